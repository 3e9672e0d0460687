"""JSON-Schema walking and lowering: rewrite a schema into a form the grammar library accepts.

`iter_subschemas` is the one walk over a schema; every other function here (and the guard's anchor discovery)
is a loop over it. Values of `DATA_KEYWORDS` are instances, not subschemas, and are never walked into.
"""

from __future__ import annotations

import json
import itertools
import re
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

__all__ = [
    "DATA_KEYWORDS", "CompileTimeout", "check_deadline", "deadline", "iter_subschemas", "all_keys",
    "drop_keyword", "lower", "prepared", "keyword_nodes", "LOCATIONS", "SHARED_PREFIX", "POINTED_PREFIX",
    "declared_only",
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


def iter_subschemas(schema: Any) -> Iterator[dict[str, Any]]:
    """Every object reached from `schema` (every value outside DATA_KEYWORDS, lists walked into), depth first,
    in document order, each once. A node's children are read after the caller resumes the generator, so the
    caller may edit the node it was just given (what `lower` does) and the walk sees the edited node."""
    seen: set[int] = set()
    maps: set[int] = set()      # the name -> subschema maps met so far: a property named "default" is walked
    stack: list[Any] = [schema]
    visited = 0
    while stack:
        node = stack.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        visited += 1
        if visited & 255 == 0:
            check_deadline()
        seen.add(id(node))
        yield node
        children: list[Any] = []
        names = id(node) in maps
        for key, value in node.items():
            if key in DATA_KEYWORDS and not names:
                continue
            if isinstance(value, dict):
                children.append(value)
                if key in _SCHEMA_MAPS and not names:
                    maps.add(id(value))
            elif isinstance(value, list):
                _collect(value, children)
        stack.extend(reversed(children))


def keyword_nodes(schema: Any) -> Iterator[dict[str, Any]]:
    """`iter_subschemas` without the maps from names to subschemas (`properties`, `$defs`, ...), whose keys are
    names, not keywords (a property named "minProperties" in JSON Schema's own meta-schema). The caller may edit
    the node it was just given, as with `iter_subschemas`."""
    maps: set[int] = set()
    for node in iter_subschemas(schema):
        if id(node) in maps:
            continue
        maps.update(id(node[key]) for key in _SCHEMA_MAPS if isinstance(node.get(key), dict))
        yield node


def _collect(items: list[Any], out: list[Any]) -> None:
    """The objects in a (possibly nested) list, in order."""
    for item in items:
        if isinstance(item, dict):
            out.append(item)
        elif isinstance(item, list):
            _collect(item, out)


def _copy(value: Any, copies: dict[int, Any]) -> Any:
    """A deep copy of a JSON value; `copies` maps id(original object) -> its copy (shared objects stay shared).
    (copy.deepcopy's generic dispatch was a fifth of a realistic schema's lowering.)"""
    if isinstance(value, dict):
        done = copies.get(id(value))
        if done is None:
            done = copies[id(value)] = {}
            for k, v in value.items():
                done[k] = _copy(v, copies)
        return done
    if isinstance(value, list):
        return [_copy(v, copies) for v in value]
    return value


def all_keys(schema: Any) -> set[str]:
    """Every keyword used anywhere in a schema (property names included; only used for over-reporting)."""
    return {key for node in iter_subschemas(schema) for key in node}


_OTHER_KEYS = frozenset({"additionalProperties", "unevaluatedProperties", "patternProperties"})
"""What an object schema may say about keys it does not declare (`declared_only` leaves such an object alone)."""


def declared_only(schema: Any) -> Any:
    """`schema` (edited in place and returned) with ``additionalProperties: false`` on every object that declares
    ``properties`` and says nothing of other keys, where that closes the object alone: what a strict request asks
    (OpenAI's ``strict`` schemas must say it; xgrammar's strict mode and llama.cpp assume it). An object whose
    meaning is joined with another subschema's keeps taking other keys, since closing it would refuse the keys the
    other declares: an ``allOf`` member or holder, a ``$ref`` beside other keywords and its target, a node with
    ``if``/``then``/``else`` or ``dependentSchemas`` and those subschemas, an ``anyOf``/``oneOf`` branch of an
    object that declares properties itself, and anything under ``not`` or ``if`` (closing there would widen what
    they refuse). Objects that declare no properties (``{"type": "object"}``) take any key, as before."""
    if not isinstance(schema, dict):
        return schema
    joined: set[int] = set()

    def join(node: Any) -> None:            # the node and the chain of local $refs it goes through
        while isinstance(node, dict) and id(node) not in joined:
            joined.add(id(node))
            ref = node.get("$ref")
            node = resolve_local_ref(schema, ref) if isinstance(ref, str) else None

    for node in keyword_nodes(schema):
        declares = isinstance(node.get("properties"), dict) or bool(node.keys() & _OTHER_KEYS)
        members = [m for m in node.get("allOf", ()) if isinstance(m, dict)] if isinstance(node.get("allOf"), list) \
            else []
        branches = [b for key in ("anyOf", "oneOf") if isinstance(node.get(key), list) for b in node[key]]
        dependent = node.get("dependentSchemas") if isinstance(node.get("dependentSchemas"), dict) else {}
        legacy = node.get("dependencies") if isinstance(node.get("dependencies"), dict) else {}
        partners = [*members, *(b for b in branches if declares), *(node.get(k) for k in ("then", "else")),
                    *dependent.values(), *(v for v in legacy.values() if isinstance(v, dict))]
        if "$ref" in node and node.keys() - ANNOTATIONS - LOCATIONS - {"$ref"}:
            partners.append(node)           # (join follows its $ref to the target)
        partners = [p for p in partners if isinstance(p, dict)]
        if partners or "if" in node:
            join(node)
            for partner in partners:
                join(partner)
        for key in ("not", "if"):
            if isinstance(node.get(key), dict):
                joined.update(id(n) for n in iter_subschemas(node[key]))
    for node in keyword_nodes(schema):
        props = node.get("properties")
        if id(node) not in joined and isinstance(props, dict) and props and not node.keys() & _OTHER_KEYS:
            node["additionalProperties"] = False
    return schema


def prepared(schema: Any, any_order: bool = True) -> Any:
    """`schema` as every later pass reads it (the free-order analysis, the lowering, the guard), edited in place
    and returned, in one walk:

    * in drafts 3 to 7 (`siblings_ignored_beside_ref`) the keywords beside a `$ref`, which those drafts ignore,
      are removed (llguidance would apply them; the guard's analysis would read them);
    * with `any_order` (objects will take their keys in any order), each object value of a `const` or `enum`
      becomes the object schema it stands for (every key required with its value, no other key; nested objects
      likewise): a grammar writes a constant as its text, keys in the schema's order, while spelled out its keys
      take any order like every other object's (`guard.free_order_sites`). Left as they are: constants beside
      other constraining keywords, and every constant of a schema that uses unevaluatedProperties/Items (the
      spelled-out keys would count as evaluated there);
    * with `any_order`, a `$ref` whose pointer goes through an object's `properties` is re-aimed (`_Reaimed`), so
      that the object can take its keys in any order (which moves its properties where the pointer no longer
      finds them);
    * with `any_order`, allOf members are merged into the subschema that holds them where that means the same
      (`_merge_all_of`), so that a closed object in an allOf can take its keys in any order.

    Before that walk, in a schema with root definitions, the definitions no `$ref` reaches are removed
    (`_prune_unreached`): every later pass, and the library, then read only what applies."""
    if not isinstance(schema, dict):
        return schema
    if "$defs" in schema or "definitions" in schema:
        _prune_unreached(schema)
    ref_alone = siblings_ignored_beside_ref(schema)
    if not ref_alone and not any_order:
        return schema
    constants: list[dict[str, Any]] = []
    through_properties: list[dict[str, Any]] = []
    joined: list[dict[str, Any]] = []
    unevaluated = nested_id = into_all_of = False
    for node in keyword_nodes(schema):
        ref = node.get("$ref")
        if isinstance(ref, str) and "/properties/" in ref:
            through_properties.append(node)
        into_all_of = into_all_of or isinstance(ref, str) and "/allOf/" in ref
        nested_id = nested_id or node is not schema and (isinstance(node.get("$id"), str)
                                                         or isinstance(node.get("id"), str))
        if ref_alone and isinstance(ref, str):
            for key in node.keys() - _BESIDE_REF:      # (removed before the walk reads the node's children)
                del node[key]
            continue
        unevaluated = unevaluated or any(key in node for key in _UNEVALUATED)
        if any_order and (isinstance(node.get("const"), dict) or isinstance(node.get("enum"), list)):
            constants.append(node)
        if any_order and isinstance(node.get("allOf"), list):
            joined.append(node)
    if not unevaluated:
        for node in constants:
            _spell_out(node)
        if not into_all_of:
            for node in reversed(joined):       # inner ones first
                _merge_all_of(node, schema)
    if any_order and through_properties and not nested_id:   # (below a nested $id, "#/..." means another document)
        _Reaimed(schema).run(through_properties)
    return schema


def _merge_all_of(node: dict[str, Any], root: dict[str, Any]) -> None:
    """`prepared`'s merge of allOf members into the node that holds them, in place, where that means the same:
    a member whose keywords are not the node's (or are `type`, intersected, and `required`, joined), with no
    keyword that reads its neighbours split from them (`_NEIGHBOURS`: properties with additionalProperties, items
    with prefixItems, ...) and nothing that names or points (`$ref`, `$id`, definitions). A member that is only a
    local `$ref` (and annotations) merges its target's keywords on the same terms (the target stays where it is,
    for its other references; its subschemas are shared, not copied). llguidance intersects an allOf, and a closed
    object intersected with anything (`{"allOf": [{closed object}, {"type": "object"}]}`, `{"allOf": [{"$ref":
    <closed object>}, {"required": [...]}]}`) must keep its keys in schema order (`guard._mixed_intersections`);
    merged, it is an object like any other."""
    members = node["allOf"]
    kept = []
    for original in members:
        member = original
        if isinstance(member, dict) and isinstance(member.get("$ref"), str) and member.keys() - ANNOTATIONS == {"$ref"}:
            target = resolve_local_ref(root, member["$ref"])
            if isinstance(target, dict) and target is not node and target is not root:
                member = target
        if not isinstance(member, dict) or not _mergeable(node, member):
            kept.append(original)
            continue
        for key, value in member.items():
            if key == "required" and "required" in node:
                node["required"] = list(dict.fromkeys([*node["required"], *value]))
            elif key == "type" and "type" in node:
                node["type"] = _type_meet(node["type"], value)
            elif key not in ANNOTATIONS or key not in node:
                node[key] = value
    if kept:
        node["allOf"] = kept
    else:
        del node["allOf"]


def _mergeable(node: dict[str, Any], member: dict[str, Any]) -> bool:
    if member.keys() & _NOT_MERGED:
        return False
    for key in member.keys() & node.keys():
        if key == "required":
            if not (isinstance(member[key], list) and isinstance(node[key], list)):
                return False
        elif key == "type":
            if not _type_meet(node[key], member[key]):
                return False
        elif key not in ANNOTATIONS:
            return False
    return not any(member.keys() & group and (node.keys() - {"allOf"}) & group for group in _NEIGHBOURS)


def _type_meet(a: Any, b: Any) -> Any:
    """The types both `type` values allow ("integer" within "number"), as a `type` value; None when none (or
    not plain type names)."""
    a = [a] if isinstance(a, str) else a
    b = [b] if isinstance(b, str) else b
    if not (isinstance(a, list) and isinstance(b, list) and all(isinstance(t, str) for t in [*a, *b])):
        return None
    both = [t for t in a if t in b or t == "integer" and "number" in b] + \
        [t for t in b if t == "integer" and "number" in a and t not in a]
    return (both[0] if len(both) == 1 else both) if both else None


_NOT_MERGED = frozenset({"$ref", "$id", "id", "$anchor", "$dynamicRef", "$dynamicAnchor", "$recursiveRef",
                         "$recursiveAnchor", "$defs", "definitions", "$schema", "unevaluatedProperties",
                         "unevaluatedItems"})
_NEIGHBOURS = (frozenset({"properties", "patternProperties", "additionalProperties"}),
               frozenset({"items", "prefixItems", "additionalItems"}), frozenset({"if", "then", "else"}),
               frozenset({"contains", "minContains", "maxContains"}))
"""Keywords whose meaning reads the others of their group in the same subschema."""


def _prune_unreached(root: dict[str, Any]) -> None:
    """Remove, in place, the entries of `$defs` / `definitions` that nothing reaches from the root: a schema cut
    from a large document (a SchemaStore file's one definition beside its hundreds) otherwise costs every pass a
    walk over all of them. Definitions are entered only through `$ref`s, and every node on a `$ref`'s pointer is
    kept. Left whole when a reference is not a plain local pointer (an anchor, another document, `$dynamicRef`)
    or a subschema names itself (`$id`, `$anchor`): what those reach is not found by following pointers."""
    reached: set[int] = set()
    kept: set[int] = set()
    maps: list[dict[str, Any]] = []
    names: set[int] = set()     # the maps of names to subschemas (`properties`, ...): a property named "examples"
    stack: list[Any] = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict) or id(node) in reached:
            continue
        reached.add(id(node))
        if len(reached) & 255 == 0:
            check_deadline()
        if id(node) in names:                   # a map: every value is a subschema
            stack.extend(node.values())
            continue
        for key, value in node.items():
            if key not in _PRUNE_SPECIAL:
                if isinstance(value, dict):
                    stack.append(value)
                    if key in _SCHEMA_MAPS:
                        names.add(id(value))
                elif isinstance(value, list):
                    stack.append(value)
            elif key == "$ref":
                path = _pointer_path(root, value) if "%" not in str(value) else None   # (%-escapes: not followed)
                if path is None:
                    return
                kept.update(map(id, path))
                stack.append(path[-1])
            elif key in _DEFINITIONS:
                if isinstance(value, dict):
                    maps.append(value)
            elif key in _NAMING or key == "$id" and node is not root or key == "id" and isinstance(value, str) \
                    and node is not root:
                return
    for defs in maps:
        for name in [name for name, sub in defs.items() if id(sub) not in reached and id(sub) not in kept]:
            del defs[name]


_NAMING = frozenset({"$anchor", "$dynamicAnchor", "$dynamicRef", "$recursiveRef", "$recursiveAnchor"})
_DEFINITIONS = frozenset({"$defs", "definitions"})
_PRUNE_SPECIAL = _NAMING | _DEFINITIONS | set(DATA_KEYWORDS) | {"$ref", "$id", "id"}
"""The keys `_prune_unreached` does more with than walk into (data values: nothing)."""


def _pointer_path(root: Any, ref: Any) -> list[Any] | None:
    """The nodes a local JSON pointer ("#/a/b") passes through, root first and its target last; None for any other
    reference (and for a pointer that leads nowhere)."""
    if ref == "#":
        return [root]
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return None
    path = [root]
    for part in ref[2:].split("/"):
        here = path[-1]
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(here, dict) and part in here:
            path.append(here[part])
        elif isinstance(here, list) and part.isdigit() and int(part) < len(here):
            path.append(here[int(part)])
        else:
            return None
    return path


def _add_definition(defs: dict[str, Any], prefix: str, n: int, sub: Any) -> tuple[str, int]:
    """Put `sub` in the root's `$defs` map `defs` under the first free name `prefix` + n, n + 1, ... (the user's
    own names stay); returns its pointer and the number after the one used."""
    while f"{prefix}{n}" in defs:
        n += 1
    defs[f"{prefix}{n}"] = sub
    return f"#/$defs/{prefix}{n}", n + 1


POINTED_PREFIX = "leapdecode-pointed-"
"""The names `_Reaimed` gives the subschemas it moves under the root's `$defs`."""


class _Reaimed:
    """Pointers through `properties` re-aimed: for a `$ref` such as SchemaStore's buildkite
    `{"$ref": "#/definitions/waitStep/properties/wait"}`, the property subschema it reaches moves under the root's
    `$defs`, a `$ref` to it takes its place, and every pointer into it is re-aimed there. Same instances, but the
    object (`waitStep`) is no longer pointed through, so `guard.free_order_sites` may let it take any key order,
    which it must refuse otherwise (the lowering turns `properties` into pattern properties). Repeated while a
    pointer still goes through some `properties` (a moved subschema may hold pointed ones). A pointer written
    with percent-escapes is left alone (its object keeps schema order)."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root

    def run(self, refs: list[dict[str, Any]]) -> None:
        defs = self.root.get("$defs", {})
        if not isinstance(defs, dict):
            return
        moved = 0
        while True:
            check_deadline()
            found = next((hit for node in refs if (hit := self._through(node["$ref"])) is not None), None)
            if found is None or moved >= 4096:
                return
            holder, name, prefix = found
            home, moved = _add_definition(self.root.setdefault("$defs", defs), POINTED_PREFIX, moved, holder[name])
            holder[name] = stand_in = {"$ref": home}
            for node in refs:
                ref = node["$ref"]
                if ref == prefix or ref.startswith(prefix + "/"):
                    node["$ref"] = home + ref[len(prefix):]
            refs.append(stand_in)

    def _through(self, ref: str) -> tuple[dict[str, Any], str, str] | None:
        """(the `properties` map, the name, the pointer's prefix up to that name) where `ref` first goes through
        an object's properties, else None. Tracks what each step lands on (a schema, a map of names to schemas,
        a list), so that a property named "properties" is a name, not the keyword."""
        if not ref.startswith("#/") or "%" in ref:
            return None
        parts = ref[2:].split("/")
        here, kind, map_of = self.root, "schema", None
        for i, raw in enumerate(parts):
            part = raw.replace("~1", "/").replace("~0", "~")
            if isinstance(here, list):
                if not part.isdigit() or int(part) >= len(here):
                    return None
                here, kind = here[int(part)], "schema"
                continue
            if not isinstance(here, dict) or part not in here:
                return None
            if kind == "map":
                if map_of == "properties":
                    return here, part, "#/" + "/".join(parts[:i + 1])
                here, kind = here[part], "schema"
            elif part in DATA_KEYWORDS:
                return None
            elif part in _SCHEMA_MAPS:
                here, kind, map_of = here[part], "map", part
            else:
                here = here[part]
        return None


def _spell_out(node: dict[str, Any]) -> None:
    """`prepared`'s rewrite of a constant object (see there), in place."""
    others = node.keys() - {"const", "enum", "type"} - ANNOTATIONS - LOCATIONS
    kind = node.get("type", "object")
    if others or not (kind == "object" or isinstance(kind, list) and "object" in kind):
        return
    if isinstance(node.get("const"), dict) and "enum" not in node:
        spelled = _object_schema(node.pop("const"))
    elif isinstance(node.get("enum"), list) and "const" not in node and any(isinstance(v, dict) for v in node["enum"]):
        values = node.pop("enum")
        rest = [v for v in values if not isinstance(v, dict)]
        spelled = {"anyOf": [_object_schema(v) for v in values if isinstance(v, dict)] + ([{"enum": rest}] if rest else [])}
    else:
        return
    node.pop("type", None)
    node.update(spelled)


def _object_schema(value: dict[str, Any]) -> dict[str, Any]:
    """The schema whose only instance is the JSON object `value` (up to key order, here and in the objects among
    its values)."""
    return {"type": "object", "additionalProperties": False, "required": list(value),
            "properties": {k: _object_schema(v) if isinstance(v, dict) else {"const": v} for k, v in value.items()}}


_UNEVALUATED = ("unevaluatedProperties", "unevaluatedItems")
LOCATIONS = frozenset({"$defs", "definitions", "$schema", "$id", "id", "$anchor", "$dynamicAnchor"})
"""Keywords that hold or name schemas without applying anything to the instance."""
_BESIDE_REF = frozenset({"$ref", "$schema", "$defs", "definitions"})
"""What stays beside a `$ref` in drafts 3 to 7: the locations pointers go through, and the draft's name."""


def drop_keyword(schema: Any, keyword: str) -> Any:
    """A copy of `schema` without `keyword` anywhere (outside data values; a property of that name stays)."""
    schema = _copy(schema, {})
    for node in keyword_nodes(schema):
        node.pop(keyword, None)
    return schema


_CATCH_ALL = {"": "", ".*": "", ".+": "+", "^.*$": "$", "^.+$": "+$"}
"""Pattern-property regexes that match every key (of at least one character: "+"; without a line break: "$")."""


def catch_all(patterns: Any) -> tuple[str, str] | None:
    """(the regex, its kind in `_CATCH_ALL`) when `patterns` (a patternProperties map) is one regex matching every
    key, with a subschema that joins no other (the names get both: llguidance intersects them), else None."""
    if isinstance(patterns, dict) and len(patterns) == 1:
        regex, sub = next(iter(patterns.items()))
        if regex in _CATCH_ALL and (sub is True or isinstance(sub, dict) and not sub.keys() & _JOINING):
            return regex, _CATCH_ALL[regex]
    return None


_JOINING = frozenset({"properties", "patternProperties", "additionalProperties", "required", "$ref", "allOf", "anyOf",
                      "oneOf", "not", "if", "then", "else", "$dynamicRef", "unevaluatedProperties"})
"""Keywords of a subschema that make its intersection with another more than a leaf's."""


def other_names_regex(names: list[str], kind: str = "") -> str:
    """A regex (no look-around: the library's syntax) matching every key but `names`; ``kind`` from `_CATCH_ALL`:
    "+" at least one character, "$" no line break. Built on the names' trie: at each node, a character that
    leaves it and anything after, or a child's character and what is not a name below it."""
    anychar, no_break = ("[^\\n]", "\\n") if "$" in kind else ("[\\s\\S]", "")
    trie: dict[str, Any] = {}
    for name in names:
        at = trie
        for c in name:
            at = at.setdefault(c, {})
        at[""] = {}                          # a name ends here

    def other(at: dict[str, Any], empty_ok: bool) -> str:
        firsts = [c for c in at if c]
        parts = [""] if empty_ok else []
        if firsts:
            leave = "".join("\\" + c if c in "\\]^-[" else c for c in firsts)
            parts.append(f"[^{leave}{no_break}]{anychar}*")
        else:
            parts.append(f"{anychar}+")
        parts += [_literal(c) + other(at[c], "" not in at[c]) for c in firsts]
        return "(?:" + "|".join(parts) + ")"
    return "^" + other(trie, "+" not in kind and "" not in trie) + "$"


def names_regex(names: list[str]) -> str:
    """A regex matching exactly the strings `names` (in the library's regex syntax: every metacharacter escaped)."""
    if len(names) == 1:
        return "^" + _literal(names[0]) + "$"
    return "^(?:" + "|".join(_literal(name) for name in names) + ")$"


def _by_subschema(props: dict[str, Any]) -> list[tuple[list[str], Any]]:
    """The properties grouped by equal subschemas, in first-appearance order. llguidance checks every pair of
    pattern properties for disjointness (quadratic: 64 exact names cost ~25 ms to compile, ~1 ms as the
    alternation they are when their values share one subschema), so names sharing a subschema share a regex."""
    groups: dict[str, tuple[list[str], Any]] = {}
    for name, sub in props.items():
        key = json.dumps(_meaning(sub), sort_keys=True)
        groups.setdefault(key, ([], sub))[0].append(name)
    return list(groups.values())


def _meaning(node: Any, names: bool = False) -> Any:
    """A subschema without its annotations (descriptions differ where the constraints do not); `names`: `node` is
    a map from names to subschemas (`properties`, `$defs`, ...), whose keys are not keywords."""
    if isinstance(node, list):
        return [_meaning(item) for item in node]
    if not isinstance(node, dict):
        return node
    if names:
        return {key: _meaning(sub) for key, sub in node.items()}
    return {key: value if key in DATA_KEYWORDS else _meaning(value, key in _SCHEMA_MAPS)
            for key, value in node.items() if key not in ANNOTATIONS}


def _literal(text: str) -> str:
    """`text` as a regex matching it literally (every metacharacter escaped)."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


ONE_OF = "oneOf (compiled as anyOf)"
"""The note `lower` leaves in `dropped` for a schema using oneOf: the library's lenient mode takes it as anyOf."""
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
"""Keywords whose value maps names (or regexes) to subschemas."""
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                         "writeOnly", "markdownDescription"})
"""Keywords that constrain nothing."""
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")
# Keywords of an expanded object that stay on it rather than move into its anyOf branches (`lower`'s `expand`).
_STAY_OUTSIDE = LOCATIONS | {"$comment", "title", "description", "examples", "default"}


def lower(schema: Any, regex_ok: Callable[[str], bool], dropped: list[str], relax: Iterable[int] = (),
          expand: Iterable[int] = (), unions: Iterable[int] = (), compact: bool = True) -> Any:
    """Rewrite `schema` into a form the library takes, without changing which instances are valid, except where
    noted in `dropped` (then the guard re-checks):

    * `oneOf` is left for the library to take as `anyOf` (noted as `ONE_OF`);
    * the root schema `true` becomes `{}`; counts written as 2.0 become 2 (same meaning in JSON Schema);
    * `minProperties`/`maxProperties` beside optional `properties` are removed (llguidance would count only the
      additional properties);
    * `pattern`s the library's regex engine rejects (look-around, back-references) are removed (over-
      approximation); a rejected patternProperties regex loses its look-around groups (over-approximation), or,
      if that does not help, is removed, so its keys fall to additionalProperties (at worst an under-
      approximation, never an invalid instance);
    * the object subschemas whose ids are in `relax` (chosen by `guard.free_order_sites`) take their
      properties in any order: each declared property becomes an exact-name pattern property (llguidance fixes
      the order of `properties`, not of pattern properties) and `required` is removed; the guard refuses a
      repeated key and closes the object only with every required key (over-approximation, checked);
    * the (small, closed) object subschemas whose ids are in `expand` become the anyOf of their properties in
      every order (llguidance keeps each branch's order): any order, exactly, with no guard;
    * with `compact`, fewer and smaller pieces for the library to compile: a relaxed object's names that share a
      subschema share one pattern property (`_by_subschema`), and an expanded object's property subschemas are
      written once, under the root's `$defs` (`_Definitions`). Where llguidance intersects two relaxed objects
      (allOf, a `$ref` beside keywords) their groups differ and overlap, which it refuses, and it refuses a `$defs`
      entry no value satisfies that it takes in place: the adapter then lowers again without `compact`;
    * the unions of objects whose ids are in `unions` (anyOf/oneOf with relaxed branches) lose their own
      `required`: llguidance writes such keys first, before the branch's; the guard validates the whole union
      when its value closes (over-approximation, checked).
    """
    memo: dict[int, Any] = {}
    original = schema
    schema = {} if schema is True else _copy(schema, memo)
    nested_id = False    # an `$id` below the root changes what "#/..." means there (`_Definitions`)
    for node in iter_subschemas(original):         # keywords beside a $ref that change nothing (before a target
        for key in redundant_beside_ref(node, original):   # is rewritten below)
            copied = memo.get(id(node))
            if isinstance(copied, dict):
                copied.pop(key, None)
        nested_id = nested_id or node is not original and (isinstance(node.get("$id"), str)
                                                             or isinstance(node.get("id"), str))
    exact: set[str] = set()  # the exact-name regexes written here: every library takes them, no check needed
    # the copies in document order (`relax` and `expand` are sets of ids: their own order changes from run to run)
    rank = {key: i for i, key in enumerate(memo)}
    relaxed: list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = []   # (node, its names, other patterns)
    for key in sorted(relax, key=lambda key: rank.get(key, -1)):
        node = memo.get(key)
        if isinstance(node, dict):
            props = node.pop("properties")
            node.pop("required", None)
            patterns = node.get("patternProperties", {})
            catch = catch_all(patterns)
            if catch is not None:       # every name is matched by it too: apply both, and it takes the rest
                regex, every = catch
                extra = patterns[regex]
                props = {name: sub if extra in ({}, True) else {"allOf": [sub, extra]} for name, sub in props.items()}
                patterns = {other_names_regex(list(props), every): extra}
            relaxed.append((node, props, patterns))     # (their patterns are written below)
            # conditionals beside (or in an allOf member of) such an object: llguidance does not implement them
            # and drops them, but with them there it refused every key of the relaxed object (Ray's cluster
            # config `auth`); removed here, noted as dropped, checked by the guard as before
            members = node.get("allOf") if isinstance(node.get("allOf"), list) else []
            for holder in [node, *(m for m in members if isinstance(m, dict))]:
                for conditional in ("if", "then", "else"):
                    if holder.pop(conditional, None) is not None:
                        dropped.append(conditional)
            if members:     # and the members left holding nothing go (joined to them, the object refused every key)
                kept = [m for m in members if not isinstance(m, dict) or m.keys() - ANNOTATIONS]
                if kept:
                    node["allOf"] = kept
                else:
                    del node["allOf"]
    for key in unions:
        node = memo.get(key)
        if isinstance(node, dict):
            node.pop("required", None)
    # (below a nested $id "#/..." means another document: nothing is moved then)
    shared = _Definitions(schema) if compact and not nested_id else None
    for key in sorted(expand, key=lambda key: rank.get(key, -1)):
        node = memo.get(key)
        if isinstance(node, dict) and len(node.get("properties", ())) > 1:
            props = node.pop("properties")
            if shared is not None:
                props = {name: shared.ref(sub) for name, sub in props.items()}
            rest = {k: v for k, v in node.items() if k not in _STAY_OUTSIDE}   # definitions, ids stay where they are
            for moved in rest:
                del node[moved]
            node["anyOf"] = [{**rest, "properties": {name: props[name] for name in order}}
                             for order in itertools.permutations(props)]
    # the relaxed objects' names as patterns; compact: names sharing a subschema share one, judged once every
    # rewrite above is done (the subschemas' final forms: a relaxed object and an equal one kept in order differ),
    # inner objects before the ones holding them
    for node, props, patterns in reversed(relaxed):
        groups = _by_subschema(props) if compact else [([name], sub) for name, sub in props.items()]
        names = {names_regex(group): sub for group, sub in groups}
        exact.update(names)
        node["patternProperties"] = {**names, **patterns}
    for node in keyword_nodes(schema):
        if "oneOf" in node and ONE_OF not in dropped:
            dropped.append(ONE_OF)
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
                sub = props.pop(key)
                wider = without_lookaround(key)
                if wider != key and wider not in props and regex_ok(wider):
                    # the keys the regex finds, and some more: AWS tags' "^(?!aws:)[a-zA-Z+-=._:/]{1,128}$" fell to
                    # additionalProperties false, and no tag could be written (the guard checks the real regex)
                    props[wider] = sub
                    dropped.append("patternProperties (look-around removed for the library)")
                else:
                    dropped.append("patternProperties (regex not supported by the library)")
    return schema


SHARED_PREFIX = "leapdecode-shared-"
"""The names `_Definitions` gives the subschemas it moves under the root's `$defs`."""


class _Definitions:
    """Subschemas moved to the root's `$defs` and referenced, so that a subschema written in several places (the
    branches of an expanded object) reaches the library once: llguidance compiles a `$ref` target once, a
    subschema each time it is written (the six orders of three properties compiled each property six times)."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.refs: dict[int, dict[str, str]] = {}

    def ref(self, sub: Any) -> Any:
        if not isinstance(sub, dict) or not sub.keys() - {"$ref"} - ANNOTATIONS:
            return sub
        known = self.refs.get(id(sub))
        if known is None:
            pointer, _ = _add_definition(self.root.setdefault("$defs", {}), SHARED_PREFIX, len(self.refs), sub)
            known = self.refs[id(sub)] = {"$ref": pointer}
        return dict(known)


def without_lookaround(regex: str) -> str:
    """`regex` without its look-around groups ((?=...), (?!...), (?<=...), (?<!...)): a regex matching every string
    it matches (a look-around only restricts), in the syntax of regex engines that have none (Rust's)."""
    out: list[str] = []
    i, n, in_class = 0, len(regex), False
    while i < n:
        c = regex[i]
        if c == "\\":
            out.append(regex[i:i + 2])
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if regex[i + 1:i + 2] == "]":   # a "]" first in a class is literal
                out.append("[]")
                i += 2
                continue
        elif c == "(" and (regex.startswith("(?=", i) or regex.startswith("(?!", i) or regex.startswith("(?<=", i)
                           or regex.startswith("(?<!", i)):
            depth, j, cls = 0, i, False
            while j < n:            # to the group's closing parenthesis
                d = regex[j]
                if d == "\\":
                    j += 2
                    continue
                if cls:
                    cls = d != "]"
                elif d == "[":
                    cls = True
                elif d == "(":
                    depth += 1
                elif d == ")":
                    depth -= 1
                    if depth == 0:
                        break
                j += 1
            i = j + 1
            continue
        out.append(c)
        i += 1
    return "".join(out)


def resolve_local_ref(root: Any, ref: str) -> Any:
    """Resolve "#/a/b" inside `root` (JSON pointer); None when it is not a plain local pointer."""
    path = _pointer_path(root, ref)
    return None if path is None else path[-1]


_ONLY_REFUSES = {
    **dict.fromkeys(("minLength", "maxLength", "pattern", "contentEncoding", "contentMediaType"), "string"),
    **dict.fromkeys(("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"), "number"),
    **dict.fromkeys(("properties", "required", "additionalProperties", "patternProperties", "minProperties",
                     "maxProperties", "propertyNames", "dependentRequired", "dependentSchemas", "dependencies",
                     "unevaluatedProperties"), "object"),
    **dict.fromkeys(("items", "prefixItems", "additionalItems", "contains", "minItems", "maxItems", "uniqueItems",
                     "minContains", "maxContains", "unevaluatedItems"), "array"),
}
"""Keywords that constrain values of one type only (a value of another type passes them)."""


def siblings_ignored_beside_ref(root: Any) -> bool:
    """Does the schema's draft ignore every keyword beside a `$ref` (drafts 3 to 7, by its `$schema`)? From
    2019-09 on they apply together with the reference, as llguidance always applies them."""
    declared = root.get("$schema") if isinstance(root, dict) else None
    return isinstance(declared, str) and re.search(r"json-schema\.org/draft-0[3-7]/schema", declared) is not None


def redundant_beside_ref(node: dict[str, Any], root: Any) -> set[str]:
    """The keywords beside a local $ref that change nothing: a `type` the target's already implies, and keywords
    for a type the target's `type` rules out (CloudFormation writes `{"$ref": "#/definitions/Tag", "maxItems":
    20}` as array items, `{"$ref": ..., "type": "object"}` everywhere). llguidance intersects a $ref with what is
    beside it, and the intersection of a closed object whose keys may come in any order with anything refused
    every key: dropped from the grammar, they leave the $ref alone (`lower`; `guard._joined` agrees)."""
    ref = node.get("$ref")
    target = resolve_local_ref(root, ref) if isinstance(ref, str) else None
    kinds = target.get("type") if isinstance(target, dict) else None
    if isinstance(kinds, str):
        kinds = [kinds]
    if not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds):
        return set()
    allowed = set(kinds) | ({"number"} if "integer" in kinds else set())
    out = set()
    for key, value in node.items():
        if key == "type":
            mine = {value} if isinstance(value, str) else set(value) if isinstance(value, list) else None
            if mine is not None and set(kinds) <= mine | ({"integer"} if "number" in mine else set()):
                out.add(key)
        elif _ONLY_REFUSES.get(key) is not None and _ONLY_REFUSES[key] not in allowed:
            out.add(key)
    return out
