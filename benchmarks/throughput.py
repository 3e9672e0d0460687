"""Offline throughput of the engine core, beside transformers `generate` on the same weights in the same run.

    python benchmarks/make_random_checkpoint.py qwen2.5-0.5b
    python benchmarks/throughput.py --model /tmp/leapdecode-ckpt/qwen2.5-0.5b -n 16 -i 128 -o 32 --batch-size 8

N requests of random prompt token ids (fixed seed, exactly --input-len tokens each, special tokens excluded) all
arrive at t = 0 (offline, like `LLM.generate` on a list); greedy decoding with the end-of-sequence token ignored, so
every request produces exactly --output-len tokens on both sides.

leapdecode: `LLM.generate(prompts, SamplingParams(temperature=0, max_tokens=O, ignore_eos=True))`; the per-request
times come from `RequestOutput.metrics` (arrival_time, first_token_time, finished_time).

transformers: `model.generate(greedy, max_new_tokens=O, min_new_tokens=O)` over the same prompts in consecutive
batches of --batch-size (left-padded with an attention mask; the prompts are equally long, so no padding happens).
The first-token time of each request is taken inside the same `generate` call by a streamer (transformers calls
`streamer.put` with the prompt, then once per step right after the new tokens are chosen), so it costs no extra
call; a request's finish time is when its batch's `generate` returns.

Per request: TTFT = first token time - arrival (the run start, for both engines: it includes waiting behind
earlier batches / prefill chunks), TPOT = (finish - first token) / (O - 1). Throughput: requests/s and output
tokens/s over the wall time of the run (first request in to last request out). When the peer runs on fewer
requests (--peer-requests) its rates stay per-request/per-token and comparable; its TTFT percentiles then see
less queueing than ours do (fewer batches wait), which favours the peer.

The "speedup" row is oriented so that > 1 always means leapdecode is better: ours/theirs for rates,
theirs/ours for latencies. Timings on a shared machine are noisy; --repeats R alternates the two engines R times
on fresh prompts and reports each engine's median run.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import platform
import pstats
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

PCTS = (50, 90, 99)


# -- results ---------------------------------------------------------------------------------------------------
@dataclass
class RunResult:
    engine: str
    num_requests: int
    elapsed_s: float
    ttft_s: list[float]
    tpot_s: list[float]
    latency_s: list[float]
    output_tokens: int
    prompt_tokens: int
    extra: dict = field(default_factory=dict)

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.output_tokens + self.prompt_tokens) / self.elapsed_s

    def summary(self) -> dict:
        out = {"engine": self.engine, "num_requests": self.num_requests, "elapsed_s": self.elapsed_s,
               "requests_per_s": self.requests_per_s, "output_tokens_per_s": self.output_tokens_per_s,
               "total_tokens_per_s": self.total_tokens_per_s, "output_tokens": self.output_tokens,
               "prompt_tokens": self.prompt_tokens}
        for name, xs in (("ttft", self.ttft_s), ("tpot", self.tpot_s), ("latency", self.latency_s)):
            out[f"{name}_mean_ms"] = 1e3 * statistics.fmean(xs) if xs else None
            for p in PCTS:
                out[f"{name}_p{p}_ms"] = 1e3 * percentile(xs, p) if xs else None
        out.update(self.extra)
        return out


def percentile(xs: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    k = (len(s) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# -- workload --------------------------------------------------------------------------------------------------
def make_prompts(n: int, length: int, vocab_hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_hi) for _ in range(length)] for _ in range(n)]


def prompt_vocab(model_dir: str) -> tuple[int, str]:
    """Ids below this are ordinary tokens of both the tokenizer and the model (no special/added tokens)."""
    from transformers import AutoConfig, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = AutoConfig.from_pretrained(model_dir)
    return min(tok.vocab_size, cfg.vocab_size), type(tok).__name__


# -- leapdecode ------------------------------------------------------------------------------------------------
class LeapdecodeRunner:
    name = "leapdecode"

    def __init__(self, args) -> None:
        from leapdecode import LLM
        t0 = time.perf_counter()
        self.llm = LLM(args.model, dtype=args.dtype, device=args.device,
                       max_model_len=args.input_len + args.output_len + 8, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed,
                       enable_prefix_caching=not args.no_prefix_caching)
        self.load_s = time.perf_counter() - t0
        self.output_len = args.output_len
        eng = self.llm.engine
        self.info = {"dtype": str(eng.dtype).replace("torch.", ""), "device": str(eng.device),
                     "kv_blocks": eng.runner.num_blocks, "block_size": eng.cfg.block_size,
                     "attention_backend": type(eng.runner.backend).__name__,
                     "max_num_seqs": eng.cfg.max_num_seqs, "max_num_batched_tokens": eng.cfg.max_num_batched_tokens,
                     "prefix_caching": eng.cfg.enable_prefix_caching, "load_s": self.load_s}

    def run(self, prompts: list[list[int]], output_len: int) -> tuple[RunResult, list[list[int]]]:
        from leapdecode import SamplingParams
        sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        eng = self.llm.engine
        steps0 = eng.stats["steps"]
        t0 = time.time()
        outs = self.llm.generate(prompts, sp, use_tqdm=False)
        t1 = time.time()
        steps = eng.stats["steps"] - steps0
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        bad = [i for i, t in enumerate(tokens) if len(t) != output_len]
        if bad:
            raise RuntimeError(f"leapdecode: requests {bad[:5]} produced {len(tokens[bad[0]])} tokens, "
                               f"expected {output_len}")
        ttft, tpot, lat = [], [], []
        for o in outs:
            m = o.metrics
            ttft.append(m.first_token_time - m.arrival_time)
            lat.append(m.finished_time - m.arrival_time)
            if output_len > 1:
                tpot.append((m.finished_time - m.first_token_time) / (output_len - 1))
        start = min(o.metrics.arrival_time for o in outs)
        end = max(o.metrics.finished_time for o in outs)
        res = RunResult(self.name, len(prompts), max(end - start, 1e-9), ttft, tpot, lat,
                        sum(map(len, tokens)), sum(map(len, prompts)),
                        {"engine_steps": steps, "ms_per_step": 1e3 * (t1 - t0) / max(steps, 1),
                         "generate_wall_s": t1 - t0})
        return res, tokens

    def close(self) -> None:
        del self.llm


# -- transformers ----------------------------------------------------------------------------------------------
class _TokenClock:
    """A transformers streamer that only timestamps: put #0 is the prompt, put #k (k >= 1) is the k-th new token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.time())

    def end(self) -> None:
        pass


class TransformersRunner:
    name = "transformers"

    def __init__(self, args) -> None:
        import transformers
        from transformers import AutoModelForCausalLM
        dtype = _torch_dtype(args.dtype, args.model)
        self.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        t0 = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(self.device).eval()
        self.load_s = time.perf_counter() - t0
        self.batch_size = args.batch_size
        eos = self.model.generation_config.eos_token_id
        self.pad_id = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
        self.info = {"dtype": str(dtype).replace("torch.", ""), "device": str(self.device),
                     "attn_implementation": self.model.config._attn_implementation, "batch_size": self.batch_size,
                     "transformers": transformers.__version__, "load_s": self.load_s}

    def _generate(self, batch: list[list[int]], output_len: int, clock: _TokenClock | None):
        width = max(map(len, batch))
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, p in enumerate(batch):                  # left padding
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device), do_sample=False,
                max_new_tokens=output_len, min_new_tokens=output_len, pad_token_id=self.pad_id, streamer=clock,
                temperature=None, top_p=None, top_k=None)
        return out[:, width:].tolist()

    def run(self, prompts: list[list[int]], output_len: int) -> tuple[RunResult, list[list[int]]]:
        ttft, tpot, lat, tokens = [], [], [], []
        t0 = time.time()
        for b in range(0, len(prompts), self.batch_size):
            batch = prompts[b:b + self.batch_size]
            clock = _TokenClock()
            new = self._generate(batch, output_len, clock)
            done = time.time()
            first = clock.times[1] if len(clock.times) > 1 else done
            for row in new:
                tokens.append(row)
                ttft.append(first - t0)
                lat.append(done - t0)
                if output_len > 1:
                    tpot.append((done - first) / (output_len - 1))
        elapsed = time.time() - t0
        bad = [i for i, t in enumerate(tokens) if len(t) != output_len]
        if bad:
            raise RuntimeError(f"transformers: requests {bad[:5]} produced {len(tokens[bad[0]])} tokens")
        return RunResult(self.name, len(prompts), elapsed, ttft, tpot, lat, sum(map(len, tokens)),
                         sum(map(len, prompts)), {"batches": -(-len(prompts) // self.batch_size)}), tokens

    def close(self) -> None:
        del self.model


def _torch_dtype(dtype: str, model_dir: str) -> torch.dtype:
    if dtype == "auto":
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            raw = json.load(f)
        return getattr(torch, str(raw.get("dtype") or raw.get("torch_dtype") or "float32").replace("torch.", ""))
    return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
            "float16": torch.float16, "fp16": torch.float16}[dtype]


# -- report ----------------------------------------------------------------------------------------------------
def hardware() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    hw = {"cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
          "torch": torch.__version__, "python": platform.python_version(),
          "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    if torch.cuda.is_available():
        hw["gpu"] = torch.cuda.get_device_name(0)
    try:
        rev = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--", "leapdecode"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        hw["leapdecode_commit"] = (rev + ("+dirty" if dirty else "")) if rev else None
    except (OSError, subprocess.SubprocessError):
        hw["leapdecode_commit"] = None
    return hw


def model_shape(model_dir: str) -> str:
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        c = json.load(f)
    arch = (c.get("architectures") or [c.get("model_type", "?")])[0]
    heads, kv = c.get("num_attention_heads"), c.get("num_key_value_heads")
    return (f"{arch}: hidden {c.get('hidden_size')}, {c.get('num_hidden_layers')} layers, {heads} heads / {kv} kv, "
            f"inter {c.get('intermediate_size')}, vocab {c.get('vocab_size')}"
            f"{', tied' if c.get('tie_word_embeddings') else ''}")


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """Greedy token agreement on the requests both ran: identical outputs, and mean matching prefix."""
    pairs = list(zip(ours, theirs))
    if not pairs:
        return {}
    prefix = []
    for a, b in pairs:
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        prefix.append(k / max(len(a), 1))
    return {"identical": sum(a == b for a, b in pairs), "compared": len(pairs),
            "mean_matching_prefix": statistics.fmean(prefix)}


def speedups(ours: dict, theirs: dict) -> dict:
    out = {}
    for k, v in ours.items():
        t = theirs.get(k)
        if not isinstance(v, (int, float)) or not isinstance(t, (int, float)) or not v or not t:
            continue
        if k.endswith("_per_s"):
            out[k] = v / t
        elif k.endswith("_ms"):
            out[k] = t / v
    return out


def print_table(header: dict, results: list[dict], ratio: dict | None, agree: dict | None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 200))
    lines = [f"[bold]model[/] {header['model']}  ({header['shape']})",
             f"[bold]dtype[/] {header['dtype']}   [bold]hardware[/] {header['hardware']['cpu']}, "
             f"{header['hardware']['cpu_count']} cores, torch {header['hardware']['torch']} with "
             f"{header['hardware']['torch_threads']} threads" + (f", {header['hardware']['gpu']}"
                                                                  if 'gpu' in header['hardware'] else "")
             + f", load average {header['load_before']:.1f} -> {header['hardware']['loadavg_1m']:.1f}"
             + f"   [bold]leapdecode[/] {header['hardware']['leapdecode_commit']}",
             f"[bold]workload[/] N={header['num_requests']} requests (peer: {header['peer_requests']}), "
             f"input {header['input_len']}, output {header['output_len']} tokens, greedy, ignore_eos; "
             f"repeats {header['repeats']} (median run shown)",
             f"[bold]batching[/] leapdecode max_num_seqs={header['leapdecode']['max_num_seqs']}, "
             f"max_num_batched_tokens={header['leapdecode']['max_num_batched_tokens']}, "
             f"{header['leapdecode']['attention_backend']}; transformers generate batch_size="
             f"{header.get('transformers', {}).get('batch_size', '-')} "
             f"({header.get('transformers', {}).get('attn_implementation', '-')} attention)"]
    for line in lines:
        console.print(line)
    table = Table(title="offline throughput (TTFT from arrival, all requests arrive at t=0)")
    cols = [("engine", None), ("req/s", "requests_per_s"), ("out tok/s", "output_tokens_per_s"),
            ("total tok/s", "total_tokens_per_s"), ("TTFT p50 ms", "ttft_p50_ms"), ("TTFT p90", "ttft_p90_ms"),
            ("TTFT p99", "ttft_p99_ms"), ("TPOT mean ms", "tpot_mean_ms"), ("TPOT p50", "tpot_p50_ms"),
            ("TPOT p99", "tpot_p99_ms"), ("wall s", "elapsed_s"), ("N", "num_requests")]
    for title, _ in cols:
        table.add_column(title, justify="left" if title == "engine" else "right")

    def fmt(v, key) -> str:
        if v is None:
            return "-"
        if key == "num_requests":
            return str(v)
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"

    for r in results:
        table.add_row(r["engine"], *[fmt(r.get(k), k) for _, k in cols[1:]])
    if ratio:
        table.add_row("[bold]speedup[/]",
                      *[f"[bold]{ratio[k]:.2f}x[/]" if k in ratio else "" for _, k in cols[1:]])
    console.print(table)
    if ratio:
        console.print("speedup: leapdecode/transformers for rates, transformers/leapdecode for latencies "
                      "(> 1: leapdecode better)")
    ld = next((r for r in results if r["engine"] == "leapdecode"), None)
    if ld:
        console.print(f"leapdecode: {ld['engine_steps']} engine steps, {ld['ms_per_step']:.1f} ms/step "
                      f"(generate wall {ld['generate_wall_s']:.2f}s, load {header['leapdecode']['load_s']:.1f}s)")
    if agree:
        console.print(f"greedy agreement with transformers: {agree['identical']}/{agree['compared']} requests "
                      f"identical, mean matching prefix {100 * agree['mean_matching_prefix']:.1f}% "
                      "(random weights give near-tied logits, so fp32 reassociation can flip a few)")


def median_run(runs: list[RunResult]) -> RunResult:
    return sorted(runs, key=lambda r: r.elapsed_s)[(len(runs) - 1) // 2]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="HF checkpoint directory (see make_random_checkpoint.py)")
    ap.add_argument("-n", "--num-requests", type=int, default=16)
    ap.add_argument("-i", "--input-len", type=int, default=128)
    ap.add_argument("-o", "--output-len", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=8, help="transformers generate batch size (the peer)")
    ap.add_argument("--dtype", default="float32", help="float32 (default: CPU), bfloat16, float16 or auto")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument("--skip-peer", action="store_true", help="leapdecode only")
    ap.add_argument("--peer-requests", type=int, default=None,
                    help="run the peer on only the first P requests (rates stay comparable; default N)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="alternate the engines R times on fresh prompts; report each engine's median run "
                         "(the faster of the middle two for an even R)")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up generations per engine before timing (0: none)")
    ap.add_argument("--profile", metavar="PATH", help="cProfile the timed leapdecode runs into PATH (.prof)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args(argv)
    for name in ("num_requests", "input_len", "output_len", "batch_size", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    peer_n = min(args.peer_requests or args.num_requests, args.num_requests)

    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    if load_before > (os.cpu_count() or 1) and torch.get_num_threads() > 1:
        print(f"note: load average {load_before:.1f} exceeds the {os.cpu_count()} cores; with other processes "
              f"competing, torch's {torch.get_num_threads()} threads wait on each other at every op "
              "(try --threads 1)", file=sys.stderr)
    vocab_hi, tok_name = prompt_vocab(args.model)
    runners = [LeapdecodeRunner(args)]
    if not args.skip_peer:
        runners.append(TransformersRunner(args))
    if args.warmup:
        warm = make_prompts(min(2, args.num_requests), args.input_len, vocab_hi, args.seed + 10_000)
        for r in runners:
            for _ in range(args.warmup):
                r.run(warm, min(4, args.output_len))
    prof = cProfile.Profile() if args.profile else None
    runs: dict[str, list[RunResult]] = {r.name: [] for r in runners}
    tokens: dict[str, list[list[int]]] = {}
    for rep in range(args.repeats):
        prompts = make_prompts(args.num_requests, args.input_len, vocab_hi, args.seed + rep)
        for r in runners:
            ps = prompts if r.name == "leapdecode" else prompts[:peer_n]
            gc.collect()
            if prof is not None and r.name == "leapdecode":
                prof.enable()
            res, toks = r.run(ps, args.output_len)
            if prof is not None and r.name == "leapdecode":
                prof.disable()
            runs[r.name].append(res)
            tokens[r.name] = toks
            print(f"[repeat {rep + 1}/{args.repeats}] {r.name}: {res.elapsed_s:.2f}s, "
                  f"{res.output_tokens_per_s:.1f} output tok/s", file=sys.stderr)

    results = [median_run(runs[r.name]).summary() for r in runners]
    for res, r in zip(results, runners):
        res["all_elapsed_s"] = [x.elapsed_s for x in runs[r.name]]
    ratio = speedups(results[0], results[1]) if len(results) > 1 else None
    agree = agreement(tokens["leapdecode"][:peer_n], tokens["transformers"]) if len(results) > 1 else None
    header = {"model": os.path.abspath(args.model), "shape": model_shape(args.model),
              "dtype": runners[0].info["dtype"], "hardware": hardware(), "num_requests": args.num_requests,
              "peer_requests": peer_n if not args.skip_peer else 0, "input_len": args.input_len,
              "output_len": args.output_len, "repeats": args.repeats, "seed": args.seed, "tokenizer": tok_name,
              "load_before": load_before,
              "leapdecode": runners[0].info}
    if len(runners) > 1:
        header["transformers"] = runners[1].info
    print_table(header, results, ratio, agree)
    report = {"header": header, "results": results, "speedup": ratio, "greedy_agreement": agree}
    if prof is not None:
        prof.dump_stats(args.profile)
        print(f"\ncProfile of the timed leapdecode run(s) -> {args.profile}; top functions by cumulative time:")
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    for r in runners:
        r.close()
    return report


if __name__ == "__main__":
    main()
