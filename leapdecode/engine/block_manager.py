"""The paged KV pool's bookkeeping: which block holds which sequence's tokens, and the prefix cache.

A block is reference-counted. A full block whose KV has been computed is keyed by a hash chain of its tokens
(hash of the previous block's key and this block's tokens), so a later request with the same prefix reuses it.
Free blocks sit in LRU order; a free block keeps its key until it is handed out again, which is what makes a
prefix survive its request. Only computed KV is ever keyed, so a hit is always safe to read.

With a windowed quantized KV cache (``num_window_blocks`` > 0: int8/int4, or fp8 keeping recent tokens) a block is
quantized ("sealed") in the step in which all of its tokens become final (computed, not draft nodes) and lie at
least ``recent_tokens`` behind the sequence's end, and until then lives in a full-precision **window block**:
``allocate`` gives a window block to every block that stays open after the step (or fails, like a short pool, when
the window is full), ``seal`` (called by the scheduler as it freezes a plan) seals what the step completes and
returns their window blocks to the window, and a block released while open gives its window block back. Sealed
blocks are always a prefix of a block table; only sealed blocks are keyed, so a prefix-cache hit is read
quantized exactly like the miss that computed it. When a sequence finishes, its full blocks still in the window
(the recent ones) are sealed late (``free_seq(..., keep_recent=True)``): keyed and released at once, their window
blocks held until ``take_late_seals`` hands the (pool block, window block) pairs to the next plan, which quantizes
them before its forward, so a later request with the same prefix finds the whole prefix cached.

With ``defer_seals`` (the CPU, no salient tokens) a sequence whose sealing blocks all have window blocks (a decode
step filling its open block, or accepted drafts completing one) seals them after the step's forward instead of
inside each layer: the step writes and reads them in the window, then ``take_deferred_seals`` hands the plan the
(pool block, window block) pairs to quantize from the window once the forward is done. Such a step seals nothing
inside its layers, so on the CPU it stays on the one-call decoder layer (model/cpu_layer.py), and its queries read
those blocks at full precision (the codes are the same: quantized from the same keys and values).

Blocks can also arrive from another engine (prefill/decode disaggregation, ``engine/kv_transfer.py``): ``install``
keys free blocks for a chain of keys whose KV the engine then writes, ``cached_blocks`` finds the blocks to export.
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


def chain_keys(token_ids: list[int] | tuple[int, ...], block_size: int) -> list[bytes]:
    """The keys of the full blocks of ``token_ids``, in chain order."""
    keys, key = [], None
    for i in range(len(token_ids) // block_size):
        key = block_hash(key, token_ids[i * block_size:(i + 1) * block_size])
        keys.append(key)
    return keys


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 num_window_blocks: int = 0, recent_tokens: int = 0, defer_seals: bool = False) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_keys: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}                             # key -> block id
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))   # LRU first
        self.hits = self.queries = 0                                   # prefix-cache statistics (tokens)
        # windowed caches: the window block of each open block, and which blocks are sealed
        self.num_window_blocks = num_window_blocks
        self.windowed = num_window_blocks > 0
        self.recent_tokens = recent_tokens if self.windowed else 0
        self.window_of = [-1] * num_blocks if self.windowed else []
        self.sealed = [False] * num_blocks if self.windowed else []
        self.free_window = list(range(num_window_blocks - 1, -1, -1))   # a stack: lowest first
        self.late_seals: list[tuple[int, int]] = []    # (pool block, window block) for the next plan to quantize
        self.defer_seals = defer_seals and self.windowed
        self.deferred_seals: list[tuple[int, int]] = []   # (pool block, window block) the plan seals after its forward

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
        if self.windowed:
            self.sealed[block] = False
        return block

    def allocate(self, seq: Sequence, num_tokens: int, num_final: int | None = None) -> bool:
        """Make ``seq.block_table`` cover its first ``num_tokens`` tokens; False (and no change) if the pool is short.
        ``num_final``: how many of them will be final after the step (the rest are draft nodes; default all): in a
        windowed cache every block past the last one they fill (less the recent tokens) needs a window block."""
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self.free):
            return False
        if self.windowed:
            first_open = self._num_sealable(num_tokens if num_final is None else num_final)
            total = len(seq.block_table) + need
            missing = [i for i in range(first_open, total)
                       if i >= len(seq.block_table) or self.window_of[seq.block_table[i]] < 0]
            if len(missing) > len(self.free_window):
                return False
        seq.block_table.extend(self._pop_free() for _ in range(need))
        if self.windowed:
            for i in missing:
                self.window_of[seq.block_table[i]] = self.free_window.pop()
        return True

    def seal(self, seq: Sequence, num_final: int) -> tuple[int, ...]:
        """Windowed caches: seal the blocks that the first ``num_final - recent_tokens`` tokens fill and that are
        not sealed yet; returns their window blocks in table order (-1: a block whose tokens are all in this step).
        The window blocks go back to the window at once: nothing reuses them before the step that seals them has
        run. With ``defer_seals``, blocks that all hold window blocks and no other sequence are sealed after the
        step's forward instead (``take_deferred_seals``): they stay in the window for this step and () is returned."""
        if not self.windowed:
            return ()
        i = min(self._num_sealable(num_final), len(seq.block_table))
        first = i
        while first > 0 and not self.sealed[seq.block_table[first - 1]]:
            first -= 1
        blocks = seq.block_table[first:i]
        if self.defer_seals and blocks and all(self.window_of[b] >= 0 and self.ref_counts[b] == 1 for b in blocks):
            for block in blocks:           # window_of stays until the plan is frozen: open_window lists them
                self.sealed[block] = True
                self.deferred_seals.append((block, self.window_of[block]))
            return ()
        out = []
        for block in blocks:
            self.sealed[block] = True
            w = self.window_of[block]
            out.append(w)
            if w >= 0:
                self.window_of[block] = -1
                self.free_window.append(w)
        return tuple(out)

    def take_deferred_seals(self) -> tuple[tuple[int, int], ...]:
        """The seals the plan being frozen applies after its forward; their window blocks go back to the window
        now (only later plans, whose forwards run after this one's seals, can write them)."""
        seals, self.deferred_seals = tuple(self.deferred_seals), []
        for block, w in seals:
            self.window_of[block] = -1
            self.free_window.append(w)
        return seals

    def _num_sealable(self, num_final: int) -> int:
        """Windowed caches: the leading blocks that ``num_final`` final tokens let seal (the rest stay in the window:
        the open block and, with ``recent_tokens``, the recent ones)."""
        return max(0, num_final - self.recent_tokens) // self.block_size

    def open_window(self, seq: Sequence) -> tuple[int, ...]:
        """Windowed caches: the window blocks of the sequence's open blocks (the trailing ones, in table order)."""
        if not self.windowed:
            return ()
        table = seq.block_table
        i = len(table)
        while i > 0 and self.window_of[table[i - 1]] >= 0:
            i -= 1
        return tuple(self.window_of[b] for b in table[i:])

    def kv_slot(self, block: int, offset: int) -> int:
        """Where the KV of (block, offset) can be copied (``KVCache.copy_slots``): its pool slot, or in a windowed
        cache its window slot (only open blocks are ever copied)."""
        if not self.windowed:
            return block * self.block_size + offset
        w = self.window_of[block]
        assert w >= 0, f"block {block} is sealed: its KV cannot move"
        return w * self.block_size + offset

    def free_seq(self, seq: Sequence, keep_recent: bool = False) -> None:
        """Release all of a sequence's blocks; the tail goes to the LRU end first, so prefixes live longest.
        ``keep_recent`` (a finished sequence, windowed caches): its full blocks of final tokens that are still in
        the window are sealed late and keyed, so they stay in the prefix cache like the sealed ones."""
        if keep_recent and self.windowed and self.enable_prefix_caching:
            self._seal_late(seq)
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table, seq.block_hashes, seq.num_kv_final = [], [], 0

    def _seal_late(self, seq: Sequence) -> None:
        """Key the sequence's full blocks of final KV beyond its keyed prefix, planning a late seal for each one
        still open; stops at a block another sequence holds too (it seals it itself, when its tokens allow)."""
        bs, table = self.block_size, seq.block_table
        for i in range(len(seq.block_hashes), min(seq.num_kv_final, seq.num_tokens) // bs):
            block = table[i]
            if self.ref_counts[block] > 1 or not (self.sealed[block] or self.window_of[block] >= 0):
                return
            if not self.sealed[block]:
                self.late_seals.append((block, self.window_of[block]))
                self.sealed[block], self.window_of[block] = True, -1     # the window block waits for the seal
            self._extend_chain(seq)

    def _extend_chain(self, seq: Sequence) -> None:
        """Hash the sequence's first full block not yet in its chain and key its block in the prefix cache, unless
        that key is cached already or the block holds another one."""
        i, bs = len(seq.block_hashes), self.block_size
        key = block_hash(seq.block_hashes[-1] if seq.block_hashes else None, seq.token_ids[i * bs:(i + 1) * bs])
        seq.block_hashes.append(key)
        block = seq.block_table[i]
        if self.enable_prefix_caching and key not in self.cached and self.block_keys[block] is None:
            self.cached[key], self.block_keys[block] = block, key

    def take_late_seals(self) -> tuple[tuple[int, int], ...]:
        """The late seals for the plan being frozen (it quantizes them before its forward, after its KV moves);
        their window blocks go back to the window now: only later plans can write them."""
        seals, self.late_seals = tuple(self.late_seals), []
        self.free_window += [w for _, w in seals]
        return seals

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free[block] = None
            if self.windowed and self.window_of[block] >= 0:      # abandoned while open
                self.free_window.append(self.window_of[block])
                self.window_of[block] = -1
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
        for key, block in self._cached_chain(seq.token_ids, max_blocks):
            self._take(block)
            seq.block_table.append(block)
            seq.block_hashes.append(key)
        cached = len(seq.block_table) * self.block_size
        self.hits += cached
        return cached

    def _cached_chain(self, token_ids: list[int], max_blocks: int) -> list[tuple[bytes, int]]:
        """(key, block) of the longest cached chain of full blocks of ``token_ids``, at most ``max_blocks``."""
        out, key = [], None
        for i in range(max_blocks):
            key = block_hash(key, token_ids[i * self.block_size:(i + 1) * self.block_size])
            block = self.cached.get(key)
            if block is None:
                break
            out.append((key, block))
        return out

    def cached_blocks(self, token_ids: list[int]) -> list[int]:
        """The blocks holding the longest cached prefix of ``token_ids`` (full blocks, chain order), to be read
        (``Engine.export_kv``); takes no reference and counts no statistics."""
        return [block for _, block in self._cached_chain(token_ids, len(token_ids) // self.block_size)]

    def install(self, keys: list[bytes]) -> list[int]:
        """Cache a chain of block keys whose KV comes from another engine (``Engine.import_kv``): each key gets a
        free block, keyed (and sealed) but unreferenced, so ``match_prefix`` adopts it like any hit. The chain ends
        at the most-recently-used end, its head last (as ``free_seq`` leaves a finished prefix). Returns one entry
        per key of the chain's prefix now cached: the block to fill with that key's KV, or -1 where the key was
        cached already (its block is kept as it is). Stops early when no free block outside the chain is left;
        with prefix caching off nothing is cached."""
        if not self.enable_prefix_caching:
            return []
        chain: set[int] = set()
        out = []
        for key in keys:
            block = self.cached.get(key)
            if block is not None:
                out.append(-1)
            elif not self.free or next(iter(self.free)) in chain:    # only the chain itself is left to evict
                break
            else:
                block = self._pop_free()                 # evicts the least recently used prefix
                self.ref_counts[block] = 0
                self.cached[key], self.block_keys[block] = block, key
                if self.windowed:
                    self.sealed[block] = True            # a keyed block is a quantized block
                self.free[block] = None
                out.append(block)
            chain.add(block)
            if self.ref_counts[block] == 0:              # keep the chain behind every other free block
                self.free.move_to_end(block)
        for key in reversed(keys[:len(out)]):            # the tail first, so prefixes are evicted last
            block = self.cached[key]
            if self.ref_counts[block] == 0:
                self.free.move_to_end(block)
        return out

    def discard(self, blocks: list[int]) -> None:
        """Undo ``install`` for free blocks whose KV never arrived (the write failed): unkey them and hand them out
        first."""
        for block in blocks:
            key = self.block_keys[block]
            if key is not None and self.cached.get(key) == block:
                del self.cached[key]
            self.block_keys[block] = None
            if self.windowed:
                self.sealed[block] = False
            self.free.move_to_end(block, last=False)

    def commit(self, seq: Sequence, num_computed: int) -> None:
        """Key every block that has become full of computed (the first ``num_computed``), committed tokens."""
        bs = self.block_size
        seq.num_kv_final = num_computed
        limit = min(num_computed, seq.num_tokens) // bs
        while len(seq.block_hashes) < limit:
            if self.windowed and not self.sealed[seq.block_table[len(seq.block_hashes)]]:
                break                             # keyed once sealed (its next step), so a hit reads it quantized
            self._extend_chain(seq)
