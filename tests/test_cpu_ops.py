"""The model's fused CPU ops (model/cpu_ops.py) against the PyTorch forms in model/layers.py: the rotary embedding
bit for bit (in place, on strided slices of a fused qkv row, int32 and int64 positions), RMSNorm within two float32
ulps and row by row the same alone as beside other rows; and the model's modules use them."""
from __future__ import annotations

import pytest
import torch

from leapdecode.model import cpu_ops, layers
from leapdecode.model.layers import RMSNorm, RotaryEmbedding, _rotate

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C++ toolchain to build model/cpu_ops.py")


def test_rms_norm_matches_the_pytorch_form_and_each_row_stands_alone(monkeypatch):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576, generator=g)
    x = torch.randn(3, 5, 576, generator=g) * 4
    x[0, 0] = 0.0                                             # an all-zero row: eps keeps it finite
    monkeypatch.setattr(layers, "FUSED_OPS", False)
    ref = norm(x)
    monkeypatch.setattr(layers, "FUSED_OPS", True)
    assert layers._fused(x) is cpu_ops
    out = norm(x)
    assert out.shape == x.shape and torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=3e-7, atol=1e-6)
    for i, j in ((0, 0), (1, 3), (2, 4)):
        assert torch.equal(norm(x[i, j:j + 1]), out[i, j:j + 1])
    strided = torch.randn(4, 1000, generator=g)[:, :576]      # a row stride that is not the row length
    torch.testing.assert_close(norm(strided), norm(strided.contiguous()), rtol=0, atol=0)


@pytest.mark.parametrize("pos_dtype", [torch.int64, torch.int32])
def test_rope_is_the_pytorch_form_to_the_bit_in_place(pos_dtype):
    g = torch.Generator().manual_seed(1)
    rope = RotaryEmbedding(64, 4096, 100000.0, None)
    qkv = torch.randn(6, (9 + 3 + 3) * 64, generator=g)
    pos = torch.tensor([0, 3, 100, 4095, 17, 17], dtype=pos_dtype)
    q, k, _ = qkv.split([576, 192, 192], -1)
    q, k = q.view(-1, 9, 64), k.view(-1, 3, 64)
    cos, sin = rope.cos[pos.long()].unsqueeze(1), rope.sin[pos.long()].unsqueeze(1)
    want_q, want_k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    assert layers._fused(q) is cpu_ops
    got_q, got_k = rope(pos, q, k)
    assert got_q.data_ptr() == q.data_ptr()                   # rotated in place, in the fused qkv row
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_other_dtypes_and_fusion_off_keep_the_pytorch_forms(monkeypatch):
    assert layers._fused(torch.zeros(2, 4, dtype=torch.bfloat16)) is None
    monkeypatch.setattr(layers, "FUSED_OPS", False)
    assert layers._fused(torch.zeros(2, 4)) is None


def test_release_openmp_threads_frees_the_calling_threads_workers():
    """native.release_openmp_threads gives back the calling thread's OpenMP worker threads (their OS threads end),
    so that one thread alone holds a pool (why: leapdecode/native.py). Run in a thread of its own so the main
    thread's pool is left as it is."""
    import os
    import threading
    import time

    from leapdecode import native
    if torch.get_num_threads() < 2 or not os.path.isdir("/proc/self/task"):
        pytest.skip("needs two intra-op threads and /proc")
    result = {}

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    def run() -> None:
        torch.ones(1 << 22).sum()              # a parallel region: this thread gets workers
        before = threads()
        result["released"] = native.release_openmp_threads()
        deadline = time.monotonic() + 10
        while threads() > before - (torch.get_num_threads() - 1) and time.monotonic() < deadline:
            time.sleep(0.01)
        result["gone"] = before - threads()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if not result["released"]:
        pytest.skip("no GNU OpenMP runtime loaded (PyTorch built with another one)")
    assert result["gone"] >= torch.get_num_threads() - 1
