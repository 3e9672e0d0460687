"""Token Recycling: draft trees from the target model's own discarded top-k candidates.

After Luo et al., "Turning Trash into Treasure: Accelerating Inference of Large Language Models with Token
Recycling" (2024). Every verification step computes the target's distribution at each verified position; its top-k
tokens are normally thrown away. Token Recycling keeps them in an adjacency matrix ``A[token] = its k most likely
successors`` (the latest observation overwrites the row) and drafts by breadth-first search from the last committed
token over a *static* tree shape: the tree for a budget of N nodes is the N rank-paths with the highest prior value
(product of per-rank acceptance rates), so it is wide near the root and thins out with depth, as in the paper.

ADED (Liu et al., "Adaptive Draft-Verification for Efficient Large Language Model Decoding", 2024) adds tri-gram
statistics that adapt during decoding: counts of the next token after each pair of tokens, learned from committed
tokens. Here they rank a node's successors: tri-gram continuations seen at least ``trigram_min_count`` times
(default 1: all of them) come first, most counted first, since they condition on one more token than the matrix;
then the matrix row; then any rarer tri-gram continuations. Their measured effect: benchmarks/README.md and the
model-free replay ``benchmarks/replay.py``.

Both tables are global (shared by all requests, as in the paper) and have a fixed size:
  adjacency  ``vocab_size * num_successors * 4`` bytes (int32); e.g. 32,000 x 8 -> 1,024,000 B (0.98 MiB)
  tri-grams  ``trigram_slots * (8 + trigram_width * 6)`` bytes (int64 key, int32 tokens, uint16 counts);
             e.g. 65,536 slots x 4 ways -> 2 MiB. A slot is a hash bucket of one token pair; a colliding pair
             replaces it, and a full bucket replaces its least counted token (space-saving), so memory never grows.
When the engine passes no top-k rows (``observe(..., topk=None)``), the matrix learns from committed tokens instead:
the token that actually followed moves to the front of its predecessor's row.
"""
from __future__ import annotations

import heapq
from array import array
from functools import lru_cache
from typing import Sequence

import numpy as np

from leapdecode.spec.calibration import Offer, depth_bucket, evidence
from leapdecode.spec.compiled import core
from leapdecode.spec.drafter import Draft, DraftRequest, PerRequestDrafter
from leapdecode.spec.index import as_int_list
from leapdecode.spec.tree import node_depths

_COUNT_MAX = int(np.iinfo(np.uint16).max)

RECYCLING = 5                    # evidence kind (spec/calibration.py)

DEFAULT_RANK_PROBS = (0.55, 0.16, 0.08, 0.05, 0.04, 0.03, 0.02, 0.02)
"""Prior acceptance rate of the successor of each rank, used only to shape the static tree."""


@lru_cache(maxsize=256)
def static_tree(max_nodes: int, rank_probs: tuple[float, ...]) -> tuple[tuple[int, int], ...]:
    """The static draft tree shape: ``(parent, rank)`` per node in breadth-first order (parent -1 = root).

    A node is a path of successor ranks from the root; its prior value is the product of ``rank_probs`` along the
    path. The ``max_nodes`` most valuable paths form a prefix-closed set (a path is worth less than its prefix),
    found best-first; sorting them by depth gives the BFS order the drafter fills in.
    """
    if max_nodes <= 0:
        return ()
    chosen: list[tuple[int, ...]] = []
    heap = [(-p, (r,)) for r, p in enumerate(rank_probs)]
    heapq.heapify(heap)
    while heap and len(chosen) < max_nodes:
        neg_value, path = heapq.heappop(heap)
        chosen.append(path)
        for r, p in enumerate(rank_probs):
            heapq.heappush(heap, (neg_value * p, path + (r,)))
    chosen.sort(key=lambda path: (len(path), path))
    index = {path: i for i, path in enumerate(chosen)}
    return tuple((index[path[:-1]] if len(path) > 1 else -1, path[-1]) for path in chosen)


class RecyclingDrafter(PerRequestDrafter):
    """Token Recycling drafter with ADED-style adaptive tri-gram ranking. See the module docstring."""
    wants_topk = True        # learns from the target's top-k at every verified position (see Drafter.observe)

    def __init__(self, vocab_size: int = 32000, num_successors: int = 8, tree: bool = True,
                 rank_probs: Sequence[float] = DEFAULT_RANK_PROBS, trigram_slots: int = 1 << 16,
                 trigram_width: int = 4, trigram_min_count: int = 1, use_trigrams: bool = True,
                 compiled: bool | None = None) -> None:
        if not (isinstance(vocab_size, int) and vocab_size >= 1):
            raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
        if not (isinstance(num_successors, int) and 1 <= num_successors <= 64):
            raise ValueError(f"num_successors must be an integer in [1, 64], got {num_successors!r}")
        if not (isinstance(trigram_slots, int) and trigram_slots >= 1 and trigram_slots & (trigram_slots - 1) == 0):
            raise ValueError(f"trigram_slots must be a power of two, got {trigram_slots!r}")
        if not (isinstance(trigram_width, int) and trigram_width >= 1):
            raise ValueError(f"trigram_width must be a positive integer, got {trigram_width!r}")
        probs = tuple(float(p) for p in rank_probs)[:num_successors]
        if not probs or not all(0.0 < p < 1.0 for p in probs):
            raise ValueError(f"rank_probs must be probabilities in (0, 1), got {rank_probs!r}")
        self.k = num_successors
        self.tree = bool(tree)
        self.rank_probs = probs if self.tree else probs[:1]
        self._adj = array("i", [-1]) * (vocab_size * num_successors)    # row t: successors of token t
        self.use_trigrams = bool(use_trigrams)
        self.trigram_min_count = int(trigram_min_count)
        # flat arrays (slot s holds ways s * width .. s * width + width - 1): read and written one element at a
        # time, array.array costs ~40 ns where a numpy scalar access costs ~150 (a prompt is learned token by
        # token: ~0.8 -> ~0.4 us a token), and nothing in them is an object the garbage collector tracks
        self._tri_mask, self._tri_width = trigram_slots - 1, trigram_width
        self._tri_key = array("q", [-1]) * trigram_slots
        self._tri_next = array("i", [-1]) * (trigram_slots * trigram_width)
        self._tri_count = array("H", [0]) * (trigram_slots * trigram_width)
        self._tri_empty = (array("i", [-1]) * trigram_width, array("H", [0]) * trigram_width)
        # learning from committed tokens and drafting in C++ (spec/compiled.py: the same tables and drafts; an
        # 8,000-token prompt learned in ~0.7 ms instead of ~10); None: the Python code below. compiled=None: where the module builds; True: required
        self._compiled = core() if compiled is not False else None
        if compiled and self._compiled is None:
            raise ValueError("compiled=True: the compiled drafting module could not be built here")
        self._learned: dict[int, int] = {}     # seq_id -> committed tokens already learned from
        # learn a request's committed tokens when it is next asked to draft (and at its end), not in every observe:
        # set by auto in order (spec/auto.py), where recycling drafts only for the requests suffix has nothing for.
        # One request alone gets the same tables and drafts (its tokens are learned in the same order before each
        # draft); requests decoding together teach the shared tables later and in another interleaving.
        self.lazy = False
        self._topk_seen = False                # once the engine sends top-k rows, the matrix learns only from them

    # -- Drafter protocol (propose: PerRequestDrafter) --------------------------------------------------------------
    def draft_one(self, req: DraftRequest) -> Draft:
        tokens, parents, ranks, _ = self._fill_request(req)
        if not tokens:
            return Draft()
        score = sum(self.rank_probs[r] for r, p in zip(ranks, parents) if p == -1)
        chain = all(p == i - 1 for i, p in enumerate(parents))   # topological by construction (BFS order)
        return Draft(tokens, None if chain else parents, min(1.0, score))

    def observe(self, seq_id: int, token_ids: Sequence[int], num_accepted: int,
                topk: Sequence[Sequence[int]] | None = None) -> None:
        if topk is not None and len(topk):
            self._topk_seen = True
            # Row r holds the successors of the token at position (last committed before the step) + r.
            first = len(token_ids) - num_accepted - 2
            for r, row in enumerate(topk):
                pos = first + r
                if 0 <= pos < len(token_ids):
                    self._set_row(int(token_ids[pos]), as_int_list(row))
        if not self.lazy:
            self._learn(seq_id, token_ids)

    def prepare(self, seq_id: int, token_ids: Sequence[int]) -> None:
        self._learn(seq_id, token_ids)

    def finish(self, seq_id: int, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        if self.lazy:
            self._learn(seq_id, token_ids)      # what it never was asked to draft from still teaches the tables
        self._learned.pop(seq_id, None)

    # -- learning --------------------------------------------------------------------------------------------------
    def memory_bytes(self) -> int:
        """Bytes held by the global tables; constant after construction unless a token id beyond ``vocab_size``
        arrives and the matrix grows to cover it."""
        return sum(len(t) * t.itemsize for t in (self._adj, self._tri_key, self._tri_next, self._tri_count))

    def _learn(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """Learn from the committed tokens not seen before (the prompt on first sight, then each step's output).
        Only the new tail is converted, so a step costs O(new tokens) whatever the context length."""
        start = self._learned.get(seq_id, 0)
        if start > len(token_ids):
            start = 0                       # the sequence was replaced: relearn
        offset = max(0, start - 2)
        tokens = as_int_list(token_ids[offset:])
        mtf_lo = max(start, 1) - offset if not self._topk_seen else -1
        tri_lo = max(start - offset, 2) if self.use_trigrams else -1
        if self._compiled is None:
            if mtf_lo >= 0:
                self._move_to_front(tokens, mtf_lo)
            if tri_lo >= 0:
                self._count_trigrams(tokens, tri_lo)
        else:       # the same updates in C++ (spec/compiled.py), on the same tables
            if mtf_lo >= 0:
                self._predecessor_rows(tokens, mtf_lo)
            self._compiled.recycling_learn(*self._tables(), tokens, mtf_lo, tri_lo)
        self._learned[seq_id] = len(token_ids)

    @property
    def adjacency(self) -> np.ndarray:
        """The matrix as a [vocab, num_successors] int32 array (a view: valid until the vocabulary grows)."""
        return np.frombuffer(self._adj, dtype=np.int32).reshape(-1, self.k)

    def _ensure_vocab(self, token: int) -> None:
        rows = len(self._adj) // self.k
        if token >= rows:
            self._adj.extend(array("i", [-1]) * ((max(token + 1, 2 * rows) - rows) * self.k))

    def _tables(self) -> tuple:
        """The tables as the compiled learning and drafting take them (read when called: the matrix may grow)."""
        return (self._adj, self.k, self._tri_key, self._tri_next, self._tri_count, self._tri_width, self._tri_mask)

    def _predecessor_rows(self, tokens: list[int], lo: int) -> bool:
        """Grow the matrix to hold the rows of the predecessors of ``tokens[lo:]`` (``lo`` at least 1); False when
        there are none."""
        lo = max(lo, 1)
        if lo >= len(tokens):
            return False
        self._ensure_vocab(max(tokens[lo - 1:-1]))
        return True

    def _set_row(self, token: int, successors: list[int]) -> None:
        self._ensure_vocab(token)
        k, n = self.k, min(self.k, len(successors))
        self._adj[token * k:token * k + k] = array("i", successors[:n] + [-1] * (k - n))

    def _move_to_front(self, tokens: list[int], lo: int) -> None:
        """Each token of ``tokens[lo:]`` moves to the front of its predecessor's row (the least recent successor
        drops out of a full row)."""
        if not self._predecessor_rows(tokens, lo):
            return
        lo = max(lo, 1)
        adj, k = self._adj, self.k
        for i in range(lo, len(tokens)):
            successor, base = tokens[i], tokens[i - 1] * k
            if adj[base] == successor:
                continue
            row = adj[base:base + k]
            j = row.index(successor) if successor in row else k - 1
            adj[base + 1:base + j + 1] = row[:j]
            adj[base] = successor

    def _slot(self, a: int, b: int) -> tuple[int, int]:
        key = (a << 32) | b
        return (a * 1_000_003 + b * 7919) & self._tri_mask, key

    def _count_trigrams(self, tokens: list[int], lo: int) -> None:
        """Count the tri-grams ending at ``tokens[lo:]`` (``lo >= 2``). A token new to its pair's bucket takes the
        least counted way (space-saving); a count at the maximum halves the bucket's counts first."""
        keys, nxt, counts, width = self._tri_key, self._tri_next, self._tri_count, self._tri_width
        slot_of, (no_next, no_count) = self._slot, self._tri_empty
        for i in range(lo, len(tokens)):
            c = tokens[i]
            slot, key = slot_of(tokens[i - 2], tokens[i - 1])
            base = slot * width
            if keys[slot] != key:           # a colliding pair (or none yet): the bucket starts over
                keys[slot] = key
                nxt[base:base + width] = no_next
                counts[base:base + width] = no_count
                j = base
                nxt[j] = c
            else:
                ways = nxt[base:base + width]
                if c in ways:
                    j = base + ways.index(c)
                else:
                    held = counts[base:base + width]
                    j = base + held.index(min(held))
                    nxt[j] = c
                    counts[j] = 0
            n = counts[j]
            if n == _COUNT_MAX:
                for x in range(base, base + width):
                    counts[x] >>= 1
                n = counts[j]
            counts[j] = n + 1

    def trigram_successors(self, a: int, b: int) -> list[tuple[int, int]]:
        """``(token, count)`` seen after the pair (a, b), most counted first."""
        if a < 0:
            return []
        slot, key = self._slot(a, b)
        if self._tri_key[slot] != key:
            return []
        base, width = slot * self._tri_width, self._tri_width
        pairs = [(t, c) for t, c in zip(self._tri_next[base:base + width], self._tri_count[base:base + width])
                 if c > 0]
        pairs.sort(key=lambda tc: -tc[1])
        return pairs

    # -- drafting --------------------------------------------------------------------------------------------------
    def successors(self, a: int, b: int) -> list[int]:
        """Ranked successors of token ``b`` preceded by ``a`` (-1 when unknown): confident tri-grams, the matrix
        row, then the other tri-grams; no duplicates."""
        return [t for t, _ in self.ranked(a, b)]

    def ranked(self, a: int, b: int) -> list[tuple[int, int]]:
        """:meth:`successors` with each one's tri-gram count after (a, b) (0: from the matrix alone)."""
        k = self.k
        row = self._adj[b * k:b * k + k].tolist() if (b + 1) * k <= len(self._adj) else []
        if not self.use_trigrams:
            return [(t, 0) for t in row if t >= 0]
        tri = self.trigram_successors(a, b)
        count = dict(tri)
        ranked = [t for t, c in tri if c >= self.trigram_min_count]
        ranked += [t for t in row if t >= 0] + [t for t, c in tri if c < self.trigram_min_count]
        return [(t, count.get(t, 0)) for t in dict.fromkeys(ranked)]

    def offers(self, req: DraftRequest) -> list[Offer]:
        """The draft as calibration offers (spec/calibration.py): each node's evidence is its successor rank, how
        often the tri-gram ending in it was seen, and its depth; its prior is the rank's prior acceptance."""
        if req.max_draft <= 0 or not len(req.token_ids):
            return []
        tokens, parents, ranks, counts = self._fill_request(req)
        depths = node_depths(parents)
        keys = [evidence(RECYCLING, min(rank, 3), min(count, 4)) + depth_bucket(d)
                for rank, count, d in zip(ranks, counts, depths)]
        offer = Offer(tokens, parents, depths, keys, [self.rank_probs[r] for r in ranks])
        return [offer] if tokens else []

    def _fill_request(self, req: DraftRequest) -> tuple[list[int], list[int], list[int], list[int]]:
        """Learn the request's new committed tokens, then :meth:`_fill` from its last two."""
        self._learn(req.seq_id, req.token_ids)
        last = int(req.token_ids[-1])
        before = int(req.token_ids[-2]) if len(req.token_ids) >= 2 else -1
        return self._fill(before, last, req.max_draft)

    def _fill(self, before: int, last: int, max_draft: int) -> tuple[list[int], list[int], list[int], list[int]]:
        """Fill the static tree breadth-first: a node's token is its parent's successor of the node's rank.
        Returns tokens, parents, each node's rank and its tri-gram count."""
        shape = static_tree(max_draft, self.rank_probs)
        if self._compiled is not None:        # the same fill in C++ (spec/compiled.py), over the same tables
            return self._compiled.recycling_fill(*self._tables(), self.use_trigrams, self.trigram_min_count, before,
                                                 last, list(shape))
        tokens: list[int] = []
        parents: list[int] = []
        ranks: list[int] = []
        counts: list[int] = []
        node_of_shape: list[int] = []           # shape node -> draft index, or -1 when it could not be filled
        cache: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for parent_shape, rank in shape:
            if parent_shape == -1:
                pair, parent = (before, last), -1
            else:
                parent = node_of_shape[parent_shape]
                if parent < 0:
                    node_of_shape.append(-1)
                    continue
                grand = parents[parent]
                pair = (tokens[grand] if grand >= 0 else last, tokens[parent])
            succ = cache.get(pair)
            if succ is None:
                succ = cache[pair] = self.ranked(*pair)
            if rank >= len(succ):
                node_of_shape.append(-1)
                continue
            tokens.append(succ[rank][0])
            counts.append(succ[rank][1])
            parents.append(parent)
            ranks.append(rank)
            node_of_shape.append(len(tokens) - 1)
        return tokens, parents, ranks, counts
