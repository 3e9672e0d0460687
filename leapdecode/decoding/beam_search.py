"""Beam search and diverse beam search: which beams live on after a step, and which hypotheses are finished.

This module is the decision alone, plain Python over the top log-probabilities of each live beam's row; the
engine (engine/beams.py) runs the beams as ordinary sequences of one request, which the scheduler forks
copy-on-write (``Scheduler.fork``), so beams share every full KV block of their common prefix.

The rules are transformers' ``generate(num_beams=...)`` (the vectorised beam search of transformers >= 4.50), so
users get the beams they know:

- candidates: the K = max(2, 1 + number of stop tokens) * width best (beam, token) pairs by accumulated log-prob
  (the sum of log-softmax of the raw logits over the beam's generated tokens);
- a candidate that ends with a stop token, or reaches the length limit, *hits*; the ``width`` best candidates that
  do not hit are the next beams; hits among the first ``width`` candidates become hypotheses scored
  ``logprob / generated_length ** length_penalty`` (the length includes the stop token), the ``width`` best kept;
- the search ends when every candidate hits (the length limit), when ``early_stopping`` is True and ``width``
  hypotheses are finished, or when no beam can still beat the worst kept hypothesis (for ``early_stopping=False``
  judged at the current length; for ``"never"`` with a positive length penalty, at the longest possible length).

Diverse beam search (Vijayakumar et al., "Diverse Beam Search", AAAI 2018) splits the width into ``num_beam_groups``
groups of equal size that search side by side: at each step the groups choose in order, and group g's log-probs
are lowered by ``diversity_penalty`` times the number of times each token was chosen by groups 0..g-1 at this step
(the Hamming diversity term), as transformers 4.x did; the penalised scores accumulate. Each group keeps its own
hypotheses and stops on its own; the answer is every group's hypotheses, best first.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from leapdecode.errors import InvalidParameter
from leapdecode.sampling_params import INT32_MAX

NEG = -1.0e9            # transformers' "cannot be chosen" score


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams`` plus transformers' beam options."""
    beam_width: int
    max_tokens: int = 16
    ignore_eos: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False        # True, False or "never" (transformers' meanings)
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    num_beam_groups: int = 1
    diversity_penalty: float = 0.0
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> InvalidParameter:
            return InvalidParameter(f"BeamSearchParams.{name} {why}, got {getattr(self, name)!r}", param=name)

        def is_int(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        if not is_int(self.beam_width) or not 1 <= self.beam_width <= 64:
            raise bad("beam_width", "must be an integer in [1, 64]")
        if not is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT32_MAX:
            raise bad("max_tokens", "must be an integer >= 1")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}]")
        if not is_num(self.length_penalty):
            raise bad("length_penalty", "must be a finite number")
        if self.early_stopping not in (True, False, "never") or not isinstance(self.early_stopping, (bool, str)):
            raise bad("early_stopping", 'must be True, False or "never"')
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if any(not is_int(t) or not 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of token ids")
        if not is_int(self.num_beam_groups) or not 1 <= self.num_beam_groups <= self.beam_width \
                or self.beam_width % self.num_beam_groups:
            raise bad("num_beam_groups", f"must be an integer >= 1 that divides beam_width={self.beam_width}")
        if not is_num(self.diversity_penalty) or self.diversity_penalty < 0:
            raise bad("diversity_penalty", "must be a finite number >= 0")
        if self.diversity_penalty > 0 and self.num_beam_groups == 1:
            raise bad("diversity_penalty", "needs num_beam_groups > 1 (the penalty is between groups)")


@dataclass
class BeamSearchSequence:
    """One finished hypothesis: vLLM's shape (``tokens`` is prompt + output) plus the output alone and its score."""
    tokens: list[int]
    output_token_ids: list[int]
    cum_logprob: float
    score: float                       # cum_logprob / len(output) ** length_penalty: what ranks hypotheses
    text: str = ""
    finish_reason: str = "length"      # "stop": ended with a stop token; "length": reached max_tokens
    stop_reason: int | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


@dataclass(frozen=True)
class Beam:
    """A live beam: the sequence that holds its tokens, and its accumulated log-prob."""
    seq_id: int
    score: float


@dataclass(frozen=True)
class Child:
    """A beam chosen this step: ``parent`` continued by ``token``."""
    parent: int                        # seq_id
    token: int
    score: float
    group: int


@dataclass
class _Group:
    width: int
    beams: list[Beam]
    hyps: list[tuple[float, float, list[int], str, int | None]] = field(default_factory=list)  # (score, cum, out, why, stop)
    can_improve: bool = True
    done: bool = False

    @property
    def full(self) -> bool:
        return len(self.hyps) >= self.width


class BeamSearch:
    """The search of one request: its groups' live beams and finished hypotheses.

    ``step(rows)`` takes, for every live beam, its output tokens so far and the top log-probs of its row (enough of
    them: ``num_logprobs``), and returns the beams of the next step as ``Child``ren of the current ones; the caller
    gives them sequences and calls ``assign``. ``start`` names the prompt's sequence, every group's first beam."""

    def __init__(self, params: BeamSearchParams, stop_ids: set[int], max_new_tokens: int) -> None:
        self.params = params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(stop_ids))
        self.max_new = min(params.max_tokens, max_new_tokens)
        size = params.beam_width // params.num_beam_groups
        self.groups = [_Group(size, []) for _ in range(params.num_beam_groups)]
        self.num_candidates = max(2, 1 + len(self.stop_ids)) * size
        self.num_logprobs = self.num_candidates + len(self.stop_ids)   # stop tokens may be masked (min_tokens)
        self.steps = 0

    @property
    def done(self) -> bool:
        return all(g.done for g in self.groups)

    def start(self, seq_id: int) -> None:
        for g in self.groups:
            g.beams = [Beam(seq_id, 0.0)]

    def live(self) -> set[int]:
        return {b.seq_id for g in self.groups if not g.done for b in g.beams}

    def step(self, rows: dict[int, tuple[list[int], list[tuple[int, float]]]]) -> list[Child]:
        """``rows``: seq_id -> (its output tokens, its row's top (token, logprob) pairs, best first)."""
        gen_len = self.steps + 1                       # generated length of every candidate
        self.steps += 1
        chosen_now: dict[int, int] = {}                # token -> times chosen by earlier groups this step
        children: list[Child] = []
        for gi, g in enumerate(self.groups):
            if g.done:
                continue
            cands = []
            for beam in g.beams:
                for token, lp in rows[beam.seq_id][1]:
                    if gen_len <= self.params.min_tokens and token in self.stop_ids:
                        continue                       # transformers' min_new_tokens: stop tokens at -inf
                    if chosen_now:
                        lp -= self.params.diversity_penalty * chosen_now.get(token, 0)
                    cands.append((beam.score + lp, beam, token))
            cands.sort(key=lambda c: -c[0])            # stable: ties keep beam order, then token rank
            cands = cands[:self.num_candidates]
            at_limit = gen_len >= self.max_new
            hits = [at_limit or token in self.stop_ids for _, _, token in cands]
            nxt = [Child(beam.seq_id, token, acc, gi)
                   for (acc, beam, token), hit in zip(cands, hits) if not hit][:g.width]
            self._finish(g, cands[:g.width], hits[:g.width], rows, gen_len)
            if all(hits) or not nxt:                  # nothing can continue (the length limit)
                g.done = True
                continue
            g.beams = []                               # filled by assign()
            self._judge(g, nxt[0].score, gen_len)
            if self._closed(g):
                g.done = True
                continue
            for c in nxt:
                chosen_now[c.token] = chosen_now.get(c.token, 0) + 1
            children += nxt
        return children

    def assign(self, children: list[Child], seq_ids: list[int]) -> None:
        """The sequences that now hold ``children`` (same order)."""
        for c, sid in zip(children, seq_ids):
            self.groups[c.group].beams.append(Beam(sid, c.score))

    def _closed(self, g: _Group) -> bool:
        """The group takes no more hypotheses: none can beat the kept ones, or early stopping has all it needs."""
        return not g.can_improve or (self.params.early_stopping is True and g.full)

    def _finish(self, g: _Group, top: list, hits: list[bool], rows: dict, gen_len: int) -> None:
        """Hits among the first ``width`` candidates become hypotheses, unless the group may not take any more."""
        if self._closed(g):
            return
        for (acc, beam, token), hit in zip(top, hits):
            if not hit:
                continue
            stopped = token in self.stop_ids
            score = acc / gen_len ** self.params.length_penalty
            g.hyps.append((score, acc, rows[beam.seq_id][0] + [token], "stop" if stopped else "length",
                           token if stopped else None))
        g.hyps.sort(key=lambda h: -h[0])
        del g.hyps[g.width:]

    def _judge(self, g: _Group, best_running: float, gen_len: int) -> None:
        """Can the best live beam still beat the worst kept hypothesis? (transformers' early-stop heuristic)"""
        if not g.full:
            return
        lp = self.params.length_penalty
        length = self.max_new if self.params.early_stopping == "never" and lp > 0 else gen_len
        if best_running / length ** lp <= g.hyps[-1][0]:
            g.can_improve = False

    def results(self, prompt: list[int]) -> list[BeamSearchSequence]:
        """Every group's hypotheses, best first (ties: earlier group first)."""
        hyps = sorted((h for g in self.groups for h in g.hyps), key=lambda h: -h[0])
        return [BeamSearchSequence(prompt + out, out, cum, score, finish_reason=why, stop_reason=stop)
                for score, cum, out, why, stop in hyps]

