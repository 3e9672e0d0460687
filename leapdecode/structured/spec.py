"""Parse and validate the `structured=` argument of `SamplingParams` into a normalized `StructuredSpec`.

The accepted shapes are exactly OpenAI's `response_format` plus three extras:

    {"type": "json_object"}
    {"type": "json_schema", "json_schema": {"name": str, "schema": {...}, "strict": bool, "description": str}}
    {"type": "regex", "regex": str}
    {"type": "grammar", "grammar": str}             # Lark (llguidance dialect) or GBNF/EBNF
    {"type": "choice", "choice": [str, ...]}

The JSON kinds also take two output-form options (defaults: every valid document is accepted):

    "whitespace": "flexible" (default: any JSON whitespace between tokens, e.g. indented JSON) | "compact"
    "key_order":  "any" (default: object properties in any order) | "schema" (declared properties first, in the
                  schema's order)

"compact" and "schema" narrow what the model may write beyond what the schema says (models are mostly trained
on indented JSON in free key order), which can lower answer quality; use them when the consumer needs that form.

``"strict": true`` (OpenAI's flag in the json_schema block) closes the schema's objects: an object that declares
``properties`` and says nothing of other keys takes only those (``lowering.declared_only``: what OpenAI requires a
strict schema to say with ``additionalProperties: false``, and what xgrammar's strict mode and llama.cpp assume).
Without it an object takes other keys wherever JSON Schema allows them (every valid document); small models given
an open object often invent keys.

Everything that can be checked without a tokenizer is checked here, so bad input fails at submission with a
ValueError that names the field; what only the grammar library can judge (regex syntax, grammar syntax,
unsupported schema features) fails in `GrammarBackend.compile`, also as a ValueError.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any, Literal

import jsonschema
import jsonschema.exceptions
import jsonschema.validators

SpecKind = Literal["json_object", "json_schema", "regex", "grammar", "choice"]

_KINDS: tuple[str, ...] = ("json_object", "json_schema", "regex", "grammar", "choice")
_FORM_KEYS = {"whitespace", "key_order"}
_WHITESPACE = ("flexible", "compact")
_KEY_ORDER = ("any", "schema")
_ALLOWED_KEYS: dict[str, set[str]] = {
    "json_object": {"type"} | _FORM_KEYS,
    "json_schema": {"type", "json_schema"} | _FORM_KEYS,
    "regex": {"type", "regex"},
    "grammar": {"type", "grammar"},
    "choice": {"type", "choice"},
}
# OpenAI: "a-z, A-Z, 0-9, or contain underscores and dashes, with a maximum length of 64".
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class StructuredSpec:
    """A normalized, hashable structured-output request.

    `text` is canonical (compact JSON for schemas, a sorted JSON list for choices) so that requests asking for
    the same constraint share one compiled grammar in the backend cache whatever their whitespace. Schema key
    order is preserved (with key_order="schema" it fixes the order of emitted properties).
    `whitespace` and `key_order` (JSON kinds only) choose the output form; see the module docstring.
    """

    kind: SpecKind
    text: str
    name: str | None = None
    strict: bool | None = None
    whitespace: str = "flexible"
    key_order: str = "any"

    @property
    def schema(self) -> dict[str, Any] | bool:
        """The JSON schema (json_object -> {"type": "object"}); only for the JSON kinds."""
        if self.kind == "json_object":
            return {"type": "object"}
        if self.kind != "json_schema":
            raise AttributeError(f"a {self.kind!r} spec has no schema")
        return json.loads(self.text)

    @property
    def choices(self) -> list[str]:
        if self.kind != "choice":
            raise AttributeError(f"a {self.kind!r} spec has no choices")
        return json.loads(self.text)

    @property
    def cache_key(self) -> tuple[str, ...]:
        """What determines the compiled grammar (not the name; strict closes the schema's objects)."""
        return (self.kind, self.text, self.whitespace, self.key_order, self.strict is True)


def parse_structured(structured: Any, *, check: bool = True) -> StructuredSpec:
    """Validate `structured` (a dict as above, or an already parsed spec) and normalize it.

    Raises ValueError naming the offending field; never returns a spec that is known to be unusable. With
    check=False the schema's meta-schema check (`check_spec`, the costly part) is left to the caller: the
    backend runs it only on a compile-cache miss.
    """
    if isinstance(structured, StructuredSpec):
        return structured
    if not isinstance(structured, dict):
        raise ValueError(f"structured must be a dict like {{'type': 'json_schema', ...}}, got {type(structured).__name__}")
    kind = structured.get("type")
    if kind not in _KINDS:
        raise ValueError(f"structured['type'] must be one of {', '.join(_KINDS)}; got {kind!r}")
    extra = set(structured) - _ALLOWED_KEYS[kind]
    if extra:
        raise ValueError(f"structured of type {kind!r} does not take the field(s) {sorted(extra)}")

    if kind in ("json_object", "json_schema"):
        form = _parse_form(structured)
        if kind == "json_object":
            return StructuredSpec("json_object", json.dumps({"type": "object"}), **form)
        spec = replace(_parse_json_schema(structured.get("json_schema")), **form)
        if check:
            check_spec(spec)
        return spec
    if kind in ("regex", "grammar"):
        text = structured.get(kind)
        if not isinstance(text, str) or not text:
            raise ValueError(f"structured[{kind!r}] must be a non-empty string, got {text!r:.80}")
        return StructuredSpec(kind, text)
    return _parse_choice(structured.get("choice"))


def _parse_form(structured: dict[str, Any]) -> dict[str, str]:
    whitespace = structured.get("whitespace", "flexible")
    if whitespace not in _WHITESPACE:
        raise ValueError(f"structured['whitespace'] must be one of {', '.join(_WHITESPACE)}; got {whitespace!r:.80}")
    key_order = structured.get("key_order", "any")
    if key_order not in _KEY_ORDER:
        raise ValueError(f"structured['key_order'] must be one of {', '.join(_KEY_ORDER)}; got {key_order!r:.80}")
    return {"whitespace": whitespace, "key_order": key_order}


def _parse_json_schema(block: Any) -> StructuredSpec:
    if not isinstance(block, dict):
        raise ValueError("structured['json_schema'] must be an object with 'name' and 'schema'")
    extra = set(block) - {"name", "schema", "strict", "description"}
    if extra:
        raise ValueError(f"structured['json_schema'] does not take the field(s) {sorted(extra)}")
    name = block.get("name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(
            "structured['json_schema']['name'] is required: 1-64 characters of a-z, A-Z, 0-9, '_' or '-'; "
            f"got {name!r:.80}"
        )
    strict = block.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ValueError(f"structured['json_schema']['strict'] must be a boolean, got {strict!r:.80}")
    if "schema" not in block:
        raise ValueError("structured['json_schema']['schema'] is required")
    schema = block["schema"]
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"structured['json_schema']['schema'] must be an object, got {type(schema).__name__}")
    # Key order is kept: property order in the schema is the order the grammar emits properties in.
    try:
        text = json.dumps(schema, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as e:
        raise ValueError(f"JSON schema is not JSON-serializable: {e}") from None
    return StructuredSpec("json_schema", text, name=name, strict=strict)


def check_spec(spec: StructuredSpec) -> None:
    """The meta-schema check of a json_schema spec (on its canonical form); nothing to do for other kinds."""
    if spec.kind == "json_schema":
        check_schema(spec.schema)


def check_schema(schema: dict[str, Any] | bool) -> None:
    """Check `schema` against its draft's meta-schema (by `$schema`, default 2020-12); ValueError on failure.

    Fast path: when the Rust validator `jsonschema_rs` is installed and `$schema` names a draft it bundles, it
    checks the meta-schema (~100x faster than jsonschema on large schemas) and Python's `re` compiles every
    `pattern` / `patternProperties` regex (the `format: regex` assertion). Anything it refuses, or cannot judge,
    goes to jsonschema's `check_schema`, which gives the error message."""
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    if _fast_check(schema, cls):
        return
    try:
        # includes `format: regex` on patterns, judged by `regex_compiles` (what the guard can evaluate)
        cls.check_schema(schema, format_checker=_meta_format_checker(cls))
    except jsonschema.exceptions.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise ValueError(f"invalid JSON schema at {where}: {e.message}") from None
    except (TypeError, RecursionError) as e:  # e.g. non-JSON values smuggled into the dict
        raise ValueError(f"invalid JSON schema: {e}") from None


def _fast_check(schema: Any, cls: Any) -> bool:
    """True when the schema certainly passes `cls.check_schema` (see `check_schema`); False: ask jsonschema."""
    if not isinstance(schema, dict):
        return False
    try:
        import jsonschema_rs
    except ImportError:
        return False
    declared = schema.get("$schema")
    meta_id = cls.META_SCHEMA.get("$id") or cls.META_SCHEMA.get("id", "")    # draft 4 says "id"
    if declared is not None and (not isinstance(declared, str) or declared.rstrip("#") != str(meta_id).rstrip("#")):
        return False  # only the bundled drafts: never let the fast validator fetch a meta-schema
    try:
        if not jsonschema_rs.meta.is_valid(schema):
            return False
    except Exception:  # noqa: BLE001 - whatever it cannot handle, jsonschema judges
        return False
    from leapdecode.structured.lowering import keyword_nodes

    for node in keyword_nodes(schema):     # (not the name maps: a property named "patternProperties")
        patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
        if isinstance(node.get("patternProperties"), dict):
            patterns += list(node["patternProperties"])
        if not all(regex_compiles(p) for p in patterns):
            return False
    return True


def regex_compiles(pattern: str) -> bool:
    """Can the guard evaluate this pattern? Python's `re`, or else the `regex` module (a superset that also
    knows Unicode property escapes such as `\\p{L}`, common in real schemas), when it is installed."""
    try:
        re.compile(pattern)
        return True
    except (re.error, RecursionError, TypeError, OverflowError):
        pass
    try:
        import regex
    except ImportError:
        return False
    try:
        regex.compile(pattern)
        return True
    except Exception:  # noqa: BLE001 - regex.error and friends
        return False


def _meta_format_checker(cls: Any) -> jsonschema.FormatChecker:
    """The meta-schema's format checker with `regex` judged by `regex_compiles`."""
    checker = jsonschema.FormatChecker(formats=())
    checker.checkers = dict(cls.FORMAT_CHECKER.checkers)
    checker.checkers["regex"] = (lambda instance: not isinstance(instance, str) or regex_compiles(instance), ())
    return checker


def _parse_choice(choice: Any) -> StructuredSpec:
    if not isinstance(choice, list) or not choice:
        raise ValueError(f"structured['choice'] must be a non-empty list of strings, got {choice!r:.80}")
    for i, c in enumerate(choice):
        if not isinstance(c, str) or not c:
            raise ValueError(f"structured['choice'][{i}] must be a non-empty string, got {c!r:.80}")
    # Order does not change the language; dedupe + sort so equal sets share a cache entry.
    return StructuredSpec("choice", json.dumps(sorted(set(choice))))
