"""Prompt chunks through the exact attention kernel (attention/cpu_exact.py) against SDPA, as they ran before.

Three tables, SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head size 64), CPU:

attention   one layer's attention of a prompt chunk of M rows after C cached keys (so M + C keys), through
            ``TorchAttention.attend`` as the engine calls it (plan, gather, mask): the kernel (rows in slabs),
            float32 SDPA (the default's path for chunks over 32 rows before), float64 SDPA (``batch_invariant=True``
            and quantization's), median of --repeats.
ttft        time to the first token on the default model, by default and under
            ``quantization="int8_activations"``: chat-templated document prompts (prefix caching off), a
            7,000-token document (four 2,048-token chunks, one run each way), and 300 new tokens after a 1,792-token
            conversation the prefix cache holds; the kernel for every chunk against SDPA for chunks over 32 rows
            (``torch_ref.KERNEL_MAX_QUERY``), alternating, median of --repeats.
cached      the same request twice, the second finding its prompt in the prefix cache (its tail then runs as a
            short chunk): are the first tokens' log-probabilities and the greedy tokens bit for bit the same?
            With SDPA for long chunks the cached run's last bits differed.

Usage: python benchmarks/prefill_exact.py [--sections attention,ttft,cached] [--threads 2] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def attention_table(repeats: int) -> None:
    from leapdecode.attention import torch_ref
    from leapdecode.attention.torch_ref import TorchAttention
    from leapdecode.engine.input_batch import InputBuffers
    from leapdecode.engine.step import ScheduledSeq, lay_out
    bs, hkv, group, d = 16, 3, 3, 64
    print("| rows | cached keys | kernel ms | float32 SDPA ms | float64 SDPA ms | SDPA32 / kernel | SDPA64 / kernel |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for m, ctx in ((64, 0), (256, 0), (512, 0), (1024, 0), (2048, 0), (300, 1500), (512, 1536), (512, 3584),
                   (2048, 2048), (2048, 6144)):
        nb = -(-(ctx + m) // bs)
        gen = torch.Generator().manual_seed(0)
        cache = torch.randn(2, nb, bs, hkv, d, generator=gen)
        q = torch.randn(m, hkv * group, d, generator=gen)
        plan = lay_out(0, bs, [ScheduledSeq(0, ctx, tuple([5] * m), tuple(range(nb)), samples=True)])
        times = {}
        for name, exact, limit in (("kernel", "kernel", None), ("sdpa32", "kernel", torch_ref.BATCH_MAX_QUERY),
                                   ("sdpa64", "always", torch_ref.BATCH_MAX_QUERY)):
            torch_ref.KERNEL_MAX_QUERY = limit
            backend = TorchAttention(exact=exact)
            meta = InputBuffers(torch.device("cpu")).build(plan, None).meta
            backend.attend(q, cache, meta, 0.125)           # the plan is built once a step, as in a forward
            ts = []
            for _ in range(repeats):
                start = time.perf_counter()
                backend.attend(q, cache, meta, 0.125)
                ts.append(time.perf_counter() - start)
            times[name] = statistics.median(ts) * 1e3
        torch_ref.KERNEL_MAX_QUERY = None
        k = times["kernel"]
        print(f"| {m} | {ctx} | {k:.2f} | {times['sdpa32']:.2f} | {times['sdpa64']:.2f} | {times['sdpa32'] / k:.2f}x | "
              f"{times['sdpa64'] / k:.2f}x |")


def _prompts(tok, count: int) -> list[tuple[str, list[int]]]:
    from real_model import chat_ids, user
    from record_outputs import doc_prompts
    summaries, questions = doc_prompts(max(count, 4))
    out = [(f"docqa {i}", chat_ids(tok, user(t))) for i, t in enumerate(questions[:count])]
    out.append(("four summarization prompts joined", chat_ids(tok, user("\n\n".join(summaries[:4])))))
    return out


def ttft_table(repeats: int) -> None:
    from leapdecode import LLM, SamplingParams
    from leapdecode.attention import torch_ref
    from leapdecode.llm import resolve_model
    from real_model import chat_ids, user
    from record_outputs import doc_prompts
    path = resolve_model(None)
    print("| weights | prompt | tokens | kernel s | SDPA for chunks > 32 s | SDPA / kernel |")
    print("|---|---|---:|---:|---:|---:|")
    params = SamplingParams(temperature=0.0, max_tokens=1)
    for quant in (None, "int8_activations"):
        cold = LLM(path, max_num_seqs=1, quantization=quant, enable_prefix_caching=False)
        tok = cold.get_tokenizer()
        summaries, questions = doc_prompts(12)
        long = chat_ids(tok, user("\n\n".join(summaries + questions)))[:7000]
        cases = [(label, None, [ids] * repeats) for label, ids in _prompts(tok, 2)]
        cases.append(("a 7,000-token document (4 chunks)", None, [long]))
        # a new turn after a conversation the prefix cache holds: 1,792 cached tokens, then ~300 new ones (a fresh
        # tail per run, so the tail is never cached)
        history = long[:1792]
        tails = [chat_ids(tok, user(q))[-300:] for q in questions]
        cases.append(("300 new tokens after 1,792 cached", history, [history + t for t in tails[:2 * repeats]]))
        warm = LLM(path, max_num_seqs=1, quantization=quant, enable_prefix_caching=True)
        sdpa = "float64" if quant else "float32"
        for label, prefix, runs in cases:
            llm = cold if prefix is None else warm
            ts = {None: [], torch_ref.BATCH_MAX_QUERY: []}
            for r in range(len(runs) if prefix is None else len(runs) // 2):
                for limit in ((None, torch_ref.BATCH_MAX_QUERY) if r % 2 == 0 else (torch_ref.BATCH_MAX_QUERY, None)):
                    torch_ref.KERNEL_MAX_QUERY = limit
                    ids = runs[r] if prefix is None else runs[2 * r + (limit is None)]
                    if prefix is not None:
                        llm.generate([prefix], params, use_tqdm=False)      # the conversation so far, cached
                    start = time.perf_counter()
                    llm.generate([ids], params, use_tqdm=False)
                    ts[limit].append(time.perf_counter() - start)
            torch_ref.KERNEL_MAX_QUERY = None
            k, s = statistics.median(ts[None]), statistics.median(ts[torch_ref.BATCH_MAX_QUERY])
            print(f"| {quant or 'default'} ({sdpa} SDPA) | {label} | {len(runs[0])} | {k:.3f} | {s:.3f} | "
                  f"{s / k:.2f}x |")
        cold.close()
        warm.close()


def cached_table() -> None:
    from leapdecode import LLM, SamplingParams
    from leapdecode.attention import torch_ref
    from leapdecode.llm import resolve_model
    path = resolve_model(None)
    print("| weights | long chunks through | first-token logprobs equal, cold vs cached | greedy 40 tokens equal |")
    print("|---|---|---:|---:|")
    for quant in (None, "int8_activations"):
        for limit in (None, torch_ref.BATCH_MAX_QUERY):
            torch_ref.KERNEL_MAX_QUERY = limit
            llm = LLM(path, max_num_seqs=1, quantization=quant)
            prompts = _prompts(llm.get_tokenizer(), 6)[:-1]
            params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=5)
            same_lp = same_tokens = 0
            for _, ids in prompts:
                cold = llm.generate([ids], params, use_tqdm=False)[0].outputs[0]
                cached = llm.generate([ids], params, use_tqdm=False)[0].outputs[0]
                same_lp += cold.logprobs[0] == cached.logprobs[0]
                same_tokens += list(cold.token_ids) == list(cached.token_ids)
            llm.close()
            how = "the kernel" if limit is None else ("float64" if quant else "float32") + " SDPA"
            print(f"| {quant or 'default'} | {how} | {same_lp}/{len(prompts)} | {same_tokens}/{len(prompts)} |")
    torch_ref.KERNEL_MAX_QUERY = None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="attention,ttft,cached")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from leapdecode.attention import cpu_exact
    if cpu_exact.kernel() is None:
        raise SystemExit("the exact kernel cannot be built here (no C++ toolchain)")
    print(f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {args.threads} threads, "
          f"load {os.getloadavg()[0]:.1f}")
    sections = args.sections.split(",")
    if "attention" in sections:
        print("\nOne layer's attention of a prompt chunk (causal), SmolLM2-135M's heads:\n")
        attention_table(args.repeats)
    if "ttft" in sections:
        print("\nTime to first token, default model, batch 1:\n")
        ttft_table(args.repeats)
    if "cached" in sections:
        print("\nThe same request cold, then with its prompt in the prefix cache (6 document-QA prompts):\n")
        cached_table()


if __name__ == "__main__":
    main()
