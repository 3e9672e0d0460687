"""Serving layouts under the same traffic: one co-located instance, replicas, and prefill/decode disaggregation,
all behind the same OpenAI proxy on a local Ray cluster, on the real default model (SmolLM2-135M-Instruct), CPU.

The traffic mixes short chat requests (MT-Bench first turns, ``--short-out`` tokens out) with long-prompt requests
(``--long-in`` tokens of the Python language reference to summarize, ``--long-out`` tokens out), arriving as a
Poisson process at each rate of ``--rates``. Every request streams; the client measures TTFT (send -> first token)
and TPOT ((last - first) / (tokens - 1)). A request is *good* when it meets both SLOs; goodput = good requests / the
arrival window (DistServe's metric). The SLOs default to multiples of the unloaded latencies measured first on the
co-located layout (TTFT: ``--ttft-x`` x a lone long prompt's; TPOT: ``--tpot-x`` x a lone stream's).

On a 2-core machine the layouts share the same 2 cores: co-located = 1 instance with 2 torch threads; replicas = 2
instances x 1 thread; disaggregated = 1 prefill + 1 decode instance x 1 thread. The peer is co-located serving.

The second part is the simulator (``leapdecode.cluster.simulator``): the step-cost model fitted on this machine,
the same traffic simulated for the same layouts beside the measured percentiles (the simulator's validation), then
the planner's choices for larger clusters on stated H100 figures, labelled SIMULATED.

    python benchmarks/disagg.py [--rates 0.2,0.4,0.8] [--requests 24] [--layouts colocated,replicas,disagg]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kv_compression import python_docs  # noqa: E402
from real_model import chat_ids, read_jsonl, user  # noqa: E402

LAYOUTS = {
    "colocated": dict(replicas=1, num_threads=2),
    "replicas": dict(replicas=2, num_threads=1),
    "disagg": dict(prefill=1, decode=1, num_threads=1),
}


# -- traffic -------------------------------------------------------------------------------------------------------
def make_traffic(tok, args) -> list[dict]:
    """Deterministic request list: (prompt ids, max tokens, kind), in arrival order (times drawn per rate)."""
    rng = random.Random(args.seed)
    questions = [r["turns"][0] for r in read_jsonl("mt_bench", "question.jsonl")]
    doc = tok.encode(python_docs(), add_special_tokens=False)
    out = []
    for i in range(args.requests):
        if rng.random() < args.long_share:
            start = rng.randrange(0, len(doc) - args.long_in)
            text = tok.decode(doc[start:start + args.long_in])
            ids = chat_ids(tok, user("Summarize this documentation in two sentences:\n\n" + text))
            out.append({"ids": ids, "max_tokens": args.long_out, "kind": "long"})
        else:
            ids = chat_ids(tok, user(questions[rng.randrange(len(questions))]))
            out.append({"ids": ids, "max_tokens": args.short_out, "kind": "short"})
    return out


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


# -- one request over HTTP -----------------------------------------------------------------------------------------
async def one_request(client, url: str, req: dict) -> dict:
    body = {"model": "m", "prompt": req["ids"], "max_tokens": req["max_tokens"], "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first = last = None
    tokens, error = 0, None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"kind": req["kind"], "error": f"HTTP {r.status_code}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]["message"]
                break
            now = time.perf_counter()
            if event.get("choices") and event["choices"][0].get("text"):
                first = first or now
                last = now
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    if error or first is None:
        return {"kind": req["kind"], "error": error or "no tokens"}
    return {"kind": req["kind"], "ttft": first - sent,
            "tpot": (last - first) / (tokens - 1) if tokens > 1 else 0.0, "tokens": tokens}


async def run_traffic(url: str, traffic: list[dict], times: list[float]) -> tuple[list[dict], float]:
    import httpx
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()

        async def at(t: float, req: dict) -> dict:
            await asyncio.sleep(max(0.0, t0 + t - time.perf_counter()))
            return await one_request(client, url, req)
        results = await asyncio.gather(*(at(t, r) for t, r in zip(times, traffic)))
    return list(results), time.perf_counter() - t0


# -- a layout behind the proxy -------------------------------------------------------------------------------------
class Served:
    """``serve_cluster`` under uvicorn in a thread; stops the instances on exit."""

    def __init__(self, llm_kwargs: dict, layout: dict) -> None:
        import uvicorn

        from leapdecode.cluster.launch import serve_cluster
        self.app, self.backend = serve_cluster(llm_kwargs, served_model_name="m", **layout)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)


def summarize(results: list[dict], window: float, slo: tuple[float, float]) -> dict:
    ok = [r for r in results if "error" not in r]
    good = [r for r in ok if r["ttft"] <= slo[0] and r["tpot"] <= slo[1]]

    def pct(key: str, q: float, kind: str | None = None) -> float:
        xs = sorted(r[key] for r in ok if kind is None or r["kind"] == kind)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")
    return {"n": len(results), "errors": len(results) - len(ok), "attained": len(good) / max(1, len(results)),
            "goodput": len(good) / window, "ttft_p50": pct("ttft", 0.5), "ttft_p90": pct("ttft", 0.9),
            "tpot_p50": pct("tpot", 0.5), "tpot_p90": pct("tpot", 0.9),
            "short_tpot_p90": pct("tpot", 0.9, "short"), "long_ttft_p50": pct("ttft", 0.5, "long")}


def probe_requests(tok, args) -> dict[str, list[dict]]:
    """Requests not in the traffic (another seed), so probes and warm-ups never warm the traffic's prefixes."""
    pool = make_traffic(tok, argparse.Namespace(**{**vars(args), "seed": args.seed + 1000, "requests": 64}))
    return {kind: [r for r in pool if r["kind"] == kind] for kind in ("long", "short")}


def warm_up(url: str, probes: dict[str, list[dict]]) -> None:
    """One long and one short request: the first forward of each shape is slow (allocation, kernel selection)."""
    asyncio.run(run_traffic(url, [probes["long"][-1], probes["short"][-1]], [0.0, 0.0]))


def unloaded_slo(url: str, probes: dict[str, list[dict]], args) -> tuple[float, float, dict]:
    """TTFT of a lone long prompt and TPOT of a lone short stream on the co-located layout -> the SLOs."""
    got = {name: asyncio.run(run_traffic(url, [probes[name][0]], [0.0]))[0][0] for name in ("long", "short")}
    return args.ttft_x * got["long"]["ttft"], args.tpot_x * got["short"]["tpot"], got


def measured(args, tok, llm_kwargs) -> tuple[list[dict], tuple[float, float]]:
    # each rate gets its own requests (another seed), so a rate never reads prefixes the previous one cached
    traffics = args.traffics = [make_traffic(tok, argparse.Namespace(**{**vars(args), "seed": args.seed + 10 * (k + 1)}))
                for k in range(len(args.rates))]
    probes_pool = probe_requests(tok, args)
    rows, slo = [], None
    for name in args.layouts:
        served = Served(llm_kwargs, LAYOUTS[name])
        try:
            warm_up(served.url, probes_pool)
            if slo is None:
                if name != "colocated":
                    raise SystemExit("the first layout must be 'colocated' (it sets the SLOs)")
                ttft_slo, tpot_slo, probes = unloaded_slo(served.url, probes_pool, args)
                slo = (ttft_slo, tpot_slo)
                print(f"unloaded (co-located): long prompt TTFT {probes['long']['ttft']:.2f}s, "
                      f"lone stream TPOT {probes['short']['tpot'] * 1000:.0f}ms -> SLO TTFT <= {slo[0]:.2f}s, "
                      f"TPOT <= {slo[1] * 1000:.0f}ms", flush=True)
            for rate, traffic in zip(args.rates, traffics):
                times = arrivals(len(traffic), rate, args.seed + 1)
                results, _ = asyncio.run(run_traffic(served.url, traffic, times))
                row = {"layout": name, "rate": rate, **summarize(results, times[-1], slo)}
                rows.append(row)
                print(f"  {name:10s} rate {rate:.2f}/s: goodput {row['goodput']:.3f}/s "
                      f"attained {row['attained']:.0%} ttft p90 {row['ttft_p90']:.2f}s "
                      f"tpot p90 {row['tpot_p90'] * 1000:.0f}ms errors {row['errors']}", flush=True)
        finally:
            served.close()
    return rows, slo


# -- the simulator beside the measurements ------------------------------------------------------------------------
def fitted_costs(llm_kwargs: dict, threads: list[int]) -> tuple[dict, object]:
    """A StepCost per torch thread count, fitted on timed engine steps of an in-process engine of this model."""
    import torch

    from leapdecode import LLM
    from leapdecode.cluster.simulator import EngineShape
    from leapdecode.cluster.step_model import StepCost, measure
    llm = LLM(**llm_kwargs)
    costs, before = {}, torch.get_num_threads()
    for n in threads:
        torch.set_num_threads(n)
        samples = measure(llm, prompt_lens=(32, 128, 512, 1024), contexts=(128, 512, 1024),
                          decode_batches=(1, 4, 8), repeats=2)
        costs[n] = StepCost.fit(samples)
        err = statistics.mean(abs(e) for e in costs[n].relative_errors(samples))
        print(f"step cost, {n} thread(s): {costs[n]} (mean |error| on its {len(samples)} probes {err:.0%})",
              flush=True)
    torch.set_num_threads(before)
    return costs, EngineShape.of_llm(llm)


def simulated_rows(rows: list[dict], traffics: list[list[dict]], args, costs: dict, engine) -> list[dict]:
    """The measured layouts and rates, simulated with the fitted costs; KV moves at ``--sim-link-gbs``."""
    from leapdecode.cluster.simulator import Cluster, Colocated, Disaggregated, simulate
    from leapdecode.cluster.workload import SimRequest
    placements = {"colocated": (Colocated(1), costs[2]), "replicas": (Colocated(2), costs[1]),
                  "disagg": (Disaggregated(1, 1, 1, 1), costs[1])}
    out = []
    for row in rows:
        k = args.rates.index(row["rate"])
        times = arrivals(len(traffics[k]), row["rate"], args.seed + 1)
        reqs = [SimRequest(t, len(r["ids"]), r["max_tokens"], i) for i, (t, r) in enumerate(zip(times, traffics[k]))]
        placement, cost = placements[row["layout"]]
        cluster = Cluster({1: cost}, engine=engine, kv_bytes_per_token=args.kv_bytes_per_token,
                          link_bandwidth=args.sim_link_gbs * 1e9, transfer_latency_s=args.sim_link_latency)
        sim = simulate(placement, cluster, reqs)
        out.append({"layout": row["layout"], "rate": row["rate"],
                    **{f"{m}_p{q}": sim.percentile(m, q) for m in ("ttft", "tpot") for q in (50, 90)}})
    return out


def print_validation(rows: list[dict], sims: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table
    t = Table(title="SIMULATED beside MEASURED (same traffic; simulator: the engine's scheduler + step costs fitted "
                    "on this machine; the proxy, HTTP and Ray are not modelled)")
    for col in ("layout", "rate", "TTFT p50 meas/sim s", "err", "TTFT p90 meas/sim s", "err",
                "TPOT p50 meas/sim ms", "err", "TPOT p90 meas/sim ms", "err"):
        t.add_column(col, justify="right")
    for r, s in zip(rows, sims):
        cells = [r["layout"], f"{r['rate']:.2f}"]
        for m, scale in (("ttft", 1), ("tpot", 1000)):
            for q in (50, 90):
                meas, sim = r[f"{m}_p{q}"], s[f"{m}_p{q}"]
                cells += [f"{meas * scale:.2f} / {sim * scale:.2f}" if scale == 1 else
                          f"{meas * scale:.0f} / {sim * scale:.0f}", f"{(sim - meas) / meas:+.0%}"]
        t.add_row(*cells)
    Console(width=200).print(t)


def print_measured(rows: list[dict], slo: tuple[float, float], args) -> None:
    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"MEASURED: {args.requests} requests per rate ({args.long_share:.0%} long: {args.long_in} tokens "
                    f"in / {args.long_out} out; short: MT-Bench / {args.short_out} out), SLO TTFT <= {slo[0]:.2f}s "
                    f"and TPOT <= {slo[1] * 1000:.0f}ms")
    for col in ("layout", "rate req/s", "goodput req/s", "vs co-located", "SLO attained", "TTFT p50/p90 s",
                "TPOT p50/p90 ms", "short TPOT p90 ms", "errors"):
        t.add_column(col, justify="right")
    base = {r["rate"]: r["goodput"] for r in rows if r["layout"] == "colocated"}
    for r in rows:
        b = base.get(r["rate"])
        ratio = f"{r['goodput'] / b:.2f}x" if b else ("-" if b is None else "co-located: 0")
        t.add_row(r["layout"], f"{r['rate']:.2f}", f"{r['goodput']:.3f}", ratio, f"{r['attained']:.0%}",
                  f"{r['ttft_p50']:.2f} / {r['ttft_p90']:.2f}",
                  f"{r['tpot_p50'] * 1000:.0f} / {r['tpot_p90'] * 1000:.0f}", f"{r['short_tpot_p90'] * 1000:.0f}",
                  str(r["errors"]))
    Console(width=200).print(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--rates", default="0.2,0.4,0.8")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--layouts", default="colocated,replicas,disagg")
    ap.add_argument("--long-share", type=float, default=0.25)
    ap.add_argument("--long-in", type=int, default=768)
    ap.add_argument("--long-out", type=int, default=16)
    ap.add_argument("--short-out", type=int, default=48)
    ap.add_argument("--ttft-x", type=float, default=3.0)
    ap.add_argument("--tpot-x", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-sim", action="store_true", help="no simulator validation")
    ap.add_argument("--skip-plan", action="store_true", help="no planner tables for larger clusters")
    ap.add_argument("--sim-link-gbs", type=float, default=2.0,
                    help="KV transfer bandwidth the simulator assumes between instances here (GB/s; host memory "
                         "through Ray's object store)")
    ap.add_argument("--sim-link-latency", type=float, default=0.02, help="per-transfer latency assumed (s)")
    args = ap.parse_args()
    args.rates = [float(x) for x in args.rates.split(",")]
    args.layouts = args.layouts.split(",")

    import ray

    from leapdecode.cluster.frontend import EngineFront
    llm_kwargs = {"model": args.model, "max_model_len": 2048}
    tok = EngineFront(llm_kwargs).tokenizer
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"python {platform.python_version()}, ray {ray.__version__}; model "
          f"{os.path.basename(str(EngineFront(llm_kwargs).cfg.model))}", flush=True)
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    try:
        rows, slo = measured(args, tok, llm_kwargs)
        print_measured(rows, slo, args)
    finally:
        ray.shutdown()
    if not args.skip_sim:
        costs, engine = fitted_costs(llm_kwargs, [1, 2])
        from leapdecode.cluster.frontend import EngineFront
        front = EngineFront(llm_kwargs).model_cfg
        args.kv_bytes_per_token = 2 * front.num_layers * front.num_kv_heads * front.head_dim * 4   # float32 on CPU
        print_validation(rows, simulated_rows(rows, args.traffics, args, costs, engine))
    if not args.skip_plan:
        from leapdecode.cluster.planner import main as plan_main
        plan_main(["--devices", "8", "64"])


if __name__ == "__main__":
    main()
