"""Trace the speculation controller and guard on the embedded model: per method, tokens/s, the median step time per
token count, drafting time per step, the controller's time per call and the draft sizes it chose, its step-time
model, and the guard's measured seconds per token per mode. GPU when there is one (graphs, Triton), else CPU.

    CASES=plain,ngram,ngram4,suffix,suffix4,draft,draft4 BATCHES=1,64 NEW=128 python benchmarks/controller_trace.py
    GUARD=0 ...     # the guard switched off (the controller alone)
    ASYNC=1 ...     # async scheduling (overlapped steps; a speculating engine overlaps while its guard has it off)
    SKIP=1 ...      # start from the second prompt (the first, at batch 1, is a digit loop the draft model misses)
    PROF=64 ...     # also cProfile plain decoding at that batch (the host's share of a step, function by function)

A development tool (one line per case, not a table): the H200 traces of 2026-11-27 are in
results/h200-2026-11-27-session7/.
"""
import sys, time, collections, statistics, os
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE); sys.path.insert(0, os.path.dirname(_HERE))
import torch
from leapdecode import LLM, SamplingParams
from leapdecode.assets import default_model_path, default_draft_model_path
import gpu_suite as gs
DEV = "cuda" if torch.cuda.is_available() else "cpu"
BACK = "triton" if DEV == "cuda" else "torch"
out_len = int(os.environ.get("NEW", 128))
def sync():
    if DEV == "cuda": torch.cuda.synchronize()
def run(label, spec, batch):
    llm = LLM(default_model_path(), dtype="bfloat16" if DEV == "cuda" else "float32", device=DEV, attention_backend=BACK,
              max_model_len=1024, max_num_seqs=batch, speculative_config=spec, enable_prefix_caching=False,
              kv_cache_memory="4GiB" if DEV == "cuda" else "1GiB", async_scheduling=os.environ.get("ASYNC") == "1")
    skip = int(os.environ.get("SKIP", 0))
    prompts = gs.code_prompts(llm.engine.tokenizer, batch + skip, 96)[skip:]
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    sp = llm.engine.speculator
    rec = []
    props = []
    if sp is not None:
        if os.environ.get("GUARD") == "0":
            sp.guard = None
        drafter = sp.drafter
        orig_prop = drafter.propose
        def prop(reqs):
            sync(); t0 = time.perf_counter(); r = orig_prop(reqs); sync()
            props.append((time.perf_counter() - t0, len(reqs), sum(q.max_draft for q in reqs)))
            return r
        drafter.propose = prop
        orig_obs = sp.observe_step
        def obs(n, s, *a):
            rec.append(("step", n, s, sp._step_draft_seconds)); orig_obs(n, s, *a)
        sp.observe_step = obs
        ctl = sp.controller
        if ctl is not None:
            orig_dl = ctl.draft_lengths
            def dl(*a, **k):
                t0 = time.perf_counter(); r = orig_dl(*a, **k)
                rec.append(("ctl", time.perf_counter() - t0, dict(ctl.last_choice), sum(r), sum(p[1] for p in a[0])))
                return r
            ctl.draft_lengths = dl
    else:
        eng = llm.engine
    sync(); t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync(); el = time.perf_counter() - t0
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    line = f"{label:28s} b={batch:3d} tok/s={toks/el:9.1f} steps={llm.engine.stats['steps']}"
    if sp is not None:
        steps = [r for r in rec if r[0] == "step"]
        byn = collections.defaultdict(list)
        for _, n, s, d in steps: byn[n].append(s)
        line += " | T(n) med ms: " + " ".join(f"{n}:{statistics.median(v)*1e3:.2f}x{len(v)}" for n, v in sorted(byn.items())[:12])
        line += f" | draft ms/step med {statistics.median([d for *_, d in steps])*1e3:.3f}" if steps else ""
        ctls = [r for r in rec if r[0] == "ctl"]
        if ctls:
            line += f" | ctl calls {len(ctls)} med {statistics.median([c[1] for c in ctls])*1e6:.0f}us"
            line += " chosen hist " + str(sorted(collections.Counter(c[3] for c in ctls).items()))
            line += " offered hist " + str(sorted(collections.Counter(c[4] for c in ctls).items())[:8])
            ctl = sp.controller
            import numpy as np
            line += " | model T(b..b+8) ms " + " ".join(f"{x*1e3:.2f}" for x in ctl.step_time.predict(np.arange(batch, batch + 9)))
            line += f" draft_ema {sp.draft_seconds_ema*1e3:.3f}ms speculating={sp._speculating}"
        line += f" acc {llm.engine.stats['accepted_tokens']}/{llm.engine.stats['draft_tokens']}"
        if props:
            ts = sorted(p[0] for p in props)
            line += (f" | propose calls {len(props)} med {statistics.median(ts)*1e3:.3f}ms max {ts[-1]*1e3:.1f}ms"
                     f" sum {sum(ts)*1e3:.1f}ms first5 " + ",".join(f"{p[0]*1e3:.1f}" for p in props[:5]))
            if hasattr(drafter, "stats"):
                line += f" drafter stats {drafter.stats}"
        g = getattr(sp, "guard", None)
        if g is not None:
            line += f" | guard vetoes {g.num_vetoes} vetoed_now {g.vetoed(batch)} " + " ".join(
                f"{k}:" + ",".join(f"{m}={r.spt*1e3:.3f}ms/tok x{r.count}" for m, r in b.rates.items()) for k, b in g._batches.items())
    print(line, flush=True)
    del llm; gs.free() if DEV == "cuda" else None
cases = os.environ.get("CASES", "plain,ngram,ngram4,suffix,suffix4").split(",")
for batch in [int(b) for b in os.environ.get("BATCHES", "1").split(",")]:
    for c in cases:
        spec = {"plain": None, "ngram": {"method": "ngram", "num_speculative_tokens": 4},
                "ngram4": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
                "suffix": {"method": "suffix", "num_speculative_tokens": 4},
                "suffix4": {"method": "suffix", "num_speculative_tokens": 4, "adaptive": False},
                "draft": {"method": "draft_model", "model": default_draft_model_path(), "num_speculative_tokens": 4},
                "draft4": {"method": "draft_model", "model": default_draft_model_path(), "num_speculative_tokens": 4,
                           "adaptive": False}}[c]
        run(c, spec, batch)
if os.environ.get("PROF"):
    import cProfile, pstats
    b = int(os.environ["PROF"])
    llm = LLM(default_model_path(), dtype="bfloat16" if DEV == "cuda" else "float32", device=DEV, attention_backend=BACK,
              max_model_len=1024, max_num_seqs=b, enable_prefix_caching=False,
              kv_cache_memory="4GiB" if DEV == "cuda" else "1GiB")
    prompts = gs.code_prompts(llm.engine.tokenizer, b, 96)
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    sync(); t0 = time.perf_counter(); llm.generate(prompts, params, use_tqdm=False); sync()
    print(f"plain b={b} unprofiled {time.perf_counter()-t0:.3f}s steps {llm.engine.stats['steps']}")
    pr = cProfile.Profile(); pr.enable(); llm.generate(prompts, params, use_tqdm=False); sync(); pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(30)
    pstats.Stats(pr).sort_stats("cumtime").print_stats(45)
