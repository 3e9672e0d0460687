"""The paged KV pool's bookkeeping: which block holds which sequence's tokens, and the prefix cache.

A block is reference-counted. A full block whose KV has been computed is keyed by a hash chain of its tokens
(hash of the previous block's key and this block's tokens), so a later request with the same prefix reuses it.
Free blocks sit in LRU order; a free block keeps its key until it is handed out again, which is what makes a
prefix survive its request. Only computed KV is ever keyed, so a hit is always safe to read.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from array import array

from leapdecode.engine.sequence import Sequence


def block_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(array("q", tokens).tobytes())
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_keys: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}                             # key -> block id
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))   # LRU first
        self.hits = self.queries = 0                                   # prefix-cache statistics (tokens)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    # -- allocation ------------------------------------------------------------------------------------------
    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free[block]
        self.ref_counts[block] += 1

    def _pop_free(self) -> int:
        block, _ = self.free.popitem(last=False)
        key = self.block_keys[block]
        if key is not None:                       # evict: its old content is about to be overwritten
            if self.cached.get(key) == block:
                del self.cached[key]
            self.block_keys[block] = None
        self.ref_counts[block] = 1
        return block

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Make ``seq.block_table`` cover its first ``num_tokens`` tokens; False (and no change) if the pool is short."""
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self.free):
            return False
        seq.block_table.extend(self._pop_free() for _ in range(need))
        return True

    def free_seq(self, seq: Sequence) -> None:
        """Release all of a sequence's blocks; the tail goes to the LRU end first, so prefixes live longest."""
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table, seq.block_hashes = [], []

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free[block] = None
            if self.block_keys[block] is None:    # nothing worth keeping: hand it out first
                self.free.move_to_end(block, last=False)

    def share_prefix(self, parent: Sequence, child: Sequence, num_blocks: int) -> int:
        """Let ``child`` (a sibling sample of the same prompt) reuse the parent's first full blocks; returns the
        number of tokens they hold (the caller owns the computed counter)."""
        assert not child.block_table
        for block in parent.block_table[:num_blocks]:
            self._take(block)
        child.block_table = list(parent.block_table[:num_blocks])
        child.block_hashes = list(parent.block_hashes[:num_blocks])
        return num_blocks * self.block_size

    # -- prefix cache ----------------------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> int:
        """On first scheduling: adopt cached blocks for the longest cached prefix, leaving >= 1 token to compute.
        Returns the number of tokens adopted (the caller owns the computed counter)."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self.queries += seq.num_tokens
        if not self.enable_prefix_caching:
            return 0
        key = None
        for i in range(max_blocks):
            key = block_hash(key, seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            block = self.cached.get(key)
            if block is None:
                break
            self._take(block)
            seq.block_table.append(block)
            seq.block_hashes.append(key)
        cached = len(seq.block_table) * self.block_size
        self.hits += cached
        return cached

    def commit(self, seq: Sequence, num_computed: int) -> None:
        """Key every block that has become full of computed (the first ``num_computed``), committed tokens."""
        bs = self.block_size
        limit = min(num_computed, seq.num_tokens) // bs
        while len(seq.block_hashes) < limit:
            i = len(seq.block_hashes)
            key = block_hash(seq.block_hashes[-1] if seq.block_hashes else None, seq.token_ids[i * bs:(i + 1) * bs])
            seq.block_hashes.append(key)
            block = seq.block_table[i]
            if self.enable_prefix_caching and key not in self.cached and self.block_keys[block] is None:
                self.cached[key] = block
                self.block_keys[block] = key
