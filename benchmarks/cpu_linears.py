"""What packing the float32 linears buys on the CPU (model/packed_linear.py: the row kernel, and oneDNN where that
does not run), on the default model (SmolLM2-135M-Instruct, Q4_1 GGUF dequantized to float32), beside PyTorch's
F.linear and transformers.

    python benchmarks/cpu_linears.py [--threads 2] [--tokens 48]

Two tables:

linears   Every linear of the model (30 layers' q/k/v, o, gate/up, down, and the LM head) run once in order, as
          one forward reads them (weights streamed from memory, not cached), for 1, 2, 5, 9, 17, 64 and 512 rows:
          F.linear, oneDNN-packed layers, the row kernel's over float32 weights and over the GGUF file's own codes
          (model/packed_linear.py's grid forms, as the engine runs them, and with int8 activations: LOSSY,
          ``quantization="int8_activations"``); and the same weights in int8 as drafters
          hold them (model/int8_linear.py): fbgemm alone, and as drafts run them (the row kernel's int8 form up to one
          6-row tile, fbgemm beyond); median of 5. Rows 5 and 17 are what a verification
          of 4 chained or 16 tree draft tokens computes at batch 1; 512, a prefill chunk.
decode    ``LLM.generate`` greedy, EOS ignored, --tokens new tokens per request, chat-templated MT-Bench turn-1
          questions: batch 1 (--prompts requests one at a time) and batch 16 (16 requests together), tokens/s
          with ``cpu_packed_linears=False`` (F.linear), packed through oneDNN (the row kernel held off), the row
          kernel over float32 weights (the grid forms held off: the default before they came), the row kernel over
          the file's codes with layers run module by module (model/cpu_layer.py's one-call layer held off), and as
          the engine runs by default (the file's codes, each layer in one call where the step allows it), and
          transformers ``generate`` on the same GGUF file (its own loader) at batch 1 as the peer; they alternate
          per repeat. Also whether the greedy tokens of all our runs are equal.

Nothing is asserted; run it on a quiet machine (see this folder's README).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


@contextlib.contextmanager
def layer_by_layer():
    """Layers run inside this block module by module (the one-call layer of model/cpu_layer.py held off)."""
    from leapdecode.model import cpu_layer
    kept = cpu_layer.run, cpu_layer.stack_of
    cpu_layer.run = cpu_layer.stack_of = lambda *args: None
    try:
        yield
    finally:
        cpu_layer.run, cpu_layer.stack_of = kept


@contextlib.contextmanager
def float_weights():
    """Layers packed inside this block keep float32 weights (the GGUF grid forms held off)."""
    from leapdecode.model import packed_linear
    kept = packed_linear.grid_form
    packed_linear.grid_form = lambda weight: None
    try:
        yield
    finally:
        packed_linear.grid_form = kept


@contextlib.contextmanager
def onednn_only():
    """Layers packed inside this block take oneDNN's layout (the row kernel held off)."""
    from leapdecode.model import packed_linear
    kept = packed_linear.rows_kernel
    packed_linear.rows_kernel = lambda: None
    try:
        yield
    finally:
        packed_linear.rows_kernel = kept


def linears_table(model, reps: int = 5) -> None:
    from decode_roofline import timed
    from leapdecode.model.int8_linear import Int8Linear, linear_names
    from leapdecode.model.packed_linear import PackedLinear
    dense = [model.layers.get_submodule(n).weight for n in linear_names(model.layers)] + [model.output_head.weight]
    dense = [w.detach().float().contiguous().clone() for w in dense]
    with onednn_only():
        onednn = [PackedLinear(w) for w in dense]
        fbgemm = [Int8Linear(w) for w in dense]          # the row kernel held off: fbgemm for every row count
    rows_layers = [PackedLinear(w, grids=False) for w in dense]
    grid_layers = [PackedLinear(w) for w in dense]       # as the engine runs them: the file's codes where exact
    a8_layers = [PackedLinear(w, activations="int8") for w in dense]   # quantization="int8_activations" (LOSSY)
    int8_layers = [Int8Linear(w) for w in dense]        # as drafts run them: the row kernel up to ROWS_MAX rows
    kernels = sorted({p.kernel for layers in (rows_layers, int8_layers, grid_layers, a8_layers) for p in layers})
    mb = {name: sum(t.numel() * t.element_size() for p in layers for t in (p.packed, p.params)) / 2 ** 20
          for name, layers in (("float", rows_layers), ("grids", grid_layers))}
    print(f"\n(kernels: {kernels}; int8 through the row kernel up to {Int8Linear.ROWS_MAX} rows; weights read a "
          f"forward: float32 {mb['float']:.0f} MiB, as the engine holds them {mb['grids']:.0f} MiB)"
          "\n| rows | F.linear ms | oneDNN ms | row kernel ms | oneDNN / row kernel | GGUF codes ms | row kernel / "
          "codes | int8 fbgemm ms | int8 as drafts run it ms | fbgemm / int8 as run | codes, int8 activations ms | "
          "codes / int8 activations |"
          "\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rows in (1, 2, 5, 9, 17, 64, 512):
        xs = {d: torch.randn(rows, d) for d in {w.shape[1] for w in dense}}
        runs = {"mkl": lambda: [F.linear(xs[w.shape[1]], w) for w in dense],
                "onednn": lambda: [p(xs[p.in_features]) for p in onednn],
                "rows": lambda: [p(xs[p.in_features]) for p in rows_layers],
                "grids": lambda: [p(xs[p.in_features]) for p in grid_layers],
                "fbgemm": lambda: [p(xs[p.in_features]) for p in fbgemm],
                "int8": lambda: [p(xs[p.in_features]) for p in int8_layers],
                "a8": lambda: [p(xs[p.in_features]) for p in a8_layers]}
        t = {}
        for name, run in runs.items():
            run()                                       # warm-up (oneDNN makes a kernel per new row count)
            t[name] = timed(run, reps) * 1e3
        print(f"| {rows} | {t['mkl']:.1f} | {t['onednn']:.1f} | {t['rows']:.1f} | {t['onednn'] / t['rows']:.2f}x | "
              f"{t['grids']:.1f} | {t['rows'] / t['grids']:.2f}x | "
              f"{t['fbgemm']:.1f} | {t['int8']:.1f} | {t['fbgemm'] / t['int8']:.2f}x | {t['a8']:.1f} | "
              f"{t['grids'] / t['a8']:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--tables", default="linears,decode")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from leapdecode import LLM, SamplingParams
    from leapdecode.assets import default_chat_model_path
    from benchmarks.speculative import mtbench_questions, render_chat
    path = default_chat_model_path()
    print(f"model {os.path.basename(path)}; {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {args.threads} threads, load {os.getloadavg()[0]:.1f}")
    llms = {"F.linear": LLM(path, dtype="float32", cpu_packed_linears=False, kv_cache_memory="1GiB")}
    with onednn_only():
        llms["oneDNN"] = LLM(path, dtype="float32", cpu_packed_linears=True, kv_cache_memory="1GiB")
    with float_weights():
        llms["float weights"] = LLM(path, dtype="float32", cpu_packed_linears=True, kv_cache_memory="1GiB")
    llms["row kernel"] = LLM(path, dtype="float32", cpu_packed_linears=True, kv_cache_memory="1GiB")
    if "linears" in args.tables:
        linears_table(llms["row kernel"].engine.runner.model)
    if "decode" not in args.tables:
        return

    tok = llms["row kernel"].engine.tokenizer
    prompts = [render_chat(tok, [{"role": "user", "content": turns[0]}]) for turns in mtbench_questions()[:16]]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    hf = None
    if not args.skip_hf:
        import transformers
        d, f = os.path.split(path)
        hf = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    rates: dict[tuple[str, int], list[float]] = {}
    same = {1: True, 16: True}
    runs = [(name, llm, contextlib.nullcontext) for name, llm in llms.items()]
    runs.insert(3, ("layer by layer", llms["row kernel"], layer_by_layer))
    for _ in range(args.repeats):
        for batch, group in ((1, prompts[:args.prompts]), (16, prompts[:16])):
            outs = {}
            for name, llm, context in runs:
                t0 = time.perf_counter()
                with context():
                    if batch == 1:
                        res = [llm.generate([p], params, use_tqdm=False)[0] for p in group]
                    else:
                        res = llm.generate(group, params, use_tqdm=False)
                dt = time.perf_counter() - t0
                outs[name] = [r.outputs[0].token_ids for r in res]
                rates.setdefault((name, batch), []).append(len(group) * args.tokens / dt)
            same[batch] &= all(o == outs["F.linear"] for o in outs.values())
            if hf is not None and batch == 1:
                t0 = time.perf_counter()
                for p in group:
                    ids = torch.tensor([p])
                    with torch.no_grad():
                        hf.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False)
                rates.setdefault(("transformers", 1), []).append(len(group) * args.tokens / (time.perf_counter() - t0))
    print("\n| batch | F.linear tok/s | oneDNN tok/s | row kernel, float weights tok/s | GGUF codes, layer by layer "
          "tok/s | GGUF codes + one-call layer tok/s (default) | codes / float weights | one-call / layer by layer | "
          "default / F.linear | transformers tok/s | default / transformers | same greedy tokens |"
          "\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for batch in (1, 16):
        a, o, f, lbl, r = (statistics.median(rates[name, batch])
                           for name in ("F.linear", "oneDNN", "float weights", "layer by layer", "row kernel"))
        h = statistics.median(rates["transformers", 1]) if batch == 1 and hf is not None else None
        print(f"| {batch} | {a:.1f} | {o:.1f} | {f:.1f} | {lbl:.1f} | {r:.1f} | {r / f:.2f}x | {r / lbl:.2f}x | "
              f"{r / a:.2f}x | {'' if h is None else f'{h:.1f}'} | {'' if h is None else f'{r / h:.2f}x'} | "
              f"{'yes' if same[batch] else 'no'} |")


if __name__ == "__main__":
    main()
