"""Per-request grammar matcher (the DESIGN "Grammar matcher" contract) and its validator-guided guard.

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

import json
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Sequence

import jsonschema
import jsonschema.validators
import numpy as np
import torch

if TYPE_CHECKING:
    from leapdecode.structured.backend import CompiledGrammar, GrammarBackend, _LibState

__all__ = ["Matcher", "SchemaGuard"]


class Matcher:
    """One request's position in its grammar. Not thread-safe; one owner (the engine's step) at a time.

    Contract (DESIGN.md): validate(tokens) -> n, accept(token) -> bool, rollback(n), fill_bitmask(bitmask, row),
    forced_tokens() -> list[int], is_terminated(). Every token whose bit fill_bitmask sets is accepted by
    accept(); the converse need not hold (where the grammar forces bytes, llguidance's mask offers only their
    canonical tokenization, while accept() takes any tokenization of valid text, e.g. a draft's).
    """

    def __init__(self, state: _LibState, backend: GrammarBackend, compiled: CompiledGrammar) -> None:
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
            and (self._guard is None or not self._guard.anchors)
        )
        self._history: list[int] = []  # accepted tokens, EOS included
        self._terminated = False
        self.error: str | None = None  # set when no token can continue to a valid instance (see module doc)
        self._text = bytearray()  # emitted bytes (kept only with a guard)
        self._cursors: list[_Cursor] = [_Cursor.start()]  # cursor after each accepted non-EOS token

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
        if self._terminated:
            bitmask[row].zero_()
            self._set_eos(bitmask, row, True)
            return
        self._state.fill(bitmask, row)
        self._set_eos(bitmask, row, self._eos_allowed())
        if self._guard is not None:
            self._guard.restrict(bitmask[row], self._text, self._cursors[-1], self._backend)
            if not bitmask[row].numpy().any():
                # Dead end: nothing leads to a valid instance. Keep the row samplable (EOS) and say so.
                self.error = "no continuation of the output can satisfy the JSON schema"
                self._set_eos(bitmask, row, True)

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
        if self._guard is None:
            return
        pieces = self._backend.token_bytes()
        text = bytes(self._text)
        eos = self._eos[0]
        for i in range(len(drafts) + 1):
            if i:
                text += pieces[drafts[i - 1]]
            word = int(bitmask[row + i, eos >> 5]) & 0xFFFFFFFF
            if word >> (eos & 31) & 1 and not self._guard.document_ok(text):
                self._set_eos(bitmask, row + i, False)

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar allows as the only continuation (jump-forward), to be proposed as drafts."""
        if self._terminated:
            return []
        tokens = self._state.forced_tokens()
        if self._guard is not None and tokens:
            tokens = tokens[: self.validate(tokens)]
        return tokens

    # -- internals -------------------------------------------------------------------------------------------
    def _eos_allowed(self) -> bool:
        if not self._state.is_accepting():
            return False
        return self._guard is None or self._guard.document_ok(bytes(self._text))

    def _set_eos(self, bitmask: torch.Tensor, row: int, allowed: bool) -> None:
        words = bitmask[row].numpy().view(np.uint32)  # CPU bitmask; shares memory
        for t in self._eos:
            word, bit = divmod(t, 32)
            if word < words.shape[0]:
                if allowed:
                    words[word] |= np.uint32(1 << bit)
                else:
                    words[word] &= np.uint32(~(1 << bit) & 0xFFFFFFFF)


# ============================================================================================ validator guard
_OPEN = frozenset(b"[{")
_CLOSE = frozenset(b"]}")
_WS = frozenset(b" \t\r\n")
_LITERALS = (b"true", b"false", b"null")
# Keywords the guard knows how to anchor; `dropped` notes name them (see `_guarded_keys`).
_GUARDED_KEYWORDS = {
    "uniqueItems", "not", "if", "then", "else", "contains", "minContains", "maxContains", "dependentRequired",
    "dependentSchemas", "dependencies", "propertyNames", "unevaluatedProperties", "unevaluatedItems", "oneOf",
    "pattern", "format", "multipleOf", "minProperties", "maxProperties", "patternProperties",
}


@dataclass
class _Frame:
    """One open container (or the root) in the JSON text being generated."""

    kind: int  # ord("{"), ord("["), or 0 for the root
    start: int  # offset of the bracket
    index: int = 0  # array: current element index
    key: str | None = None  # object: key of the current member
    expect_key: bool = False  # object: the next string is a key
    value_start: int = -1  # offset of an unfinished scalar value
    has_value: bool = False  # the current element/member has a complete value

    def step(self) -> Any:
        return self.key if self.kind == ord("{") else self.index


@dataclass(frozen=True)
class _Cursor:
    """Where the JSON text stands: open containers and string state. Immutable, so rollback keeps old ones."""

    frames: tuple[_Frame, ...]
    length: int  # bytes consumed
    in_string: bool = False
    escape: bool = False
    string_start: int = -1
    string_is_key: bool = False

    @staticmethod
    def start() -> _Cursor:
        return _Cursor((_Frame(0, 0),), 0)

    def path(self, depth: int) -> tuple[Any, ...]:
        """Instance path of the value being built inside frames[depth] (frames[0] is the root)."""
        return tuple(self.frames[i].step() for i in range(1, depth + 1))


@dataclass
class _Anchor:
    """A subschema that applies at a fixed instance path ("*" matches any array index)."""

    pattern: tuple[Any, ...]
    validator: Any  # the whole subschema (None for the root: the document check covers it)
    monotone: Any = None  # validator for the monotone keywords only, run on partial containers
    names: Any = None  # propertyNames validator, run on each key as it closes

    def matches(self, path: tuple[Any, ...]) -> bool:
        return len(path) == len(self.pattern) and all(
            p == s or (p == "*" and isinstance(s, int)) for p, s in zip(self.pattern, path)
        )

    def compatible(self, path: tuple[Any, ...]) -> bool:
        return all(p == s or (p == "*" and isinstance(s, int)) for p, s in zip(self.pattern, path))


class SchemaGuard:
    """Checks, with jsonschema, what the compiled grammar does not enforce (see the module docstring).

    max_checks bounds the candidate tokens checked per mask row (each costs a jsonschema validation); beyond
    it, the longest candidates are masked out, which keeps every row's cost bounded on large vocabularies.
    """

    max_checks = 64

    def __init__(self, schema: dict[str, Any] | bool, dropped: tuple[str, ...] = ()) -> None:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        self.validator = cls(schema, format_checker=_format_checker(cls))
        probe_schema(self.validator)
        self.dropped = dropped
        self._doc_cache: dict[bytes, bool] = {}
        self._event_cache: dict[tuple[Any, ...], bool] = {}  # mask fills and accept() see the same events
        self.anchors: list[_Anchor] = _find_anchors(schema, self.validator, dropped) if dropped else []

    # -- rule A --------------------------------------------------------------------------------------------
    def document_ok(self, text: bytes) -> bool:
        """Is `text` a complete JSON document that validates against the schema?"""
        ok = self._doc_cache.get(text)
        if ok is None:
            try:
                value = json.loads(text)
            except ValueError:
                ok = False
            else:
                ok = _is_valid(self.validator, value)
            if len(self._doc_cache) > 4096:
                self._doc_cache.clear()
            self._doc_cache[text] = ok
        return ok

    # -- rules B and C ---------------------------------------------------------------------------------------
    def advance(self, text: bytearray, cursor: _Cursor, piece: bytes) -> _Cursor | None:
        """Cursor after appending `piece`, or None if that closes a value/key/element the schema forbids."""
        if not self.anchors:
            return replace(cursor, length=cursor.length + len(piece))
        buf = bytes(text) + piece
        return _scan(buf, cursor, piece, self)

    def restrict(self, row: torch.Tensor, text: bytearray, cursor: _Cursor, backend: GrammarBackend) -> None:
        """Clear, in one mask row, the tokens that `advance` would refuse."""
        if not self.anchors:
            return
        path = cursor.path(len(cursor.frames) - 1)
        relevant = [a for a in self.anchors if a.compatible(path)]
        if not relevant:
            return
        words = row.numpy().view(np.uint32)  # shares memory with the tensor row
        allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[: backend.vocab_size].astype(bool)
        depth = len(cursor.frames) - 1
        marks = backend.byte_marks()
        if depth == 0:  # top-level scalar: a string closes on its quote, a literal on its last letter
            interesting = marks.quote | marks.literal_end
        else:
            # A token matters only if it produces an event that a relevant anchor looks at: a value closing at
            # the current path or deeper (quote/comma/bracket), an element of an ancestor closing (comma), a
            # key closing (quote), or enough brackets to close the container an anchor sits on.
            here = any(len(a.pattern) >= depth for a in relevant)
            closes = min(max(depth - len(a.pattern), 1) for a in relevant)
            interesting = marks.close_count >= closes
            if here or any(a.monotone is not None for a in relevant):
                interesting = interesting | marks.comma
            if here or any(a.names is not None for a in relevant):
                interesting = interesting | marks.quote
        if cursor.in_string:
            interesting = interesting & marks.quote  # nothing counts before the string is closed
        candidates = np.flatnonzero(allowed & interesting)
        if len(candidates) > self.max_checks:
            # Bound the work per row: check the shortest tokens (the bare quote/bracket/comma among them) and
            # mask out the rest. Only an under-approximation: the model can still close the value with the
            # short tokens; it never lets an invalid token through.
            order = np.argsort(marks.length[candidates], kind="stable")
            for t in candidates[order[self.max_checks :]]:
                words[t >> 5] &= np.uint32(~(1 << int(t & 31)) & 0xFFFFFFFF)
            candidates = candidates[order[: self.max_checks]]
        token_bytes = backend.token_bytes()
        buf = bytes(text)
        for t in candidates:
            piece = token_bytes[t]
            if _scan(buf + piece, cursor, piece, self) is None:
                words[t >> 5] &= np.uint32(~(1 << int(t & 31)) & 0xFFFFFFFF)

    # -- event checks ----------------------------------------------------------------------------------------
    def value_ok(self, path: tuple[Any, ...], raw: bytes) -> bool:
        key = ("v", path, raw)
        ok = self._event_cache.get(key)
        if ok is None:
            ok = self._event_cache[key] = self._value_ok(path, raw)
            if len(self._event_cache) > 65536:
                self._event_cache.clear()
        return ok

    def _value_ok(self, path: tuple[Any, ...], raw: bytes) -> bool:
        value: Any = _MISSING
        for anchor in self.anchors:
            if anchor.matches(path):
                if value is _MISSING:
                    try:
                        value = json.loads(raw)
                    except ValueError:
                        return True  # not JSON yet (the grammar decides); nothing to check
                if not _is_valid(anchor.validator or self.validator, value):
                    return False
        return True

    def partial_ok(self, path: tuple[Any, ...], raw: bytes) -> bool:
        value: Any = _MISSING
        for anchor in self.anchors:
            if anchor.monotone is not None and anchor.matches(path):
                if value is _MISSING:
                    try:
                        value = json.loads(raw)
                    except ValueError:
                        return True
                if not _is_valid(anchor.monotone, value):
                    return False
        return True

    def key_ok(self, path: tuple[Any, ...], key: str) -> bool:
        return all(_is_valid(a.names, key) for a in self.anchors if a.names is not None and a.matches(path))


_MISSING = object()
# Formats whose jsonschema checker is too slow to run per candidate token (rfc3987-syntax parses IRIs with a
# general Earley parser: up to ~100 ms a string). They are left to the grammar (which does not know them).
_SLOW_FORMATS = frozenset({"iri", "iri-reference"})


def _format_checker(cls: Any) -> jsonschema.FormatChecker:
    """The draft's format checker (formats are asserted), without the slow ones."""
    checker = jsonschema.FormatChecker(formats=())
    checker.checkers = {k: v for k, v in cls.FORMAT_CHECKER.checkers.items() if k not in _SLOW_FORMATS}
    return checker


def _is_valid(validator: Any, value: Any) -> bool:
    """jsonschema's verdict; a schema error surfacing only now (e.g. an unresolvable nested $ref) counts as
    invalid, so the guard errs towards refusing text rather than crashing the engine or passing bad output."""
    try:
        return bool(validator.is_valid(value))
    except Exception:  # noqa: BLE001 - referencing errors, RecursionError, re.error from exotic patterns
        return False


def probe_schema(validator: Any) -> None:
    """Raise ValueError now for schema problems jsonschema only notices while validating (unresolvable $ref)."""
    for value in (None, True, 0, 0.5, "", [], {}):
        try:
            validator.is_valid(value)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"the schema cannot be checked by jsonschema: {e}") from None


def _scan(buf: bytes, cursor: _Cursor, piece: bytes, guard: SchemaGuard) -> _Cursor | None:
    """Feed `piece` (the tail of `buf`) through the cursor, checking each closing event; None on violation."""
    frames = list(cursor.frames)
    copied = [False] * len(frames)

    def top() -> _Frame:  # copy-on-write, so earlier cursors stay valid for rollback
        if not copied[-1]:
            frames[-1] = replace(frames[-1])
            copied[-1] = True
        return frames[-1]

    def path_of(depth: int) -> tuple[Any, ...]:
        return tuple(frames[i].step() for i in range(1, depth + 1))

    in_string, escape = cursor.in_string, cursor.escape
    string_start, string_is_key = cursor.string_start, cursor.string_is_key
    base = len(buf) - len(piece)
    for offset, c in enumerate(piece):
        pos = base + offset
        if in_string:
            if escape:
                escape = False
            elif c == 0x5C:  # backslash
                escape = True
            elif c == 0x22:  # closing quote
                in_string = False
                f = top()
                raw = buf[string_start : pos + 1]
                if string_is_key:
                    try:
                        f.key = json.loads(raw)
                    except ValueError:
                        f.key = raw.decode("utf-8", "replace")
                    f.expect_key = False
                    if not guard.key_ok(path_of(len(frames) - 2), f.key):
                        return None
                else:
                    f.has_value = True
                    if not guard.value_ok(path_of(len(frames) - 1), raw):
                        return None
            continue
        if c == 0x22:
            in_string, string_start = True, pos
            string_is_key = frames[-1].kind == ord("{") and frames[-1].expect_key
        elif c in _OPEN:
            frames.append(_Frame(c, pos, expect_key=c == ord("{")))
            copied.append(True)
        elif c in _CLOSE or c == ord(","):
            f = top()
            depth = len(frames) - 1
            if f.value_start >= 0:  # a number or literal ends here
                if not guard.value_ok(path_of(depth), buf[f.value_start : pos]):
                    return None
                f.value_start, f.has_value = -1, True
            if c == ord(","):
                if f.has_value and not guard.partial_ok(path_of(depth - 1), buf[f.start : pos] + bytes([f.kind + 2])):
                    return None
                f.index += 1
                f.key, f.expect_key, f.has_value = None, f.kind == ord("{"), False
            elif depth > 0:
                frames.pop()
                copied.pop()
                if not guard.value_ok(path_of(depth - 1), buf[f.start : pos + 1]):
                    return None
                parent = top()
                parent.has_value = True
        elif c in _WS or c == ord(":"):
            pass  # our grammars emit compact JSON; whitespace between tokens carries no structure
        else:  # part of a number or literal
            f = top()
            if f.value_start < 0:
                f.value_start = pos
            if len(frames) == 1 and buf[f.value_start : pos + 1] in _LITERALS:
                if not guard.value_ok((), buf[f.value_start : pos + 1]):
                    return None
    return _Cursor(tuple(frames), len(buf), in_string, escape, string_start, string_is_key)


def _guarded_keys(dropped: tuple[str, ...]) -> set[str]:
    """Map the backend's `dropped` notes ("uniqueItems", "oneOf (compiled as anyOf)", "Unknown format: x")
    to schema keywords; an unrecognised note guards every known keyword (conservative)."""
    keys: set[str] = set()
    for note in dropped:
        word = note.split(" ")[0].strip(":")
        if word in _GUARDED_KEYWORDS:
            keys.add(word)
        elif note.lower().startswith("unknown format"):
            keys.add("format")
        else:
            keys |= _GUARDED_KEYWORDS
    if keys & {"if", "then", "else"}:
        keys |= {"if", "then", "else"}
    if keys & {"contains", "minContains", "maxContains"}:
        keys |= {"contains", "minContains", "maxContains"}
    return keys


def _find_anchors(schema: Any, validator: Any, dropped: tuple[str, ...]) -> list[_Anchor]:
    """Root anchor plus one per subschema (at a fixed instance path) that uses a keyword the grammar dropped."""
    keys = _guarded_keys(dropped)
    anchors = [_Anchor((), None)]
    seen: set[tuple[int, tuple[Any, ...]]] = set()

    def walk(node: Any, pattern: tuple[Any, ...], depth: int) -> None:
        if not isinstance(node, dict) or depth > 32 or (id(node), pattern) in seen:
            return
        seen.add((id(node), pattern))
        used = keys & node.keys()
        if used:
            anchor = anchors[0] if not pattern else _Anchor(pattern, validator.evolve(schema=node))
            monotone = _monotone_part(node)
            if monotone:
                anchor.monotone = validator.evolve(schema=monotone)
            if "propertyNames" in node:
                anchor.names = validator.evolve(schema=node["propertyNames"])
            if pattern:
                anchors.append(anchor)
        for name, sub in (node.get("properties") or {}).items() if isinstance(node.get("properties"), dict) else ():
            walk(sub, pattern + (name,), depth + 1)
        items = node.get("items")
        if isinstance(items, dict) and not node.get("prefixItems"):  # with prefixItems it covers only a tail
            walk(items, pattern + ("*",), depth + 1)
        elif isinstance(items, list):
            for i, sub in enumerate(items):
                walk(sub, pattern + (i,), depth + 1)
        for i, sub in enumerate(node.get("prefixItems") or []):
            walk(sub, pattern + (i,), depth + 1)
        for sub in node.get("allOf") or []:
            walk(sub, pattern, depth + 1)
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            walk(_resolve_local(schema, ref), pattern, depth + 1)

    walk(schema, (), 0)
    return anchors


def _monotone_part(node: dict[str, Any]) -> dict[str, Any]:
    """The keywords of `node` whose violation on a partial container can never be repaired by adding more."""
    part: dict[str, Any] = {}
    if node.get("uniqueItems") is True:
        part["uniqueItems"] = True
    if "contains" in node and "maxContains" in node:
        part.update(contains=node["contains"], maxContains=node["maxContains"], minContains=0)
    if "propertyNames" in node:
        part["propertyNames"] = node["propertyNames"]
    return part


def _resolve_local(root: Any, ref: str) -> Any:
    """Resolve "#/a/b" inside `root` (JSON pointer); None when it is not a plain local pointer."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
