"""SuffixDecoding: frequency-scored draft trees from the longest context suffix seen before.

After Oliaro et al., "SuffixDecoding: Extreme Speculative Decoding for Emerging AI Applications" (2024), whose
reference implementation is Snowflake's ArcticInference. The idea: keep suffix structures over (a) the current
request's prompt and output and (b) the outputs of earlier requests; at each step find the longest suffix of the
context that occurred before (the *pattern*), look at everything that followed its occurrences, and draft the
most frequent continuations as a tree, best-first by empirical probability (product of child count / parent count
along the path). Draft length adapts: at most ``max_spec_factor * pattern_length + max_spec_offset`` tokens (a long
match is strong evidence of copying), and no node whose probability is below ``min_token_prob``. Among candidate
pattern lengths and the two sources, the draft with the highest expected number of accepted tokens (the sum of its
node probabilities) wins.

The per-request source covers copying from the input: CopySpec (Dumitru et al. 2025, re-quoting earlier chat
turns that sit in the prompt) and input-guided Aggressive Decoding (Ge et al. 2022, edits that copy most of the
input). The global source covers agentic and templated workloads that repeat earlier answers.

Data structure. An explicit suffix tree of bounded depth D has up to D nodes per token, tens of megabytes per
request when nodes are Python objects. Instead we use an *implicit* suffix tree:
:class:`~leapdecode.spec.index.NgramIndex` lists, for each short n-gram, the positions right after its occurrences
(a chain of 8-byte entries, newest first). The pattern's tree node is represented by its occurrence set: the
occurrences of the longest indexed n-gram suffix, each extended to the left (vectorised over occurrences) to its
full match length, up to ``max_match``. Counts in the node's subtree are then computed on demand by grouping the
continuations of those occurrences, which gives exactly the counts an explicit suffix tree would store, as long as
the occurrence list is not capped (``max_occurrences`` most recent; beyond that the statistics are over the most
recent occurrences, which also favours recent text). One deliberate difference: an occurrence that overlaps the end
of the context (periodic text, a model repeating itself) is continued periodically instead of stopping at the end
(:func:`~leapdecode.spec.index.continuation`; measured effect: benchmarks/README.md and ``benchmarks/replay.py``).
Appending a token costs ``len(sizes)`` dictionary updates; both updates and lookups are independent of the context
length.
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from leapdecode.spec.calibration import Offer, depth_bucket, evidence
from leapdecode.spec.drafter import Draft, DraftRequest, PerRequestDrafter
from leapdecode.spec.index import SENTINEL, NgramIndex, as_int_list, continuation, sync_index
from leapdecode.spec.compiled import CompiledIndex, core
from leapdecode.spec.tree import node_depths


@dataclass
class SpeculationTree:
    """A candidate draft: nodes in topological order with their estimated probabilities of being accepted."""
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    match_length: int = 0
    # the continuation of the newest occurrence among the longest matches, whole (prompt lookup's draft), and
    # that match's length: offered beside the tree to a calibrating chooser (see :meth:`SuffixDrafter.offers`)
    recent: list[int] = field(default_factory=list)
    recent_match: int = 0

    @property
    def expected_accepted(self) -> float:
        """Expected accepted tokens under the empirical model: siblings are disjoint events, so the expected length
        of the longest accepted path is the sum of all node probabilities."""
        return float(sum(self.probs))

    @property
    def first_token_prob(self) -> float:
        return min(1.0, float(sum(p for p, parent in zip(self.probs, self.parents) if parent == -1)))


def expand_continuations(rows: list[list[int]], max_nodes: int, min_prob: float, tree: bool) -> SpeculationTree:
    """Best-first draft tree over continuation rows (one per occurrence of the pattern, oldest first).

    A node is a prefix shared by some rows; its count is the number of rows that reach it, and the probability of
    a child is the parent's probability times child count / parent count (rows that end at the parent, because a
    cached output ends there, count in the denominator: they are evidence for no particular continuation). ``tree=False``
    follows only the most frequent child at each depth (ties: the most recent occurrence), giving a chain.
    Identical rows are merged first (repetitive text has many), so the work grows with distinct continuations.
    """
    if max_nodes <= 0 or not rows:
        return SpeculationTree()
    weight: dict[tuple[int, ...], int] = {}
    newest: dict[tuple[int, ...], int] = {}
    for i, row in enumerate(rows):
        key = tuple(row)
        weight[key] = weight.get(key, 0) + 1
        newest[key] = i
    distinct = list(weight)
    if len(distinct) == 1:                   # one continuation: each of its tokens has probability 1
        chain = list(distinct[0][:max_nodes])
        return SpeculationTree(chain, list(range(-1, len(chain) - 1)), [1.0] * len(chain))
    counts = [weight[key] for key in distinct]
    recency = [newest[key] for key in distinct]
    out = SpeculationTree()
    order = 0
    heap: list[tuple[float, int, int, int, int, int, list[int]]] = []

    def push_children(group: list[int], depth: int, prob: float, parent: int) -> None:
        nonlocal order
        if len(group) == 1:                  # a single continuation left: its next token, same probability
            row = distinct[group[0]]
            if len(row) > depth and prob >= min_prob:
                heapq.heappush(heap, (-prob, -recency[group[0]], order, depth, parent, row[depth], group))
                order += 1
            return
        total = 0
        children: dict[int, list] = {}         # token -> [members, their count, their newest occurrence]
        for r in group:
            row = distinct[r]
            c = counts[r]
            total += c
            if len(row) > depth:
                child = children.get(row[depth])
                if child is None:
                    children[row[depth]] = [[r], c, recency[r]]
                else:
                    child[0].append(r)
                    child[1] += c
                    if recency[r] > child[2]:
                        child[2] = recency[r]
        items = [(prob * c / total, latest, tok, members) for tok, (members, c, latest) in children.items()]
        if not tree and items:
            items = [max(items, key=lambda item: (item[0], item[1]))]
        for p, latest, tok, members in items:
            if p >= min_prob:
                heapq.heappush(heap, (-p, -latest, order, depth, parent, tok, members))
                order += 1

    push_children(list(range(len(distinct))), 0, 1.0, -1)
    while heap and len(out.tokens) < max_nodes:
        neg_p, _, _, depth, parent, tok, members = heapq.heappop(heap)
        out.tokens.append(tok)
        out.parents.append(parent)
        out.probs.append(-neg_p)
        push_children(members, depth + 1, -neg_p, len(out.tokens) - 1)
    return out


SUFFIX_LOCAL, SUFFIX_GLOBAL = 1, 2       # evidence kinds (spec/calibration.py); + 2: the newest match's continuation


def _match_bucket(m: int) -> int:
    return m if m <= 6 else (8 if m <= 9 else (12 if m <= 15 else 16))


def _share_bucket(p: float) -> int:
    return 0 if p < 0.3 else (1 if p < 0.6 else (2 if p < 0.95 else 3))


class SuffixDrafter(PerRequestDrafter):
    """SuffixDecoding drafter: per-request suffix index over prompt + output, and a global one over past outputs.

    Options (all validated):
      max_match          longest pattern considered (tokens matched to the left of the context's end)
      max_spec_factor,   draft at most ``factor * pattern_length + offset`` tokens (and at most ``max_draft``)
      max_spec_offset
      min_token_prob     stop expanding below this estimated acceptance probability
      tree               draft a tree of alternatives (True) or only the most likely chain (False)
      max_occurrences    occurrences of the pattern whose continuations are counted (the most recent ones)
      max_patterns       distinct pattern lengths tried per source (longest first; the best draft wins)
      global_max_tokens  size of the cross-request cache of outputs; 0 disables it; oldest requests evicted first
      compiled           the index and the drafting compiled (spec/compiled.py: the same drafts, ~4x less CPU a
                         step); None (default): where the C++ module builds, else the Python code; True: required

    Memory (tracemalloc, 8,000 tokens of stdlib source, embedded tokenizer): about 0.3 KB per context token of each
    running request (n-gram sizes 1-4) and 0.17 KB per cached output token (sizes 2 and 4), so the default
    262,144-token global cache stays under ~50 MB (the compiled index: ~0.25 KB per token with sizes 1-4). Both are small next to the KV cache of the same tokens.
    """

    def __init__(self, max_match: int = 32, max_spec_factor: float = 2.0, max_spec_offset: float = 0.0,
                 min_token_prob: float = 0.1, tree: bool = True, max_occurrences: int = 32, max_patterns: int = 4,
                 local_sizes: Sequence[int] = (1, 2, 3, 4), global_sizes: Sequence[int] = (2, 4),
                 global_max_tokens: int = 1 << 18, compiled: bool | None = None) -> None:
        if not (isinstance(max_match, int) and max_match >= 1):
            raise ValueError(f"max_match must be a positive integer, got {max_match!r}")
        if not max_spec_factor >= 0:
            raise ValueError(f"max_spec_factor must be >= 0, got {max_spec_factor!r}")
        if not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {min_token_prob!r}")
        for name, value in (("max_occurrences", max_occurrences), ("max_patterns", max_patterns)):
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not (isinstance(global_max_tokens, int) and global_max_tokens >= 0):
            raise ValueError(f"global_max_tokens must be a non-negative integer, got {global_max_tokens!r}")
        if compiled is not False and core() is not None and all(1 <= n <= 4 for n in (*local_sizes, *global_sizes)):
            self._index_type: type = CompiledIndex
        elif compiled:
            raise ValueError("compiled=True: the compiled suffix index could not be built here (or n-gram sizes "
                             "beyond 1..4 were asked for)")
        else:
            self._index_type = NgramIndex
        self.max_match = max_match
        self.max_spec_factor, self.max_spec_offset = float(max_spec_factor), float(max_spec_offset)
        self.min_token_prob = float(min_token_prob)
        self.tree = bool(tree)
        self.max_occurrences, self.max_patterns = max_occurrences, max_patterns
        self._local_sizes = tuple(local_sizes)
        self._local: dict[int, NgramIndex] = {}
        self.global_max_tokens = global_max_tokens
        self._global = self._index_type(global_sizes)
        self._global_starts: deque[int] = deque()    # absolute start of each cached output, oldest first

    # -- Drafter protocol (propose and observe: PerRequestDrafter) --------------------------------------------------
    def draft_one(self, req: DraftRequest) -> Draft:
        if self._index_type is CompiledIndex:       # the same choice, made in one compiled call
            local = sync_index(self._local.get(req.seq_id), req.token_ids, self._local_sizes, CompiledIndex)
            self._local[req.seq_id] = local
            tokens, parents, score = core().draft(local.core, self._global.core, req.max_draft, *self._core_options)
            return Draft(tokens, parents, score) if tokens else Draft()
        best = max(self._trees(req, recent=False), key=lambda t: t.expected_accepted)   # ties: the local tree
        if not best.tokens:
            return Draft()
        parents = best.parents
        chain = all(p == i - 1 for i, p in enumerate(parents))       # parents are topological by construction
        return Draft(best.tokens, None if chain else parents, best.first_token_prob)

    def prepare(self, seq_id: int, token_ids: Sequence[int]) -> None:
        self._local[seq_id] = sync_index(self._local.get(seq_id), token_ids, self._local_sizes, self._index_type)

    def offers(self, req: DraftRequest) -> list[Offer]:
        """Both sources' best trees as calibration offers (spec/calibration.py), instead of the better one: each
        node's evidence is its source, the pattern's match length, the share of the parent's continuations that
        continue with it (its prior) and its depth."""
        if req.max_draft <= 0:
            return []
        out = []
        for kind, tree in zip((SUFFIX_LOCAL, SUFFIX_GLOBAL), self._trees(req, recent=True)):
            if tree.recent:             # kinds + 2: the newest occurrence's whole continuation
                out.append(Offer.chain(tree.recent, evidence(kind + 2, _match_bucket(tree.recent_match)), 0.5))
            if not tree.tokens:
                continue
            base = evidence(kind, _match_bucket(tree.match_length))
            parents, probs = tree.parents, tree.probs
            depths = node_depths(parents)
            shares = [p / probs[par] if par >= 0 else p for par, p in zip(parents, probs)]
            keys = [base + _share_bucket(s) * 100 + depth_bucket(d) for s, d in zip(shares, depths)]
            out.append(Offer(tree.tokens, parents, depths, keys, shares))
        return out

    def _trees(self, req: DraftRequest, recent: bool) -> list[SpeculationTree]:
        """The request's index brought up to date, and the best tree from it and (when it holds anything) from the
        global cache; ``recent``: with the newest match's continuation (see :class:`SpeculationTree`)."""
        local = sync_index(self._local.get(req.seq_id), req.token_ids, self._local_sizes, self._index_type)
        self._local[req.seq_id] = local
        trees = [self.speculate(local, local, req.max_draft, recent)]
        if len(self._global):
            trees.append(self.speculate(self._global, local, req.max_draft, recent))
        return trees

    def finish(self, seq_id: int, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """Drop the request's index and add its output to the global cache (evicting the oldest outputs)."""
        self._local.pop(seq_id, None)
        if self.global_max_tokens == 0:
            return
        output = as_int_list(token_ids[num_prompt_tokens:])
        if len(output) >= self.global_max_tokens:       # keep the tail; one slot goes to the separator
            output = output[len(output) - (self.global_max_tokens - 1):]
        if not output:
            return
        self._global.break_sequence()
        self._global_starts.append(self._global.end)
        self._global.extend(output)
        if len(self._global) > self.global_max_tokens:
            # Evict whole requests down to 3/4 of the budget, so eviction work is amortised over many inserts.
            target = self.global_max_tokens * 3 // 4
            while len(self._global_starts) > 1 and self._global.end - self._global_starts[0] + 1 > target:
                self._global_starts.popleft()
            self._global.evict_before(self._global_starts[0] - 1)   # keep the sentinel before the oldest kept

    # -- speculation -----------------------------------------------------------------------------------------------
    @property
    def _core_options(self) -> tuple:
        """The options as the compiled ``speculate`` and ``draft`` take them, after the draft budget."""
        return (self.max_match, self.max_spec_factor, self.max_spec_offset, self.min_token_prob, self.tree,
                self.max_occurrences, self.max_patterns)

    def speculate(self, source: NgramIndex, context: NgramIndex, max_draft: int,
                  recent: bool = False) -> SpeculationTree:
        """Best draft for ``context`` (a request's tokens) from the continuations recorded in ``source``;
        ``recent``: also the newest longest match's whole continuation (``SpeculationTree.recent``). Compiled
        indexes are served by the compiled code, which is this method statement for statement."""
        if isinstance(source, CompiledIndex):
            tokens, parents, probs, match, newest, newest_match = core().speculate(
                source.core, context.core, max_draft, *self._core_options, recent)
            return SpeculationTree(tokens, parents, probs, match, newest, newest_match)
        ctx = context.tokens
        followers: list[int] = []
        anchor = 0
        for n in reversed(source.sizes):
            if n <= len(ctx):
                followers = source.occurrences(tuple(ctx[len(ctx) - n:]), self.max_occurrences)
                if followers:
                    anchor = n
                    break
        if not followers:
            return SpeculationTree()
        lengths = self.match_lengths(source, followers, anchor, context)
        best = SpeculationTree()
        previous_count = 0
        for tried, length in enumerate(sorted(set(lengths), reverse=True)):
            limit = min(max_draft, int(self.max_spec_factor * length + self.max_spec_offset))
            if tried == self.max_patterns or limit <= best.expected_accepted:
                break                   # shorter patterns allow fewer tokens than the best draft already expects
            chosen = [f for f, m in zip(followers, lengths) if m >= length]
            if len(chosen) == previous_count:
                continue                # same occurrences as a longer pattern, with a smaller limit: dominated
            previous_count = len(chosen)
            rows = self._rows(source, chosen, limit, periodic=source is context)
            candidate = expand_continuations(rows, limit, self.min_token_prob, self.tree)
            candidate.match_length = length
            if candidate.expected_accepted > best.expected_accepted:
                best = candidate
        if recent:
            longest = max(lengths)
            newest = max(f for f, m in zip(followers, lengths) if m == longest)
            best.recent = self._rows(source, [newest], max_draft, periodic=source is context)[0]
            best.recent_match = longest
        return best

    def match_lengths(self, source: NgramIndex, followers: list[int], anchor: int,
                      context: NgramIndex) -> list[int]:
        """How far each occurrence (given by its follower position, already matching ``anchor`` tokens) matches the
        context's suffix to the left, capped at ``max_match``. Vectorised over occurrences when there are many;
        a plain loop is cheaper than numpy's per-call overhead for a few."""
        limit = min(self.max_match, len(context))
        if len(followers) <= 8:
            toks, base, ctx = source.tokens, source.base, context.tokens
            out = []
            for f in followers:
                i, j, m = f - base - 1 - anchor, len(ctx) - 1 - anchor, anchor
                while m < limit and i >= 0 and toks[i] == ctx[j]:
                    i, j, m = i - 1, j - 1, m + 1
                out.append(m)
            return out
        pos = np.asarray(followers, dtype=np.int64) - source.base
        offsets = np.arange(anchor, limit, dtype=np.int64)
        where = pos[:, None] - 1 - offsets[None, :]
        stored = source.array[np.maximum(where, 0)]
        equal = (stored == context.array[len(context) - 1 - offsets][None, :]) & (where >= 0)
        return (anchor + np.logical_and.accumulate(equal, axis=1).sum(axis=1)).tolist()

    @staticmethod
    def _rows(source: NgramIndex, followers: list[int], limit: int, periodic: bool) -> list[list[int]]:
        """What followed each occurrence, up to ``limit`` tokens, cut at the end of its sequence. In the request's
        own index (``periodic``) the end of the sequence is the context's end, and an occurrence overlapping it is
        continued periodically (:func:`~leapdecode.spec.index.continuation`)."""
        toks, base = source.tokens, source.base
        if periodic:
            return [continuation(toks, f - base, limit) for f in followers]
        rows = []
        for f in followers:
            row = toks[f - base:f - base + limit]
            if SENTINEL in row:
                row = row[:row.index(SENTINEL)]
            rows.append(row)
        return rows

    def memory_tokens(self) -> dict[str, int]:
        """Tokens held, per source (for tests and metrics)."""
        return {"local": sum(len(ix) for ix in self._local.values()), "global": len(self._global)}
