"""The n-gram occurrence index shared by prompt lookup (:mod:`leapdecode.spec.ngram`) and SuffixDecoding
(:mod:`leapdecode.spec.suffix`).

:class:`NgramIndex` keeps, for a growing token stream, a dictionary from every n-gram (for a few small n) to the
positions right after its occurrences. Appending a token costs ``len(sizes)`` dictionary updates, and reading the k
most recent occurrences of an n-gram one probe and k steps along a chain, independent of the stream's length;
:func:`sync_index` keeps a request's index up to date with its committed tokens, and :func:`continuation` reads what
followed an occurrence.
"""
from __future__ import annotations

from array import array
import gc
from typing import Sequence

import numpy as np

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
    followers; the natural guess, as in an LZ77 overlapping copy, is that the repetition goes on. Its measured
    effect on the drafters: benchmarks/README.md (and ``benchmarks/replay.py`` for a model-free replay).
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
    occurrence has at least one continuation token, and :meth:`occurrences` lists them in increasing position order
    (most recent last).

    Positions are absolute: :meth:`evict_before` drops a prefix of the stream (a bounded cache of finished requests)
    without renumbering, so ``base`` is the absolute position of the first stored token.

    Layout: per n, a dictionary from each n-gram to its most recent follower position, and an ``array('q')``
    ``previous`` over the stream: ``previous[f - base]`` is the follower of the same n-gram's occurrence before the
    one followed by f (-1 for none). The occurrences of an n-gram are that chain, newest first, so a lookup that
    needs the most recent k (every drafter here) costs O(k). Nothing per position is an object the garbage
    collector tracks (an earlier layout, a list of positions per n-gram, left ~16,000 tracked lists behind for an
    8,000-token prompt, growth that makes a later full collection, inside some engine step, expensive), and a
    position costs 8 bytes per n.
    """

    def __init__(self, sizes: Sequence[int] = (1, 2, 3, 4)) -> None:
        sizes = sorted(set(int(n) for n in sizes))
        if not sizes or sizes[0] < 1:
            raise ValueError(f"n-gram sizes must be positive integers, got {list(sizes)}")
        self.sizes: tuple[int, ...] = tuple(sizes)
        self.tokens: list[int] = []            # the stream (from ``base`` on), as Python ints for cheap slicing
        self.base = 0                          # absolute position of tokens[0]
        self._floor = 0                        # n-grams start at or after this absolute position (after a sentinel)
        self._tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}   # n-gram -> newest f
        self._previous: dict[int, array] = {n: array("q") for n in self.sizes}   # see the class doc
        self._array = np.empty(64, dtype=np.int64)  # numpy mirror of ``tokens`` for vectorised comparisons

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def last(self) -> int | None:
        """The last stored token (None when empty)."""
        return self.tokens[-1] if self.tokens else None

    @property
    def end(self) -> int:
        """Absolute position one past the last token."""
        return self.base + len(self.tokens)

    @property
    def array(self) -> np.ndarray:
        """The stored tokens as an int64 array (a view: valid until the next append); index = position - base."""
        return self._array[: len(self.tokens)]

    bulk = 256
    """Appends of at least this many tokens (a prompt's first indexing) run with the garbage collector paused."""

    def extend(self, new_tokens: Sequence[int]) -> None:
        """Append tokens (no sentinels) and index every n-gram that now has a follower.

        A long append creates one key tuple per n-gram and size (32,000 for an 8,000-token prompt), and every 700
        of them would trigger a collection of the young generation, which would then promote the dictionaries
        (and, while the tuples are young, the tuples) toward the old generation and set off full collections.
        Paused, the same indexing costs ~20x less; one young collection afterwards untracks the tuples (tuples of
        ints are not followed by the collector), so nothing of it is ever scanned again."""
        new = as_int_list(new_tokens)
        if not new:
            return
        if len(new) >= self.bulk and gc.isenabled():
            gc.disable()
            try:
                self._extend(new)
            finally:
                gc.enable()
            gc.collect(0)
            return
        self._extend(new)

    def _extend(self, new: list[int]) -> None:
        old_len = len(self.tokens)
        self.tokens.extend(new)
        self._mirror(old_len)
        toks, base, start, end = self.tokens, self.base, self.base + old_len, self.end
        # The n-grams gaining a follower are those followed by one of the new positions f.
        for n in self.sizes:
            table, previous = self._tables[n], self._previous[n]
            first_f = min(max(start, self._floor + n), end)
            if first_f > start:                 # followers of n-grams that would cross a sentinel: none
                previous.extend(_NONE * (first_f - start))
            lo, hi = first_f - base - n, end - base - n
            if hi - lo <= 4:                    # a decode step's few tokens: direct slices beat building a zip
                for i in range(lo, hi):
                    key = tuple(toks[i:i + n])
                    previous.append(table.get(key, -1))
                    table[key] = i + n + base
                continue
            keys = zip(*(toks[lo + j:hi + j] for j in range(n)))     # the n-gram before each f, built in C
            get, append = table.get, previous.append
            for f, key in zip(range(first_f, end), keys):
                append(get(key, -1))
                table[key] = f

    def break_sequence(self) -> None:
        """Start an independent sequence: nothing before this point will match or continue into what follows."""
        old_len = len(self.tokens)
        self.tokens.append(SENTINEL)
        self._mirror(old_len)
        for previous in self._previous.values():
            previous.append(-1)
        self._floor = self.end

    def occurrences(self, key: tuple[int, ...], limit: int | None = None) -> list[int]:
        """Follower positions of ``key`` (one of ``sizes`` long), oldest first; empty when it never occurred.
        With ``limit``, only the ``limit`` most recent (O(limit))."""
        table = self._tables.get(len(key))
        if table is None:
            raise ValueError(f"this index holds n-grams of sizes {self.sizes}, not {len(key)}")
        f = table.get(key, -1)
        previous, base, lowest = self._previous[len(key)], self.base, self.base + len(key)
        out: list[int] = []
        remaining = -1 if limit is None else limit
        while f >= lowest and remaining != 0:      # followers below base + n belong to evicted n-grams
            out.append(f)
            f = previous[f - base]
            remaining -= 1
        out.reverse()
        return out

    def grams(self, n: int) -> list[tuple[int, ...]]:
        """Every n-gram of size ``n`` held (for tests)."""
        return list(self._tables[n])

    def evict_before(self, position: int) -> None:
        """Forget every token before absolute ``position`` and every n-gram that starts there."""
        position = min(position, self.end)
        cut = position - self.base
        if cut <= 0:
            return
        toks = self.tokens
        for n in self.sizes:
            table = self._tables[n]
            # n-grams starting in [base, position) have followers f in [base + n, position + n); an n-gram whose
            # newest follower is among them has no occurrence left.
            for s in range(0, min(cut, len(toks) - n)):
                key = tuple(toks[s:s + n])
                if table.get(key, position + n) < position + n:
                    del table[key]
            del self._previous[n][:cut]
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


_NONE = array("q", (-1,))


def sync_index(index: NgramIndex | None, token_ids: Sequence[int], sizes: Sequence[int],
               make: type = NgramIndex) -> NgramIndex:
    """Bring a request's index up to date with its committed tokens, appending only what is new; a new index is a
    ``make(sizes)`` (:class:`NgramIndex`, or the compiled one of spec/compiled.py).

    Committed tokens normally only grow; if they ever do not (a caller reusing a sequence id), the index is rebuilt
    rather than trusted. The check looks at the length and the last indexed token, so it is O(1).
    """
    n = len(index) if index is not None else 0
    if index is None or len(token_ids) < n or (n and int(token_ids[n - 1]) != index.last):
        index = make(sizes)
        n = 0
    if len(token_ids) > n:
        index.extend(token_ids[n:])
    return index
