"""The validator guard: enforce with `jsonschema` what the compiled grammar does not (see matcher.py's docstring
for rules A, B and C, and README.md for the per-keyword list).

`SchemaGuard` holds the schema's validator, the document check (rule A), and the *anchors*: subschemas at a fixed
instance path that use a keyword the grammar dropped. `Cursor` and `_scan` are an incremental, byte-level JSON
scanner over the text being generated: it reports each value, key and array element as it closes, so the
guard can refuse the token that would close an invalid one (rules B and C). `TokenMarks` tells, per token, which
structural bytes it holds, so a mask row is only checked on the tokens that can close something.

This is a second, hand-written grammar engine beside the library's; it is kept in this one module so it can be
dropped if the grammar library grows the keywords.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterator

import jsonschema
import jsonschema.validators
import numpy as np

from leapdecode.structured.lowering import ANNOTATIONS, LOCATIONS, catch_all, check_deadline, iter_subschemas, \
    keyword_nodes, redundant_beside_ref, resolve_local_ref

if TYPE_CHECKING:
    from leapdecode.structured.backend import GrammarBackend

__all__ = ["Cursor", "FreeOrder", "SchemaGuard", "TokenMarks", "TokenStructure", "free_order_sites", "probe_schema",
           "universal_types"]

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


@dataclass(frozen=True, eq=False)
class TokenMarks:
    """Per-token arrays over the vocabulary: what JSON structure a token's bytes contain, each also packed into
    bitmask words (bit t of word t // 32), so a mask row's candidates are found with a few word-wise ANDs."""

    quote: np.ndarray
    comma: np.ndarray
    close_count: np.ndarray
    literal_end: np.ndarray
    length: np.ndarray
    packed: dict[str, np.ndarray]  # "quote", "comma", "literal_end", "open_close", "all", "close>=k" (k = 1..8)
    pieces: list[bytes]

    @staticmethod
    def build(pieces: list[bytes]) -> "TokenMarks":
        quote = np.array([b'"' in p for p in pieces], dtype=bool)
        comma = np.array([b"," in p for p in pieces], dtype=bool)
        close_count = np.array([p.count(b"]") + p.count(b"}") for p in pieces], dtype=np.int32)
        literal_end = np.array([p[-1:] in (b"e", b"l") for p in pieces], dtype=bool)
        open_close = np.array([b"{" in p and b"}" in p[p.index(b"{"):] for p in pieces], dtype=bool)
        packed = {"quote": _pack(quote), "comma": _pack(comma), "literal_end": _pack(literal_end),
                  "open_close": _pack(open_close),
                  "all": _pack(np.ones(len(pieces), dtype=bool))}
        for k in range(1, 9):
            packed[f"close>={k}"] = _pack(close_count >= k)
        return TokenMarks(quote, comma, close_count, literal_end, np.array([len(p) for p in pieces], dtype=np.int32),
                          packed, pieces)

    def closes(self, k: int) -> np.ndarray:
        return self.packed[f"close>={min(k, 8)}"]

    def containing(self, needle: bytes, anywhere: bool) -> np.ndarray:
        """Ids of the tokens whose bytes contain `needle` (anywhere, or at their start), found with bytes.find
        over the tokens joined (a C loop, not a Python one over the vocabulary); a needle with a quote searches
        only the tokens that have one (~2% of a vocabulary). Cached: the answer depends on the vocabulary
        only, so every grammar of the backend shares it."""
        hit = self.found.get((needle, anywhere))
        if hit is not None:
            return hit
        blob, starts, ids = self.joined_quoted if b'"' in needle else self.joined
        found: set[int] = set()
        pos = blob.find(needle)
        while pos >= 0:
            i = int(np.searchsorted(starts, pos, side="right")) - 1
            token = int(ids[i]) if ids is not None else i
            if pos + len(needle) <= starts[i] + self.length[token] and (anywhere or pos == starts[i]):
                found.add(token)
            pos = blob.find(needle, pos + 1)
        return self._keep((needle, anywhere), np.array(sorted(found), dtype=np.int64))

    def prefixes(self, text: bytes) -> np.ndarray:
        """Ids of the tokens whose bytes are a non-empty prefix of `text` (cached like `containing`)."""
        hit = self.found.get((text, None))
        if hit is None:
            hit = self._keep((text, None), np.array([t for i in range(1, len(text) + 1) for t in self.ids_of(text[:i])],
                                                    dtype=np.int64))
        return hit

    def _keep(self, key: tuple[bytes, bool | None], ids: np.ndarray) -> np.ndarray:
        """Cache an answer of `containing` / `prefixes` (bounded: cleared when full)."""
        if len(self.found) > 65536:
            self.found.clear()
        self.found[key] = ids
        return ids

    def warm(self) -> "TokenMarks":
        """Build every lazy table now (start-up), so that none is built inside a mask fill."""
        self.structure, self.by_bytes, self.joined, self.joined_quoted  # noqa: B018
        return self

    def ids_of(self, piece: bytes) -> list[int]:
        """The tokens whose bytes are exactly `piece`."""
        return self.by_bytes.get(piece, [])

    @functools.cached_property
    def by_bytes(self) -> dict[bytes, list[int]]:
        out: dict[bytes, list[int]] = {}
        for t, piece in enumerate(self.pieces):
            out.setdefault(piece, []).append(t)
        return out

    @functools.cached_property
    def structure(self) -> TokenStructure:
        """What each token writes as JSON structure (see `TokenStructure`); built once per vocabulary."""
        texts: list[bytes] = []
        index: dict[bytes, int] = {}

        def intern(b: bytes) -> int:
            i = index.get(b)
            if i is None:
                i = index[b] = len(texts)
                texts.append(b)
            return i

        in_string = np.full(len(self.pieces), -1, dtype=np.int32)
        outside = np.empty(len(self.pieces), dtype=np.int32)
        string_exit = np.zeros(len(self.pieces), dtype=bool)
        key_exit = np.zeros(len(self.pieces), dtype=bool)
        for t, piece in enumerate(self.pieces):
            outside[t] = intern(_strip_whitespace(piece))
            q = _closing_quote(piece) if b'"' in piece else -1
            if q >= 0:
                tail = _strip_whitespace(piece[q + 1 :])
                in_string[t] = intern(b'"' + tail)
                string_exit[t] = b"," in tail or b"]" in tail or b"}" in tail
                key_exit[t] = string_exit[t] or tail.count(b'"') >= 2
        return TokenStructure(in_string, outside, texts, _pack(string_exit), _pack(key_exit))

    @functools.cached_property
    def found(self) -> dict[tuple[bytes, bool | None], np.ndarray]:
        return {}  # the answers of `containing` and `prefixes`

    @functools.cached_property
    def joined(self) -> tuple[bytes, np.ndarray, None]:
        return _join(self.pieces) + (None,)

    @functools.cached_property
    def joined_quoted(self) -> tuple[bytes, np.ndarray, np.ndarray]:
        ids = np.flatnonzero(self.quote)
        return _join([self.pieces[t] for t in ids.tolist()]) + (ids,)


def _join(pieces: list[bytes]) -> tuple[bytes, np.ndarray]:
    """The pieces joined by NUL bytes, and where each starts."""
    starts = np.zeros(len(pieces), dtype=np.int64)
    np.cumsum([len(p) + 1 for p in pieces[:-1]], out=starts[1:])
    return b"\x00".join(pieces), starts


@dataclass(frozen=True, eq=False)
class TokenStructure:
    """Per token, an id of the JSON structure it writes, into `texts`: read from inside a string (the bytes from
    the string's closing quote on; -1 when it does not close it) and from outside any string, whitespace outside
    strings dropped (it carries no structure). Tokens with the same id get the same verdict from the guard
    wherever that verdict reads no earlier text (`SchemaGuard.restrict`). Packed: the tokens that, read inside
    a string, close it and then write a comma or a bracket (`string_exit`), or that, closing a key, go on to
    close something more: a comma, a bracket, or a string value's closing quote (`key_exit`)."""

    in_string: np.ndarray
    outside: np.ndarray
    texts: list[bytes]
    string_exit: np.ndarray
    key_exit: np.ndarray


_NO_TOKENS = np.zeros(0, dtype=np.int64)
_UNPLANNED = object()


@dataclass(frozen=True, eq=False)
class _Plan:
    """What a mask row is checked on at one cursor: a packed token set, token ids found by content, token ids
    refused as they are (only inside a key), and whether every byte of a key matters (a closed object's key)."""

    interesting: np.ndarray | None
    extra: np.ndarray
    refused: list[np.ndarray]
    closed_key: bool


@dataclass(eq=False)
class _Verdicts:
    """What the guard knows under one cursor signature: the verdict of each structure class, and (packed, like a
    mask row) the tokens judged so far and all but those refused."""

    classes: dict[int, bool]
    known: np.ndarray
    kept: np.ndarray  # every bit set but the refused tokens' (a row is ANDed with it)
    any_refused: bool = False
    pending: np.ndarray | None = None  # the plan's `interesting` tokens not judged yet


def _set_bits(words: np.ndarray, ids: np.ndarray) -> None:
    if ids.size:
        np.bitwise_or.at(words, ids >> 5, np.uint32(1) << (ids & 31).astype(np.uint32))


def _clear_bits(words: np.ndarray, ids: np.ndarray) -> None:
    if ids.size:
        np.bitwise_and.at(words, ids >> 5, ~(np.uint32(1) << (ids & 31).astype(np.uint32)))


@functools.lru_cache(maxsize=65536)
def _escaped(name: str) -> bytes:
    """A key as its JSON string writes it, without the quotes."""
    return json.dumps(name, ensure_ascii=False)[1:-1].encode()


def _key_text(raw: bytes) -> str:
    """The name written by a JSON string (quotes included in `raw`); without escapes it is the bytes between."""
    if b"\\" not in raw:
        try:
            return raw[1:-1].decode("utf-8")
        except UnicodeDecodeError:
            pass
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")


def _closing_quote(piece: bytes) -> int:
    """Offset of the first unescaped quote in `piece` (read from inside a string, not after a backslash)."""
    q = piece.find(b'"')
    if q < 0 or b"\\" not in piece[:q]:
        return q
    escape = False
    for i, c in enumerate(piece):
        if escape:
            escape = False
        elif c == 0x5C:
            escape = True
        elif c == 0x22:
            return i
    return -1


def _strip_whitespace(piece: bytes) -> bytes:
    """`piece` (read from outside any string) without the whitespace outside strings."""
    if not any(c in piece for c in (b" ", b"\n", b"\t", b"\r")):
        return piece
    out = bytearray()
    in_string = escape = False
    for c in piece:
        if in_string:
            out.append(c)
            if escape:
                escape = False
            elif c == 0x5C:
                escape = True
            elif c == 0x22:
                in_string = False
        elif c not in _WS:
            out.append(c)
            in_string = c == 0x22
    return bytes(out)


def _union(a: np.ndarray | None, b: np.ndarray) -> np.ndarray:
    return b if a is None else a | b


def _pack(flags: np.ndarray) -> np.ndarray:
    """bool per token -> uint32 words, little-endian bit order (the bitmask layout)."""
    padded = np.zeros(-(-len(flags) // 32) * 32, dtype=bool)
    padded[: len(flags)] = flags
    return np.packbits(padded, bitorder="little").view(np.uint32)


@dataclass(slots=True)
class _Frame:
    """One open container (or the root) in the JSON text being generated."""

    kind: int  # ord("{"), ord("["), or 0 for the root
    start: int  # offset of the bracket
    index: int = 0  # array: current element index
    key: str | None = None  # object: key of the current member
    expect_key: bool = False  # object: the next string is a key
    value_start: int = -1  # offset of an unfinished scalar value
    has_value: bool = False  # the current element/member has a complete value
    keys: frozenset[str] = frozenset()  # object: the keys seen so far

    def step(self) -> Any:
        return self.key if self.kind == ord("{") else self.index

    def copy(self) -> _Frame:
        return _Frame(self.kind, self.start, self.index, self.key, self.expect_key, self.value_start, self.has_value,
                      self.keys)

    def signature(self) -> tuple[Any, ...]:
        """What the guard's free-order checks can depend on (not the offsets, which only locate raw text)."""
        return (self.kind, self.index, self.key, self.expect_key, self.has_value, self.value_start >= 0, self.keys)


@dataclass(frozen=True)
class Cursor:
    """Where the JSON text stands: open containers and string state. Immutable, so rollback keeps old ones."""

    frames: tuple[_Frame, ...]
    length: int  # bytes consumed
    in_string: bool = False
    escape: bool = False
    string_start: int = -1
    string_is_key: bool = False

    @staticmethod
    def start() -> Cursor:
        return Cursor((_Frame(0, 0),), 0)

    def path(self, depth: int) -> tuple[Any, ...]:
        """Instance path of the value being built inside frames[depth] (frames[0] is the root)."""
        return tuple(self.frames[i].step() for i in range(1, depth + 1))

    def signature(self, text: bytes | bytearray) -> tuple[Any, ...]:
        """Everything but raw text that a scan from here can depend on, plus the key typed so far: where no
        jsonschema anchor can see the text, two cursors with equal signatures give every piece the same verdict."""
        typed = bytes(text[self.string_start + 1 :]) if self.in_string and self.string_is_key else None
        return tuple(f.signature() for f in self.frames), self.in_string, self.escape, self.string_is_key, typed


@dataclass(frozen=True)
class _KeyStep:
    """A step of an instance-path pattern that matches object keys by rule, not by name: a map's values. With
    ``regex``, the keys it finds (a `patternProperties` entry); without, the keys not in ``declared`` (an
    `additionalProperties` subschema beside no pattern properties)."""

    regex: str | None = None
    declared: frozenset[str] = frozenset()

    def admits(self, key: str) -> bool:
        return _search(self.regex, key) if self.regex is not None else key not in self.declared


def _step_matches(p: Any, s: Any) -> bool:
    """Does the pattern step ``p`` ("*": any array index; a `_KeyStep`: keys by rule) match the path step ``s``?"""
    if p == s:
        return True
    if isinstance(s, int):
        return p == "*"
    return isinstance(p, _KeyStep) and s is not None and p.admits(s)    # (None: no key yet, as for a name)


def _matches(pattern: tuple[Any, ...], path: tuple[Any, ...]) -> bool:
    return len(path) == len(pattern) and all(_step_matches(p, s) for p, s in zip(pattern, path))


def _compatible(pattern: tuple[Any, ...], path: tuple[Any, ...]) -> bool:
    """Is one of the two a prefix of a path the other matches?"""
    return all(_step_matches(p, s) for p, s in zip(pattern, path))


@dataclass
class _Anchor:
    """A subschema that applies at a fixed instance path ("*" matches any array index)."""

    pattern: tuple[Any, ...]
    validator: Any  # the whole subschema (None for the root: the document check covers it)
    monotone: Any = None  # validator for the monotone keywords only, run on partial containers
    names: Any = None  # propertyNames validator, run on each key as it closes
    # The JSON types every value of which the subschema accepts (`universal_types`): a value of such a type
    # closing here needs no jsonschema call, and its verdict reads no earlier text (so it is shared).
    universal: frozenset[str] = frozenset()

    def matches(self, path: tuple[Any, ...]) -> bool:
        return _matches(self.pattern, path)

    def compatible(self, path: tuple[Any, ...]) -> bool:
        return _compatible(self.pattern, path)


@dataclass(frozen=True)
class _ObjectRule:
    """An object (at a fixed instance path) whose properties the grammar takes in any order (see
    `free_order_sites`): a key may not repeat, and the object closes only with every required key, and with the
    keys each of its keys requires (`dependentRequired`, draft 7's `dependencies` of names)."""

    pattern: tuple[Any, ...]
    required: frozenset[str]
    # When no other key is possible (additionalProperties false, no pattern properties): the declared names as
    # (JSON-escaped bytes, name), so that a key is refused as soon as it can only become a used name, and a
    # comma once every name is used (otherwise those would be dead ends).
    closed: tuple[tuple[bytes, str], ...] | None = None
    dependent: tuple[tuple[str, frozenset[str]], ...] = ()

    def missing(self, keys: frozenset[str]) -> bool:
        """Would closing the object with `keys` miss a key it needs?"""
        return bool(self.required - keys) or any(k in keys and not need <= keys for k, need in self.dependent)

    def matches(self, path: tuple[Any, ...]) -> bool:
        return _matches(self.pattern, path)

    def compatible(self, path: tuple[Any, ...]) -> bool:
        return _compatible(self.pattern, path)


class SchemaGuard:
    """Checks, with jsonschema, what the compiled grammar does not enforce (see the module docstring).

    Every candidate token of a mask row is checked (tokens that can close something the guard looks at); there
    is no bound on their number, so exactness never depends on one.
    """

    def __init__(self, schema: dict[str, Any] | bool, dropped: tuple[str, ...] = (),
                 free_order: FreeOrder | None = None) -> None:
        cls = _with_regex_module(jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator))
        self.validator = cls(schema, format_checker=_format_checker(cls))
        probe_schema(self.validator)
        self.dropped = dropped
        self._doc_cache: dict[bytes, bool] = {}
        self._event_cache: dict[tuple[Any, ...], bool] = {}  # mask fills and accept() see the same events
        self.anchors: list[_Anchor] = _find_anchors(schema, self.validator, dropped) if dropped else []
        free_order = free_order or FreeOrder({}, [])
        self.objects: list[_ObjectRule] = [
            _ObjectRule(pattern, *self._object_rule(node, pattern in in_union))
            for node, patterns, in_union in free_order.sites.values()
            for pattern in patterns
        ]
        for anchor in self.anchors:
            sub = schema if anchor.validator is None else anchor.validator.schema
            anchor.universal = universal_types(sub, schema, self.validator)
        self.anchors += [self._union_anchor(pattern, node) for node, patterns in free_order.unions
                         for pattern in patterns if pattern]
        if any(not pattern for _, patterns in free_order.unions for pattern in patterns) and not self.anchors:
            self.anchors.append(_Anchor((), None))  # a union at the root: the document check (rule B) covers it
        self._closed_objects = any(o.closed is not None for o in self.objects)
        # free-order objects and unions of them found per path (`_PathGraph`): their rules, made per path
        self._graph = free_order.graph
        self._graph_objects: dict[tuple[int, bool], tuple[frozenset[str], Any, Any]] = {}
        self._graph_unions: dict[int, _Anchor] = {}
        if self._graph is not None:
            for i, node in self._graph.sites.items():
                for branch in (False, True):
                    self._graph_objects[(i, branch)] = self._object_rule(node, branch)
                self._closed_objects = self._closed_objects or _closed(node) is not None
            self._graph_unions = {i: self._union_anchor((), node) for i, node in self._graph.unions.items()}
        self._at_cache: dict[tuple[Any, ...], tuple[list[_Anchor], list[_ObjectRule]]] = {}
        self._verdicts: dict[tuple[Any, ...], _Verdicts] = {}  # see `restrict`
        self._plans: dict[tuple[Any, ...], _Plan | None] = {}  # per cursor signature (see `restrict`)
        self._near_cache: dict[tuple[Any, ...], tuple[list[_Anchor], list[_ObjectRule]]] = {}
        self.active = bool(self.anchors or self.objects or self._graph)  # False: only rule A (the document check)

    def _object_rule(self, node: dict[str, Any], branch: bool) -> tuple[frozenset[str], Any, Any]:
        """A free-order object's rule but its pattern: (required, closed names, dependent keys); as a union's
        branch none of them (the union's anchor checks the rest)."""
        if branch:
            return frozenset(), None, ()
        required = frozenset(r for r in node.get("required", ()) if isinstance(r, str))
        return required, _closed(node), _dependent_required(node, type(self.validator).VALIDATORS)

    def _union_anchor(self, pattern: tuple[Any, ...], node: dict[str, Any]) -> _Anchor:
        """The anchor that validates a union of relaxed objects when its value closes. It checks objects: a value
        of a type the union takes none of came through another branch of an enclosing union (`{"anyOf":
        [{"$ref": "#/$defs/Probe"}, {"type": "null"}]}`, Probe a oneOf of objects: null was refused where it is
        valid), which the grammar enforces."""
        root = self.validator.schema
        anchor = _Anchor(pattern, self.validator.evolve(schema=node))
        anchor.universal = universal_types(node, root, self.validator) | _excluded_types(node, root)
        return anchor

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
    def advance(self, text: bytearray, cursor: Cursor, piece: bytes) -> Cursor | None:
        """Cursor after appending `piece`, or None if that closes a value/key/element the schema forbids."""
        if not self.active:
            return replace(cursor, length=cursor.length + len(piece))
        buf = bytes(text) + piece
        return _scan(buf, cursor, piece, self)

    def restrict(self, words: np.ndarray, text: bytearray, cursor: Cursor, backend: GrammarBackend) -> bool:
        """Clear, in one mask row (uint32 words, changed in place), the tokens that `advance` would refuse;
        False when certainly none was cleared."""
        if not self.active:
            return False
        cleared = False
        depth = len(cursor.frames) - 1
        # A verdict that read no text from before the token (no jsonschema anchor looked at it: `_scan`'s trace)
        # depends only on the cursor's signature and the structure the token writes (`TokenMarks.structure`: in a
        # string value, the bytes from its closing quote on; whitespace dropped), so it is computed once per
        # structure class and kept, per signature, across rows and requests (`_Verdicts`), with the tokens already
        # judged and those refused: a row seen again under a known signature only clears the known refusals and
        # looks at the tokens not judged yet. The rest are scanned one by one. (At depth 0 a literal's text
        # decides whether the root is checked, and a key's text is its name: neither is shared.) What to look at
        # (`_Plan`) is a function of the signature alone, kept for every row.
        signature = cursor.signature(text)
        plan_key = signature
        if signature[-1]:   # inside a key: the plan reads what was typed only against the object's used keys
            typed, keys = signature[-1], cursor.frames[-1].keys
            if not any(_escaped(k).startswith(typed) for k in keys):
                plan_key = signature[:-1] + (None,)
        plan = self._plans.get(plan_key, _UNPLANNED)
        if plan is _UNPLANNED:
            if len(self._plans) > 4096:
                self._plans.clear()
            plan = self._plans[plan_key] = self._plan(text, cursor, backend)
        memo: _Verdicts | None = None
        if depth > 0 and not cursor.escape and not (cursor.in_string and cursor.string_is_key):
            memo = self._verdicts.get(signature)
            if memo is None:
                if len(self._verdicts) > 1024:
                    self._verdicts.clear()
                memo = _Verdicts({}, np.zeros_like(words), np.full_like(words, 0xFFFFFFFF))
                self._verdicts[signature] = memo
                if plan is not None and plan.interesting is not None:
                    memo.pending = plan.interesting[: words.shape[0]].copy()
                if plan is not None and any(ids.size for ids in plan.refused):
                    _clear_bits(memo.kept, np.concatenate(plan.refused))    # refused as they are: kept packed
                    memo.any_refused = True
            if memo.any_refused:
                words &= memo.kept
                cleared = True
        if plan is None:
            return cleared
        interesting, extra, closed_key = plan.interesting, plan.extra, plan.closed_key
        refused = [] if memo is not None else list(plan.refused)   # (a signature's are in memo.kept)
        structure = backend.byte_marks().structure
        todo = _NO_TOKENS
        if interesting is not None:
            hit = words & (interesting[: words.shape[0]] if memo is None else memo.pending)
            hit = hit.view(np.uint64) if hit.shape[0] % 2 == 0 else hit
            nonzero = np.flatnonzero(hit) if hit.any() else _NO_TOKENS   # (most rows have no candidate)
            if nonzero.size:
                width = hit.dtype.itemsize * 8
                at = np.flatnonzero(np.unpackbits(hit[nonzero].view(np.uint8), bitorder="little"))
                todo = nonzero[at // width] * width + at % width
        if extra.size:
            live = words if memo is None else words & ~memo.known
            ids = extra[((live[extra >> 5] >> (extra & 31).astype(np.uint32)) & 1).astype(bool)]
            todo = np.concatenate([todo, ids])
        # Every candidate is checked (no bound on their number).
        buf = bytes(text) if todo.size else b""
        if todo.size and memo is not None:
            classes = (structure.in_string if cursor.in_string else structure.outside)[todo]
            todo = todo[classes >= 0]  # tokens that do not close the string write no structure: nothing to check
            classes = classes[classes >= 0]
            shared = memo.classes
            verdict: dict[int, int] = {}  # class -> 1 ok, 0 refused, -1 read earlier text
            for c in set(classes.tolist()):
                ok = shared.get(c)
                if ok is None:
                    trace: list[tuple[Any, ...]] = []
                    ok = _scan(buf + structure.texts[c], cursor, structure.texts[c], self, trace) is not None
                    if trace:
                        verdict[c] = -1
                        continue
                    shared[c] = ok
                verdict[c] = ok
            unknown = [c for c, v in verdict.items() if v < 0]
            is_unknown = np.isin(classes, unknown) if unknown else np.zeros(len(classes), dtype=bool)
            judged = todo[~is_unknown]
            _set_bits(memo.known, judged)
            if memo.pending is not None:
                _clear_bits(memo.pending, judged)
            bad = [c for c, v in verdict.items() if v == 0]
            if bad:
                out = todo[np.isin(classes, bad)]
                _clear_bits(memo.kept, out)
                memo.any_refused = True
                refused.append(out)
            todo = todo[is_unknown]
        if todo.size:  # one by one, sharing the verdict of tokens equal up to their last byte that closes something
            token_bytes = backend.token_bytes()
            verdicts: dict[bytes, bool] = {}
            bad = []
            for t in todo.tolist():
                piece = token_bytes[t]
                if closed_key or depth == 0 or self._closed_objects:  # there, every key byte can matter
                    key = piece
                else:
                    key = piece[: max(piece.rfind(b'"'), piece.rfind(b","), piece.rfind(b"]"), piece.rfind(b"}")) + 1]
                ok = verdicts.get(key)
                if ok is None:
                    ok = verdicts[key] = _scan(buf + key, cursor, key, self) is not None
                if not ok:
                    bad.append(t)
            refused.append(np.array(bad, dtype=np.int64))
        for ids in refused:
            if ids.size:
                _clear_bits(words, ids)
                cleared = True
        return cleared

    def _plan(self, text: bytearray, cursor: Cursor, backend: GrammarBackend) -> _Plan | None:
        """What a row must be checked on at this cursor (None: nothing), whatever the row allows (refusing a
        token the row does not allow changes nothing)."""
        path = cursor.path(len(cursor.frames) - 1)
        relevant, objects = self._near(path)
        if not relevant and not objects:
            return None
        depth = len(cursor.frames) - 1
        marks = backend.byte_marks()
        packed = marks.packed
        structure = marks.structure
        in_key_string = cursor.in_string and cursor.string_is_key
        names_checked = any(a.names is not None for a in relevant)
        # Inside a string, a token matters only through what it writes after the string's closing quote: for a
        # string value, a comma or a bracket (unless an anchor checks the value itself); for a key, whose name
        # is checked through `refused`/`extra` below, a comma, a bracket or a value closing in the same token.
        exits = packed["quote"]
        if cursor.in_string and not cursor.escape:
            if in_key_string and not names_checked:
                exits = structure.key_exit
            elif not in_key_string and not self.checks_strings(path):
                exits = structure.string_exit
        interesting: np.ndarray | None = None
        extra: list[np.ndarray] = []  # token ids found by content, checked beside `interesting`
        refused: list[np.ndarray] = []  # token ids refused as they are
        closed_key = False
        if relevant:  # jsonschema anchors
            if depth == 0:  # top-level scalar: a string closes on its quote, a literal on its last letter
                interesting = packed["quote"] | packed["literal_end"]
            else:
                # A token matters only if it produces an event that a relevant anchor looks at: a value closing
                # at the current path or deeper (quote/comma/bracket), an element of an ancestor closing (comma),
                # a key closing (quote), or enough brackets to close the container an anchor sits on.
                here = any(len(a.pattern) >= depth for a in relevant)
                interesting = marks.closes(min(max(depth - len(a.pattern), 1) for a in relevant))
                if here or any(a.monotone is not None for a in relevant):
                    interesting = interesting | packed["comma"]
                if here or names_checked:
                    interesting = interesting | packed["quote"]
            if cursor.in_string:
                interesting = interesting & exits
        for o in objects:  # free-order objects: only what can break their rules is looked at
            level = len(o.pattern) + 1  # the frame the object sits in
            if level > depth:  # not open yet: a token holding a whole object ("{}") may close it
                if o.required and not cursor.in_string:
                    interesting = _union(interesting, packed["open_close"])
                continue
            frame = cursor.frames[level]
            if frame.kind != ord("{"):
                continue
            if o.missing(frame.keys):  # closing it now would miss a required key
                closes = marks.closes(depth - level + 1)
                interesting = _union(interesting, closes & exits if cursor.in_string else closes)
            in_key = in_key_string and level == depth
            typed = bytes(text[cursor.string_start + 1 :]) if in_key else None
            if o.closed is not None:
                if in_key:
                    # The grammar keeps the key a prefix of a declared name; it must stay one of an unused name:
                    # the tokens to check are those that continue a used name, and those that go on past the key.
                    closed_key = True
                    ids = [self._prefix_tokens(name, typed, marks) for _, name in o.closed if name in frame.keys]
                    ids = np.concatenate(ids) if ids else _NO_TOKENS
                    if ids.size:  # no quote in them: only `key_prefix_ok` can refuse them (checked directly)
                        owner, token_bytes = cursor.path(level - 1), backend.token_bytes()
                        refused.append(np.array([t for t in ids.tolist() if not self.key_prefix_ok(
                            owner, typed + token_bytes[t], frame.keys)], dtype=np.int64))
                    interesting = _union(interesting, exits)
                elif level == depth:  # between members a comma or a key may come; in a value, after its quote
                    interesting = _union(interesting, exits if cursor.in_string
                                         else packed["comma"] | packed["quote"])
                elif level < depth:  # tokens that return to it may bring a comma or a key
                    closes = marks.closes(depth - level)
                    interesting = _union(interesting, closes & exits if cursor.in_string else closes)
            if frame.keys:  # tokens that would write a key it already has
                repeats = [self._repeat_tokens(key, typed, backend) for key in frame.keys]
                (refused if in_key else extra).extend(repeats)  # in its key: refused as they are (key_ok's rule)
        if interesting is None and not extra and not refused:
            return None
        return _Plan(interesting, np.concatenate(extra) if extra else _NO_TOKENS, refused, closed_key)

    def _prefix_tokens(self, name: str, typed: bytes, marks: TokenMarks) -> np.ndarray:
        """Tokens that continue the key typed so far along `name` without closing it (a proper prefix of the
        rest of its escaped text, or all of it)."""
        escaped = _escaped(name)
        if not escaped.startswith(typed):
            return _NO_TOKENS
        return marks.prefixes(escaped[len(typed) :])

    def _repeat_tokens(self, key: str, typed: bytes | None, backend: GrammarBackend) -> np.ndarray:
        """Token ids that can write the key `key` again: inside the key (`typed` so far), those starting with
        the rest of it and its closing quote; elsewhere, those containing it whole with both quotes."""
        escaped = _escaped(key)
        if typed is not None:
            if not escaped.startswith(typed):
                return _NO_TOKENS
            needle, anywhere = escaped[len(typed) :] + b'"', False
        else:
            needle, anywhere = b'"' + escaped + b'"', True
        return backend.byte_marks().containing(needle, anywhere)

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
        kind = _KIND_OF_FIRST_BYTE.get(raw[0], "number") if raw else "number"
        return _all_valid([a.validator or self.validator for a in self._at(path)[0] if kind not in a.universal], raw)

    def checks_value(self, path: tuple[Any, ...], raw: bytes) -> bool:
        """Can an anchor at `path` refuse the value `raw` (its JSON type read from its first byte)?"""
        anchors = self._at(path)[0]
        if not anchors:
            return False
        kind = _KIND_OF_FIRST_BYTE.get(raw[0], "number") if raw else "number"
        return not all(kind in a.universal for a in anchors)

    def checks_strings(self, path: tuple[Any, ...]) -> bool:
        """Can an anchor at `path` refuse some string value?"""
        return not all("string" in a.universal for a in self._at(path)[0])

    def partial_ok(self, path: tuple[Any, ...], raw: bytes) -> bool:
        return _all_valid([a.monotone for a in self._at(path)[0] if a.monotone is not None], raw)

    def key_ok(self, path: tuple[Any, ...], key: str, seen: frozenset[str] = frozenset()) -> bool:
        """May the object at `path` take the key `key` next, having `seen` keys already?"""
        anchors, objects = self._at(path)
        if key in seen and objects:
            return False
        return all(_is_valid(a.names, key) for a in anchors if a.names is not None)

    def key_prefix_ok(self, path: tuple[Any, ...], raw: bytes, seen: frozenset[str]) -> bool:
        """Can the key whose escaped text starts with `raw` still become an unused name (closed objects)?"""
        for o in self._at(path)[1]:
            if o.closed is not None and not any(b.startswith(raw) and name not in seen for b, name in o.closed):
                return False
        return True

    def more_keys_ok(self, path: tuple[Any, ...], seen: frozenset[str]) -> bool:
        """May the object at `path` take another member (a comma) having `seen` keys?"""
        return all(any(name not in seen for _, name in o.closed) for o in self._at(path)[1] if o.closed is not None)

    def object_ok(self, path: tuple[Any, ...], keys: frozenset[str]) -> bool:
        """May the object at `path` close with `keys`? (required keys of the free-order objects)"""
        return not any(o.missing(keys) for o in self._at(path)[1])

    def _at(self, path: tuple[Any, ...]) -> tuple[list[_Anchor], list[_ObjectRule]]:
        """The anchors and object rules that apply exactly at `path` (cached: the scans ask per event)."""
        return self._rules(self._at_cache, path, "matches")

    def _near(self, path: tuple[Any, ...]) -> tuple[list[_Anchor], list[_ObjectRule]]:
        """The anchors and object rules on `path`, above it or below it (those a token written here can reach)."""
        return self._rules(self._near_cache, path, "compatible")

    def _rules(self, cache: dict, path: tuple[Any, ...], test: str) -> tuple[list[_Anchor], list[_ObjectRule]]:
        hit = cache.get(path)
        if hit is None:
            hit = ([a for a in self.anchors if getattr(a, test)(path)],
                   [o for o in self.objects if getattr(o, test)(path)])
            if self._graph is not None:
                for depth in range(len(path) + 1) if test == "compatible" else (len(path),):
                    self._graph_rules(path[:depth], *hit)
                if test == "compatible":   # below: stand-ins that no real path matches, for `_plan`
                    needs, union = self._graph.below(path)
                    if needs:
                        hit[1].append(_ObjectRule(path + _BELOW, frozenset(_BELOW)))
                    if union:
                        hit[0].append(_Anchor(path + _BELOW, None))
            if len(cache) > 65536:
                cache.clear()
            cache[path] = hit
        return hit

    def _graph_rules(self, path: tuple[Any, ...], anchors: list[_Anchor], objects: list[_ObjectRule]) -> None:
        """Add the rules of the free-order objects and unions that `_PathGraph` finds at `path`."""
        for state in self._graph.states(path):
            rule = self._graph_objects.get(state)
            if rule is not None:
                objects.append(_ObjectRule(path, *rule))
            union = self._graph_unions.get(state[0])
            if union is not None and not state[1]:
                anchors.append(replace(union, pattern=path))


def _all_valid(validators: list[Any], raw: bytes) -> bool:
    """Every validator accepts the JSON text `raw`; True while it is not JSON yet (the grammar decides)."""
    if not validators:
        return True
    try:
        value = json.loads(raw)
    except ValueError:
        return True
    return all(_is_valid(v, value) for v in validators)


# Formats whose jsonschema checker is too slow to run per candidate token (rfc3987-syntax parses IRIs with a
# general Earley parser: up to ~100 ms a string). They are left to the grammar (which does not know them).
_SLOW_FORMATS = frozenset({"iri", "iri-reference"})


@functools.lru_cache(maxsize=None)
def _with_regex_module(cls: Any) -> Any:
    """`cls` with `pattern`, `patternProperties` and `additionalProperties` evaluated by `_search`: Python's `re`,
    or the `regex` module for patterns only it compiles (Unicode property escapes); the meta-schema check
    (spec.regex_compiles) admits exactly those."""
    from jsonschema.exceptions import ValidationError

    def pattern(validator: Any, patrn: str, instance: Any, schema: Any) -> Any:
        if validator.is_type(instance, "string") and not _search(patrn, instance):
            yield ValidationError(f"{instance!r} does not match {patrn!r}")

    def pattern_properties(validator: Any, patterns: dict[str, Any], instance: Any, schema: Any) -> Any:
        if validator.is_type(instance, "object"):
            for patrn, subschema in patterns.items():
                for key, value in instance.items():
                    if _search(patrn, key):
                        yield from validator.descend(value, subschema, path=key, schema_path=patrn)

    def additional_properties(validator: Any, extra: Any, instance: Any, schema: Any) -> Any:
        if not validator.is_type(instance, "object"):
            return
        props = schema.get("properties", {})
        patterns = list(schema.get("patternProperties", {}))
        extras = [k for k in instance if k not in props and not any(_search(p, k) for p in patterns)]
        if validator.is_type(extra, "object"):
            for key in extras:
                yield from validator.descend(instance[key], extra, path=key)
        elif extra is False and extras:
            yield ValidationError(f"additional properties are not allowed ({', '.join(map(repr, extras))})")

    return jsonschema.validators.extend(cls, validators={
        "pattern": pattern, "patternProperties": pattern_properties, "additionalProperties": additional_properties,
    })


@functools.lru_cache(maxsize=4096)
def _compiled(patrn: str) -> Any:
    try:
        return re.compile(patrn)
    except re.error:
        import regex

        return regex.compile(patrn)


def _search(patrn: str, text: str) -> bool:
    return _compiled(patrn).search(text) is not None


def _regex_ok(patrn: str) -> bool:
    try:
        _compiled(patrn)
        return True
    except Exception:  # noqa: BLE001 - neither re nor regex compiles it
        return False


@functools.lru_cache(maxsize=None)
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


def _scan(buf: bytes, cursor: Cursor, piece: bytes, guard: SchemaGuard,
          trace: list[tuple[Any, ...]] | None = None) -> Cursor | None:
    """Feed `piece` (the tail of `buf`) through the cursor, checking each closing event; None on violation.

    `trace` collects the paths where a jsonschema anchor looked at raw text from before `piece`: with none, the
    verdict depends only on the cursor's signature and `piece` (see `SchemaGuard.restrict`)."""
    frames = list(cursor.frames)

    def value_ok(path: tuple[Any, ...], raw: bytes) -> bool:
        if not guard.checks_value(path, raw):
            return True  # no anchor here, or none that can refuse a value of this type: nothing to check
        if trace is not None:
            trace.append(path)
        return guard.value_ok(path, raw)

    def partial_ok(path: tuple[Any, ...], start: int, end: int, close: int) -> bool:
        """The container's text so far (buf[start:end] plus its closing bracket) against the monotone anchors."""
        if not any(a.monotone is not None for a in guard._at(path)[0]):
            return True
        if trace is not None:
            trace.append(path)
        return guard.partial_ok(path, buf[start:end] + bytes([close]))
    copied = [False] * len(frames)

    def top() -> _Frame:  # copy-on-write, so earlier cursors stay valid for rollback
        if not copied[-1]:
            frames[-1] = frames[-1].copy()
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
            closing = False
            if escape:
                escape = False
            elif c == 0x5C:  # backslash
                escape = True
            else:
                closing = c == 0x22
            if not closing:
                if string_is_key and guard._closed_objects and not guard.key_prefix_ok(
                    path_of(len(frames) - 2), buf[string_start + 1 : pos + 1], frames[-1].keys
                ):
                    return None
                continue
            if closing:
                in_string = False
                f = top()
                raw = buf[string_start : pos + 1]
                if string_is_key:
                    f.key = _key_text(raw)
                    f.expect_key = False
                    if not guard.key_ok(path_of(len(frames) - 2), f.key, f.keys):
                        return None
                    f.keys = f.keys | {f.key}
                else:
                    f.has_value = True
                    if not value_ok(path_of(len(frames) - 1), raw):
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
                if not value_ok(path_of(depth), buf[f.value_start : pos]):
                    return None
                f.value_start, f.has_value = -1, True
            if c == ord(",") and f.kind == ord("{") and guard._closed_objects:
                if not guard.more_keys_ok(path_of(depth - 1), f.keys):
                    return None
            if c == ord(","):
                if f.has_value and not partial_ok(path_of(depth - 1), f.start, pos, f.kind + 2):
                    return None
                f.index += 1
                f.key, f.expect_key, f.has_value = None, f.kind == ord("{"), False
            elif depth > 0:
                frames.pop()
                copied.pop()
                if f.kind == ord("{") and not guard.object_ok(path_of(depth - 1), f.keys):
                    return None
                if not value_ok(path_of(depth - 1), buf[f.start : pos + 1]):
                    return None
                parent = top()
                parent.has_value = True
        elif c in _WS or c == ord(":"):
            pass  # whitespace between tokens carries no structure (a number's text is cut at its end anyway)
        else:  # part of a number or literal
            f = top()
            if f.value_start < 0:
                f.value_start = pos
            if len(frames) == 1 and buf[f.value_start : pos + 1] in _LITERALS:
                if not value_ok((), buf[f.value_start : pos + 1]):
                    return None
    return Cursor(tuple(frames), len(buf), in_string, escape, string_start, string_is_key)


def _guarded_keys(dropped: tuple[str, ...]) -> tuple[set[str], set[str] | None]:
    """Map the backend's `dropped` notes ("uniqueItems", "oneOf (compiled as anyOf)", "Unknown format: x")
    to schema keywords, and the names of the unknown formats; an unrecognised note guards every known keyword
    (conservative), and then the formats are None (nothing may be left unguarded)."""
    keys: set[str] = set()
    formats: set[str] | None = set()
    for note in dropped:
        word = note.split(" ")[0].strip(":")
        if word in _GUARDED_KEYWORDS:
            keys.add(word)
        elif note.lower().startswith("unknown format"):
            keys.add("format")
            if formats is not None and ":" in note:
                formats.add(note.split(":", 1)[1].split(" (")[0].strip())
        else:
            keys |= _GUARDED_KEYWORDS
            formats = None
    if keys & {"if", "then", "else"}:
        keys |= {"if", "then", "else"}
    if keys & {"contains", "minContains", "maxContains"}:
        keys |= {"contains", "minContains", "maxContains"}
    return keys, formats


# Anchor discovery walks instance paths, which recursive `$ref`s make infinite and diamond-shaped `$defs`
# exponential: the walk only enters subschemas from which a guarded keyword is reachable, never re-enters a
# subschema already on the current chain (recursion), and stops after this many subschemas. What it does not
# reach keeps rules A and B (checked when the document closes): never an invalid output, at worst a dead end.
MAX_ANCHOR_VISITS = 2048


def _find_anchors(schema: Any, validator: Any, dropped: tuple[str, ...]) -> list[_Anchor]:
    """Root anchor plus one per subschema (at a fixed instance path) that uses a keyword the grammar dropped.

    Linear in the schema's size, bounded by MAX_ANCHOR_VISITS, and cancellable (`check_deadline`)."""
    keys, formats = _guarded_keys(dropped)
    # A format the grammar dropped and jsonschema does not check either (e.g. CloudFormation's
    # "AWS::IAM::Role.Arn") needs no anchor: neither side enforces it, so the grammar is exact there.
    checked = getattr(validator.format_checker, "checkers", {}) if validator.format_checker is not None else {}
    useless = {f for f in formats if f not in checked} if formats is not None else set()

    def guarded(node: dict[str, Any]) -> bool:
        used = keys & node.keys()
        return bool(used) and not (used == {"format"} and node.get("format") in useless)

    if formats is not None and all(note.lower().startswith("unknown format") for note in dropped) and not any(
        guarded(node) for node in keyword_nodes(schema)      # (not the name maps: a property named "format")
    ):
        return []  # only unchecked formats were dropped: nothing for rules B/C to check (rule A stays)
    relevant = _relevant_nodes(schema, keys)
    anchors = [_Anchor((), None)]
    seen: set[tuple[int, tuple[Any, ...]]] = set()
    stack: list[tuple[Any, tuple[Any, ...], frozenset[int]]] = [(schema, (), frozenset())]
    visits = 0
    while stack:
        node, pattern, chain = stack.pop()
        if not isinstance(node, dict) or id(node) not in relevant or (id(node), pattern) in seen:
            continue
        seen.add((id(node), pattern))
        visits += 1
        if visits > MAX_ANCHOR_VISITS:
            break
        if visits & 63 == 0:
            check_deadline()
        if guarded(node):
            anchor = anchors[0] if not pattern else _Anchor(pattern, validator.evolve(schema=node))
            monotone = _monotone_part(node)
            if monotone:
                anchor.monotone = validator.evolve(schema=monotone)
            names = _key_names(node, keys)
            if names is not None:
                anchor.names = validator.evolve(schema=names)
            if pattern:
                anchors.append(anchor)
        inner = chain | {id(node)}
        children = [(child, pattern + steps) for steps, child in _instance_children(schema, node)]
        stack.extend((child, path, inner) for child, path in reversed(children) if id(child) not in inner)
    return anchors


# Keywords that keep an object's declared properties in schema order: combinators and conditionals beside
# `properties` make llguidance intersect or branch schemas, and `unevaluatedProperties` depends on them.
_ORDER_BLOCKERS = frozenset({
    "anyOf", "oneOf", "$ref", "$dynamicRef", "$recursiveRef", "not",
    "dependentSchemas", "dependencies", "unevaluatedProperties",
})   # (`dependentRequired`, and `dependencies` of names only, are the object rule's: `_dependent_required`)


def _blockers(node: dict[str, Any]) -> set[str]:
    found = _ORDER_BLOCKERS & node.keys()
    deps = node.get("dependencies")
    if "dependencies" in found and isinstance(deps, dict) and all(isinstance(v, list) for v in deps.values()):
        found.discard("dependencies")
    return found


def _dependent_required(node: dict[str, Any], known: Any = None) -> tuple[tuple[str, frozenset[str]], ...]:
    """The keys each key of the object requires, from `dependentRequired` and draft 7's `dependencies` of names,
    those of the two the schema's draft knows (``known``: its keywords; None: both)."""
    out = []
    for key in ("dependentRequired", "dependencies"):
        value = node.get(key) if known is None or key in known else None
        for name, need in value.items() if isinstance(value, dict) else ():
            if isinstance(need, list):
                out.append((name, frozenset(n for n in need if isinstance(n, str))))
    return tuple(out)
_MAX_PATTERNS_PER_OBJECT = 32
MAX_EXPANDED = 3  # properties of a closed object written into the grammar in every order (3! = 6 branches)


@dataclass
class FreeOrder:
    """What `free_order_sites` found: sites {id(node): (node, [pattern, ...], {the patterns where it is a union's
    branch})} and the unions of objects (anyOf/oneOf nodes at fixed paths) one of whose branches is a site:
    [(union node, [pattern, ...])]."""

    sites: dict[int, tuple[dict[str, Any], list[tuple[Any, ...]], frozenset[tuple[Any, ...]]]]
    unions: list[tuple[dict[str, Any], list[tuple[Any, ...]]]]
    expanded: frozenset[int] = frozenset()  # small closed objects the grammar takes in any order exactly
    graph: _PathGraph | None = None  # those reached through recursion (or at too many paths): found per path

    def keys(self) -> set[int]:
        """ids of every object subschema relaxed (its properties in any order)."""
        return set(self.sites) | (set(self.graph.sites) if self.graph is not None else set())

    def union_ids(self) -> list[int]:
        """ids of every union of objects with a relaxed branch (its own `required` is the guard's)."""
        return [id(node) for node, _ in self.unions] + (list(self.graph.unions) if self.graph is not None else [])


_BELOW = ("<below>",)
"""The last step of the pattern of a rule standing for those that apply somewhere below a path (`_PathGraph`):
it matches no real step."""


class _PathGraph:
    """The schema's fixed routes as an automaton over instance paths, for the free-order objects (and unions of
    them) that recursion reaches at infinitely many paths, or that are reached at too many to list: the states
    at a path are the (subschema, reached as a union's branch) pairs that apply there; a site among them is
    checked there as a listed one is at its patterns. Follows exactly the routes `free_order_sites` calls fixed
    (what another route reaches is not a site)."""

    def __init__(self, root: dict[str, Any], edges: Any, exclusive: dict[int, set[str]],
                 sites: dict[int, dict[str, Any]], unions: dict[int, dict[str, Any]]) -> None:
        self._edges, self._exclusive = edges, exclusive
        self.sites, self.unions = sites, unions
        self._states: dict[tuple[Any, ...], frozenset[tuple[int, bool]]] = {}
        self._nodes: dict[int, dict[str, Any]] = {}
        self._root = self._closure({(id(root), False)}, root)
        self._below: dict[frozenset[tuple[int, bool]], tuple[bool, bool]] = {}

    def _closure(self, states: set[tuple[int, bool]], root: Any = None) -> frozenset[tuple[int, bool]]:
        """Add what applies at the same location: $ref targets, allOf members, the branches of a union."""
        if root is not None:
            self._nodes[id(root)] = root
        todo = list(states)
        out = set(states)
        while todo:
            i, branch = todo.pop()
            for steps, child in self._edges(self._nodes[i]):
                if not isinstance(child, dict) or not (steps == () or (steps is _UNION and not branch)):
                    continue
                key = (id(child), branch or steps is _UNION)
                if key not in out:
                    self._nodes[id(child)] = child
                    out.add(key)
                    todo.append(key)
        return frozenset(out)

    def _moves(self, states: frozenset[tuple[int, bool]], step: Any = _BELOW) -> set[tuple[int, bool]]:
        """The states one instance step below `states`, through the edges `step` matches (`_BELOW`: any step),
        before their closure."""
        found = set()
        for i, branch in states:
            for steps, child in self._edges(self._nodes[i]):
                if steps is None or steps is _UNION or len(steps) != 1 or not isinstance(child, dict):
                    continue
                if branch and steps[0] not in self._exclusive.get(i, ()):
                    continue   # below a union's branch only where every branch agrees (`_exclusive_keys`)
                if step is _BELOW or (step is not None and _step_matches(steps[0], step)):
                    self._nodes[id(child)] = child
                    found.add((id(child), False))
        return found

    def _step(self, states: frozenset[tuple[int, bool]], step: Any) -> frozenset[tuple[int, bool]]:
        found = self._moves(states, step)
        return self._closure(found) if found else frozenset()

    def states(self, path: tuple[Any, ...]) -> frozenset[tuple[int, bool]]:
        if not path:
            return self._root
        hit = self._states.get(path)
        if hit is None:
            hit = self._step(self.states(path[:-1]), path[-1])
            if len(self._states) > 65536:
                self._states.clear()
            self._states[path] = hit
        return hit

    def below(self, path: tuple[Any, ...]) -> tuple[bool, bool]:
        """(can a site that needs keys be reached strictly below `path`, can a union of them)"""
        start = self.states(path)
        hit = self._below.get(start)
        if hit is None:
            seen: set[tuple[int, bool]] = set()
            todo, needs, union = [start], False, False
            while todo and not (needs and union):
                reached = self._closure(self._moves(todo.pop())) - seen
                seen |= reached
                for i, branch in reached:
                    node = self.sites.get(i)
                    needs = needs or (node is not None and bool(node.get("required") or _dependent_required(node)))
                    union = union or i in self.unions
                if reached:
                    todo.append(frozenset(reached))
            hit = self._below[start] = (needs, union)
        return hit


def free_order_sites(schema: Any) -> FreeOrder:
    """The object subschemas whose properties the grammar may take in any order, with the instance paths they
    apply at.

    A subschema qualifies when the guard can check it exactly (a repeated key, a missing required key): it is
    reached only through fixed instance paths (properties, items, prefixItems, allOf, local $ref) - never
    through anyOf/oneOf/not/if/additionalProperties/patternProperties/... nor recursion - at few paths, it has
    `properties`, none of `_ORDER_BLOCKERS`, and its patternProperties match none of its property names. The
    others keep schema order (exact in the grammar). Any unresolvable or dynamic $ref: no site at all.
    The branches of a union of objects at a fixed path (anyOf/oneOf with several object branches, e.g. a
    pydantic discriminated union) qualify too, at those patterns as union branches: which branch applies is known
    only at the end, so there their `required` is checked by validating the whole union when its value closes
    (a model both in a union and at a fixed path elsewhere keeps its own rules at the fixed path)."""
    if not isinstance(schema, dict):
        return FreeOrder({}, [])
    memo: dict[int, list[tuple[Any, Any]]] = {}

    def edges(node: dict[str, Any]) -> list[tuple[Any, Any]]:  # each node's edges, listed once per call
        found = memo.get(id(node))
        if found is None:
            found = memo[id(node)] = list(_subschema_edges(schema, node))
        return found

    nodes: dict[int, Any] = {}
    mode: dict[int, int] = {}  # 0: fixed paths only; 1: also as a branch of a union of objects; 2: elsewhere too
    exclusive = _exclusive_keys(schema)
    stack: list[tuple[Any, int]] = [(schema, 0)]
    while stack:  # every subschema reached from the root, and the worst kind of route to it
        node, how = stack.pop()
        if not isinstance(node, dict) or mode.get(id(node), -1) >= how:
            continue
        nodes[id(node)] = node
        mode[id(node)] = how
        if len(nodes) & 255 == 0:
            check_deadline()
        for steps, child in edges(node):
            if child is _UNRESOLVED:
                return FreeOrder({}, [])
            if steps is None:
                stack.append((child, 2))
            elif steps is _UNION:
                stack.append((child, 1 if how == 0 else 2))
            else:  # same location ($ref, allOf) keeps the mode; a property or item of a union branch: elsewhere,
                # unless no other branch takes that property (then an object there is the branch's: a fixed path)
                fixed = how == 1 and len(steps) == 1 and steps[0] in exclusive.get(id(node), ())
                stack.append((child, 0 if fixed else how if not steps or how == 0 else 2))
    tainted = {i for i, how in mode.items() if how == 2}
    patterns: dict[int, list[tuple[Any, ...]]] = {}
    unions: dict[int, tuple[dict[str, Any], list[tuple[Any, ...]]]] = {}
    cyclic: set[int] = set()
    overflow: set[int] = set()
    walk: list[tuple[Any, tuple[Any, ...], tuple[int, ...], bool]] = [(schema, (), (), False)]
    in_union: dict[int, set[tuple[Any, ...]]] = {}   # the patterns at which a subschema is a union's branch
    visits = 0
    walked: set[tuple[int, tuple[Any, ...], bool]] = set()
    while walk:  # the fixed instance paths of each subschema (acyclic walk, bounded)
        node, pattern, chain, branch = walk.pop()
        if (id(node), pattern, branch) in walked:    # (reached again through another branch of a union)
            continue
        walked.add((id(node), pattern, branch))
        visits += 1
        if visits > 16 * MAX_ANCHOR_VISITS:
            return FreeOrder({}, [])
        if visits & 63 == 0:
            check_deadline()
        seen_at = patterns.setdefault(id(node), [])
        seen_at.append(pattern)
        if branch:
            in_union.setdefault(id(node), set()).add(pattern)
        if len(seen_at) > _MAX_PATTERNS_PER_OBJECT:  # too many paths: neither it nor what is below is relaxed
            overflow.add(id(node))
            continue
        chain = chain + (id(node),)
        for steps, child in edges(node):
            if steps is None or not isinstance(child, dict):
                continue
            union = steps is _UNION
            if union:
                steps = ()
                if mode.get(id(node)) == 0:
                    at = unions.setdefault(id(node), (node, []))[1]
                    if pattern not in at:   # (reached once per object branch: one anchor is enough)
                        at.append(pattern)
            if id(child) in chain:
                cyclic.update(chain[chain.index(id(child)) :])
                continue
            # a union's branch, also through $ref / allOf at the same location (not at its properties)
            walk.append((child, pattern + steps, chain, union or (branch and not steps)))
    local = _pointed_through_properties(schema) | _mixed_intersections(schema, nodes)  # about the node itself
    bad = set(tainted) | local
    spread: set[int] = set()  # whatever a recursion reaches has infinitely many paths (an overflow, too many)
    todo = list(cyclic | overflow)
    while todo:
        i = todo.pop()
        if i in spread:
            continue
        spread.add(i)
        for steps, child in edges(nodes[i]):
            if steps is not None and isinstance(child, dict) and id(child) not in spread:
                todo.append(id(child))
    graph_sites = {i: nodes[i] for i in spread
                   if i not in tainted and i not in local and _free_order_ok(nodes[i])}
    bad |= spread
    sites = {
        i: (nodes[i], pats, frozenset(in_union.get(i, ())))
        for i, pats in patterns.items()
        if i not in bad and len(pats) <= _MAX_PATTERNS_PER_OBJECT and _free_order_ok(nodes[i])
    }
    # A closed object with at most MAX_EXPANDED properties, joined to no other subschema (allOf, $ref), is
    # written into the grammar as the anyOf of its property orders (`lowering.lower`'s `expand`): exact, so the
    # guard does not follow it (a few orders cost llguidance little; 24 for four properties cost ~6 ms to compile).
    joined = _joined(schema, nodes)
    expanded = frozenset(i for i, (node, _, branch_at) in sites.items()
                         if not branch_at and i not in joined and _closed(node) is not None
                         and len(node["properties"]) <= MAX_EXPANDED and not _dependent_required(node))
    sites = {i: site for i, site in sites.items() if i not in expanded}
    # A relaxed union branch leaves `required` (of whichever branch applies) to a check of the whole union at
    # the close of its value: one jsonschema anchor per union with a relaxed branch.
    def relaxed(union: dict[str, Any], among: Any) -> bool:
        return any(id(b) in among or isinstance(b.get("$ref"), str)
                   and id(resolve_local_ref(schema, b["$ref"])) in among for b in _branches(union))
    relaxed_unions = [(node, pats) for i, (node, pats) in unions.items()
                      if i not in tainted and i not in spread and relaxed(node, sites.keys() | graph_sites.keys())]
    graph = None
    if graph_sites:    # the unions of objects recursion reaches (relaxed when a branch is)
        graph_unions = {i: node for i, node in nodes.items() if i in spread and i not in tainted and _branches(node)
                        and relaxed(node, graph_sites.keys() | sites.keys())}
        graph = _PathGraph(schema, edges, exclusive, graph_sites, graph_unions)
    if not sites and graph is None:
        return FreeOrder({}, [], expanded)
    return FreeOrder(sites, relaxed_unions, expanded, graph)


def _exclusive_keys(root: dict[str, Any]) -> dict[int, set[str]]:
    """For the branches of unions of objects: id(the branch, its $refs followed) -> the property names below which
    the same subschema applies whichever object branch of any union it is in does (each other branch a plain
    closed object without the name, or one whose property of that name is the same subschema): what lies below
    such a key sits at a fixed path. A union tagged by key (CloudFormation's `{"oneOf": [{"properties":
    {"GitLab": ...}}, {"properties": {"PagerDuty": ...}}]}`), or versions of a document sharing definitions (CMake
    presets: every version's `cmakeMinimumRequired` is one `$ref`)."""
    out: dict[int, set[str]] = {}
    for node in iter_subschemas(root):
        for key in ("anyOf", "oneOf"):
            branches = node.get(key) if isinstance(node.get(key), list) else []
            objects = [_resolved(root, b) for b in branches if _may_be(root, b, "object")]
            if len(objects) < 2:
                continue
            for i, branch in enumerate(objects):
                props = branch.get("properties") if isinstance(branch, dict) else None
                names = {k for k, sub in props.items()
                         if all(j == i or _same_below(root, other, k, sub) for j, other in enumerate(objects))} \
                    if isinstance(props, dict) else set()
                mine = out.get(id(branch))
                out[id(branch)] = names if mine is None else mine & names
    return out


def _same_below(root: dict[str, Any], other: Any, key: str, sub: Any) -> bool:
    """Does `other` (a union's branch) refuse `key`, or take it with the subschema `sub`?"""
    props = other.get("properties") if isinstance(other, dict) else None
    if isinstance(props, dict) and key in props:
        return _resolved(root, props[key]) is _resolved(root, sub)
    return _refuses_key(other, key)


def _resolved(root: dict[str, Any], node: Any) -> Any:
    """`node` with its local $refs followed (a few hops at most; beside a $ref, annotations only)."""
    for _ in range(8):
        ref = node.get("$ref") if isinstance(node, dict) else None
        if not isinstance(ref, str) or not node.keys() - ANNOTATIONS <= {"$ref"}:
            return node
        node = resolve_local_ref(root, ref)
    return node


def _refuses_key(node: Any, key: str) -> bool:
    """Does every object valid for `node` lack `key`? (Only said of plain closed objects.)"""
    return isinstance(node, dict) and node.get("additionalProperties") is False and not node.get("patternProperties") \
        and not _blockers(node) and "allOf" not in node \
        and key not in (node.get("properties") if isinstance(node.get("properties"), dict) else {})


def _joined(root: dict[str, Any], nodes: dict[int, Any], relaxed: bool = False) -> set[int]:
    """ids of the subschemas llguidance intersects with another one: allOf members and their holder, and the two
    ends of a $ref that has other keywords beside it (but those `redundant_beside_ref`). ``relaxed``: as the
    grammar is given for relaxed objects, where allOf members holding only conditionals are lowered away
    (`_conditional_only`) and annotations and `LOCATIONS` keywords beside a $ref join nothing. (`nodes` holds
    every subschema reached, $ref targets and allOf members included, so each allOf is seen at its holder.)"""
    inert = ANNOTATIONS | LOCATIONS if relaxed else frozenset()
    out: set[int] = set()
    for i, node in nodes.items():
        all_of = node.get("allOf")
        members = [m for m in all_of if isinstance(m, dict) and not (relaxed and _conditional_only(m))] \
            if isinstance(all_of, list) else []
        if members:
            out.add(i)
            out.update(id(m) for m in members)
        ref = node.get("$ref")
        if isinstance(ref, str) and node.keys() - inert - redundant_beside_ref(node, root) - {"$ref"}:
            target = resolve_local_ref(root, ref)
            out.add(i)
            if isinstance(target, dict):
                out.add(id(target))
    return out


def _closed(node: dict[str, Any]) -> tuple[tuple[bytes, str], ...] | None:
    if node.get("additionalProperties") is not False or node.get("patternProperties"):
        return None
    return tuple((_escaped(name), name) for name in node["properties"])


def _mixed_intersections(root: dict[str, Any], nodes: dict[int, Any]) -> set[int]:
    """llguidance intersects the subschemas joined by allOf / $ref: relax all the objects of such a group or
    none (an ordered `properties` intersected with relaxed ones refuses valid orders)."""
    parent = {i: i for i in nodes}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, node in nodes.items():
        members = node.get("allOf") if isinstance(node.get("allOf"), list) else []
        joined = [m for m in members if not _conditional_only(m)]
        if isinstance(node.get("$ref"), str):
            joined.append(resolve_local_ref(root, node["$ref"]))
        for child in joined:
            if isinstance(child, dict) and id(child) in parent:
                parent[find(id(child))] = find(i)
    # llguidance's intersection of a closed object (additionalProperties false) whose properties were made pattern
    # properties with any other subschema refuses every key ({"required": [...]} beside it: "unsatisfiable"):
    # such a group keeps the schema's order
    intersected = _joined(root, nodes, relaxed=True)
    blocked = {
        find(i) for i, node in nodes.items()
        if _blockers(node) - {"$ref"} or ("properties" in node and not _free_order_ok(node, True))
        or (i in intersected and node.get("additionalProperties") is False)
    }
    return {i for i in nodes if find(i) in blocked}


def _conditional_only(node: Any) -> bool:
    """An allOf member holding only conditionals (and annotations): lowered away beside a relaxed object
    (`lowering.lower`), so it joins nothing."""
    return isinstance(node, dict) and bool(node.keys() & {"if", "then", "else"}) \
        and node.keys() <= {"if", "then", "else"} | ANNOTATIONS


def _pointed_through_properties(root: dict[str, Any]) -> set[int]:
    """ids of the nodes whose `properties` some $ref points into (relaxing them would break the pointer)."""
    out: set[int] = set()
    for node in iter_subschemas(root):
        ref = node.get("$ref")
        if not isinstance(ref, str) or not ref.startswith("#/"):
            continue
        here: Any = root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if part == "properties" and isinstance(here, dict):
                out.add(id(here))
            if isinstance(here, dict) and part in here:
                here = here[part]
            elif isinstance(here, list) and part.isdigit() and int(part) < len(here):
                here = here[int(part)]
            else:
                break
    return out


def _free_order_ok(node: dict[str, Any], ignore_ref: bool = False) -> bool:
    props = node.get("properties")
    blockers = _blockers(node) - {"$ref"} if ignore_ref else _blockers(node)
    if not isinstance(props, dict) or not props or blockers:
        return False
    if not isinstance(node.get("required", []), list):
        return False
    patterns = node.get("patternProperties", {})
    if not isinstance(patterns, dict):
        return False
    if catch_all(patterns) is not None:
        return True    # a regex matching every key: `lowering.lower` gives it every other key, and both to names
    for pattern in patterns:
        try:
            if any(re.search(pattern, name) for name in props):
                return False  # a name matching a pattern property must satisfy both: keep llguidance's form
        except re.error:
            return False
    return True


_UNRESOLVED = object()
_UNION = ("<union>",)  # edge marker: a branch of a union of objects (same location, checked as a whole)


def _branches(node: dict[str, Any]) -> list[Any]:
    return [b for key in ("anyOf", "oneOf") for b in (node.get(key) or []) if isinstance(b, dict)]


def _may_be(root: Any, sub: Any, kind: str, hops: int = 0) -> bool:
    """Can an instance of ``kind`` ("object" or "array") satisfy `sub`? (False only when its type, const or enum
    rule that kind out.)"""
    if not isinstance(sub, dict):
        return sub is not False
    if isinstance(sub.get("$ref"), str) and hops < 8:
        target = resolve_local_ref(root, sub["$ref"])
        if target is None or not _may_be(root, target, kind, hops + 1):
            return target is None
    types = sub.get("type")
    if isinstance(types, str) and types != kind or isinstance(types, list) and kind not in types:
        return False
    value = dict if kind == "object" else list
    if "const" in sub and not isinstance(sub["const"], value):
        return False
    if isinstance(sub.get("enum"), list) and not any(isinstance(v, value) for v in sub["enum"]):
        return False
    return True
_SINGLE_NONFIXED = ("propertyNames", "contains", "not", "if", "then", "else",
                    "unevaluatedItems", "unevaluatedProperties", "additionalItems")


def _subschema_edges(root: Any, node: dict[str, Any]) -> Iterator[tuple[tuple[Any, ...] | None, Any]]:
    """Every subschema applying below `node` with its instance steps, or None where the location is not a fixed
    path; `_UNRESOLVED` for a $ref we cannot follow."""
    props = node.get("properties")
    for name, sub in props.items() if isinstance(props, dict) else ():
        yield (name,), sub
    patterns = node.get("patternProperties")
    for regex, sub in patterns.items() if isinstance(patterns, dict) else ():
        yield ((_KeyStep(regex),) if _regex_ok(regex) else None), sub
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        # a map's values; beside pattern properties, whose regexes the grammar may drop, left unrelaxed
        yield (None if patterns else (_KeyStep(None, frozenset(props) if isinstance(props, dict) else frozenset()),)), \
            extra
    for key in ("dependentSchemas", "dependencies"):
        value = node.get(key)
        for sub in value.values() if isinstance(value, dict) else ():
            yield None, sub
    items, prefix = node.get("items"), node.get("prefixItems")
    if isinstance(items, dict):
        yield (None if prefix else ("*",)), items
    elif isinstance(items, list):
        for i, sub in enumerate(items):
            yield (i,), sub
    for i, sub in enumerate(prefix if isinstance(prefix, list) else ()):
        yield (i,), sub
    for key in _SINGLE_NONFIXED:
        yield None, node.get(key)
    for sub in node.get("allOf") if isinstance(node.get("allOf"), list) else ():
        yield (), sub  # llguidance intersects the branches; each relaxed branch has its own object rule
    for key in ("anyOf", "oneOf"):
        branches = node.get(key) if isinstance(node.get(key), list) else []
        objects = [i for i, sub in enumerate(branches) if _may_be(root, sub, "object")]
        arrays = [i for i, sub in enumerate(branches) if _may_be(root, sub, "array")]
        for i, sub in enumerate(branches):
            # The one branch that admits objects (e.g. Optional[Model] = anyOf [object, null]) is where every
            # object at this location is checked, so for objects the location is fixed; several object
            # branches make a union (checked as a whole). Likewise the one branch that admits arrays, for what
            # lies in them (JSON Schema's own `"items": {"anyOf": [{"$ref": "#"}, {"$ref": "#/.../schemaArray"}]}`).
            yield ((), sub) if objects == [i] or (arrays == [i] and i not in objects) else \
                (_UNION, sub) if i in objects else (None, sub)
    if "$dynamicRef" in node or "$recursiveRef" in node:
        yield (), _UNRESOLVED
    ref = node.get("$ref")
    if isinstance(ref, str):
        target = resolve_local_ref(root, ref)
        yield (), (_UNRESOLVED if target is None else target)


def _relevant_nodes(schema: Any, keys: set[str]) -> set[int]:
    """ids of the subschemas (reached through `_instance_children`) from which a subschema using one of `keys`
    can be reached: one pass over the schema graph plus a reverse propagation, whatever its recursion."""
    nodes: dict[int, Any] = {}
    parents: dict[int, set[int]] = {}
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict) or id(node) in nodes:
            continue
        nodes[id(node)] = node
        if len(nodes) & 255 == 0:
            check_deadline()
        for _, child in _instance_children(schema, node):
            if isinstance(child, dict):
                parents.setdefault(id(child), set()).add(id(node))
                stack.append(child)
    relevant = {i for i, node in nodes.items() if keys & node.keys()}
    todo = list(relevant)
    while todo:
        for parent in parents.get(todo.pop(), ()):
            if parent not in relevant:
                relevant.add(parent)
                todo.append(parent)
    return relevant


def _instance_children(root: Any, node: dict[str, Any]) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """The subschemas of `node` that apply at a fixed instance path, with the instance steps that lead there
    (property name, array index, "*" for every item; none through allOf and local $ref)."""
    props = node.get("properties")
    for name, sub in props.items() if isinstance(props, dict) else ():
        yield (name,), sub
    items = node.get("items")
    if isinstance(items, dict) and not node.get("prefixItems"):  # with prefixItems it covers only a tail
        yield ("*",), items
    elif isinstance(items, list):
        for i, sub in enumerate(items):
            yield (i,), sub
    for i, sub in enumerate(node.get("prefixItems") or []):
        yield (i,), sub
    for sub in node.get("allOf") or []:
        yield (), sub
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        yield (), resolve_local_ref(root, ref)


def _key_names(node: dict[str, Any], guarded: set[str]) -> dict[str, Any] | None:
    """The schema every key of an object valid for `node` satisfies, checked as each key closes: its
    `propertyNames`, and, where the grammar's pattern properties are wider than the schema's (look-around removed,
    `lowering.without_lookaround`) beside additionalProperties false, the declared names or a pattern property's
    regex: a key only the wider regex takes is refused at its quote, not once its value is written."""
    parts = [node["propertyNames"]] if "propertyNames" in node else []
    patterns = node.get("patternProperties")
    if "patternProperties" in guarded and isinstance(patterns, dict) and patterns \
            and node.get("additionalProperties") is False:
        declared = list(node["properties"]) if isinstance(node.get("properties"), dict) else []
        parts.append({"anyOf": [{"enum": declared}] + [{"pattern": p} for p in patterns]})
    return None if not parts else parts[0] if len(parts) == 1 else {"allOf": parts}


def _monotone_part(node: dict[str, Any]) -> dict[str, Any]:
    """The keywords of `node` whose violation on a partial container can never be repaired by adding more."""
    part: dict[str, Any] = {}
    if node.get("uniqueItems") is True:
        part["uniqueItems"] = True
    if "contains" in node and "maxContains" in node:
        part.update(contains=node["contains"], maxContains=node["maxContains"], minContains=0)
    if "propertyNames" in node:
        part["propertyNames"] = node["propertyNames"]
    if isinstance(node.get("maxProperties"), int):
        part["maxProperties"] = node["maxProperties"]
    return part


_KIND_OF_FIRST_BYTE = {0x22: "string", 0x7B: "object", 0x5B: "array", 0x74: "boolean", 0x66: "boolean", 0x6E: "null"}
_ALL_TYPES = frozenset({"string", "number", "boolean", "null", "object", "array"})
# What each validation keyword can refuse: a keyword only ever refuses values of these types (jsonschema's
# keyword functions return early for other types). `format` counts for strings and numbers (conservative).
_REFUSES = {
    **dict.fromkeys(("minLength", "maxLength", "pattern"), frozenset({"string"})),
    "format": frozenset({"string", "number"}),
    **dict.fromkeys(("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
                    frozenset({"number"})),
    **dict.fromkeys(("properties", "required", "additionalProperties", "patternProperties", "minProperties",
                     "maxProperties", "propertyNames", "dependentRequired", "dependentSchemas", "dependencies",
                     "unevaluatedProperties"), frozenset({"object"})),
    **dict.fromkeys(("items", "prefixItems", "additionalItems", "contains", "minItems", "maxItems", "uniqueItems",
                     "unevaluatedItems"), frozenset({"array"})),
}


def universal_types(node: Any, root: Any, validator: Any) -> frozenset[str]:
    """The JSON types ("number" for every numeral) every value of which `node` accepts, found statically and
    conservatively (an empty set whenever unsure): keywords jsonschema does not know are ignored as it ignores
    them; type-specific keywords remove their type; anyOf unites, allOf intersects; oneOf counts a branch only
    where every other branch's `type` excludes that type; local `$ref`s are followed (a cycle, a nested `$id`
    or any other reference: nothing); enum, const, not, if and `$dynamicRef` give nothing."""
    known = type(validator).VALIDATORS
    memo: dict[int, frozenset[str]] = {}

    def excludes(sub: Any, kind: str) -> bool:
        if sub is False:
            return True
        types = sub.get("type") if isinstance(sub, dict) else None
        if types is None:
            return False
        types = {types} if isinstance(types, str) else set(types)
        return kind not in types and not (kind == "number" and "integer" in types)

    def walk(sub: Any, chain: frozenset[int]) -> frozenset[str]:
        if sub is True:
            return _ALL_TYPES
        if not isinstance(sub, dict) or id(sub) in chain or (sub is not root and "$id" in sub):
            return frozenset()
        hit = memo.get(id(sub))
        if hit is not None:
            return hit
        inner = chain | {id(sub)}
        out = _ALL_TYPES
        for key, value in sub.items():
            if key not in known or not out:
                continue
            if key in _REFUSES:
                out = out - _REFUSES[key]
            elif key == "type":
                types = {value} if isinstance(value, str) else set(value) if isinstance(value, list) else set()
                out = out & frozenset(types - {"integer"})  # "integer" alone does not take every numeral
            elif key == "anyOf" and isinstance(value, list):
                out = out & frozenset().union(*(walk(b, inner) for b in value))
            elif key == "allOf" and isinstance(value, list):
                for b in value:
                    out = out & walk(b, inner)
            elif key == "oneOf" and isinstance(value, list):
                alone: set[str] = set()
                for i, b in enumerate(value):
                    alone |= {k for k in walk(b, inner)
                              if all(excludes(o, k) for j, o in enumerate(value) if j != i)}
                out = out & frozenset(alone)
            elif key == "$ref" and isinstance(value, str):
                target = resolve_local_ref(root, value)
                out = out & (walk(target, inner) if target is not None else frozenset())
            else:  # enum, const, not, if, $dynamicRef, malformed values: anything may be refused
                out = frozenset()
        memo[id(sub)] = out
        return out

    return walk(node, frozenset())


def _excluded_types(node: Any, root: Any, hops: int = 0) -> frozenset[str]:
    """The JSON types ("number" for every numeral) no value of which `node` accepts, found statically and
    conservatively: by `type`, and through local `$ref`s, every branch of anyOf/oneOf, any member of allOf."""
    if node is False:
        return _ALL_TYPES
    if not isinstance(node, dict) or hops > 16:
        return frozenset()
    out: set[str] = set()
    kind = node.get("type")
    if isinstance(kind, (str, list)):
        kinds = {kind} if isinstance(kind, str) else set(kind)
        out |= _ALL_TYPES - kinds - ({"number"} if "integer" in kinds else set())
    ref = node.get("$ref")
    if isinstance(ref, str):
        out |= _excluded_types(resolve_local_ref(root, ref), root, hops + 1)
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        if isinstance(branches, list) and branches:
            out |= frozenset.intersection(*(_excluded_types(b, root, hops + 1) for b in branches))
    for member in node.get("allOf") if isinstance(node.get("allOf"), list) else ():
        out |= _excluded_types(member, root, hops + 1)
    return frozenset(out)
