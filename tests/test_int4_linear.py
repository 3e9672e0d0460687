"""4-bit weights on the CPU (model/int4_linear.py, ``quantization="int4"``): a 4-bit GGUF's blocks are kept
exactly, the layer computes x W^T of its own weights to bfloat16 rounding with each row independent of the others
in its call, the engine's logits stay close to the float model's, and greedy output is the same with speculation
on and off."""
import numpy as np
import pytest
import torch

from conftest import OracleDrafter, assert_pool_free, make_llm
from leapdecode import SamplingParams
from leapdecode.model import int4_linear
from leapdecode.model.int4_linear import GROUP, BF16Linear, Int4Linear, grid_codes

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not int4_linear.available(), reason="this PyTorch build has no CPU int4 kernel")
Q = gguf.GGMLQuantizationType


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LEAPDECODE_CACHE_DIR", str(tmp_path / "cache"))


def _dequantized(qtype, rows=48, cols=256, seed=0) -> np.ndarray:
    """A random matrix through the gguf package's own quantizer and dequantizer (the reference)."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).reshape(rows, cols)


def _rebuilt(codes, scale, zero) -> torch.Tensor:
    n, k = codes.shape
    return ((codes.double() - 8).reshape(n, k // GROUP, GROUP) * scale.double()[..., None]
            + zero.double()[..., None]).reshape(n, k)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_4bit_gguf_blocks_are_kept_exactly(qtype):
    w = _dequantized(qtype)
    codes, scale, zero, exact = grid_codes(torch.from_numpy(w))
    assert exact == w.size // GROUP
    assert int(codes.min()) >= 0 and int(codes.max()) <= 15
    assert torch.equal(_rebuilt(codes, scale, zero).float(), torch.from_numpy(w))


def test_other_weights_are_requantized_within_half_a_step():
    w = torch.from_numpy(_dequantized(Q.Q8_0))
    codes, scale, zero, exact = grid_codes(w)
    assert exact == 0                     # 8-bit blocks hold more than 16 levels: requantized (lossy)
    err = (_rebuilt(codes, scale, zero) - w.double()).abs().reshape(w.shape[0], -1, GROUP).amax(-1)
    assert bool((err <= scale.double() / 2 + 1e-6).all())
    flat = torch.full((16, 64), 0.25)     # constant groups are exact too
    assert grid_codes(flat)[3] == 2 * 16 and torch.equal(_rebuilt(*grid_codes(flat)[:3]).float(), flat)


@pytest.mark.parametrize("rows", [1, 2, 5, 17, 64])
def test_int4_linear_computes_its_weight(rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.from_numpy(_dequantized(Q.Q4_1, rows=96, cols=128, seed=rows))
    b = torch.randn(96, generator=g)
    layer, exact = Int4Linear.from_float(w, b)
    assert exact == 96 * 128 // GROUP
    x = torch.randn(rows, 128, generator=g)
    # reference: bfloat16 inputs, the file's weights with scale and zero rounded to bfloat16, float64 sums
    codes, scale, zero, _ = grid_codes(w)
    ref_w = _rebuilt(codes, scale.bfloat16().float(), zero.bfloat16().float())
    ref = x.bfloat16().double() @ ref_w.t() + b.double()
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (rows, 96)
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=2e-2)     # the output is rounded to bfloat16
    torch.testing.assert_close(layer(x.view(1, rows, 128)), out.view(1, rows, 96))
    torch.testing.assert_close(layer.weight.double(), ref_w, rtol=1e-2, atol=1e-2)
    # a row's result does not depend on the rows sharing the call (verification vs plain decoding)
    assert torch.equal(layer(x[:1]), out[:1])
    assert int4_linear.row_independent(layer, 128)


def test_row_independence_probe_catches_a_dependent_kernel():
    layer = BF16Linear(torch.randn(64, 64))
    assert int4_linear.row_independent(layer, 64)
    assert not int4_linear.row_independent(lambda x: layer(x) + x.mean(0, keepdim=True)[:, :64], 64)


def _tiny_q4_gguf(tiny_dir, tmp_path) -> str:
    from test_gguf import write_gguf
    return write_gguf(tiny_dir("llama"), str(tmp_path / "tiny-q4_0.gguf"), Q.Q4_0)


def test_engine_quantizes_the_layers_and_stays_close_to_the_float_model(tiny_dir, tmp_path):
    path = _tiny_q4_gguf(tiny_dir, tmp_path)
    prompt = list(range(5, 45))
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)

    def prompt_logprobs(llm):
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        return np.array([e[t] for e, t in zip(out.prompt_logprobs[1:], prompt[1:])])

    ref_llm = make_llm(path)
    ref = prompt_logprobs(ref_llm)
    assert ref_llm.engine.runner.quantized["int4"] == 0
    ref_llm.close()
    llm = make_llm(path, quantization="int4")
    q = llm.engine.runner.quantized
    layers = llm.engine.runner.model.layers
    names = [n for n, m in layers.named_modules() if isinstance(m, Int4Linear)]
    assert q["int4"] == len(names) == 4 * len(layers) and q["kept_float"] == 0, names
    assert q["exact_groups"] == q["groups"] > 0          # every Q4_0 block of the file kept as it is
    assert q["bf16_head"] == 1 and isinstance(llm.engine.runner.model.output_head.packed_logits, BF16Linear)
    assert llm.engine.runner.backend.exact == "always"    # exact attention (tests/test_step.py: why)
    ours = prompt_logprobs(llm)
    assert not np.array_equal(ours, ref)                 # the int4 path is what ran
    # bfloat16 activations on a tiny random model: each log-probability within a few hundredths on average
    diff = np.abs(ours - ref)
    assert diff.mean() < 0.05 and diff.max() < 0.3 and abs(ours.mean() - ref.mean()) < 0.02, diff
    assert_pool_free(llm)
    llm.close()


def test_greedy_identical_with_speculation_under_int4(tiny_dir, tmp_path):
    path = _tiny_q4_gguf(tiny_dir, tmp_path)
    prompts = [[3 + (7 * i + j) % 50 for j in range(20)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def run(drafter=None):
        spec = None if drafter is None else {"drafter": drafter, "num_speculative_tokens": 4, "adaptive": False}
        llm = make_llm(path, quantization="int4", speculative_config=spec)
        assert llm.engine.runner.quantized["int4"] > 0
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if drafter is not None:          # tree drafts verified, some rejected (a wrong sibling, wrong tokens)
            stats = llm.engine.stats
            assert stats["accepted_tokens"] > 0 and stats["draft_tokens"] > stats["accepted_tokens"]
        assert_pool_free(llm)
        llm.close()
        return out

    plain = run()
    truth = {tuple(p): [r] for p, r in zip(prompts, plain)}
    assert run(OracleDrafter(truth, wrong_every=3, tree=True)) == plain
    assert run(OracleDrafter(truth, wrong_every=2)) == plain


def test_bad_quantization_is_a_clear_error(llama_dir):
    from leapdecode.config import EngineConfig
    with pytest.raises(ValueError, match="quantization must be one of"):
        make_llm(llama_dir, quantization="int3")
    for kw in ({"device": "cuda"}, {"tensor_parallel_size": 2}):
        with pytest.raises(ValueError, match="quantization='int4' runs on a CPU without tensor parallelism"):
            EngineConfig(model=llama_dir, quantization="int4", **kw)


def test_cli_flag_builds_an_int4_engine(tiny_dir, tmp_path):
    from leapdecode.cli import _make_llm, build_parser
    path = _tiny_q4_gguf(tiny_dir, tmp_path)
    args = build_parser().parse_args(["generate", "--model", path, "--max-model-len", "128", "--quantization", "int4",
                                      "hello"])
    llm = _make_llm(args)
    assert llm.engine.cfg.quantization == "int4" and llm.engine.runner.quantized["int4"] > 0
    llm.close()
    assert build_parser().parse_args(["serve"]).quantization is None


def test_opting_out_of_exact_attention_under_int4_warns_when_speculating(llama_dir):
    from leapdecode.config import EngineConfig
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    with pytest.warns(UserWarning, match="speculation's greedy output can differ"):
        EngineConfig(model=llama_dir, quantization="int4", batch_invariant=False, speculative_config=spec)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        EngineConfig(model=llama_dir, quantization="int4", speculative_config=spec)
        EngineConfig(model=llama_dir, quantization="int4", batch_invariant=False)
