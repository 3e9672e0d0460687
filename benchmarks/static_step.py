"""The minimal static-cache decode step (gpt-fast's design), as a peer for the GPU suite: how fast one greedy decode
step can be with no engine around it.

It runs on leapdecode's own model modules and weights (so both sides read exactly the same bytes of weights), but
with none of the engine: a contiguous KV cache ``[batch, kv heads, max_len, head_dim]`` per layer, every sequence at
the same position, SDPA over the whole cache with a position mask (static shapes), the argmax inside the step, and
the next step's token and position written by the step itself. Two ways to run it:

* ``graph``: the eager step captured once as a CUDA graph and replayed (no compilation);
* ``compiled``: ``torch.compile(mode="reduce-overhead")`` (inductor fuses the elementwise work, then CUDA graphs);
  on CPU ``torch.compile`` with inductor's default mode (fused C++ loops, no graphs);
* ``eager``: the step as written, no capture (the CPU baseline for ``compiled``).

No scheduler, no paging, no sampling parameters, no stop checks: an upper bound for a step of the same model, not an
engine.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class StaticStep(torch.nn.Module):
    """The cache, tokens and position are registered buffers, so ``torch.compile``'s CUDA graphs treat their
    in-place updates as updates of static memory (as gpt-fast's KV cache module does)."""

    def __init__(self, model, batch: int, max_len: int, start: int, seed: int = 0) -> None:
        """``model``: a leapdecode ``LlamaForCausalLM`` (tensor parallel size 1); decoding starts at position
        ``start`` over a cache of random keys and values (random, not zeros, so no read is cheaper than real)."""
        super().__init__()
        self.model = model
        attn = model.layers[0].self_attn
        p = next(model.parameters())
        g = torch.Generator(device=p.device).manual_seed(seed)
        shape = (len(model.layers), batch, attn.num_kv_heads, max_len, attn.head_dim)
        self.register_buffer("k", torch.randn(shape, generator=g, device=p.device, dtype=p.dtype))
        self.register_buffer("v", torch.randn(shape, generator=g, device=p.device, dtype=p.dtype))
        self.register_buffer("tokens", torch.randint(0, model.cfg.vocab_size, (batch,), generator=g,
                                                     device=p.device))
        self.register_buffer("pos", torch.full((1,), start, dtype=torch.long, device=p.device))
        self.register_buffer("keys", torch.arange(max_len, device=p.device))
        self.batch, self.max_len, self.start = batch, max_len, start

    def forward(self) -> None:
        """One greedy step in place: tokens <- argmax(model(tokens at pos)), pos += 1."""
        m, b = self.model, self.batch
        pos = self.pos.expand(b)
        mask = (self.keys <= self.pos).view(1, 1, 1, -1)
        x = m.embed_tokens(self.tokens)
        for i, layer in enumerate(m.layers):
            a = layer.self_attn
            q, k, v = a.qkv_proj(layer.input_layernorm(x)).split([a.q_size, a.kv_size, a.kv_size], dim=-1)
            q, k = q.view(b, a.num_heads, a.head_dim), k.view(b, a.num_kv_heads, a.head_dim)
            if a.q_norm is not None:
                q, k = a.q_norm(q), a.k_norm(k)
            q, k = a.rope(pos, q, k)
            self.k[i].index_copy_(2, self.pos, k.unsqueeze(2))
            self.v[i].index_copy_(2, self.pos, v.view(b, a.num_kv_heads, 1, a.head_dim))
            o = F.scaled_dot_product_attention(q.unsqueeze(2), self.k[i], self.v[i], attn_mask=mask,
                                               scale=a.scale, enable_gqa=True)
            x = x + a.o_proj(o.flatten(1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        self.tokens.copy_(m.compute_logits(m.norm(x)).argmax(-1))
        self.pos.add_(1)


def _time_steps(run, steps: int, repeats: int) -> float:
    """Median seconds per step over ``repeats`` runs of ``steps`` steps (synchronised, after a warm-up run)."""
    from decode_roofline import timed
    run(steps)
    return timed(lambda: run(steps), repeats) / steps


@torch.inference_mode()
def seconds_per_step(model, batch: int, start: int, steps: int, mode: str = "graph", repeats: int = 3) -> float:
    """Decode seconds per step of the static step from position ``start`` for ``steps`` steps (each timed run
    restarts at ``start``, so every run attends over the same contexts)."""
    s = StaticStep(model, batch, start + steps + 1, start)
    if mode == "graph":
        s()                                                # warm-up outside the capture
        s.pos.fill_(start)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            s()

        def run(n):
            s.pos.fill_(start)
            for _ in range(n):
                graph.replay()
    elif mode in ("compiled", "eager"):
        # on CUDA: inductor + CUDA graphs; on CPU (no graphs): inductor's fused C++ kernels
        on_cuda = next(model.parameters()).is_cuda
        step = s if mode == "eager" else torch.compile(s, mode="reduce-overhead" if on_cuda else None, fullgraph=True)

        def run(n):
            s.pos.fill_(start)
            for _ in range(n):
                step()
    else:
        raise ValueError(f"mode must be graph, compiled or eager, got {mode!r}")
    return _time_steps(run, steps, repeats)
