"""Structured-output conformance and speed: leapdecode's backend beside raw llguidance, same schemas, same tokenizer,
one process, interleaved schema by schema.

Schema sets
  suite      the official JSON-Schema-Test-Suite (draft2020-12 + draft7, required and optional files) with its own
             valid / invalid instances.
  realistic  schemas collected from installed Python packages, never tuned to: configuration files
             (setuptools / distutils pyproject tables, schemathesis config), API specs (OpenAPI 2.0 / 3.0 /
             3.1 document schemas), AWS CloudFormation resource schemas (cfn-lint's provider data, a fixed
             stride sample), and function-calling / response schemas (pydantic `model_json_schema()` of the
             `openai` package's models). Their instances are generated from the schema by a small seeded
             generator and judged by `jsonschema` (valid ones are kept as valid, mutated ones that `jsonschema`
             refuses as invalid), so "valid" always means valid for `jsonschema`.
  schemastore  SchemaStore's schemas as vendored by the `check-jsonschema` package (CI configs, compose, renovate,
             GitHub workflows, ...: pip install check-jsonschema; skipped when absent), each whole and each of its
             definitions as a schema of its own (the document's definitions beside it), dense instances as below.
  dense      every schema of `realistic` with every CloudFormation resource (not a sample), plus the real-world
             schemas this machine holds elsewhere when present (CMake presets, Ray's cluster config, speedscope's
             file format, Rust's target spec, JSON Schema's own draft-4/7 meta-schemas); instances with most
             optional properties and one or two entries in each map (additionalProperties / patternProperties
             values), keys shuffled at every level: the objects where any key order is hard to offer.

Rows
  leapdecode         GrammarBackend defaults (guard on, flexible whitespace, any key order).
  leapdecode fixed   whitespace="compact", key_order="schema" (the narrowed form; for reference).
  llguidance         the library alone: `LLMatcher(grammar_from_json_schema(schema))` with its own defaults.

Columns
  compiled           schemas compiled (the rest refused with an error)
  (instance columns count the instances of the schemas that row compiled)
  valid compact      valid instances accepted token by token, then EOS, written compact with keys as given
  valid indented     the same written with indent=2
  invalid rejected   invalid instances refused (some token, or EOS), in both forms
  compile p50/p99    process CPU time per compilation (ours: spec check, meta-schema check, lowering,
                     llguidance, guard, the first-mask probe; llguidance: grammar + matcher construction)
  mask p50/p99       process CPU time of one mask row, over the tokens of the valid compact instances
  paired             mask times over only the valid compact instances that every row compiled and accepted whole
                     (the same schemas and the same tokens for each row: the fair comparison of cost)

Usage: python benchmarks/structured_backends.py [--tokenizer DIR] [--sets suite,realistic,dense,schemastore]
       [--limit N] [--failures FILE] [--by-schema N]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import pathlib
import random
import re
import statistics
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

torch.set_num_threads(1)

import jsonschema  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from leapdecode.structured.backend import GrammarBackend  # noqa: E402
from leapdecode.structured.lowering import iter_subschemas  # noqa: E402

DRAFTS = {"draft2020-12": "https://json-schema.org/draft/2020-12/schema", "draft7": "http://json-schema.org/draft-07/schema#"}


# ------------------------------------------------------------------------------------------------ schema sets
def suite_cases(suite: pathlib.Path) -> list[tuple[str, Any, list[tuple[Any, bool]]]]:
    cases = []
    for draft, meta in DRAFTS.items():
        for path in sorted((suite / "tests" / draft).rglob("*.json")):
            for group in json.loads(path.read_text()):
                schema = group["schema"]
                if isinstance(schema, dict) and "$schema" not in schema:
                    schema = {"$schema": meta, **schema}
                cases.append((f"{draft}/{path.name}", schema, [(t["data"], t["valid"]) for t in group["tests"]]))
    return cases


def _site_packages() -> list[str]:
    import site
    import sysconfig

    roots = {sysconfig.get_paths()["purelib"], *site.getsitepackages()}
    roots |= set(glob.glob("/root/.pyenv/versions/*/lib/python3*/site-packages"))
    return sorted(r for r in roots if os.path.isdir(r))


_ELSEWHERE = ["/usr/share/cmake-*/Help/manual/presets/schema.json", "ray/autoscaler/ray-schema.json",
              "ray/dashboard/client/build/speedscope-*/file-format-schema.json",
              "~/.rustup/toolchains/*/etc/target-spec-json-schema.json",
              "jsonschema_specifications/schemas/draft7/metaschema.json",
              "jsonschema_specifications/schemas/draft4/metaschema.json"]


def dense_schemas() -> list[tuple[str, Any]]:
    """`realistic` with every CloudFormation resource schema, and the schemas of `_ELSEWHERE` found here."""
    found = realistic_schemas(1 << 30)
    for pattern in _ELSEWHERE:
        roots = [""] if pattern.startswith(("/", "~")) else [r + "/" for r in _site_packages()]
        for path in sorted({p for r in roots for p in glob.glob(os.path.expanduser(r + pattern))})[:1]:
            try:
                found.append(("elsewhere: " + pattern,
                              json.loads(pathlib.Path(path).read_text())))
            except (OSError, ValueError):
                pass
    return found


def schemastore_schemas() -> list[tuple[str, Any]]:
    """SchemaStore's schemas vendored by check-jsonschema: each document, and each entry of its `definitions` /
    `$defs` as a schema that refers to it (`{"$ref": "#/definitions/x", "definitions": ...}`), as JSONSchemaBench
    cuts real-world documents into subschemas."""
    found: list[tuple[str, Any]] = []
    for root in _site_packages():
        paths = sorted(glob.glob(f"{root}/check_jsonschema/builtin_schemas/vendor/*.json"))
        if paths:
            break
    else:
        return found
    for path in paths:
        try:
            doc = json.loads(pathlib.Path(path).read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict):
            continue
        name = pathlib.Path(path).stem
        found.append((f"schemastore: {name}", doc))
        for key in ("definitions", "$defs"):
            defs = doc.get(key)
            if not isinstance(defs, dict):
                continue
            for entry in _self_contained(defs, key):
                found.append((f"schemastore: {name}#{entry}",
                              {k: doc[k] for k in ("$schema", "definitions", "$defs") if k in doc}
                              | {"$ref": f"#/{key}/{entry.replace('~', '~0').replace('/', '~1')}"}))
    return found


def _self_contained(defs: dict[str, Any], key: str) -> list[str]:
    """The entries of `defs` whose local `$ref`s, followed through `defs`, all stay inside it (a definition that
    refers to the document's root or its properties means something else once cut out)."""
    prefix = f"#/{key}/"
    direct = {}
    for entry, sub in defs.items():
        targets = set()
        for ref in (n["$ref"] for n in iter_subschemas(sub) if isinstance(n.get("$ref"), str)):
            if ref.startswith(prefix):
                targets.add(ref[len(prefix):].split("/")[0].replace("~1", "/").replace("~0", "~"))
            elif ref.startswith("#"):
                targets.add(None)       # the root or elsewhere in the document
        direct[entry] = targets
    out = []
    for entry, sub in defs.items():
        seen, todo, ok = set(), [entry], isinstance(sub, dict)
        while todo and ok:
            e = todo.pop()
            if e in seen:
                continue
            seen.add(e)
            if e is None or e not in direct:
                ok = False
            else:
                todo += direct[e]
        if ok:
            out.append(entry)
    return out


def realistic_schemas(limit_cfn: int) -> list[tuple[str, Any]]:
    found: list[tuple[str, Any]] = []
    seen: set[str] = set()

    def add(name: str, schema: Any) -> None:
        text = json.dumps(schema, sort_keys=True)
        if isinstance(schema, dict) and text not in seen:
            seen.add(text)
            found.append((name, schema))

    files = []
    for root in _site_packages():
        files += glob.glob(f"{root}/setuptools/config/*.schema.json")
        files += glob.glob(f"{root}/schemathesis/*/schema.json")
        files += sorted(glob.glob(f"{root}/openapi_spec_validator/resources/schemas/v*/schema.json"))
    for path in files:
        try:
            add("config/api: " + "/".join(pathlib.Path(path).parts[-3:]), json.loads(pathlib.Path(path).read_text()))
        except (OSError, ValueError):
            pass
    cfn: list[str] = []
    for root in _site_packages():
        cfn = sorted(glob.glob(f"{root}/cfnlint/data/schemas/resources/*.json"))
        if cfn:
            break
    stride = max(1, len(cfn) // max(limit_cfn, 1))
    for path in cfn[::stride][:limit_cfn]:
        try:
            schema = json.loads(pathlib.Path(path).read_text())
        except (OSError, ValueError):
            continue
        add(f"cloudformation: {schema.get('typeName', path)}", {k: v for k, v in schema.items() if k in (
            "type", "properties", "definitions", "required", "additionalProperties", "oneOf", "anyOf", "allOf")})
    try:
        import pydantic
        import openai.types as ot
        import openai.types.chat as oc

        for module in (ot, oc):
            for name in sorted(dir(module)):
                cls = getattr(module, name)
                if isinstance(cls, type) and issubclass(cls, pydantic.BaseModel):
                    try:
                        add(f"openai model: {name}", cls.model_json_schema())
                    except Exception:  # noqa: BLE001 - some models are not schema-able
                        pass
    except ImportError:
        pass
    return found


# --------------------------------------------------------------------------------------- instance generator
class _Gen:
    """A small seeded instance generator: usually valid values, judged afterwards by jsonschema."""

    def __init__(self, root: Any, rng: random.Random, optional: float = 0.4, maps: bool = False) -> None:
        """``optional``: how likely each optional property is written; ``maps``: write one or two entries in each
        map (additionalProperties, and patternProperties with a key one of a few candidates matches)."""
        self.root, self.rng, self.optional, self.maps = root, rng, optional, maps

    def resolve(self, ref: str) -> Any:
        node = self.root
        for part in ref[2:].split("/") if ref.startswith("#/") else []:
            part = part.replace("~1", "/").replace("~0", "~")
            node = node.get(part) if isinstance(node, dict) else None
        return node if ref.startswith("#") else None

    def value(self, s: Any, depth: int = 0) -> Any:
        rng = self.rng
        if not isinstance(s, dict) or depth > 6:
            return None if depth > 6 else rng.choice([1, "x", None])
        if "$ref" in s and isinstance(s["$ref"], str):
            target = self.resolve(s["$ref"])
            return self.value(target, depth + 1) if target is not None else None
        for key in ("examples",):
            if isinstance(s.get(key), list) and s[key] and rng.random() < 0.5:
                return rng.choice(s[key])
        if "const" in s:
            return s["const"]
        if isinstance(s.get("enum"), list) and s["enum"]:
            return rng.choice(s["enum"])
        for key in ("anyOf", "oneOf"):
            if isinstance(s.get(key), list) and s[key]:
                return self.value(rng.choice(s[key]), depth + 1)
        if isinstance(s.get("allOf"), list) and s["allOf"]:
            merged: dict[str, Any] = {}
            for sub in [s, *s["allOf"]]:
                sub = self.resolve(sub["$ref"]) if isinstance(sub, dict) and "$ref" in sub else sub
                if isinstance(sub, dict):
                    for k, v in sub.items():
                        if k == "properties":
                            merged.setdefault("properties", {}).update(v)
                        elif k == "required":
                            merged.setdefault("required", []).extend(v)
                        elif k != "allOf":
                            merged.setdefault(k, v)
            return self.value(merged, depth + 1)
        kind = s.get("type")
        if isinstance(kind, list):
            kind = rng.choice(kind) if kind else None
        if kind is None:
            kind = "object" if "properties" in s else "array" if "items" in s else rng.choice(["string", "integer"])
        if kind == "object":
            props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
            required = [r for r in s.get("required", []) if isinstance(r, str)]
            out = {}
            for name, sub in props.items():
                if name in required or rng.random() < self.optional:
                    out[name] = self.value(sub, depth + 1)
            for name in required:
                out.setdefault(name, "x")
            if self.maps:
                self._map_entries(s, props, out, depth)
            keys = list(out)
            rng.shuffle(keys)  # any key order
            return {k: out[k] for k in keys}
        if kind == "array":
            items = s.get("items")
            n = rng.randint(max(0, int(s.get("minItems", 0) or 0)), max(int(s.get("minItems", 0) or 0), 2))
            return [self.value(items if isinstance(items, dict) else {}, depth + 1) for _ in range(n)]
        if kind == "string":
            fmt = s.get("format")
            fixed = {"date-time": "2024-05-01T12:30:00Z", "date": "2024-05-01", "email": "a@example.com",
                     "uri": "https://example.com/x", "uuid": "123e4567-e89b-12d3-a456-426614174000",
                     "ipv4": "10.0.0.1", "hostname": "example.com", "duration": "P3DT4H", "time": "12:30:00Z",
                     "ipv6": "2001:db8::1", "uri-reference": "../x", "json-pointer": "/a/b", "regex": "^a+$"}
            if fmt in fixed:
                return fixed[fmt]
            lo = int(s.get("minLength", 0) or 0)
            hi = max(lo, min(int(s.get("maxLength", 8) or 8), lo + 8))
            return "".join(rng.choice("abcxyz_ 09") for _ in range(rng.randint(lo, hi)))
        if kind in ("integer", "number"):
            lo, hi = s.get("minimum", -20), s.get("maximum", 100)
            lo = lo if isinstance(lo, (int, float)) else -20
            hi = hi if isinstance(hi, (int, float)) and hi >= lo else lo + 100
            v = rng.randint(int(lo) if lo == int(lo) else int(lo) + 1, max(int(hi), int(lo) + 1) if hi > lo else int(lo))
            return v if kind == "integer" or rng.random() < 0.5 else v + 0.5 if v + 0.5 <= hi else v
        if kind == "boolean":
            return rng.random() < 0.5
        return None

    _KEYS = ("x", "a1", "key", "X", "foo_bar", "s_1", "n_1", "Ab", "AWS", "1", "x-y", "ab.cd")

    def _map_entries(self, s: dict[str, Any], props: dict[str, Any], out: dict[str, Any], depth: int) -> None:
        patterns = s.get("patternProperties") if isinstance(s.get("patternProperties"), dict) else {}
        extra = s.get("additionalProperties")
        if isinstance(extra, dict) and self.rng.random() < self.optional:
            for i in range(self.rng.randint(1, 2)):
                key = f"entry{i}"
                if key not in props and not any(_matches(p, key) for p in patterns):
                    out[key] = self.value(extra, depth + 1)
        for regex, sub in patterns.items():
            key = next((k for k in self._KEYS if k not in props and _matches(regex, k)
                        and not any(_matches(p, k) for p in patterns if p != regex)), None)
            if key is not None and self.rng.random() < self.optional:
                out[key] = self.value(sub, depth + 1)

    def mutate(self, value: Any) -> Any:
        rng = self.rng
        if isinstance(value, dict) and value and rng.random() < 0.7:
            key = rng.choice(list(value))
            choice = rng.random()
            out = dict(value)
            if choice < 0.3:
                del out[key]
            elif choice < 0.5:
                out["unexpected_key"] = 1
            else:
                out[key] = self.mutate(value[key])
            return out
        if isinstance(value, list) and value and rng.random() < 0.7:
            i = rng.randrange(len(value))
            return value[:i] + [self.mutate(value[i])] + value[i + 1 :]
        return rng.choice([{"x": 1}, [1], "str", 12345678, -1, True, None, 1.5])


def _matches(regex: str, key: str) -> bool:
    try:
        return re.search(regex, key) is not None
    except re.error:
        return False


def realistic_cases(limit_cfn: int, per_schema: int, seed: int = 0, dense: bool = False,
                    schemas: list[tuple[str, Any]] | None = None,
                    max_chars: int = 0) -> list[tuple[str, Any, list[tuple[Any, bool]]]]:
    """Generated instances of each schema; `max_chars`: keep only instances this short as compact JSON (the
    generator's recursion through a recursive schema can write megabytes)."""
    cases = []
    if schemas is None:
        schemas = dense_schemas() if dense else realistic_schemas(limit_cfn)
    for name, schema in schemas:
        try:
            cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
            validator = cls(schema)
        except Exception:  # noqa: BLE001
            continue
        gen = _Gen(schema, random.Random(f"{seed}:{name}"), optional=0.9 if dense else 0.4, maps=dense)
        valid, invalid = [], []
        for _ in range(12 * per_schema):
            try:
                value = gen.value(schema)
                ok = validator.is_valid(value)
                bad = gen.mutate(value)
                bad_ok = validator.is_valid(bad)
            except Exception:  # noqa: BLE001 - unresolvable refs etc.
                break
            if max_chars and len(json.dumps(value)) > max_chars:
                continue
            if ok and len(valid) < per_schema and value not in valid:
                valid.append(value)
            if not bad_ok and len(invalid) < per_schema and bad not in invalid:
                invalid.append(bad)
            if len(valid) >= per_schema and len(invalid) >= per_schema:
                break
        cases.append((name, schema, [(v, True) for v in valid] + [(v, False) for v in invalid]))
    return cases


# ------------------------------------------------------------------------------------------------- runners
class Ours:
    def __init__(self, name: str, tokenizer: Any, form: dict[str, str]) -> None:
        self.name, self.form = name, form
        self.backend = GrammarBackend(tokenizer, compile_timeout_s=30.0, cache_size=4096)
        self.eos = self.backend.eos_token_ids[0]
        self.bitmask = self.backend.allocate_bitmask(1)

    def compile(self, schema: Any) -> Any:
        return self.backend.compile({"type": "json_schema", "json_schema": {"name": "b", "schema": schema}, **self.form})

    def walk(self, compiled: Any, tokens: list[int], times: list[float] | None) -> bool:
        m = self.backend.matcher(compiled)
        for t in tokens:
            if times is not None:
                start = time.process_time()
                m.fill_bitmask(self.bitmask, 0)
                times.append(time.process_time() - start)
            if not m.accept(t):
                return False
        return m.accept(self.eos)


class RawLLGuidance:
    name = "llguidance (raw)"

    def __init__(self, tokenizer: Any) -> None:
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(tokenizer)
        self.eos = self.tok.eos_token
        self.bitmask = torch.zeros((self.tok.vocab_size + 31) // 32, dtype=torch.int32)

    def compile(self, schema: Any) -> Any:
        M = self.llg.LLMatcher
        matcher = M(self.tok, M.grammar_from_json_schema(json.dumps(schema)), log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def walk(self, compiled: Any, tokens: list[int], times: list[float] | None) -> bool:
        m = compiled.deep_copy()
        ptr, size = self.bitmask.data_ptr(), self.bitmask.numel() * 4
        for t in tokens:
            if times is not None:
                start = time.process_time()
                m.unsafe_compute_mask_ptr(ptr, size)
                times.append(time.process_time() - start)
            if m.try_consume_tokens([t]) != 1:
                return False
        return m.is_accepting() and m.consume_token(self.eos)


def measure(cases: list, runners: list, tokenizer: Any, mask_tokens_cap: int,
            failures: list[dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """Each runner on each case; `failures` collects the first runner's wrong answers (for --failures)."""
    stats = {r.name: {"compiled": 0, "valid_c": 0, "valid_i": 0, "invalid": 0, "valid_n": 0, "invalid_n": 0,
                      "compile": [], "mask": []} for r in runners}
    totals = {"schemas": len(cases), "valid": 0, "invalid": 0}
    for case, schema, instances in cases:
        totals["valid"] += sum(v for _, v in instances)
        totals["invalid"] += sum(not v for _, v in instances)
        encoded = []
        for value, valid in instances:
            forms = (json.dumps(value, separators=(",", ":"), ensure_ascii=False), json.dumps(value, indent=2, ensure_ascii=False))
            encoded.append(([tokenizer.encode(f, add_special_tokens=False) for f in forms], valid))
        walked: dict[str, list[tuple[bool, list[float]]]] = {}   # runner -> per valid instance: (accepted, mask times)
        for runner in runners:  # interleaved: every runner on this schema before the next schema
            st = stats[runner.name]
            start = time.process_time()
            try:
                compiled = runner.compile(schema)
            except Exception as e:  # noqa: BLE001 - a library crash counts as a refusal
                if failures is not None and runner is runners[0]:
                    failures.append({"name": case, "compile_error": str(e)[:300]})
                continue
            st["compile"].append(time.process_time() - start)
            st["compiled"] += 1
            for ((compact, indented), valid), (value, _) in zip(encoded, instances):
                times = [] if valid and len(compact) <= mask_tokens_cap else None
                got_c = runner.walk(compiled, compact, times)
                if times is not None:
                    st["mask"] += times
                    walked.setdefault(runner.name, []).append((got_c, times))
                got_i = runner.walk(compiled, indented, None)
                if failures is not None and runner is runners[0] and (got_c, got_i) != (valid, valid):
                    failures.append({"name": case, "valid": valid, "compact": got_c, "indented": got_i,
                                     "instance": value, "schema": schema})
                st["valid_n" if valid else "invalid_n"] += 1
                if valid:
                    st["valid_c"] += got_c
                    st["valid_i"] += got_i
                else:
                    st["invalid"] += not got_c and not got_i
        # paired: the instances every row compiled and accepted whole (so the same tokens were masked by each)
        if len(walked) == len(runners) and len({len(w) for w in walked.values()}) == 1:
            schema_rows: dict[str, list[float]] = {}    # runner -> this schema's paired mask times
            for i in range(len(next(iter(walked.values())))):
                if all(w[i][0] for w in walked.values()):
                    totals["paired"] = totals.get("paired", 0) + 1
                    for runner_name, w in walked.items():
                        stats[runner_name].setdefault("paired_mask", []).extend(w[i][1])
                        schema_rows.setdefault(runner_name, []).extend(w[i][1])
            if schema_rows:
                totals.setdefault("by_schema", []).append((case, schema_rows))
    return {"totals": totals, **stats}


def pct(n: int, d: int) -> str:
    return f"{n}/{d} ({100 * n / max(d, 1):.1f}%)"


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))] if xs else float("nan")


def table(title: str, result: dict[str, Any]) -> str:
    t = result["totals"]
    lines = [f"{title}: {t['schemas']} schemas, {t['valid']} valid + {t['invalid']} invalid instances", "",
             "| | compiled | valid accepted (compact) | valid accepted (indented) | invalid rejected | compile p50 / p99 ms | mask p50 / p99 µs |",
             "|---|---|---|---|---|---|---|"]
    for name, st in result.items():
        if name == "totals":
            continue
        lines.append(
            f"| {name} | {pct(st['compiled'], t['schemas'])} | {pct(st['valid_c'], st['valid_n'])} | "
            f"{pct(st['valid_i'], st['valid_n'])} | {pct(st['invalid'], st['invalid_n'])} | "
            f"{1e3 * quantile(st['compile'], 0.5):.2f} / {1e3 * quantile(st['compile'], 0.99):.1f} | "
            f"{1e6 * quantile(st['mask'], 0.5):.0f} / {1e6 * quantile(st['mask'], 0.99):.0f} |"
        )
    paired = [(name, st["paired_mask"]) for name, st in result.items() if name != "totals" and st.get("paired_mask")]
    if paired:
        lines += ["", f"Paired: the {t.get('paired', 0)} valid instances (compact) that every row compiled and "
                  "accepted whole, so each row masked the same tokens:", "",
                  "| | mask p50 / p99 µs | ratio to llguidance (raw) p50 / p99 |", "|---|---|---|"]
        base = dict(paired).get(RawLLGuidance.name)
        for name, xs in paired:
            ratio = (f"{quantile(xs, 0.5) / quantile(base, 0.5):.1f}x / {quantile(xs, 0.99) / quantile(base, 0.99):.1f}x"
                     if base else "-")
            lines.append(f"| {name} | {1e6 * quantile(xs, 0.5):.0f} / {1e6 * quantile(xs, 0.99):.0f} | {ratio} |")
    return "\n".join(lines)


def by_schema_table(result: dict[str, Any], top: int) -> str:
    """The ``top`` schemas by the ratio of our paired mask p50 to raw llguidance's on the same tokens."""
    rows = []
    for case, per_runner in result["totals"].get("by_schema", []):
        ours, base = per_runner.get("leapdecode"), per_runner.get(RawLLGuidance.name)
        if ours and base:
            rows.append((quantile(ours, 0.5) / quantile(base, 0.5), quantile(ours, 0.5), quantile(base, 0.5),
                         len(ours), case))
    rows.sort(reverse=True)
    lines = [f"Per schema ({len(rows)} with paired instances; median ratio "
             f"{statistics.median(r[0] for r in rows) if rows else float('nan'):.1f}x), the {top} dearest:", "",
             "| schema | ours p50 us | llguidance p50 us | ratio | rows |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r[4][:70]} | {1e6 * r[1]:.0f} | {1e6 * r[2]:.0f} | {r[0]:.1f}x | {r[3]} |" for r in rows[:top]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", default=str(ROOT.parent / "shared/bench/json_schema_test_suite"))
    parser.add_argument("--tokenizer", default=str(ROOT.parent / "shared/models/llama3-tokenizer"))
    parser.add_argument("--sets", default="suite,realistic")
    parser.add_argument("--limit", type=int, default=0, help="only the first N schemas of each set")
    parser.add_argument("--cfn", type=int, default=120, help="CloudFormation resource schemas to sample")
    parser.add_argument("--per-schema", type=int, default=3, help="valid and invalid instances per realistic schema")
    parser.add_argument("--mask-tokens-cap", type=int, default=400, help="time masks only on instances this short")
    parser.add_argument("--no-fixed", action="store_true", help="skip the compact + schema-order row")
    parser.add_argument("--json", default="", help="also write the raw numbers here")
    parser.add_argument("--failures", default="", help="write leapdecode's refusals and wrong answers here (jsonl)")
    parser.add_argument("--by-schema", type=int, default=0,
                        help="also list the N schemas whose paired mask p50 is dearest against raw llguidance's")
    args = parser.parse_args()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(args.tokenizer)
    runners: list[Any] = [Ours("leapdecode", tokenizer, {})]
    if not args.no_fixed:
        runners.append(Ours("leapdecode fixed (compact, schema order)", tokenizer, {"whitespace": "compact", "key_order": "schema"}))
    runners.append(RawLLGuidance(tokenizer))
    print(f"tokenizer {args.tokenizer} (vocab {runners[0].backend.vocab_size}); CPU, torch threads 1; "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}", flush=True)
    out = {}
    failures: list[dict[str, Any]] = []
    for name in args.sets.split(","):
        if name == "suite":
            cases = suite_cases(pathlib.Path(args.suite))
        elif name == "schemastore":
            cases = realistic_cases(0, args.per_schema, dense=True, schemas=schemastore_schemas(), max_chars=20000)
        else:
            cases = realistic_cases(args.cfn, args.per_schema, dense=name == "dense")
        if args.limit:
            cases = cases[: args.limit]
        started = time.time()
        result = measure(cases, runners, tokenizer, args.mask_tokens_cap, failures)
        out[name] = result
        title = ("JSON-Schema-Test-Suite draft2020-12 + draft7 (incl. optional/)" if name == "suite"
                 else "Realistic schemas (configs, API specs, CloudFormation, openai pydantic models)" if name == "realistic"
                 else "SchemaStore's schemas (check-jsonschema's vendored copies), whole and by definition, dense"
                 if name == "schemastore"
                 else "Dense instances of every realistic schema and the real-world schemas found on this machine")
        print(table(title, result) + f"\n({time.time() - started:.0f} s)\n", flush=True)
        if args.by_schema:
            print(by_schema_table(result, args.by_schema) + "\n", flush=True)
    if args.failures:
        pathlib.Path(args.failures).write_text("".join(json.dumps(f, ensure_ascii=False) + "\n" for f in failures))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(
            {k: {n: ({kk: vv for kk, vv in st.items() if kk not in ("compile", "mask", "paired_mask")} if n != "totals"
                     else {kk: vv for kk, vv in st.items() if kk != "by_schema"})
                 for n, st in v.items()} for k, v in out.items()}, indent=1))


if __name__ == "__main__":
    main()
