"""Is GEAR's low-rank residual worth storing in a paged int4 cache? (issue 16)

GEAR (Kang et al., 2024) keeps, beside the quantized KV, a low-rank approximation of the quantization residual.
In a paged cache that factor would be kept per (block, kv head): rank r costs r * (block_size + head_dim) float16
values per block and head, against block_size * head_dim / 2 bytes of int4 codes. This measures, on the real
default model's KV (a 2,048-token prefill of Python's own documentation, every 5th layer), how much of the int4
residual (KIVI grids: keys per channel over a block, values per token) the top r singular vectors of each
(block, head) residual capture, beside what they would capture of a Gaussian matrix of the same shape (white
noise), and what the factor would cost in memory.

    python benchmarks/kv_residual_rank.py
"""
from __future__ import annotations

import os
import sys

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.dirname(BENCH))

from kv_compression import python_docs  # noqa: E402

from leapdecode import LLM, SamplingParams  # noqa: E402
from leapdecode.attention import kv_quant as kq  # noqa: E402
from leapdecode.llm import resolve_model  # noqa: E402


def captured(r: torch.Tensor, rank: int) -> float:
    """Mean share of each matrix's squared norm in its top ``rank`` singular values; r: [..., m, n]."""
    e = torch.linalg.svdvals(r.double()) ** 2
    return (e[..., :rank].sum(-1) / e.sum(-1)).mean().item()


def main() -> None:
    torch.set_num_threads(2)
    llm = LLM(resolve_model(None), kv_cache_memory="1GiB", max_model_len=4096, enable_prefix_caching=False)
    n = 2048
    ids = llm.get_tokenizer().encode(python_docs())[:n]
    llm.generate([ids], SamplingParams(max_tokens=1), use_tqdm=False)
    data = llm.engine.runner.kv_cache.data                  # [layers, 2, blocks, 16, h, d]; the prompt's blocks first
    d = data.shape[-1]
    g = torch.Generator().manual_seed(0)
    print("| KV | block | rank | residual share captured | white noise | int4 residual / value norm | "
          "factor bytes / int4 code bytes |\n|---|---:|---:|---:|---:|---:|---:|")
    for kv in (0, 1):
        for block in (16, 64):
            shares, noise, rel = {}, {}, []
            for layer in range(0, data.shape[0], 5):
                x = data[layer, kv, :n // data.shape[3]].float().reshape(-1, block, *data.shape[-2:])
                z, s = kq.key_grid(x) if kv == 0 else kq.value_grid(x)
                codes, _ = kq.encode_int4(x, z, s, None)
                deq = kq.decode_units(kq.int4_units(codes, None, None), z, s)
                r = (x - deq).permute(0, 2, 1, 3)                               # [S, h, block, d]
                rel.append(((x - deq).norm() / x.norm()).item())
                w = torch.randn(r.shape, generator=g)
                for rank in (1, 2, 4):
                    shares.setdefault(rank, []).append(captured(r, rank))
                    noise.setdefault(rank, []).append(captured(w, rank))
            for rank in (1, 2, 4):
                cost = rank * (block + d) * 2 / (block * d / 2)
                print(f"| {'keys' if kv == 0 else 'values'} | {block} | {rank} | "
                      f"{sum(shares[rank]) / len(shares[rank]):.3f} | {sum(noise[rank]) / len(noise[rank]):.3f} | "
                      f"{sum(rel) / len(rel):.3f} | {cost:.2f} |")


if __name__ == "__main__":
    main()
