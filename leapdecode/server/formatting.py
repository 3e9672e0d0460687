"""OpenAI formatting of engine outputs: token text and bytes, logprobs in the chat and the legacy completion
shapes, echoed prompts, usage.

The tokenizer here is the server's own copy (``copy.deepcopy`` of the engine's, made once at startup): these
calls run on the event-loop thread while the engine thread detokenizes with its instance, and an HF tokenizers
object must not be shared between threads that way. Its Rust core sits in a RefCell: a call needing a mutable
borrow (transformers' encode() may flip truncation/padding settings) raises "Already borrowed" when it meets any
other call on another thread (huggingface/tokenizers#537). Two instances share nothing, so neither thread
can trip the other, whatever later code calls; the copy costs one tokenizer's memory (tens of MB for a 150k
vocabulary) and well under a second at startup. Tokenization and chat templates run in preprocess.py's worker
threads, each with its own copy, for the same reason.
"""
from __future__ import annotations

import copy
import functools
import re
from typing import Any

from leapdecode.outputs import CompletionOutput, RequestOutput
from leapdecode.server.protocol import ChoiceLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob, Usage


class Formatter:
    """Token text/bytes (cached) and logprobs formatting, with a tokenizer private to the event-loop thread."""

    def __init__(self, tokenizer: Any, max_cached_tokens: int | None = None) -> None:
        self.tokenizer = copy.deepcopy(tokenizer)
        self._token_text: dict[int, str] = {}
        # Bounded by the vocabulary anyway (keys are token ids); the limit only matters for huge vocabularies.
        self.max_cached_tokens = max_cached_tokens or min(len(self.tokenizer), 1_000_000)

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_text) < self.max_cached_tokens:
                self._token_text[token_id] = text
        return text

    def prompt_logprobs(self, out: RequestOutput) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's ``prompt_logprobs``: per prompt token (the first has none), token id -> {logprob, rank,
        decoded_token}, the prompt's own token always included."""
        if out.prompt_logprobs is None:
            return None
        result: list[dict[str, dict[str, Any]] | None] = []
        for pos, entry in enumerate(out.prompt_logprobs):
            if entry is None:
                result.append(None)
                continue
            ranked = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)
            rank_of = {t: r + 1 for r, (t, _) in enumerate(ranked)}
            result.append({str(t): {"logprob": lp, "rank": rank_of[t], "decoded_token": self.token_text(t)}
                           for t, lp in ranked})
        return result

    def echo_logprobs(self, out: RequestOutput, top_n: int, generated: CompletionLogprobs) -> CompletionLogprobs:
        """Legacy completion logprobs with the echoed prompt's tokens first (the first one has no logprob)."""
        lp = CompletionLogprobs()
        offset = 0
        entries = out.prompt_logprobs or []
        for pos, token_id in enumerate(out.prompt_token_ids):
            text = self.token_text(token_id)
            entry = entries[pos] if pos < len(entries) else None
            lp.tokens.append(text)
            lp.token_logprobs.append(entry.get(token_id) if entry else None)
            lp.top_logprobs.append({self.token_text(t): v for t, v in sorted(entry.items(), key=lambda kv: kv[1],
                                                                            reverse=True)[:max(top_n, 1)]}
                                   if entry else None)
            lp.text_offset.append(offset)
            offset += len(text)
        lp.tokens += generated.tokens
        lp.token_logprobs += generated.token_logprobs
        lp.top_logprobs += generated.top_logprobs
        lp.text_offset += generated.text_offset
        return lp

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's raw bytes. A token that is part of a multi-byte character decodes to U+FFFD on its own,
        so its bytes come from the vocabulary piece: byte-level BPE ("Ġ" = space) or SentencePiece "<0xAB>"."""
        text = self.token_text(token_id)
        if "\ufffd" not in text:
            return list(text.encode())
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
            if m:
                return [int(m.group(1), 16)]
            byte_of = _byte_level_decoder()
            if piece and all(ch in byte_of for ch in piece):
                return [byte_of[ch] for ch in piece]
        return list(text.encode())

    def chat_logprobs(self, c: CompletionOutput, start: int, end: int, top_n: int) -> ChoiceLogprobs:
        content = []
        for token_id, entry in zip(c.token_ids[start:end], (c.logprobs or [])[start:end]):
            ranked = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:top_n]
            content.append(TokenLogprob(
                token=self.token_text(token_id), logprob=entry.get(token_id, float("-inf")),
                bytes=self.token_bytes(token_id),
                top_logprobs=[TopLogprob(token=self.token_text(t), logprob=lp, bytes=self.token_bytes(t))
                              for t, lp in ranked]))
        return ChoiceLogprobs(content=content)

    def completion_logprobs(self, c: CompletionOutput, start: int, end: int, offset: int) -> CompletionLogprobs:
        lp = CompletionLogprobs()
        for token_id, entry in zip(c.token_ids[start:end], (c.logprobs or [])[start:end]):
            text = self.token_text(token_id)
            lp.tokens.append(text)
            lp.token_logprobs.append(entry.get(token_id))
            lp.top_logprobs.append({self.token_text(t): v for t, v in
                                    sorted(entry.items(), key=lambda kv: kv[1], reverse=True)})
            lp.text_offset.append(offset)
            offset += len(text)
        return lp

    def prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return self.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)


def usage(snap: list[RequestOutput | None]) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in snap if o is not None)
    completion = sum(len(c.token_ids) for o in snap if o is not None for c in o.outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


@functools.lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: printable stand-ins for the 256 byte values, inverted."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) \
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars
