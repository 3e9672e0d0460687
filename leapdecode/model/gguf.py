"""GGUF files (what llama.cpp and Ollama keep on disk) -> the same things a Hugging Face directory gives us.

A GGUF holds the architecture's numbers, the tokenizer (vocabulary, merges, special ids, chat template) and the
tensors, quantized or not, under llama.cpp's names. We read it with the ``gguf`` package:

- the metadata becomes a Hugging Face style config dict, then our ``ModelConfig`` (``gguf_config_dict``);
- tensors are dequantized at load to float32 (``gguf.quants.dequantize``), renamed to the Hugging Face names the
  safetensors path understands, and, for the llama architecture, q/k rows are put back in Hugging Face's order
  (llama.cpp's converter interleaves the two rotary halves of each head; ``_unpermute_rows`` undoes it);
- the tokenizer is built by transformers' own GGUF conversion (it knows llama.cpp's tokenizer types).

Reading a GGUF is slow in pure Python (the reader parses every vocabulary string; dequantizing is numpy work), so
the first load writes what it found to a cache directory keyed by the file's content (its size and a hash of
sampled bytes, so the same file installed in another virtual environment or clone shares one conversion):
``config.json``, ``generation_config.json``, the tokenizer files and the fused weights in the dtype used
(``weights-<dtype>.safetensors``). Later loads read only those. ``LEAPDECODE_CACHE_DIR`` moves the cache
(default ``~/.cache/leapdecode``); ``LEAPDECODE_GGUF_CACHE=0`` turns it off; weights larger than
``LEAPDECODE_GGUF_CACHE_MAX_GB`` (default 4) are never cached.

Only light modules are imported at the top: ``gguf`` and ``transformers`` are imported where they are needed.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import shutil
import tempfile
from typing import Any, Iterator

import numpy as np

# llama.cpp architecture name -> (our architecture, whether its converter permuted q/k rows)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "mistral": ("MistralForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}

CACHE_FORMAT = 1   # bump when what the cache holds changes

# llama.cpp's per-layer tensor name -> Hugging Face's (under model.layers.N.)
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def is_gguf(path: str | os.PathLike | None) -> bool:
    return path is not None and str(path).lower().endswith(".gguf")


# -- reading the file --------------------------------------------------------------------------------------------

def _stat_key(path: str) -> tuple[str, int, int]:
    if not os.path.isfile(path):
        raise ValueError(f"GGUF file {path!r} does not exist")
    st = os.stat(path)
    return os.path.realpath(path), st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=4)
def _open(real_path: str, size: int, mtime_ns: int):
    """GGUFReader for the file, checked: readable, not truncated, every tensor inside the file."""
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - gguf is a dependency
        raise ValueError("reading GGUF files needs the 'gguf' package: pip install gguf") from e
    try:
        reader = gguf.GGUFReader(real_path)
    except Exception as e:
        raise ValueError(f"GGUF file {real_path!r} ({size} bytes) is truncated or corrupt: could not read its "
                         f"header and tensor table ({type(e).__name__}: {e})") from e
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ValueError(f"GGUF file {real_path!r} is truncated: tensor {t.name!r} ends at byte "
                             f"{t.data_offset + t.n_bytes}, the file has {size} bytes")
    return reader


def open_gguf(path: str):
    return _open(*_stat_key(path))


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


# -- config ------------------------------------------------------------------------------------------------------

def gguf_config_dict(path: str) -> dict[str, Any]:
    """The file's architecture metadata as a Hugging Face config dict (what ModelConfig.from_hf reads)."""
    reader = open_gguf(path)
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF file {path!r} has architecture {arch!r}, which leapdecode does not support; "
                         f"supported GGUF architectures: {', '.join(ARCHITECTURES)}")
    hf_arch, _ = ARCHITECTURES[arch]

    def need(key: str):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"GGUF file {path!r} lacks the metadata key {arch}.{key!s}")
        return value

    names = {t.name for t in reader.tensors}
    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    kv_heads = _field(reader, f"{arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):   # some files give one count per layer
        if len(set(kv_heads)) != 1:
            raise ValueError(f"GGUF file {path!r} has a different number of KV heads per layer ({kv_heads}); "
                             "not supported")
        kv_heads = kv_heads[0]
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else _tensor_shape(reader, "token_embd.weight")[0]
    rope_theta = float(_field(reader, f"{arch}.rope.freq_base", 10000.0))
    rope_scaling = _rope_scaling(reader, arch, path, head_dim, rope_theta)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eos_ids = [int(eos)] if eos is not None else []
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    if eot is not None and int(eot) not in eos_ids:
        eos_ids.append(int(eot))
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    raw: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                       "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}[hf_arch],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names and hf_arch not in ("Qwen2ForCausalLM",),
        "mlp_bias": "blk.0.ffn_up.bias" in names,
        "torch_dtype": _natural_dtype(reader),
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
        "bos_token_id": int(bos) if bos is not None else None,
    }
    window = _field(reader, f"{arch}.attention.sliding_window")
    if window:
        raw["sliding_window"] = int(window)
    if "blk.0.attn_output.bias" in names and not raw["attention_bias"]:
        raise ValueError(f"GGUF file {path!r} has an attention output bias without q/k/v biases; not supported")
    return raw


def _tensor_shape(reader, name: str) -> tuple[int, ...]:
    for t in reader.tensors:
        if t.name == name:
            return tuple(int(x) for x in reversed(t.shape))
    raise ValueError(f"GGUF file has no tensor {name!r}")


def _natural_dtype(reader) -> str:
    """The dtype `dtype="auto"` means on a GPU: the file's own float type, bfloat16 for quantized weights."""
    import gguf
    types = {t.tensor_type for t in reader.tensors if len(t.shape) > 1}
    Q = gguf.GGMLQuantizationType
    if types <= {Q.F32}:
        return "float32"
    if types <= {Q.F32, Q.F16}:
        return "float16"
    return "bfloat16"


def _rope_scaling(reader, arch: str, path: str, head_dim: int, theta: float) -> dict | None:
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        if any(t.name == "rope_freqs.weight" for t in reader.tensors):
            return _llama3_scaling_from_freqs(reader, path, head_dim, theta)
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(_field(reader, f"{arch}.rope.scaling.factor"))}
    raise ValueError(f"GGUF file {path!r} uses rope scaling {kind!r}; leapdecode supports linear and Llama-3 "
                     "(rope_freqs) scaling")


def _llama3_scaling_from_freqs(reader, path: str, head_dim: int, theta: float) -> dict:
    """Llama 3.1/3.2 files store the per-frequency divisors (rope_freqs) instead of the scaling parameters.

    We find the standard Llama-3 parameters that give exactly those divisors, or refuse the file."""
    import torch
    from leapdecode.model.layers import rope_inv_freq
    t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    freqs = torch.from_numpy(_dequantize(t).reshape(-1).copy())
    base = rope_inv_freq(head_dim, theta, None)
    factor = float(freqs.max())
    for old_len in (8192, 4096, 2048, 16384, 32768):
        for lo, hi in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0)):
            scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": lo, "high_freq_factor": hi,
                       "original_max_position_embeddings": old_len}
            if len(freqs) == len(base) and torch.allclose(rope_inv_freq(head_dim, theta, scaling), base / freqs,
                                                          rtol=1e-4, atol=0):
                return scaling
    raise ValueError(f"GGUF file {path!r} has rope frequency factors (rope_freqs.weight) that match no Llama-3 "
                     "rope scaling leapdecode knows")


def gguf_generation_config(path: str) -> dict[str, Any]:
    """generation_config.json's equivalent: eos ids, and llama.cpp's general.sampling.* defaults when present."""
    reader = open_gguf(path)
    raw: dict[str, Any] = {}
    eos = [_field(reader, "tokenizer.ggml.eos_token_id"), _field(reader, "tokenizer.ggml.eot_token_id")]
    eos = [int(e) for e in eos if e is not None]
    if eos:
        raw["eos_token_id"] = sorted(set(eos))
    for theirs, ours in (("temp", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("min_p", "min_p")):
        value = _field(reader, f"general.sampling.{theirs}")
        if value is not None:
            raw[ours] = value
    return raw


# -- tensors -----------------------------------------------------------------------------------------------------

def _dequantize(t) -> np.ndarray:
    import gguf
    try:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise ValueError(_unsupported_type_message(t)) from e
    return np.asarray(w, dtype=np.float32).reshape([int(x) for x in reversed(t.shape)])


def supported_quant_types() -> list[str]:
    import gguf
    Q = gguf.GGMLQuantizationType
    types = {Q.F32, Q.F16} | set(gguf.quants._type_traits)
    return sorted(q.name for q in types)


def _unsupported_type_message(t) -> str:
    return (f"tensor {t.name!r} is stored as {t.tensor_type.name}, a GGUF type leapdecode cannot dequantize; "
            f"supported types: {', '.join(supported_quant_types())}")


def check_tensor_types(path: str) -> None:
    import gguf
    Q = gguf.GGMLQuantizationType
    ok = {Q.F32, Q.F16} | set(gguf.quants._type_traits)
    for t in open_gguf(path).tensors:
        if t.tensor_type not in ok:
            raise ValueError(f"GGUF file {path!r}: " + _unsupported_type_message(t))


def hf_name(gguf_name: str) -> str | None:
    """llama.cpp tensor name -> Hugging Face name (None for tensors we do not load, e.g. rope_freqs)."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    if parts[0] == "rope_freqs":
        return None
    raise ValueError(f"GGUF tensor {gguf_name!r} is not part of any architecture leapdecode supports")


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order for the llama architecture.

    Hugging Face keeps each head's rows as [first rotary half | second half]; llama.cpp stores the pairs
    interleaved (row 2i is HF row i, row 2i+1 is HF row i + D/2), to match its own rotary kernel. Going back:
    view each head as [D/2, 2] and transpose to [2, D/2].
    """
    rows = w.shape[0]
    head_dim = rows // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_tensors(path: str, raw_cfg: dict[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    """(Hugging Face name, float32 array in Hugging Face layout) for every tensor of the file, one at a time."""
    reader = open_gguf(path)
    check_tensor_types(path)
    arch = _field(reader, "general.architecture")
    permuted = ARCHITECTURES[arch][1]
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        w = _dequantize(t)
        if permuted and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            w = _unpermute_rows(w, raw_cfg["num_attention_heads"])
        elif permuted and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            w = _unpermute_rows(w, raw_cfg["num_key_value_heads"])
        yield name, w


# -- the cache ---------------------------------------------------------------------------------------------------

def cache_root() -> str:
    return os.environ.get("LEAPDECODE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "leapdecode")


def cache_enabled() -> bool:
    return os.environ.get("LEAPDECODE_GGUF_CACHE", "1") not in ("0", "false", "no", "off")


def cache_dir(path: str) -> str:
    """Where this file's converted config, tokenizer and weights live: keyed by its content (:func:`_content_key`).
    Keyed by path and mtime, every clean clone's install of the default model converted it again: 38 copies of
    540 MB on one development machine."""
    real, size, mtime = _stat_key(path)
    stem = os.path.splitext(os.path.basename(real))[0][:60]
    return os.path.join(cache_root(), "gguf", f"{stem}-{_content_key(real, size, mtime)}")


_SAMPLE = 1 << 16       # bytes read at each of _SAMPLES evenly spaced offsets, besides the first and last MiB
_SAMPLES = 16


@functools.lru_cache(maxsize=16)
def _content_key(real_path: str, size: int, mtime_ns: int) -> str:
    """sha256 of the cache format, the size, the first and last MiB (header and metadata; the last tensors) and 16
    samples of 64 KiB in between (the weights of a fine-tune with the same tokenizer and size differ there): 3 MiB
    read, not the file. (Path and mtime only key the memo.)"""
    h = hashlib.sha256(f"{CACHE_FORMAT}|{size}|".encode())
    with open(real_path, "rb") as f:
        h.update(f.read(1 << 20))
        for i in range(1, _SAMPLES + 1):
            f.seek(size * i // (_SAMPLES + 1))
            h.update(f.read(_SAMPLE))
        f.seek(max(size - (1 << 20), 0))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:24]


def _write_json_atomic(path: str, obj: Any) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def _cached_json(path: str, name: str, make) -> dict[str, Any]:
    if not cache_enabled():
        return make(path)
    file = os.path.join(cache_dir(path), name)
    if os.path.isfile(file):
        try:
            with open(file, encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            pass
    value = make(path)
    try:
        _write_json_atomic(file, value)
    except OSError:
        pass   # a read-only home is fine: we just convert again next time
    return value


def load_config_dict(path: str) -> dict[str, Any]:
    return _cached_json(path, "config.json", gguf_config_dict)


def load_generation_config(path: str) -> dict[str, Any]:
    return _cached_json(path, "generation_config.json", gguf_generation_config)


def load_tokenizer(path: str):
    """The file's tokenizer (vocabulary, merges, special tokens, chat template) via transformers' GGUF
    conversion; saved to the cache so the next start reads a tokenizer.json instead."""
    from transformers import AutoTokenizer
    tok_dir = os.path.join(cache_dir(path), "tokenizer")
    if cache_enabled() and os.path.isfile(os.path.join(tok_dir, "tokenizer_config.json")):
        try:
            return AutoTokenizer.from_pretrained(tok_dir)
        except Exception:
            pass   # a damaged cache: convert again below
    open_gguf(path)   # clear errors for a missing / truncated file before transformers' own
    real = os.path.realpath(path)
    try:
        tok = AutoTokenizer.from_pretrained(os.path.dirname(real), gguf_file=os.path.basename(real))
    except Exception as e:
        raise ValueError(f"could not build a tokenizer from the metadata of GGUF file {path!r}: {e}") from e
    if cache_enabled():
        try:   # write next to the final place, then rename: a reader never sees half a tokenizer
            os.makedirs(os.path.dirname(tok_dir), exist_ok=True)
            tmp = tempfile.mkdtemp(dir=os.path.dirname(tok_dir), prefix=".tokenizer-")
            tok.save_pretrained(tmp)
            if os.path.isdir(tok_dir):
                shutil.rmtree(tok_dir, ignore_errors=True)
            os.replace(tmp, tok_dir)
        except OSError:
            pass
    return tok


def weights_cache_file(path: str, dtype_name: str) -> str:
    return os.path.join(cache_dir(path), f"weights-{dtype_name}.safetensors")


def cache_weights_allowed(num_bytes: int) -> bool:
    limit = float(os.environ.get("LEAPDECODE_GGUF_CACHE_MAX_GB", "4")) * 2 ** 30
    return cache_enabled() and num_bytes <= limit and not math.isnan(limit)
