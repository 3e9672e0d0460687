"""Prompt lookup: draft the tokens that followed the last earlier occurrence of the context's suffix.

Prompt lookup decoding (Saxena 2023, https://github.com/apoorvumang/prompt-lookup-decoding) exploits that outputs
often copy spans of their input (summaries, code edits, multi-turn chat quoting earlier turns). It needs no model:
find the longest suffix of the context, between ``n_min`` and ``n_max`` tokens long, that also occurs earlier in
the context, and propose what followed that earlier occurrence.

The search is incremental. :class:`~leapdecode.spec.index.NgramIndex` keeps, per request, a dictionary from every
n-gram of the context to the positions right after its occurrences. A step appends the newly committed tokens
(``len(sizes)`` dictionary updates per token) and a lookup costs ``len(sizes)`` dictionary probes (plus
``scan_occurrences`` steps), independent of the context length. The index is shared with the suffix drafter
(:mod:`leapdecode.spec.suffix`), which builds on the same occurrence lists. Where the C++ module builds, the index
and the lookup are compiled (:mod:`leapdecode.spec.compiled`: the same drafts).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from leapdecode.spec.compiled import CompiledIndex, core
from leapdecode.spec.drafter import Draft, DraftRequest, PerRequestDrafter
from leapdecode.spec.index import NgramIndex, continuation, sync_index
from leapdecode.spec.tree import DraftTree


@dataclass
class _Match:
    length: int             # n-gram length of the matched suffix
    followers: list[int]    # follower positions of its most recent earlier occurrences, oldest first


class NgramDrafter(PerRequestDrafter):
    """Prompt-lookup drafter: the longest context suffix of ``n_min..n_max`` tokens found earlier in the context.

    The draft copies what followed the most recent earlier occurrence (recent text is the likeliest to be copied
    again: the current paragraph, the latest version of the code being edited), continued periodically when that
    occurrence overlaps the end of the context (see :func:`~leapdecode.spec.index.continuation`). With
    ``num_branches > 1`` the draft becomes a tree: continuations of older occurrences that differ from the most
    recent one are added as short side branches (``branch_len`` tokens past the point where they diverge), so a
    verifier that accepts the longest matching path can follow whichever copy the model actually makes.

    ``score`` is a heuristic confidence for the first draft token, increasing with match length and with how many
    of the recent occurrences agree on it.
    """

    def __init__(self, n_min: int = 1, n_max: int = 4, num_branches: int = 1, branch_len: int = 2,
                 scan_occurrences: int = 8, compiled: bool | None = None) -> None:
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
        # the index and the lookup compiled (spec/compiled.py: the same drafts): where the module builds and the
        # n-grams are at most 4 tokens (compiled=None), or required (True)
        if compiled is not False and core() is not None and n_max <= 4:
            self._index_type: type = CompiledIndex
        elif compiled:
            raise ValueError("compiled=True: the compiled index could not be built here (or n_max > 4)")
        else:
            self._index_type = NgramIndex
        self._indexes: dict[int, NgramIndex] = {}

    # -- Drafter protocol (propose and observe: PerRequestDrafter) --------------------------------------------------
    min_context = 2          # a match needs an earlier occurrence

    def draft_one(self, req: DraftRequest) -> Draft:
        index = sync_index(self._indexes.get(req.seq_id), req.token_ids, self._sizes, self._index_type)
        self._indexes[req.seq_id] = index
        return self._draft(index, req.max_draft)

    def prepare(self, seq_id: int, token_ids: Sequence[int]) -> None:
        self._indexes[seq_id] = sync_index(self._indexes.get(seq_id), token_ids, self._sizes, self._index_type)

    def finish(self, seq_id: int, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self._indexes.pop(seq_id, None)

    # -- drafting --------------------------------------------------------------------------------------------------
    def longest_match(self, index: NgramIndex) -> _Match | None:
        """The longest suffix (``n_max`` down to ``n_min`` tokens) that has an earlier occurrence, with its
        ``scan_occurrences`` most recent occurrences."""
        toks = index.tokens
        for n in range(min(self.n_max, len(toks) - 1), self.n_min - 1, -1):
            followers = index.occurrences(tuple(toks[len(toks) - n:]), self.scan_occurrences)
            if followers:
                return _Match(n, followers)
        return None

    def _draft(self, index: NgramIndex, max_draft: int) -> Draft:
        tree = self.num_branches > 1
        if isinstance(index, CompiledIndex):
            found = core().ngram_match(index.core, self.n_min, self.n_max, self.scan_occurrences, max_draft, tree)
            if found is None:
                return Draft()
            length, agree, count, conts = found
        else:
            match = self.longest_match(index)
            if match is None:
                return Draft()
            toks = index.tokens
            recent = match.followers[::-1]   # newest first
            conts = [continuation(toks, f, max_draft) for f in (recent if tree else recent[:1])]
            length, agree, count = match.length, sum(1 for f in recent if toks[f] == conts[0][0]), len(recent)
        score = agree / count * length / (length + 1.0)
        if not tree or count == 1:
            return Draft(tokens=conts[0], score=score)
        return self._tree(conts, max_draft, score)

    def _tree(self, conts: list[list[int]], max_draft: int, score: float) -> Draft:
        """The newest occurrence's continuation (``conts[0]``, the primary chain) plus side branches where older
        occurrences (``conts[1:]``, newest first) continue differently.

        Each older occurrence whose continuation leaves the paths drafted so far contributes its next
        ``branch_len`` tokens from the point of divergence. The primary chain gives up its tail to make room for
        them; the paths are merged into a prefix-shared tree cut at ``max_draft`` nodes.
        """
        primary = conts[0]
        paths = [primary]
        side_tokens = 0
        for cont in conts[1:]:
            if len(paths) >= self.num_branches:
                break
            depth = _divergence(cont, paths)
            if depth < len(cont):
                path = cont[:depth + self.branch_len]
                paths.append(path)
                side_tokens += len(path) - depth
        paths[0] = primary[:max(1, max_draft - side_tokens)]
        return Draft.from_tree(DraftTree.from_paths(paths, max_draft), score=score)


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
