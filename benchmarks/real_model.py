"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF dequantized to float32) on CPU, beside transformers
on the same weights (its own GGUF loader), in one run (issue 12).

    python benchmarks/real_model.py                 # everything, about 10 minutes on a loaded 2-core machine
    python benchmarks/real_model.py --skip-hf --prompts-per-task 1 --spec-tokens 48    # quicker

Sections (every generation greedy, float32, torch threads = --threads):

start-up      wall time of ``leapdecode generate --max-tokens 1 "Hi"`` in a fresh process, with the conversion
              cache warm and cold (a fresh cache directory), and the warm start's breakdown measured in a fresh
              process: import, tokenizer, weights + KV cache (LLM()), first token. transformers: a fresh process
              that loads the same GGUF file and tokenizer and generates one token.
batch 1       chat-templated MT-Bench turn-1 questions, one at a time, --decode-tokens tokens each (EOS ignored):
              TTFT (prompt -> first token) and decode tokens/s after the first token; transformers ``generate``
              (TTFT: generate of 1 token; decode rate: (T(n) - T(1)) / (n - 1)).
batch 32      32 chat-templated GSM8K questions submitted together, --batch-tokens tokens each (EOS ignored):
              generated tokens / wall time; transformers: one left-padded ``generate`` call over the 32.
speculation   per task type (MT-Bench turn 2 after the model's own turn-1 answer, GSM8K, HumanEval as "complete this
              function", code edits: record_outputs.py's EDIT_TASKS, rewrites that copy most of their input;
              summarization, document QA and translation into French over sections of the Python language
              reference, ``doc_tasks``),
              --prompts-per-task prompts at batch 1, up to --spec-tokens tokens (stopping at EOS), for plain
              decoding and each drafter (ngram, suffix, recycling, auto), all five LLMs alive and run back to back
              per prompt in a rotating order: tok/s (generated tokens / wall time), tokens per step
              (RequestOutput.metrics), ms per step, ratio to plain on the same prompts, and whether the greedy
              tokens are identical to plain's.

Timings on a shared CPU are noisy; the machine, load average and versions are printed with the table.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (REPO, HERE):                         # the package, and record_outputs.py beside this file
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402
from record_outputs import EDIT_TASKS, doc_prompts, translation_prompts  # noqa: E402

BENCH = os.environ.get("LEAPDECODE_BENCH_DATA", os.path.join(os.path.dirname(REPO), "shared", "bench"))
METHODS = ("ngram", "suffix", "recycling", "auto")
# --methods names beyond the drafters': (method, options); auto_ls / auto_eagle = auto over the suffix drafter and
# layer skipping (the target's own layers from int8 weights, spec/layer_skip.py) / the EAGLE head (spec/eagle.py),
# picked per request by measured goodput; "NAME@K" caps any of them at K draft tokens (else each method's default,
# or --num-speculative-tokens when given)
VARIANTS = {"auto_fill": ("auto", {"calibrate": False}),
            "auto_ls": ("auto", {"methods": ["suffix", "layer_skip"]}),
            "auto_eagle": ("auto", {"methods": ["suffix", "eagle"]})}


def read_jsonl(*parts: str) -> list[dict]:
    with open(os.path.join(BENCH, *parts), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# -- start-up ----------------------------------------------------------------------------------------------------
BREAKDOWN = r"""
import json, time
t0 = time.perf_counter()
import leapdecode
from leapdecode.llm import LLM, resolve_model
from leapdecode.sampling_params import SamplingParams
import leapdecode.engine.engine as engine_mod
import leapdecode.engine.model_runner as runner_mod
t1 = time.perf_counter()
spent = {}
def timed(mod, name, label):
    fn = getattr(mod, name, None)
    if fn is None:
        return
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[label] = spent.get(label, 0.0) + time.perf_counter() - t
    setattr(mod, name, wrapper)
timed(engine_mod, "load_tokenizer", "tokenizer (incl. importing transformers)")
timed(runner_mod, "load_model", "weights (from the conversion cache)")
path = resolve_model(None)
t2 = time.perf_counter()
llm = LLM(path, max_num_seqs=1)
t3 = time.perf_counter()
for _ in llm.stream("Hi", SamplingParams(max_tokens=1)):
    pass
t4 = time.perf_counter()
out = {"import leapdecode (torch)": t1 - t0, "find the model": t2 - t1, **spent}
out["rest of LLM() (config, KV pool, engine)"] = (t3 - t2) - sum(spent.values())
out["first token (prefill)"] = t4 - t3
print(json.dumps(out))
"""

HF_STARTUP = r"""
import os, sys, time
t0 = time.perf_counter()
import torch, transformers
path = sys.argv[1]
d, f = os.path.dirname(path), os.path.basename(path)
tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
ids = tok("Hi", return_tensors="pt").input_ids
model.generate(ids, max_new_tokens=1, do_sample=False)
print(time.perf_counter() - t0)
"""


def timed_run(cmd: list[str], env: dict) -> tuple[float, str]:
    t = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    if r.returncode != 0:
        raise RuntimeError(f"{cmd} failed: {r.stderr[-2000:]}")
    return time.perf_counter() - t, r.stdout


def startup(model_path: str, threads: int, skip_hf: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": str(threads)}
    cli = [sys.executable, "-m", "leapdecode.cli", "generate", "--max-tokens", "1", "--no-echo", "--quiet", "Hi"]
    out: dict = {}
    timed_run(cli, env)   # make sure the user's cache is warm
    out["leapdecode generate, cache warm (s)"] = min(timed_run(cli, env)[0] for _ in range(2))
    with tempfile.TemporaryDirectory() as cold:
        out["leapdecode generate, cache cold (s)"] = timed_run(cli, {**env, "LEAPDECODE_CACHE_DIR": cold})[0]
    _, text = timed_run([sys.executable, "-c", BREAKDOWN], env)
    out["breakdown (warm)"] = json.loads(text.strip().splitlines()[-1])
    if not skip_hf:
        wall, text = timed_run([sys.executable, "-c", HF_STARTUP, model_path], env)
        out["transformers load GGUF + 1 token (s)"] = wall
    return out


# -- generation helpers ------------------------------------------------------------------------------------------
def chat_ids(tok, messages: list[dict]) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def hf_model(path: str):
    import transformers
    d, f = os.path.dirname(path), os.path.basename(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    return model


def hf_generate(model, ids: list[int], n: int) -> float:
    with torch.no_grad():
        t = time.perf_counter()
        model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2)
        return time.perf_counter() - t


def batch1(llm, model, tok, questions: list[str], n: int) -> dict:
    from leapdecode import SamplingParams
    prompts = [chat_ids(tok, user(q)) for q in questions]
    llm.generate(prompts[0][:8], SamplingParams(max_tokens=2), use_tqdm=False)   # warm-up
    ttft, decode = [], []
    for ids in prompts:
        out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)[0]
        m = out.metrics
        ttft.append(m.first_token_time - m.arrival_time)
        decode.append((len(out.outputs[0].token_ids) - 1) / (m.finished_time - m.first_token_time))
    res = {"leapdecode TTFT (ms)": 1000 * sum(ttft) / len(ttft),
           "leapdecode decode tok/s": sum(decode) / len(decode), "prompt tokens (mean)":
           sum(map(len, prompts)) / len(prompts)}
    if model is not None:
        hf_generate(model, prompts[0][:8], 2)
        t1 = [hf_generate(model, ids, 1) for ids in prompts]
        tn = [hf_generate(model, ids, n) for ids in prompts]
        res["transformers TTFT (ms)"] = 1000 * sum(t1) / len(t1)
        res["transformers decode tok/s"] = sum((n - 1) / (b - a) for a, b in zip(t1, tn)) / len(t1)
    return res


def batch32(llm, model, tok, questions: list[str], n: int) -> dict:
    from leapdecode import SamplingParams
    prompts = [chat_ids(tok, user(q)) for q in questions]
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    wall = time.perf_counter() - t
    res = {"leapdecode tok/s": sum(len(o.outputs[0].token_ids) for o in outs) / wall, "leapdecode wall (s)": wall}
    if model is not None:
        width = max(map(len, prompts))
        ids = torch.tensor([[2] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            t = time.perf_counter()
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=2)
            wall = time.perf_counter() - t
        res["transformers tok/s"] = len(prompts) * n / wall
        res["transformers wall (s)"] = wall
    return res


def spec_tasks(llm, tok, k: int, n: int) -> dict[str, list[list[int]]]:
    """Chat prompts per task type. MT-Bench: turn 2 after plain decoding's own answer to turn 1."""
    from leapdecode import SamplingParams
    mt = read_jsonl("mt_bench", "question.jsonl")[:k]
    firsts = [chat_ids(tok, user(q["turns"][0])) for q in mt]
    answers = llm.generate(firsts, SamplingParams(temperature=0.0, max_tokens=n), use_tqdm=False)
    mt_prompts = [chat_ids(tok, [{"role": "user", "content": q["turns"][0]},
                                 {"role": "assistant", "content": a.outputs[0].text},
                                 {"role": "user", "content": q["turns"][1]}]) for q, a in zip(mt, answers)]
    gsm = [chat_ids(tok, user(q["question"])) for q in read_jsonl("gsm8k", "test.jsonl")[:k]]
    he = [chat_ids(tok, user("Complete this Python function:\n```python\n" + q["prompt"] + "```"))
          for q in read_jsonl("humaneval", "HumanEval.jsonl")[:k]]
    # copy-heavy rewrites: type hints, docstrings, renames, fixes
    edits = [chat_ids(tok, user(f"{instruction}\n\n{text}")) for instruction, text in EDIT_TASKS[:k]]
    return {"MT-Bench turn 2": mt_prompts, "GSM8K": gsm, "HumanEval": he, "Code edits": edits, **doc_tasks(tok, k)}


def doc_tasks(tok, k: int) -> dict[str, list[list[int]]]:
    """Summarization, retrieval-augmented question answering and translation over sections of the Python language
    reference (record_outputs.py's ``doc_prompts`` and ``translation_prompts``: the same prompts as its
    ``summarize``, ``docqa`` and ``translate`` records)."""
    summaries, questions = doc_prompts(k)
    return {"Summarization": [chat_ids(tok, user(t)) for t in summaries],
            "Document QA": [chat_ids(tok, user(t)) for t in questions],
            "Translation": [chat_ids(tok, user(t)) for t in translation_prompts(k)]}


def speculation(path: str, tok, tasks: dict[str, list[list[int]]], n: int, kv: str, k_spec: int) -> list[dict]:
    """Every configuration's LLM is kept alive and, prompt by prompt, the configurations run back to back in a
    rotating order, so slow drifts of the machine's load hit them alike."""
    from leapdecode import LLM, SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=n)
    configs = ("plain", *METHODS)
    llms = {}
    for method in configs:
        spec = None if method == "plain" else {"method": method, "num_speculative_tokens": k_spec}
        llms[method] = LLM(path, kv_cache_memory=kv, speculative_config=spec)
        llms[method].generate([tasks["GSM8K"][0][:8]], SamplingParams(max_tokens=2), use_tqdm=False)   # warm-up
    acc = {(task, m): {"wall": 0.0, "tokens": 0, "steps": 0, "accepted": 0, "ids": []}
           for task in tasks for m in configs}
    turn = 0
    for task, prompts in tasks.items():
        for p in prompts:
            order = configs[turn % len(configs):] + configs[:turn % len(configs)]
            turn += 1
            for method in order:
                llms[method].generate([p[:8]], SamplingParams(max_tokens=1), use_tqdm=False)   # touch it first
                t = time.perf_counter()
                out = llms[method].generate([p], params, use_tqdm=False)[0]   # batch 1
                a = acc[(task, method)]
                a["wall"] += time.perf_counter() - t
                a["tokens"] += len(out.outputs[0].token_ids)
                a["steps"] += out.metrics.num_steps
                a["accepted"] += out.metrics.num_accepted_tokens
                a["ids"].append(out.outputs[0].token_ids)
                a.setdefault("per_prompt", []).append(len(out.outputs[0].token_ids) / (time.perf_counter() - t))
        for method in configs:
            a, base = acc[(task, method)], acc[(task, "plain")]
            print(f"  {task:16s} {method:10s} {a['tokens'] / a['wall']:6.1f} tok/s  "
                  f"{(a['steps'] + a['accepted']) / max(a['steps'], 1):.2f} tok/step", file=sys.stderr, flush=True)
    rows = []
    for (task, method), a in acc.items():
        base = acc[(task, "plain")]
        rows.append({"task": task, "method": method, "tok/s": a["tokens"] / a["wall"],
                     "tokens/step": (a["steps"] + a["accepted"]) / max(a["steps"], 1),
                     "ms/step": 1000 * a["wall"] / max(a["steps"], 1),
                     "ratio": (a["tokens"] / a["wall"]) / (base["tokens"] / base["wall"]),
                     # per prompt, this configuration's tok/s over plain's, measured back to back: the median
                     # is what a burst of load from other processes on the machine moves least
                     "median ratio": statistics.median(x / y for x, y in zip(a["per_prompt"], base["per_prompt"])),
                     "identical": f"{sum(x == y for x, y in zip(a['ids'], base['ids']))}/{len(a['ids'])}",
                     "tokens": a["tokens"]})
    return rows


def spec_batches(path: str, tasks: dict[str, list[list[int]]], batches: list[int], n: int, kv: str, k_spec: int | None,
                 repeats: int, methods: tuple[str, ...], per_task_b1: int = 2,
                 quantization: str | None = None) -> list[dict]:
    """Issue 19's end-to-end check: plain decoding and each drafter (adaptive controller on) at each batch size,
    in one process, every configuration's LLM alive, repeats interleaved in a rotating order. Batch 1 runs each
    task's prompts one at a time (a row per task); batch B > 1 submits B prompts drawn round-robin from the tasks
    at once, after one untimed run of a batch per configuration. Per repeat the ratio to plain is taken against
    plain's run in the same repeat; the table gives the median over repeats and the pooled ratio, by wall time and
    by the process's CPU time (with one torch thread, CPU time is the work done: on a machine shared with other
    jobs it is far less noisy than wall time, which also counts the time spent waiting for a core), and by the
    requests' time per output token after their first (TPOT: the part of a request speculation can speed up; its
    prompt's prefill is the same work either way, and on long prompts at batch 1 it is most of the wall time)."""
    from leapdecode import LLM, SamplingParams
    configs = ("plain", *methods)
    llms = {}
    for method in configs:
        name, _, k_own = method.partition("@")          # "suffix@4": suffix with at most 4 draft tokens
        base, options = VARIANTS.get(name, (name, {}))
        k = int(k_own) if k_own else k_spec
        spec = None if method == "plain" else {"method": base, "options": options,
                                               **({} if k is None else {"num_speculative_tokens": k})}
        llms[method] = LLM(path, kv_cache_memory=kv, speculative_config=spec, max_num_seqs=max(batches),
                           quantization=quantization)
        llms[method].generate([next(iter(tasks.values()))[0][:8]], SamplingParams(max_tokens=2), use_tqdm=False)
    # round robin over the tasks, every prompt of each (zip stopped at the shortest: 10 code edits capped a batch
    # of six task types at 60 prompts)
    mixed = [p for group in itertools.zip_longest(*tasks.values()) for p in group if p is not None]

    def take(pool: list, count: int, rep: int) -> list:
        """Repeat ``rep``'s ``count`` prompts: the next slice of the pool (wrapping round when it is short)."""
        start = (rep * count) % len(pool)
        return [pool[(start + i) % len(pool)] for i in range(count)]

    jobs = []                                   # (batch, task label, per repeat: groups of prompts run together)
    for b in batches:
        if b == 1:
            jobs += [(1, task, [[[p] for p in take(prompts, per_task_b1, r)] for r in range(repeats)])
                     for task, prompts in tasks.items()]
        else:
            if len(mixed) < b:
                raise SystemExit(f"batch {b} needs {b} prompts, have {len(mixed)} (raise --batch-prompts)")
            jobs.append((b, "mixed", [[take(mixed, b, r)] for r in range(repeats)]))
    rows = []
    for b, task, per_rep in jobs:
        params = SamplingParams(temperature=0.0, max_tokens=n[b])
        # per repeat: (tokens, wall, steps, accepted, drafted, ids, cpu, decode seconds, decode tokens)
        runs = {m: [] for m in configs}
        if b > 1:
            # an untimed run of the batch for each configuration first: a configuration's first batch of b paid
            # one-off costs (its KV pool's pages touched for the first time, the allocator growing), which put
            # single repeats at 0.85x or 1.3-1.8x in repeat 0 alone
            for method in configs:
                llms[method].generate(per_rep[0][0], params, use_tqdm=False)
        for rep in range(repeats):
            groups = per_rep[rep]
            order = configs[rep % len(configs):] + configs[:rep % len(configs)]
            for method in order:
                llm = llms[method]
                llm.generate([groups[0][0][:8]], SamplingParams(max_tokens=1), use_tqdm=False)   # touch it first
                spec = llm.engine.speculator
                if spec is not None:
                    # a fresh drafter for every measured run: a repeat must not draft from the global cache of
                    # outputs that an earlier repeat produced for the same prompt (greedy outputs repeat exactly)
                    spec.drafter = spec.new_drafter()
                    d0, s0 = spec.drafter_seconds, spec.num_proposals
                tok = wall = cpu = steps = acc = drafted = dec_s = dec_tok = 0
                ids = []
                for g in groups:
                    t, c = time.perf_counter(), time.process_time()
                    outs = llm.generate(g, params, use_tqdm=False)
                    wall += time.perf_counter() - t
                    cpu += time.process_time() - c
                    for o in outs:
                        tok += len(o.outputs[0].token_ids)
                        steps += o.metrics.num_steps
                        acc += o.metrics.num_accepted_tokens
                        drafted += o.metrics.num_draft_tokens
                        ids.append(o.outputs[0].token_ids)
                        # after the first token: the part of a request speculation can speed up (its prompt's
                        # prefill is the same work with or without it)
                        dec_s += o.metrics.finished_time - o.metrics.first_token_time
                        dec_tok += len(o.outputs[0].token_ids) - 1
                runs[method].append((tok, wall, steps, acc, drafted, ids, cpu, dec_s, dec_tok))
                if spec is not None:
                    print(f"    rep {rep} batch {b} {task} {method}: {(steps + acc) / max(steps, 1):.2f} tok/step, "
                          f"drafter {1000 * (spec.drafter_seconds - d0):.0f} ms over "
                          f"{spec.num_proposals - s0} drafting steps, wall {wall:.1f} s, cpu {cpu:.1f} s"
                          + (f", guard vetoes {spec.guard.num_vetoes} (cool-down {spec.guard.cooldown})"
                             if spec.guard is not None else ""),
                          file=sys.stderr, flush=True)
        plain = runs["plain"]
        for method in configs:
            r = runs[method]
            ratios = [(x[0] / x[1]) / (p[0] / p[1]) for x, p in zip(r, plain)]
            cpu_ratios = [(x[0] / x[6]) / (p[0] / p[6]) for x, p in zip(r, plain)]
            tpot_ratios = [(p[7] / max(p[8], 1)) / (x[7] / max(x[8], 1)) for x, p in zip(r, plain)]
            tok = sum(x[0] for x in r)
            wall = sum(x[1] for x in r)
            steps = sum(x[2] for x in r)
            acc = sum(x[3] for x in r)
            drafted = sum(x[4] for x in r)
            same = sum(a == b for x, p in zip(r, plain) for a, b in zip(x[5], p[5]))
            row = {"batch": b, "task": task, "method": method, "tok/s": tok / wall,
                   "ratio median": statistics.median(ratios), "ratios": ratios,
                   "cpu ratio median": statistics.median(cpu_ratios), "cpu ratios": cpu_ratios,
                   "tpot ratio median": statistics.median(tpot_ratios), "tpot ratios": tpot_ratios,
                   "cpu tok/s": sum(x[0] for x in r) / sum(x[6] for x in r),
                   "ratio pooled": (tok / wall) / (sum(p[0] for p in plain) / sum(p[1] for p in plain)),
                   "tokens/step": (steps + acc) / max(steps, 1), "verified/out": (steps + drafted) / max(tok, 1),
                   "identical": f"{same}/{sum(len(x[5]) for x in r)}"}
            rows.append(row)
            print(f"  batch {b:3d} {task:16s} {method:10s} {row['tok/s']:7.1f} tok/s  x{row['ratio median']:.3f} "
                  f"(runs {' '.join(f'{x:.2f}' for x in ratios)})  decode x{row['tpot ratio median']:.3f}  "
                  f"cpu x{row['cpu ratio median']:.3f} "
                  f"(runs {' '.join(f'{x:.2f}' for x in cpu_ratios)})  {row['tokens/step']:.2f} tok/step  "
                  f"verified/out {row['verified/out']:.2f}  identical {row['identical']}", file=sys.stderr,
                  flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf file or HF dir (default: the default model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--batch1-prompts", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--batch-tokens", type=int, default=32)
    ap.add_argument("--prompts-per-task", type=int, default=3)
    ap.add_argument("--spec-tokens", type=int, default=96)
    ap.add_argument("--num-speculative-tokens", type=int, default=6)
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--quantization", default=None, choices=["int4", "int8_activations"],
                    help="--spec-batches: LLM(quantization=...) for every configuration (plain included)")
    ap.add_argument("--skip-hf", action="store_true", help="leave transformers out")
    ap.add_argument("--skip-startup", action="store_true")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--spec-batches", default=None, help="only issue 19's check: e.g. 1,16,64 (plain and each "
                    "drafter with the adaptive controller, interleaved repeats)")
    ap.add_argument("--batch-prompts", type=int, default=22, help="--spec-batches: prompts per task type")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tokens-by-batch", default="1:64,16:48,64:32", help="--spec-batches: max tokens per batch")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--tasks", default=None, help="--spec-batches: only these task types, comma-separated "
                    "(e.g. 'Summarization,Document QA'; default: all)")
    ap.add_argument("--distinct-prompts", action="store_true", help="--spec-batches at batch 1: each repeat runs "
                    "prompts of its own (--prompts-per-task x --repeats per task type) instead of the same ones")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.spec_batches:
        return spec_batches_main(args)

    from leapdecode import LLM
    from leapdecode.llm import resolve_model
    path = resolve_model(args.model)
    results: dict = {"model": path, "machine": f"{platform.processor() or platform.machine()}, "
                     f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}",
                     "torch": torch.__version__, "threads": args.threads}
    import transformers
    results["transformers"] = transformers.__version__

    if not args.skip_startup:
        print("start-up ...", file=sys.stderr, flush=True)
        results["start-up"] = startup(path, args.threads, args.skip_hf)

    llm = LLM(path, kv_cache_memory=args.kv_cache_memory)
    tok = llm.get_tokenizer()
    model = None if args.skip_hf else hf_model(path)
    print("batch 1 ...", file=sys.stderr, flush=True)
    mt = [q["turns"][0] for q in read_jsonl("mt_bench", "question.jsonl")[10:10 + args.batch1_prompts]]
    results["batch 1"] = batch1(llm, model, tok, mt, args.decode_tokens)
    print("batch 32 ...", file=sys.stderr, flush=True)
    gsm = [q["question"] for q in read_jsonl("gsm8k", "test.jsonl")[100:100 + args.batch_size]]
    results[f"batch {args.batch_size}"] = batch32(llm, model, tok, gsm, args.batch_tokens)
    del model
    print("speculation ...", file=sys.stderr, flush=True)
    tasks = spec_tasks(llm, tok, args.prompts_per_task, args.spec_tokens)
    del llm
    results["speculation"] = speculation(path, tok, tasks, args.spec_tokens, args.kv_cache_memory,
                                         args.num_speculative_tokens)
    results["load average after"] = os.getloadavg()[0]
    print_tables(results, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def spec_batches_main(args) -> None:
    from leapdecode import LLM
    from leapdecode.llm import resolve_model
    path = resolve_model(args.model)
    batches = [int(x) for x in args.spec_batches.split(",")]
    n = {int(k): int(v) for k, v in (x.split(":") for x in args.tokens_by_batch.split(","))}
    k_spec = args.num_speculative_tokens if "--num-speculative-tokens" in sys.argv else None   # each method's own
    load0 = os.getloadavg()[0]
    llm = LLM(path, kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.batch_prompts)
    tok = llm.get_tokenizer()
    k = args.batch_prompts if any(b > 1 for b in batches) else \
        args.prompts_per_task * (args.repeats if args.distinct_prompts else 1)
    tasks = spec_tasks(llm, tok, k, 96)
    if args.tasks:
        wanted = args.tasks.split(",")
        unknown = [t for t in wanted if t not in tasks]
        if unknown:
            raise SystemExit(f"--tasks: no task {unknown}; the tasks are {list(tasks)}")
        tasks = {t: tasks[t] for t in wanted}
    del llm
    rows = spec_batches(path, tasks, batches, {b: n.get(b, 32) for b in batches}, args.kv_cache_memory, k_spec,
                        args.repeats, tuple(args.methods.split(",")), args.prompts_per_task, args.quantization)
    print(f"\nmodel: {path}; machine: {platform.machine()}, {os.cpu_count()} CPUs, load average {load0:.1f} -> "
          f"{os.getloadavg()[0]:.1f}; {args.threads} threads; k={k_spec or 'each method default'}; "
          f"{args.repeats} interleaved repeats; "
          f"weights {args.quantization or 'as loaded (float32)'}\n")
    print("| batch | task | method | tok/s wall | wall ratio to plain (median of repeats; pooled) | per repeat | "
          "decode ratio (TPOT, median) | per repeat | "
          "tok per CPU-s | CPU-time ratio (median) | per repeat | tokens/step | verified/output token | "
          "identical greedy |\n|---|---|---|---:|---:|---|---:|---|---:|---:|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['batch']} | {r['task']} | {r['method']} | {r['tok/s']:.1f} | {r['ratio median']:.2f}; "
              f"{r['ratio pooled']:.2f} | {' '.join(f'{x:.2f}' for x in r['ratios'])} | "
              f"{r['tpot ratio median']:.2f} | {' '.join(f'{x:.2f}' for x in r['tpot ratios'])} | "
              f"{r['cpu tok/s']:.1f} | "
              f"{r['cpu ratio median']:.2f} | {' '.join(f'{x:.2f}' for x in r['cpu ratios'])} | "
              f"{r['tokens/step']:.2f} | {r['verified/out']:.2f} | {r['identical']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": path, "rows": rows, "k": k_spec}, f, indent=1)


def print_tables(r: dict, args) -> None:
    print(f"\nmodel: {r['model']}\nmachine: {r['machine']} (after: {r['load average after']:.1f}); torch "
          f"{r['torch']}, transformers {r['transformers']}, {r['threads']} threads, float32\n")
    if "start-up" in r:
        s = r["start-up"]
        print("| start-up | seconds |\n|---|---:|")
        for key, value in s.items():
            if isinstance(value, dict):
                for k, v in value.items():
                    print(f"| warm breakdown: {k} | {v:.2f} |")
            else:
                print(f"| {key} | {value:.2f} |")
        print()
    b1 = r["batch 1"]
    print(f"| batch 1 ({args.batch1_prompts} MT-Bench questions, {args.decode_tokens} tokens, "
          f"~{b1['prompt tokens (mean)']:.0f} prompt tokens) | leapdecode | transformers |\n|---|---:|---:|")
    print(f"| TTFT (ms) | {b1['leapdecode TTFT (ms)']:.0f} | {b1.get('transformers TTFT (ms)', float('nan')):.0f} |")
    print(f"| decode tok/s | {b1['leapdecode decode tok/s']:.1f} | "
          f"{b1.get('transformers decode tok/s', float('nan')):.1f} |")
    bb = r[f"batch {args.batch_size}"]
    print(f"| batch {args.batch_size} ({args.batch_tokens} tokens each) tok/s | {bb['leapdecode tok/s']:.1f} | "
          f"{bb.get('transformers tok/s', float('nan')):.1f} |\n")
    print(f"| task (batch 1, {args.prompts_per_task} prompts, <= {args.spec_tokens} tokens) | method | tok/s | "
          "tokens/step | ms/step | ratio to plain (total / median per prompt) | identical greedy |\n"
          "|---|---|---:|---:|---:|---:|---:|")
    for row in r["speculation"]:
        print(f"| {row['task']} | {row['method']} | {row['tok/s']:.1f} | {row['tokens/step']:.2f} | "
              f"{row['ms/step']:.0f} | {row['ratio']:.2f} / {row['median ratio']:.2f} | {row['identical']} |")


if __name__ == "__main__":
    main()
