"""Lossy CPU precisions against float32 activations on the real default model: 4-bit weights with bfloat16
activations (``LLM(..., quantization="int4")``, model/int4_linear.py) and int8 activations on the GGUF's own 4- and
8-bit codes (``quantization="int8_activations"``, model/packed_linear.py): decode speed at batch 1 and 16 beside
transformers, the quality cost (perplexity on held-back text, greedy agreement), and what speculation is worth once
a step is cheaper.

    python benchmarks/cpu_int4.py                                   # every section, 2 threads
    python benchmarks/cpu_int4.py --sections speed,quality --tokens 64

Sections:
- speed: chat-templated MT-Bench turn-1 questions, greedy, EOS ignored; batch 1 one request at a time (decode
  tok/s = tokens after the first over the time after the first, as real_model.py) and batch 16 (16 requests in one
  ``generate``, whole wall time). transformers' ``generate`` on the same GGUF (float32) is the peer at batch 1.
- quality: perplexity of the first ``--ppl-tokens`` tokens of Python's language reference (``pydoc_data``, as
  kv_compression.py), and greedy agreement over ``--greedy-tokens`` new tokens from 3 prompts (first divergence
  and the share of equal tokens).
- exact: what exact attention (``batch_invariant``, on by default under int4: attention/cpu_exact.py's kernel, or
  float64 SDPA where it cannot be built) costs against float32 SDPA, for float32 and int4
  weights: batch 1 over 4 documentation prompts of 600-1,000 tokens (summaries, real_model.py's), batch 16 over
  MT-Bench questions; whole ``generate`` time, 48 tokens, 3 alternating repeats, medians.
- spec: tokens/s of n-gram prompt lookup and the EAGLE head, both under the goodput controller, over plain decoding
  in the same precision and run (batch 1; MT-Bench and HumanEval prompts), float32 and int4.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import real_model  # noqa: E402
import speculative as S  # noqa: E402
from leapdecode import LLM, SamplingParams  # noqa: E402
from leapdecode.llm import resolve_model  # noqa: E402

FORMATS = {"float32": None, "int4": "int4", "int8_activations": "int8_activations"}


def build(path: str, quantization: str | None, spec: dict | None = None, batch_invariant: bool | None = None) -> LLM:
    return LLM(path, quantization=quantization, max_model_len=4096, speculative_config=spec,
               batch_invariant=batch_invariant)


def chat(tok, questions: list[str]) -> list[list[int]]:
    return [S.render_chat(tok, [{"role": "user", "content": q}]) for q in questions]


def decode_rate(llm: LLM, prompts: list[list[int]], n: int) -> float:
    """Mean decode tokens/s at batch 1 (after the first token)."""
    rates = []
    for ids in prompts:
        out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)[0]
        m = out.metrics
        rates.append((len(out.outputs[0].token_ids) - 1) / (m.finished_time - m.first_token_time))
    return statistics.mean(rates)


def batch_rate(llm: LLM, prompts: list[list[int]], n: int) -> float:
    """Output tokens/s of one ``generate`` over all prompts (prefill included)."""
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)


def hf_rate(path: str, prompts: list[list[int]], n: int) -> float:
    """transformers' decode tokens/s at batch 1 (real_model.py's loader and timed ``generate``)."""
    model = real_model.hf_model(path).eval()
    real_model.hf_generate(model, prompts[0][:8], 2)
    return statistics.mean((n - 1) / (real_model.hf_generate(model, ids, n) - real_model.hf_generate(model, ids, 1))
                           for ids in prompts)


def speed(path: str, tok, args) -> list[tuple]:
    qs = [turns[0] for turns in S.mtbench_questions()]
    b1, b16 = chat(tok, qs[:args.prompts]), chat(tok, qs[args.prompts:args.prompts + 16])
    rows = []
    for name, q in FORMATS.items():
        llm = build(path, q)
        llm.generate([b1[0][:8]], SamplingParams(max_tokens=2), use_tqdm=False)
        r1 = decode_rate(llm, b1, args.tokens)
        r16 = batch_rate(llm, b16, args.tokens)
        rows.append((name, r1, r16))
        llm.close()
    hf = hf_rate(path, b1, args.tokens) if not args.skip_hf else None
    base1, base16 = rows[0][1], rows[0][2]
    print(f"\n## speed (batch 1: {len(b1)} prompts x {args.tokens} tokens; batch 16: one generate of 16)\n")
    print("| weights | batch 1 decode tok/s | vs float32 | vs transformers | batch 16 tok/s | vs float32 |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r1, r16 in rows:
        vs_hf = f"{r1 / hf:.2f}x" if hf else "-"
        print(f"| leapdecode {name} | {r1:.1f} | {r1 / base1:.2f}x | {vs_hf} | {r16:.1f} | {r16 / base16:.2f}x |")
    if hf:
        print(f"| transformers float32 | {hf:.1f} | {hf / base1:.2f}x | 1.00x | - | - |")
    return rows


def quality(path: str, tok, args) -> None:
    import kv_compression as K
    ids = tok(K.python_docs())["input_ids"][:args.ppl_tokens]
    qs = [turns[0] for turns in S.mtbench_questions()][40:43]
    prompts = chat(tok, qs)
    res = {}
    for name, q in FORMATS.items():
        llm = build(path, q)
        out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        lps = [float(e[t]) for e, t in zip(out.prompt_logprobs[1:], ids[1:])]
        greedy = [o.outputs[0].token_ids for o in llm.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=args.greedy_tokens, ignore_eos=True), use_tqdm=False)]
        res[name] = (math.exp(-sum(lps) / len(lps)), greedy)
        llm.close()
    ppl0, ref = res["float32"]
    print(f"\n## quality (perplexity: {len(ids)} tokens of Python's language reference; greedy: {len(prompts)} "
          f"MT-Bench prompts x {args.greedy_tokens} tokens against float32's)\n")
    print("| weights | perplexity | vs float32 | greedy: first divergence (mean) | greedy: equal tokens |")
    print("|---|---:|---:|---:|---:|")
    for name, (ppl, greedy) in res.items():
        firsts, same = [], 0
        for a, b in zip(greedy, ref):
            firsts.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
            same += sum(x == y for x, y in zip(a, b))
        total = sum(len(b) for b in ref)
        print(f"| {name} | {ppl:.4f} | {100 * (ppl / ppl0 - 1):+.2f}% | {statistics.mean(firsts):.1f} | "
              f"{same / total:.3f} |")


def exact(path: str, tok, args) -> None:
    docs = real_model.doc_tasks(tok, 4)["Summarization"]
    qs = chat(tok, [turns[0] for turns in S.mtbench_questions()][20:36])
    sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    print("\n## exact attention (batch_invariant): tokens/s, whole generate, medians of 3 alternating repeats\n")
    print("| weights | attention | batch 1 (documents) | vs SDPA | batch 16 | vs SDPA |")
    print("|---|---|---:|---:|---:|---:|")
    for name, q in FORMATS.items():
        llms = {inv: build(path, q, batch_invariant=inv) for inv in (False, True)}
        rates: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for llm in llms.values():
            llm.generate(qs[:1], SamplingParams(max_tokens=4), use_tqdm=False)
        for _ in range(3):
            for inv, llm in llms.items():
                t = time.perf_counter()
                for p in docs:
                    llm.generate([p], sp, use_tqdm=False)
                b1 = len(docs) * 48 / (time.perf_counter() - t)
                rates[inv].append((b1, batch_rate(llm, qs, 48)))
        med = {inv: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for inv, v in rates.items()}
        for inv in (False, True):
            (b1, b16), (r1, r16) = med[inv], med[False]
            print(f"| {name} | {'exact' if inv else 'SDPA float32'} | {b1:.1f} | {b1 / r1:.2f}x | {b16:.1f} | "
                  f"{b16 / r16:.2f}x |")
        for llm in llms.values():
            llm.close()


def spec(path: str, tok, args) -> None:
    tasks = {"mtbench": chat(tok, S._task_messages("mtbench")[50:50 + args.prompts]),
             "humaneval": chat(tok, S._task_messages("humaneval")[10:10 + args.prompts])}
    configs = {"plain": None,
               "ngram+ctl": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": True},
               "eagle+ctl": {"method": "eagle", "num_speculative_tokens": 4, "adaptive": True}}
    print(f"\n## speculation at batch 1 ({args.prompts} prompts per task one at a time, {args.tokens} tokens; "
          "cells: tokens/s over plain decoding in the same precision (tokens per step))\n")
    print("| weights | task | plain tok/s | " + " | ".join(c for c in configs if c != "plain") + " |")
    print("|---|---|---:|" + "---:|" * (len(configs) - 1))
    for name, q in FORMATS.items():
        llms = {c: build(path, q, s) for c, s in configs.items()}
        for llm in llms.values():
            llm.generate([tasks["mtbench"][0]], SamplingParams(max_tokens=8), use_tqdm=False)
        for task, prompts in tasks.items():
            rate, steps = {}, {}
            for c, llm in llms.items():
                t = time.perf_counter()
                outs = [llm.generate([p], SamplingParams(temperature=0.0, max_tokens=args.tokens), use_tqdm=False)[0]
                        for p in prompts]
                n = sum(len(o.outputs[0].token_ids) for o in outs)
                rate[c] = n / (time.perf_counter() - t)
                steps[c] = n / max(1, sum(o.metrics.num_steps for o in outs))
            cells = " | ".join(f"{rate[c] / rate['plain']:.2f} ({steps[c]:.2f})" for c in configs if c != "plain")
            print(f"| {name} | {task} | {rate['plain']:.1f} | {cells} |")
        for llm in llms.values():
            llm.close()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sections", default="speed,quality,exact,spec")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", type=int, default=4, help="batch-1 prompts (per task in spec)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--ppl-tokens", type=int, default=3000)
    p.add_argument("--greedy-tokens", type=int, default=128)
    p.add_argument("--skip-hf", action="store_true", help="no transformers peer")
    p.add_argument("--model", default=None)
    p.add_argument("--formats", default=",".join(FORMATS), help="of " + ", ".join(FORMATS) + " (float32 first)")
    args = p.parse_args(argv)
    for name in list(FORMATS):
        if name not in args.formats.split(","):
            del FORMATS[name]
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    info = S.hardware()
    print(f"# cpu_int4.py: {os.path.basename(path)}; {info['cpu']}, {info['cores']} cores, {args.threads} threads; "
          f"torch {info['torch']}; commit {info['commit']}; load {info['load_avg_1m']}")
    tok = LLM(path, max_model_len=64).get_tokenizer()
    sections = args.sections.split(",")
    if "speed" in sections:
        speed(path, tok, args)
    if "quality" in sections:
        quality(path, tok, args)
    if "exact" in sections:
        exact(path, tok, args)
    if "spec" in sections:
        spec(path, tok, args)


if __name__ == "__main__":
    main()
