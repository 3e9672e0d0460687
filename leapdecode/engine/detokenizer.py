"""Incremental detokenization with stop strings.

Text comes from the tokenizers library's DecodeStream, which holds back bytes until they form whole UTF-8
characters and is seeded with the prompt's last tokens so the first output token decodes with the right spacing.
Stop strings are searched only in the region new text could have completed; text that might still become the start
of a stop string is held back from streaming until it cannot.
"""
from __future__ import annotations

from tokenizers.decoders import DecodeStream

_CONTEXT_TOKENS = 8   # prompt tokens to seed the stream with: enough for any multi-byte character


class Detokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str], skip_special_tokens: bool,
                 include_stop: bool, deferred: bool = False) -> None:
        """``deferred``: nobody reads the text before the end, so without stop strings tokens are only queued and
        decoded when the text is asked for (the same text: the same stream, fed later)."""
        self._tok = tokenizer.backend_tokenizer
        self._stream = DecodeStream(ids=list(prompt_token_ids[-_CONTEXT_TOKENS:]),
                                    skip_special_tokens=skip_special_tokens)
        self.stop, self.include_stop = stop, include_stop
        self.holdback = max((len(s) for s in stop), default=1) - 1   # chars a stop string could still claim
        self.text = ""
        self._ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._emitted = len(self._ids)       # tokens whose text is already in self.text
        self._skip = skip_special_tokens
        self._queue: list[int] | None = [] if deferred and not stop else None

    def add(self, token_id: int) -> str | None:
        """Append one token's text; return the stop string if it completed one (text is then cut)."""
        if self._queue is not None:
            self._queue.append(token_id)
            return None
        return self._add(token_id)

    def _drain(self) -> None:
        if self._queue:
            queue, self._queue = self._queue, []
            for token_id in queue:
                self._add(token_id)

    def _add(self, token_id: int) -> str | None:
        chunk = self._stream.step(self._tok, token_id)
        self._ids.append(token_id)
        if not chunk:
            return None
        self._emitted = len(self._ids)
        search_from = max(0, len(self.text) - self.holdback)
        self.text += chunk
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if not hits:
            return None
        i, s = min(hits)                       # the earliest stop string wins
        self.text = self.text[:i + len(s) if self.include_stop else i]
        return s

    def flush(self) -> None:
        """At the end, decode tokens still held back (an unfinished UTF-8 sequence) the way a full decode would."""
        self._drain()
        if self._emitted == len(self._ids):
            return
        ctx = self._ids[max(0, self._emitted - _CONTEXT_TOKENS):self._emitted]
        head = self._tok.decode(ctx, skip_special_tokens=self._skip)
        full = self._tok.decode(ctx + self._ids[self._emitted:], skip_special_tokens=self._skip)
        self.text += full[len(head):] if full.startswith(head) else full
        self._emitted = len(self._ids)

    def visible_text(self, finished: bool) -> str:
        """What may be streamed now: all of it when finished, else minus a possible stop-string prefix."""
        self._drain()
        if finished or not self.holdback:
            return self.text
        return self.text[:max(0, len(self.text) - self.holdback)]
