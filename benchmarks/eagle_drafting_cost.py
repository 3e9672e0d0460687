"""What one EAGLE proposal costs on this machine, float32 head vs int8 head (``EagleHead.quantize_int8``).

The shipped head bound to SmolLM2-135M-Instruct (the default model), a 400-pair context of random features, median
of 15 calls of ``draft()`` (a 4-token chain, a 16-node dynamic tree of depth 6) and ``extend_state()`` (the
per-step catch-up with 2 committed pairs). Drafts are proposals, so int8 changes acceptance, never the output.

    python benchmarks/eagle_drafting_cost.py [--threads 2]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def median_ms(fn, n: int = 15) -> float:
    from decode_roofline import timed
    for _ in range(3):
        fn()
    return timed(fn, n) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=400)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from leapdecode import LLM
    from leapdecode.spec.eagle import EagleHead, draft, extend_state, shipped_head_path
    llm = LLM(max_model_len=1024, num_kv_blocks=80)
    model = llm.engine.runner.model
    d, V = model.cfg.hidden_size, model.cfg.vocab_size
    print(f"| head weights | chain k=4 | tree 16 nodes (top-4, depth 6) | catch-up (2 pairs) |   "
          f"({args.threads} threads, context {args.context})")
    print("|---|---:|---:|---:|")
    for int8 in (False, True):
        head = EagleHead.from_pretrained(shipped_head_path()).bind_target(model).eval()
        if int8:
            head.quantize_int8()
        g = torch.Generator().manual_seed(1)
        state = extend_state(head, None, torch.randn(args.context, d, generator=g),
                             torch.randint(0, V, (args.context,), generator=g).tolist(), 0)
        chain = median_ms(lambda: draft(head, state, 4, 1))
        tree = median_ms(lambda: draft(head, state, 6, 4, 16))
        catch = median_ms(lambda: extend_state(head, state, torch.randn(2, d), [1, 2], state.next_pos))
        print(f"| {'int8' if int8 else 'float32'} | {chain:.1f} ms | {tree:.1f} ms | {catch:.1f} ms |")


if __name__ == "__main__":
    main()
