"""Auto drafting: run several model-free drafters and pick, per request and step, the most promising draft.

No drafter wins everywhere: suffix/prompt lookup is superb when the output copies its input or earlier outputs and
useless on fresh text, where Token Recycling's learned successors still get a token or two accepted.

**Calibrated (the default, ``calibrate=True``).** Every drafter that can (``offers``: suffix, recycling) hands over
its candidate nodes with the evidence behind each; others are wrapped with generic evidence (their name and the
depth). :func:`~leapdecode.spec.calibration.choose` merges them into one tree and keeps, best first, the nodes whose
probability of being accepted (learned online per kind of evidence, see spec/calibration.py) is at least
``min_accept_prob``; the draft carries those probabilities in ``confidence``. Cross-checking replaces topping up:
two sources proposing the same token raise its estimate, and a guess no evidence supports is not verified. In
replay (benchmarks/README.md) this verifies 1.4-1.7 tokens per output token where filling verified 1.9-4.8, for
87-94% of filling's tokens per step. Under the controller the speculator builds ``auto`` in order instead (below);
asked for the calibrated draft there (``fallback=False``), the bar drops to 0.02 and the controller keeps what pays.

**Uncalibrated (``calibrate=False``, the earlier behaviour).** Each drafter proposes, and the draft with the
highest expected accepted length wins,

    E[accepted] ~= P(first token accepted) * E[accepted length | first accepted], capped at the draft's depth,

where P blends the drafter's own ``score`` for this draft with the drafter's recent first-token hit rate on this
request, and the conditional length is that drafter's recent average on this request. With ``fill=True`` the
budget the best draft leaves unused goes to the other drafts, in order of their expected value, merged into one
tree (shared prefixes are stored once). Both histories are exponential moving averages fed in :meth:`observe`, for
*every* drafter, not only the chosen one: the committed tokens tell what each unused draft would have had accepted
(censored at the tokens the step committed); fresh requests start from per-drafter averages over all requests.

**In order (``fallback=True``: what the speculator builds when the goodput controller is on).** The free
drafters are asked in the order given (suffix, then recycling, by default) and a request takes the first draft
that is not empty: a later drafter is asked only for the requests the earlier ones had nothing for. The draft is
the drafter's own (suffix's frequency-weighted tree, with its own score), which the controller values and cuts
with its own models of acceptance and cost; a later drafter's score, a prior it does not learn (recycling's sum of
rank priors), is replaced by its measured first-token hit rate over all requests, since the controller's
first-token table is keyed by score and shared with the first drafter's. Measured under the controller (replay of
the default model's outputs, ``benchmarks/replay.py --machine cpu-smollm2``): the calibrated draft ran at 1.19-1.20x
of plain decoding (geometric mean of eight task sets) where suffix alone ran at 1.24-1.25x, and at 1.18 with suffix
as its only member, so the loss is the calibrated tree itself, not the merging; in order, 1.23-1.24x, at ~50 us a
step instead of ~100 (~15 us since the drafters' hot paths are compiled, spec/compiled.py, and recycling, asked only
where suffix has nothing, learns a request's tokens when it is asked and at the request's end rather than in every
observe: ``lazy``).

**A drafter that runs a model** (``costly``: draft_model, layer_skip or eagle, at most one) is not asked every step:
its drafts cost a sizeable share of a step. It is asked only for the requests whose best model-free draft promises
fewer accepted tokens than the model drafter's record on that request (its first-token rate times its accepted
length; the average over all requests for a new one), so copying requests keep their free suffix matches and fresh
text gets the model's drafts. A model draft carries its distribution q and is never merged with other drafts.
Whether those drafts are worth their time is not this module's call: ``costly_gate`` (set by the speculator when
the goodput controller is on, see spec/speculator.py) sees the requests and their promises before the model
drafter runs and may say no; ``last_costly_seconds`` is the time the model drafter took in the last ``propose``,
so its cost is measured apart from the free drafters'.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from leapdecode.spec.calibration import AcceptanceModel, Offer, choose, depth_bucket
from leapdecode.spec.drafter import Draft, Drafter, DraftRequest
from leapdecode.spec.index import as_int_list
from leapdecode.spec.tree import DraftTree, node_depths


def accepted_length(draft: Draft, truth: Sequence[int]) -> int:
    """``draft.tree.accepted_length(truth)``, kept under this name for ``benchmarks/replay.py``."""
    return draft.tree.accepted_length(truth)


def _depth(draft: Draft) -> int:
    """``draft.tree.depth`` without building the tree (a chain's depth is its length)."""
    if draft.parents is None:
        return len(draft.tokens)
    return max(node_depths(draft.parents), default=0)


def _accepted(draft: Draft, truth: Sequence[int]) -> int:
    """``draft.tree.accepted_length(truth)`` without building the tree: a chain is compared directly, a tree
    walked from the root (its nodes are in topological order, so a node's children follow it; of duplicate
    siblings the first is followed, as there)."""
    toks, parents, n = draft.tokens, draft.parents, 0
    if parents is None:
        while n < len(toks) and n < len(truth) and toks[n] == truth[n]:
            n += 1
        return n
    node = -1
    while n < len(truth):
        want = truth[n]
        for i in range(node + 1, len(toks)):
            if parents[i] == node and toks[i] == want:
                node, n = i, n + 1
                break
        else:
            break
    return n


@dataclass
class _Stats:
    """Moving averages of one drafter's results (on one request, or over all requests)."""
    first_hit: float = 0.5      # P(first token accepted)
    depth: float = 2.0          # accepted length when the first token was accepted

    def update(self, accepted: int, decay: float) -> None:
        self.first_hit = decay * self.first_hit + (1.0 - decay) * (accepted > 0)
        if accepted > 0:
            self.depth = decay * self.depth + (1.0 - decay) * accepted


class AutoDrafter:
    """Per-request choice among ``drafters`` (name -> drafter) by expected accepted tokens; see the module doc."""

    @property
    def wants_topk(self) -> bool:
        """Whether the engine should hand the target's top-k rows over (Token Recycling learns from them). Not in
        order (``fallback``): recycling then drafts only where suffix has nothing, and learns its successors from
        the committed tokens; in replay of the default model's outputs the top-k rows added 0.0-0.3% tokens per step
        to the in-order draft, while the engine computes them on every verified row (a ``topk`` over the
        vocabulary per row, ~1 ms a step at batch 64 on the CPU)."""
        if self.fallback:
            return False
        return any(getattr(d, "wants_topk", False) for d in self.drafters.values())

    def __init__(self, drafters: Mapping[str, Drafter], score_weight: float = 0.5, decay: float = 0.7,
                 prior_decay: float = 0.98, fill: bool = True, costly: Sequence[str] = (),
                 calibrate: bool = True, min_accept_prob: float = 0.2, fallback: bool = False) -> None:
        if not drafters:
            raise ValueError("AutoDrafter needs at least one drafter")
        if len(costly) > 1 or any(name not in drafters for name in costly):
            raise ValueError(f"costly must name at most one of the drafters {tuple(drafters)}, got {tuple(costly)}")
        self.costly = costly[0] if costly else None
        for name, value in (("score_weight", score_weight), ("decay", decay), ("prior_decay", prior_decay)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value!r}")
        self.drafters = dict(drafters)
        self.score_weight, self.decay, self.prior_decay = score_weight, decay, prior_decay
        self.fill = bool(fill)
        if not 0.0 <= min_accept_prob <= 1.0:
            raise ValueError(f"min_accept_prob must be in [0, 1], got {min_accept_prob!r}")
        self.calibrate, self.min_accept_prob = bool(calibrate), float(min_accept_prob)
        self.fallback = bool(fallback)     # in order, the first draft that is not empty (the module doc)
        if self.fallback:                  # a later member drafts rarely: it may learn when asked (RecyclingDrafter)
            for name in list(self.drafters)[1:]:
                if hasattr(self.drafters[name], "lazy"):
                    self.drafters[name].lazy = True
        self.acceptance = AcceptanceModel()
        self._offers: dict[int, list[Offer]] = {}     # the offers of each request's latest calibrated draft
        self._prior = {name: _Stats() for name in self.drafters}
        self._stats: dict[int, dict[str, _Stats]] = {}
        self._last: dict[int, dict[str, Draft]] = {}     # each drafter's latest draft per request
        self.chosen: dict[str, int] = {name: 0 for name in self.drafters}   # how often each was picked
        self.costly_asked = 0            # request-drafts the costly drafter was asked for ...
        self.requests_seen = 0           # ... of this many
        self.costly_gated = 0            # request-drafts it would have been asked for, refused by costly_gate
        # (requests, their promised accepted tokens) -> ask the model drafter? None: always (no controller)
        self.costly_gate: Callable[[list[DraftRequest], list[float]], bool] | None = None
        self.last_costly_seconds = 0.0
        self.last_train_seconds = 0.0   # the model drafter's online training in the last propose (not drafting)
        self.last_backlog_seconds = 0.0  # and its catching up on tokens committed before the previous step

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """Hidden states the engine hands over after each verify forward (the EAGLE drafter's features)."""
        return tuple(sorted({i for d in self.drafters.values() for i in getattr(d, "capture_layers", ())}))

    def observe_hidden(self, plan, result, hidden) -> None:
        for d in self.drafters.values():
            if getattr(d, "capture_layers", ()):
                d.observe_hidden(plan, result, hidden)

    def _record(self, name: str, seq_id: int) -> _Stats:
        return self._stats.get(seq_id, {}).get(name) or self._prior[name]

    def _promise(self, req: DraftRequest) -> float:
        """The model drafter's expected accepted tokens on ``req`` before drafting (its record, no draft score)."""
        rec = self._record(self.costly, req.seq_id)
        return rec.first_hit * min(rec.depth, float(req.max_draft))

    def expected_accepted(self, name: str, seq_id: int, draft: Draft) -> float:
        if not draft.tokens:
            return 0.0
        stats = self._record(name, seq_id)
        p_first = self.score_weight * draft.score + (1.0 - self.score_weight) * stats.first_hit
        return p_first * min(stats.depth, float(_depth(draft)))

    # -- Drafter protocol ------------------------------------------------------------------------------------------
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        self.requests_seen += len(requests)
        if self.fallback:
            out, promised, credit, drafts = self._propose_in_order(requests)
        elif self.calibrate:
            out, promised, credit, drafts = self._propose_calibrated(requests)
        else:
            out, promised, credit, drafts = self._propose_ranked(requests)
        for i, draft in self._ask_costly(requests, promised, drafts).items():
            out[i], credit[i] = draft, self.costly
        for req, name, per in zip(requests, credit, drafts):
            self._last[req.seq_id] = per
            if name is not None:
                self.chosen[name] += 1
        return out

    def _propose_calibrated(self, requests: list[DraftRequest]):
        """Per request: the calibrated draft (see the module doc), its expected accepted tokens, the drafter to
        credit (the one most confident in the draft's best token), and no per-drafter drafts (the acceptance model
        learns from the offers instead)."""
        out, promised, credit = [], [], []
        for req in requests:
            gathered = self._gather(req)
            offers = [offer for _, offer in gathered]
            draft, merged = choose(offers, self.acceptance, req.max_draft, self.min_accept_prob)
            self._offers[req.seq_id] = offers + [merged]
            out.append(draft)
            promised.append(sum(draft.confidence or ()))
            credit.append(self._most_confident(gathered, draft.tokens[0]) if draft.tokens else None)
        return out, promised, credit, [{} for _ in requests]

    def _propose_in_order(self, requests: list[DraftRequest]):
        """``fallback``, per request: the first free drafter's draft that is not empty (a later drafter's score
        replaced by its first-token hit rate over all requests), its expected value, its drafter, and the drafts
        whose records someone reads (the later drafters', for that hit rate; all of them when a model drafter
        compares its record with theirs). Without a model drafter the expected values are not computed (0)."""
        out, credit = [Draft() for _ in requests], [None] * len(requests)
        drafts: list[dict[str, Draft]] = [{} for _ in requests]
        todo = [i for i, req in enumerate(requests) if req.max_draft > 0]
        first = True
        for name, drafter in self.drafters.items():
            if name == self.costly or not todo:
                continue
            left = []
            keep = not first or self.costly is not None
            for i, d in zip(todo, drafter.propose([requests[i] for i in todo])):
                if keep:
                    drafts[i][name] = d
                if not d.tokens:
                    left.append(i)
                    continue
                if not first:
                    d.score = self._prior[name].first_hit
                out[i], credit[i] = d, name
            todo, first = left, False
        if self.costly is None:
            return out, [0.0] * len(requests), credit, drafts
        promised = [self.expected_accepted(name, req.seq_id, d) if name is not None else 0.0
                    for req, name, d in zip(requests, credit, out)]
        return out, promised, credit, drafts

    def _propose_ranked(self, requests: list[DraftRequest]):
        """Uncalibrated, per request: of the free drafters' drafts the one with the highest expected accepted
        length (topped up with the others' with ``fill``), its expected value, its drafter, and every drafter's
        draft (for their records)."""
        proposals = {name: drafter.propose(requests) for name, drafter in self.drafters.items()
                     if name != self.costly}
        drafts = [{name: proposals[name][i] for name in proposals} for i in range(len(requests))]
        out, promised, credit = [], [], []
        for req, per in zip(requests, drafts):
            values = {name: self.expected_accepted(name, req.seq_id, d) for name, d in per.items()}
            ranked = sorted((name for name in per if values[name] > 0.0), key=lambda n: -values[n])
            credit.append(ranked[0] if ranked else None)
            if not ranked:
                out.append(Draft())
                promised.append(0.0)
                continue
            best = per[ranked[0]]
            if self.fill and len(ranked) > 1 and len(best.tokens) < req.max_draft:
                merged = DraftTree.merge((per[name].tree for name in ranked), req.max_draft)
                best = Draft.from_tree(merged, score=best.score)
            out.append(best)
            promised.append(values[ranked[0]])
        return out, promised, credit, drafts

    def _ask_costly(self, requests: list[DraftRequest], promised: list[float],
                    drafts: list[dict[str, Draft]]) -> dict[int, Draft]:
        """The model drafter's drafts that beat the free ones (request index -> draft); it is asked only
        where the free draft promises less than its record, and only if ``costly_gate`` agrees. Its drafts go into
        ``drafts`` (for its record)."""
        self.last_costly_seconds = self.last_train_seconds = self.last_backlog_seconds = 0.0
        if self.costly is None:
            return {}
        promises = [self._promise(req) if req.max_draft > 0 else 0.0 for req in requests]
        asked = [i for i, req in enumerate(requests) if req.max_draft > 0 and promised[i] < promises[i]]
        if asked and self.costly_gate is not None and \
                not self.costly_gate([requests[i] for i in asked], [promises[i] for i in asked]):
            self.costly_gated += len(asked)
            asked = []
        self.costly_asked += len(asked)
        if not asked:
            return {}
        won = {}
        t0 = time.perf_counter()
        for i, d in zip(asked, self.drafters[self.costly].propose([requests[i] for i in asked])):
            drafts[i][self.costly] = d
            if self.expected_accepted(self.costly, requests[i].seq_id, d) > promised[i]:
                won[i] = d
        # the model drafter's online training (spec/online.py) and backlog (spec/speculator.py, ``_draft``), if
        # any, are reported apart from its drafting
        model = self.drafters[self.costly]
        self.last_train_seconds = getattr(model, "last_train_seconds", 0.0)
        self.last_backlog_seconds = getattr(model, "last_backlog_seconds", 0.0)
        self.last_costly_seconds = time.perf_counter() - t0 - self.last_train_seconds - self.last_backlog_seconds
        return won

    def _most_confident(self, gathered: list[tuple[str, Offer]], root: int) -> str:
        best, name = -1.0, ""
        for n, offer in gathered:
            for tok, par, key, prior in zip(offer.tokens, offer.parents, offer.keys, offer.priors):
                if par < 0 and tok == root:
                    p = self.acceptance.estimate(key, prior)
                    if p > best:
                        best, name = p, n
        return name

    def _gather(self, req: DraftRequest) -> list[tuple[str, Offer]]:
        """Every free drafter's offers for ``req``: its own (``offers``) or its draft with generic evidence (the
        drafter's name and the depth; prior: its score for the first token, an even chance deeper)."""
        out: list[tuple[str, Offer]] = []
        for name, drafter in self.drafters.items():
            if name == self.costly:
                continue
            if hasattr(drafter, "offers"):
                out += [(name, offer) for offer in drafter.offers(req)]
                continue
            d = drafter.propose([req])[0]
            if not d.tokens:
                continue
            tree = d.tree
            parents = [tree.parent(i) for i in range(len(tree))]
            depths = tree.depths()
            offer = Offer(list(tree.tokens), parents, depths, [(name, depth_bucket(x)) for x in depths],
                          [d.score if par < 0 else 0.5 for par in parents])
            out.append((name, offer))
        return out

    def observe(self, seq_id: int, token_ids: Sequence[int], num_accepted: int,
                topk: Sequence[Sequence[int]] | None = None) -> None:
        offers = self._offers.pop(seq_id, None)
        if offers:
            self.acceptance.learn(offers, as_int_list(token_ids[max(0, len(token_ids) - num_accepted - 1):]))
        drafts = self._last.pop(seq_id, None)
        if drafts is not None:
            committed = as_int_list(token_ids[max(0, len(token_ids) - num_accepted - 1):])
            per_request = self._stats.setdefault(seq_id, {})
            for name, draft in drafts.items():
                if not draft.tokens:
                    continue
                accepted = _accepted(draft, committed)
                if name not in per_request:
                    prior = self._prior[name]
                    per_request[name] = _Stats(prior.first_hit, prior.depth)
                per_request[name].update(accepted, self.decay)
                self._prior[name].update(accepted, self.prior_decay)
        for drafter in self.drafters.values():
            drafter.observe(seq_id, token_ids, num_accepted, topk)

    def prepare(self, seq_id: int, token_ids: Sequence[int]) -> None:
        for drafter in self.drafters.values():
            if hasattr(drafter, "prepare"):
                drafter.prepare(seq_id, token_ids)

    def finish(self, seq_id: int, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self._offers.pop(seq_id, None)
        self._stats.pop(seq_id, None)
        self._last.pop(seq_id, None)
        for drafter in self.drafters.values():
            drafter.finish(seq_id, token_ids, num_prompt_tokens)
