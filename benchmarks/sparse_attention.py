"""Decode attention per layer, full vs sparse (attention/sparse.py: per-layer top-k or TidalDecode), at long contexts.

One decode step of a whole model's attention through the torch backend on a random paged KV cache (every layer its
own cache, as in a model): plan once, then ``attend`` layer by layer. Full attention reads the whole context at
every layer. With ``--selection per_layer`` (the default) the first ``--dense-layers`` read it all and every other
layer (a "sparse layer" in the table) reads every key, but only the values of its top budget + window positions;
with ``--selection tidal`` the layers below the first selection layer and the selection layers read it all, every
other layer only budget + window selected keys and values. Shapes default to SmolLM2-135M's (30 layers, 9 query
heads, 3 KV heads, head_dim 64). One row per context length; the sparse module's own dense layers (on the CPU the
exact kernel, as the full path; elsewhere its gather and grouped-query SDPA over the whole context) are timed beside
the ordinary full path. On the CPU a per_layer sparse layer is one call of attention/cpu_sparse.py's kernel. The
full path is the engine's CPU default, attention/cpu_exact.py's kernel (``--full sdpa``: float32 SDPA, what earlier
tables compared against). ``time_decode_attention`` returns the rows for other scripts (benchmarks/kv_compression.py).

``--quality P J`` measures the quality cost instead, on a real model (default: SmolLM2-135M-Instruct): prefill
P tokens of a long text with full attention, then decode its next J tokens one at a time (teacher-forced decode
rows) with full and with sparse attention; top-1 agreement with full attention's next-token argmax, mean
KL(full || sparse) and the text's NLL (``teacher_forced_quality``).

    python benchmarks/sparse_attention.py                          # 2k/4k/8k, budget 0.1, window 32, batch 1
    python benchmarks/sparse_attention.py --contexts 8192 --budget 256 --batch 4 --threads 2
    python benchmarks/sparse_attention.py --quality 3000 64 --selection tidal --selection-layers 2 12
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from leapdecode.attention.backend import AttentionMetadata
from leapdecode.attention.sparse import SparseAttention
from leapdecode.attention.torch_ref import TorchAttention
from leapdecode.config import SparseAttentionConfig


def decode_metadata(context_len: int, batch: int, block_size: int) -> AttentionMetadata:
    """``batch`` decode rows of ``context_len`` keys each, in disjoint, shuffled blocks."""
    nb = -(-context_len // block_size)
    blocks = torch.randperm(batch * nb).view(batch, nb)
    last = context_len - 1
    return AttentionMetadata(
        positions=torch.full((batch,), last), block_tables=blocks, seq_lens=torch.full((batch,), context_len),
        slot_mapping=blocks[:, last // block_size] * block_size + last % block_size,
        query_start_loc=torch.arange(batch + 1), query_lens=[1] * batch, seq_lens_host=[context_len] * batch,
        block_size=block_size, num_actual_tokens=batch)


def _time_step(backend: TorchAttention, caches: list[torch.Tensor], qs: list[torch.Tensor], meta: AttentionMetadata,
               scale: float) -> tuple[float, list[float]]:
    """One step: plan, then every layer; seconds for the whole step and for each layer's attend."""
    meta.plan = None
    t0 = time.perf_counter()
    backend.plan(meta)
    per_layer = []
    for layer, (kv, q) in enumerate(zip(caches, qs)):
        t = time.perf_counter()
        backend.attend(q, kv, meta, scale, layer=layer)
        per_layer.append(time.perf_counter() - t)
    return time.perf_counter() - t0, per_layer


def time_decode_attention(contexts: tuple[int, ...] = (2048, 4096, 8192), budget: float | int = 0.1,
                          window: int = 32, selection_layers: tuple[int, ...] | None = None, batch: int = 1,
                          num_layers: int = 30, heads: int = 9, kv_heads: int = 3, head_dim: int = 64,
                          block_size: int = 16, repeats: int = 7, dtype: torch.dtype = torch.float32,
                          selection: str | None = None, dense_layers: int = 2, exact: str = "kernel") -> list[dict]:
    """Median decode-attention times (ms) full vs sparse per context length, as a list of dict rows. ``exact``: the
    backend's full path, "kernel" (the engine's CPU default: attention/cpu_exact.py's kernel for decode rows) or
    "off" (float32 SDPA)."""
    cfg = SparseAttentionConfig(budget=budget, window=window, selection_layers=selection_layers, selection=selection,
                                dense_layers=dense_layers)
    policy = SparseAttention(cfg, num_layers)
    full, sparse = TorchAttention(exact=exact), TorchAttention(policy, exact=exact)
    scale = head_dim ** -0.5
    rows = []
    for n in contexts:
        meta = decode_metadata(n, batch, block_size)
        nb = batch * -(-n // block_size)
        caches = [torch.randn(2, nb, block_size, kv_heads, head_dim, dtype=dtype) for _ in range(num_layers)]
        qs = [torch.randn(batch, heads, head_dim, dtype=dtype) for _ in range(num_layers)]
        if policy.pages:                                 # the page bounds a model's writes would have kept
            policy.page_bounds.clear()                   # (each context length has its own caches)
            slots = (meta.block_tables[:, :, None] * block_size + torch.arange(block_size)).flatten()
            for layer, kv in enumerate(caches):
                policy.record_keys(layer, kv[0].flatten(0, 1)[slots], slots, kv, block_size)
        times: dict[str, list[float]] = {"full": [], "sparse": []}
        kinds: dict[str, list[float]] = {"dense": [], "selection": [], "sparse": []}
        own = policy.per_layer or policy.pages            # every sparse layer chooses for itself
        for _ in range(repeats + 1):                     # the first round warms up
            for name, backend in (("full", full), ("sparse", sparse)):
                total, per_layer = _time_step(backend, caches, qs, meta, scale)
                times[name].append(total)
                if name == "sparse":
                    for layer, t in enumerate(per_layer):
                        kind = ("dense" if layer < policy.first_selection else
                                "selection" if layer in policy.selection_layers and not own else
                                "sparse")
                        kinds[kind].append(t)
        ms = {k: statistics.median(v[1:]) * 1e3 for k, v in times.items()}
        layer_ms = {k: statistics.median(v[len(v) // (repeats + 1):]) * 1e3 for k, v in kinds.items() if v}
        sparse_layers = num_layers - policy.first_selection - (0 if own else len(policy.selection_layers))
        rows.append({
            "context": n, "batch": batch, "keys_read": min(n, policy.num_selected(n) + window),
            "full_ms_per_layer": ms["full"] / num_layers, "sparse_layer_ms": layer_ms.get("sparse", float("nan")),
            "dense_layer_ms": layer_ms.get("dense", float("nan")),
            "selection_layer_ms": layer_ms.get("selection", float("nan")), "full_step_ms": ms["full"], "sparse_step_ms": ms["sparse"],
            "sparse_layers": sparse_layers, "layer_speedup": ms["full"] / num_layers / layer_ms.get("sparse", 1e9),
            "step_speedup": ms["full"] / ms["sparse"]})
        del caches
    return rows


LICENSE_TEXTS = ("/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/GFDL-1.3")


def teacher_forced_quality(context: int, positions: int, configs: dict[str, SparseAttentionConfig],
                           model: str | None = None, text: str | None = None) -> list[dict]:
    """Per config: top-1 agreement with full attention, mean KL(full || sparse) and NLL over ``positions``
    teacher-forced decodes after a ``context``-token prefill of ``text`` (default: the GPL-3 and GFDL-1.3 texts)."""
    from leapdecode import LLM
    text = text if text is not None else "".join(open(p).read() for p in LICENSE_TEXTS)
    llm = LLM(model, max_model_len=context + positions + 1, max_num_seqs=1, dtype="float32")
    runner = llm.engine.runner
    net, backend, bs = runner.model, runner.backend, runner.block_size
    ids = llm.get_tokenizer().encode(text)[:context + positions + 1]
    if len(ids) < context + positions + 1:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than context + positions + 1")
    table = torch.arange(-(-len(ids) // bs))

    def forward(start: int, n: int) -> torch.Tensor:
        pos = torch.arange(start, start + n)
        meta = AttentionMetadata(
            positions=pos, slot_mapping=table[pos // bs] * bs + pos % bs, block_tables=table[None],
            seq_lens=torch.tensor([start + n]), query_start_loc=torch.tensor([0, n]), query_lens=[n],
            seq_lens_host=[start + n], block_size=bs, num_actual_tokens=n)
        backend.plan(meta)
        return net(torch.tensor(ids[start:start + n]), meta)

    def decode(cfg: SparseAttentionConfig | None) -> torch.Tensor:
        """Next-token log-probs after each of the ``positions`` decodes (they rewrite the same KV slots)."""
        backend.sparse = SparseAttention(cfg, runner.model_cfg.num_layers) if cfg is not None else None
        if cfg is not None and backend.sparse.pages:     # the prefill ran without it: bound its pages now
            slots = (table[:, None] * bs + torch.arange(bs)).flatten()[:context]
            for i, layer in enumerate(net.layers):
                kv = layer.self_attn.kv_cache
                backend.sparse.record_keys(i, kv[0].flatten(0, 1)[slots], slots, kv, bs)
        return torch.stack([torch.log_softmax(net.compute_logits(forward(context + j, 1))[0].double(), -1)
                            for j in range(positions)])

    with torch.inference_mode():
        for start in range(0, context, 512):
            forward(start, min(512, context - start))
        full = decode(None)
        target = torch.tensor(ids[context + 1:])[:, None]
        rows = [{"config": "full", "top1": 1.0, "kl": 0.0, "nll": -full.gather(1, target).mean().item()}]
        for name, cfg in configs.items():
            lp = decode(cfg)
            rows.append({"config": name, "top1": (lp.argmax(-1) == full.argmax(-1)).double().mean().item(),
                         "kl": (full.exp() * (full - lp)).sum(-1).mean().item(),
                         "nll": -lp.gather(1, target).mean().item()})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--budget", type=lambda s: float(s) if "." in s else int(s), default=0.1,
                   help="a fraction of the context (0.1) or a token count (256)")
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--selection", choices=("per_layer", "tidal", "pages"), default=None,
                   help="default: tidal with --selection-layers, else per_layer")
    p.add_argument("--dense-layers", type=int, default=2, help="per_layer: layers that attend fully")
    p.add_argument("--selection-layers", type=int, nargs="+", default=None, help="tidal: the selection layers")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--full", choices=("kernel", "sdpa"), default="kernel",
                   help="full attention's path: the engine's CPU default (the exact kernel) or float32 SDPA")
    p.add_argument("--quality", type=int, nargs=2, default=None, metavar=("P", "J"),
                   help="measure quality on a real model instead: P context tokens, J teacher-forced decodes")
    p.add_argument("--model", default=None, help="for --quality (default: SmolLM2-135M-Instruct)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    sel = tuple(args.selection_layers) if args.selection_layers else None
    if args.quality:
        cfg = SparseAttentionConfig(budget=args.budget, window=args.window, selection_layers=sel,
                                    selection=args.selection, dense_layers=args.dense_layers)
        name = (f"{cfg.selection}, budget {args.budget}, window {args.window}, " +
                (f"selection layers {sel or 'default'}" if cfg.selection == "tidal" else
                 f"{args.dense_layers} dense layers"))
        print(f"# teacher-forced quality: {args.quality[0]} context tokens, {args.quality[1]} decodes, "
              f"model {args.model or 'SmolLM2-135M-Instruct'}")
        print("| attention | top-1 agreement with full | KL(full || sparse) | NLL |\n|---|---|---|---|")
        for r in teacher_forced_quality(*args.quality, {name: cfg}, model=args.model):
            print(f"| {r['config']} | {r['top1']:.3f} | {r['kl']:.4f} | {r['nll']:.4f} |")
        return
    rows = time_decode_attention(tuple(args.contexts), args.budget, args.window, sel, args.batch, args.layers,
                                 args.heads, args.kv_heads, args.head_dim, repeats=args.repeats,
                                 selection=args.selection, dense_layers=args.dense_layers,
                                 exact="kernel" if args.full == "kernel" else "off")
    cfg = SparseAttentionConfig(selection_layers=sel, selection=args.selection, dense_layers=args.dense_layers)
    layers = cfg.layers_for(args.layers)
    print(f"# decode attention, torch backend, {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, {args.threads} thread(s), load {os.getloadavg()[0]:.1f}; "
          f"{args.layers} layers, {args.heads}/{args.kv_heads} heads, head_dim {args.head_dim}, float32; "
          f"full attention: {'exact kernel' if args.full == 'kernel' else 'float32 SDPA'}; "
          f"{cfg.selection}: budget {args.budget} + window {args.window}, layers that choose positions {layers}; "
          f"median of {args.repeats}")
    print("| context | batch | keys read (sparse layer) | full ms/layer | dense-layer ms | selection-layer ms "
          "| sparse-layer ms | full ms/step | sparse ms/step | sparse layer vs full | step vs full |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['context']} | {r['batch']} | {r['keys_read']} | {r['full_ms_per_layer']:.3f} | "
              f"{r['dense_layer_ms']:.3f} | {r['selection_layer_ms']:.3f} | {r['sparse_layer_ms']:.3f} | "
              f"{r['full_step_ms']:.2f} | {r['sparse_step_ms']:.2f} | {r['layer_speedup']:.2f}x | "
              f"{r['step_speedup']:.2f}x |")
    print("full: the torch backend's ordinary decode path; dense / selection / sparse: the sparse module's layers "
          "below the first selection layer (whole context; on the CPU the exact kernel), tidal's "
          "selection layers (whole context + top-k) and the others (tidal: selected keys only; per_layer: every "
          "key scored, selected keys attended)")


if __name__ == "__main__":
    main()
