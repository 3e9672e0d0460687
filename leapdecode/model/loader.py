"""Hugging Face directory or GGUF file -> (ModelConfig, model with weights, tokenizer, generation defaults).

Every public function takes either a Hugging Face directory or a path ending in ``.gguf`` (see model/gguf.py).
The model is built on the meta device and materialised once on the target device and dtype; each safetensors
tensor is then copied straight into its final place (a slice of a fused projection where we fuse), so a checkpoint
never sits in memory twice. Under tensor parallelism each rank builds only its shard and copies only its slices of
each tensor (``checkpoint_slices`` of the layers in model/parallel_layers.py).
"""
from __future__ import annotations

import contextlib
import json
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open

from leapdecode.attention.backend import AttentionBackend
from leapdecode.distributed.parallel_state import SINGLE, ParallelState
from leapdecode.model import gguf as gguf_file
from leapdecode.model.config import ModelConfig
from leapdecode.model.llama import LlamaForCausalLM
from leapdecode.model.parallel_layers import Slice


@dataclass
class GenerationDefaults:
    """generation_config.json: extra eos ids and the sampling defaults the model's authors recommend."""
    eos_token_id: list[int]
    sampling: dict[str, Any]


def _read_json(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_model_config(model_dir: str) -> ModelConfig:
    if gguf_file.is_gguf(model_dir):
        return ModelConfig.from_hf(gguf_file.load_config_dict(model_dir))
    if not os.path.isdir(model_dir):
        raise ValueError(f"model directory {model_dir!r} does not exist")
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"model directory {model_dir!r} has no config.json")
    return ModelConfig.from_hf(_read_json(path))


def load_generation_defaults(model_dir: str) -> GenerationDefaults:
    if gguf_file.is_gguf(model_dir):
        raw = gguf_file.load_generation_config(model_dir)
    else:
        path = os.path.join(model_dir, "generation_config.json")
        raw = _read_json(path) if os.path.isfile(path) else {}
    eos = raw.get("eos_token_id")
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    keys = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
            "repetition_penalty": "repetition_penalty"}
    sampling = {ours: raw[theirs] for theirs, ours in keys.items() if theirs in raw}
    if raw.get("do_sample") is False:
        sampling["temperature"] = 0.0
    return GenerationDefaults(eos, sampling)


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        names = sorted(set(_read_json(index)["weight_map"].values()))
    else:
        names = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not names:
        raise ValueError(f"model directory {model_dir!r} has no *.safetensors weights")
    missing = [n for n in names if not os.path.isfile(os.path.join(model_dir, n))]
    if missing:
        raise ValueError(f"model directory {model_dir!r} is missing weight shards {missing}")
    return [os.path.join(model_dir, n) for n in names]


LOAD_FORMATS = ("auto", "dummy")


def load_model(model_dir: str, cfg: ModelConfig, backend: AttentionBackend, dtype: torch.dtype,
               device: torch.device, max_positions: int, tp: ParallelState = SINGLE,
               load_format: str = "auto", seed: int = 0) -> LlamaForCausalLM:
    """The model (this rank's shard of it under tensor parallelism ``tp``) with its weights, in eval mode.
    ``load_format="dummy"``: random weights at the checkpoint's shapes (only config.json is read), for
    benchmarking real shapes without writing or reading gigabytes of random numbers."""
    model = _empty_model(cfg, backend, dtype, device, max_positions, tp)
    if load_format == "dummy":
        _fill_dummy(model, seed)
        return model.eval()
    if gguf_file.is_gguf(model_dir):
        _load_gguf_weights(model, model_dir, cfg, dtype)
        return model.eval()
    filler = _Filler(model, cfg)
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                filler.put(key, lambda key=key: f.get_tensor(key), os.path.basename(path))
    filler.check(model_dir)
    return model.eval()


def _empty_model(cfg: ModelConfig, backend: AttentionBackend, dtype: torch.dtype, device: torch.device,
                 max_positions: int, tp: ParallelState) -> LlamaForCausalLM:
    """The model with uninitialised weights on ``device`` in ``dtype``, every parameter to be overwritten.

    On CPU we build it directly with the random initialisers switched off (allocation is lazy, nothing is
    written twice); elsewhere on the meta device and then materialised. Building under the meta device mode
    routes every op through torch's Python references, which imports torch._dynamo: about 2 s of start-up
    on a small CPU machine, for nothing."""
    if device.type == "cpu":
        with _no_weight_init(), _default_dtype(dtype):
            model = LlamaForCausalLM(cfg, backend, max_positions, tp)
        model = model.to(dtype)
    else:
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg, backend, max_positions, tp)
        model = model.to_empty(device=device).to(dtype)
    model.rope.build(device)
    return model


@torch.no_grad()
def _fill_dummy(model: LlamaForCausalLM, seed: int) -> None:
    """Random weights drawn on the model's device: N(0, 0.02) for matrices (transformers' default
    initializer_range), ones for norm weights, zeros for biases; the same seed gives the same model."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.normal_(0.0, 0.02, generator=gen)


@contextlib.contextmanager
def _no_weight_init():
    names = ("uniform_", "normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
             "trunc_normal_", "zeros_", "ones_", "constant_")
    saved = {n: getattr(torch.nn.init, n) for n in names}
    try:
        for n in names:
            setattr(torch.nn.init, n, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for n, fn in saved.items():
            setattr(torch.nn.init, n, fn)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    """Floating parameters are created in the final dtype, so no conversion copy follows."""
    old = torch.get_default_dtype()
    if dtype.is_floating_point:
        torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class _Filler:
    """Copies checkpoint tensors (Hugging Face names, or our own fused names) into their final place: the rows of
    a fused projection, and under tensor parallelism only this rank's slices."""

    def __init__(self, model: LlamaForCausalLM, cfg: ModelConfig) -> None:
        self.model, self.cfg = model, cfg
        self.params = dict(model.named_parameters())
        self.modules = dict(model.named_modules())
        self.pending = {name: p.shape[0] for name, p in self.params.items()}   # rows still to be filled

    def put(self, key: str, get_tensor, source: str) -> None:
        target = _target_name(key, self.cfg)
        if target is None:
            return
        name, shard = target
        if name not in self.params:
            raise ValueError(f"unexpected tensor {key!r} in {source}")
        param = self.params[name]
        owner, _, leaf = name.rpartition(".")
        slices = getattr(self.modules[owner], "checkpoint_slices", None)
        shape, parts = slices(leaf, shard) if slices else (tuple(param.shape), [Slice(0, 0, param.shape[0])])
        tensor = get_tensor()
        if tuple(tensor.shape) != shape:
            raise ValueError(f"tensor {key!r} has shape {tuple(tensor.shape)}, expected {shape}")
        for part in parts:
            dst = param.data.narrow(0, part.offset, part.count if part.dim == 0 else param.shape[0])
            dst.copy_(tensor.narrow(part.dim, part.start, part.count))
            self.pending[name] -= dst.shape[0]

    def check(self, source: str) -> None:
        missing = [n for n, rows in self.pending.items() if rows != 0]
        if missing:
            raise ValueError(f"checkpoint in {source!r} is missing weights for {missing[:5]}")


def _load_gguf_weights(model: LlamaForCausalLM, path: str, cfg: ModelConfig, dtype: torch.dtype) -> None:
    """Dequantize the file's tensors into the fused layout, or read them back from the conversion cache."""
    cache = gguf_file.weights_cache_file(path, str(dtype).removeprefix("torch."))
    if gguf_file.cache_enabled() and os.path.isfile(cache):
        try:
            filler = _Filler(model, cfg)
            with safe_open(cache, framework="pt", device="cpu") as f:
                for key in f.keys():
                    filler.put(key, lambda key=key: f.get_tensor(key), os.path.basename(cache))
            filler.check(cache)
            return
        except Exception:   # a damaged or stale cache: convert the file again
            pass
    filler = _Filler(model, cfg)
    raw_cfg = gguf_file.load_config_dict(path)
    with warnings.catch_warnings():   # F32 tensors are read-only views of the file; we only copy from them
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for key, array in gguf_file.iter_tensors(path, raw_cfg):
            filler.put(key, lambda array=array: torch.from_numpy(array), os.path.basename(path))
    filler.check(path)
    params = dict(model.named_parameters())
    size = sum(p.numel() * p.element_size() for p in params.values())
    if model.tp.size == 1 and gguf_file.cache_weights_allowed(size):    # a shard is not the file's cache
        try:
            from safetensors.torch import save_file
            os.makedirs(os.path.dirname(cache), exist_ok=True)
            tmp = cache + f".{os.getpid()}.tmp"
            save_file({n: p.detach().cpu().contiguous() for n, p in params.items()}, tmp)
            os.replace(tmp, cache)
        except OSError:
            pass   # no cache this time; loading still worked


def _target_name(key: str, cfg: ModelConfig) -> tuple[str, int | None] | None:
    """Checkpoint tensor name -> (our parameter name, shard index in a fused parameter or None)."""
    if "rotary_emb" in key:
        return None
    if key == "lm_head.weight":
        return None if cfg.tie_word_embeddings else ("lm_head.weight", None)
    name = key.removeprefix("model.")
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in LlamaForCausalLM.stacked_params:
            fused, shard = LlamaForCausalLM.stacked_params[part]
            return ".".join(parts[:i] + [fused] + parts[i + 1:]), shard
    return name, None


def load_tokenizer(path: str):
    """The model's own tokenizer through transformers (special tokens, chat template and all)."""
    if gguf_file.is_gguf(path):
        return gguf_file.load_tokenizer(path)
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises many types here; all mean the same to the user
        raise ValueError(f"could not load a tokenizer from {path!r}: {e}") from e
