"""Helpers for the structured-output tests and benchmarks (not part of the package)."""
from __future__ import annotations

import json
from typing import Any

from leapdecode.structured.lowering import iter_subschemas


def json_text(instance: Any, schema: Any = None) -> str:
    """The JSON text our grammars produce for `instance`: compact separators, non-ASCII kept as is, and object
    keys in the order the schema declares them (llguidance emits declared `properties` in schema order, then
    any additional properties). Keys are ranked by their first appearance anywhere in the schema."""
    rank: dict[str, int] = {}
    for node, _ in iter_subschemas(schema):
        props = node.get("properties")
        if isinstance(props, dict):
            for name in props:
                rank.setdefault(name, len(rank))

    def order(value: Any) -> Any:
        if isinstance(value, dict):
            keys = sorted(enumerate(value), key=lambda ik: (rank.get(ik[1], len(rank)), ik[0]))
            return {k: order(value[k]) for _, k in keys}
        if isinstance(value, list):
            return [order(v) for v in value]
        return value

    return json.dumps(order(instance), separators=(",", ":"), ensure_ascii=False)
