"""Hugging Face directory -> (ModelConfig, model with weights, tokenizer, generation defaults).

The model is built on the meta device and materialised once on the target device and dtype; each safetensors
tensor is then copied straight into its final place (a slice of a fused projection where we fuse), so a checkpoint
never sits in memory twice.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open

from leapdecode.attention.backend import AttentionBackend
from leapdecode.model.config import ModelConfig
from leapdecode.model.llama import LlamaForCausalLM


@dataclass
class GenerationDefaults:
    """generation_config.json: extra eos ids and the sampling defaults the model's authors recommend."""
    eos_token_id: list[int]
    sampling: dict[str, Any]


def _read_json(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_model_config(model_dir: str) -> ModelConfig:
    if not os.path.isdir(model_dir):
        raise ValueError(f"model directory {model_dir!r} does not exist")
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"model directory {model_dir!r} has no config.json")
    return ModelConfig.from_hf(_read_json(path))


def load_generation_defaults(model_dir: str) -> GenerationDefaults:
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


def load_model(model_dir: str, cfg: ModelConfig, backend: AttentionBackend, dtype: torch.dtype,
               device: torch.device, max_positions: int) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, backend, max_positions)
    model = model.to_empty(device=device).to(dtype)
    model.rope.build(device)
    params = dict(model.named_parameters())
    pending = {name: p.shape[0] for name, p in params.items()}   # rows still to be filled
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                target = _target_name(key, cfg)
                if target is None:
                    continue
                name, shard = target
                if name not in params:
                    raise ValueError(f"unexpected tensor {key!r} in {os.path.basename(path)}")
                tensor = f.get_tensor(key)
                param = params[name]
                if shard is None:
                    dst = param.data
                else:
                    fused = name.split(".")[-2]
                    sizes = model.shard_sizes(fused)
                    dst = param.data.narrow(0, sum(sizes[:shard]), sizes[shard])
                if dst.shape != tensor.shape:
                    raise ValueError(f"tensor {key!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
                dst.copy_(tensor)
                pending[name] -= dst.shape[0]
    missing = [n for n, rows in pending.items() if rows != 0]
    if missing:
        raise ValueError(f"checkpoint in {model_dir!r} is missing weights for {missing[:5]}")
    return model.eval()


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
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises many types here; all mean the same to the user
        raise ValueError(f"could not load a tokenizer from {path!r}: {e}") from e
