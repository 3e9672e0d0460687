"""Grammar backend adapter: compile a `StructuredSpec` once per (spec, tokenizer) and hand out per-request matchers.

The grammar library sits behind a tiny two-part interface (`_Library.compile` and `_LibState`), so llguidance
(the default, chosen by benchmarks/structured_backends.py) and xgrammar are interchangeable; a third library is
one more pair of classes. Compilation runs in a worker thread under a time limit, and the result (or the error)
is cached by the spec's canonical text, so a thousand requests with the same schema compile it once.

JSON schemas are first *lowered* for the library: llguidance runs in lenient mode, which drops keywords it cannot
express (uniqueItems, not, if/then/else, contains, dependentRequired, propertyNames, unevaluated*, ...) and
reports them; patterns whose regex the library cannot parse (look-around, back-references) are removed by us. The
grammar is then an over-approximation of the schema, and `SchemaGuard` (matcher.py) enforces the rest with
`jsonschema` while decoding. See README.md in this folder for the per-keyword list.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from leapdecode.structured.matcher import Matcher, SchemaGuard
from leapdecode.structured.spec import StructuredSpec, parse_structured

__all__ = ["CompiledGrammar", "GrammarBackend", "LIBRARIES", "fill_bitmasks", "json_text"]

LIBRARIES = ("llguidance", "xgrammar")

# Keywords the guard re-checks when the library dropped them. llguidance names them in its warnings; for
# xgrammar (which never says) we assume every keyword outside its documented core set may be approximated.
_XGRAMMAR_CORE = {
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
    "enum", "const", "anyOf", "allOf", "$ref", "$defs", "definitions", "minLength", "maxLength", "pattern",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "$schema", "$id", "title", "description",
    "default", "examples", "$comment",
}


@dataclass(frozen=True)
class CompiledGrammar:
    """A compiled constraint, immutable and shared by every request with the same spec.

    `dropped` lists what the grammar does NOT enforce (e.g. "uniqueItems", "pattern (look-around)"); when
    non-empty, `guard` checks those with jsonschema during decoding. `guard` is set for every JSON schema
    (a cheap end-of-document check even when nothing was dropped, in case the library errs).
    """

    spec: StructuredSpec
    library: str
    handle: Any = field(repr=False)
    dropped: tuple[str, ...] = ()
    guard: SchemaGuard | None = field(default=None, repr=False)
    compile_s: float = 0.0

    @property
    def exact(self) -> bool:
        """True when the grammar alone enforces the whole spec."""
        return not self.dropped


class _LibState(Protocol):
    """One request's parser state inside the grammar library (EOS is handled by `Matcher`, never passed here)."""

    def try_consume(self, token: int) -> bool: ...
    def validate(self, tokens: list[int]) -> int: ...
    def rollback(self, n: int) -> None: ...
    def fill(self, bitmask: torch.Tensor, row: int) -> None: ...
    def is_accepting(self) -> bool: ...
    def forced_tokens(self) -> list[int]: ...


class _Library(Protocol):
    name: str
    vocab_size: int

    def compile(self, spec: StructuredSpec) -> tuple[Any, tuple[str, ...]]: ...
    def new_state(self, handle: Any) -> _LibState: ...
    def token_bytes(self) -> list[bytes]: ...


# ----------------------------------------------------------------------------------------------- llguidance
_LLG_JSON_OPTIONS = {
    # Compact JSON: no free whitespace, fixed separators. Keeps masks small and makes the guard's scanner exact.
    "whitespace_flexible": False,
    "item_separator": ",",
    "key_separator": ":",
    "lenient": True,  # drop unimplemented keywords (reported as warnings) instead of refusing the schema
    "coerce_one_of": True,  # oneOf -> anyOf (over-approximation); the guard enforces "exactly one"
}
_DATA_KEYWORDS = ("enum", "const", "default", "examples")  # values, not subschemas
# (keyword, part of llguidance's error): refusals we lower by dropping the keyword from the grammar. A dropped
# patternProperties makes its keys fall to additionalProperties: over- or under-approximate, never unchecked.
_DROPPABLE_ON_ERROR = (("multipleOf", "multipleOf"), ("patternProperties", "are not disjoint"))
_UNIMPLEMENTED_RE = re.compile(r"Unimplemented keys: \[(.*?)\]")


class _LLGuidanceState:
    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def try_consume(self, token: int) -> bool:
        # try_consume_tokens leaves the matcher usable on refusal (consume_token would poison it).
        return self._m.try_consume_tokens([token]) == 1

    def validate(self, tokens: list[int]) -> int:
        return self._m.validate_tokens(tokens)

    def rollback(self, n: int) -> None:
        if n and not self._m.rollback(n):
            raise RuntimeError(f"llguidance could not roll back {n} tokens: {self._m.get_error()}")

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        v = bitmask[row]
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def is_accepting(self) -> bool:
        return self._m.is_accepting()

    def forced_tokens(self) -> list[int]:
        return list(self._m.compute_ff_tokens())

    @property
    def native(self) -> Any:
        """The LLMatcher, for llguidance's parallel executor."""
        return self._m


class _LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any) -> None:
        import llguidance
        import llguidance.hf

        self._llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer)
        self.vocab_size = self.tokenizer.vocab_size
        self.eos = self.tokenizer.eos_token

    def token_bytes(self) -> list[bytes]:
        return [self.tokenizer.decode_bytes([t]) for t in range(self.vocab_size)]

    def _grammar(self, spec: StructuredSpec) -> str:
        M = self._llg.LLMatcher
        if spec.kind in ("json_object", "json_schema"):
            return M.grammar_from_json_schema(json.dumps(spec.schema), defaults=_LLG_JSON_OPTIONS)
        if spec.kind == "regex":
            return M.grammar_from_regex(spec.text)
        if spec.kind == "grammar":
            return self._llg.grammar_from("grammar", spec.text)
        lark = "start: " + " | ".join(json.dumps(c) for c in spec.choices)
        return M.grammar_from_lark(lark)

    def _validate(self, grammar: str) -> list[str]:
        is_error, messages = self._llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise ValueError(messages[0] if messages else "invalid grammar")
        return messages

    def compile(self, spec: StructuredSpec) -> tuple[Any, tuple[str, ...]]:
        dropped: list[str] = []
        if spec.kind == "json_schema":
            schema = spec.schema
            if schema is False:
                raise ValueError("the schema is `false`: no instance is valid")
            schema = _lower(schema, self._regex_ok, dropped)
            spec = StructuredSpec("json_schema", json.dumps(schema), spec.name, spec.strict)
            if _contains_key(schema, "oneOf"):
                dropped.append("oneOf (compiled as anyOf)")
        grammar = self._grammar(spec)
        messages = None
        while messages is None:
            try:
                messages = self._validate(grammar)
            except ValueError as e:
                # A few refusals have a safe fallback: drop the keyword from the grammar, the guard checks it.
                keyword = next((k for k, why in _DROPPABLE_ON_ERROR if why in str(e)), None)
                if spec.kind != "json_schema" or keyword is None or keyword in dropped:
                    raise
                schema = _drop_keyword(schema, keyword)
                dropped.append(keyword)
                spec = StructuredSpec("json_schema", json.dumps(schema), spec.name, spec.strict)
                grammar = self._grammar(spec)
        for msg in messages:
            found = _UNIMPLEMENTED_RE.search(msg)
            if found:
                dropped += [k.strip().strip('"') for k in found.group(1).split(",")]
            else:
                dropped.append(msg.strip())
        matcher = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)  # builds the lexer; drops the GIL
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher, tuple(dict.fromkeys(dropped))

    def _regex_ok(self, pattern: str) -> bool:
        grammar = self._llg.LLMatcher.grammar_from_json_schema({"type": "string", "pattern": pattern})
        is_error, _ = self._llg.LLMatcher.validate_grammar_with_warnings(grammar)
        return not is_error

    def new_state(self, handle: Any) -> _LibState:
        return _LLGuidanceState(handle.deep_copy())

    def executor(self) -> Any:
        return self._llg.LLExecutor()


# ------------------------------------------------------------------------------------------------- xgrammar
class _XGrammarState:
    def __init__(self, matcher: Any, encode: Any) -> None:
        self._m = matcher
        self._encode = encode

    def try_consume(self, token: int) -> bool:
        return bool(self._m.accept_token(token))

    def validate(self, tokens: list[int]) -> int:
        n = 0
        for t in tokens:
            if not self._m.accept_token(t):
                break
            n += 1
        if n:
            self._m.rollback(n)
        return n

    def rollback(self, n: int) -> None:
        if n:
            self._m.rollback(n)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def is_accepting(self) -> bool:
        return bool(self._m.is_completed())

    def forced_tokens(self) -> list[int]:
        text = self._m.find_jump_forward_string()
        if not text:
            return []
        tokens = self._encode(text)
        return tokens[: self.validate(tokens)]


class _XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any) -> None:
        import xgrammar

        self._xgr = xgrammar
        self._hf = tokenizer
        self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer)
        self.vocab_size = self.info.vocab_size
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)

    def token_bytes(self) -> list[bytes]:
        vocab = self.info.decoded_vocab
        return [bytes(vocab[t]) if t < len(vocab) else b"" for t in range(self.vocab_size)]

    def compile(self, spec: StructuredSpec) -> tuple[Any, tuple[str, ...]]:
        try:
            if spec.kind in ("json_object", "json_schema"):
                schema = spec.schema
                handle = self.compiler.compile_json_schema(
                    json.dumps(schema), any_whitespace=False, separators=(",", ":"), strict_mode=True
                )
                dropped = sorted(k for k in _all_keys(schema) if k not in _XGRAMMAR_CORE)
                return handle, tuple(dropped)
            if spec.kind == "regex":
                return self.compiler.compile_regex(spec.text), ()
            if spec.kind == "grammar":
                return self.compiler.compile_grammar(spec.text), ()
            ebnf = "root ::= " + " | ".join(json.dumps(c) for c in spec.choices)
            return self.compiler.compile_grammar(ebnf), ()
        except RuntimeError as e:  # xgrammar reports every compile problem as RuntimeError
            raise ValueError(str(e)) from None

    def new_state(self, handle: Any) -> _LibState:
        matcher = self._xgr.GrammarMatcher(handle, terminate_without_stop_token=True)
        return _XGrammarState(matcher, lambda s: self._hf.encode(s, add_special_tokens=False))


# -------------------------------------------------------------------------------------------------- backend
@dataclass(frozen=True)
class TokenMarks:
    """Per-token bool/int arrays over the vocabulary: what JSON structure a token's bytes contain."""

    quote: np.ndarray
    comma: np.ndarray
    close_count: np.ndarray
    literal_end: np.ndarray
    length: np.ndarray


class GrammarBackend:
    """Compiles specs for one tokenizer and creates matchers. Build one per tokenizer; thread-safe.

    tokenizer:         a `transformers.PreTrainedTokenizerFast` (its eos_token_id is the stop token).
    library:           "llguidance" (default) or "xgrammar".
    compile_timeout_s: a compilation that takes longer is a ValueError (the worker finishes in the background
                       and its result still lands in the cache).
    guard:             enforce with jsonschema what the grammar cannot (matcher.py). Only benchmarks of the raw
                       library turn it off: without it, schemas with dropped keywords can yield invalid JSON.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        library: str = "llguidance",
        compile_timeout_s: float = 10.0,
        cache_size: int = 256,
        compile_workers: int = 2,
        eos_token_ids: list[int] | None = None,
        guard: bool = True,
    ) -> None:
        if library not in LIBRARIES:
            raise ValueError(f"unknown grammar library {library!r}; choose one of {LIBRARIES}")
        self.library = library
        self._lib: _Library = _LLGuidance(tokenizer) if library == "llguidance" else _XGrammar(tokenizer)
        self.vocab_size: int = self._lib.vocab_size
        if eos_token_ids is None:
            eos_token_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        if not eos_token_ids:
            raise ValueError("the tokenizer has no eos_token_id; pass eos_token_ids=")
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        self.native_eos: int | None = getattr(self._lib, "eos", None)  # the EOS the library itself masks
        self.compile_timeout_s = compile_timeout_s
        self.guard = guard
        self._cache: OrderedDict[tuple[str, str], Future[CompiledGrammar]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=compile_workers, thread_name_prefix="grammar-compile")
        self._token_bytes: list[bytes] | None = None
        self._marks: TokenMarks | None = None
        self._executor: Any = None
        if guard:
            self.byte_marks()  # ~0.5 s for a 150k vocab: pay it at startup, not on the first guarded request

    # -- compile -------------------------------------------------------------------------------------------
    def compile_async(self, structured: Any) -> Future[CompiledGrammar]:
        """Start (or join) the compilation of `structured`; spec errors raise ValueError right here."""
        spec = parse_structured(structured)
        with self._lock:
            future = self._cache.get(spec.cache_key)
            if future is not None:
                self._cache.move_to_end(spec.cache_key)
                return future
            future = self._pool.submit(self._compile_now, spec)
            self._cache[spec.cache_key] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return future

    def compile(self, structured: Any, *, timeout_s: float | None = None) -> CompiledGrammar:
        """Compile (cached) within the time limit. Any problem with the spec is a ValueError naming it."""
        spec = parse_structured(structured)
        future = self.compile_async(spec)
        limit = self.compile_timeout_s if timeout_s is None else timeout_s
        try:
            return future.result(timeout=limit)
        except FutureTimeout:
            raise ValueError(f"{_describe(spec)}: grammar compilation exceeded the time limit of {limit:g} s") from None

    def _compile_now(self, spec: StructuredSpec) -> CompiledGrammar:
        start = time.perf_counter()
        try:
            handle, dropped = self._lib.compile(spec)
        except ValueError as e:
            raise ValueError(f"{_describe(spec)}: not supported by {self.library}: {_first_line(e)}") from None
        except Exception as e:  # a library bug must not kill the engine: surface it as bad input
            raise ValueError(f"{_describe(spec)}: {self.library} failed to compile it: {e!r}") from None
        guard = None
        if self.guard and spec.kind in ("json_object", "json_schema"):
            try:
                guard = SchemaGuard(spec.schema, dropped=dropped)
            except ValueError as e:
                raise ValueError(f"{_describe(spec)}: {e}") from None
        return CompiledGrammar(spec, self.library, handle, dropped, guard, time.perf_counter() - start)

    # -- matchers ------------------------------------------------------------------------------------------
    def matcher(self, compiled: CompiledGrammar) -> Matcher:
        """A fresh per-request matcher at the start of the output."""
        if compiled.library != self.library:
            raise ValueError(f"grammar compiled by {compiled.library}, backend is {self.library}")
        return Matcher(self._lib.new_state(compiled.handle), self, compiled)

    def fill_native(self, jobs: list[tuple[Any, int, list[int]]], bitmask: torch.Tensor) -> None:
        """Fill rows for unguarded llguidance matchers in parallel in native threads (the GIL is released)."""
        if self._executor is None:
            self._executor = self._lib.executor()
        if not bitmask.is_contiguous() or bitmask.dtype != torch.int32 or bitmask.device.type != "cpu":
            raise ValueError("bitmask must be a contiguous CPU int32 tensor")
        row_bytes, rows = bitmask.shape[1] * 4, bitmask.shape[0]
        plain = [(m, row) for m, row, drafts in jobs if not drafts]
        with_drafts = [job for job in jobs if job[2]]
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), row_bytes, rows)
        if with_drafts:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(with_drafts, bitmask.data_ptr(), row_bytes, rows)

    def token_bytes(self) -> list[bytes]:
        """Bytes of every token id (built once; used by the guard)."""
        if self._token_bytes is None:
            self._token_bytes = self._lib.token_bytes()
        return self._token_bytes

    def byte_marks(self) -> TokenMarks:
        """Which tokens contain the bytes that can close a JSON value or key (built once; used by the guard)."""
        if self._marks is None:
            pieces = self.token_bytes()
            self._marks = TokenMarks(
                quote=np.array([b'"' in p for p in pieces], dtype=bool),
                comma=np.array([b"," in p for p in pieces], dtype=bool),
                close_count=np.array([p.count(b"]") + p.count(b"}") for p in pieces], dtype=np.int32),
                literal_end=np.array([p[-1:] in (b"e", b"l") for p in pieces], dtype=bool),
                length=np.array([len(p) for p in pieces], dtype=np.int32),
            )
        return self._marks

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        from leapdecode.structured.bitmask import allocate_token_bitmask

        return allocate_token_bitmask(rows, self.vocab_size)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def fill_bitmasks(jobs: list[tuple[Matcher, int, list[int]]], bitmask: torch.Tensor) -> list[int]:
    """Batched fill for one engine step; safe to run in a thread while the forward pass runs.

    Each job is (matcher, first_row, drafts): rows first_row .. first_row + n are filled, where n is how many
    of `drafts` the grammar accepts (the draft positions plus the bonus). Returns n per job, so the caller
    can cut each request's drafts to its valid prefix. The matchers end in the state they started in.
    """
    counts = [0] * len(jobs)
    native: dict[int, tuple[GrammarBackend, list[tuple[Any, int, list[int]]], list[Matcher]]] = {}
    for i, (matcher, row, drafts) in enumerate(jobs):
        job = matcher.native_job(row, drafts)
        if job is None:
            counts[i] = matcher.fill_bitmasks(bitmask, row, drafts)
        else:
            counts[i] = len(job[2])
            entry = native.setdefault(id(matcher.backend), (matcher.backend, [], []))
            entry[1].append(job)
            entry[2].append(matcher)
    for backend, native_jobs, matchers in native.values():
        backend.fill_native(native_jobs, bitmask)
        for (_, row, drafts), matcher in zip(native_jobs, matchers):
            matcher.finish_native(bitmask, row, drafts)
    return counts


def json_text(instance: Any, schema: Any = None) -> str:
    """The JSON text our grammars produce for `instance`: compact separators, non-ASCII kept as is, and object
    keys in the order the schema declares them (llguidance emits declared `properties` in schema order, then
    any additional properties). Keys are ranked by their first appearance anywhere in the schema."""
    rank: dict[str, int] = {}

    def collect(node: Any) -> None:
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict):
                for name in props:
                    rank.setdefault(name, len(rank))
            for k, v in node.items():
                if k not in _DATA_KEYWORDS:
                    collect(v)
        elif isinstance(node, list):
            for v in node:
                collect(v)

    def order(value: Any) -> Any:
        if isinstance(value, dict):
            keys = sorted(enumerate(value), key=lambda ik: (rank.get(ik[1], len(rank)), ik[0]))
            return {k: order(value[k]) for _, k in keys}
        if isinstance(value, list):
            return [order(v) for v in value]
        return value

    collect(schema)
    return json.dumps(order(instance), separators=(",", ":"), ensure_ascii=False)


# ---------------------------------------------------------------------------------------------- schema utils
def _describe(spec: StructuredSpec) -> str:
    if spec.kind == "json_schema":
        return f"json_schema {spec.name!r}"
    return f"{spec.kind} spec"


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text if len(text) < 500 else text[:500] + "..."


def _all_keys(node: Any) -> set[str]:
    """Every keyword used anywhere in a schema (property names included; only used for over-reporting)."""
    keys: set[str] = set()
    if isinstance(node, dict):
        for k, v in node.items():
            keys.add(k)
            keys |= _all_keys(v)
    elif isinstance(node, list):
        for v in node:
            keys |= _all_keys(v)
    return keys


def _contains_key(node: Any, key: str) -> bool:
    if isinstance(node, dict):
        return key in node or any(_contains_key(v, key) for v in node.values())
    if isinstance(node, list):
        return any(_contains_key(v, key) for v in node)
    return False


_INTEGER_KEYWORDS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties", "minContains", "maxContains")


def _drop_keyword(schema: Any, keyword: str) -> Any:
    """A copy of `schema` without `keyword` anywhere (outside data values)."""
    if isinstance(schema, dict):
        return {k: (v if k in _DATA_KEYWORDS else _drop_keyword(v, keyword)) for k, v in schema.items() if k != keyword}
    if isinstance(schema, list):
        return [_drop_keyword(v, keyword) for v in schema]
    return schema


def _lower(schema: Any, regex_ok: Any, dropped: list[str]) -> Any:
    """Rewrite `schema` into a form the library takes, without changing which instances are valid, except where
    noted in `dropped` (then the guard re-checks):

    * the root schema `true` becomes `{}`; counts written as 2.0 become 2 (same meaning in JSON Schema);
    * `pattern`s the library's regex engine rejects (look-around, back-references) are removed (over-
      approximation); a rejected patternProperties entry is removed, so its keys fall to additionalProperties
      (at worst an under-approximation, never an invalid instance).
    """
    schema = {} if schema is True else copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key in _INTEGER_KEYWORDS:
                value = node.get(key)
                if isinstance(value, float) and value.is_integer():
                    node[key] = int(value)
            pattern = node.get("pattern")
            if isinstance(pattern, str) and not regex_ok(pattern):
                del node["pattern"]
                dropped.append("pattern (regex not supported by the library)")
            props = node.get("patternProperties")
            if isinstance(props, dict):
                for key in [k for k in props if not regex_ok(k)]:
                    del props[key]
                    dropped.append("patternProperties (regex not supported by the library)")
            for k, v in node.items():
                if k not in _DATA_KEYWORDS:
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(schema)
    return schema
