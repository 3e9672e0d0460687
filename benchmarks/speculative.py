"""End-to-end speculative decoding: output tokens/s with and without speculation, in one run (issue 4).

    python benchmarks/speculative.py                      # embedded model, all methods, adaptive on and off
    python benchmarks/speculative.py models               # model drafters (draft_model, layer_skip): see the end
    python benchmarks/speculative.py --model /tmp/leapdecode-ckpt/qwen2.5-0.5b --order sequential \
        --methods suffix,auto --adaptive on,off --workloads copy --n1 2 --batch-sizes 1,16 -o 32

For every engine configuration

    baseline                 LLM(model)                                  (no speculation: the peer)
    <method> adaptive=A      LLM(model, speculative_config={"method": m, "num_speculative_tokens": k, "adaptive": A})

and every workload it runs, greedy (``SamplingParams(temperature=0, max_tokens=O, ignore_eos=False)``):

    batch 1   --n1 requests, one at a time (one ``llm.generate`` call per request)
    batch B   B requests submitted together in one ``llm.generate`` call (continuous batching of B)

Batch-1 and batch-B requests are disjoint prompts, so a drafter that learns across requests (suffix, auto) never
sees the output it will be asked to draft. Per (workload, batch, config) it reports:

    tok/s        generated tokens / wall time of the run (all requests, from submission to the last output)
    ratio        tok/s / baseline tok/s of the same workload and batch (> 1: speculation is faster)
    tok/step     tokens emitted per model step per request, mean over requests of
                 ``RequestOutput.metrics.mean_accepted_per_step`` ((steps + accepted drafts) / steps; 1.0 = plain)
    accept       accepted draft tokens / draft tokens verified (engine stats)
    draft/step   draft tokens verified per request per decode step (engine ``draft_tokens`` / the requests' decode
                 steps, i.e. ``metrics.num_steps - 1``: the first token comes from the prefill step):
                 with adaptive=True this is the controller's choice, so batch 1 vs batch B shows it backing off
                 under load (adaptive=False verifies whatever the drafter proposes, up to k)
    steps        engine steps of the run
    identical    requests whose greedy token ids equal the baseline's, of all requests (lossless check)
    ms/step      wall time / engine steps
    fwd/draft/other   share of the run's wall time in the forward pass, the drafter (propose), and the rest
                 (scheduling, sampling/verification, commit, detokenization, Python overhead)
    drafter ms/step   time in ``Speculator.propose`` per engine step (all requests of the step)
    t(n) fit     the adaptive controller's step-time model after the run: c0 ms + c1 µs per token in the step

A/A control: "baseline (A/A)" is a second LLM without speculation, measured exactly like a peer; its ratio (ideally
1.00) shows the timing noise of the run (``--no-aa`` skips it).

Workloads:
    copy        code editing and repeat/summarise tasks over Python stdlib source read at runtime with
                ``inspect.getsource`` ("Here is a function: <code> Rewrite it with type hints:"), copy-heavy
    humaneval   the first HumanEval prompts (``/work/shared/bench/humaneval/HumanEval.jsonl``)
    mtbench     MT-Bench turn 2: the chat template over [turn 1, the baseline's own greedy answer to it, turn 2], so
                the prompt holds text the model may re-read (``/work/shared/bench/mt_bench/question.jsonl``)

Order: ``interleaved`` (default) keeps every configuration's LLM alive and runs the configurations back to back for
each (workload, batch), so the baseline is measured next to each peer under the same machine load;
``sequential`` builds one LLM at a time (for models too big to hold 9 copies). Timings on a shared CPU are noisy;
``--threads 1`` keeps torch's intra-op threads from waiting on each other when the machine is oversubscribed.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import inspect
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

BENCH = os.environ.get("LEAPDECODE_BENCH_DATA", os.path.join(os.path.dirname(REPO), "shared", "bench"))
METHODS = ("ngram", "suffix", "recycling", "auto")
WORKLOADS = ("copy", "humaneval", "mtbench")

# Stdlib modules whose functions' source makes the copy-heavy prompts (read at runtime with inspect.getsource):
# every public top-level function of each module whose source is 200..--max-code-chars characters, taken round-robin
# across the modules (deterministic for a given Python version).
STDLIB_MODULES = (
    "textwrap shutil json os posixpath functools heapq bisect statistics random string fnmatch glob base64 csv copy "
    "collections difflib ipaddress tempfile urllib.parse html calendar gettext locale pprint shlex zipfile colorsys "
    "dataclasses inspect linecache mimetypes platform quopri tokenize typing uuid warnings logging email.utils "
    "getpass codecs pathlib enum abc contextlib argparse configparser datetime decimal fractions hashlib hmac io "
    "operator pickle plistlib queue re secrets selectors socket struct subprocess sysconfig tarfile threading "
    "timeit traceback types wave zipapp").split()

COPY_TASKS = [
    "# Here is a function:\n{code}\n# Rewrite it with type hints:\n",
    "# Here is a function:\n{code}\n# Repeat it exactly, then add a docstring:\n",
    "# Summarize what this function does, quoting the lines you describe:\n{code}\n# Summary:\n",
    "# Here is a function:\n{code}\n# Rename its local variables and rewrite it:\n",
]


# -- machine ---------------------------------------------------------------------------------------------------
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str:
    try:
        return subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=5).stdout.strip() or "?"
    except Exception:
        return "?"


def git_dirty() -> list[str]:
    """Engine files that differ from the commit (the run imports the working tree, not the commit)."""
    try:
        out = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--", "leapdecode"], capture_output=True,
                             text=True, timeout=5).stdout
        return [line[3:] for line in out.splitlines() if line.strip()]
    except Exception:
        return []


def hardware() -> dict:
    dirty = git_dirty()
    info = {"cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "torch": torch.__version__, "python": platform.python_version(),
            "commit": git_commit() + (f"+{len(dirty)} modified engine files" if dirty else ""), "dirty": dirty}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


# -- workloads -------------------------------------------------------------------------------------------------
def stdlib_sources(max_chars: int) -> list[str]:
    per_module = []
    for name in STDLIB_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        srcs = []
        for attr, obj in sorted(vars(mod).items()):
            if attr.startswith("_") or not inspect.isfunction(obj) or obj.__module__ != mod.__name__:
                continue
            try:
                src = inspect.getsource(obj)
            except (OSError, TypeError):
                continue
            if 200 <= len(src) <= max_chars:
                srcs.append(src)
        per_module.append(srcs)
    out = []
    for i in range(max((len(s) for s in per_module), default=0)):
        out += [s[i] for s in per_module if i < len(s)]
    return out


def copy_prompts(max_chars: int) -> list[str]:
    return [COPY_TASKS[i % len(COPY_TASKS)].format(code=src.rstrip("\n"))
            for i, src in enumerate(stdlib_sources(max_chars))]


def humaneval_prompts() -> list[str]:
    path = os.path.join(BENCH, "humaneval", "HumanEval.jsonl")
    with open(path) as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def mtbench_questions() -> list[list[str]]:
    path = os.path.join(BENCH, "mt_bench", "question.jsonl")
    with open(path) as f:
        return [json.loads(line)["turns"] for line in f if line.strip()]


def render_chat(tok, messages: list[dict]) -> str | list[int]:
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


def fits(tok, prompts: list, max_prompt_tokens: int) -> list:
    out = []
    for p in prompts:
        n = len(p) if isinstance(p, list) else len(tok.encode(p))
        if 0 < n <= max_prompt_tokens:
            out.append(p)
    return out


def split(prompts: list, n1: int, nb: int, name: str) -> tuple[list, list]:
    """Disjoint prompt sets for the batch-1 and the batch-B runs; cycles (with a note) when there are too few."""
    b1, rest = prompts[:n1], prompts[n1:]
    if len(rest) < nb:
        print(f"note: workload {name} has {len(prompts)} prompts that fit; batch-B prompts repeat "
              f"({nb} requests over {len(rest) or len(prompts)} distinct)", file=sys.stderr)
        rest = rest or prompts
    bb = [rest[i % len(rest)] for i in range(nb)]
    return b1, bb


# -- one engine config -----------------------------------------------------------------------------------------
@dataclass
class Config:
    name: str
    method: str | None
    adaptive: bool | None

    def spec(self, k: int) -> dict | None:
        if self.method is None:
            return None
        return {"method": self.method, "num_speculative_tokens": k, "adaptive": self.adaptive}


@dataclass
class Timers:
    """Wall time spent in the forward pass and in the drafter, accumulated by wrapping the engine's methods."""
    forward: float = 0.0
    draft: float = 0.0

    def reset(self) -> None:
        self.forward = self.draft = 0.0


def _timed(fn, timers: Timers, attr: str):
    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            setattr(timers, attr, getattr(timers, attr) + time.perf_counter() - t0)
    return wrapper


class Runner:
    def __init__(self, cfg: Config, args) -> None:
        from leapdecode import LLM
        t0 = time.perf_counter()
        self.cfg = cfg
        self.llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                       max_num_seqs=max(args.batch_sizes), seed=0, speculative_config=cfg.spec(args.k))
        self.load_s = time.perf_counter() - t0
        eng = self.llm.engine
        self.timers = Timers()
        eng.runner.execute = _timed(eng.runner.execute, self.timers, "forward")
        if eng.speculator is not None:
            eng.speculator.propose = _timed(eng.speculator.propose, self.timers, "draft")
        # warm up (allocator, first-call costs) on a prompt that is in no workload
        self.llm.generate(["def _warmup(x):\n    return"], self.params(8), use_tqdm=False)

    @staticmethod
    def params(max_tokens: int):
        from leapdecode import SamplingParams
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=False)

    def run(self, prompts: list, batch: int, max_tokens: int) -> dict:
        eng = self.llm.engine
        before = dict(eng.stats)
        self.timers.reset()
        sp = self.params(max_tokens)
        gc.collect()
        t0 = time.perf_counter()
        if batch == 1:
            outs = [self.llm.generate([p], sp, use_tqdm=False)[0] for p in prompts]
        else:
            outs = []
            for i in range(0, len(prompts), batch):
                outs += self.llm.generate(prompts[i:i + batch], sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        d = {k: eng.stats[k] - before[k] for k in eng.stats}
        req_steps = sum(o.metrics.num_steps for o in outs)
        decode_steps = sum(max(o.metrics.num_steps - 1, 0) for o in outs)   # the first token comes from prefill
        gen = sum(len(o.outputs[0].token_ids) for o in outs)
        return {
            "wall_s": wall, "generated_tokens": gen, "tokens_per_s": gen / wall,
            "tok_per_step": statistics.fmean(o.metrics.mean_accepted_per_step for o in outs),
            "acceptance": d["accepted_tokens"] / d["draft_tokens"] if d["draft_tokens"] else None,
            "draft_per_req_step": d["draft_tokens"] / max(decode_steps, 1),
            "engine_steps": d["steps"], "request_steps": req_steps, "decode_steps": decode_steps,
            "draft_tokens": d["draft_tokens"], "accepted_tokens": d["accepted_tokens"],
            "forward_share": self.timers.forward / wall, "draft_share": self.timers.draft / wall,
            "forward_s": self.timers.forward, "draft_s": self.timers.draft,
            "finish": {r: sum(o.outputs[0].finish_reason == r for o in outs) for r in ("stop", "length")},
            "drafter_ms_per_step": 1e3 * self.timers.draft / max(d["steps"], 1),
            "ms_per_step": 1e3 * wall / max(d["steps"], 1),
            "controller": self.controller_state(),
            "token_ids": [list(o.outputs[0].token_ids) for o in outs],
            "prompt_ids": [list(o.prompt_token_ids) for o in outs],
        }

    def controller_state(self) -> dict | None:
        """The goodput controller's fitted step-time model t(n) = c0 + c1 n (seconds), after the run."""
        spec = self.llm.engine.speculator
        if spec is None or spec.controller is None:
            return None
        m = spec.controller.step_time
        return {"c0_ms": 1e3 * m.c0, "c1_us_per_token": 1e6 * m.c1}

    def close(self) -> None:
        self.llm = None
        gc.collect()


# -- lossless check --------------------------------------------------------------------------------------------
def divergence_gap(llm, prompt_ids: list[int], ref: list[int], other: list[int]) -> dict:
    """Where two greedy outputs first differ, and how far apart the two tokens are there: logprob(ref's token) -
    logprob(other's token) from a plain prefill of prompt + the common prefix on ``llm`` (no speculation). A gap
    within a few bfloat16/float rounding steps of 0 means greedy was at a (near-)tie, where any change of the
    forward pass's shapes (a verification chunk instead of one token) may flip argmax; a large gap is a real bug."""
    from leapdecode import SamplingParams
    i = next((j for j, (x, y) in enumerate(zip(ref, other)) if x != y), min(len(ref), len(other)))
    if i >= min(len(ref), len(other)):
        return {"index": i, "gap": None, "why": "one output is a prefix of the other (different stop)"}
    out = llm.generate([list(prompt_ids) + list(ref[:i])],
                       SamplingParams(temperature=0.0, max_tokens=1, logprobs=20), use_tqdm=False)[0].outputs[0]
    lp = out.logprobs[0] if out.logprobs else {}
    gap = lp[ref[i]] - lp[other[i]] if ref[i] in lp and other[i] in lp else None
    return {"index": i, "gap": gap, "ref_token": ref[i], "other_token": other[i],
            "prefill_argmax": out.token_ids[0] if out.token_ids else None}


# -- main ------------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model dir (default: the embedded default model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--adaptive", default="on,off", help="on, off or on,off")
    p.add_argument("-k", "--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--batch-sizes", default="1,64", help="1 = one request at a time; B = B requests together")
    p.add_argument("--n1", type=int, default=8, help="requests in the batch-1 runs (one after another)")
    p.add_argument("-o", "--output-len", type=int, default=64, help="max_tokens O")
    p.add_argument("--max-prompt-tokens", type=int, default=448)
    p.add_argument("--max-code-chars", type=int, default=1200, help="longest stdlib source in the copy prompts")
    p.add_argument("--order", choices=("interleaved", "sequential"), default="interleaved")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--no-aa", dest="aa", action="store_false",
                   help="skip the A/A control (a second, identical baseline LLM measured like a peer: its ratio "
                        "shows the timing noise of the run)")
    p.add_argument("--json", default=None, help="write all results (and the outputs' token ids) here")
    args = p.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in args.methods if m not in METHODS]
    if bad:
        p.error(f"unknown methods {bad}; choose from {METHODS}")
    args.adaptive = [{"on": True, "off": False}[a] for a in args.adaptive.split(",") if a]
    args.workloads = [w for w in args.workloads.split(",") if w]
    if any(w not in WORKLOADS for w in args.workloads):
        p.error(f"workloads must be among {WORKLOADS}")
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.model is None:
        from leapdecode.assets import default_model_path
        args.model = default_model_path()
    return args


def build_workloads(args, baseline: Runner) -> dict[str, tuple[list, list]]:
    tok = baseline.llm.get_tokenizer()
    nb = max(b for b in args.batch_sizes if b > 1) if any(b > 1 for b in args.batch_sizes) else 0
    n1 = args.n1 if 1 in args.batch_sizes else 0
    out = {}
    for w in args.workloads:
        if w == "copy":
            prompts = fits(tok, copy_prompts(args.max_code_chars), args.max_prompt_tokens)
        elif w == "humaneval":
            prompts = fits(tok, humaneval_prompts(), args.max_prompt_tokens)
        else:
            # turn 1 answered by the baseline itself (greedy, untimed), then turn 2 re-reads it
            qs = []
            for q in mtbench_questions():   # questions whose turn 1 leaves room for the answer and turn 2
                if len(qs) < n1 + nb and fits(tok, [render_chat(tok, [{"role": "user", "content": q[0]}])],
                                              args.max_prompt_tokens - args.output_len - 48):
                    qs.append(q)
            first = [render_chat(tok, [{"role": "user", "content": q[0]}]) for q in qs]
            answers = baseline.llm.generate(first, baseline.params(args.output_len), use_tqdm=False)
            prompts = [render_chat(tok, [{"role": "user", "content": q[0]},
                                         {"role": "assistant", "content": a.outputs[0].text},
                                         {"role": "user", "content": q[1]}]) for q, a in zip(qs, answers)]
            prompts = fits(tok, prompts, args.max_prompt_tokens)
        if not prompts:
            raise SystemExit(f"workload {w}: no prompt fits in --max-prompt-tokens {args.max_prompt_tokens}")
        out[w] = split(prompts, n1, nb, w)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from leapdecode.model.loader import load_model_config
    mcfg = load_model_config(args.model)
    args.max_model_len = min(mcfg.max_position_embeddings, args.max_prompt_tokens + args.output_len + args.k + 8)
    configs = [Config("baseline", None, None)] + ([Config("baseline (A/A)", None, None)] if args.aa else []) + [
        Config(f"{m}{'' if a else ' (fixed k)'}", m, a) for m in args.methods for a in args.adaptive]
    hw = hardware()
    header = {"model": args.model, "model_shape": {k: getattr(mcfg, k, None) for k in
                                                   ("num_layers", "hidden_size", "vocab_size")},
              **hw, "k": args.k, "O": args.output_len, "batch_sizes": args.batch_sizes, "n1": args.n1,
              "order": args.order, "max_prompt_tokens": args.max_prompt_tokens}
    t_start = time.perf_counter()
    runners: dict[str, Runner] = {}
    baseline = Runner(configs[0], args)
    runners["baseline"] = baseline
    header["dtype"] = str(baseline.llm.engine.dtype).replace("torch.", "")
    workloads = build_workloads(args, baseline)
    jobs = [(w, b) for w in args.workloads for b in args.batch_sizes]

    def prompts_for(w, b):
        return workloads[w][0] if b == 1 else workloads[w][1][:b]

    results: dict[tuple[str, int, str], dict] = {}
    if args.order == "interleaved":
        for cfg in configs[1:]:
            runners[cfg.name] = Runner(cfg, args)
        for w, b in jobs:
            for cfg in configs:
                results[(w, b, cfg.name)] = runners[cfg.name].run(prompts_for(w, b), b, args.output_len)
                print(f"  {w:9s} batch {b:3d} {cfg.name:20s} {results[(w, b, cfg.name)]['tokens_per_s']:8.1f} tok/s",
                      file=sys.stderr)
    else:
        for cfg in configs:
            r = runners.pop("baseline") if cfg.name == "baseline" else Runner(cfg, args)
            for w, b in jobs:
                results[(w, b, cfg.name)] = r.run(prompts_for(w, b), b, args.output_len)
                print(f"  {w:9s} batch {b:3d} {cfg.name:20s} {results[(w, b, cfg.name)]['tokens_per_s']:8.1f} tok/s",
                      file=sys.stderr)
            r.close()
    header["elapsed_s"] = time.perf_counter() - t_start
    header["load_avg_1m_end"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None

    rows = []
    checker = runners.get("baseline")
    for w, b in jobs:
        base = results[(w, b, "baseline")]
        for cfg in configs:
            r = results[(w, b, cfg.name)]
            same = sum(x == y for x, y in zip(r["token_ids"], base["token_ids"]))
            diffs = []
            for p_ids, x, y in zip(base["prompt_ids"], base["token_ids"], r["token_ids"]):
                if x != y:
                    if checker is None:     # sequential order: the baseline LLM is gone; rebuild one for the check
                        checker = Runner(configs[0], args)
                    diffs.append(divergence_gap(checker.llm, p_ids, x, y))
            rows.append({"workload": w, "batch": b, "config": cfg.name, "method": cfg.method,
                         "adaptive": cfg.adaptive, "requests": len(r["token_ids"]),
                         "ratio": r["tokens_per_s"] / base["tokens_per_s"], "identical": same, "divergences": diffs,
                         **{k: v for k, v in r.items() if k not in ("token_ids", "prompt_ids")}})
    print_tables(header, rows, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "rows": rows,
                       "outputs": {f"{w}/{b}/{c}": r["token_ids"] for (w, b, c), r in results.items()}}, f, indent=1)
        print(f"wrote {args.json}", file=sys.stderr)
    all_same = all(r["identical"] == r["requests"] for r in rows)
    return 0 if all_same else 1


def print_tables(header: dict, rows: list[dict], args) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    shape = header["model_shape"]
    title = (f"speculative decoding, end to end | model {os.path.basename(os.path.normpath(header['model']))} "
             f"({shape['num_layers']} layers, hidden {shape['hidden_size']}, vocab {shape['vocab_size']}, {header['dtype']})\n"
             f"{header['cpu']} ({header['cores']} cores), torch {header['torch']} threads {header['torch_threads']}, "
             f"load {header['load_avg_1m']:.1f}->{header['load_avg_1m_end']:.1f} | greedy, k={header['k']}, "
             f"O={header['O']}, batch 1 = {header['n1']} requests one at a time, batch B = B together | "
             f"order {header['order']} | commit {header['commit']} | {header['elapsed_s']:.0f} s")
    t = Table(title=title, title_justify="left")
    for col in ("workload", "batch", "config", "tok/s", "ratio", "tok/step", "accept", "draft/step", "steps",
                "ms/step", "identical", "fwd", "draft", "other", "drafter ms/step", "t(n) fit", "stop/len"):
        t.add_column(col, justify="left" if col in ("workload", "config") else "right")
    last = None
    for r in rows:
        if last is not None and (r["workload"], r["batch"]) != last:
            t.add_section()
        last = (r["workload"], r["batch"])
        ok = r["identical"] == r["requests"]
        t.add_row(r["workload"], str(r["batch"]), r["config"], f"{r['tokens_per_s']:.1f}",
                  f"{r['ratio']:.2f}", f"{r['tok_per_step']:.2f}",
                  "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}",
                  f"{r['draft_per_req_step']:.2f}", str(r["engine_steps"]), f"{r['ms_per_step']:.1f}",
                  f"[{'green' if ok else 'red'}]{r['identical']}/{r['requests']}[/]",
                  f"{r['forward_share']:.0%}", f"{r['draft_share']:.0%}",
                  f"{max(0.0, 1 - r['forward_share'] - r['draft_share']):.0%}",
                  f"{r['drafter_ms_per_step']:.2f}" if r["method"] else "-",
                  "-" if not r["controller"] else
                  f"{r['controller']['c0_ms']:.1f}+{r['controller']['c1_us_per_token']:.0f}µs·n",
                  f"{r['finish']['stop']}/{r['finish']['length']}")
    console.print(t)

    # the controller under load: draft tokens per request per step at batch 1 vs the largest batch
    bs = sorted(set(r["batch"] for r in rows))
    if len(bs) > 1:
        c = Table(title="controller under load: draft tokens verified per request per decode step "
                        f"(adaptive vs fixed k={header['k']})", title_justify="left")
        c.add_column("workload")
        c.add_column("method")
        for a in ("adaptive", "fixed k"):
            for b in bs:
                c.add_column(f"{a} b{b}", justify="right")
        by = {(r["workload"], r["batch"], r["method"], r["adaptive"]): r for r in rows}
        for w in args.workloads:
            for m in args.methods:
                cells = []
                for a in (True, False):
                    for b in bs:
                        r = by.get((w, b, m, a))
                        cells.append("-" if r is None else f"{r['draft_per_req_step']:.2f} ({r['ratio']:.2f}x)")
                c.add_row(w, m, *cells)
        console.print(c)
        console.print("cells: draft/step (ratio vs baseline)")
    console.print("ms/step: wall / engine steps; drafter ms/step: Speculator.propose per engine step (all requests); "
                  "t(n) fit: the adaptive controller's step-time model after the run (ms + µs per token in the step)")
    total = sum(r["requests"] for r in rows if r["method"] is not None)
    same = sum(r["identical"] for r in rows if r["method"] is not None)
    console.print(f"greedy outputs identical to the baseline: {same}/{total} requests")
    for r in rows:
        for d in r["divergences"]:
            gap = "n/a" if d["gap"] is None else f"{d['gap']:.4f}"
            console.print(f"  differs: {r['workload']} batch {r['batch']} {r['config']}: first at output token "
                          f"{d['index']} ({d.get('ref_token')} vs {d.get('other_token')}); logprob gap there in a "
                          f"plain prefill {gap}{' ' + d['why'] if d.get('why') else ''}")


# == model drafters (issue 13): draft_model, layer_skip, kangaroo, eagle ============================================
#
#     python benchmarks/speculative.py models                      # SmolLM2-135M-Instruct (if installed): layer_skip
#     python benchmarks/speculative.py models --model embedded --configs draft_model,draft_model+ctl
#
# Per (task, batch, temperature) every configuration runs the same chat-templated prompts (MT-Bench turn 1, GSM8K
# questions, HumanEval prompts as a user message) with all LLMs alive, the plain one first: tokens per step
# (generated tokens / the requests' model steps), tokens/s (generated tokens / wall time), the ratio to plain
# decoding's tokens/s in the same run, acceptance (accepted / verified draft tokens) and, greedy only, how many
# outputs are identical to plain decoding's. "+ctl" = the adaptive goodput controller (it may switch drafting off);
# without it every step drafts up to k. Sampled rows (T > 0) are seeded per request; their outputs differ from
# plain decoding's (same distribution, different draws), so their tokens/s also reflect different lengths.
# There is no smaller model with SmolLM2's tokenizer offline, so draft_model is measured on the embedded pair
# (leapdecode/assets: default_model as target, draft_model as draft), selected with --model embedded.

MODEL_TASKS = ("mtbench", "gsm8k", "humaneval")


def _task_messages(task: str) -> list[str]:
    if task == "mtbench":
        return [turns[0] for turns in mtbench_questions()]
    if task == "gsm8k":
        with open(os.path.join(BENCH, "gsm8k", "test.jsonl")) as f:
            return [json.loads(line)["question"] for line in f if line.strip()]
    if task == "humaneval":
        return [f"Complete this Python function:\n```python\n{p}```" for p in humaneval_prompts()]
    raise ValueError(f"unknown task {task!r}")


def _model_config(name: str, k: int, draft: str | None, threshold: float | None) -> dict | None:
    """A configuration name -> speculative_config: ``method[opt=value,...][+ctl]``, e.g. ``layer_skip+ctl``,
    ``eagle[top_k=4,k=16]+ctl`` (``k`` = num_speculative_tokens), ``layer_skip[int8=0]`` (0/1 are booleans),
    ``auto[methods=suffix|layer_skip]+ctl`` (``|`` separates a list)."""
    if name in ("plain", "plain-A/A"):          # the A/A control: a second plain LLM measured like a peer
        return None
    base, _, ctl = name.partition("+")
    method, _, opts = base.partition("[")
    cfg = {"method": method, "num_speculative_tokens": k, "adaptive": ctl == "ctl"}
    if method == "draft_model":
        cfg["model"] = draft
    if threshold is not None and method in ("draft_model", "layer_skip", "kangaroo"):
        cfg["threshold"] = threshold
    for item in filter(None, opts.rstrip("]").split(",")):
        key, _, value = item.partition("=")
        try:
            v = json.loads(value)
        except ValueError:
            v = value.split("|") if "|" in value else value
        if key in ("int8", "dynamic"):
            v = bool(v)
        cfg["num_speculative_tokens" if key == "k" else key] = v
    return cfg


def model_drafters(argv: list[str]) -> int:
    from leapdecode import LLM, SamplingParams
    from leapdecode.assets import default_chat_model_path, default_draft_model_path, default_model_path

    ap = argparse.ArgumentParser(prog="speculative.py models", description="draft_model and layer_skip, end to end")
    ap.add_argument("--model", default=None, help="target (default: SmolLM2-135M-Instruct if installed); "
                    "'embedded' = the embedded model, with the embedded draft model as draft")
    ap.add_argument("--draft", default=None, help="draft model for draft_model (default: the embedded draft)")
    ap.add_argument("--configs", default="plain-A/A,layer_skip,layer_skip+ctl",
                    help="comma-separated method[opt=value,...][+ctl] names, e.g. eagle[top_k=4,k=16]+ctl")
    ap.add_argument("--tasks", default=",".join(MODEL_TASKS))
    ap.add_argument("--n", type=int, default=2, help="prompts per task at batch 1 (one request at a time)")
    ap.add_argument("--batch-sizes", default="1")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("-o", type=int, default=64, help="max tokens per request")
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--threshold", type=float, default=None, help="drafters' confidence early exit")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = args.model
    if model == "embedded":
        model = default_model_path()
    elif model is None:
        model = default_chat_model_path() or default_model_path()
    draft = args.draft or default_draft_model_path()
    names = ["plain"] + [c for c in re.split(r",(?![^\[]*\])", args.configs) if c and c != "plain"]
    t_start = time.time()
    llms = {n: LLM(model, max_model_len=args.max_model_len,
                   speculative_config=_model_config(n, args.k, draft, args.threshold)) for n in names}
    tok = llms["plain"].get_tokenizer()
    for llm in llms.values():     # touch every configuration once before measuring
        llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    rows = []
    for task in args.tasks.split(","):
        msgs = _task_messages(task)
        for b in [int(x) for x in args.batch_sizes.split(",")]:
            count = args.n if b == 1 else b
            start = 0 if b == 1 else args.n
            chosen = [msgs[(start + i) % len(msgs)] for i in range(count)]
            prompts = [render_chat(tok, [{"role": "user", "content": m}]) for m in chosen]
            for temp in [float(x) for x in args.temperatures.split(",")]:
                params = [SamplingParams(temperature=temp, max_tokens=args.o, seed=None if temp == 0 else i)
                          for i in range(len(prompts))]
                acc = {n: {"wall": 0.0, "outs": [], "d": 0, "a": 0} for n in names}
                # batch 1: the configurations take turns on each prompt (rotating who goes first), so a burst of
                # load on the shared machine hits them alike; batch B: one call per configuration
                groups = [[i] for i in range(len(prompts))] if b == 1 else [list(range(len(prompts)))]
                for g, group in enumerate(groups):
                    for name in names[g % len(names):] + names[:g % len(names)]:
                        llm, a = llms[name], acc[name]
                        stats0 = dict(llm.engine.stats)
                        t0 = time.perf_counter()
                        a["outs"] += llm.generate([prompts[i] for i in group], [params[i] for i in group],
                                                  use_tqdm=False)
                        a["wall"] += time.perf_counter() - t0
                        a["d"] += llm.engine.stats["draft_tokens"] - stats0["draft_tokens"]
                        a["a"] += llm.engine.stats["accepted_tokens"] - stats0["accepted_tokens"]
                ref_ids = [o.outputs[0].token_ids for o in acc["plain"]["outs"]]
                ref_rate = sum(len(x) for x in ref_ids) / acc["plain"]["wall"]
                for name in names:
                    a = acc[name]
                    ids = [o.outputs[0].token_ids for o in a["outs"]]
                    tokens = sum(len(x) for x in ids)
                    steps = sum(o.metrics.num_steps for o in a["outs"])
                    rows.append({"task": task, "batch": b, "T": temp, "config": name, "requests": len(ids),
                                 "tokens": tokens, "tok_per_step": tokens / max(steps, 1),
                                 "tok_s": tokens / a["wall"], "ratio": tokens / a["wall"] / ref_rate,
                                 "accept": a["a"] / a["d"] if a["d"] else None,
                                 "identical": sum(x == y for x, y in zip(ids, ref_ids)) if temp == 0 else None})
    hw = hardware()
    print(f"model drafters | target {os.path.basename(model)} | {hw['cpu']} ({hw['cores']} cores), torch threads "
          f"{hw['torch_threads']}, load {hw['load_avg_1m']:.1f} | k={args.k}, max_tokens={args.o}, batch 1 = "
          f"{args.n} requests one at a time | commit {hw['commit']} | {time.time() - t_start:.0f} s")
    print("| task | batch | T | config | tok/step | tok/s | ratio | accept | identical |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        acc = "-" if r["accept"] is None else f"{r['accept']:.2f}"
        same = "-" if r["identical"] is None else f"{r['identical']}/{r['requests']}"
        print(f"| {r['task']} | {r['batch']} | {r['T']:g} | {r['config']} | {r['tok_per_step']:.2f} | "
              f"{r['tok_s']:.1f} | {r['ratio']:.2f} | {acc} | {same} |")
    for name in names[1:]:
        if llms[name].engine.speculator is None:
            continue
        d = llms[name].engine.speculator.drafter
        extra = f" skip set {sorted(d.skip)}" if hasattr(d, "skip") else ""
        print(f"{name}: drafter stats {getattr(d, 'stats', {})}{extra}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": hw, "rows": rows}, f, indent=1)
    return 0 if all(r["identical"] in (None, r["requests"]) for r in rows) else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "models":
        sys.exit(model_drafters(sys.argv[2:]))
    sys.exit(main())
