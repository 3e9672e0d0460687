"""SamplingParams: what a request asks of the sampler, validated at submission so errors name the field."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from leapdecode.errors import InvalidParameter

INT32_MAX = 2**31 - 1          # bound of counts and token ids (the model-dependent bounds are the engine's)
MIN_TOP_P = 1e-9
MIN_REPETITION_PENALTY = 1e-6


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                      # -1 or 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0      # HF semantics: over prompt + output tokens
    presence_penalty: float = 0.0        # OpenAI semantics: over output tokens
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16          # None: up to max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None          # top-N logprobs per sampled token (the sampled one always included)
    prompt_logprobs: int | None = None   # top-N logprobs per prompt token
    skip_special_tokens: bool = True
    structured: dict[str, Any] | None = None   # OpenAI response_format shape, plus regex / grammar / choice
    grammar_aligned: bool = False        # ASAp: repeated samples converge to P(output | output in grammar)
    logit_bias: dict[int, float] | None = None   # OpenAI's: token id -> bias in [-100, 100] added to its logit
    mirostat: int = 0                    # llama.cpp's: 0 off, 1 or 2: Mirostat v1/v2 (sampling/mirostat.py)
    mirostat_tau: float = 5.0            # target surprise, bits per token
    mirostat_eta: float = 0.1            # learning rate of the surprise threshold mu
    penalty_alpha: float = 0.0           # > 0 with top_k > 1: contrastive search over top_k candidates (_validate)
    dola_layers: str | tuple[int, ...] | None = None   # DoLa (sampling/dola.py): "low", "high" or layer indices
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> InvalidParameter:
            return InvalidParameter(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}", param=name)

        def is_int(x: Any) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x: Any) -> bool:     # a finite real number: NaN and infinities would poison the sampler
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        if not is_int(self.n) or not 1 <= self.n <= INT32_MAX:
            raise bad("n", "must be an integer >= 1")
        if not is_num(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a finite number >= 0")
        # Lower bounds that keep float32 sampling finite: a smaller top_p rounds to 0 (nothing kept), a smaller
        # repetition_penalty divides logits into infinities; either would make a NaN distribution.
        if not is_num(self.top_p) or not MIN_TOP_P <= self.top_p <= 1.0:
            raise bad("top_p", f"must be in [{MIN_TOP_P:g}, 1] (in (0, 1], and not below float32's reach)")
        if not is_int(self.top_k) or not -1 <= self.top_k <= INT32_MAX:
            raise bad("top_k", "must be -1 (off), 0 (off) or a positive integer (at most the vocabulary size)")
        if not is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not is_num(self.repetition_penalty) or self.repetition_penalty < MIN_REPETITION_PENALTY:
            raise bad("repetition_penalty", f"must be a finite number >= {MIN_REPETITION_PENALTY:g} (> 0)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not -2.0 <= v <= 2.0:
                raise bad(name, "must be in [-2, 2]")
        if self.seed is not None and (not is_int(self.seed) or not -2**63 <= self.seed < 2**63):
            raise bad("seed", "must be a 64-bit integer or None")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT32_MAX):
            raise bad("max_tokens", "must be an integer >= 1 or None")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= INT32_MAX:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if any(not isinstance(s, str) or s == "" for s in self.stop_strings):
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        if any(not is_int(t) or not 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of token ids (non-negative integers in the vocabulary)")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or not 0 <= v <= INT32_MAX):
                raise bad(name, "must be an integer >= 0 or None")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or any(
                    not is_int(t) or not 0 <= t <= INT32_MAX or not is_num(b) or not -100 <= b <= 100
                    for t, b in self.logit_bias.items()):
                raise bad("logit_bias", "must map token ids (non-negative integers in the vocabulary) to biases "
                                        "in [-100, 100]")
            self.logit_bias = {t: float(b) for t, b in self.logit_bias.items()} or None
        if self.structured is not None and not isinstance(self.structured, dict):
            raise bad("structured", "must be a dict like OpenAI's response_format")
        if self.grammar_aligned and self.structured is None:
            raise bad("grammar_aligned", "needs structured= (it reweights a grammar's masked distribution)")
        # Mirostat does its own truncation: it refuses the others rather than silently mixing with them, and it
        # needs a distribution to control (not greedy).
        if not is_int(self.mirostat) or self.mirostat not in (0, 1, 2):
            raise bad("mirostat", "must be 0 (off), 1 (Mirostat v1) or 2 (Mirostat v2)")
        for name in ("mirostat_tau", "mirostat_eta"):
            if not is_num(getattr(self, name)) or getattr(self, name) <= 0:
                raise bad(name, "must be a finite number > 0")
        if self.mirostat:
            truncates = "Mirostat chooses the tokens to keep itself"
            for name, clash, why in (
                    ("top_k", self.top_k > 0, truncates), ("top_p", self.top_p < 1.0, truncates),
                    ("min_p", self.min_p > 0.0, truncates),
                    ("temperature", self.greedy, "greedy decoding leaves no distribution to control"),
                    ("grammar_aligned", self.grammar_aligned, "ASAp reweights a fixed sampling distribution")):
                if clash:
                    raise bad(name, f"cannot be combined with mirostat={self.mirostat} ({why})")
        # Contrastive search (decoding/contrastive.py), as transformers' generate(penalty_alpha, top_k): on when
        # penalty_alpha > 0 and top_k > 1 (top_k == 1 is plain greedy, as there). It is deterministic, so
        # temperature, top_p, min_p and seed are ignored (as transformers ignores them without do_sample); n must
        # be 1 (every sample would be the same); a grammar's masks are built for one chain of drafts, not for k
        # candidate siblings, so it does not combine with structured output.
        if not is_num(self.penalty_alpha) or not 0.0 <= self.penalty_alpha <= 1.0:
            raise bad("penalty_alpha", "must be a number in [0, 1] (0: off; > 0 with top_k > 1: contrastive search)")
        if self.penalty_alpha > 0 and self.top_k <= 0:
            raise bad("top_k", "must be > 1 with penalty_alpha > 0 (contrastive search chooses among top_k "
                               "candidates)")
        if self.contrastive and self.n != 1:
            raise bad("n", "must be 1 with contrastive search (penalty_alpha > 0): it is deterministic, so every "
                           "sample would be the same")
        if self.contrastive and self.structured is not None:
            raise bad("structured", "cannot be combined with contrastive search (penalty_alpha > 0)")
        # DoLa (sampling/dola.py): the layer indices are checked against the model when the request is added.
        if self.dola_layers is not None:
            if isinstance(self.dola_layers, str):
                if self.dola_layers not in ("low", "high"):
                    raise bad("dola_layers", 'must be "low", "high" or a non-empty list of layer indices')
            elif not isinstance(self.dola_layers, (list, tuple)) or not self.dola_layers or any(
                    not is_int(i) or i < 0 for i in self.dola_layers):
                raise bad("dola_layers", 'must be "low", "high" or a non-empty list of layer indices (>= 0; the '
                                         "model's layer count is checked when the request is added)")
            else:
                self.dola_layers = tuple(self.dola_layers)
            if self.grammar_aligned:
                raise bad("grammar_aligned", "cannot be combined with dola_layers (ASAp reweights the model's "
                                             "distribution, DoLa replaces it)")
            if self.contrastive or self.mirostat:
                raise bad("dola_layers", "cannot be combined with contrastive search or mirostat")

    @property
    def contrastive(self) -> bool:
        """Contrastive search: choose among the top_k candidates by probability and a degeneration penalty."""
        return self.penalty_alpha > 0 and self.top_k > 1

    @property
    def greedy(self) -> bool:
        """Deterministic: no random draw (contrastive search included, whatever its temperature)."""
        return self.temperature < 1e-5 or self.top_k == 1 or self.contrastive

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)
