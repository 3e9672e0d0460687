"""The sampler's CPU argmax (numpy's vectorised one) picks exactly what torch.argmax picks."""
import torch

from leapdecode.sampling.sampler import argmax_rows


def test_argmax_rows_matches_torch_on_ties_nan_inf_and_views():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (64, 1000), generator=g).float()          # many ties: the first maximum wins
    x[3, 17] = float("nan")                                             # NaN counts as the maximum
    x[5] = float("-inf")
    x[6, :] = float("nan")
    for t in (x, x.double(), x[:, ::3], x.t().contiguous().t()[:, :500], x[:0]):
        assert torch.equal(argmax_rows(t), t.argmax(-1)), t.shape
    assert argmax_rows(x).dtype == torch.int64
