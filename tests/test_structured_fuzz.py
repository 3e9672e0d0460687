"""Fuzz: random JSON schemas and instances, judged by `jsonschema`; the matcher must agree token by token.

For each generated schema the backend compiles (default output form: any key order, flexible whitespace), every
instance `jsonschema` calls valid must be producible (each token accepted, mask consistent, then EOS) written
compact and indented, with its keys in a random order; every invalid one must be refused in both forms.
Bounded (fixed seed, max_examples, no per-example deadline) so the file runs in well under a minute on a CPU.
"""
from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from test_structured_conformance import _produce, _schema_spec, backend, tokenizer  # noqa: E402,F401

NAMES = ["id", "name", "tags", "a", "b", "count", "x_y", "val"]


def _leaf() -> st.SearchStrategy[dict[str, Any]]:
    integer = st.fixed_dictionaries({"type": st.just("integer")}, optional={
        "minimum": st.integers(-5, 5), "maximum": st.integers(5, 50)})
    number = st.fixed_dictionaries({"type": st.just("number")}, optional={"minimum": st.integers(-3, 0)})
    string = st.fixed_dictionaries({"type": st.just("string")}, optional={
        "maxLength": st.integers(1, 6), "minLength": st.integers(0, 2)})
    enum = st.lists(st.one_of(st.integers(-3, 3), st.sampled_from(["red", "blue", "x y"]), st.booleans()),
                    min_size=1, max_size=4, unique_by=lambda v: (type(v), v)).map(lambda e: {"enum": e})
    return st.one_of(integer, number, string, enum, st.just({"type": "boolean"}), st.just({"type": "null"}))


def _container(inner: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    @st.composite
    def obj(draw: Any) -> dict[str, Any]:
        names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=4, unique=True))
        props = {n: draw(inner) for n in names}
        schema: dict[str, Any] = {"type": "object", "properties": props}
        required = [n for n in names if draw(st.booleans())]
        if required:
            schema["required"] = required
        extra = draw(st.sampled_from([None, False, {"type": "integer"}]))
        if extra is not None:
            schema["additionalProperties"] = extra
        if draw(st.integers(0, 5)) == 0:
            schema["propertyNames"] = {"maxLength": 4}
        return schema

    @st.composite
    def arr(draw: Any) -> dict[str, Any]:
        schema: dict[str, Any] = {"type": "array", "items": draw(inner)}
        if draw(st.booleans()):
            schema["maxItems"] = draw(st.integers(1, 4))
        if draw(st.booleans()):
            schema["uniqueItems"] = True
        return schema

    nullable = inner.map(lambda s: {"anyOf": [s, {"type": "null"}]})
    # allOf wrappers (merged into their holder where that means the same; an object intersected otherwise)
    joined = st.one_of(obj().map(lambda s: {"allOf": [s]}), obj().map(lambda s: {"allOf": [s, {"type": "object"}]}),
                       obj().map(lambda s: {"allOf": [s, {"required": sorted(s["properties"])[:1]}]}))
    return st.one_of(obj(), arr(), nullable, joined)


SCHEMAS = st.recursive(_leaf(), _container, max_leaves=6)


def _instance(schema: Any, rng: random.Random, depth: int = 0) -> Any:
    """A value shaped by the schema: usually valid, sometimes not (jsonschema decides which)."""
    if "enum" in schema:
        return rng.choice(schema["enum"])
    if "anyOf" in schema:
        return _instance(rng.choice(schema["anyOf"]), rng, depth)
    if "allOf" in schema:
        return _instance(schema["allOf"][0], rng, depth)
    kind = schema.get("type")
    if kind == "object":
        props = schema["properties"]
        out = {n: _instance(s, rng, depth + 1) for n, s in props.items() if rng.random() < 0.8}
        if rng.random() < 0.2:
            out["extra"] = rng.choice([1, "s"])
        keys = list(out)
        rng.shuffle(keys)  # any key order
        return {k: out[k] for k in keys}
    if kind == "array":
        return [_instance(schema["items"], rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == "integer":
        return rng.randint(-8, 60)
    if kind == "number":
        return rng.choice([0.5, -2.25, 3, 1e-3, -1.5e2])
    if kind == "string":
        return "".join(rng.choice("ab z") for _ in range(rng.randint(0, 7)))
    if kind == "boolean":
        return rng.random() < 0.5
    return None if rng.random() < 0.9 else 0


@settings(max_examples=100, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large])
@given(schema=SCHEMAS, seed=st.integers(0, 2**16))
def test_fuzz_schemas_agree_with_jsonschema(backend: Any, tokenizer: Any, schema: dict[str, Any], seed: int) -> None:
    try:
        compiled = backend.compile(_schema_spec(schema))
    except ValueError as e:
        pytest.fail(f"refused {json.dumps(schema)}: {e}")
    validator = jsonschema.Draft202012Validator(schema)
    rng = random.Random(seed)
    first = _instance(schema, random.Random(seed + 1))
    if validator.is_valid(first):  # along one valid instance: every token the mask allows is accepted
        _every_allowed_token_is_accepted(backend, compiled, tokenizer, json.dumps(first, indent=1))
    _agrees(backend, compiled, tokenizer, schema, schema, rng, 4)


def _agrees(backend: Any, compiled: Any, tokenizer: Any, schema: dict[str, Any], shape: Any, rng: random.Random,
            n: int) -> None:
    """n instances shaped by `shape` (usually valid, sometimes not), each produced exactly when `jsonschema` calls it
    valid against `schema`, written compact and indented."""
    validator = jsonschema.Draft202012Validator(schema)
    for _ in range(n):
        value = _instance(shape, rng)
        valid = validator.is_valid(value)
        for text in (json.dumps(value, separators=(",", ":")), json.dumps(value, indent=2)):
            produced = _produce(backend, compiled, tokenizer, text, check_mask=True)
            assert produced == valid, f"{'valid' if valid else 'invalid'} {text!r} for {json.dumps(schema)}"


def _every_allowed_token_is_accepted(backend: Any, compiled: Any, tokenizer: Any, text: str) -> None:
    from leapdecode.structured import allocate_token_bitmask, bitmask_to_bool

    matcher = backend.matcher(compiled)
    row = allocate_token_bitmask(1, backend.vocab_size)
    for token in tokenizer.encode(text, add_special_tokens=False):
        matcher.fill_bitmask(row, 0)
        allowed = bitmask_to_bool(row[0], backend.vocab_size).nonzero().flatten().tolist()
        for t in allowed:
            if t == tokenizer.eos_token_id:
                continue
            assert matcher.accept(t), f"mask allows {tokenizer.decode([t])!r} after {matcher.text!r}, accept refuses"
            matcher.rollback(1)
        if not matcher.accept(token):
            return


# Shared models: pydantic-style `$defs` objects used in several contexts of one schema (directly, as a union's
# branch, beside `{}` or scalars, in arrays, optional), where the guard's any-order rules depend on the context a
# model is reached through, not on the model alone (a model both in a union and alone at a fixed path once lost its
# required keys at the fixed path).
_CONTEXTS = [
    {"$ref": "#/$defs/m1"},
    {"anyOf": [{"$ref": "#/$defs/m1"}, {"$ref": "#/$defs/m2"}]},
    {"anyOf": [{"$ref": "#/$defs/m1"}, {}]},
    {"anyOf": [{"$ref": "#/$defs/m2"}, {"type": "string", "maxLength": 3}, {"type": "number"}]},
    {"type": "array", "items": {"$ref": "#/$defs/m1"}, "maxItems": 2},
    {"type": "array", "items": {"anyOf": [{"$ref": "#/$defs/m1"}, {"$ref": "#/$defs/m2"}]}, "maxItems": 2},
    {"anyOf": [{"$ref": "#/$defs/m2"}, {"type": "null"}]},
]


@st.composite
def _model(draw: Any) -> dict[str, Any]:
    names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=4, unique=True))
    schema: dict[str, Any] = {"type": "object", "properties": {n: draw(_leaf()) for n in names}}
    required = [n for n in names if draw(st.booleans())]
    if required:
        schema["required"] = required
    if draw(st.booleans()):
        schema["additionalProperties"] = False
    return schema


@st.composite
def _shared_models(draw: Any) -> dict[str, Any]:
    chosen = draw(st.lists(st.integers(0, len(_CONTEXTS) - 1), min_size=2, max_size=4, unique=True))
    props = {f"p{i}": _CONTEXTS[i] for i in chosen}
    schema = {"type": "object", "$defs": {"m1": draw(_model()), "m2": draw(_model())}, "properties": props,
              "additionalProperties": False}
    required = [k for k in props if draw(st.booleans())]
    if required:
        schema["required"] = required
    return schema


def _inlined(schema: Any, root: dict[str, Any]) -> Any:
    """The schema with its (non-recursive) local $refs replaced by their targets, for `_instance`."""
    if isinstance(schema, dict):
        if "$ref" in schema:
            return _inlined(root["$defs"][schema["$ref"].rsplit("/", 1)[1]], root)
        return {k: _inlined(v, root) for k, v in schema.items() if k != "$defs"}
    if isinstance(schema, list):
        return [_inlined(v, root) for v in schema]
    return schema


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large])
@given(schema=_shared_models(), seed=st.integers(0, 2**16))
def test_fuzz_shared_models_agree_with_jsonschema(backend: Any, tokenizer: Any, schema: dict[str, Any],
                                                  seed: int) -> None:
    compiled = backend.compile(_schema_spec(schema))
    _agrees(backend, compiled, tokenizer, schema, _inlined(schema, schema), random.Random(seed), 6)


# Where models sit in real schemas beyond `_CONTEXTS` (session 20): a map's values, a pattern property's, below a
# key a union of closed objects tags, below a key every version of a document shares, through recursion, beside a
# redundant `type`, with keys that require keys and with conditionals. Each is a place where the grammar takes the
# model's keys in any order and the guard checks them.
_PLACES = [
    {"type": "object", "additionalProperties": {"$ref": "#/$defs/m1"}},
    {"type": "object", "patternProperties": {"^k": {"$ref": "#/$defs/m1"}}, "additionalProperties": False},
    {"oneOf": [{"type": "object", "properties": {"cat": {"$ref": "#/$defs/m1"}}, "required": ["cat"],
                "additionalProperties": False},
               {"type": "object", "properties": {"dog": {"$ref": "#/$defs/m2"}}, "required": ["dog"],
                "additionalProperties": False}]},
    {"oneOf": [{"type": "object", "properties": {"v": {"const": 1}, "m": {"$ref": "#/$defs/m1"}}, "required": ["v"],
                "additionalProperties": False},
               {"type": "object", "properties": {"v": {"const": 2}, "m": {"$ref": "#/$defs/m1"}, "n": {"type": "integer"}},
                "required": ["v"], "additionalProperties": False}]},
    {"$ref": "#/$defs/tree"},
    {"$ref": "#/$defs/m2", "type": "object"},
    {"type": "array", "items": {"$ref": "#/$defs/m1", "maxItems": 3}, "maxItems": 2},
    {"$ref": "#/$defs/expr"},
    {"type": "object", "properties": {"q": {"$ref": "#/$defs/m2"}, "n": {"type": "integer"}}, "required": ["n"],
     "patternProperties": {".+": {"type": ["object", "integer"]}}},
]


@st.composite
def _placed_models(draw: Any) -> dict[str, Any]:
    m1, m2 = draw(_model()), draw(_model())
    names = list(m1["properties"])
    if len(names) > 1 and draw(st.booleans()):
        m1["dependentRequired"] = {names[0]: [names[1]]}
    if len(names) > 1 and draw(st.booleans()):
        m2_names = list(m2["properties"])
        m2["allOf"] = [{"if": {"required": [m2_names[0]]}, "then": {"required": [m2_names[-1]]}}]
    tree = {"type": "object", "properties": {"m": {"$ref": "#/$defs/m1"},
                                             "kids": {"type": "array", "items": {"$ref": "#/$defs/tree"}, "maxItems": 2},
                                             "next": {"anyOf": [{"$ref": "#/$defs/tree"}, {"type": "null"}]}},
            "required": ["m"], "additionalProperties": False}
    expr = {"type": "object", "required": ["kind"], "oneOf": [   # a union of objects recursion reaches
        {"type": "object", "properties": {"kind": {"const": "leaf"}, "m": {"$ref": "#/$defs/m2"}},
         "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "pair"}, "l": {"$ref": "#/$defs/expr"},
                                          "r": {"$ref": "#/$defs/expr"}, "n": {"type": "integer"}},
         "additionalProperties": False}]}
    chosen = draw(st.lists(st.integers(0, len(_PLACES) - 1), min_size=1, max_size=3, unique=True))
    return {"type": "object", "$defs": {"m1": m1, "m2": m2, "tree": tree, "expr": expr},
            "properties": {f"p{i}": _PLACES[i] for i in chosen}, "additionalProperties": False}


def _placed_instance(schema: Any, root: dict[str, Any], rng: random.Random, depth: int = 0) -> Any:
    """`_instance` for `_placed_models`: follows $refs (recursion cut at a depth), writes map entries and keys a
    pattern property takes, picks a union branch."""
    if not isinstance(schema, dict):
        return None
    if "$ref" in schema:
        if depth > 4:
            return None
        return _placed_instance(root["$defs"][schema["$ref"].rsplit("/", 1)[1]], root, rng, depth + 1)
    if "const" in schema:
        return schema["const"]
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return _placed_instance(rng.choice(schema[key]), root, rng, depth + 1)
    if schema.get("type") == "object":
        out = {n: _placed_instance(s, root, rng, depth + 1) for n, s in schema.get("properties", {}).items()
               if rng.random() < 0.7}
        if isinstance(schema.get("additionalProperties"), dict):
            for i in range(rng.randint(0, 2)):
                out[f"e{i}"] = _placed_instance(schema["additionalProperties"], root, rng, depth + 1)
        for regex, sub in schema.get("patternProperties", {}).items():
            for i in range(rng.randint(0, 2)):
                out[f"k{i}"] = _placed_instance(sub, root, rng, depth + 1)
        if rng.random() < 0.1:
            out["extra"] = 1
        keys = list(out)
        rng.shuffle(keys)
        return {k: out[k] for k in keys}
    if schema.get("type") == "array":
        return [_placed_instance(schema["items"], root, rng, depth + 1) for _ in range(rng.randint(0, 2))]
    return _instance(schema, rng, depth)


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large])
@given(schema=_placed_models(), seed=st.integers(0, 2**16))
def test_fuzz_placed_models_agree_with_jsonschema(backend: Any, tokenizer: Any, schema: dict[str, Any],
                                                  seed: int) -> None:
    """Every instance is produced exactly when jsonschema calls it valid, compact and indented, and every token the
    mask allows along it is accepted (`_produce`)."""
    try:
        compiled = backend.compile(_schema_spec(schema))
    except ValueError as e:      # llguidance refuses a model no value satisfies (minLength > maxLength), even where
        assume("nsatisfiable" not in str(e))   # it is only a map's value; anything else is a failure
        raise
    validator = jsonschema.Draft202012Validator(schema)
    rng = random.Random(seed)
    valid_seen = 0
    for _ in range(6):
        value = _placed_instance(schema, schema, rng)
        valid = validator.is_valid(value)
        valid_seen += valid
        for text in (json.dumps(value, separators=(",", ":")), json.dumps(value, indent=2)):
            assert _produce(backend, compiled, tokenizer, text) == valid, \
                f"{'valid' if valid else 'invalid'} {text!r} for {json.dumps(schema)}"
