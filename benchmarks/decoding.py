"""Decoding strategies on the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF dequantized to float32), CPU,
beside transformers in the same run.

Beam search: ``LLM.beam_search`` (width 4) vs transformers ``generate(num_beams=4)`` on MT-Bench first turns
(chat template), every beam held to exactly ``--tokens`` new tokens (min = max, so both do the same work), at
batch 1 (prompts one after another) and batch 16 (one call; transformers left-pads). Reported: wall time, tokens/s
(new tokens of the returned best hypotheses / wall), whether the best hypothesis is identical to transformers',
and KV memory: leapdecode's peak pool use in blocks (tracked every step) beside what the same beams would hold as
independent sequences, and transformers' cache (batch x width x padded length).

"n answers at the cost of one": one request with n sampled completions (prompt blocks shared, the n rows batched)
vs one completion, at batch 1: the marginal cost of each extra answer, the bar Superposed Decoding would have to
beat.

    python benchmarks/decoding.py [--tokens 32] [--prompts 8] [--skip-hf]
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from real_model import chat_ids, hf_model, read_jsonl, user  # noqa: E402

import torch  # noqa: E402

WIDTH = 4


def beam_leapdecode(llm, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]], int]:
    """-> (wall seconds, best hypothesis per prompt, peak KV blocks in use)."""
    from leapdecode.decoding.beam_search import BeamSearchParams
    engine, bm = llm.engine, llm.engine.block_manager
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=n, min_tokens=n)
    t = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_beam_request(f"beam-{time.monotonic_ns()}-{i}", ids, params)
    order = [r for r in engine.requests]
    done, peak = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        peak = max(peak, bm.num_blocks - bm.num_free_blocks)
    return time.perf_counter() - t, [done[r] for r in order], peak


def beam_hf(model, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
    width = max(map(len, prompts))
    ids = torch.tensor([[2] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, num_beams=WIDTH, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=2)
        wall = time.perf_counter() - t
    return wall, [row[width:] for row in out.tolist()]


def independent_blocks(prompts: list[list[int]], n: int, bs: int) -> int:
    return sum(WIDTH * -(-(len(p) + n) // bs) for p in prompts)


def run_beams(llm, model, prompts: list[list[int]], n: int, batch: int) -> dict:
    bs = llm.engine.cfg.block_size
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    ours, best, peak = 0.0, [], 0
    for g in groups:
        wall, b, p = beam_leapdecode(llm, g, n)
        ours, best, peak = ours + wall, best + b, max(peak, p)
    row = {"batch": batch, "prompts": len(prompts), "leapdecode wall (s)": ours,
           "leapdecode tok/s": len(prompts) * n / ours, "peak KV blocks": peak,
           "independent-sequence KV blocks": max(independent_blocks(g, n, bs) for g in groups)}
    if model is not None:
        theirs, ref = 0.0, []
        for g in groups:
            wall, r = beam_hf(model, g, n)
            theirs, ref = theirs + wall, ref + r
        row.update({"transformers wall (s)": theirs, "transformers tok/s": len(prompts) * n / theirs,
                    "same best beam": sum(a == b for a, b in zip(best, ref)),
                    "transformers KV tokens": max(len(g) * WIDTH * (max(map(len, g)) + n) for g in groups)})
    return row


def n_samples(llm, prompts: list[list[int]], n_tokens: int, ns: tuple[int, ...]) -> list[dict]:
    from leapdecode import SamplingParams
    rows = []
    for n in ns:
        params = SamplingParams(n=n, temperature=0.8, seed=0, max_tokens=n_tokens, min_tokens=n_tokens)
        t = time.perf_counter()
        for ids in prompts:
            llm.generate([ids], params, use_tqdm=False)
        wall = time.perf_counter() - t
        rows.append({"n": n, "wall per prompt (s)": wall / len(prompts),
                     "answers/s": n * len(prompts) / wall})
    base = rows[0]["wall per prompt (s)"]
    for r in rows:
        r["cost vs n=1"] = r["wall per prompt (s)"] / base
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=8, help="prompts at batch 1 (batch 16 uses 16)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from leapdecode import LLM
    from leapdecode.llm import resolve_model
    path = resolve_model(None)
    llm = LLM(path, dtype="float32", max_model_len=1024)
    tok = llm.get_tokenizer()
    questions = [q["turns"][0] for q in read_jsonl("mt_bench", "question.jsonl")]
    prompts = [chat_ids(tok, user(q)) for q in questions[:16]]
    model = None if args.skip_hf else hf_model(path)
    llm.generate([prompts[0]], use_tqdm=False)                       # warm-up both
    if model is not None:
        beam_hf(model, prompts[:1], 2)
    rows = [run_beams(llm, model, prompts[:args.prompts], args.tokens, 1),
            run_beams(llm, model, prompts[:16], args.tokens, 16)]
    samples = n_samples(llm, prompts[:args.prompts], args.tokens, (1, 2, 4, 8))

    import transformers
    print(f"\nSmolLM2-135M-Instruct (GGUF Q4_1 -> float32), {platform.machine()} CPU, {args.threads} threads, "
          f"torch {torch.__version__}, transformers {transformers.__version__}, load {os.getloadavg()[0]:.1f}, "
          f"{args.tokens} new tokens per beam, width {WIDTH}, block size {llm.engine.cfg.block_size}\n")
    print("| batch | prompts | leapdecode tok/s | transformers tok/s | ratio | same best beam | peak KV blocks "
          "| as independent seqs | transformers KV (tokens) |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        hf = r.get("transformers tok/s", float("nan"))
        print(f"| {r['batch']} | {r['prompts']} | {r['leapdecode tok/s']:.1f} | {hf:.1f} | "
              f"{r['leapdecode tok/s'] / hf:.2f}x | {r.get('same best beam', '-')}/{r['prompts']} | "
              f"{r['peak KV blocks']} ({r['peak KV blocks'] * llm.engine.cfg.block_size} tokens) | "
              f"{r['independent-sequence KV blocks']} | {r.get('transformers KV tokens', '-')} |")
    print("\n| n sampled answers (one request, batch 1) | wall per prompt (s) | answers/s | cost vs n=1 |\n"
          "|---:|---:|---:|---:|")
    for r in samples:
        print(f"| {r['n']} | {r['wall per prompt (s)']:.2f} | {r['answers/s']:.1f} | {r['cost vs n=1']:.2f}x |")


if __name__ == "__main__":
    main()
