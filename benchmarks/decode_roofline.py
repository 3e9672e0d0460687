"""Decode speed against the GPU's measured memory roofline: whole models at batch 1, batched decode, and the decode
attention kernel alone; transformers / PyTorch beside us in the same run.

    python benchmarks/decode_roofline.py --dry-run                     # the plan and byte counts (no GPU needed)
    python benchmarks/decode_roofline.py --sections copy,kernel        # the attention kernel alone (minutes)
    python benchmarks/decode_roofline.py --sections batch1 --models llama-3.2-1b,qwen2.5-0.5b
    python benchmarks/decode_roofline.py --sections batched --models llama-3.2-1b
    python benchmarks/decode_roofline.py --sections kernel --tune      # sweep the decode kernel's tile shapes

Sections (each prints one table):

copy     The roofline. Bandwidth of a large device-to-device copy (``dst.copy_(src)`` of --copy-gib GiB, median of
         20 timed copies after warm-up): bytes read + bytes written over the time. Every other section reports its
         achieved bytes/s as a fraction of this number, measured in the same run on the same GPU.

batch1   One request, random prompt of --prompt-len token ids, greedy, exactly --output-len new tokens, for random-
         weight models of real shapes (Llama-3.2-1B, Qwen2.5-0.5B, Llama-3.1-8B; checkpoints written once by
         benchmarks/make_random_checkpoint.py) in bf16. Decode time = T(output_len) - T(1), where T(n) is the
         median wall time of ``generate`` with n new tokens (prefill and the first token cancel out); tokens/s =
         (output_len - 1) / decode time. leapdecode runs with prefix caching off (so T(1) and T(n) both prefill),
         on each --backends attention backend; transformers ``generate`` (its default attention and dynamic
         cache) on the same checkpoint is the peer.
         Bytes per decode step = weight bytes + KV bytes. Weight bytes: every parameter once (the lm_head matrix
         once, tied or not; an untied input embedding counts one row per sequence, not the matrix). KV bytes: keys
         and values of every layer for the context the step attends over (prompt + tokens so far, averaged over
         the timed steps), plus the new token's K/V written. Roofline fraction = bytes per step x steps/s / copy
         bandwidth. This is the floor of the traffic of any exact implementation; activations are ignored.

batched  The same measurement at batch --batch-sizes (16, 64, 256) with contexts --contexts (512, 2048): prompt of
         that length, --batched-output-len new tokens, output tokens/s over the decode time. Cases whose KV would
         not fit in the GPU's memory are skipped and say so; the peer runs up to --peer-max-batch.

kernel   The decode attention kernel alone (``paged_decode_attention``: split-KV over a paged cache with shuffled
         blocks) against ``torch.nn.functional.scaled_dot_product_attention`` and compiled ``flex_attention`` on
         contiguous K/V (the peers get the easier, unpaged layout). Llama-3.1-8B heads (32 q / 8 kv, d=128), bf16,
         contexts 1k..128k, batch 1..64. Timed with ``triton.testing.do_bench`` (L2 flushed between runs, median).
         Achieved GB/s = K/V bytes read / time. "ours 1 split" shows what the split-KV pass buys. Each
         implementation but flex_attention is captured as a CUDA graph and timed by its replays (--no-graphs:
         eager launches), so the host's launch overhead (tens of microseconds for a Triton launch from Python)
         stays out of the kernels' numbers. Before timing,
         each shape's output is checked against SDPA on the same keys.

Nothing here is asserted; the numbers are printed with the device, torch/triton/transformers versions and dtype.
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
BENCH = os.path.dirname(os.path.abspath(__file__))
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

SECTIONS = ("copy", "batch1", "batched", "kernel")
MODELS = ("llama-3.2-1b", "qwen2.5-0.5b", "llama-3.1-8b")
GIB = 1 << 30

# Used only when benchmarks/make_random_checkpoint.py is absent (for --dry-run byte counts): the real shapes.
_FALLBACK_SHAPES = {
    "llama-3.2-1b": ("LlamaConfig", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                         head_dim=64, tie_word_embeddings=True)),
    "qwen2.5-0.5b": ("Qwen2Config", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                         tie_word_embeddings=True)),
    "llama-3.1-8b": ("LlamaConfig", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                         head_dim=128, tie_word_embeddings=False)),
}


# -- model shapes and bytes -------------------------------------------------------------------------------------
@dataclass
class ModelBytes:
    name: str
    params: int
    weight_bytes: int          # read once per decode step (see the module docstring)
    embed_row_bytes: int       # an untied input embedding: one row per sequence per step (0 when tied)
    kv_bytes_per_token: int    # K and V of all layers for one token
    layers: int
    kv_heads: int
    head_dim: int


def model_config(name: str):
    import transformers
    try:
        from make_random_checkpoint import SHAPES
        cls_name, _, kw, _ = SHAPES[name]
    except ImportError:
        cls_name, kw = _FALLBACK_SHAPES[name]
    return getattr(transformers, cls_name)(**kw)


def count_bytes(name: str, dtype: torch.dtype = torch.bfloat16) -> ModelBytes:
    """Parameter bytes from the model built on the meta device (no memory, no GPU)."""
    import transformers
    cfg = model_config(name)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    elem = torch.finfo(dtype).bits // 8
    params = sum(p.numel() for p in model.parameters())          # tied weights are one parameter, counted once
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings().weight
    tied = emb is out                                             # (meta tensors have no data pointers)
    weight = params * elem - (0 if tied else emb.numel() * elem)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_tok = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * elem
    return ModelBytes(name, params, weight, 0 if tied else cfg.hidden_size * elem, kv_tok,
                      cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim)


def step_bytes(mb: ModelBytes, batch: int, prompt_len: int, output_len: int) -> float:
    """Mean bytes per decode step over the timed steps 2..output_len (the step making token k attends over
    prompt_len + k - 1 keys, the new one included, and writes one token's K/V)."""
    mean_ctx = prompt_len + output_len / 2
    return mb.weight_bytes + batch * (mb.embed_row_bytes + mb.kv_bytes_per_token * (mean_ctx + 1))


# -- timing helpers ------------------------------------------------------------------------------------------------
def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls, synchronised on a GPU (warm up before calling)."""
    times = []
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(gib: float) -> float:
    """Bytes/s of a device-to-device copy of ``gib`` GiB (read + write counted)."""
    n = int(gib * GIB)
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / statistics.median(times)


def free_memory() -> int:
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def prompts_for(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (batch, length), generator=g).tolist()


# -- engines -----------------------------------------------------------------------------------------------------
def checkpoint(name: str, root: str) -> str:
    try:
        from make_random_checkpoint import make_checkpoint
    except ImportError as e:
        raise SystemExit("benchmarks/make_random_checkpoint.py is needed to write the random checkpoints") from e
    return make_checkpoint(name, os.path.join(root, name), dtype="bfloat16")


def engine_decode_seconds(llm, prompts: list[list[int]], new: int, repeats: int, warmup: int = 8) -> float:
    """T(new) - T(1) of ``llm.generate`` (greedy, exactly n tokens): the decode time of ``new - 1`` steps, the
    prefill and first token cancelled out; a ``warmup``-token run first compiles the kernels for these shapes."""
    from leapdecode import SamplingParams

    def run(n):
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        return lambda: llm.generate(prompts, sp, use_tqdm=False)

    run(warmup)()
    t1, tn = timed(run(1), repeats), timed(run(new), repeats)
    return tn - t1


def hf_decode_seconds(model, prompts: list[list[int]], new: int, repeats: int, warmup: int = 8) -> float:
    """The same T(new) - T(1) for transformers ``generate`` (greedy, exactly n tokens) on ``model``."""
    ids = torch.tensor(prompts, device=model.device)
    mask = torch.ones_like(ids)

    def run(n):
        return lambda: model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                                      min_new_tokens=n, pad_token_id=0)

    with torch.inference_mode():
        run(warmup)()
        t1, tn = timed(run(1), repeats), timed(run(new), repeats)
    return tn - t1


def leapdecode_decode(path: str, backend: str, batch: int, prompt_len: int, output_len: int, vocab: int,
                      repeats: int) -> tuple[float, str]:
    """Decode seconds (T(n) - T(1)) for ``batch`` requests; returns (seconds, backend actually used)."""
    from leapdecode import LLM, SamplingParams
    os.environ["LEAPDECODE_ATTENTION_BACKEND"] = backend
    mb_tokens = batch * (prompt_len + output_len + 32)
    llm = LLM(path, dtype="bfloat16", device="cuda", max_model_len=prompt_len + output_len + 32,
              enable_prefix_caching=False, max_num_seqs=max(batch, 1),
              max_num_batched_tokens=max(2048, prompt_len + 1), num_kv_blocks=-(-mb_tokens // 16) + batch + 8)
    try:
        used = llm.engine.runner.backend.name
        return engine_decode_seconds(llm, prompts_for(batch, prompt_len, vocab, seed=1), output_len, repeats), used
    finally:
        del llm
        os.environ.pop("LEAPDECODE_ATTENTION_BACKEND", None)
        free_memory()


class TransformersPeer:
    def __init__(self, path: str):
        import transformers
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()

    def decode_seconds(self, batch: int, prompt_len: int, output_len: int, vocab: int, repeats: int) -> float:
        return hf_decode_seconds(self.model, prompts_for(batch, prompt_len, vocab, seed=1), output_len, repeats)

    def close(self):
        del self.model
        free_memory()


# -- sections ----------------------------------------------------------------------------------------------------
def section_decode(args, console, copy_bw: float, batched: bool) -> None:
    from rich.table import Table
    cases = planned_decode_cases(args, batched)
    title = "Batched decode" if batched else "Batch-1 decode"
    table = Table(title=f"{title} vs the copy roofline ({copy_bw / 1e9:.0f} GB/s), bf16, random weights")
    for col in ("model", "batch", "prompt", "new", "engine", "tok/s", "ms/step", "GB/step", "roofline frac",
                "vs peer"):
        table.add_column(col, justify="right" if col not in ("model", "engine") else "left")
    for name in args.models:
        mb = count_bytes(name)
        path = checkpoint(name, args.ckpt_root)
        vocab = model_config(name).vocab_size
        rows: list[tuple] = []
        for batch, prompt_len, new in cases:
            kv_need = batch * (prompt_len + new + 32) * mb.kv_bytes_per_token
            if kv_need > 0.8 * (free_memory() - mb.weight_bytes):
                table.add_row(name, str(batch), str(prompt_len), str(new), "skipped",
                              f"KV {kv_need / GIB:.0f} GiB does not fit", "", "", "", "")
                continue
            per_step = step_bytes(mb, batch, prompt_len, new)
            results = {}
            for backend in args.backends:
                secs, used = leapdecode_decode(path, backend, batch, prompt_len, new, vocab, args.repeats)
                results[f"leapdecode ({used})"] = secs
            rows.append((batch, prompt_len, new, per_step, results))
        peer = None
        for batch, prompt_len, new, per_step, results in rows:
            if batch <= args.peer_max_batch and not args.no_peer:
                peer = peer or TransformersPeer(path)
                results["transformers"] = peer.decode_seconds(batch, prompt_len, new, vocab, args.repeats)
            peer_s = results.get("transformers")
            for engine, secs in results.items():
                steps_s = (new - 1) / secs
                ratio = f"{peer_s / secs:.2f}x" if peer_s and engine != "transformers" else ""
                table.add_row(name, str(batch), str(prompt_len), str(new), engine, f"{steps_s * batch:,.0f}",
                              f"{1e3 / steps_s:.2f}", f"{per_step / 1e9:.3f}",
                              f"{per_step * steps_s / copy_bw:.1%}", ratio)
        if peer:
            peer.close()
    console.print(table)


def section_kernel(args, console, copy_bw: float) -> list[dict]:
    import torch.nn.functional as F
    import triton.testing
    from rich.table import Table

    from leapdecode.attention import triton_kernels as tk

    flex = None
    if not args.no_flex:
        try:
            from torch.nn.attention.flex_attention import flex_attention
            from torch._dynamo import config as dynamo_config
            for knob in ("cache_size_limit", "recompile_limit"):
                if hasattr(dynamo_config, knob):
                    setattr(dynamo_config, knob, 256)
            flex = torch.compile(flex_attention, dynamic=False)
        except Exception as e:  # noqa: BLE001 - the peer is optional
            console.print(f"flex_attention unavailable: {e!r}")
    H, HKV, D, BS, dtype = 32, 8, 128, 16, torch.bfloat16
    scale = D ** -0.5
    rows: list[dict] = []
    table = Table(title=f"Decode attention alone: H={H}/{HKV} kv, d={D}, bf16, block {BS}; copy roofline "
                        f"{copy_bw / 1e9:.0f} GB/s")
    for col in ("batch", "context", "KV MiB", "impl", "splits", "us", "GB/s", "roofline frac", "vs SDPA"):
        table.add_column(col, justify="left" if col == "impl" else "right")
    for batch, ctx in planned_kernel_cases(args):
        kv_bytes = 2 * batch * ctx * HKV * D * 2
        if kv_bytes > args.kernel_max_gib * GIB or 3 * kv_bytes > free_memory():   # paged + dense + gather temp
            table.add_row(str(batch), str(ctx), f"{kv_bytes / 2**20:,.0f}", "skipped (memory)", "", "", "", "", "")
            continue
        nblk = batch * (-(-ctx // BS))
        kv = torch.randn(2, nblk, BS, HKV, D, dtype=dtype, device="cuda")
        tables = torch.randperm(nblk, device="cuda", dtype=torch.int64).to(torch.int32).view(batch, -1)
        seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        pos = torch.full((batch,), ctx - 1, dtype=torch.int64, device="cuda")
        q = torch.randn(batch, H, D, dtype=dtype, device="cuda")
        out = torch.empty_like(q)
        auto_splits = tk.choose_num_splits(batch, HKV, ctx, torch.cuda.get_device_properties(0).multi_processor_count)

        def ours(splits=None, tune=None):
            return lambda: tk.paged_decode_attention(q, kv, tables, seq_lens, qsl, pos, scale, max_seq_len=ctx,
                                                     num_splits=splits, out=out, tune=tune)

        impls = {"ours": (ours(), auto_splits), "ours 1 split": (ours(1), 1)}
        if args.tune:
            for bn in (32, 64, 128):
                for nw in (2, 4, 8):
                    for st in (1, 2, 3):
                        impls[f"ours bn{bn} w{nw} s{st}"] = (ours(tune=dict(block_n=bn, num_warps=nw,
                                                                          num_stages=st)), auto_splits)
        # dense K/V for the peers: the same keys, gathered out of the pages (also the correctness check)
        k = kv[0][tables.long()].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()    # [B, HKV, ctx, D]
        v = kv[1][tables.long()].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
        q4 = q.view(batch, H, 1, D)
        ref = F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True).view(batch, H, D)
        ours()()
        err = (out.float() - ref.float()).abs().max().item()
        impls["SDPA (dense)"] = (lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True),
                                 None)
        impls["SDPA cuDNN (dense)"] = (lambda: _cudnn_sdpa(q4, k, v, scale), None)
        if flex is not None and (not args.flex_contexts or ctx in args.flex_contexts):
            impls["flex_attention (dense)"] = (lambda: flex(q4, k, v, scale=scale, enable_gqa=True), None)
        times = {}
        for label, (fn, splits) in impls.items():
            try:
                fn = graphed(fn) if args.graphs and not label.startswith("flex") else fn
                times[label] = (triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3,
                                splits)
            except Exception as e:  # noqa: BLE001 - report and go on
                table.add_row(str(batch), str(ctx), "", label, "", f"error: {type(e).__name__}", "", "", "")
        sdpa = times.get("SDPA (dense)", (None,))[0]
        for label, (secs, splits) in times.items():
            rows.append(dict(batch=batch, context=ctx, impl=label, splits=splits, us=secs * 1e6,
                             gbs=kv_bytes / secs / 1e9, roofline=kv_bytes / secs / copy_bw, max_err=err))
            table.add_row(str(batch), str(ctx), f"{kv_bytes / 2**20:,.0f}",
                          label + (f" (max err {err:.1e})" if label == "ours" else ""),
                          "" if splits is None else str(splits), f"{secs * 1e6:,.1f}",
                          f"{kv_bytes / secs / 1e9:,.0f}", f"{kv_bytes / secs / copy_bw:.1%}",
                          f"{sdpa / secs:.2f}x" if sdpa and not label.startswith("SDPA") else "")
        del kv, k, v, q, out, ref
        free_memory()
    console.print(table)
    return rows


def graphed(fn):
    """``fn`` captured once as a CUDA graph, returned as its replay: timing then measures the GPU's work, not
    the host's launch overhead (Triton's Python launcher costs tens of microseconds a launch, more than a short
    kernel runs; the engine replays graphs too)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def _cudnn_sdpa(q, k, v, scale):
    """SDPA forced onto cuDNN's attention (the strongest dense peer on Hopper); raises where cuDNN refuses."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)


# -- planning ----------------------------------------------------------------------------------------------------
def planned_decode_cases(args, batched: bool) -> list[tuple[int, int, int]]:
    if batched:
        return [(b, c, args.batched_output_len) for b in args.batch_sizes for c in args.contexts]
    return [(1, args.prompt_len, args.output_len)]


def planned_kernel_cases(args) -> list[tuple[int, int]]:
    return [(b, c) for b in args.kernel_batches for c in args.kernel_contexts]


def dry_run(args, console) -> None:
    from rich.table import Table
    console.print(f"sections: {', '.join(args.sections)}; models: {', '.join(args.models)}; backends: "
                  f"{', '.join(args.backends)}; copy probe {args.copy_gib} GiB")
    table = Table(title="Planned decode cases (bytes per step, bf16)")
    for col in ("section", "model", "params", "weights GB", "KV KiB/token", "batch", "prompt", "new",
                "GB/step", "peer"):
        table.add_column(col)
    for name in args.models if {"batch1", "batched"} & set(args.sections) else []:
        mb = count_bytes(name)
        for section, batched in (("batch1", False), ("batched", True)):
            if section not in args.sections:
                continue
            for batch, prompt_len, new in planned_decode_cases(args, batched):
                table.add_row(section, name, f"{mb.params / 1e9:.2f}B", f"{mb.weight_bytes / 1e9:.2f}",
                              f"{mb.kv_bytes_per_token / 1024:.0f}", str(batch), str(prompt_len), str(new),
                              f"{step_bytes(mb, batch, prompt_len, new) / 1e9:.3f}",
                              "yes" if batch <= args.peer_max_batch and not args.no_peer else "no")
    console.print(table)
    if "kernel" in args.sections:
        kt = Table(title="Planned kernel cases (H=32/8 kv, d=128, bf16)")
        for col in ("batch", "context", "KV MiB", "splits on an H100 (132 SMs)", "within --kernel-max-gib"):
            kt.add_column(col)
        from leapdecode.attention.triton_kernels import choose_num_splits
        for batch, ctx in planned_kernel_cases(args):
            kv = 2 * batch * ctx * 8 * 128 * 2
            kt.add_row(str(batch), str(ctx), f"{kv / 2**20:,.0f}", str(choose_num_splits(batch, 8, ctx, 132)),
                       "yes" if kv <= args.kernel_max_gib * GIB else "no (skipped)")
        console.print(kt)


def _ints(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        out.append(int(float(part[:-1]) * 1024) if part.endswith("k") else int(part))
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__[
                                     __doc__.index("Sections"):])
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    ap.add_argument("--models", default=",".join(MODELS), help="comma list of model shapes")
    ap.add_argument("--backends", default="triton", help="leapdecode attention backends to time: triton,torch")
    ap.add_argument("--ckpt-root", default="/tmp/leapdecode-ckpt", help="where random checkpoints are written")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--batch-sizes", type=_ints, default=[16, 64, 256])
    ap.add_argument("--contexts", type=_ints, default=[512, 2048], help="prompt lengths of the batched section")
    ap.add_argument("--batched-output-len", type=int, default=64)
    ap.add_argument("--peer-max-batch", type=int, default=64, help="largest batch given to transformers")
    ap.add_argument("--no-peer", action="store_true", help="skip transformers")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--copy-gib", type=float, default=2.0)
    ap.add_argument("--kernel-batches", type=_ints, default=[1, 4, 16, 64])
    ap.add_argument("--kernel-contexts", type=_ints, default=[1024, 4096, 16384, 65536, 131072])
    ap.add_argument("--kernel-max-gib", type=float, default=20.0, help="skip kernel cases with more K/V than this")
    ap.add_argument("--no-flex", action="store_true", help="skip flex_attention (compiles per shape)")
    ap.add_argument("--flex-contexts", type=_ints, default=[], help="time flex_attention at these contexts only "
                    "(default: all; it compiles per shape)")
    ap.add_argument("--tune", action="store_true", help="also time the decode kernel's tile/warp/stage variants")
    ap.add_argument("--no-graphs", dest="graphs", action="store_false",
                    help="time kernel launches eagerly (default: each captured as a CUDA graph, timed by replays)")
    ap.add_argument("--dry-run", action="store_true", help="print the planned cases and byte counts, run nothing")
    args = ap.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    bad = [s for s in args.sections if s not in SECTIONS] + [m for m in args.models if m not in MODELS]
    bad += [b for b in args.backends if b not in ("triton", "torch")]
    if bad:
        ap.error(f"unknown section/model/backend: {', '.join(bad)}")
    return args


def main(argv=None) -> None:
    from rich.console import Console
    args = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 160)
    if args.dry_run:
        dry_run(args, console)
        return
    if not torch.cuda.is_available():
        raise SystemExit("decode_roofline.py measures a GPU; without CUDA only --dry-run and --help work")
    import triton
    import transformers
    props = torch.cuda.get_device_properties(0)
    console.print(f"{props.name}, {props.multi_processor_count} SMs, {props.total_memory / GIB:.0f} GiB; torch "
                  f"{torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}")
    copy_bw = copy_bandwidth(args.copy_gib)
    console.print(f"copy roofline: {copy_bw / 1e9:,.0f} GB/s (device-to-device copy of {args.copy_gib} GiB, "
                  "read + write)")
    if "kernel" in args.sections:
        section_kernel(args, console, copy_bw)
    if "batch1" in args.sections:
        section_decode(args, console, copy_bw, batched=False)
    if "batched" in args.sections:
        section_decode(args, console, copy_bw, batched=True)


if __name__ == "__main__":
    main()
