"""JSON-Schema walking and lowering: rewrite a schema into a form the grammar library accepts.

`iter_subschemas` is the one walk over a schema; every other function here (and the guard's anchor discovery)
is a loop over it. Values of `DATA_KEYWORDS` are instances, not subschemas, and are never walked into.
"""

from __future__ import annotations

import copy
import itertools
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

__all__ = [
    "DATA_KEYWORDS", "CompileTimeout", "check_deadline", "deadline", "iter_subschemas", "all_keys", "contains_key",
    "drop_keyword", "lower",
]

DATA_KEYWORDS = ("enum", "const", "default", "examples")  # values, not subschemas
_INTEGER_KEYWORDS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties", "minContains", "maxContains")


class CompileTimeout(Exception):
    """Raised inside a compilation that ran past its deadline (see `deadline`)."""


_local = threading.local()


@contextmanager
def deadline(seconds: float | None) -> Iterator[None]:
    """Within this block, `check_deadline` (called by every schema walk) raises CompileTimeout once `seconds`
    have passed: the cooperative cancellation of our own Python passes over a schema (lowering, anchors)."""
    previous = getattr(_local, "deadline", None)
    _local.deadline = None if seconds is None else time.monotonic() + seconds
    try:
        yield
    finally:
        _local.deadline = previous


def check_deadline() -> None:
    limit = getattr(_local, "deadline", None)
    if limit is not None and time.monotonic() > limit:
        raise CompileTimeout("the compilation ran past its time limit")


# children(node) -> (path steps, child) pairs; see `iter_subschemas`.
Children = Callable[[dict[str, Any]], Iterable[tuple[tuple[Any, ...], Any]]]


def _all_children(node: dict[str, Any]) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every value outside DATA_KEYWORDS, lists flattened; steps are JSON-pointer parts (keys, list indices)."""
    for key, value in node.items():
        if key not in DATA_KEYWORDS:
            yield from _flatten((key,), value)


def _flatten(steps: tuple[Any, ...], value: Any) -> Iterator[tuple[tuple[Any, ...], Any]]:
    if isinstance(value, list):
        for i, item in enumerate(value):
            yield from _flatten(steps + (i,), item)
    else:
        yield steps, value


def iter_subschemas(schema: Any, children: Children = _all_children, *,
                    max_depth: int | None = None) -> Iterator[tuple[dict[str, Any], tuple[Any, ...]]]:
    """(node, path) for every object reached from `schema`, depth first, in document order.

    By default every value outside DATA_KEYWORDS is walked (including mappings such as `properties` itself) and
    `path` is the node's location in the schema. A caller may pass `children` to walk other edges (the guard
    walks instance paths); a (node, path) pair reached twice is yielded once, nodes deeper than `max_depth`
    hops are skipped. A node's children are read after the caller resumes the generator, so the caller may
    edit the node it was just given (what `lower` does) and the walk sees the edited node.
    """
    seen: set[tuple[int, tuple[Any, ...]]] = set()
    stack: list[tuple[Any, tuple[Any, ...], int]] = [(schema, (), 0)]
    visited = 0
    while stack:
        visited += 1
        if visited & 255 == 0:
            check_deadline()
        node, path, depth = stack.pop()
        if not isinstance(node, dict) or (max_depth is not None and depth > max_depth) or (id(node), path) in seen:
            continue
        seen.add((id(node), path))
        yield node, path
        stack.extend(reversed([(child, path + steps, depth + 1) for steps, child in children(node)]))


def all_keys(schema: Any) -> set[str]:
    """Every keyword used anywhere in a schema (property names included; only used for over-reporting)."""
    return {key for node, _ in iter_subschemas(schema) for key in node}


def contains_key(schema: Any, key: str) -> bool:
    return any(key in node for node, _ in iter_subschemas(schema))


def drop_keyword(schema: Any, keyword: str) -> Any:
    """A copy of `schema` without `keyword` anywhere (outside data values)."""
    schema = copy.deepcopy(schema)
    for node, _ in iter_subschemas(schema):
        node.pop(keyword, None)
    return schema


def exact_name_regex(name: str) -> str:
    """A regex matching exactly the string `name` (in the library's regex syntax: every metacharacter escaped)."""
    return "^" + "".join("\\" + c if c in _REGEX_META else c for c in name) + "$"


_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")
# Keywords of an expanded object that stay on it rather than move into its anyOf branches (`lower`'s `expand`).
_STAY_OUTSIDE = frozenset({"$defs", "definitions", "$schema", "$id", "id", "$anchor", "$dynamicAnchor", "$comment",
                           "title", "description", "examples", "default"})


def lower(schema: Any, regex_ok: Callable[[str], bool], dropped: list[str], relax: Iterable[int] = (),
          expand: Iterable[int] = ()) -> Any:
    """Rewrite `schema` into a form the library takes, without changing which instances are valid, except where
    noted in `dropped` (then the guard re-checks):

    * the root schema `true` becomes `{}`; counts written as 2.0 become 2 (same meaning in JSON Schema);
    * `minProperties`/`maxProperties` beside optional `properties` are removed (llguidance would count only the
      additional properties);
    * `pattern`s the library's regex engine rejects (look-around, back-references) are removed (over-
      approximation); a rejected patternProperties entry is removed, so its keys fall to additionalProperties
      (at worst an under-approximation, never an invalid instance);
    * the object subschemas whose ids are in `relax` (chosen by `guard.free_order_sites`) take their
      properties in any order: each declared property becomes an exact-name pattern property (llguidance fixes
      the order of `properties`, not of pattern properties) and `required` is removed; the guard refuses a
      repeated key and closes the object only with every required key (over-approximation, checked);
    * the (small, closed) object subschemas whose ids are in `expand` become the anyOf of their properties in
      every order (llguidance keeps each branch's order): any order, exactly, with no guard.
    """
    memo: dict[int, Any] = {}
    schema = {} if schema is True else copy.deepcopy(schema, memo)
    exact: set[str] = set()  # the exact-name regexes written here: every library takes them, no check needed
    for key in relax:
        node = memo.get(key)
        if isinstance(node, dict):
            props = node.pop("properties")
            node.pop("required", None)
            names = {exact_name_regex(name): sub for name, sub in props.items()}
            exact.update(names)
            node["patternProperties"] = {**names, **node.get("patternProperties", {})}
    for key in expand:
        node = memo.get(key)
        if isinstance(node, dict) and len(node.get("properties", ())) > 1:
            props = node.pop("properties")
            rest = {k: v for k, v in node.items() if k not in _STAY_OUTSIDE}   # definitions, ids stay where they are
            for moved in rest:
                del node[moved]
            node["anyOf"] = [{**rest, "properties": {name: props[name] for name in order}}
                             for order in itertools.permutations(props)]
    for node, _ in iter_subschemas(schema):
        for key in _INTEGER_KEYWORDS:
            value = node.get(key)
            if isinstance(value, float) and value.is_integer():
                node[key] = int(value)
        props = node.get("properties")
        if isinstance(props, dict) and props and ("minProperties" in node or "maxProperties" in node):
            required = node.get("required")
            if not isinstance(required, list) or not set(props) <= set(required):
                # llguidance counts only additional properties then, which can leave no way to close the object
                for key in ("minProperties", "maxProperties"):
                    if node.pop(key, None) is not None:
                        dropped.append(key)
        pattern = node.get("pattern")
        if isinstance(pattern, str) and not regex_ok(pattern):
            del node["pattern"]
            dropped.append("pattern (regex not supported by the library)")
        props = node.get("patternProperties")
        if isinstance(props, dict):
            for key in [k for k in props if k not in exact and not regex_ok(k)]:
                del props[key]
                dropped.append("patternProperties (regex not supported by the library)")
    return schema
