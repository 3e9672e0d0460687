"""Contrastive search: of the most probable next tokens, the one least like what came before.

Su et al., "A Contrastive Framework for Neural Text Generation" (NeurIPS 2022), eq. (5): with context x_<t,

    x_t = argmax_{v in V(k)}  (1 - alpha) * p(v | x_<t)  -  alpha * max_{j < t} cos(h_v, h_{x_j})

where V(k) holds the k most probable tokens, h is the model's last hidden state after the final norm (transformers'
``hidden_states[-1]``) and h_v is computed with v appended. The semantics are transformers 4.x's
``generate(penalty_alpha=alpha, top_k=k)``: p is the softmax over the whole vocabulary of the request's processed
logits (logit bias, penalties, min_tokens; no temperature, top-p or min-p: the method is deterministic), the
context is every previous token's hidden state (the prompt's, then each chosen token's own candidate state), the
next candidates are the top-k of the chosen candidate's row, and a tie goes to the more probable candidate (the
first maximum). One departure: a candidate that the processing forbids (logit -inf, e.g. eos under min_tokens) is
dropped rather than scored with probability 0, so the request's constraints always hold.

In the step (plan -> forward -> result -> update) the k candidates are a token tree of k siblings under the
sequence's last known token, proposed where drafts are (``drafts``), so one forward computes the last token's row
and every candidate's row, hidden states included. After verification ``choose`` rewrites these sequences'
results: no draft node accepted, the chosen token appended. The scheduler then rolls the k nodes back, and the
chosen token, now the last known one, is computed again next step as the root of the next candidates (one extra
row per step, nearly free in a bandwidth-bound decode). The first token: the prompt's last row only yields the
first candidates, so that step chooses nothing (``tokens=()``) and the scheduler computes the prompt's last token
again, now with the candidates as its children. A step whose plan lost candidates to the token budget also chooses
nothing and is retried.

The state (context hidden states on the device, the next candidates and their probabilities) lives here, per
sequence, from ``add`` to ``finish``. It survives preemption: the context is indexed by position and only ever
extended, so recomputing a preempted sequence's tokens adds nothing and its candidates stay valid. What it cannot
survive is KV it never saw computed, so these requests do not adopt prefix-cache blocks (engine/scheduler.py) and
allow n = 1 only (sampling_params.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Mapping

import torch

from leapdecode.engine.step import SeqResult, StepPlan, StepResult
from leapdecode.errors import InvalidParameter
from leapdecode.sampling.sampler import Row, SamplingBatch, argmax_rows, compute_logprobs
from leapdecode.sampling_params import SamplingParams
from leapdecode.spec.tree import EMPTY, DraftTree

if TYPE_CHECKING:
    from leapdecode.engine.sequence import Sequence
    from leapdecode.engine.step import ScheduledSeq


@dataclass
class _State:
    """One sequence's search state. ``candidates`` follow its first ``for_len`` tokens."""
    context: torch.Tensor | None = None     # [capacity, H]: unit hidden state of the token at each position
    num_rows: int = 0                       # positions [0, num_rows) are known
    candidates: DraftTree = EMPTY           # the next token's candidates, most probable first, as siblings
    probs: torch.Tensor | None = None       # [len(candidates)] their probabilities
    for_len: int = -1

    def extend(self, start: int, rows: torch.Tensor) -> None:
        """Hidden states of the tokens at positions ``start, start + 1, ...``; positions already known are kept,
        so a recomputed chunk (after preemption, or the last token computed again) changes nothing."""
        if start > self.num_rows:
            raise RuntimeError(f"contrastive search lost the hidden states of positions {self.num_rows}..{start - 1}")
        rows = rows[self.num_rows - start:]
        if not len(rows):
            return
        need = self.num_rows + len(rows)
        if self.context is None or self.context.shape[0] < need:   # grow by doubling: appends stay O(1) amortised
            cap = max(need, 64, 2 * (0 if self.context is None else self.context.shape[0]))
            grown = rows.new_empty((cap, rows.shape[1]))
            if self.context is not None:
                grown[:self.num_rows] = self.context[:self.num_rows]
            self.context = grown
        self.context[self.num_rows:need] = _unit(rows)
        self.num_rows = need


@dataclass
class _Scored:
    """A sampling chunk that carries its full candidate tree: a token is chosen this step."""
    chunk: "ScheduledSeq"
    seq: "Sequence"
    state: _State
    first: int          # row of its first candidate in the step's hidden states


class ContrastiveSearch:
    """Per-sequence contrastive search state, consulted by the engine at two points of the step: ``drafts``
    (candidates instead of a drafter's proposal) and ``choose`` (after ``Verifier.verify``, before
    ``Scheduler.update``). It reads sequences and never writes them."""

    def __init__(self, vocab_size: int, eos_token_ids: set[int], layer: int, max_num_batched_tokens: int,
                 kv_tokens: int, max_model_len: int) -> None:
        """``layer``: the final-norm hidden state in the runner's capture numbering (= the number of layers);
        ``kv_tokens``: the KV pool's capacity in tokens."""
        self.vocab_size, self.eos_token_ids, self.layer = vocab_size, eos_token_ids, layer
        self.max_num_batched_tokens, self.kv_tokens, self.max_model_len = (max_num_batched_tokens, kv_tokens,
                                                                           max_model_len)
        self._states: dict[int, _State] = {}

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._states

    # -- the request's life ----------------------------------------------------------------------------------
    def check(self, params: SamplingParams, num_prompt_tokens: int) -> None:
        """The limits that depend on the engine: the last token and its candidates are computed in one step, and
        must fit the budget and, at the longest, the KV pool (else the request could never advance)."""
        if not params.contrastive:
            return
        k = params.top_k
        if 1 + k > self.max_num_batched_tokens:
            raise InvalidParameter(f"SamplingParams.top_k must be < max_num_batched_tokens "
                                   f"({self.max_num_batched_tokens}) for contrastive search (the last token and its "
                                   f"top_k candidates are computed in one step), got {k}", param="top_k")
        longest = min(self.max_model_len, num_prompt_tokens + (params.max_tokens or self.max_model_len))
        if longest - 1 + k > self.kv_tokens:
            raise InvalidParameter(f"SamplingParams.top_k is too large for the KV pool ({self.kv_tokens} tokens): "
                                   f"contrastive search needs room for a sequence of {longest} tokens plus its top_k "
                                   f"candidates, got {k}", param="top_k")

    def add(self, seq: "Sequence") -> None:
        if seq.params.contrastive:
            self._states[seq.seq_id] = _State()

    def finish(self, seq_id: int) -> None:
        """Free the state (the sequence finished or was aborted)."""
        self._states.pop(seq_id, None)

    # -- the step --------------------------------------------------------------------------------------------
    def drafts(self, decoding: list["Sequence"]) -> dict[int, DraftTree]:
        """Each decoding contrastive sequence's candidates, as k siblings under its last known token."""
        out = {}
        for seq in decoding:
            st = self._states.get(seq.seq_id)
            if st is not None and st.candidates and st.for_len == seq.num_tokens:
                out[seq.seq_id] = st.candidates
        return out

    def capture(self, plan: StepPlan) -> tuple[int, ...]:
        """The hidden-state layer the forward must return (for every row) if the plan holds a contrastive
        sequence, else nothing."""
        if self._states and any(c.seq_id in self._states for c in plan.seqs):
            return (self.layer,)
        return ()

    def choose(self, plan: StepPlan, result: StepResult, logits: torch.Tensor,
               hidden: Mapping[int, torch.Tensor], seqs: Mapping[int, "Sequence"]) -> StepResult:
        """``result`` with the contrastive sequences' entries replaced (a chosen token, or none yet). ``logits``
        and ``hidden`` are the forward's (logits rows; hidden states of every token row, ``capture`` asked).
        A fault here ends only the request it belongs to (``StepResult.errors``)."""
        mine = [(c, off) for c, off in _token_offsets(plan)
                if c.seq_id in self._states and c.seq_id in seqs and c.seq_id not in result.errors]
        if not mine:
            return result
        h = hidden[self.layer]
        errors: dict[int, str] = {}
        try:
            chosen = self._choose(mine, result, logits, h, seqs)
        except Exception:                       # noqa: BLE001 - find whose fault it is: each sequence alone
            chosen = {}
            for item in mine:
                try:
                    chosen.update(self._choose([item], result, logits, h, seqs))
                except Exception as e:          # noqa: BLE001 - this request ends with the error, the others go on
                    errors[item[0].seq_id] = f"{type(e).__name__}: {e}"
        out = {**result.seqs, **chosen}
        for seq_id in errors:
            out.pop(seq_id, None)
        return StepResult(result.step_id, out, result.prompt_logprobs, {**result.errors, **errors})

    def _choose(self, mine: list[tuple["ScheduledSeq", int]], result: StepResult, logits: torch.Tensor,
                h: torch.Tensor, seqs: Mapping[int, "Sequence"]) -> dict[int, SeqResult]:
        # 1. Context: every committed token's hidden state (idempotent, so a retry after a fault is harmless).
        scored: list[_Scored] = []
        waiting: list["ScheduledSeq"] = []      # sampling chunks that choose nothing this step
        refresh: list[tuple["ScheduledSeq", "Sequence", _State]] = []   # ... and need their candidates
        for c, off in mine:
            seq, st = seqs[c.seq_id], self._states[c.seq_id]
            st.extend(c.start, h[off:off + c.num_committed])
            if not c.samples:
                continue
            if st.num_rows != seq.num_tokens:
                raise RuntimeError(f"contrastive search has {st.num_rows} context states for {seq.num_tokens} tokens")
            if c.draft and c.draft == st.candidates and st.for_len == seq.num_tokens:
                scored.append(_Scored(c, seq, st, off + c.num_committed))
                continue
            waiting.append(c)
            if st.for_len != seq.num_tokens:    # first token (or lost): the last token's row gives candidates
                refresh.append((c, seq, st))

        # 2. The choice, then the next candidates: the top-k of the chosen candidate's row (its history now holds
        #    the chosen token), or of the last token's row where there are no candidates yet. Nothing is written
        #    before everything is computed.
        choices = self._argmax_scores(scored, h)
        picks = [s.state.candidates.tokens[j] for s, j in zip(scored, choices)]
        rows = [Row(s.seq, (tok,)) for s, tok in zip(scored, picks)] + [Row(seq, ()) for _, seq, _ in refresh]
        where = ([s.chunk.sample_logits_rows[1 + j] for s, j in zip(scored, choices)]
                 + [c.sample_logits_rows[0] for c, _, _ in refresh])
        nxt = self._top_candidates(rows, logits, where)
        lps = self._logprobs(scored, picks, logits)

        # 3. Commit to the state and rewrite the results.
        out: dict[int, SeqResult] = {}
        for s, j, tok, (tree, probs), lp in zip(scored, choices, picks, nxt, lps):
            s.state.extend(s.seq.num_tokens, h[s.first + j:s.first + j + 1])   # the chosen token's own state
            s.state.candidates, s.state.probs, s.state.for_len = tree, probs, s.seq.num_tokens + 1
            old = result.seqs.get(s.chunk.seq_id)
            topk = (old.topk[0],) if old is not None and old.topk else None   # the target's top-k at the root row
            out[s.chunk.seq_id] = SeqResult(s.chunk.seq_id, (), (tok,), None if lp is None else (lp,), topk)
        for (c, seq, st), (tree, probs) in zip(refresh, nxt[len(scored):]):
            st.candidates, st.probs, st.for_len = tree, probs, seq.num_tokens
        for c in waiting:
            out[c.seq_id] = SeqResult(c.seq_id, (), ())
        return out

    @staticmethod
    def _argmax_scores(scored: list[_Scored], h: torch.Tensor) -> list[int]:
        """Index of the best candidate per sequence: (1 - alpha) p(v) - alpha max_j cos(h_v, h_j), first maximum
        on ties (the more probable candidate)."""
        if not scored:
            return []
        width = max(len(s.state.candidates) for s in scored)
        scores = torch.full((len(scored), width), -math.inf, dtype=torch.float32, device=h.device)
        for i, s in enumerate(scored):
            st, k, alpha = s.state, len(s.state.candidates), s.seq.params.penalty_alpha
            cand = _unit(h[s.first:s.first + k])
            penalty = (cand @ st.context[:st.num_rows].T).amax(-1).float()     # [k] max cosine to the context
            scores[i, :k] = (1.0 - alpha) * st.probs - alpha * penalty
        return argmax_rows(scores).tolist()

    def _top_candidates(self, rows: list[Row], logits: torch.Tensor, where: list[int]
                        ) -> list[tuple[DraftTree, torch.Tensor]]:
        """(candidates as siblings, their probabilities) per row: the top-k of the processed logits, the
        probabilities a softmax over the whole vocabulary; forbidden tokens (-inf) are not candidates."""
        if not rows:
            return []
        raw = logits[torch.tensor(where, device=logits.device)]
        processed = SamplingBatch(rows, self.vocab_size, logits.device, self.eos_token_ids).processed_logits(raw)
        ks = [r.seq.params.top_k for r in rows]
        top, ids = processed.topk(max(ks), dim=-1)
        probs = processed.softmax(-1).gather(1, ids)
        ids_host, allowed = ids.tolist(), torch.isfinite(top).sum(-1).tolist()
        out = []
        for i, k in enumerate(ks):
            m = min(k, allowed[i])
            if m == 0:
                raise RuntimeError("contrastive search: the request's logits processing forbids every token")
            out.append((DraftTree.of(ids_host[i][:m], [-1] * m), probs[i, :m]))
        return out

    @staticmethod
    def _logprobs(scored: list[_Scored], picks: list[int], logits: torch.Tensor) -> list[tuple | None]:
        """Per chosen token, (its logprob, the top-N) under the raw model at the row that predicted it (the root),
        as the verifier reports them; None where the request asked for none."""
        want = [i for i, s in enumerate(scored) if s.seq.params.logprobs is not None]
        out: list[tuple | None] = [None] * len(scored)
        if not want:
            return out
        roots = torch.tensor([scored[i].chunk.sample_logits_rows[0] for i in want], device=logits.device)
        tokens = torch.tensor([picks[i] for i in want], device=logits.device)
        chosen, top = compute_logprobs(logits[roots], tokens, max(scored[i].seq.params.logprobs for i in want))
        for i, lp, t in zip(want, chosen, top):
            out[i] = (lp, t)
        return out


def _unit(x: torch.Tensor) -> torch.Tensor:
    """Rows scaled to unit length (cosine similarity is then a dot product), as the paper's cos(., .)."""
    return x / x.norm(dim=-1, keepdim=True)


def _token_offsets(plan: StepPlan) -> Iterator[tuple["ScheduledSeq", int]]:
    """Each scheduled chunk with the index of its first token in the flat batch (the hidden states' rows)."""
    off = 0
    for c in plan.seqs:
        yield c, off
        off += c.num_new_tokens
