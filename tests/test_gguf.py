"""GGUF files: tiny random Hugging Face checkpoints written as GGUF here (F32, F16, Q8_0, Q4_0, with llama.cpp's
q/k row order for the llama architecture), then loaded by leapdecode and, as the independent reference, by
transformers' own GGUF loader: same log-probabilities, same greedy tokens, same tokenizer and chat template.
Bad files (truncated, unknown architecture, a quant type nothing can dequantize) give a ValueError naming the
problem."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from leapdecode import LLM, SamplingParams  # noqa: E402
from leapdecode.model import gguf as gguf_mod  # noqa: E402

Q = gguf.GGMLQuantizationType
LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
PROMPTS = ["Once upon a time there was", "def add(a, b):\n", "The quick brown fox", '{"name": "leap"']


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LEAPDECODE_CACHE_DIR", str(tmp_path / "cache"))


def gguf_tensor_name(hf: str) -> str:
    stem, leaf = hf.rsplit(".", 1)
    if stem in TOP:
        return f"{TOP[stem]}.{leaf}"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{LAYER[rest]}.{leaf}"


def llama_cpp_row_order(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k of the llama architecture: per head, interleave the two rotary
    halves (row i of the first half, then row i of the second half)."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_dir: str, out: str, qtype: Q, arch: str | None = None, *, rope_freqs: np.ndarray | None = None,
               override_type: dict[str, Q] | None = None) -> str:
    """A Hugging Face directory -> a GGUF file, written with the gguf package's writer."""
    from safetensors.numpy import load_file
    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    arch = arch or cfg["model_type"]
    tok = json.load(open(os.path.join(hf_dir, "tokenizer.json")))
    tok_cfg = json.load(open(os.path.join(hf_dir, "tokenizer_config.json")))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads

    w = gguf.GGUFWriter(out, arch)
    w.add_name("tiny-test")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(int(qtype))

    vocab = tok["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tok["added_tokens"] if a.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab[tok_cfg["bos_token"]])
    w.add_eos_token_id(vocab[tok_cfg["eos_token"]])
    w.add_add_bos_token(False)
    template = os.path.join(hf_dir, "chat_template.jinja")
    w.add_chat_template(open(template).read() if os.path.isfile(template) else tok_cfg["chat_template"])

    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    permute = arch in ("llama", "mistral")
    for hf, t in state.items():
        name = gguf_tensor_name(hf)
        t = t.astype(np.float32)
        if permute and ".attn_q." in name:
            t = llama_cpp_row_order(t, heads)
        elif permute and ".attn_k." in name:
            t = llama_cpp_row_order(t, kv_heads)
        kind = (override_type or {}).get(name, qtype if t.ndim == 2 else Q.F32)
        if kind == Q.F32:
            w.add_tensor(name, t)
        elif kind == Q.F16:
            w.add_tensor(name, t.astype(np.float16))
        elif kind == Q.Q8_1:   # a block type the gguf package cannot dequantize: raw bytes of the right size
            nbytes = t.size // 32 * 40
            w.add_tensor(name, np.zeros((t.shape[0], nbytes // t.shape[0]), np.uint8), raw_dtype=Q.Q8_1)
        else:
            w.add_tensor(name, gguf.quants.quantize(t, kind), raw_dtype=kind)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def build_llama(path: str, tokenizer_from: str, **overrides) -> str:
    import transformers
    kw = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=1,
              num_key_value_heads=1, head_dim=64, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=0,
              eos_token_id=1, initializer_range=0.25)
    kw.update(overrides)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).float()
    model.save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(path)
    return path


def hf_gguf_model(path: str):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                             dtype=torch.float32).eval()


def hf_gguf_tokenizer(path: str):
    import transformers
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def assert_logprobs_match(llm: LLM, ref_model, tokenizer, prompt: str) -> None:
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=5), use_tqdm=False)[0]
    with torch.no_grad():
        ref = torch.log_softmax(ref_model(torch.tensor([ids])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None
    for pos in range(1, len(ids)):
        ours = out.prompt_logprobs[pos]
        assert ids[pos] in ours
        for token, lp in ours.items():
            assert lp == pytest.approx(ref[pos - 1, token].item(), abs=2e-4), (pos, token)
        top = torch.topk(ref[pos - 1], 5).indices.tolist()
        assert set(top) <= set(ours)


@pytest.mark.parametrize("arch,qtype", [("llama", Q.F32), ("llama", Q.F16), ("llama", Q.Q8_0), ("llama", Q.Q4_0),
                                        ("qwen2", Q.Q8_0), ("qwen3", Q.F16)])
def test_logprobs_and_greedy_match_transformers_gguf(tiny_dir, tmp_path, arch, qtype):
    # transformers reads no head_dim from a qwen3 GGUF (it keeps its default, 128): give the tiny model that one
    extra = {"llama": {"rope_scaling": None}, "qwen3": {"head_dim": 128}}.get(arch, {})
    hf_dir = tiny_dir(arch, **extra)
    path = write_gguf(hf_dir, str(tmp_path / f"tiny-{arch}-{qtype.name}.gguf"), qtype)
    llm = LLM(path, max_model_len=128, num_kv_blocks=64)
    ref = hf_gguf_model(path)
    tok = hf_gguf_tokenizer(path)
    assert_logprobs_match(llm, ref, tok, PROMPTS[0])
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(PROMPTS[1:], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS[1:], outs):
        ids = tok.encode(prompt, add_special_tokens=False)
        with torch.no_grad():
            gen = ref.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, min_new_tokens=10,
                               pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == gen, prompt


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0])
def test_quantized_gguf_runs_from_its_codes_with_the_float_bits(tiny_dir, tmp_path, monkeypatch, qtype):
    """A 4- or 8-bit GGUF's linears run from their codes (model/packed_linear.py's grid forms), layer by layer and
    through the one-call layer, plain and speculative: greedy tokens and every logprob equal, bit for bit, to the
    same file run from float32 copies of its weights. Fails if the grid forms are not taken."""
    from conftest import OracleDrafter
    from leapdecode.model import packed_linear
    if packed_linear.rows_kernel() is None:
        pytest.skip("no row kernel here (no compiler or no AVX-512)")
    path = write_gguf(tiny_dir("llama"), str(tmp_path / f"grid-{qtype.name}.gguf"), qtype)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    prompts = [[3 + (7 * i + j) % 50 for j in range(12 + 9 * i)] for i in range(3)]

    def run(spec=None):
        llm = LLM(path, max_model_len=128, num_kv_blocks=64, speculative_config=spec)
        kinds = {m.kernel for m in llm.engine.runner.model.modules() if isinstance(m, packed_linear.PackedLinear)}
        outs = [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in prompts]
        return kinds, [(o.token_ids, o.logprobs) for o in outs]

    kinds, plain = run()
    assert kinds == {"rows_q4" if qtype == Q.Q4_0 else "rows_q8"}, kinds
    truth = {tuple(p): [list(t)] for p, (t, _) in zip(prompts, plain)}
    spec = {"drafter": OracleDrafter(truth, wrong_every=3), "num_speculative_tokens": 4, "adaptive": False}
    assert run(spec)[1] == plain
    monkeypatch.setattr(packed_linear, "grid_form", lambda w: None)
    kinds, floats = run()
    if packed_linear.float_rows() is not None:          # (AVX2: float32 weights go through oneDNN, other bits)
        assert kinds == {"rows"} and floats == plain


def test_int8_activations_are_lossless_for_speculation_and_close_to_the_float_run(tiny_dir, tmp_path):
    """quantization="int8_activations" (LOSSY): a Q4_0 file's layers take int8 activations (rows_q4a8), layer by
    layer and through the one-call layer; speculation (drafts right and wrong) gives plain decoding's tokens and
    logprobs bit for bit in this mode; the logprobs differ from the float activations' run, but by little (a tiny
    random model: median 0.01-0.02, at most ~0.2). A float
    checkpoint is refused with a clear error. Fails with the mode ignored (the logprobs would equal the float run's)
    or with a kernel whose row results depend on the rows sharing a call."""
    from conftest import OracleDrafter
    from leapdecode.model import packed_linear
    if packed_linear.a8_kernel() is None:
        pytest.skip("no AVX-512 VNNI row kernel here")
    path = write_gguf(tiny_dir("llama"), str(tmp_path / "a8-Q4_0.gguf"), Q.Q4_0)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    prompts = [[3 + (7 * i + j) % 50 for j in range(12 + 9 * i)] for i in range(3)]

    def run(quantization, spec=None):
        llm = LLM(path, max_model_len=128, num_kv_blocks=64, speculative_config=spec, quantization=quantization)
        kinds = {m.kernel for m in llm.engine.runner.model.modules() if isinstance(m, packed_linear.PackedLinear)}
        outs = [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in prompts]
        return kinds, [(o.token_ids, o.logprobs) for o in outs]

    kinds, plain = run("int8_activations")
    assert "rows_q4a8" in kinds and not kinds & {"rows_q4", "rows_q8"}, kinds    # no grid with float activations
    truth = {tuple(p): [list(t)] for p, (t, _) in zip(prompts, plain)}
    spec = {"drafter": OracleDrafter(truth, wrong_every=3), "num_speculative_tokens": 4, "adaptive": False}
    assert run("int8_activations", spec)[1] == plain
    _, floats = run(None)
    diffs = [abs(a[t] - b[t]) for (ta, la), (tb, lb) in zip(plain, floats) for a, b in zip(la, lb)
             for t in a.keys() & b.keys()]
    assert max(diffs) > 0 and sorted(diffs)[len(diffs) // 2] < 0.05 and max(diffs) < 0.5, diffs
    with pytest.raises(ValueError, match="int8_activations.*GGUF"):
        LLM(tiny_dir("llama"), max_model_len=128, num_kv_blocks=64, quantization="int8_activations")


_A8_LINEARS = """
import gguf, torch
from leapdecode.model import packed_linear
g = torch.Generator().manual_seed(7)
linears = []
for qt in (gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0):
    x = torch.randn(80, 96, generator=g).numpy()
    w = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(x, qt), qt).reshape(80, 96).copy())
    rows = torch.randn(9, 96, generator=g) * 3
    linears.append(packed_linear.PackedLinear(w, activations="int8")(rows).tolist())
"""

_AVX2_RUN = """
import json, os, sys
import torch
from leapdecode import LLM, SamplingParams
from leapdecode.model import packed_linear
mod = packed_linear.rows_kernel()
assert mod is not None and not mod.rows_wide(), "not the AVX2 form"
assert packed_linear.PackedLinear(torch.randn(32, 64)).kernel == "oneDNN"     # float32 weights: oneDNN there
args = json.loads(sys.argv[1])
params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
result = {}
for quantization in (None, "int8_activations"):
    llm = LLM(args["path"], max_model_len=128, num_kv_blocks=64, quantization=quantization)
    kinds = sorted({m.kernel for m in llm.engine.runner.model.modules()
                    if isinstance(m, packed_linear.PackedLinear)})
    outs = [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in args["prompts"]]
    result[str(quantization)] = {"kinds": kinds, "outs": [[o.token_ids, [{str(k): v for k, v in lp.items()}
                                                                         for lp in o.logprobs]] for o in outs]}
names = {}
exec(args["linears"], names)
result["linears"] = names["linears"]
json.dump(result, open(args["out"], "w"))
"""


def test_avx2_form_of_the_row_kernel_gives_the_avx512_bits(tiny_dir, tmp_path):
    """On a machine without AVX-512 the row kernel runs its AVX2 form (two 8-lane halves per 16-output block; GGUF
    grid weights only, float32 ones keep oneDNN) and the one-call layer with it, and int8 activations run through
    vpmaddubsw instead of VNNI. Built here without AVX-512 (``LEAPDECODE_CPU_ISA=avx2``, in a subprocess), a Q4_0
    file decodes to the same tokens and logprobs, bit for bit, as the AVX-512 build in this process, with float and
    with int8 activations: every output is one FMA chain over the inputs in order whatever the vector width, and
    the integer sums are exact either way. Fails if the AVX2 form is missing (oneDNN over float weights gives other
    bits) or rebuilds, sums or scales a weight differently."""
    import json
    import subprocess
    import sys
    from leapdecode.model import packed_linear
    mod = packed_linear.rows_kernel()
    if mod is None or not mod.rows_wide():
        pytest.skip("needs the AVX-512 row kernel here, to compare the AVX2 build with")
    path = write_gguf(tiny_dir("llama"), str(tmp_path / "avx2-Q4_0.gguf"), Q.Q4_0)
    prompts = [[3 + (7 * i + j) % 50 for j in range(12 + 9 * i)] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    here = {}
    for quantization in (None, "int8_activations"):
        llm = LLM(path, max_model_len=128, num_kv_blocks=64, quantization=quantization)
        here[str(quantization)] = [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in prompts]
    out = tmp_path / "avx2.json"
    env = {**os.environ, "LEAPDECODE_CPU_ISA": "avx2"}
    run = subprocess.run([sys.executable, "-c", _AVX2_RUN, json.dumps({"path": path, "prompts": prompts,
                                                                        "out": str(out), "linears": _A8_LINEARS})],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(out.read_text())
    assert "rows_q4" in got["None"]["kinds"] and "rows_q4a8" in got["int8_activations"]["kinds"], got
    for quantization, outs in here.items():
        for o, (ids, lps) in zip(outs, got[quantization]["outs"]):
            assert o.token_ids == ids, quantization
            assert [{str(k): v for k, v in lp.items()} for lp in o.logprobs] == lps, quantization
    names = {}
    exec(_A8_LINEARS, names)                        # Q4_1 and Q8_0 (the offset codes' sign trick) linears alone
    assert names["linears"] == got["linears"]


def test_f32_gguf_equals_the_original_checkpoint(tiny_dir, tmp_path):
    """Untied lm_head, q/k row order undone: the F32 file gives the original safetensors model's numbers."""
    hf_dir = tiny_dir("llama", rope_scaling=None)
    path = write_gguf(hf_dir, str(tmp_path / "tiny.gguf"), Q.F32)
    a = LLM(path, max_model_len=128, num_kv_blocks=64)
    b = LLM(hf_dir, max_model_len=128, num_kv_blocks=64)
    assert a.engine.model_cfg.tie_word_embeddings is False
    p = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    for x, y in zip(a.generate(PROMPTS, p, use_tqdm=False), b.generate(PROMPTS, p, use_tqdm=False)):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert lx.keys() == ly.keys()
            assert all(abs(lx[k] - ly[k]) < 1e-5 for k in lx)


def test_llama3_rope_freqs_become_llama3_scaling(tiny_dir, tmp_path):
    """Llama 3.1-style files carry rope_freqs instead of scaling parameters; we recover the parameters."""
    hf_dir = tiny_dir("llama")   # llama3 rope scaling, factor 4, original length 64
    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    from leapdecode.model.layers import rope_inv_freq
    scaling = cfg.get("rope_scaling") or cfg["rope_parameters"]
    base = rope_inv_freq(16, 10000.0, None)
    freqs = (base / rope_inv_freq(16, 10000.0, {k: v for k, v in scaling.items() if k != "rope_theta"})).numpy()
    # our matcher tries the standard original lengths; this tiny model's is 64, so expect a clear refusal ...
    path = write_gguf(hf_dir, str(tmp_path / "rope.gguf"), Q.F32, rope_freqs=freqs)
    with pytest.raises(ValueError, match="rope_freqs"):
        LLM(path, max_model_len=128, num_kv_blocks=64)
    # ... and with the standard Llama 3.1 parameters, the recovered scaling gives the original model's numbers
    std = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}
    hf_std = build_llama(str(tmp_path / "llama31"), tiny_dir("llama_tied"), rope_scaling=dict(std),
                         max_position_embeddings=16384)
    freqs = (rope_inv_freq(64, 10000.0, None) / rope_inv_freq(64, 10000.0, std)).numpy()
    path = write_gguf(hf_std, str(tmp_path / "rope31.gguf"), Q.F32, rope_freqs=freqs)
    cfg = gguf_mod.gguf_config_dict(path)
    assert cfg["rope_scaling"] == std
    a = LLM(path, max_model_len=128, num_kv_blocks=64)
    b = LLM(hf_std, max_model_len=128, num_kv_blocks=64)
    p = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    assert ([o.outputs[0].token_ids for o in a.generate(PROMPTS, p, use_tqdm=False)]
            == [o.outputs[0].token_ids for o in b.generate(PROMPTS, p, use_tqdm=False)])


def test_tokenizer_and_chat_template_from_metadata(tiny_dir, tmp_path):
    import transformers
    hf_dir = tiny_dir("llama_tied")
    original = transformers.AutoTokenizer.from_pretrained(hf_dir)
    path = write_gguf(hf_dir, str(tmp_path / "tok.gguf"), Q.Q8_0)
    llm = LLM(path, max_model_len=128, num_kv_blocks=64)
    tok = llm.get_tokenizer()
    texts = PROMPTS + ["Ünïcödé text: naïve café, 東京, emoji 🎉", "<|im_start|>user\nhi<|im_end|>\n", "  spaces\n\n\ttabs"]
    for text in texts:
        ids = original.encode(text, add_special_tokens=False)
        assert tok.encode(text, add_special_tokens=False) == ids, text
        assert tok.decode(ids) == original.decode(ids)
    assert tok.eos_token == original.eos_token == "</s>"
    assert tok.bos_token == original.bos_token
    messages = [{"role": "user", "content": "What is 2+2?"}]
    expected = original.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert expected.endswith("<|im_start|>assistant\n")
    assert llm.apply_chat_template(messages) == original.encode(expected, add_special_tokens=False)
    assert llm.engine.model_cfg.tie_word_embeddings is True
    eos = original.convert_tokens_to_ids("</s>")
    assert eos in llm.engine.eos_token_ids
    # the second load reads the conversion cache (no GGUF parsing) and is identical
    cache = gguf_mod.cache_dir(path)
    assert os.path.isfile(os.path.join(cache, "weights-float32.safetensors"))
    again = LLM(path, max_model_len=128, num_kv_blocks=64)
    p = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert ([o.outputs[0].token_ids for o in llm.generate(PROMPTS, p, use_tqdm=False)]
            == [o.outputs[0].token_ids for o in again.generate(PROMPTS, p, use_tqdm=False)])
    assert again.get_tokenizer().encode(texts[4], add_special_tokens=False) == original.encode(
        texts[4], add_special_tokens=False)
    assert again.apply_chat_template(messages) == llm.apply_chat_template(messages)


def test_conversion_cache_is_keyed_by_content_not_path(tiny_dir, tmp_path):
    """The same file at another path with another mtime (the default model installed in a fresh clone's virtual
    environment) shares one cache entry; a different file of the same size does not."""
    import shutil
    import time
    a = write_gguf(tiny_dir("llama_tied"), str(tmp_path / "a.gguf"), Q.Q8_0)
    os.makedirs(tmp_path / "elsewhere")
    time.sleep(0.01)
    b = shutil.copy(a, tmp_path / "elsewhere" / "a.gguf")
    assert os.stat(a).st_mtime_ns != os.stat(b).st_mtime_ns
    assert gguf_mod.cache_dir(a) == gguf_mod.cache_dir(str(b))
    data = bytearray(open(a, "rb").read())
    data[-10] ^= 0xFF                         # one byte of the last tensor's data
    c = tmp_path / "c.gguf"
    c.write_bytes(bytes(data))
    assert gguf_mod.cache_dir(str(c)) != gguf_mod.cache_dir(a)


def test_truncated_file_is_a_clear_error(tiny_dir, tmp_path):
    path = write_gguf(tiny_dir("llama_tied"), str(tmp_path / "whole.gguf"), Q.F32)
    data = open(path, "rb").read()
    for keep in (len(data) // 2, len(data) - 100, 200):
        cut = tmp_path / f"cut-{keep}.gguf"
        cut.write_bytes(data[:keep])
        with pytest.raises(ValueError, match="truncated"):
            LLM(str(cut), max_model_len=128, num_kv_blocks=64)


def test_missing_file_and_unknown_architecture(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope.gguf"))
    path = str(tmp_path / "gpt2.gguf")
    w = gguf.GGUFWriter(path, "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"architecture 'gpt2'.*supported GGUF architectures: llama"):
        LLM(path)


def test_unsupported_quant_type_is_named(tiny_dir, tmp_path):
    path = write_gguf(tiny_dir("llama_tied"), str(tmp_path / "q81.gguf"), Q.F32,
                      override_type={"blk.0.ffn_up.weight": Q.Q8_1})
    with pytest.raises(ValueError, match=r"'blk.0.ffn_up.weight' is stored as Q8_1.*supported types: .*Q4_K"):
        LLM(path, max_model_len=128, num_kv_blocks=64)


def test_tensor_names_and_row_order_helpers():
    assert gguf_mod.hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert gguf_mod.hf_name("output.weight") == "lm_head.weight"
    assert gguf_mod.hf_name("rope_freqs.weight") is None
    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(32, 3)
    assert np.array_equal(gguf_mod._unpermute_rows(llama_cpp_row_order(w, 4), 4), w)
    with pytest.raises(ValueError, match="not part of any architecture"):
        gguf_mod.hf_name("blk.0.ssm_conv1d.weight")
