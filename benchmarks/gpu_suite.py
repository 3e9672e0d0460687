"""The GPU suite: every number of the GPU fast-path issue in one run on a bare H100/H200 (random weights at real
shapes, built on the machine; nothing downloaded). ``benchmarks/gpu_suite.sh`` runs the GPU tests first, then this.

    python benchmarks/gpu_suite.py --out DIR          # all sections (about 5 minutes on an H200)
    python benchmarks/gpu_suite.py --sections batch1 --models llama-3.2-1b

Sections (run in the order --sections gives; each prints one table; all numbers are also written to
DIR/gpu_suite.json, pictures to DIR/*.png):

copy     Device-to-device copy bandwidth (read + written bytes): the roofline every fraction below refers to.
batch1   One request, greedy, random prompt of --prompt-len tokens, for the Llama-3.2-1B, Qwen2.5-0.5B and
         Llama-3.1-8B shapes in bf16. leapdecode four ways (CUDA graphs, synchronous step; graphs + overlapped
         step; graphs with the model's elementwise ops unfused; eager), the GPU time of its graph alone (replayed
         back to back: the step minus the host's work), the minimal static-cache step in plain PyTorch ops
         (benchmarks/static_step.py) replayed as a CUDA graph, and transformers ``generate`` (eager, dynamic cache)
         on a model of the same shape. Engine decode time = T(n) - T(1) (prefill and first token cancel).
         Roofline fraction = (weights + KV attended) bytes per step x steps/s / copy bandwidth.
compiled The static step under torch.compile(mode="reduce-overhead"), run last (it compiles for tens of seconds).
batched  leapdecode (graphs + overlap) at batch 16/64/256 with 512 and 2048-token prompts, the GPU time of its
         decode graph alone (the last step's graph replayed back to back), transformers up to batch
         --peer-max-batch: output tokens/s and roofline fraction.
tune     The decode kernel's block_n / num_warps / num_stages variants at --tune-batches x --tune-contexts.
kernel   The paged split-KV decode kernel alone vs SDPA (default and cuDNN) and flex_attention on dense K/V
         (benchmarks/decode_roofline.py's kernel section), Llama-3-8B heads, GB/s.
spec     Speculative decoding on the GPU with the embedded real model (leapdecode/assets/default_model, trained on
         Python code; its draft model for draft_model speculation) on Python source prompts, greedy, batch 1 and
         64 (at least --spec-prompts prompts; batch 1 runs them one at a time): tokens/s of each method over plain
         decoding in the same run (the adaptive controller's choice, and always drafting k = 4), with
         accepted/drafted tokens. Warm-up over every prompt first; each timed run starts from empty drafter caches.
kvquant  Quantized KV caches (dequantized inside the Triton kernels) beside bf16: the decode kernel alone for fp8,
         int8 and int4 with 2 salient tokens (--kv-kernel-formats), each reading --kv-code-bytes bytes of codes a
         load (32 q / 8 kv heads of --kv-head-dims, --kvfp8-batches x --kvfp8-contexts, CUDA graphs) and the
         engine's batched decode (--batched-models, --kv-engine-batches, 2048-token prompts) for
         --kv-engine-formats (fp8, fp8 with 256 recent tokens, int8, int4): us / tok/s, bytes read, speed-up, the
         largest difference of the fp8 kernel's output from bf16's, bytes per token.

Nothing is asserted here: correctness is the GPU tests' job.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import os
import statistics
import sys
import time

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
for p in (REPO, BENCH):
    if p not in sys.path:
        sys.path.insert(0, p)

import decode_roofline as dr  # noqa: E402

SECTIONS = ("copy", "batch1", "kernel", "batched", "tune", "spec", "kvquant", "compiled")
GIB = 1 << 30
DEVICE, BACKEND = "cuda", "triton"      # (a CPU smoke test of the suite's own logic switches these)


# -- helpers -------------------------------------------------------------------------------------------------------
def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def engine(path: str, max_len: int, batch: int, **kw):
    from leapdecode import LLM
    blocks = batch * (-(-max_len // 16) + 1) + 16
    return LLM(path, dtype="bfloat16", device=DEVICE, load_format="dummy", attention_backend=BACKEND,
               max_model_len=max_len, enable_prefix_caching=False, max_num_seqs=batch,
               max_num_batched_tokens=max(8192, max_len), num_kv_blocks=blocks, **kw)


@contextlib.contextmanager
def fused_ops(on: bool):
    """The model's fused Triton elementwise kernels on or off (model/layers.py FUSED_OPS) for the block."""
    from leapdecode.model import layers
    old, layers.FUSED_OPS = layers.FUSED_OPS, on
    try:
        yield
    finally:
        layers.FUSED_OPS = old


def replay_seconds(graph, n: int = 200) -> float:
    """Seconds per replay of a captured graph, replayed back to back (device time, no host work between)."""
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def hf_model(shape: str):
    import transformers
    from make_random_checkpoint import hf_config
    with torch.device(DEVICE):
        return transformers.AutoModelForCausalLM.from_config(hf_config(shape), dtype=torch.bfloat16).eval()


class Report:
    """Tables to the console as they come, and every row to one JSON file."""

    def __init__(self, out: str | None, width: int = 200) -> None:
        from rich.console import Console
        self.console = Console(width=width)
        self.out = out
        self.data: dict = {"sections": {}}

    def table(self, section: str, title: str, columns: list[str], rows: list[dict]) -> None:
        from rich.table import Table
        t = Table(title=title)
        for c in columns:
            t.add_column(c, justify="left" if c in ("model", "engine", "impl", "method") else "right")
        for r in rows:
            t.add_row(*[_fmt(r.get(c, "")) for c in columns])
        self.console.print(t)
        self.data["sections"].setdefault(section, []).extend(rows)
        self.save()

    def note(self, text: str) -> None:
        self.console.print(text)
        self.data.setdefault("notes", []).append(text)

    def save(self) -> None:
        if self.out:
            with open(os.path.join(self.out, "gpu_suite.json"), "w", encoding="utf-8") as f:
                json.dump(self.data, f, indent=1, default=str)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:,.1f}"
    return str(v)


# -- sections ------------------------------------------------------------------------------------------------------
def shape(args, name: str):
    """(weightless model directory, byte counts, vocabulary size) of a random-weight model shape."""
    from make_random_checkpoint import make_config_dir
    return (make_config_dir(name, os.path.join(args.ckpt_root, name)), dr.count_bytes(name),
            dr.model_config(name).vocab_size)


def section_batch1(args, rep: Report, copy_bw: float) -> None:
    from static_step import seconds_per_step
    rows = []
    for name in args.models:
        path, mb, vocab = shape(args, name)
        prompts = dr.prompts_for(1, args.prompt_len, vocab, seed=1)
        new = args.output_len
        per_step = dr.step_bytes(mb, 1, args.prompt_len, new)
        max_len = args.prompt_len + new + 32
        results: dict[str, float] = {}

        def add(label, secs_per_step):
            results[label] = secs_per_step
        for label, kw, fused in (("leapdecode graphs", {}, True),
                                 ("leapdecode graphs+overlap", dict(async_scheduling=True), True),
                                 ("leapdecode graphs, unfused ops", {}, False),
                                 ("leapdecode eager", dict(enforce_eager=True), True)):
            try:
                with fused_ops(fused):
                    llm = engine(path, max_len, 1, **kw)
                    add(label, dr.engine_decode_seconds(llm, prompts, new, args.repeats, warmup=4) / (new - 1))
                if label == "leapdecode graphs":
                    g = llm.engine.runner.graphs
                    rep.note(f"{name}: CUDA graphs: {'none' if g is None else len(g.graphs)} captured in "
                             f"{0 if g is None else g.capture_seconds:.2f} s, "
                             f"{0 if g is None else g.num_replays} replays")
                    if g is not None:       # the step's GPU time alone: the graph replayed back to back
                        add("(GPU only) leapdecode graph replay", replay_seconds(g.graphs[(1, 1)].graph))
                    with fused_ops(False):   # the minimal step written in plain PyTorch ops, as a peer would be
                        add("static step, CUDA graph", seconds_per_step(llm.engine.runner.model, 1,
                                                                        args.prompt_len, new))
                del llm
            except Exception as e:  # noqa: BLE001 - report and go on with the next engine
                rep.note(f"{name} {label}: error {type(e).__name__}: {e}")
            free()
        if not args.no_peer:
            try:
                hf = hf_model(name)
                add("transformers generate", dr.hf_decode_seconds(hf, prompts, args.peer_output_len, args.repeats,
                                                                  warmup=2) / (args.peer_output_len - 1))
                del hf
            except Exception as e:  # noqa: BLE001
                rep.note(f"{name} transformers: error {type(e).__name__}: {e}")
            free()
        peer = results.get("transformers generate")
        static = results.get("static step, CUDA graph")
        for label, s in results.items():
            rows.append(dict(model=name, engine=label, **{"tok/s": 1 / s, "ms/step": s * 1e3,
                             "GB/step": per_step / 1e9, "roofline": per_step / s / copy_bw,
                             "vs transformers": peer / s if peer else "", "vs static": static / s if static else ""}))
    rep.table("batch1", f"Batch-1 decode, bf16, random weights, prompt {args.prompt_len}, {args.output_len} new "
              f"(transformers {args.peer_output_len}); copy roofline {copy_bw / 1e9:,.0f} GB/s",
              ["model", "engine", "tok/s", "ms/step", "GB/step", "roofline", "vs transformers", "vs static"], rows)


def section_compiled(args, rep: Report, copy_bw: float) -> None:
    """The static step under torch.compile (last: compiling takes tens of seconds per model)."""
    from static_step import seconds_per_step
    rows = []
    for name in args.compile_models:
        path, mb, _ = shape(args, name)
        per_step = dr.step_bytes(mb, 1, args.prompt_len, args.output_len)
        llm = engine(path, args.prompt_len + args.output_len + 32, 1, enforce_eager=True)
        t0 = time.perf_counter()
        with fused_ops(False):        # plain PyTorch ops: inductor fuses them itself
            s = seconds_per_step(llm.engine.runner.model, 1, args.prompt_len, args.output_len, mode="compiled")
        rep.note(f"{name}: torch.compile of the static step: {time.perf_counter() - t0:.0f} s (compile + timing)")
        ours = {r["engine"]: r["ms/step"] / 1e3 for r in rep.data["sections"].get("batch1", [])
                if r["model"] == name and r["engine"].startswith("leapdecode graphs")}
        rows.append(dict(model=name, engine="static step, torch.compile", **{
            "tok/s": 1 / s, "ms/step": s * 1e3, "roofline": per_step / s / copy_bw,
            "leapdecode best vs it": s / min(ours.values()) if ours else ""}))
        del llm
        free()
    rep.table("compiled", "The minimal static-cache step under torch.compile(mode='reduce-overhead'), batch 1",
              ["model", "engine", "tok/s", "ms/step", "roofline", "leapdecode best vs it"], rows)


def section_batched(args, rep: Report, copy_bw: float) -> None:
    rows = []
    for name in args.batched_models:
        path, mb, vocab = shape(args, name)
        new = args.batched_output_len
        max_batch, max_ctx = max(args.batch_sizes), max(args.contexts)
        try:
            llm = engine(path, max_ctx + new + 32, max_batch, async_scheduling=True)
        except Exception as e:  # noqa: BLE001
            rep.note(f"{name} batched: engine error {type(e).__name__}: {e}")
            continue
        results = []
        for batch in args.batch_sizes:
            for ctx in args.contexts:
                prompts = dr.prompts_for(batch, ctx, vocab, seed=2)
                try:
                    s = dr.engine_decode_seconds(llm, prompts, new, 1, warmup=4) / (new - 1)
                    results.append((batch, ctx, "leapdecode graphs+overlap", s))
                    g = llm.engine.runner.graphs
                    bucket = g.batch_bucket(batch) if g is not None else None
                    if bucket is not None:   # the GPU's share: the last decode step's graph replayed back to back
                        results.append((batch, ctx, "(GPU only) graph replay",
                                        replay_seconds(g.graphs[(bucket, 1)].graph)))
                except Exception as e:  # noqa: BLE001
                    rep.note(f"{name} batch {batch} ctx {ctx}: error {type(e).__name__}: {e}")
        del llm
        free()
        if not args.no_peer:
            try:
                hf = hf_model(name)
                for batch in [b for b in args.batch_sizes if b <= args.peer_max_batch]:
                    for ctx in args.contexts:
                        prompts = dr.prompts_for(batch, ctx, vocab, seed=2)
                        s = dr.hf_decode_seconds(hf, prompts, args.peer_output_len, 1, warmup=2)
                        s /= args.peer_output_len - 1
                        results.append((batch, ctx, "transformers generate", s))
                del hf
            except Exception as e:  # noqa: BLE001
                rep.note(f"{name} batched transformers: error {type(e).__name__}: {e}")
            free()
        peers = {(b, c): s for b, c, e, s in results if e == "transformers generate"}
        for batch, ctx, label, s in sorted(results):
            per_step = dr.step_bytes(mb, batch, ctx, new)
            peer = peers.get((batch, ctx))
            rows.append(dict(model=name, batch=batch, context=ctx, engine=label, **{
                "tok/s": batch / s, "ms/step": s * 1e3, "GB/step": per_step / 1e9, "roofline": per_step / s / copy_bw,
                "vs transformers": peer / s if peer and label.startswith("leapdecode") else ""}))
    rep.table("batched", f"Batched decode, bf16, random weights, {args.batched_output_len} new tokens "
              f"(transformers {args.peer_output_len})",
              ["model", "batch", "context", "engine", "tok/s", "ms/step", "GB/step", "roofline", "vs transformers"],
              rows)


def section_kernel(args, rep: Report, copy_bw: float) -> None:
    ns = argparse.Namespace(kernel_batches=args.kernel_batches, kernel_contexts=args.kernel_contexts,
                            kernel_max_gib=args.kernel_max_gib, no_flex=False, flex_contexts=args.flex_contexts,
                            tune=False, graphs=True)
    rows = dr.section_kernel(ns, rep.console, copy_bw)
    rep.data["sections"]["kernel"] = rows
    best = {}
    for r in rows:
        if r["impl"].startswith("SDPA"):
            key = (r["batch"], r["context"])
            best[key] = max(best.get(key, 0.0), r["gbs"])
    summary = [dict(batch=r["batch"], context=r["context"], **{"ours GB/s": r["gbs"], "roofline": r["roofline"],
                    "best SDPA GB/s": best.get((r["batch"], r["context"]), ""),
                    "vs best SDPA": r["gbs"] / best[(r["batch"], r["context"])]
                    if best.get((r["batch"], r["context"])) else ""})
               for r in rows if r["impl"] == "ours"]
    rep.table("kernel_summary", "Decode kernel vs the best dense SDPA (default or cuDNN) on the same keys",
              ["batch", "context", "ours GB/s", "roofline", "best SDPA GB/s", "vs best SDPA"], summary)


def section_kvquant(args, rep: Report, copy_bw: float) -> None:
    import triton.testing

    from leapdecode.attention import kv_quant as kq
    from leapdecode.attention import triton_kernels as tk
    H, HKV, BS = 32, 8, 16      # Llama-3-8B / Llama-3.2-1B heads: head_dim 128 / 64
    rows = []
    for D in args.kv_head_dims:
        for batch in args.kvfp8_batches:
            for ctx in args.kvfp8_contexts:
                nblk = batch * (-(-ctx // BS))
                kv = torch.randn(2, nblk, BS, HKV, D, dtype=torch.bfloat16, device="cuda")
                codes, scales = kq.fp8_quantize(kv)
                tables = torch.randperm(nblk, device="cuda", dtype=torch.int64).to(torch.int32).view(batch, -1)
                seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
                qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
                pos = torch.full((batch,), ctx - 1, dtype=torch.int64, device="cuda")
                q = torch.randn(batch, H, D, dtype=torch.bfloat16, device="cuda")
                caches = {"bf16": (kv, None), "fp8": (codes, tk.QuantizedKV("fp8", scales))}
                if "int" in args.kv_kernel_formats:      # timing only: random codes on random grids (the tests check
                    u8 = lambda *shape: torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda")  # noqa: E731
                    grids = dict(key_grid=0.01 * torch.randn(nblk, 2, HKV, D, device="cuda").half(),   # the values)
                                 value_grid=0.01 * torch.randn(nblk, 2, BS, HKV, device="cuda").half())
                    caches["int8"] = (u8(2, nblk, BS, HKV, D), tk.QuantizedKV("int8", **grids))
                    sal = torch.tensor([3, 9], dtype=torch.uint8, device="cuda")[None, :, None].expand(nblk, 2, HKV)
                    caches["int4+2 salient"] = (u8(2, nblk, BS, HKV, D // 2), tk.QuantizedKV(
                        "int4", **grids, salient=sal.contiguous(), residual=u8(2, nblk, 2, HKV, D // 2)))
                # each quantized format with its codes read 1, 2, 4 or 8 bytes to a load (the kernels' ``code_bytes``)
                fmts = ["bf16"] + [f"{f}, {cb} B/load" for f in caches if f != "bf16" for cb in args.kv_code_bytes]
                if args.kv_grid_per_block:          # int keys' grids loaded once per block (tk.GRID_PER_BLOCK)
                    fmts += [f"{f}, {cb} B/load, grids per block" for f in caches if f.startswith("int")
                             for cb in args.kv_code_bytes]
                outs = {f: torch.empty_like(q) for f in fmts}

                def call(f):
                    name, _, cb = f.partition(", ")
                    cache, quant = caches[name]
                    tune = dict(code_bytes=int(cb.split()[0]), grid_per_block="grids" in cb) if cb else None
                    return lambda: tk.paged_decode_attention(q, cache, tables, seq_lens, qsl, pos, D ** -0.5,
                                                             max_seq_len=ctx, out=outs[f], tune=tune, quant=quant)

                def nbytes(f):     # what the kernel reads: codes and what decodes them
                    cache, quant = caches[f.partition(", ")[0]]
                    aux = [getattr(quant, a) for a in ("scales", "key_grid", "value_grid", "salient", "residual")] \
                        if quant is not None else []
                    return sum(t.numel() * t.element_size() for t in [cache, *aux] if t is not None)
                secs = {f: triton.testing.do_bench(dr.graphed(call(f)), warmup=25, rep=100, return_mode="median")
                        * 1e-3 for f in fmts}
                for f in fmts:
                    err = (outs[f].float() - outs["bf16"].float()).abs().max().item() if f.startswith("fp8") else ""
                    rows.append(dict(part=f"kernel, head_dim {D}", batch=batch, context=ctx, format=f, us=secs[f] * 1e6,
                                     **{"KV MB": nbytes(f) / 1e6, "GB/s": nbytes(f) / secs[f] / 1e9,
                                        "vs bf16": secs["bf16"] / secs[f], "max |diff|": err}))
                del kv, codes, scales, q, outs, caches
                free()
    for name in args.batched_models:
        path, mb, vocab = shape(args, name)
        for batch in args.kv_engine_batches:
            res = {}
            for f, kw in (("auto", {}), ("fp8", {}), ("fp8, 256 recent", {"kv_cache_recent_tokens": 256}),
                          ("int8", {}), ("int4", {})):
                if f not in args.kv_engine_formats:
                    continue
                try:
                    llm = engine(path, 2048 + 80, batch, async_scheduling=True, kv_cache_dtype=f.split(",")[0], **kw)
                    prompts = dr.prompts_for(batch, 2048, vocab, seed=2)
                    s = dr.engine_decode_seconds(llm, prompts, 48, 1, warmup=4) / 47
                    res[f] = (s, llm.kv_cache_info()["bytes_per_token"], llm.engine.runner.backend.name)
                    del llm
                except Exception as e:  # noqa: BLE001
                    rep.note(f"kvquant {name} batch {batch} {f}: error {type(e).__name__}: {e}")
                free()
            for f, (s, bpt, backend) in res.items():
                rows.append(dict(part=f"engine {name} ({backend})", batch=batch, context=2048, format=f,
                                 us=s * 1e6, **{"tok/s": batch / s, "bytes/token": bpt,
                                                "vs bf16": res["auto"][0] / s if "auto" in res else ""}))
    rep.table("kvquant", "Quantized KV caches vs bf16: decode kernel (32 q / 8 kv heads), batched engine decode",
              ["part", "batch", "context", "format", "us", "KV MB", "GB/s", "tok/s", "bytes/token", "vs bf16",
               "max |diff|"], rows)


def section_tune(args, rep: Report, copy_bw: float) -> None:
    """The decode kernel's tile / warp / pipeline-stage variants at a few shapes (decode_roofline.py --tune)."""
    ns = argparse.Namespace(kernel_batches=args.tune_batches, kernel_contexts=args.tune_contexts, kernel_max_gib=20.0,
                            no_flex=True, flex_contexts=[], tune=True, graphs=True)
    rows = dr.section_kernel(ns, rep.console, copy_bw)
    rep.data["sections"]["tune"] = rows
    best = {}
    for r in rows:
        if r["impl"].startswith("ours"):
            key = (r["batch"], r["context"])
            if key not in best or r["gbs"] > best[key]["gbs"]:
                best[key] = r
    rep.table("tune_best", "Best decode-kernel variant per shape", ["batch", "context", "impl", "gbs", "roofline"],
              list(best.values()))


def code_prompts(tokenizer, n: int, tokens: int) -> list[list[int]]:
    """Prompts from the Python standard library's own source (the embedded model was trained on Python code):
    the first ``tokens`` tokens of n functions."""
    import json as j1, os as o1, textwrap, argparse as a1, collections as c1, statistics as s1
    funcs = []
    for mod in (j1, o1, textwrap, a1, c1, s1, inspect):
        for _, f in inspect.getmembers(mod, inspect.isfunction):
            try:
                funcs.append(inspect.getsource(f))
            except (OSError, TypeError):
                pass
    out = []
    for src in funcs:
        ids = tokenizer.encode(src)
        if len(ids) >= tokens:
            out.append(ids[:tokens])
        if len(out) == n:
            break
    while len(out) < n:
        out.append(out[len(out) % max(1, len(out))])
    return out


def section_spec(args, rep: Report) -> None:
    from leapdecode import LLM, SamplingParams
    from leapdecode.assets import default_draft_model_path, default_model_path
    path = default_model_path()
    kinds = {"ngram (prompt lookup)": {"method": "ngram"}, "suffix": {"method": "suffix"},
             "draft_model": {"method": "draft_model", "model": default_draft_model_path()}}
    methods = {"plain": None}
    for label, spec in kinds.items():     # the controller's choice (default), and always drafting k = 4
        methods[label] = {**spec, "num_speculative_tokens": 4}
        methods[f"{label}, fixed k=4"] = {**spec, "num_speculative_tokens": 4, "adaptive": False}
    rows = []
    for batch in args.spec_batches:
        base = None
        for label, spec in methods.items():
            try:
                # --spec-async: every engine with async scheduling (a speculating one overlaps while its guard has
                # the drafter off); off by default: on this small model the overlapped step was the slower one on
                # an H200 (plain 1,945 vs 2,773 tok/s at batch 1, 30,718 vs 40,587 at 64; benchmarks/README.md)
                llm = LLM(path, dtype="bfloat16", device=DEVICE, attention_backend=BACKEND, max_model_len=1024,
                          max_num_seqs=batch, speculative_config=spec, enable_prefix_caching=False,
                          kv_cache_memory="4GiB", async_scheduling=args.spec_async)
                # at least --spec-prompts prompts (run --batch at a time): one prompt made batch 1 a single text
                # (its greedy output a digit loop the draft model never predicts: 0 of 1,014 drafts accepted)
                prompts = code_prompts(llm.engine.tokenizer, max(batch, args.spec_prompts), args.spec_prompt_len)
                params = SamplingParams(temperature=0.0, max_tokens=args.spec_output_len, ignore_eos=True)
                # warm-up over every prompt: the first prefill of a batch this size compiles its kernels (up
                # to 0.6 s on an H200), which a 2-prompt warm-up left inside the first timed run
                llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                             use_tqdm=False)
                times, outs = [], None
                for _ in range(args.repeats):
                    sp = llm.engine.speculator
                    if sp is not None:      # every run from empty drafter caches (suffix keeps finished outputs)
                        sp.drafter = sp.new_drafter()
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    outs = llm.generate(prompts, params, use_tqdm=False)
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                s = statistics.median(times)
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                stats = llm.engine.stats
                row = dict(method=label, batch=batch, **{"tok/s": tokens / s})
                if base is None:
                    base = tokens / s
                row["vs plain"] = tokens / s / base
                if spec is not None:
                    row["accepted/drafted"] = f"{stats['accepted_tokens']}/{stats['draft_tokens']}"
                rows.append(row)
                del llm
            except Exception as e:  # noqa: BLE001
                rep.note(f"spec {label} batch {batch}: error {type(e).__name__}: {e}")
            free()
    rep.table("spec", f"Speculative decoding on the GPU: embedded code model ({path.rsplit('/', 1)[-1]}, real "
              f"weights), Python-source prompts of {args.spec_prompt_len} tokens, {args.spec_output_len} new, greedy"
              + (", async scheduling" if args.spec_async else ""),
              ["method", "batch", "tok/s", "vs plain", "accepted/drafted"], rows)



# -- pictures ------------------------------------------------------------------------------------------------------
def pictures(rep: Report, copy_bw: float, out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    data = rep.data["sections"]
    batched = [r for r in data.get("batched", []) if r["engine"].startswith("leapdecode")]
    if batched:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for ctx in sorted({r["context"] for r in batched}):
            rs = sorted((r for r in batched if r["context"] == ctx), key=lambda r: r["batch"])
            model = rs[0]["model"]
            mb = dr.count_bytes(model)
            xs = [r["batch"] for r in rs]
            ax.plot(xs, [r["tok/s"] for r in rs], "o-", label=f"leapdecode, context {ctx}")
            roof = [b * copy_bw / dr.step_bytes(mb, b, ctx, 0) for b in xs]
            ax.plot(xs, roof, "--", label=f"bandwidth roofline, context {ctx}")
        peer = [r for r in data.get("batched", []) if r["engine"] == "transformers generate"]
        for ctx in sorted({r["context"] for r in peer}):
            rs = sorted((r for r in peer if r["context"] == ctx), key=lambda r: r["batch"])
            ax.plot([r["batch"] for r in rs], [r["tok/s"] for r in rs], "x:", label=f"transformers, context {ctx}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"{batched[0]['model']} decode throughput, bf16, {torch.cuda.get_device_name(0)}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out, "throughput_vs_batch.png"), dpi=110)
        plt.close(fig)
    kernel = data.get("kernel", [])
    if kernel:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for batch in sorted({r["batch"] for r in kernel}):
            for impl, style in (("ours", "o-"), ("SDPA cuDNN (dense)", "s--"), ("SDPA (dense)", "^:")):
                rs = sorted((r for r in kernel if r["batch"] == batch and r["impl"] == impl),
                            key=lambda r: r["context"])
                if rs:
                    ax.plot([r["context"] for r in rs], [r["gbs"] for r in rs], style,
                            label=f"{'leapdecode paged' if impl == 'ours' else impl}, batch {batch}")
        ax.axhline(copy_bw / 1e9, color="k", lw=0.8, label="copy bandwidth")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (keys)")
        ax.set_ylabel("K/V GB/s")
        ax.set_title(f"Decode attention, Llama-3-8B heads, bf16, {torch.cuda.get_device_name(0)}")
        ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        fig.savefig(os.path.join(out, "kernel_bandwidth.png"), dpi=110)
        plt.close(fig)


# -- main ----------------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__[__doc__.index("Sections"):])
    ints = dr._ints
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/gpu_suite", help="folder for JSON and PNGs")
    ap.add_argument("--models", default="llama-3.2-1b,qwen2.5-0.5b,llama-3.1-8b")
    ap.add_argument("--compile-models", default="llama-3.2-1b",
                    help="models whose static step is also timed under torch.compile (about 40 s each)")
    ap.add_argument("--batched-models", default="llama-3.2-1b")
    ap.add_argument("--ckpt-root", default="/tmp/leapdecode-ckpt")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--peer-output-len", type=int, default=24, help="new tokens for transformers (it is slow)")
    ap.add_argument("--batch-sizes", type=ints, default=[16, 64, 256])
    ap.add_argument("--contexts", type=ints, default=[512, 2048])
    ap.add_argument("--batched-output-len", type=int, default=48)
    ap.add_argument("--peer-max-batch", type=int, default=64)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--copy-gib", type=float, default=2.0)
    ap.add_argument("--kernel-batches", type=ints, default=[1, 16, 64])
    ap.add_argument("--kernel-contexts", type=ints, default=[1024, 4096, 32768, 131072])
    ap.add_argument("--flex-contexts", type=ints, default=[32768])
    ap.add_argument("--kernel-max-gib", type=float, default=20.0)
    ap.add_argument("--tune-batches", type=ints, default=[1, 16])
    ap.add_argument("--tune-contexts", type=ints, default=[32768])
    ap.add_argument("--spec-batches", type=ints, default=[1, 64])
    ap.add_argument("--spec-prompt-len", type=int, default=96)
    ap.add_argument("--spec-prompts", type=int, default=8, help="spec: prompts at least (batch 1 runs them in turn)")
    ap.add_argument("--spec-output-len", type=int, default=128)
    ap.add_argument("--spec-async", action="store_true", help="spec: async scheduling for every engine")
    ap.add_argument("--kvfp8-batches", type=ints, default=[1, 16, 64])
    ap.add_argument("--kvfp8-contexts", type=ints, default=[4096, 32768])
    ap.add_argument("--kv-code-bytes", type=ints, default=[1, 8],
                    help="kvquant: bytes of codes a load in the kernel rows (1, 2, 4, 8)")
    ap.add_argument("--kv-engine-batches", type=ints, default=[64, 256])
    ap.add_argument("--kv-head-dims", type=ints, default=[128, 64], help="kvquant kernel rows: head dims")
    ap.add_argument("--kv-grid-per-block", action="store_true",
                    help="kvquant: also int rows with the keys' grids loaded once per block")
    ap.add_argument("--kv-kernel-formats", default="fp8,int", help="kvquant kernel rows: fp8 alone, or also int")
    ap.add_argument("--kv-engine-formats", default="auto;fp8;fp8, 256 recent;int8;int4",
                    help="kvquant: the engine rows' cache formats, separated by ';'")
    args = ap.parse_args(argv)
    split = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    args.sections, args.models = split(args.sections), split(args.models)
    args.compile_models, args.batched_models = split(args.compile_models), split(args.batched_models)
    args.kv_engine_formats = [f.strip() for f in args.kv_engine_formats.split(";") if f.strip()]
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_suite: no CUDA device here; nothing to measure (run it on an H100/H200)")
        return
    import triton
    import transformers
    os.makedirs(args.out, exist_ok=True)
    rep = Report(args.out)
    props = torch.cuda.get_device_properties(0)
    rep.data["device"] = dict(name=props.name, sms=props.multi_processor_count, memory_gib=props.total_memory / GIB,
                              torch=torch.__version__, triton=triton.__version__, transformers=transformers.__version__)
    rep.note(f"{props.name}, {props.multi_processor_count} SMs, {props.total_memory / GIB:.0f} GiB; torch "
             f"{torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}")
    t0 = time.perf_counter()
    copy_bw = dr.copy_bandwidth(args.copy_gib)
    rep.data["copy_bandwidth"] = copy_bw
    rep.note(f"copy roofline: {copy_bw / 1e9:,.0f} GB/s (device-to-device copy of {args.copy_gib} GiB, read + write)")
    runs = {"batch1": lambda: section_batch1(args, rep, copy_bw),
            "kernel": lambda: section_kernel(args, rep, copy_bw),
            "batched": lambda: section_batched(args, rep, copy_bw),
            "tune": lambda: section_tune(args, rep, copy_bw),
            "spec": lambda: section_spec(args, rep),
            "kvquant": lambda: section_kvquant(args, rep, copy_bw),
            "compiled": lambda: section_compiled(args, rep, copy_bw)}
    for section in args.sections:     # in the order given: a short lease puts what it needs most first
        fn = runs.get(section)
        if fn is None:
            continue
        s0 = time.perf_counter()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - one broken section must not cost the others
            import traceback
            traceback.print_exc()
            rep.note(f"section {section} failed: {type(e).__name__}: {e}")
        rep.note(f"[{section}: {time.perf_counter() - s0:.0f} s]")
        free()
    try:
        pictures(rep, copy_bw, args.out)
    except Exception as e:  # noqa: BLE001
        rep.note(f"pictures failed: {type(e).__name__}: {e}")
    rep.note(f"suite done in {time.perf_counter() - t0:.0f} s; JSON and PNGs in {args.out}")


if __name__ == "__main__":
    main()
