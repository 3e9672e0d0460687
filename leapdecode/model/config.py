"""ModelConfig: the few numbers the model file needs, read from a Hugging Face config.json (old and new styles)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    dtype: str | None
    eos_token_id: list[int]
    bos_token_id: int | None

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "ModelConfig":
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"unsupported architecture {archs or raw.get('model_type')!r}; "
                             f"leapdecode supports {', '.join(ARCHITECTURES)}")
        qwen2 = arch == "Qwen2ForCausalLM"
        # transformers >= 5 keeps rope_theta and scaling together in rope_parameters; older configs split them.
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = {}
        window = raw.get("sliding_window")
        if qwen2 or arch == "Qwen3ForCausalLM":
            if raw.get("use_sliding_window"):
                raise ValueError("Qwen sliding-window attention (use_sliding_window=true) is not supported")
            window = None
        heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        bias = bool(raw.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope or None,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=bias or qwen2,
            o_bias=bias and not qwen2,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=window,
            dtype=raw.get("torch_dtype") or raw.get("dtype"),
            eos_token_id=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            bos_token_id=raw.get("bos_token_id"),
        )
