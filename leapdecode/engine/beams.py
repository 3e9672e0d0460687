"""Beam search requests inside the engine's step: the beams of a request are ordinary sequences.

Each live beam is a running ``Sequence`` whose step samples one row, with the row's top log-probs reported
(``SamplingParams.logprobs``); after the verifier and before ``Scheduler.update``, ``BeamRequests.decide`` hands those
rows to the request's ``BeamSearch`` (decoding/beam_search.py) and turns its choice into scheduler moves:

- a beam continued by one chosen token keeps its sequence (its ``SeqResult`` now carries that token);
- every further child of the same beam is ``Scheduler.fork``: a new sequence that shares the parent's full KV
  blocks and copies its partial last block, so w beams of a 1,000-token prompt hold one copy of the prompt;
- a beam with no child is finished ("pruned") and its blocks go back (shared ones stay with their other holders).

The beams of a request step in lockstep: a decision needs the rows of all of them from the same step. If one is
missing (preempted, or a fork recomputing its tail was cut by the token budget), the others choose no token
(``SeqResult.tokens == ()``), so the scheduler computes their last token again next step, and the decision waits.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from leapdecode.decoding.beam_search import BeamSearch
from leapdecode.engine.scheduler import Scheduler
from leapdecode.engine.sequence import Sequence
from leapdecode.engine.step import SeqResult, StepPlan, StepResult
from leapdecode.sampling_params import SamplingParams


def beam_sampling_params(search: BeamSearch) -> SamplingParams:
    """What each beam's row asks of the sampler: nothing drawn (greedy), the top log-probs reported; stops are
    the search's business, so the sequence itself never stops before max_model_len."""
    return SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True, logprobs=search.num_logprobs,
                          skip_special_tokens=search.params.skip_special_tokens)


@dataclass
class BeamOutcome:
    result: StepResult
    forks: list[Sequence] = field(default_factory=list)       # new beams, to register with their requests
    pruned: list[Sequence] = field(default_factory=list)      # finished by the scheduler: clean up after them
    done: list[str] = field(default_factory=list)             # requests whose search ended this step


class BeamRequests:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.searches: dict[str, BeamSearch] = {}

    def __bool__(self) -> bool:
        return bool(self.searches)

    def add(self, request_id: str, search: BeamSearch) -> None:
        self.searches[request_id] = search

    def remove(self, request_id: str) -> None:
        self.searches.pop(request_id, None)

    def decide(self, plan: StepPlan, result: StepResult, seqs: Mapping[int, Sequence]) -> BeamOutcome:
        """Apply every beam request's decision for this step (before ``Scheduler.update``)."""
        rows = dict(result.seqs)
        out = BeamOutcome(result)
        sampled = {c.seq_id for c in plan.seqs if c.samples}
        for request_id, search in list(self.searches.items()):
            live = search.live()
            failed = [result.errors[sid] for sid in live if sid in result.errors]
            if failed:                                 # one beam's fault ends the search (update finishes it)
                for sid in live - set(result.errors):
                    rows.pop(sid, None)
                    self.scheduler.finish(seqs[sid], "error", failed[0])
                    out.pruned.append(seqs[sid])
                out.done.append(request_id)
                del self.searches[request_id]
                continue
            here = {sid for sid in live if sid in rows and sid in sampled}
            if not here:
                continue
            if here != live:                           # wait for the whole group
                for sid in here:
                    rows[sid] = SeqResult(sid, (), ())
                continue
            children = search.step({sid: (seqs[sid].output_token_ids, list(rows[sid].logprobs[0][1]))
                                    for sid in live})
            holders: list[int] = []
            first: dict[int, int] = {}                 # parent -> the token its own sequence continues with
            index = max(s.index for s in (seqs[sid] for sid in live)) + 1
            for child in children:                     # forks first: they copy the parent before it moves on
                if child.parent not in first:
                    first[child.parent] = child.token
                    holders.append(child.parent)
                    continue
                seq = self.scheduler.fork(seqs[child.parent], child.token, index)
                index += 1
                out.forks.append(seq)
                holders.append(seq.seq_id)
            for sid in live:
                if sid in first:
                    rows[sid] = SeqResult(sid, (), (first[sid],))
                else:                                  # no child: the beam ends here
                    rows.pop(sid, None)
                    self.scheduler.finish(seqs[sid], "pruned")
                    out.pruned.append(seqs[sid])
            search.assign(children, holders)
            if search.done:
                out.done.append(request_id)
                del self.searches[request_id]
        out.result = StepResult(result.step_id, rows, result.prompt_logprobs, result.errors)
        return out
