"""Does this token end the sequence? One decision, in one place, asked once per appended token, in order.

The order matters and is fixed here: the grammar first (a token it refuses ends the request with "abort"), then
stop token ids, then eos (or a grammar that is complete), then stop strings (the detokenizer), then the length
limits. A stop ends the sequence at that token: tokens after it in the same step (accepted drafts) are dropped.
"""
from __future__ import annotations

from typing import Callable

from leapdecode.engine.sequence import Sequence

# (seq, token) -> "stop" | "abort" | "abort: <why>" | None, and (seq, token) -> the stop string hit, or None
GrammarHook = Callable[[Sequence, int], "str | None"]
TextHook = Callable[[Sequence, int], "str | None"]


class StopChecker:
    def __init__(self, eos_token_ids: set[int], max_model_len: int, grammar: GrammarHook | None = None,
                 text: TextHook | None = None) -> None:
        self.eos_token_ids, self.max_model_len = set(eos_token_ids), max_model_len
        self.grammar, self.text = grammar, text

    def max_output(self, seq: Sequence) -> int:
        return seq.params.max_tokens or self.max_model_len

    def room(self, seq: Sequence) -> int:
        """Tokens the sequence may still append (known ones and placeholders counted)."""
        known = seq.num_tokens + seq.num_placeholders
        return min(self.max_output(seq) - (known - seq.num_prompt_tokens), self.max_model_len - known)

    def check(self, seq: Sequence, token: int) -> tuple[str, int | str | None] | None:
        """Called after ``token`` was appended: (finish_reason, stop_reason) if it ends the sequence."""
        p = seq.params
        verdict = self.grammar(seq, token) if self.grammar is not None else None
        if verdict is not None and verdict.startswith("abort"):
            return "abort", verdict.partition(": ")[2] or "no valid continuation under the structured-output grammar"
        if token in p.stop_token_ids:
            return "stop", token
        if (token in self.eos_token_ids and not p.ignore_eos) or verdict == "stop":
            return "stop", None
        stop = self.text(seq, token) if self.text is not None else None
        if stop is not None:
            return "stop", stop
        if seq.num_output_tokens >= self.max_output(seq) or seq.num_tokens >= self.max_model_len:
            return "length", None
        return None
