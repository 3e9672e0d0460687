"""Host time per engine step: everything but the model's forward (scheduling, input preparation, sampling,
verification, commit, detokenization), and the host-to-device tensor traffic a step would make on a GPU.

Runs the same workload in two source trees, in fresh processes, in one go: this checkout ("after") and a git
worktree of an older commit ("before"), so the two are measured on the same machine under the same load.

    python benchmarks/step_overhead.py --before 9124815            # both trees, full table
    python benchmarks/step_overhead.py --src . --batch 1 16          # one tree only

How it measures. The embedded model (assets/default_model, 4 layers) on CPU, float32, one torch thread. B
requests of 8-token prompts run until every one is decoding, then ``--steps`` steps are timed in CPU time of the
engine's thread (``time.thread_time``: time spent waiting for a core on a shared machine does not count, nor the
grammar's mask fill, which runs in its own thread during the forward); the time inside
``LlamaForCausalLM.forward``, ``compute_logits`` and the attention backend's
once-per-step ``plan`` (device work on a GPU; the older tree built the same masks inside every layer's forward) is
subtracted, per step. Variants: ``plain`` (greedy), ``drafts`` (suffix drafter, k=4, fixed length: every step
verifies drafts), ``vetoed`` (adaptive suffix speculation that the guard has switched off), ``grammar`` (a JSON schema on every request). Host-to-device traffic is counted as tensors built
from host data inside the step (``torch.tensor``/``as_tensor``/``from_numpy``: each is a copy to the device on a
GPU) plus the runner's staging copies (one per step where the inputs go through persistent buffers).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}, "minItems": 40}},
          "required": ["name", "age", "tags"]}


def measure(batch: int, variant: str, steps: int, replay: bool = False) -> dict:
    """Runs inside the tree under test (its leapdecode is first on sys.path).

    ``replay``: after warm-up, the forward returns the hidden states and logits it computed for the first batch of
    the same shape, so no forward pass runs between two steps' host work (as on a GPU, where the forward does not
    evict the host's caches); on CPU the real forward leaves the next step's Python and data cache-cold."""
    import torch
    from torch.overrides import TorchFunctionMode

    import leapdecode
    from leapdecode import LLM, SamplingParams
    torch.set_num_threads(1)
    spec = {"drafts": {"method": "suffix", "num_speculative_tokens": 4, "adaptive": False},
            "vetoed": {"method": "suffix", "num_speculative_tokens": 4}}.get(variant)
    embedded = os.path.join(os.path.dirname(leapdecode.__file__), "assets", "default_model")
    llm = LLM(embedded, dtype="float32", speculative_config=spec, max_num_seqs=max(256, batch), max_model_len=512,
              max_num_batched_tokens=4096)
    eng = llm.engine
    if variant == "vetoed":                # the guard has switched speculation off: what is left of its cost
        eng.speculator.guard.veto_until = 1 << 60
    model = eng.runner.model
    forward_s = [0.0]

    def timed(fn):
        def wrapper(*a, **k):
            t0 = time.thread_time()
            out = fn(*a, **k)
            forward_s[0] += time.thread_time() - t0
            return out
        return wrapper

    model.forward = timed(model.forward)
    model.compute_logits = timed(model.compute_logits)
    backend = eng.runner.backend
    if hasattr(backend, "plan"):           # attention metadata built once per step: device work on a GPU
        backend.plan = timed(backend.plan)
    constructed = [0]

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.tensor, torch.as_tensor, torch.from_numpy):
                constructed[0] += 1
            return func(*args, **(kwargs or {}))

    structured = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}} if variant == "grammar" else None
    text = "def add(a, b):\n    return a + b\n" * 3           # copy-heavy, so the suffix drafter has matches
    import inspect                # as LLM.generate adds them: final outputs only (where the tree has that option)
    final_only = {"stream": False} if "stream" in inspect.signature(eng.add_request).parameters else {}
    for i in range(batch):
        eng.add_request(str(i), text if variant in ("drafts", "vetoed") else f"item {i}: the value",
                        SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=structured is None,
                                       structured=structured), **final_only)
    for _ in range(50):                                       # prefill, and a few decode steps of warm-up
        eng.step()
        if len(eng.scheduler.running) == batch and not any(s.is_prefill for s in eng.scheduler.running):
            break
    for _ in range(3):
        eng.step()
    if replay:
        _replay_forward(model, backend)
        for _ in range(3):
            eng.step()
    buffers = getattr(eng.runner, "buffers", None)
    host = []
    for _ in range(steps):                       # timed steps (no counting: a function mode slows every op)
        forward_s[0] = 0.0
        t0 = time.thread_time()
        eng.step()
        host.append(time.thread_time() - t0 - forward_s[0])
    ctor = []
    for _ in range(3):                           # counted steps
        constructed[0] = 0
        builds0 = getattr(buffers, "num_builds", 0)
        with Count():
            eng.step()
        ctor.append(constructed[0] + (getattr(buffers, "num_builds", 0) - builds0 if buffers is not None else 0))
    return {"version": getattr(leapdecode, "__file__", "?"), "host_us_median": statistics.median(host) * 1e6,
            "host_us_p90": sorted(host)[int(0.9 * (len(host) - 1))] * 1e6,
            "h2d_per_step": statistics.median(ctor), "running": len(eng.scheduler.running)}


def _replay_forward(model, backend) -> None:
    """Make the model's forward and logits return, per input shape, what they computed the first time."""
    forward, logits, plan = model.forward, model.compute_logits, getattr(backend, "plan", None)
    seen: dict = {}

    def fwd(ids, *a, **k):
        key = ("f", tuple(ids.shape))
        if key not in seen:
            if plan is not None:
                plan(a[0] if a else k["meta"])
            seen[key] = forward(ids, *a, **k)
        return seen[key]

    def lg(hidden):
        key = ("l", tuple(hidden.shape))
        if key not in seen:
            seen[key] = logits(hidden)
        return seen[key]
    model.forward, model.compute_logits = fwd, lg
    if plan is not None:
        backend.plan = lambda meta: None


def overlap(batch: int, model: str | None, tokens: int) -> dict:
    """Decode tokens/s with the synchronous step and with the overlapped step (async_scheduling), same requests."""
    import torch

    import leapdecode
    from leapdecode import LLM, SamplingParams
    torch.set_num_threads(1)
    path = model or os.path.join(os.path.dirname(leapdecode.__file__), "assets", "default_model")
    out = {}
    for mode in (False, True, False, True):
        llm = LLM(path, dtype="float32", max_model_len=1024, async_scheduling=mode, max_num_seqs=max(batch, 1))
        p = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        llm.generate([f"warm up {i}" for i in range(batch)], SamplingParams(max_tokens=4), use_tqdm=False)
        t0 = time.perf_counter()
        res = llm.generate([f"request {i}: the value of" for i in range(batch)], p, use_tqdm=False)
        dt = time.perf_counter() - t0
        out.setdefault(mode, []).append(sum(len(r.outputs[0].token_ids) for r in res) / dt)
        out.setdefault(f"ids{mode}", [r.outputs[0].token_ids for r in res])
    return {"sync": max(out[False]), "overlap": max(out[True]), "identical": out["idsFalse"] == out["idsTrue"]}


def run_tree(src: str, batch: int, variant: str, steps: int, replay: bool = False) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(src))
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps([batch, variant, steps, replay])]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"rc {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", help="a commit to compare with (checked out as a git worktree)")
    ap.add_argument("--src", default=os.path.join(os.path.dirname(__file__), ".."))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--variants", nargs="+", default=["plain", "drafts", "grammar"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3, help="alternated runs per tree; the best is reported")
    ap.add_argument("--replay-forward", action="store_true",
                    help="no forward pass between steps (each shape's first outputs are replayed): host time as it "
                         "would run beside a GPU forward, with the host's caches not evicted by a CPU forward")
    ap.add_argument("--overlap", action="store_true",
                    help="instead: decode tokens/s, synchronous vs overlapped step (this tree only)")
    ap.add_argument("--model", help="with --overlap: a model path (default: the embedded model)")
    ap.add_argument("--tokens", type=int, default=64, help="with --overlap: tokens per request")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.overlap:
        print(f"# overlapped step: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, "
              f"{args.model or 'embedded model'}, CPU float32, 1 torch thread, greedy, {args.tokens} tokens/request; "
              "best of 2 alternated runs")
        print("| batch | sync tok/s | overlapped tok/s | overlapped / sync | identical |\n|---|---|---|---|---|")
        for batch in args.batch:
            r = overlap(batch, args.model, args.tokens)
            print(f"| {batch} | {r['sync']:.1f} | {r['overlap']:.1f} | {r['overlap'] / r['sync']:.2f} | "
                  f"{r['identical']} |", flush=True)
        return
    if args.worker:
        batch, variant, steps, replay = json.loads(args.worker)
        print(json.dumps(measure(batch, variant, steps, replay)))
        return
    trees = [("after", args.src)]
    if args.before:
        path = os.path.join(tempfile.gettempdir(), f"leapdecode-before-{args.before}")
        if not os.path.exists(path):
            subprocess.run(["git", "-C", args.src, "worktree", "add", "--detach", path, args.before], check=True,
                           capture_output=True)
        trees.insert(0, ("before", path))
    import platform
    print(f"# step_overhead: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.1f}, embedded model, CPU float32, 1 torch thread, {args.steps} timed steps, "
          f"{'forward replayed (no forward between steps), ' if args.replay_forward else ''}"
          f"best of {args.repeats} alternated runs")
    print("| batch | variant | " + " | ".join(f"{n} host µs/step (p50 / p90) | {n} H2D/step" for n, _ in trees)
          + (" | after / before |" if len(trees) == 2 else " |"))
    print("|---|---|" + "---|---|" * len(trees) + ("---|" if len(trees) == 2 else ""))
    for batch in args.batch:
        for variant in args.variants:
            cells, meds = [], []
            runs = {name: [] for name, _ in trees}
            for _ in range(args.repeats):             # alternate the trees; keep each one's best run
                for name, src in trees:
                    runs[name].append(run_tree(src, batch, variant, args.steps, args.replay_forward))
            for name, _ in trees:
                ok = [r for r in runs[name] if "error" not in r]
                if not ok:
                    cells += [f"error: {runs[name][0]['error'][:60]}", "-"]
                    meds.append(None)
                    continue
                r = min(ok, key=lambda r: r["host_us_median"])
                cells += [f"{r['host_us_median']:.0f} / {r['host_us_p90']:.0f}", f"{r['h2d_per_step']:.0f}"]
                meds.append(r["host_us_median"])
            ratio = (f" {meds[1] / meds[0]:.2f} |" if len(meds) == 2 and None not in meds else
                     (" - |" if len(trees) == 2 else ""))
            print(f"| {batch} | {variant} | " + " | ".join(cells) + " |" + ratio, flush=True)


if __name__ == "__main__":
    main()
