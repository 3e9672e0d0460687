"""Offline acceptance of the EAGLE draft head on held-out prompts, beside plain decoding and model-free drafters.

For each task (chat: MT-Bench turn 1, math: GSM8K, code: HumanEval) the first ``--per-task`` prompts of the
held-out split (``split_of`` in scripts/train_draft_head.py: never trained on) go through the target's chat
template and are answered greedily by the target (leapdecode, one batch). Each prompt + answer is then replayed
teacher-forced: the target's features come from one forward over the whole sequence, the head's committed state
from one head forward over all pairs (a causal prefix of it is exactly the state the drafter would hold), and
decoding is simulated step by step: at committed length n the drafter proposes, greedy verification accepts the
longest root path matching the target's own tokens, and n advances by accepted + 1. Reported: tokens per step
(plain decoding = 1.00) and the drafter's time per proposal on this machine.

    .venv/bin/python benchmarks/eagle_acceptance.py                       # shipped head, default model
    .venv/bin/python benchmarks/eagle_acceptance.py --head DIR --per-task 16 --json out.json
    .venv/bin/python benchmarks/eagle_acceptance.py --e2e 4               # + end-to-end tok/s at batch 1

``--e2e N`` adds an end-to-end run: N held-out prompts per task at batch 1 through ``LLM.generate`` with
``speculative_config={"method": "eagle", ...}`` beside plain decoding, back to back per prompt (rotating order),
tokens/s ratio to plain in the same run, and a check that the greedy outputs are identical.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))

import train_draft_head as tdh  # noqa: E402  (prompts and the train / held-out split)

CHAINS = (1, 2, 3, 4, 5, 6)
TREES = {  # name -> (top_k, depth, node budget, dynamic)
    "static tree 4x4 (16)": (4, 4, 16, False),
    "dynamic tree k4 d6 (16)": (4, 6, 16, True),
}
BIG_TREE = {"dynamic tree k8 d6 (32)": (8, 6, 32, True)}   # --big-tree


def heldout_prompts(tok, per_task: int) -> dict[str, list[list[int]]]:
    its = tdh.items("heldout")
    return {
        "chat": [tdh.chat_ids(tok, tdh.user(q["turns"][0])) for _, q in its["chat"][:per_task]],
        "math": [tdh.chat_ids(tok, tdh.user(q)) for _, q in its["math"][:per_task]],
        "code": [tdh.chat_ids(tok, tdh.user(q)) for _, q in its["code"][:per_task]],
    }


def simulate(propose, n0: int, ids: list[int]) -> tuple[int, int]:
    """Greedy speculative decoding replayed on the target's own tokens ``ids`` from committed length n0 + 1:
    (tokens generated, steps). ``propose(n)`` drafts after committed tokens ids[:n + 1]."""
    n, steps = n0, 0
    last = len(ids) - 1
    while n < last:
        tree = propose(n)
        a = tree.accepted_length(ids[n + 1:]) if tree else 0
        n += min(a + 1, last - n)
        steps += 1
    return last - n0, steps


@torch.no_grad()
def chains_at_every_position(head, hout: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ns: list[int],
                             depth: int) -> dict[int, list[int]]:
    """The greedy chain ``draft(head, state(n), depth)`` would give, for every committed length n in ``ns`` at
    once: the depth-d pairs of all n run as one batch, each seeing the committed keys before n and its own chain's
    earlier draft keys (the same computation as the sequential drafter, batched over positions)."""
    voc = head.draft_vocab
    N, T = len(ns), k.shape[2]
    idx = torch.tensor(ns)
    feat = hout[0, idx - 1]                                   # [N, d]: the predicted feature at n
    tok = voc[head.logits(feat).argmax(-1)]
    chains = [tok]
    base = torch.arange(T)[None, :] < idx[:, None]            # committed keys of each n
    dk = dv = None
    eye = torch.eye(N, dtype=torch.bool)
    mask_draft = torch.zeros(N, 0, dtype=torch.bool)
    for d in range(2, depth + 1):
        pos = (idx + d - 2)[None]
        mask = torch.cat([base, mask_draft, eye], 1)[None, None]
        past = (k, v) if dk is None else (torch.cat([k, dk], 2), torch.cat([v, dv], 2))
        # one "sequence" of N queries over the shared committed keys + the draft keys
        out, kk, vv = head(feat[None], tok[None], pos, past, mask)
        dk = kk if dk is None else torch.cat([dk, kk], 2)
        dv = vv if dv is None else torch.cat([dv, vv], 2)
        mask_draft = torch.cat([mask_draft, eye], 1)
        feat = out[0]
        tok = voc[head.logits(feat).argmax(-1)]
        chains.append(tok)
    stacked = torch.stack(chains, 1).tolist()
    return {n: row for n, row in zip(ns, stacked)}


def acceptance(llm, head, tasks: dict[str, list[list[int]]], max_tokens: int) -> list[dict]:
    from leapdecode import SamplingParams
    from leapdecode.spec.drafter import DraftRequest
    from leapdecode.spec.eagle import HeadState, draft
    from leapdecode.spec.ngram import NgramDrafter
    from leapdecode.spec.suffix import SuffixDrafter
    rows = []
    flat = [(t, p) for t, ps in tasks.items() for p in ps]
    t0 = time.time()
    outs = llm.generate([p for _, p in flat], SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    print(f"generated {len(flat)} held-out answers in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    acc: dict[tuple[str, str], list[float]] = {}    # (task, config) -> [tokens, steps, draft seconds, proposals]

    def add(task, name, tokens, steps, secs, props):
        a = acc.setdefault((task, name), [0, 0, 0.0, 0])
        a[0] += tokens
        a[1] += steps
        a[2] += secs
        a[3] += props

    model_free = {"ngram (prompt lookup, k=6)": lambda: NgramDrafter(), "suffix (k=6)": lambda: SuffixDrafter()}
    drafters = {task: {name: make() for name, make in model_free.items()} for task in tasks}
    for sid, ((task, prompt), out) in enumerate(zip(flat, outs)):
        ids = prompt + list(out.outputs[0].token_ids)
        if len(ids) - len(prompt) < 2:
            continue
        P = len(prompt)
        feats = tdh.record_features(llm, [ids])[0]
        with torch.no_grad():
            T = len(ids) - 1
            pos = torch.arange(T)[None]
            hout, k, v = head(feats[None, :T], torch.tensor(ids[1:])[None], pos)

        def state(n):   # pairs 0..n-1 committed: the drafter's state after committed tokens ids[:n + 1]
            return HeadState.of(k[:, :, :n], v[:, :, :n], 0, hout[0, n - 1])

        add(task, "plain", len(ids) - 1 - P, len(ids) - 1 - P, 0.0, 0)
        # chains: the greedy chain of depth k is the first k nodes of the depth-6 chain, computed for every n
        # in one batch; the drafter's own time per chain is measured on a few positions
        from leapdecode.spec.tree import DraftTree
        cache = {n: DraftTree.of(c) for n, c in
                 chains_at_every_position(head, hout, k, v, list(range(P, T)), max(CHAINS)).items()}
        secs = [0.0]
        probe = list(range(P, T, max(1, (T - P) // 4)))[:4]
        for n in probe:
            t = time.perf_counter()
            tr = draft(head, state(n), depth=max(CHAINS))[0]
            secs[0] += time.perf_counter() - t
            assert tr.tokens == cache[n].tokens, (n, tr.tokens, cache[n].tokens)   # batched == sequential

        def chain6(n):
            return cache[n]

        for kk in CHAINS:
            tokens, steps = simulate(lambda n: chain6(n).prefix(kk), P, ids)
            add(task, f"eagle chain k={kk}", tokens, steps, 0.0, 0)
        add(task, f"eagle chain k={max(CHAINS)}", 0, 0, secs[0], len(probe))
        for name, (top_k, depth, budget, dynamic) in TREES.items():
            t = [0.0, 0]

            def tree_at(n, top_k=top_k, depth=depth, budget=budget, dynamic=dynamic, t=t):
                t0_ = time.perf_counter()
                tr = draft(head, state(n), depth=depth, top_k=top_k, budget=budget, dynamic=dynamic)[0]
                t[0] += time.perf_counter() - t0_
                t[1] += 1
                return tr

            tokens, steps = simulate(tree_at, P, ids)
            add(task, f"eagle {name}", tokens, steps, t[0], t[1])
        for name, d in drafters[task].items():
            t = [0.0, 0]

            def mf(n, d=d, t=t):
                t0_ = time.perf_counter()
                dr = d.propose([DraftRequest(sid, ids[:n + 1], P, 6)])[0]
                t[0] += time.perf_counter() - t0_
                t[1] += 1
                return dr.tree

            tokens, steps = simulate(mf, P, ids)
            add(task, name, tokens, steps, t[0], t[1])
            d.finish(sid, ids, P)
        print(f"  {task} #{sid}: {len(ids) - P} answer tokens", file=sys.stderr, flush=True)
    for (task, name), (tokens, steps, s, props) in acc.items():
        rows.append({"task": task, "config": name, "tokens": tokens, "steps": steps,
                     "tokens/step": tokens / max(steps, 1), "ms/proposal": 1000 * s / props if props else None})
    return rows


def end_to_end(model, head_dir, tasks, n: int, max_tokens: int, configs: dict[str, dict | None]) -> list[dict]:
    from leapdecode import LLM, SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llms = {}
    for name, spec in configs.items():
        if spec is not None and head_dir:
            spec = {**spec, "model": head_dir}
        llms[name] = LLM(model, max_model_len=1024, speculative_config=spec)
        llms[name].generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    acc = {}
    turn = 0
    for task, prompts in tasks.items():
        for p in prompts[:n]:
            names = list(configs)
            order = names[turn % len(names):] + names[:turn % len(names)]
            turn += 1
            for name in order:
                t = time.perf_counter()
                out = llms[name].generate([p], params, use_tqdm=False)[0]
                dt = time.perf_counter() - t
                a = acc.setdefault((task, name), {"wall": 0.0, "tokens": 0, "steps": 0, "accepted": 0, "ids": []})
                a["wall"] += dt
                a["tokens"] += len(out.outputs[0].token_ids)
                a["steps"] += out.metrics.num_steps
                a["accepted"] += out.metrics.num_accepted_tokens
                a["ids"].append(list(out.outputs[0].token_ids))
            print(f"  e2e {task}: prompt done", file=sys.stderr, flush=True)
    rows = []
    for (task, name), a in acc.items():
        base = acc[(task, "plain")]
        rows.append({"task": task, "config": name, "tok/s": a["tokens"] / a["wall"],
                     "tokens/step": (a["steps"] + a["accepted"]) / max(a["steps"], 1),
                     "ratio": (a["tokens"] / a["wall"]) / (base["tokens"] / base["wall"]),
                     "identical": f"{sum(x == y for x, y in zip(a['ids'], base['ids']))}/{len(a['ids'])}"})
    for llm in llms.values():
        eng = llm.engine
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--head", default=None, help="head directory (default: the shipped one)")
    ap.add_argument("--per-task", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--e2e", type=int, default=0, help="prompts per task for the end-to-end run (0: skip)")
    ap.add_argument("--no-controller", action="store_true",
                    help="end to end: also each eagle configuration with the adaptive controller off (always drafts)")
    ap.add_argument("--big-tree", action="store_true", help="also a 32-node dynamic tree (slow on a CPU)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.big_tree:
        TREES.update(BIG_TREE)
    from leapdecode import LLM
    from leapdecode.spec.eagle import load_head_for
    llm = LLM(args.model, max_model_len=1024, enable_prefix_caching=False)
    head = load_head_for(llm.engine.runner.model, args.head, torch.float32, torch.device("cpu"))
    tasks = heldout_prompts(llm.get_tokenizer(), args.per_task)
    t0 = time.time()
    rows = acceptance(llm, head, tasks, args.max_tokens)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, torch threads {args.threads}"
    print(f"\nheld-out acceptance ({machine}; {time.time() - t0:.0f} s), "
          f"model {os.path.basename(llm.engine.cfg.model)},"
          f" head {head.num_parameters() / 1e6:.2f}M params, {args.per_task} prompts/task, <= {args.max_tokens} "
          "tokens, greedy\n")
    configs = list(dict.fromkeys(r["config"] for r in rows))
    print(f"| config | {' | '.join(tasks)} | ms/proposal |")
    print("|---|" + "---:|" * (len(tasks) + 1))
    for c in configs:
        cells = [next((f"{r['tokens/step']:.2f}" for r in rows if r["task"] == t and r["config"] == c), "")
                 for t in tasks]
        ms = [r["ms/proposal"] for r in rows if r["config"] == c and r["ms/proposal"] is not None]
        print(f"| {c} | {' | '.join(cells)} | {sum(ms) / len(ms):.1f} |" if ms else f"| {c} | {' | '.join(cells)} | |")
    result = {"acceptance": rows, "machine": machine}
    if args.e2e:
        del llm
        configs_e2e = {"plain": None,
                       "eagle chain k=4": {"method": "eagle", "num_speculative_tokens": 4},
                       "eagle tree (16)": {"method": "eagle", "num_speculative_tokens": 16, "top_k": 4,
                                           "depth": 6}}
        if args.no_controller:
            configs_e2e.update({f"{name}, controller off": {**spec, "adaptive": False}
                                for name, spec in list(configs_e2e.items()) if spec is not None})
        e2e = end_to_end(args.model, args.head, tasks, args.e2e, args.max_tokens, configs_e2e)
        print(f"\nend to end, batch 1, greedy, {args.e2e} held-out prompts/task, same run\n")
        print("| task | config | tok/s | tokens/step | ratio to plain | identical |")
        print("|---|---|---:|---:|---:|---:|")
        for r in e2e:
            print(f"| {r['task']} | {r['config']} | {r['tok/s']:.1f} | {r['tokens/step']:.2f} | {r['ratio']:.2f} | "
                  f"{r['identical']} |")
        result["e2e"] = e2e
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
