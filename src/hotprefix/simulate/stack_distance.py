"""LRU stack distances: the LRU hit count at every pool capacity from one pass over a trace.

The engine's LRU frees a request's blocks tail first, so a parent is always more recent than its
child and the cached set at capacity C is the top C of one recency stack (Mattson's inclusion
property). A Fenwick tree over recency stamps gives each hit's stack distance in O(log n). Knows
nothing about the pool or the replay; ``sweep`` checks it against one.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Sequence

from hotprefix.cache.hashing import BlockKey
from hotprefix.simulate.traces import TraceRequest, lookup_limit, request_keys


class _Fenwick:
    """Prefix sums over positions 0..n-1 with point updates (a binary indexed tree)."""

    def __init__(self, n: int):
        self.n = n
        self.t = [0] * (n + 1)

    def add(self, i: int, d: int) -> None:
        i += 1
        t, n = self.t, self.n
        while i <= n:
            t[i] += d
            i += i & -i

    def prefix(self, i: int) -> int:
        """Sum of positions < i."""
        s, t = 0, self.t
        while i > 0:
            s += t[i]
            i -= i & -i
        return s


def lru_stack_hits(reqs: Sequence[TraceRequest], block_size: int,
                   keys: Sequence[Sequence[BlockKey]] | None = None) -> list[int]:
    """One pass of LRU stack distances: ``hist[d]`` = prompt blocks that hit at every capacity of
    at least ``d`` blocks (the engine's LRU frees a request tail first, so a parent is always more
    recent than its child and the cached set at capacity C is the top C of one recency stack).

    Exact for capacities no smaller than the largest request and for traces without retention
    controls; ``sweep`` checks it against a full replay."""
    keys = keys if keys is not None else request_keys(reqs, block_size)
    total = sum(math.ceil(r.num_tokens / block_size) for r in reqs) + sum(len(k) for k in keys)
    fw = _Fenwick(total + 1)
    stamp: dict[BlockKey, int] = {}
    hist: dict[int, int] = {}
    phantoms: deque[int] = deque()  # empty slots left by partial blocks, reused first
    t = 0
    live = 0
    for r, ks in zip(reqs, keys):
        lim = lookup_limit(r, len(ks), block_size)
        run = 0
        h = 0
        for j in range(lim):
            s = stamp.get(ks[j])
            if s is None:
                break
            d = live - fw.prefix(s)  # slots at least as recent as this key's
            run = max(run, d)
            hist[run] = hist.get(run, 0) + 1
            h += 1
        n_alloc = math.ceil(r.num_tokens / block_size)
        for _ in range(min(len(phantoms), n_alloc - h)):  # new blocks take the empty slots first
            fw.add(phantoms.popleft(), -1)
            live -= 1
        m = min(len(ks), r.num_tokens // block_size)
        for _ in range(n_alloc - m):  # the partial block: its slot ends up empty, its victim gone
            fw.add(t, 1)
            phantoms.append(t)
            live += 1
            t += 1
        for j in range(m - 1, -1, -1):  # freed tail first: block 0 ends up the most recent
            k = ks[j]
            s = stamp.get(k)
            if s is not None:
                fw.add(s, -1)
            else:
                live += 1
            stamp[k] = t
            fw.add(t, 1)
            t += 1
    if not hist:
        return [0]
    out = [0] * (max(hist) + 1)
    for d, c in hist.items():
        out[d] += c
    return out


def hits_at(hist: Sequence[int], capacity_blocks: int) -> int:
    """LRU hits at a pool of ``capacity_blocks`` blocks, from ``lru_stack_hits``'s histogram."""
    return sum(hist[:capacity_blocks + 1])
