"""Engine and speculation configs, validated once at start-up."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

_DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: str | torch.dtype, model_dtype: str | None, device: torch.device) -> torch.dtype:
    """"auto" means the checkpoint's dtype on GPUs; on CPU float32 (most CPUs lack fast half-precision math)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        d = _DTYPES.get(str(model_dtype or "float32").replace("torch.", ""), torch.float32)
        return torch.float32 if device.type == "cpu" else d
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def parse_memory(value: int | float | str) -> int:
    """Bytes from an int or a string such as '512MiB', '2GB', '1.5G'."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", str(value))
    if not m:
        raise ValueError(f"kv_cache_memory must be bytes or a size like '2GiB', got {value!r}")
    scale = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


@dataclass
class SpeculativeConfig:
    """How to speculate. ``num_speculative_tokens`` is the most draft tokens per request per step. ``drafter``
    takes any object implementing the ``Drafter`` protocol (spec/drafter.py) instead of a built-in method."""
    method: str = "suffix"
    num_speculative_tokens: int = 4
    adaptive: bool = True            # per-request draft length from acceptance history + load-aware cap
    options: dict[str, Any] = field(default_factory=dict)   # passed to the drafter
    drafter: Any = None

    def __post_init__(self) -> None:
        from leapdecode.spec.registry import METHODS
        if self.drafter is None and self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got {self.method!r}")
        if self.drafter is not None and not callable(getattr(self.drafter, "propose", None)):
            raise ValueError("speculative_config.drafter must implement the Drafter protocol (a propose method)")
        if not isinstance(self.num_speculative_tokens, int) or not 0 <= self.num_speculative_tokens <= 64:
            raise ValueError("speculative_config.num_speculative_tokens must be an integer in [0, 64], "
                             f"got {self.num_speculative_tokens!r}")

    @property
    def model_methods(self) -> tuple[str, ...]:
        """The drafters among this configuration's that run a model inside the step (``auto`` may include one)."""
        from leapdecode.spec.registry import DEFAULT_AUTO_METHODS, MODEL_METHODS
        if self.drafter is not None:
            return ()
        methods = tuple(self.options.get("methods", DEFAULT_AUTO_METHODS)) if self.method == "auto" else (self.method,)
        return tuple(m for m in methods if m in MODEL_METHODS)

    @classmethod
    def from_any(cls, value: "SpeculativeConfig | dict | None") -> "SpeculativeConfig | None":
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            known = {"method", "num_speculative_tokens", "adaptive", "options", "drafter"}
            options = {k: v for k, v in value.items() if k not in known}
            base = {k: v for k, v in value.items() if k in known}
            given = base.pop("options", None) or {}         # popped before ``base`` is unpacked
            return cls(**base, options={**given, **options})
        raise ValueError(f"speculative_config must be a SpeculativeConfig or a dict, got {type(value).__name__}")


SPARSE_SELECTIONS = ("per_layer", "tidal", "pages")


@dataclass(frozen=True)
class SparseAttentionConfig:
    """LOSSY, opt-in: sparse attention for long decode rows (attention/sparse.py). Prefill and verification rows
    always attend fully.

    ``budget``: positions a sparse layer reads besides the window: a fraction of the context (a float in (0, 1]) or a
    token count (an int >= 1); a context no longer than budget + window attends fully, so its outputs are exact.
    ``window``: the most recent positions (the current token included) that every sparse layer also reads.
    ``selection``: how positions are chosen (None: "tidal" when ``selection_layers`` is given, else "per_layer").

    - ``"per_layer"`` (default; top-k attention): every layer from ``dense_layers`` up ranks the earlier positions
      by its own attention scores, per KV head, and attends to its top ``budget`` (plus the window); the layers
      below ``dense_layers`` attend fully. It reads every key but only the chosen values.
    - ``"tidal"`` (TidalDecode): ``selection_layers`` (0-based, ascending) attend fully and choose one set of
      positions that the layers above them reuse (until the next selection layer); the layers below the first
      attend fully. None: layer 2 and one at 40% depth (the paper's layers 2 and 13 of Llama-3-8B's 32). It reads
      far less, but on SmolLM2-135M the positions a layer needs do not persist from one layer to the next (see
      attention/sparse.py for the measurement).
    - ``"pages"`` (Quest): every layer from ``dense_layers`` up bounds, per KV head, the score its queries can give
      each block of the cache from the block's per-channel key minimum and maximum (kept as keys are written),
      and attends over the top blocks holding ``budget`` tokens plus the blocks of the window. It reads the bounds
      (two vectors per block) and the chosen blocks' keys and values, not the whole context."""
    budget: float | int = 0.1
    selection_layers: tuple[int, ...] | None = None
    window: int = 32
    selection: str | None = None
    dense_layers: int = 2

    def __post_init__(self) -> None:
        b = self.budget
        if isinstance(b, bool) or not isinstance(b, (int, float)) or (isinstance(b, int) and b < 1) or (
                isinstance(b, float) and not 0.0 < b <= 1.0):
            raise ValueError("sparse_attention.budget must be a fraction of the context in (0, 1] or a token count "
                             f">= 1, got {b!r}")
        if self.selection is None:
            object.__setattr__(self, "selection", "per_layer" if self.selection_layers is None else "tidal")
        if self.selection not in SPARSE_SELECTIONS:
            raise ValueError(f"sparse_attention.selection must be one of {SPARSE_SELECTIONS}, got {self.selection!r}")
        layers = self.selection_layers
        if layers is not None:
            if self.selection != "tidal":
                raise ValueError("sparse_attention.selection_layers applies to selection='tidal' only (with "
                                 f"{self.selection!r} every layer from dense_layers up selects its own positions)")
            if isinstance(layers, int) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
                raise ValueError(f"sparse_attention.selection_layers must be layer indices, got {layers!r}")
            layers = tuple(layers)
            if not layers or layers[0] < 0 or any(a >= b for a, b in zip(layers, layers[1:])):
                raise ValueError("sparse_attention.selection_layers must be non-empty, >= 0 and strictly "
                                 f"ascending, got {layers!r}")
            object.__setattr__(self, "selection_layers", layers)
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"sparse_attention.window must be an integer >= 1 (it includes the current token), "
                             f"got {self.window!r}")
        d = self.dense_layers
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise ValueError(f"sparse_attention.dense_layers must be an integer >= 0, got {d!r}")

    def layers_for(self, num_layers: int) -> tuple[int, ...]:
        """The layers that choose positions, for a model of ``num_layers`` layers (the default resolved, the given
        checked): with "per_layer" and "pages", every layer from ``dense_layers`` up."""
        if self.selection in ("per_layer", "pages"):
            if self.dense_layers >= num_layers:
                raise ValueError(f"sparse_attention.dense_layers {self.dense_layers} leaves none of the model's "
                                 f"{num_layers} layers sparse")
            return tuple(range(self.dense_layers, num_layers))
        if self.selection_layers is None:
            first = min(2, num_layers - 1)
            return tuple(sorted({first, max(first, round(0.4 * num_layers))}))
        if self.selection_layers[-1] >= num_layers:
            raise ValueError(f"sparse_attention.selection_layers {self.selection_layers} must be below the "
                             f"model's {num_layers} layers")
        return self.selection_layers

    @classmethod
    def from_any(cls, value: "SparseAttentionConfig | dict | None") -> "SparseAttentionConfig | None":
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            fields = ("budget", "window", "selection", "dense_layers", "selection_layers")
            unknown = set(value) - set(fields)
            if unknown:
                raise ValueError(f"sparse_attention has no field(s) {sorted(unknown)}: use {', '.join(fields)}")
            return cls(**value)
        raise ValueError(f"sparse_attention must be a SparseAttentionConfig or a dict, got {type(value).__name__}")


@dataclass
class EngineConfig:
    model: str
    tokenizer: str | None = None
    dtype: str | torch.dtype = "auto"
    device: str | None = None                 # None: cuda if available else cpu
    max_model_len: int | None = None          # None: the checkpoint's max_position_embeddings (capped at 8192)
    kv_cache_memory: int | str | None = None  # bytes for the KV pool; None: see EngineConfig.resolve
    num_kv_blocks: int | None = None          # overrides kv_cache_memory when set
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    seed: int = 0
    speculative_config: SpeculativeConfig | dict | None = None
    attention_backend: str = "auto"           # auto | torch | triton (see attention/backend.py)
    async_scheduling: bool = False            # overlap the host work of step N+1 with step N's forward
    pad_to_buckets: bool | None = None        # pad token counts to capacity buckets; None: on CUDA only
    grammar_cache_size: int = 256             # compiled grammars kept (LRU; about 0.2 MB each for a JSON schema)
    sparse_attention: SparseAttentionConfig | dict | None = None   # LOSSY sparse decoding (attention/sparse.py)
    tensor_parallel_size: int = 1             # ranks the model is sharded over (engine/tp_executor.py)
    # KV-cache format (attention/kv_quant.py): "auto" = the model's dtype (lossless); fp8 | int8 | int4 are LOSSY
    kv_cache_dtype: str = "auto"
    kv_cache_salient_ratio: float | None = None   # int4: share of a block's tokens kept at 8 bits (None: 0.125)
    kv_cache_recent_tokens: int = 0               # each sequence's newest tokens kept at full precision (a
                                                  # quantized cache's window; measured: benchmarks/README.md)
    load_format: str = "auto"                 # auto: the checkpoint's weights; dummy: random weights (benchmarks)
    enforce_eager: bool = False               # True: no CUDA graphs (engine/cuda_graphs.py), every step eager
    cpu_packed_linears: bool | None = None    # float32 CPU: weights packed once, linears through our row
                                              # kernel or oneDNN (model/packed_linear.py); None: where available
    quantization: str | None = None           # "int4": LOSSY 4-bit weights on the CPU (model/int4_linear.py)
    batch_invariant: bool | None = None       # exact attention: a request's logits are bit for bit the same
                                              # whatever shares its step (attention/cpu_exact.py); None: every
                                              # CPU row (prompts prefill at 0.95-1.17x float32 SDPA's speed),
                                              # everywhere with quantization
    max_graph_batch: int = 256                # CUDA graphs are captured for decode batches up to this size

    def __post_init__(self) -> None:
        from leapdecode.attention.backend import BACKENDS
        self.speculative_config = SpeculativeConfig.from_any(self.speculative_config)
        self.sparse_attention = SparseAttentionConfig.from_any(self.sparse_attention)
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {BACKENDS}, got {self.attention_backend!r}")
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "grammar_cache_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 1):
            raise ValueError(f"num_kv_blocks must be a positive integer, got {self.num_kv_blocks!r}")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_memory(self.kv_cache_memory)
        from leapdecode.attention.kv_quant import parse_kv_cache_dtype
        self.kv_cache_dtype = parse_kv_cache_dtype(self.kv_cache_dtype)
        from leapdecode.model.loader import LOAD_FORMATS
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        from leapdecode.model.int4_linear import QUANTIZATIONS
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if not isinstance(self.max_graph_batch, int) or self.max_graph_batch < 0:
            raise ValueError(f"max_graph_batch must be an integer >= 0, got {self.max_graph_batch!r}")
        r = self.kv_cache_salient_ratio
        if r is not None:
            if self.kv_cache_dtype != "int4":
                raise ValueError(f"kv_cache_salient_ratio applies to kv_cache_dtype='int4' only, "
                                 f"not {self.kv_cache_dtype!r}")
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r <= 1:
                raise ValueError(f"kv_cache_salient_ratio must be a number in [0, 1], got {r!r}")
        w = self.kv_cache_recent_tokens
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise ValueError(f"kv_cache_recent_tokens must be an integer >= 0, got {w!r}")
        if w and self.kv_cache_dtype == "auto":
            raise ValueError("kv_cache_recent_tokens applies to a quantized kv_cache_dtype (fp8, int8, int4), "
                             "not 'auto' (every token is already at full precision)")
        self.torch_device = torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.batch_invariant not in (None, True, False):
            raise ValueError(f"batch_invariant must be True, False or None, got {self.batch_invariant!r}")
        if self.quantization is not None and self.batch_invariant is False and self.speculative_config is not None:
            import warnings
            warnings.warn(f"quantization={self.quantization!r} with batch_invariant=False: float32 attention's last "
                          "bits, rounded to bfloat16, change tokens, so speculation's greedy output can differ from "
                          "plain decoding's (see model/int4_linear.py)", stacklevel=3)
        if self.quantization is not None and (self.torch_device.type != "cpu" or self.tensor_parallel_size != 1):
            raise ValueError(f"quantization={self.quantization!r} runs on a CPU without tensor parallelism (got "
                             f"device {self.torch_device.type}, tensor_parallel_size={self.tensor_parallel_size})")
        self._check_tensor_parallel()

    def _check_tensor_parallel(self) -> None:
        """What tensor parallelism needs from the config alone (the model's heads are checked at load time)."""
        n = self.tensor_parallel_size
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {n!r}")
        if n == 1:
            return
        if self.torch_device.type not in ("cpu", "cuda"):
            raise ValueError(f"tensor_parallel_size={n} runs on cpu (gloo) or cuda (nccl), "
                             f"not {self.torch_device.type}")
        spec = self.speculative_config
        if spec is not None and spec.model_methods:
            raise ValueError(f"speculative_config {spec.model_methods[0]!r} runs a model inside the step, which is "
                             f"not sharded: it does not work with tensor_parallel_size={n} yet (use a model-free "
                             "drafter: ngram, suffix, recycling, auto)")

    @property
    def exact_attention(self) -> str:
        """The torch attention backend's ``exact`` mode (attention/torch_ref.py): "always" with
        ``batch_invariant=True`` or, by default, under ``quantization`` (whose bfloat16 or int8 activations make
        float32 SDPA's last bits visible; float64 SDPA where the kernel cannot run); "off" with
        ``batch_invariant=False``; else "kernel" (every row on a CPU: decode rows at no cost, prompts at 0.95-1.17x
        float32 SDPA's speed)."""
        if self.batch_invariant or (self.batch_invariant is None and self.quantization is not None):
            return "always"
        return "off" if self.batch_invariant is False else "kernel"

    @property
    def kv_cache_salient_tokens(self) -> int:
        """int4: tokens per block (per kv head) kept at 8 bits."""
        if self.kv_cache_dtype != "int4":
            return 0
        ratio = 0.125 if self.kv_cache_salient_ratio is None else self.kv_cache_salient_ratio
        return min(self.block_size, round(ratio * self.block_size))
