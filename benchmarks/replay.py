"""Model-free replay of speculative decoding: how many tokens per step would each drafter give?

Input: jsonl records with ``prompt_token_ids`` and ``output_token_ids`` (from ``benchmarks/record_outputs.py``), or
``prompt``/``output`` text plus ``--tokenizer``. Optional ``output_topk_ids`` (the target's top-k at each step) are
passed to drafters' ``observe`` like the engine would after verification; without them (``topk=None``) the
drafters only see the committed tokens.

Greedy decoding is replayed token by token. Each step asks the drafter for a draft of at most ``k`` tokens (a chain
or a tree), accepts the longest root path that equals the recorded output (exactly what greedy verification
accepts), emits it plus the target's bonus token, and calls ``observe``. Reported per drafter:

  tok/step    tokens emitted per verification step (accepted drafts + the bonus): the speedup bound of speculation
  draft len   mean draft tokens (tree nodes) proposed per step
  verified/out  tokens verified per output token: (steps + draft tokens) / emitted tokens (what a CPU pays for)
  accept      accepted draft tokens / proposed draft tokens
  us/step     drafter CPU time per step (propose + observe; thread CPU time, so other processes on a shared
              machine do not inflate it), median and p99

Peers in the same run:
  hf_prompt_lookup  transformers' ``PromptLookupCandidateGenerator`` driven standalone with ``input_ids`` (its
                    defaults: max_matching_ngram_size=2; num_output_tokens = k, which is its default 10 at k=10)
  arctic_suffix     ArcticInference's ``SuffixDecodingCache`` (vLLM's suffix defaults: depth 24, factor 1.0,
                    min prob 0.1), when ``arctic_inference`` imports; otherwise the reason is printed. PyPI has
                    only its sdist (0.3.0); it builds for CPU without build isolation (which would pull a CUDA
                    torch) in a venv with nanobind==2.9.2, cmake, ninja, protobuf, grpcio-tools:
                    CMAKE_ARGS=-DPython_EXECUTABLE=$VENV/bin/python pip install --no-build-isolation --no-deps .
                    Only the suffix cache is needed, and it builds alone, outside the project's venv: in a scratch
                    venv with nanobind==2.9.2, ``cmake <sdist>/csrc/suffix_decoding -G Ninja
                    -DPython_EXECUTABLE=<that venv>/bin/python && ninja``, then a folder holding
                    ``arctic_inference/__init__.py`` (empty) and ``arctic_inference/suffix_decoding/`` (the sdist's
                    ``__init__.py`` and ``cache.py`` plus the built ``_C*.so``) on PYTHONPATH.

    python benchmarks/replay.py --data out/replay_stories260k.jsonl --k 10
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from leapdecode.spec.auto import accepted_length  # noqa: E402
from leapdecode.spec.drafter import Draft, Drafter, DraftRequest  # noqa: E402
from leapdecode.spec.registry import make_drafter  # noqa: E402


# -- peers -------------------------------------------------------------------------------------------------------------
class HFPromptLookup:
    """transformers' prompt-lookup candidate generator behind the Drafter protocol.

    ``get_candidates`` takes the whole ``input_ids`` tensor each step (that is how ``generate`` calls it); the tensor
    is kept per request and filled in place, so the timing is the generator's own search.
    """

    def __init__(self, max_matching_ngram_size: int = 2) -> None:
        import torch
        from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

        self._torch = torch
        self._make = lambda k: PromptLookupCandidateGenerator(num_output_tokens=k,
                                                              max_matching_ngram_size=max_matching_ngram_size,
                                                              max_length=1 << 30)
        self._generators: dict[int, object] = {}
        self._buffers: dict[int, tuple[object, int]] = {}

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        out = []
        for req in requests:
            if req.max_draft <= 0:
                out.append(Draft())
                continue
            gen = self._generators.get(req.max_draft)
            if gen is None:
                gen = self._generators[req.max_draft] = self._make(req.max_draft)
            ids = self._input_ids(req.seq_id, req.token_ids)
            candidates, _ = gen.get_candidates(ids)
            out.append(Draft(tokens=candidates[0, ids.shape[1]:].tolist()))
        return out

    def _input_ids(self, seq_id: int, token_ids: Sequence[int]):
        buf, n = self._buffers.get(seq_id, (None, 0))
        if buf is None or buf.shape[1] < len(token_ids):
            grown = self._torch.zeros((1, max(2 * len(token_ids), 64)), dtype=self._torch.long)
            if buf is not None:
                grown[0, :n] = buf[0, :n]
            buf = grown
        if len(token_ids) > n:
            buf[0, n:len(token_ids)] = self._torch.tensor(list(token_ids[n:]), dtype=self._torch.long)
        self._buffers[seq_id] = (buf, len(token_ids))
        return buf[:, :len(token_ids)]

    def observe(self, seq_id, token_ids, num_accepted, topk=None) -> None:
        pass

    def finish(self, seq_id, token_ids, num_prompt_tokens) -> None:
        self._buffers.pop(seq_id, None)


class ArcticSuffix:
    """ArcticInference's suffix cache behind the Drafter protocol (prompt tree per request + global output tree)."""

    def __init__(self, tree: bool, max_depth: int = 24, factor: float = 1.0, min_prob: float = 0.1,
                 max_cached_requests: int = 10000) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.cache = SuffixDecodingCache(max_tree_depth=max_depth, max_cached_requests=max_cached_requests)
        self.tree, self.max_depth, self.factor, self.min_prob = tree, max_depth, factor, min_prob
        self._sent: dict[int, int] = {}

    def _sync(self, seq_id: int, token_ids: Sequence[int], num_prompt: int) -> None:
        if seq_id not in self._sent:
            self.cache.start_request(seq_id, list(token_ids[:num_prompt]))
            self._sent[seq_id] = num_prompt
        sent = self._sent[seq_id]
        if len(token_ids) > sent:
            self.cache.add_active_response(seq_id, list(token_ids[sent:]))
            self._sent[seq_id] = len(token_ids)

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        out = []
        for req in requests:
            self._sync(req.seq_id, req.token_ids, req.num_prompt_tokens)
            if req.max_draft <= 0:
                out.append(Draft())
                continue
            d = self.cache.speculate(req.seq_id, list(req.token_ids[-self.max_depth:]), max_spec_tokens=req.max_draft,
                                     max_spec_factor=self.factor, min_token_prob=self.min_prob,
                                     use_tree_spec=self.tree)
            tokens, parents = list(d.token_ids), list(d.parents)
            chain = all(p == i - 1 for i, p in enumerate(parents))
            out.append(Draft(tokens=tokens, parents=None if chain else parents, score=min(1.0, float(d.score))))
        return out

    def observe(self, seq_id, token_ids, num_accepted, topk=None) -> None:
        if seq_id in self._sent:
            sent = self._sent[seq_id]
            if len(token_ids) > sent:
                self.cache.add_active_response(seq_id, list(token_ids[sent:]))
                self._sent[seq_id] = len(token_ids)

    def finish(self, seq_id, token_ids, num_prompt_tokens) -> None:
        if self._sent.pop(seq_id, None) is not None:
            self.cache.stop_request(seq_id)


# -- replay ------------------------------------------------------------------------------------------------------------
@dataclass
class Record:
    dataset: str
    prompt: list[int]
    output: list[int]
    topk: list[list[int]] | None


@dataclass
class Stats:
    steps: int = 0
    emitted: int = 0
    drafted: int = 0
    accepted: int = 0
    micros: list[float] = field(default_factory=list)

    def add(self, other: "Stats") -> None:
        self.steps += other.steps
        self.emitted += other.emitted
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.micros += other.micros


def replay(drafter: Drafter, records: list[Record], k: int, use_topk: bool) -> dict[str, Stats]:
    """Replay every record in order (global drafter state carries over, like a server); stats per dataset."""
    per_dataset: dict[str, Stats] = defaultdict(Stats)
    clock = time.thread_time_ns      # CPU time of this thread: robust to other load on a shared machine
    for seq_id, rec in enumerate(records):
        stats = per_dataset[rec.dataset]
        ctx = list(rec.prompt)
        out, t = rec.output, 0
        while t < len(out):
            t0 = clock()
            draft = drafter.propose([DraftRequest(seq_id, ctx, len(rec.prompt), k)])[0]
            t1 = clock()
            _check(draft, k)
            acc = accepted_length(draft, out[t:t + k])
            emitted = min(acc + 1, len(out) - t)
            accepted = emitted - 1        # the last emitted token is always the target's own (the bonus)
            topk = None
            if use_topk and rec.topk is not None:
                # Rows for the last committed token and each accepted position: distributions for out[t .. t+acc].
                topk = rec.topk[t:t + accepted + 1]
            ctx.extend(out[t:t + emitted])
            t += emitted
            t2 = clock()
            drafter.observe(seq_id, ctx, accepted, topk)
            t3 = clock()
            stats.steps += 1
            stats.emitted += emitted
            stats.drafted += len(draft)
            stats.accepted += accepted
            stats.micros.append(((t1 - t0) + (t3 - t2)) / 1000.0)
        drafter.finish(seq_id, ctx, len(rec.prompt))
    return per_dataset


# -- the controller on a fabricated machine ------------------------------------------------------------------------
def _measured_cpu(n: int) -> float:
    """SmolLM2-135M (Q4_1) at batch 1 on the 2-core VM after session 26's CPU step: a verification step of n
    tokens costs T(n) / T(1) = 1, 1.21, 1.32, 1.48, 1.69, 1.85, 1.99, 2.10, 2.43 for n = 1..9 (benchmarks README,
    "The CPU step piece by piece"; n = 6 interpolated), then ~0.17 a token (T(17) / T(1) ~3.8), T(1) = 8 ms."""
    ratios = (1.0, 1.21, 1.32, 1.48, 1.69, 1.85, 1.99, 2.10, 2.43)
    r = ratios[n - 1] if n <= len(ratios) else ratios[-1] + 0.17 * (n - len(ratios))
    return 0.008 * r


MACHINES = {
    # seconds for a step of n tokens; "cpu" is shaped like SmolLM2-135M on one CPU core (a multi-token forward
    # costs a jump, then every token costs), "gpu" like a small model on a GPU (flat until a knee), "cpu-smollm2"
    # the measured curve of the default model on the 2-core VM
    "cpu": lambda n: 0.020 + (0.006 if n > 1 else 0.0) + 0.003 * (n - 1),
    "gpu": lambda n: 0.006 + 0.00001 * n + (0.00005 * (n - 256) if n > 256 else 0.0),
    "cpu-smollm2": _measured_cpu,
}


class _Seq:
    def __init__(self, seq_id: int, prompt: list[int]) -> None:
        self.seq_id, self.token_ids, self.num_prompt_tokens = seq_id, list(prompt), len(prompt)
        self.num_computed_tokens = len(prompt)
        self.params, self.index, self.block_table = None, 0, ()     # what model drafters read; unused here
        self.is_finished = False


@dataclass
class SimStats:
    tokens: int = 0
    seconds: float = 0.0          # simulated step times plus the speculator's real time (drafting, controller)
    plain: float = 0.0            # the same tokens decoded one per step
    verified: int = 0


def controller_replay(make: Callable[[], Drafter], records: list[Record], k: int, machine: str,
                      adaptive: bool, noise: float = 0.0, seed: int = 0, fresh: bool = True) -> dict[str, SimStats]:
    """Batch-1 replay through the real Speculator (controller, guard, shadow drafts) on a fabricated step-time
    curve, every record in turn through one speculator (as one engine serves them: its controller carries what it
    learnt from one task to the next), a fresh drafter for each dataset (as benchmarks/real_model.py measures;
    ``fresh=False``: one drafter for all, as a server keeps it);
    drafting and the controller's decisions cost their real wall time. ``noise``: each step's time is the curve's
    times a lognormal factor of that sigma (seeded), as a machine's steps vary. Per dataset: its SimStats."""
    from leapdecode.config import SpeculativeConfig
    from leapdecode.spec.controller import StepTimeModel
    from leapdecode.spec.speculator import CONTROLLED_AUTO, Speculator

    curve = MACHINES[machine]
    rng = np.random.default_rng(seed)
    probe = StepTimeModel()
    for n in (1, 2, 4, 8, 16, 32, 64, 1, 2, 4, 8, 16, 32, 64):
        probe.observe(n, curve(n))
    spec = None
    out: dict[str, SimStats] = {}
    for seq_id, rec in enumerate(records):
        if rec.dataset not in out and (fresh or spec is None):
            drafter = make()
            if adaptive and hasattr(drafter, "min_accept_prob"):
                for key, value in CONTROLLED_AUTO.items():    # what the speculator gives an auto it builds itself
                    setattr(drafter, key, value)
            if spec is None:
                spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=k, adaptive=adaptive,
                                                    drafter=drafter), 1 << 20, probe)
            else:
                spec.drafter = drafter
        st = out.setdefault(rec.dataset, SimStats())
        seq, target, t = _Seq(seq_id, rec.prompt), rec.output, 0
        t0 = time.perf_counter()
        spec.prepare([seq])
        st.seconds += time.perf_counter() - t0
        while t < len(target):
            t0 = time.perf_counter()
            tree = spec.propose([seq], [k], 0).get(seq_id)
            spent = time.perf_counter() - t0
            acc = tree.accepted_length(target[t:t + len(tree)]) if tree else 0
            emitted = min(acc + 1, len(target) - t)
            seq.token_ids.extend(target[t:t + emitted])
            t += emitted
            seq.is_finished = t >= len(target)
            n = 1 + (len(tree) if tree else 0)
            t0 = time.perf_counter()
            spec.observe(seq, n - 1, emitted - 1, None)
            step = curve(n) * (float(np.exp(rng.normal(0.0, noise))) if noise else 1.0)
            spent += time.perf_counter() - t0
            spec.observe_step(n, step + spent, emitted=emitted)
            st.seconds += step + spent
            st.verified += n
        st.tokens += len(target)
        st.plain += len(target) * curve(1)
        spec.finish(seq)
    return out


def _check(draft: Draft, k: int) -> None:
    if len(draft) > k:
        raise AssertionError(f"draft of {len(draft)} tokens exceeds max_draft={k}")
    if draft.parents is not None and any(not -1 <= p < i for i, p in enumerate(draft.parents)):
        raise AssertionError(f"draft parents are not topological: {draft.parents}")


def load_records(paths: list[str], tokenizer_dir: str | None, limit: int | None,
                 max_output: int | None = None) -> list[Record]:
    """Records of jsonl files; ``limit``: the first N only; ``max_output``: each record's first N output tokens."""
    tokenizer = None
    records = []
    for path in paths:
        for line in open(path):
            row = json.loads(line)
            if "prompt_token_ids" in row:
                prompt, output = row["prompt_token_ids"], row["output_token_ids"]
            else:
                if tokenizer is None:
                    if not tokenizer_dir:
                        sys.exit("text records need --tokenizer")
                    from transformers import AutoTokenizer
                    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
                prompt = tokenizer(row["prompt"])["input_ids"]
                output = tokenizer(row["output"], add_special_tokens=False)["input_ids"]
            topk = row.get("output_topk_ids")
            if max_output:
                output, topk = output[:max_output], topk[:max_output] if topk is not None else None
            if output:
                records.append(Record(row.get("dataset", Path(path).stem), prompt, output, topk))
    return records[:limit] if limit else records


def drafter_factories(vocab_size: int) -> dict[str, tuple[Callable[[], Drafter], bool]]:
    """name -> (factory, whether observe gets the recorded top-k rows)."""
    return {
        "hf_prompt_lookup": (HFPromptLookup, False),
        "ngram": (lambda: make_drafter("ngram"), False),
        "ngram_tree": (lambda: make_drafter("ngram", num_branches=3), False),
        "suffix": (lambda: make_drafter("suffix"), False),
        "suffix_chain": (lambda: make_drafter("suffix", tree=False), False),
        "suffix_f1": (lambda: make_drafter("suffix", max_spec_factor=1.0), False),   # arctic's length factor
        "recycling+topk": (lambda: make_drafter("recycling", vocab_size=vocab_size), True),
        "recycling(tokens)": (lambda: make_drafter("recycling", vocab_size=vocab_size), False),
        "auto+topk": (lambda: make_drafter("auto", vocab_size=vocab_size), True),
        "auto(tokens)": (lambda: make_drafter("auto", vocab_size=vocab_size), False),
        # the uncalibrated auto of earlier rounds: best draft by expected length, topped up with the others' guesses
        "auto_fill(tokens)": (lambda: make_drafter("auto", vocab_size=vocab_size, calibrate=False), False),
        # calibrated auto offering down to the bar the speculator sets under the controller for it
        "auto_0.02(tokens)": (lambda: make_drafter("auto", vocab_size=vocab_size, min_accept_prob=0.02), False),
        # auto in order, as the speculator builds it under the controller (spec/auto.py, ``fallback``); with
        # --machine every auto row is built so (CONTROLLED_AUTO)
        "auto_in_order(tokens)": (lambda: make_drafter("auto", vocab_size=vocab_size, fallback=True), False),
        "arctic_suffix": (lambda: ArcticSuffix(tree=False), False),
        "arctic_suffix_tree": (lambda: ArcticSuffix(tree=True), False),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", nargs="+", required=True, help="jsonl file(s)")
    ap.add_argument("--tokenizer", help="tokenizer dir for text records")
    ap.add_argument("--k", default="10", help="max draft tokens per step, comma-separated list")
    ap.add_argument("--drafters", help="comma-separated subset of drafter names (default: all)")
    ap.add_argument("--limit", type=int, help="replay only the first N records")
    ap.add_argument("--max-output", type=int, help="replay only each record's first N output tokens (a small "
                    "model's long answers end in loops that copy easily; benchmarks/real_model.py decodes 48)")
    ap.add_argument("--machine", choices=sorted(MACHINES),
                    help="instead: run the speculation controller on this fabricated step-time curve, adaptive vs "
                         "fixed k vs plain decoding (simulated tokens/s at batch 1)")
    ap.add_argument("--noise", type=float, default=0.0, help="--machine: lognormal sigma of each step's time")
    ap.add_argument("--seeds", type=int, default=1, help="--machine: runs with seeds 0..N-1 (median and min)")
    ap.add_argument("--python", action="store_true", help="our drafters in pure Python (no compiled hot paths, "
                    "leapdecode/spec/compiled.py): the same drafts, their CPU cost without the C++")
    args = ap.parse_args()
    if args.python:
        os.environ["LEAPDECODE_NO_CPU_KERNELS"] = "1"      # before anything builds the drafting module
    from leapdecode.spec.compiled import core

    from rich.console import Console
    from rich.table import Table
    from tqdm import tqdm

    console = Console(width=150)
    records = load_records(args.data, args.tokenizer, args.limit, args.max_output)
    if not records:
        sys.exit("no records")
    # like the engine after start-up: what is alive now (records, imported modules) is moved out of the collector's
    # reach, so a full collection inside a step scans only what the drafters allocate (as it would in the engine)
    gc.collect()
    gc.freeze()
    has_topk = any(r.topk is not None for r in records)
    vocab = max(max(r.prompt + r.output) for r in records) + 1
    factories = drafter_factories(vocab)
    names = [n.strip() for n in args.drafters.split(",")] if args.drafters else list(factories)
    if not has_topk:
        names = [n for n in names if not n.endswith("+topk")]
    available: dict[str, Callable[[], Drafter]] = {}
    for name in names:
        if name not in factories:
            sys.exit(f"unknown drafter {name!r}; choose from {list(factories)}")
        try:
            factories[name][0]()
            available[name] = factories[name][0]
        except Exception as e:  # a peer that is not installed or does not run here
            console.print(f"[yellow]{name} not available: {type(e).__name__}: {e}[/yellow]")
    models = sorted({json.loads(open(p).readline()).get("model", "?") for p in args.data})
    datasets = sorted({r.dataset for r in records})
    out_tokens = sum(len(r.output) for r in records)
    console.print(f"data: {', '.join(args.data)} | model: {', '.join(models)} | {len(records)} records, "
                  f"{out_tokens} output tokens | datasets: {', '.join(datasets)} | top-k rows: "
                  f"{'yes' if has_topk else 'no'} | CPU: {os.cpu_count()} cores, us = thread CPU time | our drafters: "
                  f"{'compiled' if core() is not None else 'pure Python'}")

    if args.machine:
        table = Table(title=f"controller replay on the fabricated '{args.machine}' machine, batch 1, noise "
                            f"{args.noise} over {args.seeds} seeds (tokens/s relative to plain decoding: median, "
                            "min; verified tokens per output token)")
        for col in ("drafter", "k", "dataset", "adaptive", "min", "fixed k", "verified/out (adaptive)"):
            table.add_column(col, justify="left" if col in ("drafter", "dataset") else "right")
        for k in [int(x) for x in args.k.split(",")]:
            for name in available:
                if factories[name][1]:
                    continue
                runs = [controller_replay(available[name], records, k, args.machine, True, args.noise, s)
                        for s in range(args.seeds)]
                fixed = controller_replay(available[name], records, k, args.machine, False)
                for ds in datasets:
                    ratios = sorted(r[ds].plain / r[ds].seconds for r in runs)
                    v = sum(r[ds].verified for r in runs) / sum(r[ds].tokens for r in runs)
                    table.add_row(name, str(k), ds, f"{np.median(ratios):.3f}x", f"{ratios[0]:.3f}x",
                                  f"{fixed[ds].plain / fixed[ds].seconds:.2f}x", f"{v:.2f}")
        console.print(table)
        return

    for k in [int(x) for x in args.k.split(",")]:
        results: dict[str, dict[str, Stats]] = {}
        for name in tqdm(list(available), desc=f"k={k}", leave=False):
            results[name] = replay(available[name](), records, k, use_topk=factories[name][1])
        ref = _total(results["hf_prompt_lookup"]) if "hf_prompt_lookup" in results else None
        table = Table(title=f"replay, k={k} (tokens per step include the bonus token)")
        for col in ("drafter", "tok/step", "vs HF PLD", "draft len", "verified/out", "accept", "us/step med",
                    "us/step p99"):
            table.add_column(col, justify="left" if col == "drafter" else "right")
        for name, per_ds in results.items():
            s = _total(per_ds)
            ratio = f"{(s.emitted / s.steps) / (ref.emitted / ref.steps):.2f}x" if ref else "-"
            table.add_row(name, f"{s.emitted / s.steps:.3f}", ratio, f"{s.drafted / s.steps:.2f}",
                          f"{(s.steps + s.drafted) / s.emitted:.2f}", f"{s.accepted / max(1, s.drafted):.1%}",
                          f"{np.median(s.micros):.0f}", f"{np.percentile(s.micros, 99):.0f}")
        console.print(table)
        by_ds = Table(title=f"tokens per step by dataset, k={k}")
        by_ds.add_column("drafter")
        for ds in datasets:
            by_ds.add_column(ds, justify="right")
        for name, per_ds in results.items():
            by_ds.add_row(name, *[f"{per_ds[ds].emitted / per_ds[ds].steps:.3f}" if per_ds[ds].steps else "-"
                                  for ds in datasets])
        console.print(by_ds)
    console.print("notes: '(tokens)' rows get topk=None in observe, so Token Recycling learns only from committed "
                  "tokens (bigram move-to-front), not from the model's discarded top-k candidates; '+topk' rows get "
                  "the recorded top-k rows of the accepted positions only (no rows for rejected tree nodes).")


def _total(per_ds: dict[str, Stats]) -> Stats:
    total = Stats()
    for s in per_ds.values():
        total.add(s)
    return total


if __name__ == "__main__":
    main()
