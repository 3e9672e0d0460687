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

import json
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
from leapdecode.structured.backend import json_text

SUITE = pathlib.Path(__file__).parent / "data" / "json_schema_test_suite" / "tests"
DRAFT_URIS = {"draft2020-12": "https://json-schema.org/draft/2020-12/schema", "draft7": "http://json-schema.org/draft-07/schema#"}

# Refused at compile time (a clear ValueError), so nothing is ever generated for these schemas:
_REMOTE = "refers to a remote schema (http://localhost:1234/...); the backend never fetches schemas"
_UNSAT = "unsatisfiable schema (no instance is valid): refusing it with a ValueError is the right outcome"
_PATPROPS = "llguidance requires the regexes of patternProperties to be disjoint (these overlap)"
_UNICODE_PROP = "ECMA-262 \\p{...} escape: Python's re (which jsonschema, our guard, uses) rejects it at submission"
# Compiled, but some VALID instances cannot be produced (an under-approximation; never an invalid instance):
_INT_FLOAT = "a number with a zero fraction (1.0, [0.0]): the grammar writes the equal value in integer form only"
_CONST_ORDER = "const/enum objects are emitted with exactly the schema's key order"
_REF_ORDER = "llguidance fixes an order of properties merged from $ref that differs from the instance's and the schema's"
_DRAFT7_REF = "draft 7 ignores keywords beside $ref; llguidance applies them (2019-09+ semantics)"
_FORMAT = "format is asserted (grammar + jsonschema FormatChecker), stricter than the annotation-only default"
# (file, group description[, test description]) -> reason; (file, "*") covers a whole file.
UNSUPPORTED: dict[tuple[str, ...], str] = {
    ('draft7/refRemote.json', '*'): _REMOTE,
    ('draft2020-12/refRemote.json', '*'): _REMOTE,
    ('draft2020-12/allOf.json', 'allOf with boolean schemas, some false'): _UNSAT,
    ('draft2020-12/allOf.json', 'allOf with boolean schemas, all false'): _UNSAT,
    ('draft2020-12/anyOf.json', 'anyOf with boolean schemas, all false'): _UNSAT,
    ('draft2020-12/boolean_schema.json', "boolean schema 'false'"): _UNSAT,
    ('draft2020-12/const.json', 'const with object', 'same object with different property order is valid'): _CONST_ORDER,
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
    ('draft2020-12/format.json', 'email format', 'invalid email string is only an annotation by default'): _FORMAT,
    ('draft2020-12/format.json', 'idn-email format', 'invalid idn-email string is only an annotation by default'): _FORMAT,
    ('draft2020-12/format.json', 'regex format', 'invalid regex string is only an annotation by default'): _FORMAT,
    ('draft2020-12/format.json', 'ipv4 format', 'invalid ipv4 string is only an annotation by default'): _FORMAT,
    ('draft2020-12/format.json', 'ipv6 format', 'invalid ipv6 string is only an annotation by default'): _FORMAT,
    ('draft2020-12/format.json', 'idn-hostname format', 'invalid idn-hostname string is only an annotation by default'): _FORMAT,
    ('draft2020-12/format.json', 'hostname format', 'invalid hostname string is only an annotation by default'): _FORMAT,
    ('draft2020-12/format.json', 'date format', 'invalid date string is only an annotation by default'): _FORMAT,
    ('draft2020-12/format.json', 'date-time format', 'invalid date-time string is only an annotation by default'): _FORMAT,
    ('draft2020-12/format.json', 'time format', 'invalid time string is only an annotation by default'): _FORMAT,
    ('draft2020-12/format.json', 'json-pointer format', 'invalid json-pointer string is only an annotation by default'): _FORMAT,
    ('draft2020-12/format.json', 'relative-json-pointer format', 'invalid relative-json-pointer string is only an annotation by default'): _FORMAT,
    ('draft2020-12/format.json', 'uri format', 'invalid uri string is only an annotation by default'): _FORMAT,
    ('draft2020-12/format.json', 'uuid format', 'invalid uuid string is only an annotation by default'): _FORMAT,
    ('draft2020-12/format.json', 'duration format', 'invalid duration string is only an annotation by default'): _FORMAT,
    ('draft2020-12/oneOf.json', 'oneOf with boolean schemas, all false'): _UNSAT,
    ('draft2020-12/pattern.json', 'pattern with Unicode property escape requires unicode mode'): _UNICODE_PROP,
    ('draft2020-12/patternProperties.json', 'multiple simultaneous patternProperties are validated'): _PATPROPS,
    ('draft2020-12/patternProperties.json', 'regexes are not anchored by default and are case sensitive'): _PATPROPS,
    ('draft2020-12/patternProperties.json', 'patternProperties with boolean schemas'): _PATPROPS,
    ('draft2020-12/patternProperties.json', 'patternProperties with Unicode property escape'): _UNICODE_PROP,
    ('draft2020-12/ref.json', '$ref to boolean schema false'): _UNSAT,
    ('draft2020-12/type.json', 'integer type matches integers', 'a float with zero fractional part is an integer'): _INT_FLOAT,
    ('draft2020-12/unevaluatedProperties.json', 'unevaluatedProperties with $ref', 'with no unevaluated properties'): _REF_ORDER,
    ('draft2020-12/vocabulary.json', 'schema that uses custom metaschema with with no validation vocabulary'): _REMOTE,
    ('draft2020-12/vocabulary.json', 'ignore unrecognized optional vocabulary'): _REMOTE,
    ('draft7/allOf.json', 'allOf with boolean schemas, some false'): _UNSAT,
    ('draft7/allOf.json', 'allOf with boolean schemas, all false'): _UNSAT,
    ('draft7/anyOf.json', 'anyOf with boolean schemas, all false'): _UNSAT,
    ('draft7/boolean_schema.json', "boolean schema 'false'"): _UNSAT,
    ('draft7/const.json', 'const with object', 'same object with different property order is valid'): _CONST_ORDER,
    ('draft7/const.json', 'const with 0 does not match other zero-like types', 'float zero is valid'): _INT_FLOAT,
    ('draft7/const.json', 'const with 1 does not match true', 'float one is valid'): _INT_FLOAT,
    ('draft7/const.json', 'const with -2.0 matches integer and float types', 'float -2.0 is valid'): _INT_FLOAT,
    ('draft7/const.json', 'float and integers are equal up to 64-bit representation limits', 'float is valid'): _INT_FLOAT,
    ('draft7/enum.json', 'enum with 0 does not match false', 'float zero is valid'): _INT_FLOAT,
    ('draft7/enum.json', 'enum with [0] does not match [false]', '[0.0] is valid'): _INT_FLOAT,
    ('draft7/enum.json', 'enum with 1 does not match true', 'float one is valid'): _INT_FLOAT,
    ('draft7/enum.json', 'enum with [1] does not match [true]', '[1.0] is valid'): _INT_FLOAT,
    ('draft7/oneOf.json', 'oneOf with boolean schemas, all false'): _UNSAT,
    ('draft7/patternProperties.json', 'multiple simultaneous patternProperties are validated'): _PATPROPS,
    ('draft7/patternProperties.json', 'regexes are not anchored by default and are case sensitive'): _PATPROPS,
    ('draft7/patternProperties.json', 'patternProperties with boolean schemas'): _PATPROPS,
    ('draft7/ref.json', 'ref overrides any sibling keywords', 'ref valid, maxItems ignored'): _DRAFT7_REF,
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


def _produce(backend: GrammarBackend, compiled: Any, tokenizer: Any, text: str) -> bool:
    """Walk `text` token by token; True if the matcher accepts all of it and then EOS.

    Also checks at every step that a token the mask allows is accepted (the mask may be stricter than accept():
    where the grammar forces bytes, llguidance offers only their canonical tokenization).
    """
    matcher = backend.matcher(compiled)
    bitmask = allocate_token_bitmask(1, backend.vocab_size)
    for token in _encode(tokenizer, text) + [tokenizer.eos_token_id]:
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
        for test in group["tests"]:
            texts = dict.fromkeys([json.dumps(test["data"], separators=(",", ":"), ensure_ascii=False), json_text(test["data"], group["schema"])])
            produced = any(_produce(backend, compiled, tokenizer, t) for t in texts)
            kind = "valid" if test["valid"] else "invalid"
            good = produced == test["valid"]
            counts[f"{kind} instances"] += 1
            counts[f"{kind} {'accepted' if test['valid'] else 'rejected'}"] += good
            if not good:
                key = (file, desc, test["description"])
                if _listed(*key):
                    note(key)
                else:
                    failures.append(f"{kind} instance {'refused' if test['valid'] else 'produced'}: {key!r} {list(texts)[0]}")
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
