"""Per-request grammar matcher (the DESIGN "Grammar matcher" contract), with the validator guard (guard.py).

`Matcher` wraps one request's parser state in the grammar library and adds what the engine needs around it:
EOS handling, speculation (validate drafts, one mask row per draft position plus the bonus, rollback), forced
tokens, and - for JSON schemas - `SchemaGuard`, which enforces with `jsonschema` what the grammar could not:

* Rule A (every JSON schema): EOS is allowed only when the complete document validates against the schema.
* Rule B (schemas with dropped keywords): a token that completes the top-level value is forbidden when the
  resulting document is invalid (otherwise the grammar would have nothing left to offer but EOS).
* Rule C (dropped keywords reachable by a fixed instance path through properties/items/prefixItems/allOf/$ref):
  a token that closes a value at that path is forbidden when the value is invalid against its subschema, and
  monotone keywords (uniqueItems, contains+maxContains, propertyNames) are checked on every element/key as it
  closes, so the model is steered away before the violation becomes unrecoverable.

What stays approximate: a prefix can still reach a state with no valid continuation (e.g. `not` inside an
anyOf branch); then the row allows only EOS and `Matcher.error` says why - the engine must finish the request
with an error instead of returning the text as a valid instance.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from leapdecode.structured.guard import Cursor

if TYPE_CHECKING:
    from leapdecode.structured.adapters import LibState
    from leapdecode.structured.backend import CompiledGrammar, GrammarBackend

__all__ = ["Matcher"]


class Matcher:
    """One request's position in its grammar. Not thread-safe; one owner (the engine's step) at a time.

    Contract (DESIGN.md): validate(tokens) -> n, accept(token) -> bool, rollback(n), fill_bitmask(bitmask, row),
    forced_tokens() -> list[int], is_terminated(). Every token whose bit fill_bitmask sets is accepted by
    accept(); the converse need not hold (where the grammar forces bytes, llguidance's mask offers only their
    canonical tokenization, while accept() takes any tokenization of valid text, e.g. a draft's).
    """

    def __init__(self, state: LibState, backend: GrammarBackend, compiled: CompiledGrammar) -> None:
        self._state = state
        self._backend = backend
        self.compiled = compiled
        self._eos = backend.eos_token_ids
        self._guard = compiled.guard
        # llguidance's native batched fill (parallel, GIL released) is equivalent to ours when EOS is the
        # tokenizer's single eos token and the guard, if any, only has rule A (fixed up by `finish_native`).
        self._native_ok = (
            hasattr(state, "native")
            and self._eos == (backend.native_eos,)
            and (self._guard is None or not self._guard.active)
        )
        self._eos_is_native = self._eos == (backend.native_eos,)   # the only EOS is the one the library masks
        self._history: list[int] = []  # accepted tokens, EOS included
        self._terminated = False
        self.error: str | None = None  # set when no token can continue to a valid instance (see module doc)
        self._text = bytearray()  # emitted bytes (kept only with a guard)
        self._cursors: list[Cursor] = [Cursor.start()]  # cursor after each accepted non-EOS token
        self._view: tuple[torch.Tensor, int, np.ndarray] | None = None  # the last bitmask filled, as uint32 words

    @property
    def backend(self) -> GrammarBackend:
        return self._backend

    # -- state queries -------------------------------------------------------------------------------------
    def is_terminated(self) -> bool:
        """True once EOS has been accepted."""
        return self._terminated

    def is_accepting(self) -> bool:
        """True when EOS is allowed now (the output so far is a complete, valid instance)."""
        return not self._terminated and self._eos_allowed()

    @property
    def num_tokens(self) -> int:
        return len(self._history)

    @property
    def text(self) -> bytes:
        """The bytes emitted so far (only tracked for JSON schemas)."""
        return bytes(self._text)

    # -- advancing -----------------------------------------------------------------------------------------
    def accept(self, token: int) -> bool:
        """Advance by one token; returns False (and leaves the state unchanged) if it is not allowed."""
        if self._terminated:
            return False
        if token in self._eos:
            if not self._eos_allowed():
                return False
            self._terminated = True
            self._history.append(token)
            return True
        if not self._state.try_consume(token):
            self._library_failed()
            return False
        if self._guard is not None:
            piece = self._backend.token_bytes()[token]
            cursor = self._guard.advance(self._text, self._cursors[-1], piece)
            if cursor is None:
                self._state.rollback(1)
                return False
            self._text += piece
            self._cursors.append(cursor)
        self._history.append(token)
        return True

    def accept_tokens(self, tokens: list[int]) -> int:
        """Accept tokens in order until one is refused; returns how many were accepted (kept)."""
        n = 0
        for t in tokens:
            if not self.accept(t):
                break
            n += 1
        return n

    def validate(self, tokens: list[int]) -> int:
        """Length of the longest prefix of `tokens` (e.g. a draft) that could be accepted; state unchanged."""
        if self._guard is None and not self._terminated and not any(t in self._eos for t in tokens):
            return self._state.validate(tokens)
        n = self.accept_tokens(tokens)
        self.rollback(n)
        return n

    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens (e.g. drafts the verifier rejected)."""
        if n < 0 or n > len(self._history):
            raise ValueError(f"cannot roll back {n} of {len(self._history)} tokens")
        grammar_tokens = 0
        for token in self._history[len(self._history) - n :]:
            if token in self._eos and self._terminated:
                self._terminated = False
            else:
                grammar_tokens += 1
        del self._history[len(self._history) - n :]
        self._state.rollback(grammar_tokens)
        if self._guard is not None and grammar_tokens:
            del self._cursors[len(self._cursors) - grammar_tokens :]
            del self._text[self._cursors[-1].length :]
        self.error = None

    def reset(self) -> None:
        self.rollback(len(self._history))

    # -- masks -----------------------------------------------------------------------------------------------
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (CPU int32 [rows, ceil(V/32)])."""
        words = self._words(bitmask, row)
        if self._terminated:
            words[:] = 0
            self._set_eos(words, True)
            return
        self._state.fill(bitmask, row)
        if self._library_failed():
            words[:] = 0
            self._set_eos(words, True)  # keep the row samplable; the engine ends the request with `error`
            return
        accepting = self._state.is_accepting()
        eos_ok = accepting and self._document_ok()
        if accepting or not self._eos_is_native:    # (not accepting: the library left its EOS bit clear)
            self._set_eos(words, eos_ok)
        if self._guard is None:
            return
        cleared = self._guard.restrict(words, self._text, self._cursors[-1], self._backend)
        if (cleared or accepting and not eos_ok) and not words.any():
            # Dead end: nothing leads to a valid instance. Keep the row samplable (EOS) and say so.
            self.error = "no continuation of the output can satisfy the JSON schema"
            self._set_eos(words, True)

    def fill_bitmasks(self, bitmask: torch.Tensor, row: int, drafts: Sequence[int] = ()) -> int:
        """Fill one row per position: before drafts[0], after each accepted draft token (the last is the bonus).

        Stops at the first draft token the grammar refuses; returns n, the number of valid drafts, having
        written rows row .. row+n. The matcher is left where it started.
        """
        self.fill_bitmask(bitmask, row)
        n = 0
        for token in drafts:
            if not self.accept(token):
                break
            n += 1
            self.fill_bitmask(bitmask, row + n)
        self.rollback(n)
        return n

    def native_job(self, row: int, drafts: Sequence[int]) -> tuple[Any, int, list[int]] | None:
        """(library matcher, row, valid drafts) when the library can fill this matcher's rows natively in
        parallel with others (see `fill_bitmasks`), else None."""
        if not self._native_ok or self._terminated or any(t in self._eos for t in drafts):
            return None
        drafts = list(drafts)
        return (self._state.native, row, drafts[: self._state.validate(drafts)])  # type: ignore[attr-defined]

    def finish_native(self, bitmask: torch.Tensor, row: int, drafts: Sequence[int]) -> None:
        """After a native fill of rows row .. row+len(drafts): apply rule A (EOS only for a valid document)."""
        if self._library_failed():
            words = self._words(bitmask, row)
            words[:] = 0
            self._set_eos(words, True)
            return
        if self._guard is None:
            return
        pieces = self._backend.token_bytes()
        text = bytes(self._text)
        eos = self._eos[0]
        for i in range(len(drafts) + 1):
            if i:
                text += pieces[drafts[i - 1]]
            words = self._words(bitmask, row + i)      # (numpy: no PyTorch op in the fill thread)
            if int(words[eos >> 5]) >> (eos & 31) & 1 and not self._guard.document_ok(text):
                self._set_eos(words, False)

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar allows as the only continuation (jump-forward), to be proposed as drafts."""
        if self._terminated:
            return []
        tokens = self._state.forced_tokens()
        if self._guard is not None and tokens:
            tokens = tokens[: self.validate(tokens)]
        return tokens

    # -- internals -------------------------------------------------------------------------------------------
    def _library_failed(self) -> bool:
        """True (and `error` set to the library's own message) once the library stopped with an error."""
        message = self._state.error()
        if message is None:
            return False
        self.error = f"{self._backend.library}: {message}"
        return True

    def _eos_allowed(self) -> bool:
        return self._state.is_accepting() and self._document_ok()

    def _document_ok(self) -> bool:
        """The output so far is a document the schema accepts (rule A), or there is no schema to check."""
        return self._guard is None or self._guard.document_ok(bytes(self._text))

    def _words(self, bitmask: torch.Tensor, row: int) -> np.ndarray:
        """A CPU bitmask row as uint32 words, sharing its memory. The whole bitmask's view is kept for the next
        row: indexing a tensor and converting it costs ~10 us, a sixth of a guarded row's own work."""
        view = self._view
        if view is None or view[0] is not bitmask or view[1] != bitmask.data_ptr():
            view = self._view = (bitmask, bitmask.data_ptr(), bitmask.numpy().view(np.uint32))
        return view[2][row]

    def _set_eos(self, words: np.ndarray, allowed: bool) -> None:
        for t in self._eos:
            word, bit = t >> 5, t & 31
            if word < words.shape[0]:
                if allowed:
                    words[word] |= np.uint32(1 << bit)
                else:
                    words[word] &= np.uint32(~(1 << bit) & 0xFFFFFFFF)

