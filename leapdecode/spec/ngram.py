"""Prompt lookup: draft the tokens that followed the last earlier occurrence of the context's suffix.

Prompt lookup decoding (Saxena 2023, https://github.com/apoorvumang/prompt-lookup-decoding) exploits that outputs
often copy spans of their input (summaries, code edits, multi-turn chat quoting earlier turns). It needs no model:
find the longest suffix of the context, between ``n_min`` and ``n_max`` tokens long, that also occurs earlier in
the context, and propose what followed that earlier occurrence.

The search is incremental. :class:`NgramIndex` keeps, per request, a dictionary from every n-gram of the context to
the positions right after its occurrences. A step appends the newly committed tokens (``len(sizes)`` dictionary
updates per token) and a lookup costs ``len(sizes)`` dictionary probes, independent of the context length. The
index is shared with the suffix drafter (:mod:`leapdecode.spec.suffix`), which builds on the same occurrence lists.
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from leapdecode.spec.drafter import Draft, DraftRequest

SENTINEL = -1
"""A token value that is never a real token: separates independent sequences inside one :class:`NgramIndex`, so no
n-gram, match or continuation crosses from one sequence into the next."""


def as_int_list(tokens: Sequence[int]) -> list[int]:
    """Plain Python ints (lists, tuples, numpy arrays and torch tensors all come in): dictionary keys built from numpy
    scalars hash equal but are slower, and tensors would hash by identity."""
    if isinstance(tokens, list):
        return tokens
    tolist = getattr(tokens, "tolist", None)
    if tolist is not None:
        return tolist()
    return [int(t) for t in tokens]


def continuation(tokens: list[int], start: int, length: int) -> list[int]:
    """``tokens[start:start + length]``, continued periodically where it runs past the end of ``tokens``.

    An occurrence that overlaps the context's own suffix (text repeating with period ``len(tokens) - start``, as in
    a model stuck in a loop, a ruler of ``#`` lines, a table of similar rows) has fewer than ``length`` known
    followers; the natural guess, as in an LZ77 overlapping copy, is that the repetition goes on. (On the embedded
    model's loop-prone outputs this took prompt lookup from 2.78 to 4.61 tokens per step at k=10.)
    """
    out = tokens[start:start + length]
    period = len(tokens) - start
    while 0 < period and len(out) < length:
        out.append(out[len(out) - period])
    return out


class NgramIndex:
    """Where each n-gram of a growing token stream occurs, for the n-gram lengths in ``sizes``.

    An occurrence of the n-gram ``tokens[s:s+n]`` is recorded as its *follower* position ``f = s + n``, and only
    once ``tokens[f]`` exists. So the n-gram at the very end of the stream is never its own match, every recorded
    occurrence has at least one continuation token, and ``occurrences`` lists are in increasing position order
    (most recent last).

    Positions are absolute: :meth:`evict_before` drops a prefix of the stream (a bounded cache of finished requests)
    without renumbering, so ``base`` is the absolute position of the first stored token.
    """

    def __init__(self, sizes: Sequence[int] = (1, 2, 3, 4)) -> None:
        sizes = sorted(set(int(n) for n in sizes))
        if not sizes or sizes[0] < 1:
            raise ValueError(f"n-gram sizes must be positive integers, got {list(sizes)}")
        self.sizes: tuple[int, ...] = tuple(sizes)
        self.tokens: list[int] = []            # the stream (from ``base`` on), as Python ints for cheap slicing
        self.base = 0                          # absolute position of tokens[0]
        self._floor = 0                        # n-grams start at or after this absolute position (after a sentinel)
        self._tables: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in self.sizes}
        self._array = np.empty(64, dtype=np.int64)  # numpy mirror of ``tokens`` for vectorised comparisons

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def end(self) -> int:
        """Absolute position one past the last token."""
        return self.base + len(self.tokens)

    @property
    def array(self) -> np.ndarray:
        """The stored tokens as an int64 array (a view: valid until the next append); index = position - base."""
        return self._array[: len(self.tokens)]

    def extend(self, new_tokens: Sequence[int]) -> None:
        """Append tokens (no sentinels) and index every n-gram that now has a follower."""
        new = as_int_list(new_tokens)
        if not new:
            return
        old_len = len(self.tokens)
        self.tokens.extend(new)
        self._mirror(old_len)
        toks, base = self.tokens, self.base
        # The n-grams gaining a follower are those followed by one of the new positions f.
        for n in self.sizes:
            table = self._tables[n]
            first_f = max(base + old_len, self._floor + n)
            for f in range(first_f, self.end):
                i = f - base
                key = tuple(toks[i - n:i])
                lst = table.get(key)
                if lst is None:
                    table[key] = [f]
                else:
                    lst.append(f)

    def break_sequence(self) -> None:
        """Start an independent sequence: nothing before this point will match or continue into what follows."""
        old_len = len(self.tokens)
        self.tokens.append(SENTINEL)
        self._mirror(old_len)
        self._floor = self.end

    def occurrences(self, key: tuple[int, ...]) -> list[int]:
        """Follower positions of ``key`` (one of ``sizes`` long), oldest first; empty when it never occurred.
        The returned list is the index's own: do not modify it."""
        table = self._tables.get(len(key))
        if table is None:
            raise ValueError(f"this index holds n-grams of sizes {self.sizes}, not {len(key)}")
        return table.get(key, _EMPTY)

    def evict_before(self, position: int) -> None:
        """Forget every token before absolute ``position`` and every n-gram that starts there."""
        position = min(position, self.end)
        cut = position - self.base
        if cut <= 0:
            return
        toks = self.tokens
        for n in self.sizes:
            table = self._tables[n]
            # n-grams starting in [base, position) have followers f in [base + n, position + n).
            starts = range(0, min(cut, len(toks) - n))
            seen: set[tuple[int, ...]] = set()
            for s in starts:
                key = tuple(toks[s:s + n])
                if key in seen or SENTINEL in key:
                    continue
                seen.add(key)
                lst = table.get(key)
                if lst is None:
                    continue
                del lst[: bisect_left(lst, position + n)]
                if not lst:
                    del table[key]
        del self.tokens[:cut]
        self.base = position
        self._floor = max(self._floor, position)
        self._array = np.array(self.tokens, dtype=np.int64) if self.tokens else np.empty(64, dtype=np.int64)
        if len(self._array) < 64:
            self._array = np.resize(self._array, 64)

    def _mirror(self, old_len: int) -> None:
        """Copy the tokens appended since ``old_len`` into the numpy mirror, doubling its capacity as needed."""
        size = len(self.tokens)
        if size > len(self._array):
            grown = np.empty(max(size, 2 * len(self._array)), dtype=np.int64)
            grown[:old_len] = self._array[:old_len]
            self._array = grown
        self._array[old_len:size] = self.tokens[old_len:size]


_EMPTY: list[int] = []


def sync_index(index: NgramIndex | None, token_ids: Sequence[int], sizes: Sequence[int]) -> NgramIndex:
    """Bring a request's index up to date with its committed tokens, appending only what is new.

    Committed tokens normally only grow; if they ever do not (a caller reusing a sequence id), the index is rebuilt
    rather than trusted. The check looks at the length and the last indexed token, so it is O(1).
    """
    n = len(index.tokens) if index is not None else 0
    if index is None or len(token_ids) < n or (n and int(token_ids[n - 1]) != index.tokens[-1]):
        index = NgramIndex(sizes)
        n = 0
    if len(token_ids) > n:
        index.extend(token_ids[n:])
    return index


@dataclass
class _Match:
    length: int             # n-gram length of the matched suffix
    followers: list[int]    # follower positions of its earlier occurrences, oldest first


class NgramDrafter:
    """Prompt-lookup drafter: the longest context suffix of ``n_min..n_max`` tokens found earlier in the context.

    The draft copies what followed the most recent earlier occurrence (recent text is the likeliest to be copied
    again: the current paragraph, the latest version of the code being edited), continued periodically when that
    occurrence overlaps the end of the context (see :func:`continuation`). With ``num_branches > 1`` the
    draft becomes a tree: continuations of older occurrences that differ from the most recent one are added as
    short side branches (``branch_len`` tokens past the point where they diverge), so a verifier that accepts the
    longest matching path can follow whichever copy the model actually makes.

    ``score`` is a heuristic confidence for the first draft token, increasing with match length and with how many
    of the recent occurrences agree on it.
    """

    def __init__(self, n_min: int = 1, n_max: int = 4, num_branches: int = 1, branch_len: int = 2,
                 scan_occurrences: int = 8) -> None:
        if not (isinstance(n_min, int) and isinstance(n_max, int) and 1 <= n_min <= n_max):
            raise ValueError(f"need integers 1 <= n_min <= n_max, got n_min={n_min!r}, n_max={n_max!r}")
        if not (isinstance(num_branches, int) and num_branches >= 1):
            raise ValueError(f"num_branches must be a positive integer, got {num_branches!r}")
        if not (isinstance(branch_len, int) and branch_len >= 1):
            raise ValueError(f"branch_len must be a positive integer, got {branch_len!r}")
        if not (isinstance(scan_occurrences, int) and scan_occurrences >= 1):
            raise ValueError(f"scan_occurrences must be a positive integer, got {scan_occurrences!r}")
        self.n_min, self.n_max = n_min, n_max
        self.num_branches, self.branch_len = num_branches, branch_len
        self.scan_occurrences = scan_occurrences
        self._sizes = tuple(range(n_min, n_max + 1))
        self._indexes: dict[int, NgramIndex] = {}

    # -- Drafter protocol ------------------------------------------------------------------------------------------
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts = []
        for req in requests:
            if req.max_draft <= 0 or len(req.token_ids) < 2:
                drafts.append(Draft())
                continue
            index = sync_index(self._indexes.get(req.seq_id), req.token_ids, self._sizes)
            self._indexes[req.seq_id] = index
            drafts.append(self._draft(index, req.max_draft))
        return drafts

    def observe(self, seq_id: int, token_ids: Sequence[int], num_accepted: int,
                topk: Sequence[Sequence[int]] | None = None) -> None:
        # The index catches up lazily in propose(); nothing here needs the acceptance outcome.
        del seq_id, token_ids, num_accepted, topk

    def finish(self, seq_id: int, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self._indexes.pop(seq_id, None)

    # -- drafting --------------------------------------------------------------------------------------------------
    def longest_match(self, index: NgramIndex) -> _Match | None:
        """The longest suffix (``n_max`` down to ``n_min`` tokens) that has an earlier occurrence."""
        toks = index.tokens
        for n in range(min(self.n_max, len(toks) - 1), self.n_min - 1, -1):
            followers = index.occurrences(tuple(toks[len(toks) - n:]))
            if followers:
                return _Match(n, followers)
        return None

    def _draft(self, index: NgramIndex, max_draft: int) -> Draft:
        match = self.longest_match(index)
        if match is None:
            return Draft()
        toks = index.tokens
        recent = match.followers[-1:-self.scan_occurrences - 1:-1]   # newest first
        primary = continuation(toks, recent[0], max_draft)
        agree = sum(1 for f in recent if toks[f] == primary[0]) / len(recent)
        score = agree * match.length / (match.length + 1.0)
        if self.num_branches == 1 or len(recent) == 1:
            return Draft(tokens=primary, score=score)
        return self._tree(toks, recent, primary, max_draft, score)

    def _tree(self, toks: list[int], recent: list[int], primary: list[int], max_draft: int, score: float) -> Draft:
        """Primary chain plus side branches where older occurrences continue differently.

        Each older occurrence whose continuation leaves the paths drafted so far contributes its next
        ``branch_len`` tokens from the point of divergence. The primary chain gives up its tail to make room for
        them, so the tree never exceeds ``max_draft`` nodes.
        """
        paths = [primary]
        side_tokens = 0
        for f in recent[1:]:
            if len(paths) >= self.num_branches:
                break
            cont = continuation(toks, f, max_draft)
            depth = _divergence(cont, paths)
            if depth < len(cont):
                path = cont[:depth + self.branch_len]
                paths.append(path)
                side_tokens += len(path) - depth
        paths[0] = primary[:max(1, max_draft - side_tokens)]
        tokens: list[int] = []
        parents: list[int] = []
        node_of: dict[tuple[int, ...], int] = {}
        for path in paths:
            parent = -1
            for depth in range(len(path)):
                key = tuple(path[:depth + 1])
                node = node_of.get(key)
                if node is None:
                    if len(tokens) == max_draft:
                        break
                    tokens.append(path[depth])
                    parents.append(parent)
                    node = node_of[key] = len(tokens) - 1
                parent = node
        return Draft(tokens=tokens, parents=parents, score=score)


def _divergence(cont: list[int], paths: list[list[int]]) -> int:
    """Length of the longest common prefix between ``cont`` and any of ``paths``."""
    best = 0
    for path in paths:
        n = 0
        for a, b in zip(cont, path):
            if a != b:
                break
            n += 1
        best = max(best, n)
    return best
