"""Helpers for the structured-output tests and benchmarks (not part of the package)."""
from __future__ import annotations

import json
import re
from typing import Any

from leapdecode.structured.guard import resolve_local_ref


def json_text(instance: Any, schema: Any = None, *, indent: int | None = None) -> str:
    """`instance` as JSON text with object keys in the order the schema declares them *at that instance
    location* (what `key_order="schema"` makes the grammar emit: declared `properties` in schema order, then any
    other keys as given). Compact separators by default; `indent=2` writes the indented form models are trained on.
    Non-ASCII is kept as is.

    The subschemas that apply at a location are followed through local `$ref`, `allOf`, `anyOf`, `oneOf`,
    `if`/`then`/`else`, `properties`, `patternProperties`, `additionalProperties`, `items` and `prefixItems`."""
    root = schema

    def expand(nodes: list[Any]) -> list[dict[str, Any]]:
        """The nodes and every subschema applying at the same location (ref, allOf, anyOf, ...), each once."""
        out: list[dict[str, Any]] = []
        seen: set[int] = set()
        stack = list(reversed(nodes))
        while stack:
            node = stack.pop()
            if not isinstance(node, dict) or id(node) in seen:
                continue
            seen.add(id(node))
            out.append(node)
            same_place: list[Any] = []
            if isinstance(node.get("$ref"), str):
                same_place.append(resolve_local_ref(root, node["$ref"]))
            for key in ("allOf", "anyOf", "oneOf"):
                if isinstance(node.get(key), list):
                    same_place += node[key]
            same_place += [node.get(k) for k in ("if", "then", "else")]
            stack.extend(reversed(same_place))
        return out

    def order(value: Any, nodes: list[Any]) -> Any:
        applicable = expand(nodes)
        if isinstance(value, dict):
            rank: dict[str, int] = {}
            for node in applicable:
                props = node.get("properties")
                if isinstance(props, dict):
                    for name in props:
                        rank.setdefault(name, len(rank))
            keys = sorted(enumerate(value), key=lambda ik: (rank.get(ik[1], len(rank)), ik[0]))
            out = {}
            for _, key in keys:
                inner: list[Any] = []
                for node in applicable:
                    props = node.get("properties")
                    if isinstance(props, dict) and key in props:
                        inner.append(props[key])
                        continue
                    patterns = node.get("patternProperties")
                    matched = [sub for pat, sub in (patterns.items() if isinstance(patterns, dict) else ())
                               if _search(pat, key)]
                    inner += matched or [node.get("additionalProperties")]
                out[key] = order(value[key], inner)
            return out
        if isinstance(value, list):
            items = []
            for i, item in enumerate(value):
                inner = []
                for node in applicable:
                    prefix = node.get("prefixItems")
                    legacy = node.get("items")
                    if isinstance(prefix, list) and i < len(prefix):
                        inner.append(prefix[i])
                    elif isinstance(legacy, list):
                        inner.append(legacy[i] if i < len(legacy) else node.get("additionalItems"))
                    else:
                        inner.append(legacy)
                items.append(order(item, inner))
            return items
        return value

    separators = (",", ":") if indent is None else (",", ": ")
    return json.dumps(order(instance, [schema]), separators=separators, indent=indent, ensure_ascii=False)


def _search(pattern: str, key: str) -> bool:
    try:
        return re.search(pattern, key) is not None
    except re.error:
        return False
