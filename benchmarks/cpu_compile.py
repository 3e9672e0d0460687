"""Does torch.compile (inductor) help decoding on the CPU? The minimal static-cache step (static_step.py) eager vs
compiled, beside leapdecode's own decode step, batch 1, on the default model (SmolLM2-135M-Instruct).

    python benchmarks/cpu_compile.py [--threads 2] [--prompt-len 128] [--steps 64]

leapdecode's step is timed as T(n) - T(1) of ``generate`` (prefill and first token cancel); the static step by
running it ``--steps`` times from position ``--prompt-len``. Same weights (the engine's), float32. Nothing is
asserted; run it on a quiet machine (see this folder's README).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from rich.console import Console
    from rich.table import Table

    from leapdecode import LLM, SamplingParams
    from static_step import seconds_per_step
    llm = LLM(dtype="float32", device="cpu", enable_prefix_caching=False)
    prompt = list(range(100, 100 + args.prompt_len))

    def gen(n):
        t0 = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t0
    gen(4)
    ours = (statistics.median(gen(args.steps) for _ in range(args.repeats))
            - statistics.median(gen(1) for _ in range(args.repeats))) / (args.steps - 1)
    model = llm.engine.runner.model
    eager = seconds_per_step(model, 1, args.prompt_len, args.steps, mode="eager", repeats=args.repeats)
    t0 = time.perf_counter()
    compiled = seconds_per_step(model, 1, args.prompt_len, args.steps, mode="compiled", repeats=args.repeats)
    compile_s = time.perf_counter() - t0
    t = Table(title=f"CPU decode step, batch 1, {os.path.basename(str(llm.engine.cfg.model))}, float32, "
                    f"{args.threads} threads, context {args.prompt_len}..{args.prompt_len + args.steps}; load "
                    f"{os.getloadavg()[0]:.2f}")
    for c in ("step", "ms/step", "vs static eager"):
        t.add_column(c, justify="left" if c == "step" else "right")
    for label, s in (("leapdecode engine step (paged KV, sampling, bookkeeping)", ours),
                     ("static step, eager", eager),
                     (f"static step, torch.compile (inductor; compile + timing {compile_s:.0f} s)", compiled)):
        t.add_row(label, f"{s * 1e3:.1f}", f"{eager / s:.2f}x")
    Console(width=160).print(t)


if __name__ == "__main__":
    main()
