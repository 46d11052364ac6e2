"""Belady's MIN as an eviction policy, and the next-use table it is given.

MIN is offline: it needs, for every block a request touches, the index of the next request that
touches it again (``next_uses``). It plugs into the real ``BlockPool`` like the engine's policies
but is not in their registry: only a trace replay can know the future. Knows nothing about trace
formats or replay bookkeeping.
"""

from __future__ import annotations

from typing import Sequence

from hotprefix.cache.block import KVBlock
from hotprefix.cache.eviction import EvictionPolicy
from hotprefix.cache.hashing import BlockKey
from hotprefix.cache.lazy_heap import LazyHeap

INF = 1 << 62
"""Next use of a key that is never used again."""


class MinPolicy(EvictionPolicy):
    """Belady's MIN over the pool's events: evict the block whose next use is furthest (never
    used again first); ties go to the deepest block. A parent is used whenever its child is, so
    its next use is never later and MIN never strands a descendant.

    Offline: ``begin(keys, next_use)`` must be called before each request with the request's keys
    and, for each, the index of the next request that uses it; ``index`` must be the pool's index.
    """

    name = "min"

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self._next: dict[BlockKey, int] = {}
        self._blocks: list[KVBlock | None] = [None] * num_blocks
        self._heap = LazyHeap(num_blocks)  # evictable blocks: id -> (-next use, -depth)
        self._cur: dict[BlockKey, int] = {}
        self.index: dict[BlockKey, KVBlock] = {}
        """The pool's key -> block index (set by the replay)."""

    def begin(self, keys: Sequence[BlockKey], next_use: Sequence[int]) -> None:
        self._cur = dict(zip(keys, next_use))
        nxt = self._next
        for k, nu in self._cur.items():  # cached blocks this request uses but may not hit
            b = self.index.get(k)
            if b is not None and nxt.get(k) != nu:
                nxt[k] = nu
                if b.block_id in self._heap:
                    self._push(b)

    def _push(self, b: KVBlock) -> None:
        self._heap.push(b.block_id, (-self._next.get(b.key, INF), -b.depth))

    def on_cached(self, block: KVBlock) -> None:
        self._next[block.key] = self._cur.get(block.key, INF)

    def on_hit(self, block: KVBlock) -> None:
        self._next[block.key] = self._cur.get(block.key, INF)

    def on_free(self, block: KVBlock) -> None:
        self._blocks[block.block_id] = block
        self._push(block)

    def on_use(self, block: KVBlock) -> None:
        self._heap.discard(block.block_id)

    def evict(self) -> KVBlock:
        b = self._blocks[self._heap.pop()[1]]
        assert b is not None
        self._next.pop(b.key, None)
        return b

    def on_removed(self, block: KVBlock) -> None:
        self.on_use(block)
        self._next.pop(block.key, None)

    def __len__(self) -> int:
        return len(self._heap)


def next_uses(all_keys: Sequence[Sequence[BlockKey]]) -> list[list[int]]:
    """For request i and its j-th key: the index of the next request that uses that key (INF)."""
    out: list[list[int]] = [[]] * len(all_keys)
    later: dict[BlockKey, int] = {}
    for i in range(len(all_keys) - 1, -1, -1):
        ks = all_keys[i]
        out[i] = [later.get(k, INF) for k in ks]
        for k in ks:
            later[k] = i
    return out
