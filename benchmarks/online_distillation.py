"""Online distillation of the EAGLE head (issue 13, spec/online.py): acceptance before and after serving a workload.

The shipped SmolLM2-135M head (trained offline on chat, GSM8K and HumanEval answers) serves a stream of requests
it was not trained on, one at a time, twice with the same weights to start from: once fixed, once distilled online
from the committed tokens. Requests go in rounds (``--rounds``; each round is the same task list again, so the
last round shows what the head learnt about this workload, the first what it knew). Reported per round: draft
tokens accepted per drafted token and tokens per step for the fixed and the online head, the online head's
optimizer steps and the share of wall time they took, tokens/s relative to plain decoding (measured the same way,
one request at a time, before), and whether every output equals plain decoding's.

By default speculation runs without the adaptive controller (``adaptive=False``) so both heads draft on every step
and their acceptance is comparable; ``--adaptive`` turns the controller on (it drafts only where drafting pays, so
acceptance is then measured on different steps for the two heads, and speed is the column to read).

    python benchmarks/online_distillation.py                      # code edits, 3 rounds, ~6 minutes on 2 cores
    python benchmarks/online_distillation.py --tasks gsm8k --rounds 2
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def workload(name: str, tok, n: int) -> list[list[int]]:
    from record_outputs import EDIT_TASKS, load_prompts

    def chat(text: str) -> list[int]:
        text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)
    if name == "edits":
        return [chat(f"{instruction}\n\n{text}") for instruction, text in EDIT_TASKS[:n]]
    return [chat(item["turns"][0]) for item in load_prompts(name, n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default="edits", help="edits (record_outputs.EDIT_TASKS) or a record_outputs dataset")
    ap.add_argument("--requests", type=int, default=12, help="requests per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4, help="draft tokens per step")
    ap.add_argument("--online", default="{}", help="OnlineConfig fields as JSON")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--adaptive", action="store_true",
                    help="with the speculation controller (speed, not acceptance: it drafts only where it pays)")
    args = ap.parse_args()

    import torch
    torch.set_num_threads(args.threads)
    from leapdecode import LLM, SamplingParams
    from leapdecode.assets import SMOLLM2_INSTALL_HINT, default_chat_model_path
    path = default_chat_model_path()
    if path is None:
        sys.exit(f"the default model is not installed: {SMOLLM2_INSTALL_HINT}")
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    plain_llm = LLM(path)
    prompts = workload(args.tasks, plain_llm.get_tokenizer(), args.requests)
    plain_llm.generate(prompts[:1], params, use_tqdm=False)                 # warm-up
    t0 = time.perf_counter()
    plain = [list(plain_llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids) for p in prompts]
    plain_rate = sum(map(len, plain)) / (time.perf_counter() - t0)
    del plain_llm
    online = json.loads(args.online)
    rows = {}
    for label, opt in (("fixed", False), ("online", online)):
        llm = LLM(path, speculative_config={"method": "eagle", "num_speculative_tokens": args.k,
                                            "adaptive": args.adaptive, "online": opt})
        drafter = llm.engine.speculator.drafter
        t_start = time.perf_counter()
        per_round = []
        for _ in range(args.rounds):
            acc = drafted = steps = tokens = same = 0
            t0 = time.perf_counter()
            for p, ref in zip(prompts, plain):                 # one request at a time
                o = llm.generate([p], params, use_tqdm=False)[0]
                acc += o.metrics.num_accepted_tokens
                drafted += o.metrics.num_draft_tokens
                steps += o.metrics.num_steps
                tokens += len(o.outputs[0].token_ids)
                same += list(o.outputs[0].token_ids) == ref
            per_round.append((acc / max(drafted, 1), (steps + acc) / max(steps, 1), same,
                              tokens / (time.perf_counter() - t0) / plain_rate))
        wall = time.perf_counter() - t_start
        d = drafter.online
        rows[label] = (per_round, (d.steps, d.seconds / wall) if d is not None else (0, 0.0))
        print(f"{label}: {per_round}", file=sys.stderr, flush=True)

    print(f"model: {os.path.basename(path)}; head: shipped (leapdecode/assets/eagle-smollm2-135m); workload: "
          f"{args.tasks}, {len(prompts)} requests per round, batch 1, greedy, {args.max_tokens} tokens, k={args.k}; "
          f"online: {online or 'defaults'}; controller {'on' if args.adaptive else 'off'}; CPU threads "
          f"{args.threads}; plain decoding {plain_rate:.1f} tok/s")
    print("| round | fixed: accepted/drafted | fixed: tokens/step | fixed: speed vs plain | online: accepted/drafted "
          "| online: tokens/step | online: speed vs plain | identical to plain (fixed / online) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in range(args.rounds):
        f, o = rows["fixed"][0][r], rows["online"][0][r]
        print(f"| {r + 1} | {f[0]:.3f} | {f[1]:.2f} | {f[3]:.2f}x | {o[0]:.3f} | {o[1]:.2f} | {o[3]:.2f}x | "
              f"{f[2]}/{len(prompts)} / {o[2]}/{len(prompts)} |")
    steps, share = rows["online"][1]
    print(f"online optimizer steps: {steps}, {100 * share:.1f}% of the online run's wall time")


if __name__ == "__main__":
    main()
