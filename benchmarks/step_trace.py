"""Per-step trace of the speculation controller on the real default model (issue 19's batch check): for plain
decoding and each method, every step's shape (tokens, sequences, draft tokens), its forward time and whole time,
and each controller decision (draft tokens offered and chosen, predicted step times, the claims it counted on,
the claim discount) beside what the step then accepted. A development tool (lines, not a table): it is how the
session-11 changes to spec/controller.py were found (benchmarks/README.md, "Batch 1, 16 and 64 on the CPU after
pricing steps per batch size").

    python benchmarks/step_trace.py                          # batch 64, 16 tokens, 4 repeats, plain and auto
    B=16 NEW=32 REPS=2 METHODS=plain,ngram,auto SHOW=2,3 python benchmarks/step_trace.py

Repeats take the benchmark's prompts in the same order as real_model.py --spec-batches (repeats 2 and 3 reuse
repeat 0's prompts: prefix-cached, decode-dominated); SHOW picks the repeats whose steps are printed.
"""
import itertools
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.dirname(_HERE))

import torch  # noqa: E402

import real_model as rm  # noqa: E402
from leapdecode import LLM, SamplingParams  # noqa: E402
from leapdecode.llm import resolve_model  # noqa: E402


def main() -> None:
    torch.set_num_threads(int(os.environ.get("THREADS", 2)))
    reps, batch, new = int(os.environ.get("REPS", 4)), int(os.environ.get("B", 64)), int(os.environ.get("NEW", 16))
    methods = os.environ.get("METHODS", "plain,auto").split(",")
    show = {int(x) for x in os.environ.get("SHOW", "2,3").split(",")}
    path = resolve_model(None)
    probe = LLM(path, kv_cache_memory="1GiB", max_num_seqs=24)
    tasks = rm.spec_tasks(probe, probe.get_tokenizer(), 24, 96)
    del probe
    mixed = [p for g in itertools.zip_longest(*tasks.values()) for p in g if p is not None]

    def take(rep: int) -> list:
        start = (rep * batch) % len(mixed)
        return [mixed[(start + i) % len(mixed)] for i in range(batch)]

    llms, lines = {}, {}
    for m in methods:
        spec = None if m == "plain" else {"method": m, "num_speculative_tokens": 4}
        llms[m] = LLM(path, kv_cache_memory="1GiB", max_num_seqs=batch, speculative_config=spec)
        llms[m].generate([mixed[0][:8]], SamplingParams(max_tokens=2), use_tqdm=False)
        lines[m] = []
        _instrument(llms[m].engine, lines[m])
    params = SamplingParams(temperature=0.0, max_tokens=new)
    for rep in range(reps):
        for m in methods:
            sp = llms[m].engine.speculator
            if sp is not None:
                sp.drafter = sp.new_drafter()
            lines[m].clear()
            t0 = time.perf_counter()
            outs = llms[m].generate(take(rep), params, use_tqdm=False)
            wall = time.perf_counter() - t0
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            print(f"repeat {rep} {m}: {tokens / wall:.1f} tok/s, {wall:.2f} s", flush=True)
            if rep in show:
                print("\n".join(lines[m]), flush=True)


def _instrument(engine, out: list) -> None:
    """Wrap the runner's forward, the speculator's step report and outcomes, and the controller's decision, so that
    each appends one line to ``out``."""
    runner_execute = engine.runner.execute

    def execute(plan, *a, **k):
        t0 = time.perf_counter()
        r = runner_execute(plan, *a, **k)
        if getattr(r, "logits", None) is not None:
            r.logits.cpu()
        out.append(f"  forward  tokens {plan.num_tokens:5d}  seqs {len(plan.seqs):3d}  drafted {plan.num_drafted:3d}"
                   f"  {1000 * (time.perf_counter() - t0):7.1f} ms")
        return r
    engine.runner.execute = execute
    sp = engine.speculator
    if sp is None:
        return
    outcome = [0, 0]
    sp_observe, sp_step = sp.observe, sp.observe_step

    def observe(seq, k, accepted, topk):
        outcome[0] += k
        outcome[1] += accepted
        sp_observe(seq, k, accepted, topk)

    def observe_step(n, seconds, *a, **k):
        out.append(f"  step     tokens {n:5d}  decode-only seqs {sp._decode_seqs}  {1000 * seconds:7.1f} ms"
                   f" (drafter {1000 * sp._step_draft_seconds:.1f} ms)  drafted {outcome[0]} accepted {outcome[1]}")
        outcome[0] = outcome[1] = 0
        sp_step(n, seconds, *a, **k)
    sp.observe, sp.observe_step = observe, observe_step
    ctl = sp.controller
    if ctl is None:
        return
    draft_lengths, worth_drafting = ctl.draft_lengths, ctl.worth_drafting
    probing = [False]

    def worth(*a, **k):           # the quiet re-check calls draft_lengths too: its lines say "probe"
        probing[0] = True
        try:
            return worth_drafting(*a, **k)
        finally:
            probing[0] = False
    ctl.worth_drafting = worth

    def decide(props, other, charge=0.0, num_seqs=None, **kw):
        keep = draft_lengths(props, other, charge, num_seqs, **kw)
        st, chosen, c = ctl.step_time, sum(keep), ctl.last_choice
        t0, t1 = st(other, num_seqs), st(other + max(chosen, 1), num_seqs)
        gain = c.get("gain", float("nan"))       # (a decision taken before any pricing records no gain)
        claimed = gain * len(props) * (t1 + (charge if chosen else 0.0)) / t0 - len(props) if chosen else 0.0
        out.append(f"  {'probe ' if probing[0] else 'decide'}   requests {len(props)}  base {other}"
                   f"  offered {sum(p[1] for p in props)}"
                   f"  chosen {chosen}"
                   f"  T(base) {1000 * t0:.0f} ms  T(base+chosen) {1000 * t1:.0f} ms  claimed ~{claimed:.1f}"
                   f"  gain {gain:.2f}  explored {c.get('explored')}  discount {c.get('realized', float('nan')):.2f}")
        return keep
    ctl.draft_lengths = decide


if __name__ == "__main__":
    main()
