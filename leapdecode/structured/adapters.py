"""Grammar library adapters: llguidance (the default, chosen by benchmarks/structured_backends.py) and xgrammar,
each behind the same two-part interface (`Library.compile` and `LibState`); a third library is one more pair of
classes. `make_library(name, tokenizer)` builds one.

JSON schemas are first *lowered* for the library (lowering.py): llguidance runs in lenient mode, which drops
keywords it cannot express (uniqueItems, not, if/then/else, contains, dependentRequired, propertyNames,
unevaluated*, ...) and reports them; patterns whose regex the library cannot parse (look-around,
back-references) are removed by us. `compile` returns what was dropped; the guard (guard.py) enforces it.
"""

from __future__ import annotations

import json
import re
from typing import Any, Protocol

import numpy as np
import torch

from leapdecode.structured.lowering import SHARED_PREFIX, all_keys, drop_keyword, lower
from leapdecode.structured.spec import StructuredSpec

__all__ = ["LIBRARIES", "LibState", "Library", "make_library"]

LIBRARIES = ("llguidance", "xgrammar")

# Keywords the guard re-checks when the library dropped them. llguidance names them in its warnings; for
# xgrammar (which never says) we assume every keyword outside its documented core set may be approximated.
_XGRAMMAR_CORE = {
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
    "enum", "const", "anyOf", "allOf", "$ref", "$defs", "definitions", "minLength", "maxLength", "pattern",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "$schema", "$id", "title", "description",
    "default", "examples", "$comment",
}


class LibState(Protocol):
    """One request's parser state inside the grammar library (EOS is handled by `Matcher`, never passed here)."""

    def try_consume(self, token: int) -> bool: ...
    def validate(self, tokens: list[int]) -> int: ...
    def rollback(self, n: int) -> None: ...
    def fill(self, bitmask: torch.Tensor, row: int) -> None: ...
    def is_accepting(self) -> bool: ...
    def forced_tokens(self) -> list[int]: ...
    def error(self) -> str | None: ...


class Library(Protocol):
    name: str
    vocab_size: int

    def compile(self, spec: StructuredSpec, schema: Any = None, relax: Any = (),
                expand: Any = (), unions: Any = ()) -> tuple[Any, tuple[str, ...]]: ...
    def new_state(self, handle: Any) -> LibState: ...
    def token_bytes(self) -> list[bytes]: ...


# ----------------------------------------------------------------------------------------------- llguidance
_LLG_JSON_OPTIONS = {
    # whitespace_flexible is set per spec (spec.whitespace): "flexible" allows JSON whitespace around every
    # token (indented JSON), "compact" none; separators are "," and ":" either way.
    "whitespace_flexible": True,
    "item_separator": ",",
    "key_separator": ":",
    "lenient": True,  # drop unimplemented keywords (reported as warnings) instead of refusing the schema
    "coerce_one_of": True,  # oneOf -> anyOf (over-approximation); the guard enforces "exactly one"
}
# "flexible" whitespace between tokens: any JSON whitespace, bounded per gap (up to 16 spaces/tabs, then up to two
# line breaks each followed by up to 48 spaces/tabs: indented JSON to depth 24 at 2 spaces), so that a model
# cannot spend its whole budget on whitespace, a known failure mode of unbounded `[ \t\n\r]+`.
FLEXIBLE_WHITESPACE = r"[\x20\x09]{0,16}(?:\x0D?\x0A[\x20\x09]{0,48}){0,2}"
# (keyword, part of llguidance's error): refusals we lower by dropping the keyword from the grammar. A dropped
# patternProperties makes its keys fall to additionalProperties: over- or under-approximate, never unchecked.
_OVERLAP = "are not disjoint"   # llguidance's refusal of overlapping pattern properties
_DROPPABLE_ON_ERROR = (("multipleOf", "multipleOf"), ("patternProperties", _OVERLAP),
                       ("pattern", "Unable to determine if regex is empty"))
_UNIMPLEMENTED_RE = re.compile(r"Unimplemented keys: \[(.*?)\]")
_MIN_MAX_PROPERTIES = "min/maxProperties only supported"


def library_error(message: str) -> str:
    """llguidance's error without its state dump (the text before "<state>"), on one line."""
    text = message.split("<state>")[0].strip()
    return " ".join(text.split())[:500] or "the grammar library stopped with an error"


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
        # the row's address computed, not indexed: a tensor view costs ~1 us, a tenth of a guarded row's overhead
        size = bitmask.shape[1] * bitmask.element_size()
        self._m.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * bitmask.stride(0) * bitmask.element_size(), size)

    def is_accepting(self) -> bool:
        return self._m.is_accepting()

    def forced_tokens(self) -> list[int]:
        return list(self._m.compute_ff_tokens())

    def error(self) -> str | None:
        """The library's message once it stopped with an error (e.g. a lexer resource limit), else None."""
        return library_error(self._m.get_error()) if self._m.is_error() else None

    @property
    def native(self) -> Any:
        """The LLMatcher, for llguidance's parallel executor."""
        return self._m


class _LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any, limits: Any = None) -> None:
        import llguidance
        import llguidance.hf

        self._llg = llguidance
        self.limits = limits  # llguidance.LLParserLimits (None: the library's defaults)
        self._regex_cache: dict[str, bool] = {}
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer)
        self.vocab_size = self.tokenizer.vocab_size
        self.eos = self.tokenizer.eos_token

    def token_bytes(self) -> list[bytes]:
        return [self.tokenizer.decode_bytes([t]) for t in range(self.vocab_size)]

    def _grammar(self, spec: StructuredSpec) -> str:
        M = self._llg.LLMatcher
        if spec.kind == "regex":
            return M.grammar_from_regex(spec.text)
        if spec.kind == "grammar":
            return self._llg.grammar_from("grammar", spec.text)
        lark = "start: " + " | ".join(json.dumps(c) for c in spec.choices)
        return M.grammar_from_lark(lark)

    def compile(self, spec: StructuredSpec, schema: Any = None, relax: Any = (),
                expand: Any = (), unions: Any = ()) -> tuple[Any, tuple[str, ...]]:
        """One pass: the matcher is built once (it compiles the grammar and reports lenient-mode warnings); only
        a refusal with a safe fallback (see `_DROPPABLE_ON_ERROR`) compiles again without that keyword.

        schema: the spec's parsed schema (parsed here when None); expand: ids of its small closed objects to write
        in every property order (`lowering.lower`); relax: ids of its object subschemas whose
        properties may come in any order (`lowering.lower`; the guard checks required and duplicate keys); unions:
        ids of the unions of such objects, whose own `required` the guard checks (`lowering.lower`)."""
        dropped: list[str] = []
        original, compact = None, False     # (compact: lowered with `lowering.lower`'s compact pieces)
        if spec.kind in ("json_object", "json_schema"):
            schema = spec.schema if schema is None else schema
            if schema is False:
                raise ValueError("the schema is `false`: no instance is valid")
            original, compact = schema, True
            schema = lower(original, self._regex_ok, dropped, relax=relax, expand=expand, unions=unions)
        options = {**_LLG_JSON_OPTIONS, "whitespace_flexible": spec.whitespace == "flexible"}
        if spec.whitespace == "flexible":
            options["whitespace_pattern"] = FLEXIBLE_WHITESPACE
        while True:
            grammar = self._grammar(spec) if schema is None else self._schema_grammar(schema, options)
            matcher = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
            if matcher.is_error():
                error = matcher.get_error()
                if compact and (SHARED_PREFIX in error or _OVERLAP in error):
                    # the compact lowering's two failures (`lowering.lower`): grouped names of two intersected
                    # objects overlap; a `$defs` entry no value satisfies (`{"$ref": <a string>, "type": "object"}`),
                    # which in place only rules its optional property out. Lowered again, one name a pattern, each
                    # subschema in place.
                    dropped.clear()
                    compact = False
                    schema = lower(original, self._regex_ok, dropped, relax=relax, expand=expand, unions=unions,
                                   compact=False)
                    continue
                # A few refusals have a safe fallback: drop the keyword from the grammar, the guard checks it.
                keyword = next((k for k, why in _DROPPABLE_ON_ERROR if why in error), None)
                if schema is None or keyword is None or keyword in dropped:
                    raise ValueError(error)
                schema = drop_keyword(schema, keyword)
                dropped.append(keyword)
                continue
            messages = matcher.get_grammar_warnings()
            if schema is not None and any(_MIN_MAX_PROPERTIES in m for m in messages):
                # llguidance's lenient lowering of min/maxProperties beside optional properties can leave no way
                # to close the object (it counts only additional properties): drop both, the guard checks them.
                schema = drop_keyword(drop_keyword(schema, "minProperties"), "maxProperties")
                dropped += ["minProperties", "maxProperties"]
                continue
            break
        for msg in messages:
            found = _UNIMPLEMENTED_RE.search(msg)
            if found:
                dropped += [k.strip().strip('"') for k in found.group(1).split(",")]
            else:
                dropped.append(msg.strip())
        # Resource limits (lexer size, fuel) only bite when a mask is computed: compute the first one now, so a
        # grammar the library cannot run is a ValueError at submission, never a silent all-zero mask later.
        # (numpy, not torch: compiles run in their own thread, where no PyTorch op may run; native.py's
        # release_openmp_threads says why)
        probe = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(probe.ctypes.data, probe.nbytes)
        if matcher.is_error():
            raise ValueError(library_error(matcher.get_error()))
        return matcher, tuple(dict.fromkeys(dropped))

    def _schema_grammar(self, schema: Any, options: dict[str, Any]) -> str:
        return self._llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)

    def _regex_ok(self, pattern: str) -> bool:
        ok = self._regex_cache.get(pattern)
        if ok is None:
            grammar = self._llg.LLMatcher.grammar_from_json_schema({"type": "string", "pattern": pattern})
            is_error, _ = self._llg.LLMatcher.validate_grammar_with_warnings(grammar)
            ok = not is_error
            if len(self._regex_cache) > 4096:
                self._regex_cache.clear()
            self._regex_cache[pattern] = ok
        return ok

    def new_state(self, handle: Any) -> LibState:
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

    def error(self) -> str | None:
        return None

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

    def compile(self, spec: StructuredSpec, schema: Any = None, relax: Any = (),
                expand: Any = (), unions: Any = ()) -> tuple[Any, tuple[str, ...]]:
        try:
            if spec.kind in ("json_object", "json_schema"):
                schema = spec.schema if schema is None else schema
                flexible = spec.whitespace == "flexible"
                handle = self.compiler.compile_json_schema(
                    json.dumps(schema), any_whitespace=flexible, separators=(",", ": ") if flexible else (",", ":"),
                    strict_mode=True,
                )
                dropped = sorted(k for k in all_keys(schema) if k not in _XGRAMMAR_CORE)
                return handle, tuple(dropped)
            if spec.kind == "regex":
                return self.compiler.compile_regex(spec.text), ()
            if spec.kind == "grammar":
                return self.compiler.compile_grammar(spec.text), ()
            ebnf = "root ::= " + " | ".join(json.dumps(c) for c in spec.choices)
            return self.compiler.compile_grammar(ebnf), ()
        except RuntimeError as e:  # xgrammar reports every compile problem as RuntimeError
            raise ValueError(str(e)) from None

    def new_state(self, handle: Any) -> LibState:
        matcher = self._xgr.GrammarMatcher(handle, terminate_without_stop_token=True)
        return _XGrammarState(matcher, lambda s: self._hf.encode(s, add_special_tokens=False))


def make_library(name: str, tokenizer: Any, limits: Any = None) -> Library:
    if name not in LIBRARIES:
        raise ValueError(f"unknown grammar library {name!r}; choose one of {LIBRARIES}")
    return _LLGuidance(tokenizer, limits) if name == "llguidance" else _XGrammar(tokenizer)
