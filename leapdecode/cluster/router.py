"""Which instance serves a request: the one most likely to hold its prompt's prefix, unless it is much busier.

Each instance's recently routed prompts are remembered as the hash chain of their full blocks (the same keys the
block manager uses for its prefix cache), in a bounded LRU. A request goes to the instance that shares the longest
chain of leading blocks with its prompt, so conversations and shared system prompts keep hitting a warm cache; when
that instance has ``imbalance`` more requests in flight than the least busy one, the least busy one wins instead (a
cache hit is not worth a queue). The router's memory is approximate by design (an instance may have evicted a
block; another request may have warmed it): a miss costs recomputation, never correctness.
"""
from __future__ import annotations

from collections import OrderedDict

from leapdecode.engine.block_manager import chain_keys


class PrefixRouter:
    def __init__(self, num_instances: int, block_size: int, imbalance: int = 4, capacity: int = 1 << 16) -> None:
        self.block_size, self.imbalance, self.capacity = block_size, imbalance, capacity
        self._seen: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_instances)]
        self.in_flight = [0] * num_instances

    def matched_blocks(self, instance: int, keys: list[bytes]) -> int:
        seen, n = self._seen[instance], 0
        for key in keys:
            if key not in seen:
                break
            n += 1
        return n

    def pick(self, token_ids: list[int], candidates: list[int]) -> int:
        """The instance (among ``candidates``, which must not be empty) to serve ``token_ids``; records the choice."""
        keys = chain_keys(token_ids, self.block_size)       # empty prompt: the least busy instance
        least = min(candidates, key=lambda i: (self.in_flight[i], i))
        best = max(candidates, key=lambda i: (self.matched_blocks(i, keys), -self.in_flight[i], -i))
        if self.matched_blocks(best, keys) == 0 or self.in_flight[best] - self.in_flight[least] >= self.imbalance:
            best = least
        self.record(best, keys)
        return best

    def record(self, instance: int, keys: list[bytes]) -> None:
        seen = self._seen[instance]
        for key in keys:
            seen[key] = None
            seen.move_to_end(key)
        while len(seen) > self.capacity:
            seen.popitem(last=False)

    def started(self, instance: int) -> None:
        self.in_flight[instance] += 1

    def ended(self, instance: int) -> None:
        self.in_flight[instance] -= 1

    def forget(self, instance: int) -> None:
        """The instance restarted: its cache is empty."""
        self._seen[instance].clear()
