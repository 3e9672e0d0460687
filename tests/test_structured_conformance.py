"""Structured output: spec parsing, grammar backend, matcher, bitmasks, ASAp, and JSON-Schema-Test-Suite conformance.

CPU only and self-contained: the tokenizer is a small byte-level BPE trained here, the suite files are copied in
tests/data/json_schema_test_suite (required-behaviour files of draft2020-12 and draft7).

Conformance rule: for every schema group the backend compiles, each valid instance must be producible (every
token allowed by the mask, then EOS allowed) and each invalid one impossible (some token refused, or EOS refused
at the end). Instances are written as the grammar writes JSON: compact separators, and (llguidance emits declared
properties in schema order) object keys either as given or in schema order - `json_text`.
Everything that does not conform is listed in UNSUPPORTED with its reason; a stale entry fails the test too.
"""

from __future__ import annotations

import copy
import json
import re
import pathlib
import random
from collections import Counter
from typing import Any

import pytest
import torch

from leapdecode.structured import (
    AsapTrie,
    GrammarBackend,
    allocate_token_bitmask,
    apply_token_bitmask,
    bitmask_to_bool,
    fill_bitmasks,
    parse_structured,
)
from structured_helpers import json_text

SUITE = pathlib.Path(__file__).parent / "data" / "json_schema_test_suite" / "tests"
DRAFT_URIS = {"draft2020-12": "https://json-schema.org/draft/2020-12/schema", "draft7": "http://json-schema.org/draft-07/schema#"}

# Refused at compile time (a clear ValueError), so nothing is ever generated for these schemas:
_REMOTE = "refers to a remote schema (http://localhost:1234/...); the backend never fetches schemas"
_UNSAT = "unsatisfiable schema (no instance is valid): refusing it with a ValueError is the right outcome"
# Compiled, but some VALID instances cannot be produced (an under-approximation; never an invalid instance):
_INT_FLOAT = "a number with a zero fraction (1.0, [0.0]): the grammar writes the equal value in integer form only"
_REF_ORDER = ("properties merged from $ref beside unevaluatedProperties keep llguidance's fixed merge order (key_order "
              "'any' relaxes only objects the guard can check exactly)")
_FORMAT = "format is asserted (grammar + jsonschema FormatChecker), stricter than the annotation-only default"
# (file, group description[, test description]) -> reason; (file, "*") covers a whole file.
UNSUPPORTED: dict[tuple[str, ...], str] = {
    ("draft2020-12/format.json", "*"): _FORMAT,  # which formats fail depends on jsonschema's installed checkers
    ('draft7/refRemote.json', '*'): _REMOTE,
    ('draft2020-12/refRemote.json', '*'): _REMOTE,
    ('draft2020-12/allOf.json', 'allOf with boolean schemas, some false'): _UNSAT,
    ('draft2020-12/allOf.json', 'allOf with boolean schemas, all false'): _UNSAT,
    ('draft2020-12/anyOf.json', 'anyOf with boolean schemas, all false'): _UNSAT,
    ('draft2020-12/boolean_schema.json', "boolean schema 'false'"): _UNSAT,
    ('draft2020-12/const.json', 'const with 0 does not match other zero-like types', 'float zero is valid'): _INT_FLOAT,
    ('draft2020-12/const.json', 'const with 1 does not match true', 'float one is valid'): _INT_FLOAT,
    ('draft2020-12/const.json', 'const with -2.0 matches integer and float types', 'float -2.0 is valid'): _INT_FLOAT,
    ('draft2020-12/const.json', 'float and integers are equal up to 64-bit representation limits', 'float is valid'): _INT_FLOAT,
    ('draft2020-12/dynamicRef.json', 'strict-tree schema, guards against misspelled properties'): _REMOTE,
    ('draft2020-12/dynamicRef.json', 'tests for implementation dynamic anchor and reference link'): _REMOTE,
    ('draft2020-12/dynamicRef.json', '$ref and $dynamicAnchor are independent of order - $defs first'): _REMOTE,
    ('draft2020-12/dynamicRef.json', '$ref and $dynamicAnchor are independent of order - $ref first'): _REMOTE,
    ('draft2020-12/dynamicRef.json', '$ref to $dynamicRef finds detached $dynamicAnchor'): _REMOTE,
    ('draft2020-12/enum.json', 'enum with 0 does not match false', 'float zero is valid'): _INT_FLOAT,
    ('draft2020-12/enum.json', 'enum with [0] does not match [false]', '[0.0] is valid'): _INT_FLOAT,
    ('draft2020-12/enum.json', 'enum with 1 does not match true', 'float one is valid'): _INT_FLOAT,
    ('draft2020-12/enum.json', 'enum with [1] does not match [true]', '[1.0] is valid'): _INT_FLOAT,
    ('draft2020-12/enum.json', 'empty enum'): _UNSAT,
    ('draft2020-12/oneOf.json', 'oneOf with boolean schemas, all false'): _UNSAT,
    ('draft2020-12/ref.json', '$ref to boolean schema false'): _UNSAT,
    ('draft2020-12/type.json', 'integer type matches integers', 'a float with zero fractional part is an integer'): _INT_FLOAT,
    ('draft2020-12/unevaluatedProperties.json', 'unevaluatedProperties with $ref', 'with no unevaluated properties'): _REF_ORDER,
    ('draft2020-12/vocabulary.json', 'schema that uses custom metaschema with with no validation vocabulary'): _REMOTE,
    ('draft2020-12/vocabulary.json', 'ignore unrecognized optional vocabulary'): _REMOTE,
    ('draft7/allOf.json', 'allOf with boolean schemas, some false'): _UNSAT,
    ('draft7/allOf.json', 'allOf with boolean schemas, all false'): _UNSAT,
    ('draft7/anyOf.json', 'anyOf with boolean schemas, all false'): _UNSAT,
    ('draft7/boolean_schema.json', "boolean schema 'false'"): _UNSAT,
    ('draft7/const.json', 'const with 0 does not match other zero-like types', 'float zero is valid'): _INT_FLOAT,
    ('draft7/const.json', 'const with 1 does not match true', 'float one is valid'): _INT_FLOAT,
    ('draft7/const.json', 'const with -2.0 matches integer and float types', 'float -2.0 is valid'): _INT_FLOAT,
    ('draft7/const.json', 'float and integers are equal up to 64-bit representation limits', 'float is valid'): _INT_FLOAT,
    ('draft7/enum.json', 'enum with 0 does not match false', 'float zero is valid'): _INT_FLOAT,
    ('draft7/enum.json', 'enum with [0] does not match [false]', '[0.0] is valid'): _INT_FLOAT,
    ('draft7/enum.json', 'enum with 1 does not match true', 'float one is valid'): _INT_FLOAT,
    ('draft7/enum.json', 'enum with [1] does not match [true]', '[1.0] is valid'): _INT_FLOAT,
    ('draft7/oneOf.json', 'oneOf with boolean schemas, all false'): _UNSAT,
    ('draft7/ref.json', '$ref to boolean schema false'): _UNSAT,
    ('draft7/type.json', 'integer type matches integers', 'a float with zero fractional part is an integer'): _INT_FLOAT,

}


# ------------------------------------------------------------------------------------------------ fixtures
def _corpus() -> list[str]:
    """A few KB of JSON-ish text: enough merges for realistic multi-byte tokens (quotes+braces, digits, keys)."""
    rng = random.Random(0)
    words = ["name", "age", "tags", "id", "value", "items", "type", "foo", "bar", "baz", "alpha", "beta", "a", "b"]
    out = []
    for _ in range(300):
        obj = {rng.choice(words): rng.choice([rng.randint(-99, 999), rng.choice(words), [1, 2, "x"], {"a": 1.5}, None, True, False]) for _ in range(3)}
        out.append(json.dumps(obj, separators=(",", ":")))
        out.append(json.dumps(list(obj.values()), separators=(",", ":")))
    return out


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(_corpus(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@pytest.fixture(scope="session")
def backend(tokenizer: Any) -> GrammarBackend:
    return GrammarBackend(tokenizer)


def _schema_spec(schema: Any, name: str = "t") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _produce(backend: GrammarBackend, compiled: Any, tokenizer: Any, text: str, check_mask: bool = True) -> bool:
    """Walk `text` token by token; True if the matcher accepts all of it and then EOS.

    With check_mask, also checks at every step that a token the mask allows is accepted (the mask may be
    stricter than accept(): where the grammar forces bytes, llguidance offers only their canonical tokenization).
    """
    matcher = backend.matcher(compiled)
    bitmask = allocate_token_bitmask(1, backend.vocab_size)
    for token in _encode(tokenizer, text) + [tokenizer.eos_token_id]:
        allowed = False
        if check_mask:
            matcher.fill_bitmask(bitmask, 0)
            allowed = bool((int(bitmask[0, token >> 5]) >> (token & 31)) & 1)
        accepted = matcher.accept(token)
        assert accepted or not allowed, f"the mask allows token {token} in {text!r} but accept() refuses it"
        if not accepted:
            return False
    return matcher.is_terminated()


# ---------------------------------------------------------------------------------------------- conformance
def _suite_groups() -> list[tuple[str, dict[str, Any]]]:
    groups = []
    for draft, uri in DRAFT_URIS.items():
        for path in sorted((SUITE / draft).glob("*.json")):
            for group in json.loads(path.read_text()):
                schema = group["schema"]
                if isinstance(schema, dict) and "$schema" not in schema:
                    schema = {"$schema": uri, **schema}  # the draft decides keyword semantics (jsonschema + grammar)
                groups.append((f"{draft}/{path.name}", {**group, "schema": schema}))
    return groups


def _listed(file: str, group: str, test: str | None = None) -> str | None:
    return UNSUPPORTED.get((file, "*")) or UNSUPPORTED.get((file, group)) or (
        UNSUPPORTED.get((file, group, test)) if test is not None else None
    )


def run_suite(backend: GrammarBackend, tokenizer: Any) -> tuple[Counter, list[str], set[tuple[str, ...]]]:
    """Returns (counts, unexpected failures, UNSUPPORTED keys that were used)."""
    counts: Counter = Counter()
    failures: list[str] = []
    used: set[tuple[str, ...]] = set()

    def note(key: tuple[str, ...]) -> None:
        for k in (key[:1] + ("*",), key[:2], key):
            if k in UNSUPPORTED:
                used.add(k)

    for file, group in _suite_groups():
        desc = group["description"]
        counts["groups"] += 1
        try:
            compiled = backend.compile(_schema_spec(group["schema"]))
        except ValueError as e:
            counts["groups refused"] += 1
            if _listed(file, desc):
                note((file, desc))
            else:
                failures.append(f"refused: {(file, desc)!r}: {e}")
            continue
        counts["groups compiled"] += 1
        counts["groups exact"] += compiled.exact
        for i, test in enumerate(group["tests"]):
            # Default output form: any key order, flexible whitespace. So each instance is tried as given, compact
            # and indented: a valid one must be producible in both forms, an invalid one in neither.
            texts = [json.dumps(test["data"], separators=(",", ":"), ensure_ascii=False),
                     json.dumps(test["data"], indent=2, ensure_ascii=False)]
            # The mask-vs-accept invariant is checked on every group's first instance (it is the slow part).
            produced = [_produce(backend, compiled, tokenizer, t, check_mask=i == 0) for t in texts]
            kind = "valid" if test["valid"] else "invalid"
            good = all(produced) if test["valid"] else not any(produced)
            counts[f"{kind} instances"] += 1
            counts[f"{kind} {'accepted' if test['valid'] else 'rejected'}"] += good
            if not good:
                key = (file, desc, test["description"])
                if _listed(*key):
                    note(key)
                else:
                    failures.append(f"{kind} instance {'refused' if test['valid'] else 'produced'}: {key!r} {texts[0]} {produced}")
    return counts, failures, used


def test_json_schema_test_suite(backend: GrammarBackend, tokenizer: Any) -> None:
    counts, failures, used = run_suite(backend, tokenizer)
    print(
        f"\nJSON-Schema-Test-Suite (draft2020-12 + draft7, required files): {counts['groups compiled']}/{counts['groups']} "
        f"groups compiled ({counts['groups exact']} exactly, the rest with the jsonschema guard); "
        f"valid accepted {counts['valid accepted']}/{counts['valid instances']}; "
        f"invalid rejected {counts['invalid rejected']}/{counts['invalid instances']}; "
        f"{len(UNSUPPORTED)} UNSUPPORTED entries"
    )
    assert not failures, "\n".join(failures[:40]) + f"\n... {len(failures)} unexpected results"
    stale = set(UNSUPPORTED) - used
    assert not stale, f"UNSUPPORTED entries that now pass (remove them): {sorted(stale)}"


# ------------------------------------------------------------------------------------------- each spec type
def _accepts(backend: GrammarBackend, tokenizer: Any, spec: Any, text: str) -> bool:
    return _produce(backend, backend.compile(spec), tokenizer, text)


def test_json_object(backend: GrammarBackend, tokenizer: Any) -> None:
    spec = {"type": "json_object"}
    assert _accepts(backend, tokenizer, spec, '{"a":[1,2,{"b":null}],"c":"x"}')
    assert not _accepts(backend, tokenizer, spec, "[1,2]")
    assert not _accepts(backend, tokenizer, spec, '{"a":1')


def test_json_schema(backend: GrammarBackend, tokenizer: Any) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}}, "required": ["name", "age"], "additionalProperties": False}
    spec = _schema_spec(schema, "person")
    assert _accepts(backend, tokenizer, spec, '{"name":"Ann","age":31}')
    assert not _accepts(backend, tokenizer, spec, '{"name":"Ann","age":-1}')
    assert not _accepts(backend, tokenizer, spec, '{"name":"Ann"}')
    assert _accepts(backend, tokenizer, spec, '{"age":31, "name":"Ann"}')  # by default: any order, whitespace
    assert _accepts(backend, tokenizer, spec, '{\n  "name": "Ann",\n  "age": 31\n}')
    assert not _accepts(backend, tokenizer, spec, '{"name":"Ann","age":31,"name":"Bo"}')  # a key once only
    assert not _accepts(backend, tokenizer, spec, '{"age":31}')
    # No dead ends from the free order: with every declared key used (additionalProperties false) the comma is
    # refused, and a key that can only become a used name is refused at its first byte.
    matcher = backend.matcher(backend.compile(spec))
    assert matcher.accept_tokens(_encode(tokenizer, '{"age":31,"name":"Ann"')) > 0
    assert not matcher.accept(_encode(tokenizer, ",")[0]) and matcher.accept(_encode(tokenizer, "}")[0])
    matcher = backend.matcher(backend.compile(spec))
    prefix = _encode(tokenizer, '{"age":31,"')
    assert matcher.accept_tokens(prefix) == len(prefix)
    row = allocate_token_bitmask(1, backend.vocab_size)
    matcher.fill_bitmask(row, 0)
    allowed = bitmask_to_bool(row[0], backend.vocab_size)
    assert not allowed[_encode(tokenizer, "a")[0]]
    rest = _encode(tokenizer, 'name":"Bo"}')
    assert matcher.accept_tokens(rest) == len(rest) and matcher.is_accepting()
    # ... and in the last value, a token that closes it and brings a comma ('",') is masked too (found by the
    # server test: the mask allowed it, accept() refused it, the request aborted).
    for prefix in ('{"age":31,"name":"Ann', '{"name":"Ann","age":3'):
        matcher = backend.matcher(backend.compile(spec))
        assert matcher.accept_tokens(_encode(tokenizer, prefix)) == len(_encode(tokenizer, prefix))
        matcher.fill_bitmask(row, 0)
        for t in bitmask_to_bool(row[0], backend.vocab_size).nonzero().flatten().tolist():
            assert t == tokenizer.eos_token_id or matcher.accept_tokens([t]) == 1, (prefix, tokenizer.decode([t]))
            matcher.rollback(matcher.num_tokens - len(_encode(tokenizer, prefix)))
    compact = {**spec, "whitespace": "compact"}
    assert not _accepts(backend, tokenizer, compact, '{"name":"Ann", "age":3}')
    assert _accepts(backend, tokenizer, compact, '{"age":3,"name":"Ann"}')
    ordered = {**spec, "key_order": "schema"}
    assert not _accepts(backend, tokenizer, ordered, '{"age":31,"name":"Ann"}')
    assert _accepts(backend, tokenizer, ordered, '{"name": "Ann", "age": 31}')
    assert backend.compile(ordered).exact and not backend.compile(ordered).guard.active


def test_one_of_is_noted_and_checked_where_each_value_closes(backend: GrammarBackend, tokenizer: Any) -> None:
    """llguidance takes oneOf as anyOf; the lowering notes it, so the guard refuses the token that closes an array
    element matching both branches (no dead end: without the note, only the end of the document was checked)."""
    spec = _schema_spec({"type": "array", "items": {"oneOf": [{"type": "integer", "minimum": 0},
                                                              {"type": "integer", "maximum": 10}]}})
    compiled = backend.compile(spec)
    assert "oneOf (compiled as anyOf)" in compiled.dropped
    row = allocate_token_bitmask(1, backend.vocab_size)
    for prefix, closes in (("[5", False), ("[20", True), ("[-3", True)):
        matcher = backend.matcher(compiled)
        assert matcher.accept_tokens(_encode(tokenizer, prefix)) == len(_encode(tokenizer, prefix))
        matcher.fill_bitmask(row, 0)
        allowed = bitmask_to_bool(row[0], backend.vocab_size)
        assert bool(allowed[_encode(tokenizer, "]")[0]]) == closes, prefix
    assert _accepts(backend, tokenizer, spec, "[20,-3]") and not _accepts(backend, tokenizer, spec, "[20,5]")


def test_regex_grammar_choice(backend: GrammarBackend, tokenizer: Any) -> None:
    regex = {"type": "regex", "regex": r"[0-9]{3}-[a-c]+"}
    assert _accepts(backend, tokenizer, regex, "123-abca")
    assert not _accepts(backend, tokenizer, regex, "12-abc")
    lark = {"type": "grammar", "grammar": 'start: "sum(" NUM ("," NUM)* ")"\nNUM: /[0-9]+/'}
    assert _accepts(backend, tokenizer, lark, "sum(1,22,333)")
    assert not _accepts(backend, tokenizer, lark, "sum()")
    gbnf = {"type": "grammar", "grammar": 'root ::= "yes" | "no"'}
    assert _accepts(backend, tokenizer, gbnf, "no") and not _accepts(backend, tokenizer, gbnf, "maybe")
    choice = {"type": "choice", "choice": ["red", "green", "blue"]}
    assert all(_accepts(backend, tokenizer, choice, c) for c in ("red", "green", "blue"))
    assert not _accepts(backend, tokenizer, choice, "gre") and not _accepts(backend, tokenizer, choice, "redblue")


def test_spec_normalization_and_cache(backend: GrammarBackend) -> None:
    a = parse_structured({"type": "choice", "choice": ["b", "a", "b"]})
    assert a == parse_structured({"type": "choice", "choice": ["a", "b"]})
    first = backend.compile(_schema_spec({"type": "object", "properties": {"x": {"type": "integer"}}}, "one"))
    again = backend.compile(_schema_spec({"type": "object", "properties": {"x": {"type": "integer"}}}, "two"))
    assert again is first  # cached by the schema, not the name


def test_compile_cache_hit_skips_metaschema_check(backend: GrammarBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """The meta-schema check (jsonschema, the costly part of validating a spec) runs once per distinct schema: a
    cache hit costs only the shape checks, which still refuse a malformed request around a cached schema."""
    import leapdecode.structured.backend as backend_module

    calls = []
    check = backend_module.check_spec

    def counted(spec: Any) -> None:
        calls.append(spec)
        return check(spec)

    monkeypatch.setattr(backend_module, "check_spec", counted)
    schema = {"type": "object", "properties": {"cache_probe": {"type": "string"}}}
    first = backend.compile(_schema_spec(schema, "one"))
    assert len(calls) == 1
    assert backend.compile(_schema_spec(schema, "two")) is first and len(calls) == 1
    assert backend.compile_async(_schema_spec(schema, "three")).result() is first and len(calls) == 1
    with pytest.raises(ValueError, match=re.escape("['name'] is required")):
        backend.compile(_schema_spec(schema, "not a valid name!"))
    with pytest.raises(ValueError, match="invalid JSON schema at type"):  # a miss is still checked
        backend.compile(_schema_spec({"type": "strnig"}))
    assert len(calls) == 2
    backend._cache.clear()  # an evicted grammar recompiles; the meta-schema verdict is cached by schema text
    assert backend.compile(_schema_spec(schema, "four")) is not first and len(calls) == 2


def test_fast_metaschema_check_agrees_with_jsonschema() -> None:
    """The fast path (jsonschema_rs, when installed) accepts only what jsonschema accepts; errors keep
    jsonschema's message."""
    from leapdecode.structured.spec import check_schema

    for good in ({"type": "object", "properties": {"a": {"pattern": "^[a-z]+$"}}},
                 {"$schema": "http://json-schema.org/draft-07/schema#", "items": [{}], "additionalItems": False}):
        check_schema(good)
    # draft 4's meta-schema names itself with "id", not "$id": it takes the fast path too (it fell back to
    # jsonschema's ~20 ms check on OpenAPI-sized schemas), and its own rules still hold
    draft4 = "http://json-schema.org/draft-04/schema#"
    good4 = {"$schema": draft4, "properties": {"a": {"type": "integer", "minimum": 0, "exclusiveMinimum": True}}}
    check_schema(good4)
    try:
        import jsonschema_rs  # noqa: F401
    except ImportError:
        pass
    else:
        from leapdecode.structured.spec import _fast_check
        from jsonschema import Draft4Validator
        assert _fast_check(good4, Draft4Validator)
    with pytest.raises(ValueError, match="at properties/a/exclusiveMinimum"):
        check_schema({"$schema": draft4, "properties": {"a": {"exclusiveMinimum": 3}}})
    for bad, message in (({"type": "strnig"}, "at type"), ({"minLength": -1}, "at minLength"),
                         ({"pattern": "(unclosed"}, "is not a 'regex'"),
                         ({"patternProperties": {"(": {}}}, "is not a 'regex'")):
        with pytest.raises(ValueError, match=re.escape(message)):
            check_schema(bad)


@pytest.mark.parametrize(
    "structured, message",
    [
        ("json", "must be a dict"),
        ({"type": "xml"}, "structured['type']"),
        ({"type": "json_schema"}, "['json_schema'] must be an object"),
        ({"type": "json_schema", "json_schema": {"schema": {}}}, "['name'] is required"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "['schema'] is required"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}, "invalid JSON schema at type"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"minLength": -1}}}, "invalid JSON schema at minLength"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}, "['strict'] must be a boolean"),
        ({"type": "choice", "choice": []}, "non-empty list"),
        ({"type": "choice", "choice": ["a", 3]}, "structured['choice'][1]"),
        ({"type": "regex", "regex": "a(b"}, "regex spec: not supported by llguidance"),
        ({"type": "regex", "regex": ""}, "non-empty string"),
        ({"type": "json_object", "schema": {}}, "does not take the field"),
    ],
)
def test_bad_specs_are_value_errors(backend: GrammarBackend, structured: Any, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        backend.compile(structured)


@pytest.mark.parametrize(
    "structured, message",
    [
        (_schema_spec({"$ref": "http://example.com/s.json"}), "not supported by llguidance"),
        (_schema_spec({"type": "string", "pattern": "^(ab$"}), "is not a 'regex'"),
        (_schema_spec(False), "no instance is valid"),
        (_schema_spec({"enum": []}), "Unsatisfiable"),
        ({"type": "grammar", "grammar": "start: undefined_rule"}, "grammar spec: not supported"),
    ],
)
def test_unsupported_specs_are_value_errors(backend: GrammarBackend, structured: Any, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        backend.compile(structured)


def test_compile_time_limit(tokenizer: Any) -> None:
    slow = GrammarBackend(tokenizer, compile_timeout_s=1e-4)
    big = {"type": "object", "properties": {f"field_{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1},40}}[0-9]+$"} for i in range(300)}}
    with pytest.raises(ValueError, match="exceeded the time limit"):
        slow.compile(_schema_spec(big))
    slow.shutdown()


# ----------------------------------------------------------------------------------------------- bitmasks
def test_apply_token_bitmask_matches_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab, rows = 77, 5
    allowed = torch.rand(rows, vocab, generator=gen) < 0.3
    bitmask = allocate_token_bitmask(rows, vocab)
    bitmask.zero_()
    for r in range(rows):
        for t in torch.nonzero(allowed[r]).flatten().tolist():
            bitmask[r, t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32) if t % 32 != 31 else torch.tensor(-(1 << 31), dtype=torch.int32)
    assert torch.equal(bitmask_to_bool(bitmask, vocab), allowed)
    logits = torch.randn(rows, vocab, generator=gen)
    reference = torch.where(allowed, logits, torch.tensor(float("-inf")))
    assert torch.equal(apply_token_bitmask(logits.clone(), bitmask), reference)
    # Only some rows constrained (mixed batch), and a model vocab padded beyond the tokenizer's.
    padded = torch.randn(rows + 2, vocab + 5, generator=gen)
    out = apply_token_bitmask(padded.clone(), bitmask, rows=[1, 2, 3, 4, 6])
    assert torch.equal(out[[0, 5]], padded[[0, 5]])
    assert torch.equal(out[[1, 2, 3, 4, 6], :vocab], torch.where(allowed, padded[[1, 2, 3, 4, 6], :vocab], torch.tensor(float("-inf"))))
    assert torch.isinf(out[[1, 2, 3, 4, 6], vocab:]).all()
    if torch.cuda.is_available():
        assert torch.equal(apply_token_bitmask(logits.cuda(), bitmask).cpu(), reference)


# --------------------------------------------------------------------------------------- speculation API
def test_validate_rollback_and_draft_masks(backend: GrammarBackend, tokenizer: Any) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    compiled = backend.compile(_schema_spec(schema))
    matcher = backend.matcher(compiled)
    good = _encode(tokenizer, '{"n":12}')
    bad = _encode(tokenizer, '{"n":"x"}')
    assert matcher.validate(good) == len(good) and matcher.num_tokens == 0  # validate leaves the state alone
    cut = matcher.validate(bad)
    assert 0 < cut < len(bad) and '{"n":'.startswith(tokenizer.decode(bad[:cut]))

    # One row per draft position + the bonus; rows equal what a step-by-step walk produces.
    bitmask = allocate_token_bitmask(len(good) + 1, backend.vocab_size)
    n = fill_bitmasks([(matcher, 0, good)], bitmask)[0]
    assert n == len(good) and matcher.num_tokens == 0
    step = allocate_token_bitmask(1, backend.vocab_size)
    for i, token in enumerate(good):
        matcher.fill_bitmask(step, 0)
        assert torch.equal(step[0], bitmask[i])
        assert matcher.accept(token)
    matcher.fill_bitmask(step, 0)
    assert torch.equal(step[0], bitmask[len(good)])
    assert matcher.is_accepting()

    # Accept speculatively, roll back the rejected tail, continue differently.
    matcher.rollback(3)
    assert matcher.num_tokens == len(good) - 3 and not matcher.is_accepting()
    assert matcher.accept_tokens(good[-3:]) == 3
    assert matcher.accept(tokenizer.eos_token_id) and matcher.is_terminated()
    matcher.rollback(1)
    assert not matcher.is_terminated() and matcher.is_accepting()
    assert not matcher.accept(good[0])  # nothing may follow the closed object


def test_forced_tokens_fixed_keys(backend: GrammarBackend, tokenizer: Any) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"], "additionalProperties": False}
    # Forced tokens come from the fixed output form (compact, schema key order); by default nothing is fixed.
    assert backend.matcher(backend.compile(_schema_spec(schema))).forced_tokens() == []
    fixed = {**_schema_spec(schema), "whitespace": "compact", "key_order": "schema"}
    matcher = backend.matcher(backend.compile(fixed))
    # llguidance forces bytes up to where the tokenization could still differ (e.g. `":` vs `":"`).
    forced = matcher.forced_tokens()
    assert '{"name":"'.startswith(tokenizer.decode(forced)) and len(tokenizer.decode(forced)) >= len('{"name')
    assert matcher.accept_tokens(forced) == len(forced)
    rest = '{"name":"'[len(tokenizer.decode(forced)) :] + "Bo"
    assert matcher.accept_tokens(_encode(tokenizer, rest)) == len(_encode(tokenizer, rest))
    assert matcher.forced_tokens() == []  # inside a free string nothing is forced
    assert matcher.accept_tokens(_encode(tokenizer, '"')) == 1
    forced = tokenizer.decode(matcher.forced_tokens())
    assert ',"age":'.startswith(forced) and len(forced) >= len(',"age')


# ------------------------------------------------------------------------------------- validator guard
def test_guard_nested_unique_items_and_not(backend: GrammarBackend, tokenizer: Any) -> None:
    schema = {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
            "word": {"type": "string", "not": {"const": "no"}},
        },
        "required": ["tags", "word"],
        "additionalProperties": False,
    }
    compiled = backend.compile(_schema_spec(schema))
    assert set(compiled.dropped) == {"uniqueItems", "not"}
    assert _produce(backend, compiled, tokenizer, '{"tags":[1,2],"word":"yes"}')
    assert not _produce(backend, compiled, tokenizer, '{"tags":[1,1],"word":"yes"}')
    assert not _produce(backend, compiled, tokenizer, '{"tags":[1,2],"word":"no"}')
    # The duplicate is refused where it happens (the comma after the second 1), not only at the end.
    matcher = backend.matcher(compiled)
    prefix = _encode(tokenizer, '{"tags":[1,1')
    assert matcher.accept_tokens(prefix) == len(prefix)
    comma, close = _encode(tokenizer, ",")[0], _encode(tokenizer, "]")[0]
    assert not matcher.accept(comma) and not matcher.accept(close)
    row = allocate_token_bitmask(1, backend.vocab_size)
    matcher.fill_bitmask(row, 0)
    allowed = bitmask_to_bool(row[0], backend.vocab_size)
    assert not allowed[comma] and not allowed[close] and allowed[_encode(tokenizer, "2")[0]]
    assert matcher.error is None


def test_guard_dead_end_is_reported(backend: GrammarBackend, tokenizer: Any) -> None:
    # The grammar cannot see `not`; the only grammatical continuation of `{"a":` is an invalid instance.
    schema = {"type": "object", "properties": {"a": {"const": 1}}, "required": ["a"], "additionalProperties": False, "not": {"required": ["a"]}}
    compiled = backend.compile({**_schema_spec(schema), "whitespace": "compact"})  # else whitespace may come first
    matcher = backend.matcher(compiled)
    assert matcher.accept_tokens(_encode(tokenizer, '{"a":1')) > 0
    row = allocate_token_bitmask(1, backend.vocab_size)
    matcher.fill_bitmask(row, 0)
    allowed = torch.nonzero(bitmask_to_bool(row[0], backend.vocab_size)).flatten().tolist()
    assert allowed == [tokenizer.eos_token_id] and matcher.error is not None
    assert not matcher.accept(tokenizer.eos_token_id)  # the invalid document can still never be completed
    # A root number the grammar lets only end (0..9), refused by the document check alone (rule A): the row's one
    # grammatical token is EOS and the guard clears nothing else; still a dead end, still reported.
    compiled = backend.compile(_schema_spec({"type": "integer", "minimum": 0, "maximum": 9, "not": {"const": 5}}))
    matcher = backend.matcher(compiled)
    assert matcher.accept_tokens(_encode(tokenizer, "5")) == 1
    matcher.fill_bitmask(row, 0)
    allowed = torch.nonzero(bitmask_to_bool(row[0], backend.vocab_size)).flatten().tolist()
    assert allowed == [tokenizer.eos_token_id] and matcher.error is not None


# ----------------------------------------------------------------------------------------------- ASAp
def test_asap_converges_to_grammar_conditioned_distribution(backend: GrammarBackend, tokenizer: Any) -> None:
    """Strings over {a,b,c} of length 1..3 containing an 'a'; a fixed 'model' over the tokens a, b, c, EOS."""
    letters = {ch: _encode(tokenizer, ch)[0] for ch in "abc"}
    assert len(set(letters.values())) == 3
    eos = tokenizer.eos_token_id
    compiled = backend.compile({"type": "regex", "regex": "a[abc]{0,2}|[bc]a[abc]?|[bc][bc]a"})
    vocab = backend.vocab_size

    import functools

    @functools.lru_cache(maxsize=None)
    def model(prefix: str) -> torch.Tensor:  # a known next-token distribution that ignores the grammar
        probs = torch.zeros(vocab, dtype=torch.float64)
        weights = {"a": 0.15, "b": 0.45, "c": 0.2, None: 0.2} if len(prefix) < 3 else {"a": 0.3, "b": 0.3, "c": 0.1, None: 0.3}
        for ch, w in weights.items():
            probs[eos if ch is None else letters[ch]] = w
        return probs

    def prob(s: str) -> float:  # model probability of emitting s then EOS
        p = 1.0
        for i, ch in enumerate(s + "$"):
            dist = model(s[:i])
            p *= float(dist[eos if ch == "$" else letters[ch]])
        return p

    import itertools
    import re as _re

    language = ["".join(w) for n in (1, 2, 3) for w in itertools.product("abc", repeat=n) if "a" in w]
    assert all(_re.fullmatch("a[abc]{0,2}|[bc]a[abc]?|[bc][bc]a", w) for w in language)
    z = sum(prob(w) for w in language)
    exact = {w: prob(w) / z for w in language}

    masks: dict[tuple[int, ...], torch.Tensor] = {}  # the grammar mask only depends on the prefix: memoize

    matcher = backend.matcher(compiled)
    row = allocate_token_bitmask(1, vocab)

    def mask(prefix: tuple[int, ...]) -> torch.Tensor:  # from the real matcher; memoized per prefix
        if prefix not in masks:
            matcher.reset()
            assert matcher.accept_tokens(list(prefix)) == len(prefix)
            matcher.fill_bitmask(row, 0)
            masks[prefix] = bitmask_to_bool(row[0], vocab)
        return masks[prefix]

    def sample_many(n: int, trie: AsapTrie | None, seed: int) -> Counter:
        rng = random.Random(seed)
        counts: Counter = Counter()
        back = {v: k for k, v in letters.items()}
        for _ in range(n):
            tokens: list[int] = []
            while not tokens or tokens[-1] != eos:
                allowed = mask(tuple(tokens))
                probs = model("".join(back[t] for t in tokens))
                if trie is None:  # plain constrained sampling: mask and renormalize
                    q = torch.where(allowed, probs, torch.zeros((), dtype=probs.dtype))
                    q = q / q.sum()
                else:
                    q = trie.reweight(tokens, probs, allowed)
                support = torch.nonzero(q).flatten().tolist()
                tokens.append(rng.choices(support, weights=q[support].tolist())[0])
            if trie is not None:
                trie.update(tokens)
            counts["".join(back[t] for t in tokens[:-1])] += 1
        return counts

    def tv(counts: Counter) -> float:
        total = sum(counts.values())
        return 0.5 * sum(abs(counts.get(w, 0) / total - p) for w, p in exact.items())

    n = 1500
    trie = AsapTrie()
    tv_asap = tv(sample_many(n, trie, seed=1))
    tv_plain = tv(sample_many(n, None, seed=1))
    print(f"\nASAp TV {tv_asap:.3f} vs plain constrained sampling TV {tv_plain:.3f} after {n} samples")
    assert trie.num_samples == n and trie.efg([]) < 1.0  # it learned that some mass is ungrammatical
    assert tv_asap < 0.08
    assert tv_plain > 0.15 and tv_asap < tv_plain / 2


def test_batched_fill_matches_sequential(backend: GrammarBackend, tokenizer: Any) -> None:
    """fill_bitmasks over several requests (native parallel path for unguarded ones, Python for guarded ones)
    writes the same rows as filling each position one by one."""
    plain = backend.compile(_schema_spec({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}))
    guarded = backend.compile(_schema_spec({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}))
    regex = backend.compile({"type": "regex", "regex": "[ab]+c"})
    requests = [
        (backend.matcher(plain), _encode(tokenizer, '{"n":'), _encode(tokenizer, "12}")),
        (backend.matcher(guarded), _encode(tokenizer, "[1,"), _encode(tokenizer, "2,1]")),  # the second 1 is cut
        (backend.matcher(regex), _encode(tokenizer, "ab"), []),
    ]
    jobs, row = [], 0
    for matcher, prefix, drafts in requests:
        assert matcher.accept_tokens(prefix) == len(prefix)
        jobs.append((matcher, row, drafts))
        row += len(drafts) + 1
    bitmask = allocate_token_bitmask(row, backend.vocab_size)
    counts = fill_bitmasks(jobs, bitmask)
    assert counts == [len(requests[0][2]), requests[1][0].validate(requests[1][2]), 0]
    assert counts[1] < len(requests[1][2])
    expected = allocate_token_bitmask(row, backend.vocab_size)
    for (matcher, start, drafts), n in zip(jobs, counts):
        for i in range(n + 1):
            matcher.fill_bitmask(expected, start + i)
            if i < n:
                assert matcher.accept(drafts[i])
        matcher.rollback(n)
    used = [r for (_, start, _), n in zip(jobs, counts) for r in range(start, start + n + 1)]
    assert torch.equal(bitmask[used], expected[used])


def test_xgrammar_adapter(tokenizer: Any) -> None:
    """The second library behind the same adapter (optional dependency): same API, same guarantees."""
    pytest.importorskip("xgrammar")
    xgr = GrammarBackend(tokenizer, library="xgrammar")
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}, "required": ["tags"]}
    compiled = xgr.compile(_schema_spec(schema))
    assert _produce(xgr, compiled, tokenizer, '{"tags":[1,2]}')
    assert not _produce(xgr, compiled, tokenizer, '{"tags":[1,1]}')  # xgrammar ignores uniqueItems; the guard does not
    assert not _produce(xgr, compiled, tokenizer, '{"tags":["a"]}')
    assert _produce(xgr, xgr.compile({"type": "regex", "regex": "ab+"}), tokenizer, "abbb")
    matcher = xgr.matcher(compiled)
    tokens = _encode(tokenizer, '{"tags":[3]}')
    assert matcher.validate(tokens) == len(tokens) and matcher.accept_tokens(tokens) == len(tokens)
    matcher.rollback(2)
    assert matcher.accept_tokens(tokens[-2:]) == 2 and matcher.accept(tokenizer.eos_token_id)
    xgr.shutdown()


# ----------------------------------------------------------------------------------- regressions (issue 14)
def _recursive_schema(props: str, one_of_inside: bool = False) -> dict[str, Any]:
    """Issue 14, defect 1: a self-referencing $defs entry plus a oneOf made anchor discovery exponential."""
    t: dict[str, Any] = {"type": "object", "properties": {p: {"$ref": "#/$defs/t"} for p in props}}
    if one_of_inside:
        t["oneOf"] = [{"required": ["a"]}, {"required": ["b"]}, {"maxProperties": 0}]
    return {"$defs": {"t": t}, "$ref": "#/$defs/t", "oneOf": [{"type": "object"}, {"required": ["zz"]}]}


def test_hostile_recursive_schema_compiles_fast_and_blocks_nothing(tokenizer: Any) -> None:
    import time as _time

    backend = GrammarBackend(tokenizer, compile_timeout_s=5.0, compile_workers=4)
    for i, schema in enumerate([_recursive_schema("abc"), _recursive_schema("abcdef"), _recursive_schema("abc", True)]):
        start = _time.perf_counter()
        try:
            compiled = backend.compile(_schema_spec(schema))
        except ValueError as e:
            pytest.fail(f"hostile schema {i} refused: {e}")
        assert _time.perf_counter() - start < 5.0
        assert _produce(backend, compiled, tokenizer, '{"a":{"b":{}},"c":{}}')
    assert _produce(backend, compiled, tokenizer, '{"a":{"a":{}}}')  # oneOf inside: a, b or nothing, not a and b
    assert not _produce(backend, compiled, tokenizer, '{"a":{"a":{}},"b":{}}')
    assert not _produce(backend, compiled, tokenizer, '{"c":{"a":{},"b":{}}}')
    for i in range(3):  # later compiles still work, several times
        compiled = backend.compile(_schema_spec({"type": "integer", "minimum": i}))
        assert _produce(backend, compiled, tokenizer, str(i + 5)) and not _produce(backend, compiled, tokenizer, "-1")
    backend.shutdown()


def test_compile_workers_are_kept_then_leave_when_idle() -> None:
    """Compilations run on kept threads (never more than the pool's size at once), which exit after their idle
    time; a call submitted after that starts a thread again."""
    import threading
    import time as _time

    from leapdecode.structured.backend import Workers

    workers = Workers(2, name="test-workers", idle_s=0.2)
    seen: list[str] = []
    done = threading.Event()
    for i in range(5):
        workers.submit(lambda i=i: (seen.append(threading.current_thread().name), i == 4 and done.set()))
    assert done.wait(5) and len(seen) == 5 and workers.threads <= 2

    def alive() -> bool:
        return any(t.name == "test-workers" for t in threading.enumerate())

    deadline = _time.monotonic() + 5
    while (workers.threads or alive()) and _time.monotonic() < deadline:
        _time.sleep(0.05)
    assert workers.threads == 0 and not alive()
    again = threading.Event()
    workers.submit(again.set)
    assert again.wait(5) and workers.threads == 1
    # a forked child inherits the count but none of the threads: it starts its own
    import multiprocessing

    def child(out: Any) -> None:
        ran = threading.Event()
        workers.submit(ran.set)
        out.put(ran.wait(5))

    busy = threading.Event()
    workers.submit(busy.wait, 10)       # the parent's thread is busy, its count at 1 of 2
    workers.submit(busy.wait, 10)       # ... 2 of 2: a child that trusted the count would start none
    out = multiprocessing.get_context("fork").Queue()
    process = multiprocessing.get_context("fork").Process(target=child, args=(out,))
    process.start()
    try:
        assert out.get(timeout=20) is True
    finally:
        busy.set()
        process.join(10)


def test_internal_errors_are_reported_as_ours_and_not_cached(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception of our own passes (here the guard's set-up) is a ValueError that says it is an internal error,
    not the library's refusal nor the schema's fault, and is not cached: once the bug is gone the same schema
    compiles."""
    import leapdecode.structured.backend as backend_module

    class Broken:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise TypeError("a bug")

    backend = GrammarBackend(tokenizer)
    spec = _schema_spec({"type": "object", "properties": {"a": {"type": "integer"}}})
    with monkeypatch.context() as patch:
        patch.setattr(backend_module, "SchemaGuard", Broken)
        with pytest.raises(ValueError, match="internal error .*TypeError"):
            backend.compile(spec)
    assert _produce(backend, backend.compile(spec), tokenizer, '{"a":1}')
    backend.shutdown()


def test_compile_deadline_is_cooperative_and_frees_the_worker(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compile whose own Python pass runs long (here: the anchor walk with its visit bound lifted, on a diamond
    of 40 levels, 2**40 instance paths) stops at the deadline with a ValueError, is not cached, frees its worker
    for the next compilation, and a full pool refuses new work at once instead of queueing it."""
    import threading
    import time as _time

    import leapdecode.structured.guard as guard_module

    monkeypatch.setattr(guard_module, "MAX_ANCHOR_VISITS", 10**12)
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}, "y": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(40)}
    defs["d40"] = {"type": "array", "uniqueItems": True}
    diamond = {"$defs": defs, "$ref": "#/$defs/d0"}
    backend = GrammarBackend(tokenizer, compile_timeout_s=1.0, compile_workers=1)
    start = _time.perf_counter()
    with pytest.raises(ValueError, match="exceeded the time limit of 1 s"):
        backend.compile(_schema_spec(diamond))
    assert _time.perf_counter() - start < 3.0
    deadline = _time.monotonic() + 3.0      # the worker stops at its own deadline and takes new work
    while True:
        try:
            compiled = backend.compile(_schema_spec({"type": "integer"}))
            break
        except ValueError as e:
            assert "already running" in str(e) and _time.monotonic() < deadline, e
            _time.sleep(0.05)
    assert _produce(backend, compiled, tokenizer, "12")
    # A timeout is never cached: the same schema is compiled afresh (and times out again) ...
    future = backend.compile_async(_schema_spec(diamond))
    # ... and while it holds the only slot, another miss is refused at once with a clear error.
    with pytest.raises(ValueError, match="already running"):
        backend.compile(_schema_spec({"type": "integer", "minimum": 3}))
    with pytest.raises(ValueError, match="exceeded the time limit"):
        future.result(timeout=5)
    assert _produce(backend, backend.compile(_schema_spec({"type": "integer", "minimum": 3})), tokenizer, "4")
    backend.shutdown()


def test_min_properties_beside_optional_properties_can_close(backend: GrammarBackend, tokenizer: Any) -> None:
    """Issue 14, defect 2: llguidance's lenient minProperties counted only additional properties."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}}, "minProperties": 1}
    compiled = backend.compile(_schema_spec(schema))
    for text in ('{"a":1}', '{"b":true}', '{"a":1,"b":true}', '{"x":2}'):
        assert _produce(backend, compiled, tokenizer, text), text
    assert not _produce(backend, compiled, tokenizer, "{}")
    capped = {"type": "object", "properties": {"a": {"type": "integer"}}, "maxProperties": 1}
    compiled = backend.compile(_schema_spec(capped))
    assert _produce(backend, compiled, tokenizer, '{"a":1}') and _produce(backend, compiled, tokenizer, '{"q":1}')
    assert not _produce(backend, compiled, tokenizer, '{"a":1,"q":2}')


def test_library_resource_limit_is_a_clear_error_and_not_cached(tokenizer: Any) -> None:
    """Issue 14, defect 3: a grammar the library cannot run (its lexer limit) gave an all-zero mask, no error,
    and a cached grammar that failed every later request. Now: a ValueError at compile time carrying llguidance's
    message, every time; other schemas are unaffected. (A tiny lexer-fuel limit reproduces with our small test
    tokenizer what the default limit does with Llama-3's vocabulary.)"""
    import llguidance

    backend = GrammarBackend(tokenizer, llg_limits=llguidance.LLParserLimits(step_lexer_fuel=10))
    hostile = _schema_spec({"type": "string", "pattern": "^(?:\\S+\\s+){0,99}\\S+$", "maxLength": 5000})
    for _ in range(2):
        with pytest.raises(ValueError, match="too many expressions constructed"):
            backend.compile(hostile)
    assert _produce(backend, backend.compile(_schema_spec({"type": "integer"})), tokenizer, "7")


def test_library_error_while_decoding_carries_its_message(backend: GrammarBackend, tokenizer: Any) -> None:
    """If the library stops with an error mid-output, the row allows only EOS, accept(EOS) refuses, and the
    engine finishes the request with "abort" and the library's message as the stop reason."""
    from leapdecode.engine.stop import StopChecker

    matcher = backend.matcher(backend.compile(_schema_spec({"type": "string"})))
    assert matcher.accept_tokens(_encode(tokenizer, '"ab')) > 0
    matcher._state.error = lambda: "lexer error: too many expressions constructed"  # type: ignore[method-assign]
    row = allocate_token_bitmask(1, backend.vocab_size)
    matcher.fill_bitmask(row, 0)
    assert torch.nonzero(bitmask_to_bool(row[0], backend.vocab_size)).flatten().tolist() == [tokenizer.eos_token_id]
    assert matcher.error == "llguidance: lexer error: too many expressions constructed"
    assert not matcher.accept(tokenizer.eos_token_id)

    class _Seq:
        class params:
            stop_token_ids: list[int] = []
            ignore_eos = False
            max_tokens = 10

    checker = StopChecker({0}, 100, grammar=lambda seq, token: f"abort: {matcher.error}")
    assert checker.check(_Seq(), 5) == ("abort", "llguidance: lexer error: too many expressions constructed")


def test_json_text_orders_nested_objects_by_their_own_schema() -> None:
    """Issue 14, defect 4: keys were ranked by first appearance anywhere in the schema."""
    schema = {
        "type": "object",
        "properties": {
            "b": {"type": "object", "properties": {"a": {}, "b": {}}},
            "a": {"$ref": "#/$defs/inner"},
            "list": {"type": "array", "items": {"properties": {"z": {}, "b": {}}}},
        },
        "$defs": {"inner": {"allOf": [{"properties": {"y": {}}}, {"properties": {"b": {}}}]}},
    }
    instance = {"list": [{"b": 1, "z": 2}], "a": {"b": 1, "y": 2}, "b": {"b": 1, "a": 2}}
    assert json_text(instance, schema) == '{"b":{"a":2,"b":1},"a":{"y":2,"b":1},"list":[{"z":2,"b":1}]}'
    assert json_text({"k": [1]}, {}, indent=2) == '{\n  "k": [\n    1\n  ]\n}'


def _check_row_against_brute_force(backend: GrammarBackend, tokenizer: Any, matcher: Any, context: str) -> int:
    """Assert the matcher's mask row is exactly what the grammar allows minus what `accept` refuses; returns the
    number of tokens compared."""
    row, raw = allocate_token_bitmask(1, backend.vocab_size), allocate_token_bitmask(1, backend.vocab_size)
    matcher.fill_bitmask(row, 0)
    allowed = bitmask_to_bool(row[0], backend.vocab_size)
    matcher._state.fill(raw, 0)
    grammar = bitmask_to_bool(raw[0], backend.vocab_size)
    checked = 0
    for t in torch.nonzero(grammar).flatten().tolist():
        if t == tokenizer.eos_token_id:
            continue
        ok = matcher.accept(t)
        if ok:
            matcher.rollback(1)
        assert bool(allowed[t]) == ok, (context, matcher.text, tokenizer.decode([t]))
        checked += 1
    return checked


def test_guard_checks_every_candidate(backend: GrammarBackend, tokenizer: Any) -> None:
    """Issue 14: the guard checked at most 64 candidate tokens per row and masked the rest (canonical tokens such
    as `"},` among them). Now a guarded row is exactly: what the grammar allows, minus what the guard refuses."""
    schema = {"type": "object", "properties": {"w": {"type": "string", "not": {"const": "no"}}, "n": {"type": "integer"}},
              "required": ["w"], "additionalProperties": False}
    compiled = backend.compile(_schema_spec(schema))
    for prefix in ('{"w":"ab', '{"w":"n', '{"n":1', '{"n":1,"w":"x"'):
        matcher = backend.matcher(compiled)
        assert matcher.accept_tokens(_encode(tokenizer, prefix)) == len(_encode(tokenizer, prefix))
        _check_row_against_brute_force(backend, tokenizer, matcher, prefix)


def test_free_key_order_in_unions_of_objects(backend: GrammarBackend, tokenizer: Any) -> None:
    """A pydantic-style discriminated union (anyOf of object branches) at a fixed path takes its keys in any order;
    which branch applies is only known at the close, where the whole union is validated."""
    cat = {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}},
           "required": ["kind", "lives"], "additionalProperties": False}
    dog = {"type": "object", "properties": {"kind": {"const": "dog"}, "good": {"type": "boolean"}},
           "required": ["kind"], "additionalProperties": False}
    schema = {"type": "object", "properties": {"pet": {"anyOf": [{"$ref": "#/$defs/cat"}, {"$ref": "#/$defs/dog"}]},
                                               "n": {"type": "integer"}},
              "required": ["pet"], "$defs": {"cat": cat, "dog": dog}}
    compiled = backend.compile(_schema_spec(schema))
    for text in ('{"pet":{"lives":9,"kind":"cat"}}', '{"n":1,"pet":{"good":true,"kind":"dog"}}', '{"pet":{"kind":"dog"}}'):
        assert _produce(backend, compiled, tokenizer, text), text
    for text in ('{"pet":{"kind":"cat"}}', '{"pet":{"lives":9,"kind":"dog"}}', '{"pet":{"kind":"dog","kind":"dog"}}', '{"n":1}'):
        assert not _produce(backend, compiled, tokenizer, text), text


def test_free_key_order_in_map_values(backend: GrammarBackend, tokenizer: Any) -> None:
    """Objects that are a map's values (`additionalProperties`, `patternProperties`: the services of a compose
    file, the jobs of a workflow) take their keys in any order, with repeats and missing required keys refused by
    the guard at the keys that lead there. They kept the schema's order before (a valid document in another
    order was refused)."""
    for index, good, bad in (
            (4, ['{"k":{"z":"a","x":1}}', '{"name":"n","k":{"w":true,"x":1,"z":"a"}}'],
             ['{"k":{"x":1}}', '{"k":{"z":"a","x":1,"x":2}}', '{"k":{"z":"a","x":1,"v":2}}', '{"name":{"x":1,"z":"a"}}']),
            (5, ['{"s_1":{"b":"x","a":1}}', '{"n_1":2,"s_":{"c":null,"a":0}}'],
             ['{"s_1":{"b":"x"}}', '{"s_1":{"a":1,"a":1}}', '{"n_1":{"a":1}}', '{"t":{"a":1}}'])):
        compiled = backend.compile(_schema_spec(_GUARDED_SCHEMAS[index]))
        assert compiled.guard.objects
        for text in good:
            assert _produce(backend, compiled, tokenizer, text), text
        for text in bad:
            assert not _produce(backend, compiled, tokenizer, text), text


def test_free_key_order_below_a_key_only_one_union_branch_takes(backend: GrammarBackend, tokenizer: Any) -> None:
    """In a union tagged by key (each branch a closed object with its own property), the object below a branch's
    key is that branch's: its keys come in any order, checked as at a fixed path. Where another branch would take
    the key too (an open object), it is not (a document valid through that branch stays accepted)."""
    compiled = backend.compile(_schema_spec(_GUARDED_SCHEMAS[6]))
    assert compiled.guard.objects
    for text in ('{"svc":{"git":{"token":"t","url":"u"}}}', '{"svc":{"pager":{"on":false,"level":2,"key":"k"}}}'):
        assert _produce(backend, compiled, tokenizer, text), text
    for text in ('{"svc":{"git":{"token":"t"}}}', '{"svc":{"pager":{"team":"a"}}}',
                 '{"svc":{"git":{"url":"u","token":"t","url":"v"}}}', '{"svc":{"git":{"url":"u","token":"t"},"pager":{"key":"k"}}}'):
        assert not _produce(backend, compiled, tokenizer, text), text
    schema = copy.deepcopy(_GUARDED_SCHEMAS[6])
    schema["properties"]["svc"]["oneOf"].append({"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]})
    compiled = backend.compile(_schema_spec(schema))
    assert _produce(backend, compiled, tokenizer, '{"svc":{"x":1,"git":{"token":"t"}}}')     # the open branch's
    assert not _produce(backend, compiled, tokenizer, '{"svc":{"git":{"token":"t"}}}')


def test_dependent_required_in_free_order_objects(backend: GrammarBackend, tokenizer: Any) -> None:
    """Keys that require other keys (`dependentRequired`, draft 7's `dependencies` of names: CloudFormation's
    certificate settings) no longer keep an object in the schema's order: the object rule closes it only with
    the keys its keys require."""
    compiled = backend.compile(_schema_spec(_GUARDED_SCHEMAS[7]))
    assert {o.pattern for o in compiled.guard.objects} == {(), ("cert",), ("opts",)}
    for text in ('{"cert":{"method":"vip","arn":"x"}}', '{"cert":{"version":"v1","iam":"i","method":"vip"}}',
                 '{"cert":{"default":true}}', '{"opts":{"b":1,"a":2}}', '{"opts":{"d":1,"c":2}}'):
        assert _produce(backend, compiled, tokenizer, text), text
    for text in ('{"cert":{"arn":"x"}}', '{"cert":{"iam":"x","version":"v1"}}', '{"opts":{"a":2}}', '{"opts":{"c":1,"a":2}}'):
        assert not _produce(backend, compiled, tokenizer, text), text
    # in a map's values no jsonschema anchor looks at the object: the object rule alone refuses its close (rule A
    # would refuse only the end of the document: a dead end)
    schema = {"type": "object", "additionalProperties": _GUARDED_SCHEMAS[7]["properties"]["cert"]}
    compiled = backend.compile(_schema_spec(schema))
    for prefix, ok in (('{"x":{"arn":"a"', False), ('{"x":{"arn":"a","method":"vip"', True)):
        matcher = backend.matcher(compiled)
        assert matcher.accept_tokens(_encode(tokenizer, prefix)) == len(_encode(tokenizer, prefix))
        assert matcher.accept(_encode(tokenizer, "}")[0]) == ok, prefix
    # `dependencies` is draft 7's (2020-12 ignores it, as jsonschema does); `dependentRequired` is not draft 7's
    opts = _GUARDED_SCHEMAS[7]["properties"]["opts"]
    for draft, keyword, enforced in (("http://json-schema.org/draft-07/schema#", "dependencies", True),
                                     ("https://json-schema.org/draft/2020-12/schema", "dependencies", False),
                                     ("http://json-schema.org/draft-07/schema#", "dependentRequired", False)):
        schema = {"$schema": draft, "type": "object", "properties": {"opts": {
            **{k: v for k, v in opts.items() if k != "dependentRequired"}, keyword: {"a": ["b"]}}}}
        compiled = backend.compile(_schema_spec(schema))
        assert _produce(backend, compiled, tokenizer, '{"opts":{"c":1,"a":2,"b":3}}')
        assert _produce(backend, compiled, tokenizer, '{"opts":{"c":1,"a":2}}') == (not enforced), (draft, keyword)


def test_free_key_order_in_versioned_documents(backend: GrammarBackend, tokenizer: Any) -> None:
    """CMake's presets and Ray's cluster config, in small: the union's own `required` no longer makes its keys
    come first (llguidance writes them before the branch's: the guard checks them with the union), the object
    every branch takes below one key (one definition) is at a fixed path, and a closed object whose conditionals
    sit in an allOf takes its keys in any order (the conditionals are the guard's). Each refused a valid document
    in another order before."""
    compiled = backend.compile(_schema_spec(_GUARDED_SCHEMAS[8]))
    for text in ('{"min":{"major":1},"version":1}', '{"min":{"patch":2,"major":1},"version":2}',
                 '{"auth":{"key":"k","user":"u"},"version":2}', '{"version":2,"auth":{"proxy":"p","use_id":true}}'):
        assert _produce(backend, compiled, tokenizer, text), text
    for text in ('{"min":{"major":1}}', '{"version":1,"min":{"patch":2}}', '{"auth":{"use_id":true},"version":2}',
                 '{"auth":{"user":"u"},"version":1}', '{"version":2,"auth":{"user":"u","user":"v"}}'):
        assert not _produce(backend, compiled, tokenizer, text), text


def test_a_union_of_objects_inside_a_nullable_union_takes_null(backend: GrammarBackend, tokenizer: Any) -> None:
    """A union of objects (its required keys checked by validating the union when its value closes) reached as
    the one object branch of a nullable anyOf (Rust's target spec: `"stack-probes": {"anyOf": [{"$ref":
    "#/$defs/StackProbeType"}, {"type": "null"}]}`): null was refused, validated against the union of objects."""
    probe = {"oneOf": [{"type": "object", "properties": {"kind": {"const": "none"}}, "required": ["kind"]},
                       {"type": "object", "properties": {"kind": {"const": "call"}, "depth": {"type": "integer"}},
                        "required": ["kind", "depth"]}]}
    schema = {"type": "object", "$defs": {"probe": probe},
              "properties": {"p": {"anyOf": [{"$ref": "#/$defs/probe"}, {"type": "null"}]}, "n": {"type": "integer"}}}
    compiled = backend.compile(_schema_spec(schema))
    for text in ('{"p":null,"n":1}', '{"p":{"depth":2,"kind":"call"}}', '{"n":1,"p":{"kind":"none"}}'):
        assert _produce(backend, compiled, tokenizer, text), text
    for text in ('{"p":{"kind":"call"}}', '{"p":1}', '{"p":{"depth":2}}'):
        assert not _produce(backend, compiled, tokenizer, text), text


def test_free_key_order_in_recursive_definitions(backend: GrammarBackend, tokenizer: Any) -> None:
    """Objects that recursion reaches (a tree, JSON Schema's own meta-schema) take their keys in any order: which
    free-order objects apply at a path is found by walking the schema's fixed routes along it (`_PathGraph`), at
    any depth. They kept the schema's order before."""
    compiled = backend.compile(_schema_spec(_GUARDED_SCHEMAS[9]))
    assert compiled.guard._graph is not None
    # a token written at ("kids", 0) may also close an object below it (`[{}]`): the plan looks at such tokens
    assert any(o.pattern == ("kids", 0, "<below>") and o.required for o in compiled.guard._near(("kids", 0))[1])
    deep = '{"name":"a","kids":[{"kids":[{"size":1,"kids":[{"name":"d"}],"name":"c"}],"name":"b"}]}'
    for text in ('{"size":1,"name":"a"}', deep, '{"link":{"size":2,"name":"b"},"name":"a"}',
                 '{"link":[{"name":"b"},{"kids":[],"name":"c"}],"name":"a"}', '{"name":"a","tag":{"x":3,"k":"a"}}'):
        assert _produce(backend, compiled, tokenizer, text), text
    for text in ('{"size":1}', deep.replace('"name":"d"', '"size":2'), '{"name":"a","kids":[{"name":"b","name":"c"}]}',
                 '{"link":[{"kids":[{}],"name":"b"}],"name":"a"}', '{"name":"a","tag":{"k":"a"}}',
                 '{"name":"a","kids":[{"name":"b","color":1}]}'):
        assert not _produce(backend, compiled, tokenizer, text), text


def test_look_around_in_pattern_properties_widens_the_grammar_and_the_guard_checks_keys(
        backend: GrammarBackend, tokenizer: Any) -> None:
    """A patternProperties regex the library cannot take (a look-ahead: AWS tags' `^(?!aws:)...`) was removed, so
    with additionalProperties false no tag could be written. The grammar now takes the regex without its
    look-around (wider), and the guard refuses a key only the wider regex takes as its closing quote is written."""
    compiled = backend.compile(_schema_spec(_GUARDED_SCHEMAS[11]))
    assert any("look-around" in note for note in compiled.dropped)
    for text in ('{"Tags":{"a":"b"}}', '{"Tags":{"k:1":"v","x":"y"},"Name":"n"}'):
        assert _produce(backend, compiled, tokenizer, text), text
    for text in ('{"Tags":{"aws:x":"b"}}', '{"Tags":{"a":1}}', '{"Tags":{"a":"1","b":"2","c":"3","d":"4"}}'):
        assert not _produce(backend, compiled, tokenizer, text), text
    prefix = '{"Tags":{"aws:x'
    matcher = backend.matcher(compiled)
    assert matcher.accept_tokens(_encode(tokenizer, prefix)) == len(_encode(tokenizer, prefix))
    assert not matcher.accept(_encode(tokenizer, '"')[0])       # refused at the key's closing quote


def test_keywords_beside_a_ref_that_change_nothing_do_not_fix_key_order(backend: GrammarBackend, tokenizer: Any) -> None:
    """CloudFormation writes `{"$ref": "#/definitions/X", "type": "object"}`, and `{"$ref": "#/definitions/Tag",
    "maxItems": 20}` as array items: keywords the target's own type makes redundant. llguidance intersects a $ref
    with what is beside it, so the closed object they point to kept the schema's order; they are dropped from the
    grammar (`lowering.redundant_beside_ref`) and it takes any order."""
    tag = {"type": "object", "additionalProperties": False, "required": ["Key", "Value"],
           "properties": {"Key": {"type": "string"}, "Value": {"type": "string"}, "Note": {"type": "string"},
                          "Owner": {"type": "string"}}}
    schema = {"type": "object", "definitions": {"Tag": tag},
              "properties": {"Main": {"$ref": "#/definitions/Tag", "type": "object"},
                             "Tags": {"type": "array", "items": {"$ref": "#/definitions/Tag", "maxItems": 20}}}}
    compiled = backend.compile(_schema_spec(schema))
    for text in ('{"Main":{"Value":"v","Key":"k"}}', '{"Tags":[{"Owner":"o","Value":"v","Key":"k"}]}'):
        assert _produce(backend, compiled, tokenizer, text), text
    for text in ('{"Main":{"Value":"v"}}', '{"Tags":[{"Key":"k","Value":"v","Key":"j"}]}', '{"Tags":[{"Key":"k"}]}'):
        assert not _produce(backend, compiled, tokenizer, text), text


def test_property_names_that_are_keywords_stay_properties(backend: GrammarBackend, tokenizer: Any) -> None:
    """A schema describing schemas (JSON Schema's own meta-schema, OpenAPI's Schema Object) has properties named
    `properties`, `minProperties`, `pattern`: the lowering took that `properties` map for a schema and dropped the
    property named `minProperties` from the grammar (as if llguidance could not count it), so it could not be
    written."""
    schema = {"type": "object", "properties": {"properties": {"type": "object"}, "minProperties": {"type": "integer"},
                                               "pattern": {"type": "string"}}}
    for key_order in ("any", "schema"):     # (in any order the map's names become regexes first)
        compiled = backend.compile({**_schema_spec(schema), "key_order": key_order})
        for text in ('{"minProperties":2}', '{"properties":{},"minProperties":1,"pattern":"a"}'):
            assert _produce(backend, compiled, tokenizer, text), (key_order, text)
        assert not _produce(backend, compiled, tokenizer, '{"minProperties":"x"}')


def test_free_key_order_for_a_definition_used_at_many_paths(backend: GrammarBackend, tokenizer: Any) -> None:
    """A definition used at more paths than are listed (`_MAX_PATTERNS_PER_OBJECT`) is found per path like a
    recursive one: any key order, its required keys checked wherever it is used. It kept schema order before."""
    item = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}, "c": {"type": "boolean"},
                                             "d": {"type": "null"}}, "required": ["a", "b"]}
    schema = {"type": "object", "$defs": {"item": item},
              "properties": {f"p{i}": {"$ref": "#/$defs/item"} for i in range(40)}}
    compiled = backend.compile(_schema_spec(schema))
    assert compiled.guard._graph is not None and compiled.guard._graph.sites
    for text in ('{"p0":{"b":"x","a":1}}', '{"p39":{"d":null,"b":"","a":2},"p7":{"a":0,"c":true,"b":"y"}}'):
        assert _produce(backend, compiled, tokenizer, text), text
    for text in ('{"p0":{"b":"x"}}', '{"p39":{"a":1,"b":"x","a":2}}', '{"p3":{"a":1,"b":2}}'):
        assert not _produce(backend, compiled, tokenizer, text), text


def test_a_catch_all_pattern_property_beside_properties_takes_any_key_order(backend: GrammarBackend,
                                                                           tokenizer: Any) -> None:
    """`"patternProperties": {".+": S}` beside `properties` (setuptools' distutils table): S applies to the declared
    names too, and llguidance needs pattern properties disjoint, so the object kept the schema's order. The
    grammar now gives S every other key (a regex for the complement of the names, `lowering.other_names_regex`)
    and both schemas to the names."""
    schema = {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}, "ab": {"type": "string"}},
              "patternProperties": {".+": {"type": ["integer", "string"]}}, "additionalProperties": False}
    compiled = backend.compile(_schema_spec(schema))
    for text in ('{"ab":"x","a":1}', '{"z":"q","a":2}', '{"abc":3,"a":1,"b":"w"}'):
        assert _produce(backend, compiled, tokenizer, text), text
    for text in ('{"ab":"x"}', '{"a":"s"}', '{"z":[],"a":1}', '{"a":1,"a":2}', '{"":1,"a":1}'):
        assert not _produce(backend, compiled, tokenizer, text), text
    import re as _re
    from leapdecode.structured.lowering import other_names_regex
    names = ["a", "ab", "b.c", "x]"]
    for kind, keys in (("", ["", "a", "ab", "abc", "b", "b.c", "bxc", "x", "x]", "x]]", "q\nr"]),
                       ("+$", ["", "a", "abc", "x]", "y", "q\nr"])):
        rx = _re.compile(other_names_regex(names, kind))
        for key in keys:
            want = key not in names and (key or "+" not in kind) and ("\n" not in key or "$" not in kind)
            assert bool(rx.fullmatch(key)) == bool(want), (kind, key)


def test_a_union_with_its_own_required_inside_recursion(backend: GrammarBackend, tokenizer: Any) -> None:
    """A union of objects that recursion reaches, with a `required` of its own beside its branches: its keys may
    come after the branch's (the union's `required` is dropped from the grammar for the unions found per path
    too, and checked when its value closes)."""
    node = {"type": "object", "required": ["kind"],
            "oneOf": [{"type": "object", "properties": {"kind": {"const": "leaf"}, "w": {"type": "integer"}},
                       "additionalProperties": False},
                      {"type": "object", "properties": {"kind": {"const": "pair"}, "l": {"$ref": "#/$defs/n"},
                                                        "r": {"$ref": "#/$defs/n"}}, "additionalProperties": False}]}
    compiled = backend.compile(_schema_spec({"$ref": "#/$defs/n", "$defs": {"n": node}}))
    for text in ('{"w":1,"kind":"leaf"}', '{"r":{"w":2,"kind":"leaf"},"l":{"kind":"leaf"},"kind":"pair"}'):
        assert _produce(backend, compiled, tokenizer, text), text
    for text in ('{"w":1}', '{"kind":"pair","l":{"w":2}}'):
        assert not _produce(backend, compiled, tokenizer, text), text


def test_closed_objects_joined_by_allof_keep_their_order_and_compile(backend: GrammarBackend, tokenizer: Any) -> None:
    """A closed object (additionalProperties false) joined by allOf to another subschema: relaxed, llguidance's
    intersection refused every key, or the schema ("unsatisfiable" beside `{"required": [...]}`). Such an
    object keeps the schema's order (exact in the grammar)."""
    props = {"a": {"type": "string"}, "b": {"type": "integer"}, "c": {"type": "integer"}, "d": {"type": "integer"}}
    for member in ({"required": ["a"]}, {"type": "object"}, {"minProperties": 1}):
        compiled = backend.compile(_schema_spec({"type": "object", "properties": props, "additionalProperties": False,
                                                 "allOf": [member]}))
        assert _produce(backend, compiled, tokenizer, '{"a":"x","c":2}'), member
        assert not _produce(backend, compiled, tokenizer, '{"a":"x","e":2}'), member


def test_unicode_property_escapes(backend: GrammarBackend, tokenizer: Any) -> None:
    """`\\p{...}` (common in real schemas, e.g. CloudFormation tag keys) was refused because Python's `re` cannot
    compile it; the grammar (Rust regex) and the guard (the `regex` module where `re` fails) both handle it."""
    pytest.importorskip("regex")
    schema = {"type": "object", "properties": {"tag": {"type": "string", "pattern": "^[\\p{L}\\p{Z}_.:/=+\\-@]*$"}},
              "patternProperties": {"^\\p{Lu}": {"type": "integer"}}, "additionalProperties": False}
    compiled = backend.compile(_schema_spec(schema))
    assert _produce(backend, compiled, tokenizer, '{"tag":"ab c:d","X":1}')
    assert not _produce(backend, compiled, tokenizer, '{"tag":"ab1"}')
    assert not _produce(backend, compiled, tokenizer, '{"x":1}')
    assert not _produce(backend, compiled, tokenizer, '{"X":"s"}')


def test_pattern_llguidance_cannot_decide_falls_back_to_the_guard(backend: GrammarBackend, tokenizer: Any) -> None:
    """llguidance refuses some pattern + length combinations ("Unable to determine if regex is empty", 4 of 119
    CloudFormation schemas); the pattern then goes to the guard instead of refusing the schema."""
    schema = {"type": "string", "pattern": "^aws\\.partner(/[\\.\\-_A-Za-z0-9]+){2,}$", "minLength": 1, "maxLength": 256}
    try:
        compiled = backend.compile(_schema_spec(schema))
    except ValueError as e:
        pytest.fail(f"refused: {e}")
    assert "pattern" in compiled.dropped
    assert _produce(backend, compiled, tokenizer, '"aws.partner/a/b"')
    assert not _produce(backend, compiled, tokenizer, '"aws.partner/a"')


_CMP = {"type": "object", "properties": {"key": {"type": "string"}, "op": {"enum": ["eq", "ne"]},
                                        "value": {"anyOf": [{"type": "string"}, {"type": "number"}]}},
        "required": ["key", "op", "value"], "additionalProperties": False}
_UNION_WITH_ANY = {"type": "object", "$defs": {"cmp": _CMP},
                   "properties": {"filters": {"type": "array", "items": {"anyOf": [{"$ref": "#/$defs/cmp"}, {}]}},
                                  "pick": {"anyOf": [{"$ref": "#/$defs/cmp"}, {"type": "string", "maxLength": 3},
                                                     {"type": "number"}]},
                                  "kind": {"enum": ["and", "or"]}},
                   "required": ["filters", "kind"], "additionalProperties": False}
_GUARDED_SCHEMAS = [
    # closed free-order object with required keys, nested closed object, array with uniqueItems
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                      "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
                                      "id": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
                                             "required": ["a"], "additionalProperties": False}},
     "required": ["name", "id"], "additionalProperties": False},
    # open object (other keys allowed), a string checked by the guard (look-ahead pattern), a `not`
    {"type": "object", "properties": {"foo": {"type": "string", "pattern": "^(?!no)"}, "bar": {"type": "integer", "not": {"const": 3}},
                                      "w": {"type": "string", "not": {"const": "qq"}},
                                      "baz": {"type": "array", "items": {"type": "object", "properties": {"value": {"type": "integer"}},
                                                                         "required": ["value"]}}},
     "required": ["foo"]},
    # a union of objects at a fixed path, and an array of closed objects
    {"type": "object", "properties": {"items": {"type": "array", "items": {"anyOf": [
        {"type": "object", "properties": {"type": {"const": "a"}, "alpha": {"type": "integer"}}, "required": ["type"], "additionalProperties": False},
        {"type": "object", "properties": {"type": {"const": "b"}, "beta": {"type": "string"}}, "required": ["type", "beta"], "additionalProperties": False}]}},
        "value": {"type": "string", "format": "AWS::IAM::Role.Arn"}}, "required": ["items"], "additionalProperties": False},
    # unions of a free-order object with branches that take every string / number (their scalars need no check)
    _UNION_WITH_ANY,
    # maps: free-order objects as additionalProperties and patternProperties values
    {"type": "object", "properties": {"name": {"type": "string"}},
     "additionalProperties": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"},
                                                               "z": {"type": "string"}, "w": {"type": "boolean"}},
                              "required": ["x", "z"], "additionalProperties": False}},
    {"type": "object", "patternProperties": {"^s_": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
                                                     "required": ["a"]},
                                             "^n_": {"type": "integer"}}, "additionalProperties": False},
    # a union tagged by key: what lies below a key only one branch takes is at a fixed path
    {"type": "object", "properties": {"svc": {"oneOf": [
        {"type": "object", "properties": {"git": {"$ref": "#/$defs/git"}}, "required": ["git"], "additionalProperties": False},
        {"type": "object", "properties": {"pager": {"type": "object", "properties": {
            "key": {"type": "string"}, "team": {"type": "string"}, "level": {"type": "integer"}, "on": {"type": "boolean"}},
            "required": ["key"]}}, "required": ["pager"], "additionalProperties": False}]}},
     "$defs": {"git": {"type": "object", "properties": {"url": {"type": "string"}, "token": {"type": "string"},
                                                        "branch": {"type": "string"}, "depth": {"type": "integer"}},
                       "required": ["url", "token"], "additionalProperties": False}}},
    # keys that require other keys (dependentRequired; draft 7's dependencies of names) in free-order objects
    {"type": "object", "properties": {
        "cert": {"type": "object", "additionalProperties": False, "dependentRequired": {"arn": ["method"], "iam": ["method"]},
                 "properties": {"arn": {"type": "string"}, "default": {"type": "boolean"}, "iam": {"type": "string", "maxLength": 8},
                                "version": {"enum": ["v1", "v2"]}, "method": {"enum": ["sni-only", "vip"]}}},
        "opts": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"},
                                                  "d": {"type": "integer"}}, "dependentRequired": {"a": ["b"]}}}},
    # versions of a document: a union with its own `required`, the branches sharing a definition below one key;
    # a closed object with conditionals in an allOf (Ray's cluster config `auth`)
    {"type": "object", "required": ["version"], "$defs": {
        "min": {"type": "object", "properties": {"major": {"type": "integer"}, "minor": {"type": "integer"},
                                                 "patch": {"type": "integer"}, "tag": {"type": "string"}}, "required": ["major"]},
        "auth": {"type": "object", "additionalProperties": False,
                 "properties": {"user": {"type": "string"}, "key": {"type": "string"}, "proxy": {"type": "string"}, "use_id": {"type": "boolean"}},
                 "allOf": [{"if": {"properties": {"use_id": {"const": True}}, "required": ["use_id"]}, "then": {"required": ["proxy"]}}]}},
     "oneOf": [{"properties": {"version": {"const": 1}, "min": {"$ref": "#/$defs/min"}}, "additionalProperties": False},
               {"properties": {"version": {"const": 2}, "min": {"$ref": "#/$defs/min", "description": "as in 1"},
                               "auth": {"$ref": "#/$defs/auth"}}, "additionalProperties": False}]},
    # recursion: a tree whose nodes need a key, with a union of objects and a list-or-node choice inside it
    {"$ref": "#/$defs/node", "$defs": {
        "node": {"type": "object", "required": ["name"], "additionalProperties": False,
                 "properties": {"name": {"type": "string"}, "size": {"type": "integer"},
                                "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                                "link": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "array", "items": {"$ref": "#/$defs/node"}}]},
                                "tag": {"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}, "x": {"type": "integer"}}, "required": ["k", "x"]},
                                                  {"type": "object", "properties": {"k": {"const": "b"}}, "required": ["k"]}]}}}}},
    # a union of objects recursion reaches, with a required of its own
    {"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "required": ["kind"], "oneOf": [
        {"type": "object", "properties": {"kind": {"const": "leaf"}, "w": {"type": "integer"}}, "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "pair"}, "l": {"$ref": "#/$defs/n"}, "r": {"$ref": "#/$defs/n"}},
         "additionalProperties": False}]}}},
    # pattern properties with a look-ahead (AWS tags), beside additionalProperties false
    {"type": "object", "properties": {"Name": {"type": "string"},
                                      "Tags": {"type": "object", "additionalProperties": False, "maxProperties": 3,
                                               "patternProperties": {"^(?!aws:)[a-zA-Z+-=._:/]{1,16}$": {"type": "string"}}}}},
]
_GUARDED_INSTANCES = [
    [{"id": {"b": "x", "a": 1}, "name": "foo", "tags": ["a", "b"]}, {"age": 3, "name": "a\"b", "id": {"a": -2}}],
    [{"bar": 2, "foo": "yes", "baz": [{"value": 1, "x": 2}, {"value": 9}]}, {"foo": "a", "name": [1, 2], "w": "qqqq"},
     {"bar": 1, "b": 2, "bark": 3, "foo": "x", "f": 0}],
    [{"value": "arn", "items": [{"alpha": 1, "type": "a"}, {"beta": "x", "type": "b"}]}, {"items": []}],
    [{"kind": "or", "filters": ["a b", 2.5, {"value": 1, "op": "eq", "key": "k"}, [1, {"x": None}]], "pick": "abc"},
     {"filters": [], "pick": {"op": "ne", "value": "v", "key": "q"}, "kind": "and"}, {"pick": -3e-2, "filters": [True], "kind": "or"}],
    [{"k1": {"z": "q", "x": 1}, "name": "n", "k2": {"w": True, "y": 2, "z": "", "x": -1}}, {}],
    [{"s_1": {"b": "x", "a": 1}, "n_2": 3, "s_x": {"a": 2, "extra": [1]}}],
    [{"svc": {"git": {"token": "t", "url": "u"}}}, {"svc": {"pager": {"team": "a", "key": "k", "on": True}}}],
    [{"cert": {"method": "vip", "version": "v2", "arn": "x"}, "opts": {"c": 1, "b": 2, "a": 3}}, {"opts": {"d": 4}}],
    [{"min": {"patch": 1, "major": 3}, "version": 1}, {"auth": {"use_id": True, "user": "u", "proxy": "p"}, "version": 2,
                                                       "min": {"tag": "x", "major": 0}}],
    [{"kids": [{"size": 2, "name": "b", "kids": []}, {"name": "c", "tag": {"x": 1, "k": "a"}}], "name": "a"},
     {"link": [{"link": {"name": "e", "size": 1}, "name": "d"}], "size": 3, "name": "r"}],
    [{"w": 1, "kind": "leaf"}, {"r": {"w": 2, "kind": "leaf"}, "kind": "pair", "l": {"kind": "leaf"}}],
    [{"Tags": {"a": "b", "k:2": "v"}, "Name": "x"}, {"Tags": {}}],
]


@pytest.mark.parametrize("index", range(len(_GUARDED_SCHEMAS)))
def test_guarded_rows_are_exactly_grammar_minus_refusals(backend: GrammarBackend, tokenizer: Any, index: int) -> None:
    """Every guarded mask row equals, token by token, what the grammar allows and `accept` takes (the brute-force
    definition), along valid instances in compact and indented form; twice per compiled grammar, so the verdicts
    the guard shares across rows and requests (by cursor signature and token structure) are checked where they
    are reused. Fails if a shared verdict, a candidate filter (string exits, repeated or used-name keys) or the
    structure classes were wrong."""
    compiled = backend.compile(_schema_spec(_GUARDED_SCHEMAS[index]))
    assert compiled.guard is not None and compiled.guard.active
    checked = 0
    for _ in range(2):
        for instance in _GUARDED_INSTANCES[index]:
            for indent in (None, 2):
                text = json.dumps(instance, indent=indent, separators=None if indent else (",", ":"))
                matcher = backend.matcher(compiled)
                for token in _encode(tokenizer, text):
                    checked += _check_row_against_brute_force(backend, tokenizer, matcher, text)
                    assert matcher.accept(token), (text, matcher.text)
                assert matcher.accept(tokenizer.eos_token_id), text
    assert checked > 1000


def test_formats_neither_side_checks_need_no_guard(backend: GrammarBackend) -> None:
    """A format llguidance drops and jsonschema does not know either (CloudFormation's "AWS::IAM::Role.Arn") left
    a root anchor that made the guard follow every token for nothing; a dropped format jsonschema does check
    keeps its anchor."""
    compiled = backend.compile(_schema_spec({"type": "object", "properties": {"r": {"type": "string", "format": "AWS::IAM::Role.Arn"}}}))
    assert any("format" in note.lower() for note in compiled.guard.dropped)
    assert not compiled.guard.anchors


def test_small_closed_objects_take_any_order_in_the_grammar(backend: GrammarBackend, tokenizer: Any) -> None:
    """A closed object with at most three properties is written into the grammar as the anyOf of its property
    orders: every order is accepted exactly (repeats and missing required keys refused by the grammar alone), and
    the guard does not follow it (its rows go to llguidance's native executor)."""
    import itertools
    item = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}, "c": {"type": "boolean"}},
            "required": ["a"], "additionalProperties": False}
    schema = {"type": "array", "items": item}
    compiled = backend.compile(_schema_spec(schema))
    assert not compiled.guard.objects and not compiled.guard.active
    assert backend.matcher(compiled)._native_ok
    values = {"a": 1, "b": "x", "c": True}
    for n in (1, 2, 3):
        for keys in itertools.permutations("abc", n):
            doc = [{k: values[k] for k in keys}]
            for indent in (None, 2):
                text = json.dumps(doc, indent=indent, separators=None if indent else (",", ":"))
                assert _produce(backend, compiled, tokenizer, text) == ("a" in keys), text
    for text in ('[{"a":1,"a":2}]', '[{"b":"x","a":1,"b":"y"}]', '[{"a":1,"d":2}]', '[{}]'):
        assert not _produce(backend, compiled, tokenizer, text), text


def test_relaxed_names_sharing_a_subschema_share_one_pattern(backend: GrammarBackend, tokenizer: Any) -> None:
    """Free-order objects give llguidance one pattern property per distinct subschema (annotations aside), not
    one per name: it checks every pair of patterns for overlap (64 names: ~25 ms to compile, ~1 ms grouped).
    Any order is still taken, and each name still gets its own subschema."""
    from leapdecode.structured.guard import free_order_sites
    from leapdecode.structured.lowering import lower

    props = {"a": {"type": "string", "description": "first"}, "b": {"type": "integer"},
             "c": {"type": "string", "description": "third"}, "d": {"type": "integer", "title": "D"},
             "e.f": {"type": "boolean"}, "g": {"type": "null"}}
    schema = {"type": "object", "properties": props, "required": ["a", "d"], "additionalProperties": False}
    sites = free_order_sites(schema)
    lowered = lower(schema, lambda regex: True, [], relax=sites.keys())
    assert list(lowered["patternProperties"]) == ["^(?:a|c)$", "^(?:b|d)$", "^e\\.f$", "^g$"]
    compiled = backend.compile(_schema_spec(schema))
    for text in ('{"d":1,"a":"x"}', '{"c":"y","e.f":true,"d":2,"g":null,"a":"x","b":3}', '{"a":"x","d":1,"c":"z"}'):
        assert _produce(backend, compiled, tokenizer, text), text
    for text in ('{"a":1,"d":1}', '{"a":"x","d":"1"}', '{"a":"x","d":1,"c":2}', '{"a":"x","d":1,"b":"2"}',
                 '{"a":"x","d":1,"ef":true}', '{"a":"x","d":1,"a":"y"}', '{"a":"x"}'):
        assert not _produce(backend, compiled, tokenizer, text), text


def test_lowering_does_not_depend_on_the_order_of_its_id_sets() -> None:
    """`relax` and `expand` are sets of ids, whose order changes from run to run: the lowered schema must not
    (names were grouped by their subschemas before or after those were relaxed, depending on it, and the shared
    definitions were numbered in it)."""
    from leapdecode.structured.guard import free_order_sites
    from leapdecode.structured.lowering import lower

    inner = {"type": "object", "properties": {"p": {"type": "integer"}, "q": {"type": "string"},
                                               "r": {"type": "boolean"}, "s": {"type": "null"}}}
    small = {"type": "object", "additionalProperties": False,
             "properties": {"u": {"type": "integer", "minimum": 1}, "v": {"enum": ["a", "b"]}}}
    schema = {"type": "object", "properties": {"x": copy.deepcopy(inner), "y": copy.deepcopy(inner),
                                               "m": copy.deepcopy(small), "n": copy.deepcopy(small)}}
    sites = free_order_sites(schema)
    relax, expand = list(sites.keys()), list(sites.expanded)
    assert len(relax) == 3 and len(expand) == 2
    outputs = {json.dumps(lower(schema, lambda regex: True, [], relax=r, expand=e, unions=sites.union_ids()))
               for r in (relax, relax[::-1]) for e in (expand, expand[::-1])}
    assert len(outputs) == 1


def test_grouped_names_of_intersected_objects_fall_back_to_one_name_a_pattern(backend: GrammarBackend,
                                                                            tokenizer: Any) -> None:
    """Two relaxed objects joined by allOf group their names differently, and llguidance refuses the overlap of
    their intersection: the schema is lowered again with one name a pattern, and nothing is dropped from the
    grammar (before the fallback, patternProperties went, and CMake's presets schema refused every document)."""
    s, i, b = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}
    first = {"type": "object", "properties": {"a": s, "b": s, "c": i, "d": i, "e": b, "f": b}}       # (a|b) (c|d) (e|f)
    second = {"type": "object", "properties": {"a": s, "b": i, "c": i, "d": b, "e": b, "f": s}}      # (a|f) (b|c) (d|e)
    compiled = backend.compile(_schema_spec({"type": "array", "items": {"allOf": [first, second]}}))
    assert compiled.dropped == () and compiled.guard.objects
    for text in ('[{"e":true,"a":"x","c":2}]', '[{"c":1,"a":"x"}]', '[{}]'):
        assert _produce(backend, compiled, tokenizer, text), text
    for text in ('[{"a":1}]', '[{"b":"y"}]', '[{"b":1}]', '[{"a":"x","a":"y"}]'):
        assert not _produce(backend, compiled, tokenizer, text), text


def test_expanded_objects_reference_their_property_subschemas_once(backend: GrammarBackend, tokenizer: Any) -> None:
    """The anyOf of a small closed object's property orders refers to each property's subschema through the
    root's `$defs` (llguidance compiles a `$ref` target once, a subschema as often as it is written: six times
    for three properties), keeps the root's own definitions, and is exact; below a nested `$id`, where "#/..."
    means another document, nothing moves."""
    import itertools

    from leapdecode.structured.guard import free_order_sites
    from leapdecode.structured.lowering import lower

    point = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0}, "y": {"type": "integer"}},
             "required": ["x", "y"], "additionalProperties": False}
    item = {"type": "object", "additionalProperties": False, "required": ["p"],
            "properties": {"p": {"$ref": "#/$defs/point"}, "tag": {"enum": ["u", "v"]}, "n": {"type": "null"}}}
    schema = {"$defs": {"point": point, "leapdecode-shared-0": {"type": "string"}}, "type": "array", "items": item}
    sites = free_order_sites(schema)
    lowered = lower(schema, lambda regex: True, [], expand=sites.expanded)
    branches = lowered["items"]["anyOf"]
    assert len(branches) == 6 and "point" in lowered["$defs"]
    refs = {name: {json.dumps(b["properties"][name]) for b in branches} for name in ("p", "tag", "n")}
    assert refs["p"] == {'{"$ref": "#/$defs/point"}'}          # a bare $ref stays as it is
    (tag,) = refs["tag"]
    (n,) = refs["n"]
    assert tag != n and all(r.startswith('{"$ref": "#/$defs/leapdecode-shared-') for r in (tag, n))
    assert lowered["$defs"]["leapdecode-shared-0"] == {"type": "string"}   # the user's own entry is kept
    assert lowered["$defs"][json.loads(tag)["$ref"].rsplit("/", 1)[1]] == {"enum": ["u", "v"]}
    compiled = backend.compile(_schema_spec(schema))
    values = {"p": {"y": -1, "x": 2}, "tag": "v", "n": None}
    for keys in itertools.permutations(values):
        assert _produce(backend, compiled, tokenizer, json.dumps([{k: values[k] for k in keys}], separators=(",", ":")))
    for text in ('[{"tag":"w","p":{"x":1,"y":1}}]', '[{"n":0,"p":{"x":1,"y":1}}]', '[{"p":{"x":-1,"y":1}}]',
                 '[{"tag":"u"}]'):
        assert not _produce(backend, compiled, tokenizer, text), text
    # a property no value satisfies (a string $ref beside "type": "object", as CloudFormation writes one): as a $defs
    # entry llguidance refuses the schema, written in place it rules the property out; the lowering falls back
    never = {"$defs": {"arn": {"type": "string"}}, "type": "object", "additionalProperties": False,
             "properties": {"on": {"type": "boolean"}, "arn": {"$ref": "#/$defs/arn", "type": "object"}}}
    compiled = backend.compile(_schema_spec(never))
    assert _produce(backend, compiled, tokenizer, '{"on":true}') and not _produce(backend, compiled, tokenizer, '{"arn":"x"}')
    nested = {"type": "array", "items": {"$id": "http://example.com/item", **item}, "$defs": {"point": point}}
    nested_sites = free_order_sites(nested)
    assert nested_sites.expanded
    moved = lower(nested, lambda regex: True, [], expand=nested_sites.expanded)["$defs"]
    assert list(moved) == ["point"]


def test_draft7_keywords_beside_a_ref_are_ignored(backend: GrammarBackend, tokenizer: Any) -> None:
    """Drafts 3 to 7 ignore every keyword beside a `$ref` (2019-09 on applies them): neither the grammar nor the
    guard's analysis may read them there, while in 2020-12 they hold."""
    inner = {"type": "object", "properties": {"q": {"type": "integer"}, "r": {"type": "string"}}, "required": ["q"]}
    for draft, applies in (("http://json-schema.org/draft-07/schema#", False),
                           ("https://json-schema.org/draft/2020-12/schema", True)):
        schema = {"$schema": draft, "definitions": {"a": {"type": "object"}}, "$ref": "#/definitions/a",
                  "properties": {"x": inner}, "maxProperties": 1}
        compiled = backend.compile(_schema_spec(schema))
        assert _produce(backend, compiled, tokenizer, '{"x":{"q":1}}')
        for text in ('{"x":{"r":"s"}}', '{"x":5}', '{"x":{"q":1},"y":2}'):
            assert _produce(backend, compiled, tokenizer, text) == (not applies), (draft, text)


def test_constant_objects_take_any_key_order(backend: GrammarBackend, tokenizer: Any) -> None:
    """Object values of const and enum are spelled out as object schemas (each key required with its value, no
    other key), so their keys come in any order like any object's; everything else about them stays exact. Not
    where the schema uses unevaluatedProperties (the spelled-out keys would count as evaluated there)."""
    from leapdecode.structured.lowering import prepared

    schema = {"type": "object", "properties": {
        "mode": {"enum": [{"kind": "fast", "level": 1}, {"kind": "slow", "opts": {"a": True, "b": None}}, "off"]},
        "point": {"const": {"x": 1, "y": [1, 2], "z": {"w": "v"}}, "description": "fixed"}}}
    compiled = backend.compile(_schema_spec(schema))
    for text in ('{"mode":{"level":1,"kind":"fast"},"point":{"z":{"w":"v"},"x":1,"y":[1,2]}}',
                 '{"point":{"y":[1,2],"z":{"w":"v"},"x":1},"mode":{"opts":{"b":null,"a":true},"kind":"slow"}}',
                 '{"mode":"off"}', '{"mode":{"kind":"fast","level":1}}'):
        assert _produce(backend, compiled, tokenizer, text), text
    for text in ('{"mode":{"level":2,"kind":"fast"}}', '{"mode":{"kind":"fast"}}', '{"mode":{"kind":"fast","level":1,"x":1}}',
                 '{"mode":{"kind":"slow","opts":{"a":true}}}', '{"mode":"on"}', '{"point":{"x":1,"y":[2,1],"z":{"w":"v"}}}',
                 '{"point":{"x":true,"y":[1,2],"z":{"w":"v"}}}', '{"mode":{"kind":"fast","level":1,"kind":"fast"}}'):
        assert not _produce(backend, compiled, tokenizer, text), text
    ordered = backend.compile({**_schema_spec(schema), "key_order": "schema"})      # the narrowed form: as written
    assert not _produce(backend, ordered, tokenizer, '{"mode":{"level":1,"kind":"fast"}}')
    assert _produce(backend, ordered, tokenizer, '{"mode":{"kind":"fast","level":1}}')
    # properties named like the keywords whose values are data: subschemas all the same (walked, spelled out)
    data_names = backend.compile(_schema_spec({"type": "object", "properties": {"default": {"const": {"a": 1, "b": 2}},
                                                                                  "enum": {"enum": [{"c": 1, "d": 2}]}}}))
    assert _produce(backend, data_names, tokenizer, '{"enum":{"d":2,"c":1},"default":{"b":2,"a":1}}')
    kept = {"properties": {"c": {"const": {"a": 1, "b": 2}}}, "unevaluatedProperties": False}
    assert prepared(copy.deepcopy(kept)) == kept
    named = {"properties": {"const": {"type": "object"}}}     # a property named "const", not the keyword
    assert prepared(copy.deepcopy(named)) == named


def test_pointers_through_properties_do_not_fix_the_key_order(backend: GrammarBackend, tokenizer: Any) -> None:
    """A `$ref` into another object's `properties` (SchemaStore's buildkite: `"identifier": {"$ref":
    "#/definitions/waitStep/properties/key"}`) had kept that object in schema order (relaxing it moves its
    properties where the pointer looks): the pointed subschemas now move under `$defs`, re-aimed pointers
    included, so the object takes any order, and stays exact. Also a pointer through two objects' properties,
    and a property named "properties" (a name on the pointer, not the keyword)."""
    from leapdecode.structured.lowering import POINTED_PREFIX, prepared

    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "$ref": "#/definitions/step", "definitions": {
        "step": {"type": "object", "additionalProperties": False, "properties": {
            "key": {"type": "string", "maxLength": 3},
            "identifier": {"$ref": "#/definitions/step/properties/key"},
            "wait": {"type": ["string", "null"]},
            "name": {"$ref": "#/definitions/step/properties/wait"},
            "opts": {"type": "object", "properties": {"depth": {"type": "integer", "minimum": 0},
                                                      "properties": {"type": "boolean"}}},
            "depth": {"$ref": "#/definitions/step/properties/opts/properties/depth"},
            "flag": {"$ref": "#/definitions/step/properties/opts/properties/properties"}}}}}
    compiled = backend.compile(_schema_spec(schema))
    for text in ('{"wait":"","identifier":"d"}', '{"identifier":"d","wait":""}', '{"name":null,"key":"abc"}',
                 '{"flag":true,"depth":3,"opts":{"properties":false,"depth":1},"wait":null}'):
        for form in (text, json.dumps(json.loads(text), indent=2)):
            assert _produce(backend, compiled, tokenizer, form), form
    for text in ('{"identifier":"dddd"}', '{"wait":1}', '{"zz":1}', '{"depth":-1}', '{"flag":1}',
                 '{"opts":{"depth":"x"}}', '{"key":"a","key":"b"}'):
        assert not _produce(backend, compiled, tokenizer, text), text
    moved = prepared(copy.deepcopy(schema))
    assert not [ref for ref in _refs(moved) if "/properties/" in ref]
    assert sorted(moved["$defs"]) == [f"{POINTED_PREFIX}{i}" for i in range(5)]  # key, wait, opts, its depth and flag
    assert prepared(copy.deepcopy(schema), any_order=False) == schema     # the narrowed form reads it as written


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        return ([node["$ref"]] if isinstance(node.get("$ref"), str) else []) + [r for v in node.values() for r in _refs(v)]
    return [r for v in node for r in _refs(v)] if isinstance(node, list) else []


def test_unreached_definitions_are_pruned() -> None:
    """`prepared` removes the definitions nothing reaches (a schema cut from a large document otherwise costs
    every pass a walk over all of them), keeps every node on a pointer (into a definition's own definitions),
    and keeps everything when a reached subschema refers other than by a plain pointer (an anchor, another
    document) or names itself (`$anchor`, a nested `$id`)."""
    from leapdecode.structured.lowering import prepared

    defs = {"a": {"type": "object", "properties": {"b": {"$ref": "#/definitions/b"}}}, "b": {"type": "integer"},
            "unused": {"type": "string", "x": {"$ref": "#/definitions/b"}},
            "outer": {"definitions": {"inner": {"type": "boolean"}, "spare": {"type": "null"}}, "type": "object"},
            "self": {"items": {"$ref": "#/definitions/self"}}}
    schema = {"anyOf": [{"$ref": "#/definitions/a"}, {"$ref": "#/definitions/outer/definitions/inner"},
                        {"$ref": "#/definitions/self"}], "definitions": defs}
    pruned = prepared(copy.deepcopy(schema))
    assert set(pruned["definitions"]) == {"a", "b", "outer", "self"}
    named = {"properties": {"examples": {"$ref": "#/$defs/e"}}, "$defs": {"e": {"type": "integer"}, "f": {}}}
    assert set(prepared(copy.deepcopy(named))["$defs"]) == {"e"}     # a property named "examples" is a subschema
    assert set(pruned["definitions"]["outer"]["definitions"]) == {"inner", "spare"}   # kept whole: on a pointer
    for other in ({"$anchor": "here"}, {"$ref": "other.json#/definitions/b"}, {"$ref": "#here"}, {"$id": "x.json"}):
        whole = copy.deepcopy({**schema, "anyOf": [*schema["anyOf"], other]})
        assert prepared(copy.deepcopy(whole)) == whole, other
        unreached = copy.deepcopy({**schema, "definitions": {**defs, "extra": other}})    # what is never met: gone
        assert "extra" not in prepared(unreached)["definitions"]


def test_properties_named_like_keywords_stay_properties(backend: GrammarBackend, tokenizer: Any) -> None:
    """A property named "format" (buildkite's text field), "pattern" or "multipleOf" is a name, not a keyword: the
    guard's check for dropped formats read a properties map as a schema and failed (TypeError: its "format" was
    a subschema), and dropping a keyword the library refused removed such properties too."""
    from leapdecode.structured.lowering import drop_keyword

    schema = {"type": "object", "properties": {"format": {"type": "string", "format": "regex"},
                                               "key": {"type": "string"}}, "additionalProperties": False}
    compiled = backend.compile(_schema_spec(schema))
    assert _produce(backend, compiled, tokenizer, '{"key":"k","format":"a+"}')
    assert not _produce(backend, compiled, tokenizer, '{"format":1}')
    named = {"properties": {"pattern": {"type": "string", "pattern": "a"}, "multipleOf": {"multipleOf": 2}},
             "pattern": "b"}
    assert drop_keyword(named, "pattern") == {"properties": {"pattern": {"type": "string"},
                                                             "multipleOf": {"multipleOf": 2}}}
    assert drop_keyword(named, "multipleOf")["properties"] == {"pattern": named["properties"]["pattern"],
                                                               "multipleOf": {}}


def test_property_names_beside_properties_take_any_order(backend: GrammarBackend, tokenizer: Any) -> None:
    """`propertyNames` (checked by the guard on each key as it closes) no longer keeps the object's declared
    properties first: an additional key may come before them, and every name is still checked, declared ones
    included, as is every declared property's value."""
    schema = {"type": "object", "properties": {"ab": {"type": "string", "maxLength": 3}, "long_name": {}},
              "propertyNames": {"maxLength": 4}}
    compiled = backend.compile(_schema_spec(schema))
    for text in ('{"%":[],"ab":""}', '{"x":1,"ab":"abc","y":null}', '{"ab":"","%":[]}'):
        assert _produce(backend, compiled, tokenizer, text), text
        assert _produce(backend, compiled, tokenizer, json.dumps(json.loads(text), indent=2)), text
    for text in ('{"%":[],"ab":"abcd"}', '{"abcde":1}', '{"long_name":1}', '{"ab":"","ab":""}'):
        assert not _produce(backend, compiled, tokenizer, text), text


def test_closed_objects_in_an_all_of_take_any_order(backend: GrammarBackend, tokenizer: Any) -> None:
    """allOf members merge into the subschema holding them where that means the same, so a closed object in
    `{"allOf": [S]}`, beside `{"type": "object"}` or beside `{"required": [...]}` takes its keys in any order
    (intersected, it had to keep schema order), and so does a `$ref` member's target; members whose keywords read
    each other's stay apart (a closed object's additionalProperties does not see another member's properties)."""
    from leapdecode.structured.lowering import prepared

    closed = {"type": "object", "properties": {"p": {"type": "integer"}, "q": {"type": "string"}, "r": {"type": "boolean"},
                                               "s": {"type": "null"}, "u": {"type": "integer"}},
              "required": ["p"], "additionalProperties": False}
    for wrapper, required in (({"allOf": [closed]}, ["p"]), ({"allOf": [closed, {"type": "object"}]}, ["p"]),
                              ({"allOf": [closed, {"required": ["q"], "description": "d"}]}, ["p", "q"])):
        schema = {"type": "object", "properties": {"f": wrapper}}
        compiled = backend.compile(_schema_spec(schema))
        for text in ('{"f":{"q":"a","p":1}}', '{"f":{"u":2,"s":null,"r":true,"q":"a","p":1}}'):
            assert _produce(backend, compiled, tokenizer, text), (wrapper, text)
        for text in ('{"f":{"q":"a","p":1,"x":0}}', '{"f":{"q":1,"p":1}}', '{"f":{"p":1,"p":1,"q":"a"}}'):
            assert not _produce(backend, compiled, tokenizer, text), (wrapper, text)
        assert _produce(backend, compiled, tokenizer, '{"f":{"p":1}}') == (required == ["p"])
        assert prepared(copy.deepcopy(schema))["properties"]["f"].get("required") == required
    apart = {"allOf": [{"type": "object", "properties": {"a": {}}, "additionalProperties": False},
                       {"properties": {"b": {"type": "integer"}}}]}
    assert prepared(copy.deepcopy(apart))["allOf"] == apart["allOf"][1:]      # the first one merged, not the second
    compiled = backend.compile(_schema_spec(apart))
    assert _produce(backend, compiled, tokenizer, '{"a":1}') and not _produce(backend, compiled, tokenizer, '{"b":1}')
    # a `$ref` member merges its target's keywords (GitLab's job inputs: allOf [$ref, {"required": [...]}]); the
    # target stays for its other references
    by_ref = {"type": "object", "properties": {"f": {"allOf": [{"$ref": "#/$defs/c"}, {"required": ["q"]}]},
                                               "g": {"$ref": "#/$defs/c"}}, "$defs": {"c": closed}}
    merged = prepared(copy.deepcopy(by_ref))
    assert "allOf" not in merged["properties"]["f"] and merged["properties"]["f"]["required"] == ["p", "q"]
    assert merged["$defs"]["c"] == closed
    compiled = backend.compile(_schema_spec(by_ref))
    for text, ok in (('{"f":{"q":"a","p":1},"g":{"p":2}}', True), ('{"g":{"r":true,"p":2},"f":{"u":1,"q":"","p":0}}', True),
                     ('{"f":{"p":1}}', False), ('{"g":{"q":"a"}}', False), ('{"f":{"q":"a","p":1,"z":0}}', False)):
        assert _produce(backend, compiled, tokenizer, text) == ok, text
    keeps_ref = {"allOf": [{"$ref": "#/$defs/c"}, {"properties": {"z": {}}}], "$defs": {"c": closed}}
    assert prepared(copy.deepcopy(keeps_ref))["allOf"] == keeps_ref["allOf"][1:]      # the target merged, not z
    assert prepared(copy.deepcopy(wrapper), any_order=False) == wrapper


def test_universal_types_are_sound_and_found() -> None:
    """`universal_types` names the JSON types every value of which a subschema accepts (such values need no
    jsonschema call); checked against jsonschema on sample values of each type, and on what it must find."""
    import jsonschema
    from leapdecode.structured.guard import universal_types

    samples = {"string": ["", "a", "no", "2020-01-01", "x" * 40], "number": [0, -1, 2.5, 1e300, 3], "boolean": [True, False],
               "null": [None], "object": [{}, {"a": 1}], "array": [[], [1, "a"]]}
    everything = frozenset(samples)
    cases = [
        ({}, everything), (True, everything), (False, frozenset()),
        ({"type": "string", "title": "t", "x-custom": 1}, {"string"}), ({"type": "integer"}, frozenset()),
        ({"type": ["number", "null"], "minimum": 0}, {"null"}), ({"minLength": 2}, everything - {"string"}),
        ({"format": "date"}, everything - {"string", "number"}), ({"enum": ["a"]}, frozenset()),
        ({"anyOf": [{"type": "string"}, {"type": "object", "required": ["a"]}]}, {"string"}),
        ({"anyOf": [{"$ref": "#/$defs/o"}, {}]}, everything),
        ({"allOf": [{"type": ["string", "number"]}, {"type": "string"}]}, {"string"}),
        ({"oneOf": [{"type": "string"}, {"type": "number"}, {"type": "object"}]}, {"string", "number", "object"}),
        ({"oneOf": [{"type": "string"}, {"minLength": 3}]}, everything - {"string"}),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, frozenset()),
        ({"$ref": "#/$defs/o"}, frozenset()), ({"$ref": "#/$defs/s"}, {"string"}), ({"$ref": "#/$defs/loop"}, {"string"}),
        ({"$ref": "#/$defs/elsewhere"}, frozenset()), ({"$ref": "#/$defs/nested_id"}, frozenset()),
        ({"not": {"type": "string"}}, frozenset()), ({"if": {"type": "string"}, "then": {"minLength": 1}}, frozenset()),
        ({"then": {"minLength": 9}}, everything), ({"type": "array", "items": {"type": "integer"}}, frozenset()),
        ({"type": "array", "maxItems": 0}, frozenset()),
    ]
    defs = {"o": {"type": "object", "required": ["a"]}, "s": {"type": "string", "description": "d"}, "loop": {"anyOf": [{"type": "string"}, {"$ref": "#/$defs/loop"}]},
            "nested_id": {"$id": "http://example.com/x", "type": "string"}}
    for schema, expected in cases:
        root = {"$defs": defs, **schema} if isinstance(schema, dict) else schema
        validator = jsonschema.Draft202012Validator(root, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
        found = universal_types(root, root, validator)
        assert found == frozenset(expected), (schema, found)
        for kind in found:
            for value in samples[kind]:
                assert validator.is_valid(value), (schema, kind, value)


def test_values_every_branch_accepts_cost_no_jsonschema_call(backend: GrammarBackend, tokenizer: Any,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A union of a free-order object with `{}` (pydantic's `Union[Model, Any]`) is validated by the guard as a
    whole at its fixed path; a string element there used to be checked with jsonschema once per candidate token
    that could close it (10 ms rows), although `{}` takes every string. Now no jsonschema call is made for it,
    and the row is still exactly the grammar's minus what `accept` refuses."""
    from leapdecode.structured import guard as guard_module

    calls = []
    real = guard_module._is_valid
    monkeypatch.setattr(guard_module, "_is_valid", lambda v, value: calls.append(value) or real(v, value))
    compiled = backend.compile(_schema_spec(_UNION_WITH_ANY))
    matcher = backend.matcher(compiled)
    prefix = '{"kind":"or","filters":["a b'
    assert matcher.accept_tokens(_encode(tokenizer, prefix)) == len(_encode(tokenizer, prefix))
    calls.clear()
    _check_row_against_brute_force(backend, tokenizer, matcher, prefix)
    assert not calls
    import jsonschema   # and what it accepts is what jsonschema accepts (the skip is sound)
    for doc in ({"filters": ["x", 3, None], "kind": "or", "pick": "abc"}, {"filters": [], "kind": "or", "pick": "abcd"},
                {"filters": [{"key": "k", "op": "eq", "value": [1]}], "kind": "and"}, {"pick": {"key": "k"}, "filters": [], "kind": "or"},
                {"pick": {"value": 2, "op": "ne", "key": "k"}, "filters": [{}], "kind": "and"}):
        valid = jsonschema.Draft202012Validator(_UNION_WITH_ANY).is_valid(doc)
        for indent in (None, 2):
            text = json.dumps(doc, indent=indent, separators=None if indent else (",", ":"))
            assert _produce(backend, compiled, tokenizer, text) == valid, (text, valid)


# ------------------------------------------------------------------------------------------ strict schemas
def _strict(schema: Any) -> dict[str, Any]:
    spec = _schema_spec(schema)
    spec["json_schema"]["strict"] = True
    return spec


def test_strict_closes_the_objects_that_declare_properties(backend: GrammarBackend, tokenizer: Any) -> None:
    """``strict: true`` (OpenAI's flag) takes an object that declares properties and says nothing of other keys
    as closed, as OpenAI requires strict schemas to say and xgrammar's strict mode and llama.cpp assume; without
    it every valid document is accepted. The reference: jsonschema on the schema as given, and on the same schema
    with ``additionalProperties: false`` written by hand where strict closes it."""
    import jsonschema
    schema = {"type": "object", "required": ["a"],
              "properties": {"a": {"type": "integer"},
                             "o": {"type": "object", "properties": {"x": {"type": "string"}}},
                             "free": {"type": "object"},
                             "items": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "integer"}}}},
                             "map": {"type": "object", "additionalProperties": {"type": "integer"}}}}
    closed = copy.deepcopy(schema)
    closed["additionalProperties"] = False
    closed["properties"]["o"]["additionalProperties"] = False
    closed["properties"]["items"]["items"]["additionalProperties"] = False
    instances = [{"a": 1}, {"a": 1, "zz": 2}, {"o": {"x": "s"}, "a": 1}, {"a": 1, "o": {"x": "s", "y": 1}},
                 {"a": 1, "free": {"k": 1, "j": [2]}}, {"a": 1, "items": [{"k": 1}, {"k": 2, "extra": 0}]},
                 {"a": 1, "items": [{"k": 1}]}, {"a": 1, "map": {"p": 1, "q": 2}}, {"zz": 2}]
    refused = 0
    for instance in instances:
        for indent in (None, 2):
            text = json.dumps(instance, indent=indent, separators=None if indent else (",", ":"))
            assert _accepts(backend, tokenizer, _schema_spec(schema), text) == jsonschema.Draft202012Validator(
                schema).is_valid(instance), text
            strict = _accepts(backend, tokenizer, _strict(schema), text)
            assert strict == jsonschema.Draft202012Validator(closed).is_valid(instance), text
            refused += not strict and jsonschema.Draft202012Validator(schema).is_valid(instance)
    assert refused == 2 * 3        # the extra keys at the top, in "o" and in an item: valid, refused when strict
    # strict is part of what is compiled (and cached): the two specs are different grammars
    assert backend.compile(_strict(schema)) is not backend.compile(_schema_spec(schema))


def test_strict_keeps_the_keys_that_joined_subschemas_declare(backend: GrammarBackend, tokenizer: Any) -> None:
    """An object whose meaning is joined with another's (allOf, a $ref beside properties, if/then) is not closed
    alone, which would refuse the keys the other declares: those documents stay accepted under strict; a union's
    branches with nothing declared beside them are closed each."""
    cases = [
        ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                    {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
         [('{"a":1,"b":2}', True), ('{"b":2}', True)]),
        ({"$defs": {"B": {"type": "object", "properties": {"b": {"type": "integer"}}}},
          "$ref": "#/$defs/B", "properties": {"a": {"type": "integer"}}},
         [('{"a":1,"b":2}', True), ('{"b":"x"}', False)]),
        ({"type": "object", "properties": {"kind": {"enum": ["p", "q"]}},
          "if": {"properties": {"kind": {"const": "p"}}}, "then": {"properties": {"p": {"type": "integer"}}}},
         [('{"kind":"p","p":1}', True), ('{"kind":"p","p":"x"}', False)]),
        ({"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                    {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
         [('{"a":1}', True), ('{"b":2}', True), ('{"a":1,"z":0}', False)]),
    ]
    for schema, texts in cases:
        for text, ok in texts:
            assert _accepts(backend, tokenizer, _strict(schema), text) == ok, (schema, text)
    assert _accepts(backend, tokenizer, _schema_spec(cases[3][0]), '{"a":1,"z":0}')    # open: valid, accepted
