"""Packed float32 linears on the CPU (model/packed_linear.py: the row kernel, else oneDNN): same results as
F.linear to float32 rounding, a row's bits independent of the rows sharing its call, the engine packs its target by
default and keeps transformers' logits, and greedy output is the same with packing on and off, speculation
included."""
import pytest
import torch
import torch.nn.functional as F

from conftest import OracleDrafter, assert_pool_free, make_llm
from leapdecode import SamplingParams
from leapdecode.model import int8_linear, packed_linear
from leapdecode.model.packed_linear import PackedLinear

pytestmark = pytest.mark.skipif(not packed_linear.available(torch.float32, "cpu"),
                                reason="this PyTorch build has no oneDNN linear")


@pytest.mark.parametrize("rows", [1, 2, 5, 17, 64])
def test_packed_linear_matches_f_linear(rows):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 80, generator=g), torch.randn(96, generator=g)
    x = torch.randn(rows, 80, generator=g)
    layer = PackedLinear(w, b)
    torch.testing.assert_close(layer(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer(x.view(1, rows, 80)), F.linear(x, w, b).view(1, rows, 96), rtol=1e-5,
                               atol=1e-5)
    assert torch.equal(layer.weight, w)               # packing only reorders: the dense copy is exact
    # a row's result does not depend on the rows sharing the call (verification vs plain decoding)
    assert torch.equal(layer(x[:1]), layer(x)[:1])


def test_row_kernel_is_exact_and_row_independent():
    """The row kernel: within float32 rounding of a float64 reference, bias or not, 5 and 7 blocks of 16 outputs
    (tails of the 4-block groups), an odd number of inputs, and each row's bits the same whichever rows share its
    call (`row_independent`'s calls of 1-17 rows from 23 leave every remainder after the 6-row tiles)."""
    from leapdecode.model.int4_linear import row_independent
    mod = packed_linear._build_rows()
    if mod is None:
        pytest.skip("the row kernel does not build on this machine (no compiler, or no AVX-512): oneDNN serves")
    assert packed_linear.rows_kernel() is not None      # built, so its start-up check must pass
    g = torch.Generator().manual_seed(1)
    for n, k in ((80, 37), (112, 64)):
        w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        packed = packed_linear.pack_rows(w)
        x = torch.randn(23, k, generator=g)
        for bias in (b, torch.empty(0)):
            ref = F.linear(x.double(), w.double(), bias.double() if bias.numel() else None).float()
            torch.testing.assert_close(mod.rows_linear(x, packed, bias), ref, rtol=1e-5, atol=1e-4)
            assert row_independent(lambda rows: mod.rows_linear(rows.contiguous(), packed, bias), k, max_rows=23), \
                (n, k, bias.numel())
    # the model's layers take the row kernel wherever it serves float32 weights (AVX-512; AVX2: oneDNN) and the
    # output features allow it
    assert PackedLinear(torch.randn(96, 80)).kernel == ("rows" if packed_linear.float_rows() else "oneDNN")
    assert PackedLinear(torch.randn(100, 80)).kernel == "oneDNN"


def test_weights_on_gguf_grids_run_from_their_codes_with_the_float_bits():
    """Weights that are dequantized 4- and 8-bit GGUF blocks (Q4_0 with scales of both signs, Q4_1, Q8_0) are read
    from their codes (rows_q4 / rows_q8: ~5 and ~8.5 bits a weight instead of 32) and give the float32 row
    kernel's results bit for bit, for 1 to 40 rows (one tile up to 18 rows, over 4, 2 or 1 blocks of 16 outputs
    with their tails, and slabs rebuilt once beyond),
    bias or not; the dense copy is the weight itself. A float weight keeps the float form. Fails if the grid forms
    are never taken or rebuild any weight or sum differently."""
    gguf = pytest.importorskip("gguf")
    mod = packed_linear.rows_kernel()
    if mod is None:
        pytest.skip("no row kernel here (no compiler, or neither AVX-512 nor AVX2)")
    Q = gguf.GGMLQuantizationType
    g = torch.Generator().manual_seed(3)
    for qtype, kind in ((Q.Q4_0, "rows_q4"), (Q.Q4_1, "rows_q4"), (Q.Q8_0, "rows_q8")):
        for n, k in ((80, 64), (112, 96)):
            x = torch.randn(n, k, generator=g).numpy()
            w = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(x, qtype), qtype).reshape(n, k).copy())
            for bias in (torch.randn(n, generator=g), None):
                grid = PackedLinear(w, bias)
                assert grid.kernel == kind, qtype
                assert torch.equal(grid.weight, w)
                rows = torch.randn(40, k, generator=g)
                # the float32 tiles over the dense weight (on AVX2 layers keep oneDNN for float32 weights, but the
                # tiles are there)
                packed, b = packed_linear.pack_rows(w), packed_linear.ABSENT if bias is None else bias
                for m in (1, 2, 5, 6, 7, 9, 12, 13, 17, 18, 19, 40):
                    ref = mod.rows_linear(rows[:m].contiguous(), packed, b)
                    assert torch.equal(grid(rows[:m]), ref), (qtype.name, n, k, m)
    float_kind = "rows" if packed_linear.float_rows() else "oneDNN"
    assert PackedLinear(torch.randn(96, 64, generator=g)).kernel == float_kind


def test_int8_activations_on_grid_codes_match_their_dequantized_product():
    """quantization="int8_activations" (rows_q4a8 / rows_q8a8, LOSSY): each row's inputs as int8 per group of 32
    (d = max|x| / 127, codes round(x / d)) times the 4- or 8-bit codes. The result is the float64 product of the
    dequantized inputs and the weight (to float32 rounding), not the float inputs' product; a row's bits do not
    depend on the rows sharing its call (1 to 40 rows: tiles of 1-3 rows over 4, 3, 2, 1 blocks, of 4-6 over pairs);
    the codes' layout round-trips. Fails with the float path (off by the inputs' quantization) or a wrong layout,
    scale, level or Q8 offset."""
    gguf = pytest.importorskip("gguf")
    if packed_linear.a8_kernel() is None:
        pytest.skip("no AVX-512 VNNI row kernel here")
    Q = gguf.GGMLQuantizationType
    g = torch.Generator().manual_seed(4)
    for qtype, kind in ((Q.Q4_0, "rows_q4a8"), (Q.Q4_1, "rows_q4a8"), (Q.Q8_0, "rows_q8a8")):
        for n, k in ((80, 64), (112, 96), (48, 160)):
            x = torch.randn(n, k, generator=g).numpy()
            w = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(x, qtype), qtype).reshape(n, k).copy())
            form = packed_linear.grid_form(w)
            back = packed_linear.a8_grid(*packed_linear.a8_form(*form), k)
            assert torch.equal(back[0], form[0]) and torch.equal(back[1], form[1])
            for bias in (torch.randn(n, generator=g), None):
                layer = PackedLinear(w, bias, activations="int8")
                assert layer.kernel == kind and torch.equal(layer.weight, w)
                rows = torch.randn(40, k, generator=g) * torch.rand(40, k // 32, 1, generator=g).repeat_interleave(
                    32, 1).view(40, k) * 4
                rows[3, :32] = 0                                   # a group of zeros (scale 0)
                step = rows.view(40, -1, 32).abs().amax(-1, keepdim=True) / 127
                inv = torch.where(step != 0, 1 / step, torch.zeros_like(step))
                deq = (torch.round(rows.view(40, -1, 32) * inv) * step.double()).view(40, k)
                ref = F.linear(deq, w.double(), None if bias is None else bias.double()).float()
                full = layer(rows)
                torch.testing.assert_close(full, ref, rtol=1e-5, atol=1e-4)
                assert not torch.allclose(full, PackedLinear(w, bias)(rows), rtol=1e-5, atol=1e-4)
                for m in (1, 2, 3, 4, 5, 6, 7, 9, 12, 13, 17, 40):
                    assert torch.equal(layer(rows[:m]), full[:m]), (qtype.name, n, k, m)
    float_kind = "rows" if packed_linear.float_rows() else "oneDNN"
    assert PackedLinear(torch.randn(32, 64, generator=g), activations="int8").kernel == float_kind   # as it was


def test_int8_linear_takes_the_row_kernel_for_few_rows():
    """Int8Linear (drafters' weights, model/int8_linear.py): up to ROWS_MAX rows through the row kernel's int8 form,
    which keeps the inputs float, so it computes the float matmul of the dequantized weights to float32 rounding;
    more rows through fbgemm (inputs quantized: within int8 error only). Fails with the int8 form off (fbgemm's
    input quantization is ~1e-2 off the dequantized reference) or with a wrong scale, bias or tail of blocks."""
    if packed_linear.float_rows() is None:
        pytest.skip("no AVX-512 row kernel on this machine (no compiler, or AVX2 at most): fbgemm serves")
    g = torch.Generator().manual_seed(2)
    for n, k in ((80, 37), (112, 64)):
        w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        for bias in (b, None):
            layer = int8_linear.Int8Linear(w, bias)
            assert layer.kernel == "rows"
            scale = (w.abs().amax(1) / 127.0).double()
            dequant = torch.round(w.double() / scale[:, None]).clamp(-127, 127) * scale[:, None]
            for rows in range(1, layer.ROWS_MAX + 3):
                x = torch.randn(rows, k, generator=g)
                ref = F.linear(x.double(), dequant, None if bias is None else bias.double()).float()
                if rows <= layer.ROWS_MAX:
                    torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-4)
                    torch.testing.assert_close(layer(x.view(1, rows, k)), ref.view(1, rows, n), rtol=1e-5,
                                               atol=1e-4)
                elif int8_linear._fbgemm_works():
                    assert (layer(x) - ref).abs().max() < 0.05 * ref.abs().max()
    assert int8_linear.Int8Linear(torch.randn(100, 80)).kernel == "fbgemm"   # outputs not a multiple of 16


def test_engine_packs_by_default_and_keeps_transformers_logits(llama_dir):
    import transformers
    llm = make_llm(llama_dir)
    runner = llm.engine.runner
    model = runner.model
    names = int8_linear.linear_names(model.layers)
    assert runner.num_packed_linears == len(names) + 1 > 1
    assert all(isinstance(model.layers.get_submodule(n), PackedLinear) for n in names)
    assert model.output_head.packed_logits is not None
    prompt = list(range(5, 40))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    ref = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + list(out.token_ids)])).logits[0]
    # every generated token is transformers' argmax at its position, and its logprob matches
    ref_tokens = logits[len(prompt) - 1:-1].argmax(-1).tolist()
    assert list(out.token_ids) == ref_tokens
    ref_lp = torch.log_softmax(logits[len(prompt) - 1:-1].double(), -1)
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert abs(lp[tok] - ref_lp[i, tok].item()) < 1e-4
    llm.close()


def test_greedy_identical_packed_and_unpacked_with_speculation(llama_dir):
    prompts = [[3 + (7 * i + j) % 50 for j in range(20)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def run(packed, drafter=None):
        spec = None if drafter is None else {"drafter": drafter, "num_speculative_tokens": 4, "adaptive": False}
        llm = make_llm(llama_dir, cpu_packed_linears=packed, speculative_config=spec)
        assert (llm.engine.runner.num_packed_linears > 0) == packed
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if drafter is not None:          # tree drafts verified, some rejected (a wrong sibling, wrong tokens)
            assert llm.engine.stats["accepted_tokens"] > 0 and llm.engine.stats["draft_tokens"] > \
                llm.engine.stats["accepted_tokens"]
        assert_pool_free(llm)
        llm.close()
        return out

    plain = run(False)
    assert run(True) == plain
    truth = {tuple(p): [r] for p, r in zip(prompts, plain)}
    for packed in (False, True):
        assert run(packed, OracleDrafter(truth, wrong_every=3, tree=True)) == plain


def test_explicit_packing_off_a_float32_cpu_is_an_error(llama_dir):
    with pytest.raises(ValueError, match="cpu_packed_linears"):
        make_llm(llama_dir, dtype="bfloat16", cpu_packed_linears=True)
