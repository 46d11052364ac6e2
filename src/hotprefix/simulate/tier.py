"""A simulated KV store below the pool (``hotprefix simulate --kv-store-capacity-tokens N``).

It models which blocks a store of ``N`` tokens would still hold, as the engine's tiers are used
(``hotprefix.cache.tier_link``): every block the pool caches is written through to it; after the
pool's hit run, the next blocks of the prompt are looked up in it, and the consecutive run it holds
is served from it and put back in the pool (fresh blocks, cached as if computed). Eviction is LRU
over reads and writes, by whole blocks, like the ``host`` and ``disk`` tiers without priorities.

What it does not know: bytes, verification, load latency, deadlines or the "load only where it
beats recompute" rule; the engine's real tier hook (``KVCacheManager.tiers``) is not used here.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence

from hotprefix.cache.hashing import BlockKey

TIER_NAME = "store"
"""The simulated tier's name in the replay's figures (``hit_tokens_by_tier``)."""


class StoreTier:
    """An LRU set of block keys, ``capacity_tokens // block_size`` blocks large."""

    def __init__(self, capacity_tokens: int, block_size: int):
        self.num_blocks = capacity_tokens // block_size
        """Blocks the store holds at most."""
        if self.num_blocks < 1:
            raise ValueError(f"store capacity {capacity_tokens} tokens is less than one block of "
                             f"{block_size}")
        self.capacity_tokens = capacity_tokens
        self.block_size = block_size
        self._lru: OrderedDict[BlockKey, None] = OrderedDict()  # least recently used first
        self.written_blocks = 0
        """Blocks written that it did not hold (a rewrite only refreshes recency)."""
        self.evictions = 0
        """Blocks dropped to make room."""

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._lru

    def serve(self, keys: Sequence[BlockKey], start: int, limit: int) -> int:
        """How many of ``keys[start:limit]``, from ``start`` on, the store holds in a row (the run a
        pool miss at block ``start`` can load); each of them is marked as just read."""
        lru = self._lru
        n = 0
        for i in range(start, limit):
            k = keys[i]
            if k not in lru:
                break
            lru.move_to_end(k)
            n += 1
        return n

    def write(self, keys: Iterable[BlockKey]) -> None:
        """Write-through of blocks the pool just cached, in the order given (the engine's: parent
        first); the least recently used blocks drop when it is full."""
        lru = self._lru
        for k in keys:
            if k in lru:
                lru.move_to_end(k)
                continue
            lru[k] = None
            self.written_blocks += 1
            if len(lru) > self.num_blocks:
                lru.popitem(last=False)
                self.evictions += 1
