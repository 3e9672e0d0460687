"""llguidance vs xgrammar on the official JSON-Schema-Test-Suite (draft2020-12 + draft7).

For each library, through the same adapter (`GrammarBackend`), with and without our jsonschema guard:
  compiled   fraction of schema groups that compile (the rest are refused with a ValueError)
  valid ok   valid instances whose tokens are all accepted and that can then end (EOS allowed)
  invalid ok invalid instances that are refused (a token refused, or EOS not allowed at the end)
  compile    p50 / p99 compile time per schema (ms)
  mask       time to fill one bitmask row (µs per token; mean and median), over the valid instances' tokens

Instances are serialized the way the grammars emit JSON (compact, keys in schema order: see `json_text`).
Usage: python benchmarks/structured_backends.py [--suite DIR] [--tokenizer DIR] [--limit N]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformers import PreTrainedTokenizerFast  # noqa: E402

from leapdecode.structured.backend import GrammarBackend, json_text  # noqa: E402

DRAFTS = {"draft2020-12": "https://json-schema.org/draft/2020-12/schema", "draft7": "http://json-schema.org/draft-07/schema#"}


def load_groups(suite: pathlib.Path) -> list[tuple[str, dict[str, Any]]]:
    groups = []
    for draft, meta in DRAFTS.items():
        for path in sorted((suite / "tests" / draft).rglob("*.json")):
            for group in json.loads(path.read_text()):
                schema = group["schema"]
                if isinstance(schema, dict) and "$schema" not in schema:
                    schema = {"$schema": meta, **schema}
                groups.append((f"{draft}/{path.relative_to(suite / 'tests' / draft)}", {**group, "schema": schema}))
    return groups


def run_instance(backend: GrammarBackend, compiled: Any, tokenizer: Any, text: str, fill_times: list[float]) -> bool:
    """True when the whole text is accepted and EOS is allowed after it."""
    matcher = backend.matcher(compiled)
    bitmask = backend.allocate_bitmask(1)
    for token in tokenizer.encode(text, add_special_tokens=False):
        start = time.perf_counter()
        matcher.fill_bitmask(bitmask, 0)
        fill_times.append(time.perf_counter() - start)
        if not matcher.accept(token):
            return False
    return matcher.accept(backend.eos_token_ids[0])


def measure(library: str, guard: bool, groups: list, tokenizer: Any) -> dict[str, Any]:
    backend = GrammarBackend(tokenizer, library=library, guard=guard, compile_timeout_s=30.0)
    compiled_n = valid_ok = valid_n = invalid_ok = invalid_n = 0
    compile_ms: list[float] = []
    fill_times: list[float] = []
    for i, (_, group) in enumerate(groups):
        spec = {"type": "json_schema", "json_schema": {"name": f"g{i}", "schema": group["schema"]}}
        try:
            compiled = backend.compile(spec)
        except ValueError:
            continue
        compiled_n += 1
        compile_ms.append(compiled.compile_s * 1e3)
        for test in group["tests"]:
            texts = [json.dumps(test["data"], separators=(",", ":"), ensure_ascii=False)]
            texts.append(json_text(test["data"], group["schema"]))
            if test["valid"]:
                valid_n += 1
                valid_ok += any(run_instance(backend, compiled, tokenizer, t, fill_times) for t in dict.fromkeys(texts))
            else:
                invalid_n += 1
                invalid_ok += not any(run_instance(backend, compiled, tokenizer, t, []) for t in dict.fromkeys(texts))
    backend.shutdown()
    compile_ms.sort()
    return {
        "library": library + (" + guard" if guard else ""),
        "compiled": f"{compiled_n}/{len(groups)} ({100 * compiled_n / len(groups):.1f}%)",
        "valid ok": f"{valid_ok}/{valid_n} ({100 * valid_ok / max(valid_n, 1):.1f}%)",
        "invalid rejected": f"{invalid_ok}/{invalid_n} ({100 * invalid_ok / max(invalid_n, 1):.1f}%)",
        "compile p50/p99 ms": f"{statistics.median(compile_ms):.2f} / {compile_ms[int(0.99 * (len(compile_ms) - 1))]:.2f}",
        "mask µs/token mean/p50": f"{1e6 * statistics.mean(fill_times):.0f} / {1e6 * statistics.median(fill_times):.0f}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", default=str(ROOT.parent / "shared/bench/json_schema_test_suite"))
    parser.add_argument("--tokenizer", default=str(ROOT.parent / "shared/models/gpt2-tokenizer"))
    parser.add_argument("--limit", type=int, default=0, help="only the first N schema groups")
    parser.add_argument("--libraries", default="llguidance,xgrammar")
    parser.add_argument("--guard", default="llguidance", help="libraries to also measure with our jsonschema guard")
    args = parser.parse_args()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(args.tokenizer)
    groups = load_groups(pathlib.Path(args.suite))
    if args.limit:
        groups = groups[: args.limit]
    rows = []
    for library in args.libraries.split(","):
        for guard in (False, True):
            if guard and library not in args.guard.split(","):
                continue
            rows.append(measure(library, guard, groups, tokenizer))
    print(f"JSON-Schema-Test-Suite draft2020-12 + draft7: {len(groups)} schema groups; tokenizer {args.tokenizer}; CPU")
    headers = list(rows[0])
    widths = [max(len(h), *(len(r[h]) for r in rows)) for h in headers]
    print(" | ".join(h.ljust(w) for h, w in zip(headers, widths)))
    print("-|-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(r[h].ljust(w) for h, w in zip(headers, widths)))


if __name__ == "__main__":
    main()
