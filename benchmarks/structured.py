"""Structured output, end to end: compile time, mask-fill time, tokens/s with and without a schema, and the forward
passes that grammar-forced tokens save (issue 8).

    python benchmarks/structured.py                      # embedded model, batch 1 and 32
    python benchmarks/structured.py --model DIR --batch-sizes 1,8 -o 96 --json /tmp/structured.json

(i) compile time. Every group's schema of the JSON-Schema-Test-Suite draft2020-12 files
    (``tests/data/json_schema_test_suite/tests/draft2020-12/*.json``; duplicates removed) is compiled with the
    engine's own backend, ``llm.engine.structured_backend.compile({"type": "json_schema", ...})``, wall time around
    the call. cold = the first compile of each schema on a backend that has never seen it (a fresh LLM, so nothing
    is cached; the backend's one-time construction is timed separately); cached = the same call again right after
    (a hit in the backend's compile cache, an LRU of 256 specs), and the part of it spent in ``parse_structured``
    (the spec validation that runs before the cache lookup). A ValueError is a refusal (unsupported, or over the time limit) and is counted.

(ii) mask fill. During the end-to-end structured runs below, ``leapdecode.structured.fill_bitmasks`` (what the
    engine's worker thread runs in ``Constraints.start_fill``) is wrapped to time each call, and
    ``Constraints.apply`` to time how long the step waits for the worker after the forward pass (the part of the
    fill that is not hidden). Reported per mask row (one row = one verified position = one token): µs median/p99,
    and per step. "isolated" re-plays every generated structured output through a fresh matcher on the main thread
    (``matcher.fill_bitmask`` then ``accept``, one row at a time): the same realistic states without a concurrent
    forward pass.

(iii) tokens/s with and without a schema: the same prompts, greedy, same max_tokens O; the unconstrained side uses
    ``ignore_eos=True`` (so it always makes O tokens), the structured side cannot (the grammar ends the output with
    EOS), so each side reports tokens/s = generated tokens / wall time. batch 1 = --n1 requests one at a time;
    batch B = B requests submitted together. Caveat at batch B: the unconstrained requests all run O steps, the
    structured ones end at their own EOS, so their batch thins out towards the end (fewer tokens per step to
    amortize a step over); ms/step (wall / engine steps) is shown beside tokens/s for that reason.

(iv) forced tokens ("jump-forward" as drafts verified with certainty): ``structured.num_forced_tokens``, engine
    steps vs generated tokens, and tokens/s against the same schema run with forced-token drafting disabled. The
    disabled variant is a monkeypatch in THIS SCRIPT ONLY: ``llm.engine.structured.prepare_drafts`` replaced by a
    version that only cuts drafter drafts to what the grammar accepts and never proposes forced tokens. Greedy
    outputs of both must be identical (the forced token is the only one the mask allows). With
    ``--spec-method M`` a third variant runs forced drafting plus a model-free drafter (its drafts cut by the
    grammar).

Prefix caching is off in this benchmark so every variant pays the same prefill (they share one LLM and the
same prompts). Timings on a shared CPU are noisy; variants are run back to back for each batch size, and
``--repeats R`` alternates them R times and keeps each variant's median.
"""
from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from speculative import divergence_gap, hardware  # noqa: E402  (CPU model, threads, load, commit; tie check)

SUITE = os.path.join(REPO, "tests", "data", "json_schema_test_suite", "tests", "draft2020-12")
DRAFT_2020 = "https://json-schema.org/draft/2020-12/schema"

USER_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["admin", "user", "guest", "developer", "tester"]},
                 "maxItems": 4},
        "address": {"type": "object",
                    "properties": {"street": {"type": "string", "maxLength": 30},
                                   "city": {"type": "string", "maxLength": 20}},
                    "required": ["street", "city"], "additionalProperties": False},
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}

NAMES = ["Alice", "Bob", "Carol", "Dmitri", "Eve", "Farah", "Gustavo", "Hana", "Ivan", "Julia", "Kenji", "Lena",
         "Mateo", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tariq", "Uma", "Viktor", "Wen", "Ximena",
         "Yusuf", "Zoe"]
CITIES = ["Berlin", "Lagos", "Lima", "Osaka", "Oslo", "Pune", "Quito", "Rome", "Seoul", "Tunis", "Vienna"]
PROMPTS = [
    "# A user record as JSON (name, age, tags, address):\n# {name}, {age}, lives in {city}.\nuser = ",
    "Describe the user {name} ({age} years old, from {city}) as JSON:\n",
    "def make_user():\n    \"\"\"Return the record of {name}, aged {age}, of {city}, as a JSON string.\"\"\"\n    return '",
    "# config for {name}\n# city: {city}\n# age: {age}\nrecord = json.loads('",
]


def prompts(n: int, offset: int = 0) -> list[str]:
    out = []
    for i in range(offset, offset + n):
        out.append(PROMPTS[i % len(PROMPTS)].format(name=NAMES[i % len(NAMES)], age=18 + (7 * i) % 60,
                                                    city=CITIES[i % len(CITIES)]))
    return out


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# -- (i) compile -----------------------------------------------------------------------------------------------
def suite_schemas(suite: str) -> list[tuple[str, object]]:
    seen, out = set(), []
    for path in sorted(glob.glob(os.path.join(suite, "*.json"))):
        with open(path) as f:
            groups = json.load(f)
        for g in groups:
            schema = g["schema"]
            if isinstance(schema, dict) and "$schema" not in schema:
                schema = {"$schema": DRAFT_2020, **schema}
            key = json.dumps(schema, sort_keys=True)
            if key in seen:
                continue
            seen.add(key)
            out.append((f"{os.path.basename(path)}: {g.get('description', '')}", schema))
    return out


def bench_compile(llm, suite: str) -> dict:
    from leapdecode.structured import GrammarBackend
    eng = llm.engine
    schemas = suite_schemas(suite)
    # one-time backend construction (tokenizer conversion, guard tables): timed on throwaway backends
    build = []
    for _ in range(3):
        t0 = time.perf_counter()
        b = GrammarBackend(eng.tokenizer, eos_token_ids=[eng.tokenizer.eos_token_id or min(eng.eos_token_ids)])
        build.append(time.perf_counter() - t0)
        b.shutdown()
    backend = eng.structured_backend          # built on first use; fresh LLM, so its cache is empty
    from leapdecode.structured import parse_structured
    cold, cached, inner, refused, reasons, parse = [], [], [], [], {}, []
    for _, schema in schemas:
        spec = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        t0 = time.perf_counter()
        try:
            compiled = backend.compile(spec)
        except ValueError as e:
            refused.append(time.perf_counter() - t0)
            why = "time limit" if "time limit" in str(e) else str(e).split(":", 2)[-1].strip()[:60]
            reasons[why] = reasons.get(why, 0) + 1
            continue
        cold.append(time.perf_counter() - t0)
        inner.append(compiled.compile_s)
        # cached: the same call again right away (the backend's LRU holds 256 specs, fewer than the suite has)
        t0 = time.perf_counter()
        backend.compile(spec)
        cached.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        parse_structured(spec)            # the validation every compile() call does before its cache lookup
        parse.append(time.perf_counter() - t0)
    return {"schemas": len(schemas), "compiled": len(cold), "refused": len(refused),
            "refusal_reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1])[:8]),
            "backend_build_s": statistics.median(build),
            "cold_ms": {"median": 1e3 * statistics.median(cold), "p99": 1e3 * pct(cold, 99),
                        "max": 1e3 * max(cold), "mean": 1e3 * statistics.fmean(cold)},
            "cold_in_worker_ms": {"median": 1e3 * statistics.median(inner), "p99": 1e3 * pct(inner, 99)},
            "refused_ms": {"median": 1e3 * statistics.median(refused), "p99": 1e3 * pct(refused, 99)} if refused else None,
            "cached_us": {"median": 1e6 * statistics.median(cached), "p99": 1e6 * pct(cached, 99)},
            "parse_us": {"median": 1e6 * statistics.median(parse), "p99": 1e6 * pct(parse, 99)}}


# -- instrumentation -------------------------------------------------------------------------------------------
@dataclass
class FillLog:
    calls: list[tuple[float, int, int]] = field(default_factory=list)   # (seconds, rows, jobs) per worker call
    waits: list[float] = field(default_factory=list)                    # main thread blocked on the worker
    on: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


def instrument(llm, log: FillLog) -> None:
    import leapdecode.structured as st
    original = st.fill_bitmasks
    if not getattr(original, "_bench_wrapped", False):
        def fill_bitmasks(jobs, bitmask):
            t0 = time.perf_counter()
            counts = original(jobs, bitmask)
            dt = time.perf_counter() - t0
            if log.on:
                with log.lock:
                    log.calls.append((dt, sum(counts) + len(counts), len(counts)))
            return counts
        fill_bitmasks._bench_wrapped = True
        st.fill_bitmasks = fill_bitmasks      # StructuredOutput.start_fill imports it from leapdecode.structured per call

    cons = llm.engine.structured
    apply = cons.apply

    def timed_apply(logits, pending):
        if pending is not None:
            t0 = time.perf_counter()
            pending.result()
            if log.on:
                log.waits.append(time.perf_counter() - t0)
        return apply(logits, pending)
    cons.apply = timed_apply


def disable_forced(cons) -> None:
    """Benchmark-only monkeypatch: never propose grammar-forced tokens; only cut drafter drafts to the grammar."""
    def draft(seq, proposal, room):
        m = cons.matchers[seq.seq_id]
        chain = proposal.first_chain()
        return chain.prefix(m.validate(list(chain.tokens))) if chain else chain
    cons.draft = draft


def enable_forced(cons) -> None:
    cons.__dict__.pop("draft", None)


# -- (iii)/(iv) end to end -------------------------------------------------------------------------------------
def run(llm, ps: list[str], batch: int, sp, log: FillLog | None = None) -> dict:
    eng = llm.engine
    before = dict(eng.stats)
    forced0 = eng.structured.num_forced_tokens
    if log is not None:
        log.on = True
    gc.collect()
    t0 = time.perf_counter()
    if batch == 1:
        outs = [llm.generate([p], sp, use_tqdm=False)[0] for p in ps]
    else:
        outs = []
        for i in range(0, len(ps), batch):
            outs += llm.generate(ps[i:i + batch], sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    if log is not None:
        log.on = False
    d = {k: eng.stats[k] - before[k] for k in eng.stats}
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"wall_s": wall, "generated_tokens": gen, "tokens_per_s": gen / wall, "steps": d["steps"],
            "request_steps": sum(o.metrics.num_steps for o in outs),
            "draft_tokens": d["draft_tokens"], "accepted_tokens": d["accepted_tokens"],
            "forced_tokens": eng.structured.num_forced_tokens - forced0,
            "finish": {r: sum(o.outputs[0].finish_reason == r for o in outs) for r in ("stop", "length", "abort")},
            "texts": [o.outputs[0].text for o in outs],
            "token_ids": [list(o.outputs[0].token_ids) for o in outs],
            "prompt_ids": [list(o.prompt_token_ids) for o in outs]}


def valid_count(texts: list[str], schema: dict) -> int:
    import jsonschema
    n = 0
    for t in texts:
        try:
            jsonschema.validate(json.loads(t), schema)
            n += 1
        except Exception:
            pass
    return n


def isolated_fill(llm, compiled, outputs: list[list[int]]) -> list[float]:
    """Re-play outputs through fresh matchers on this thread, timing fill_bitmask per row."""
    backend = llm.engine.structured_backend
    bitmask = backend.allocate_bitmask(1)
    eos = llm.engine.eos_token_ids
    times = []
    for tokens in outputs:
        m = backend.matcher(compiled)
        for tok in tokens:
            t0 = time.perf_counter()
            m.fill_bitmask(bitmask, 0)
            times.append(time.perf_counter() - t0)
            if tok in eos or not m.accept(tok):
                break
    return times


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model dir (default: the embedded default model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--n1", type=int, default=8, help="requests in the batch-1 runs (one after another)")
    p.add_argument("-o", "--output-len", type=int, default=96, help="max_tokens O")
    p.add_argument("--suite", default=SUITE)
    p.add_argument("--skip-compile", action="store_true")
    p.add_argument("--spec-method", default="suffix", help="drafter for the 'forced + drafts' variant ('' = none)")
    p.add_argument("--spec-k", type=int, default=4)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.model is None:
        from leapdecode.assets import default_model_path
        args.model = default_model_path()
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from leapdecode import LLM, SamplingParams
    from leapdecode.model.loader import load_model_config

    mcfg = load_model_config(args.model)
    hw = hardware()
    header = {"model": args.model, "model_shape": {"num_layers": mcfg.num_layers, "hidden_size": mcfg.hidden_size,
                                                   "vocab_size": mcfg.vocab_size},
              **hw, "O": args.output_len, "batch_sizes": args.batch_sizes, "n1": args.n1, "schema": USER_SCHEMA}
    t_start = time.perf_counter()
    kw = dict(dtype=args.dtype, max_num_seqs=max(args.batch_sizes), enable_prefix_caching=False, seed=0,
              max_model_len=min(mcfg.max_position_embeddings, 256 + args.output_len + args.spec_k + 8))
    llm = LLM(args.model, **kw)
    header["dtype"] = str(llm.engine.dtype).replace("torch.", "")
    result: dict = {"header": header}

    # (i)
    if not args.skip_compile:
        print("compiling the suite's schemas ...", file=sys.stderr)
        result["compile"] = bench_compile(llm, args.suite)

    # (ii)-(iv)
    structured = {"type": "json_schema", "json_schema": {"name": "user", "schema": USER_SCHEMA}}
    compiled = llm.engine.structured_backend.compile(structured)
    free = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=args.output_len, structured=structured)
    log = FillLog()
    instrument(llm, log)
    spec_llm = None
    if args.spec_method:
        spec_llm = LLM(args.model, **kw, speculative_config={"method": args.spec_method,
                                                             "num_speculative_tokens": args.spec_k})
        instrument(spec_llm, log)
    for m in [llm] + ([spec_llm] if spec_llm else []):
        m.generate(["def _warmup():\n    return"], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        m.generate(["# warmup\nx = "], constrained, use_tqdm=False)

    variants = ["unconstrained", "schema", "schema, no forced"] + (
        [f"schema + {args.spec_method}"] if spec_llm else [])
    rows, fills = [], {}
    for b in args.batch_sizes:
        ps = prompts(args.n1) if b == 1 else prompts(b, offset=1000)
        reps: dict[str, list[dict]] = {v: [] for v in variants}
        for rep in range(args.repeats):
            for v in variants:
                if v == "unconstrained":
                    r = run(llm, ps, b, free)
                elif v == "schema":
                    enable_forced(llm.engine.structured)
                    log.calls.clear(), log.waits.clear()
                    r = run(llm, ps, b, constrained, log)
                    r["fill"] = (list(log.calls), list(log.waits))
                elif v == "schema, no forced":
                    disable_forced(llm.engine.structured)
                    r = run(llm, ps, b, constrained)
                    enable_forced(llm.engine.structured)
                else:
                    r = run(spec_llm, ps, b, constrained)
                reps[v].append(r)
                print(f"  batch {b:3d} {v:22s} {r['tokens_per_s']:8.1f} tok/s", file=sys.stderr)
        base = None
        ref = None
        for v in variants:
            runs = sorted(reps[v], key=lambda r: r["tokens_per_s"])
            r = runs[len(runs) // 2]
            if v == "unconstrained":
                base = r
            if v == "schema":
                ref = r
                calls, waits = r["fill"]
                per_row = [dt / rows_ for dt, rows_, _ in calls if rows_]
                iso = isolated_fill(llm, compiled, r["token_ids"])
                fills[b] = {"calls": len(calls), "rows": sum(c[1] for c in calls),
                            "row_us": {"median": 1e6 * pct(per_row, 50), "p99": 1e6 * pct(per_row, 99)},
                            "call_ms": {"median": 1e3 * pct([c[0] for c in calls], 50),
                                        "p99": 1e3 * pct([c[0] for c in calls], 99)},
                            "rows_per_call": statistics.fmean(c[1] for c in calls) if calls else 0,
                            "wait_ms": {"median": 1e3 * pct(waits, 50), "p99": 1e3 * pct(waits, 99),
                                        "total_s": sum(waits)},
                            "fill_total_s": sum(c[0] for c in calls), "wall_s": r["wall_s"],
                            "isolated_row_us": {"median": 1e6 * pct(iso, 50), "p99": 1e6 * pct(iso, 99),
                                                "n": len(iso)}}
            row = {"batch": b, "variant": v, "requests": len(ps),
                   **{k: val for k, val in r.items() if k not in ("texts", "token_ids", "fill", "prompt_ids")},
                   "ratio": r["tokens_per_s"] / base["tokens_per_s"],
                   "tokens_per_step": r["generated_tokens"] / max(r["request_steps"], 1),
                   "valid": None if v == "unconstrained" else valid_count(r["texts"], USER_SCHEMA),
                   "identical": None if ref is None or v in ("unconstrained", "schema")
                   else sum(x == y for x, y in zip(r["token_ids"], ref["token_ids"]))}
            if v == "schema":
                row["example"] = r["texts"][0][:200]
            if row["identical"] is not None and row["identical"] < len(ps):
                row["divergences"] = [divergence_gap(llm, p_ids, x, y) for p_ids, x, y in
                                      zip(ref["prompt_ids"], ref["token_ids"], r["token_ids"]) if x != y]
            rows.append(row)
    result["e2e"] = rows
    result["fill"] = fills
    header["elapsed_s"] = time.perf_counter() - t_start
    header["load_avg_1m_end"] = os.getloadavg()[0]
    print_tables(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}", file=sys.stderr)
    ok = all(r["identical"] in (None, r["requests"]) for r in rows)
    return 0 if ok else 1


def print_tables(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    h = result["header"]
    s = h["model_shape"]
    head = (f"model {os.path.basename(os.path.normpath(h['model']))} ({s['num_layers']} layers, hidden "
            f"{s['hidden_size']}, vocab {s['vocab_size']}, {h['dtype']}) | {h['cpu']} ({h['cores']} cores), torch {h['torch']} "
            f"threads {h['torch_threads']}, load {h['load_avg_1m']:.1f}->{h['load_avg_1m_end']:.1f} | "
            f"commit {h['commit']}")
    c = result.get("compile")
    if c:
        t = Table(title=f"(i) schema compile time, JSON-Schema-Test-Suite draft2020-12: {c['schemas']} distinct "
                        f"schemas, {c['compiled']} compiled, {c['refused']} refused (ValueError)\n{head}",
                  title_justify="left")
        for col in ("", "median", "p99", "max / mean"):
            t.add_column(col, justify="left" if not col else "right")
        t.add_row("cold compile (first time on the backend, wall)", f"{c['cold_ms']['median']:.2f} ms",
                  f"{c['cold_ms']['p99']:.2f} ms", f"{c['cold_ms']['max']:.1f} / {c['cold_ms']['mean']:.2f} ms")
        t.add_row("  of which in the compile worker", f"{c['cold_in_worker_ms']['median']:.2f} ms",
                  f"{c['cold_in_worker_ms']['p99']:.2f} ms", "")
        if c["refused_ms"]:
            t.add_row("refusal (time to the ValueError)", f"{c['refused_ms']['median']:.2f} ms",
                      f"{c['refused_ms']['p99']:.2f} ms", "")
        t.add_row("cached compile (same spec again)", f"{c['cached_us']['median']:.1f} µs",
                  f"{c['cached_us']['p99']:.1f} µs", "")
        t.add_row("  of which parse_structured (schema validation)", f"{c['parse_us']['median']:.1f} µs",
                  f"{c['parse_us']['p99']:.1f} µs", "")
        t.add_row("backend construction (once per tokenizer)", f"{1e3 * c['backend_build_s']:.0f} ms", "", "")
        console.print(t)
        if c["refusal_reasons"]:
            console.print("refusals: " + "; ".join(f"{n}x {why}" for why, n in c["refusal_reasons"].items()))

    t = Table(title=f"(iii)/(iv) end to end, greedy, O={h['O']}, batch 1 = {h['n1']} requests one at a time, "
                    f"batch B = B together | schema: user {{name, age, tags[enum], address{{street, city}}}}\n{head}",
              title_justify="left")
    for col in ("batch", "variant", "tok/s", "ratio", "vs no forced", "tokens", "steps", "ms/step", "tok/step",
                "forced", "drafts acc/prop", "identical", "valid", "stop/len/abort"):
        t.add_column(col, justify="left" if col == "variant" else "right")
    last = None
    for r in result["e2e"]:
        if last is not None and r["batch"] != last:
            t.add_section()
        last = r["batch"]
        ident = "-" if r["identical"] is None else (
            f"[{'green' if r['identical'] == r['requests'] else 'red'}]{r['identical']}/{r['requests']}[/]")
        nf = next((x for x in result["e2e"] if x["batch"] == r["batch"] and x["variant"] == "schema, no forced"), None)
        vs = "-" if nf is None or r["variant"] == "unconstrained" else f"{r['tokens_per_s'] / nf['tokens_per_s']:.2f}"
        t.add_row(str(r["batch"]), r["variant"], f"{r['tokens_per_s']:.1f}", f"{r['ratio']:.2f}", vs,
                  str(r["generated_tokens"]), str(r["steps"]), f"{1e3 * r['wall_s'] / max(r['steps'], 1):.1f}",
                  f"{r['tokens_per_step']:.2f}",
                  str(r["forced_tokens"]), f"{r['accepted_tokens']}/{r['draft_tokens']}", ident,
                  "-" if r["valid"] is None else f"{r['valid']}/{r['requests']}",
                  f"{r['finish']['stop']}/{r['finish']['length']}/{r['finish']['abort']}")
    console.print(t)
    console.print("ratio: tok/s over the unconstrained run of the same batch; vs no forced: tok/s over the 'schema, no "
                  "forced' run (forced-token drafting disabled by a monkeypatch in this script); ms/step: wall / engine "
                  "steps; tok/step: generated tokens per request-step; forced: grammar-forced draft tokens proposed (structured.num_forced_tokens); "
                  "identical: greedy token ids equal to the 'schema' run's")
    for r in result["e2e"]:
        for d in r.get("divergences", []):
            gap = "n/a" if d["gap"] is None else f"{d['gap']:.4f}"
            console.print(f"  differs: batch {r['batch']} {r['variant']}: first at output token {d['index']} "
                          f"({d.get('ref_token')} vs {d.get('other_token')}); logprob gap there in a plain prefill "
                          f"{gap}{' ' + d['why'] if d.get('why') else ''}")
    ex = next((r.get("example") for r in result["e2e"] if r.get("example")), None)
    if ex:
        console.print(f"example structured output: {ex!r}")

    t = Table(title="(ii) bitmask fill per token (one mask row per verified position), during the structured runs",
              title_justify="left")
    for col in ("batch", "rows", "rows/step", "µs/row p50", "µs/row p99", "ms/step p50", "ms/step p99",
                "step waits for fill p50 / p99 (ms)", "fill / wall", "isolated µs/row p50 / p99"):
        t.add_column(col, justify="right")
    for b, f in result["fill"].items():
        t.add_row(str(b), str(f["rows"]), f"{f['rows_per_call']:.1f}", f"{f['row_us']['median']:.0f}",
                  f"{f['row_us']['p99']:.0f}", f"{f['call_ms']['median']:.2f}", f"{f['call_ms']['p99']:.2f}",
                  f"{f['wait_ms']['median']:.3f} / {f['wait_ms']['p99']:.2f}",
                  f"{f['fill_total_s'] / f['wall_s']:.1%}",
                  f"{f['isolated_row_us']['median']:.0f} / {f['isolated_row_us']['p99']:.0f}")
    console.print(t)


if __name__ == "__main__":
    sys.exit(main())
