"""The engine's front without its weights: what the proxy of a cluster needs to validate and prepare requests.

The OpenAI server reads the tokenizer, the chat template, the context length, the vocabulary and the grammar
compiler from ``llm.engine``; a proxy in front of engine instances needs exactly those and no model or KV cache.
``FrontLLM`` stands in for a ``leapdecode.LLM`` in ``build_app``.
"""
from __future__ import annotations

from dataclasses import dataclass

from leapdecode.config import EngineConfig
from leapdecode.engine.engine import eos_token_ids, resolve_max_model_len
from leapdecode.engine.structured_output import StructuredOutput
from leapdecode.llm import resolve_model
from leapdecode.model.loader import load_generation_defaults, load_model_config, load_tokenizer


class EngineFront:
    """Tokenizer, limits and grammar compiler of the engine that ``llm_kwargs`` (``LLM``'s arguments) would build."""

    speculator = None      # the server's cache metrics look for a drafter; the proxy has none

    def __init__(self, llm_kwargs: dict) -> None:
        kw = dict(llm_kwargs)
        self.cfg = EngineConfig(model=resolve_model(kw.get("model")), tokenizer=kw.get("tokenizer"),
                                max_model_len=kw.get("max_model_len"),
                                grammar_cache_size=kw.get("grammar_cache_size", 256),
                                block_size=kw.get("block_size", 16))
        self.model_cfg = load_model_config(self.cfg.model)
        self.tokenizer = load_tokenizer(self.cfg.tokenizer or self.cfg.model)
        self.generation_defaults = load_generation_defaults(self.cfg.model)
        self.max_model_len = resolve_max_model_len(self.cfg, self.model_cfg)
        self.vocab_size = self.model_cfg.vocab_size
        self.eos_token_ids = eos_token_ids(self.model_cfg, self.generation_defaults, self.tokenizer)
        self.structured = StructuredOutput(self.tokenizer, self.eos_token_ids, self.cfg.grammar_cache_size)


@dataclass
class FrontLLM:
    """Stands in for an ``LLM`` where only ``llm.engine``'s front is read (``build_app`` with a cluster backend)."""
    engine: EngineFront
