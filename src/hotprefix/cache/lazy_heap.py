"""A min-heap of small integer ids whose priority can be replaced or removed cheaply.

``heapq`` cannot delete or re-prioritise an entry in the middle of the list, so the pool's pin
expiry, the ``freq`` eviction policy and the simulator's Belady MIN all use the same trick (lazy
deletion): every push carries a per-id version, replacing or removing an id only bumps or clears
its version, and stale entries are skipped when they reach the top. This module holds that trick
once. Knows nothing about blocks or keys. Imports no torch.
"""

from __future__ import annotations

import heapq
from typing import Any


class LazyHeap:
    """Min-heap over ids ``0 .. size-1``; each id has at most one live priority.

    ``push(i, p)`` gives ``i`` the priority ``p`` (replacing any earlier one), ``discard(i)``
    removes it, ``pop()``/``peek()`` give the live id with the smallest ``(priority, id)``. Both
    cost O(log n) amortized; the list is compacted when stale entries outnumber live ones 4 to 1.
    Priorities of different ids must be mutually comparable.
    """

    COMPACT_SLACK = 1024
    """Stale entries tolerated beyond 4x the live ones before the list is rebuilt."""

    def __init__(self, size: int):
        self._ver = [0] * size       # version of id i's live entry
        self._live = [False] * size  # id i has a live entry
        self._num_live = 0
        self._heap: list[tuple[Any, int, int]] = []  # (priority, id, version)

    def __len__(self) -> int:
        """Number of live ids."""
        return self._num_live

    def __contains__(self, i: int) -> bool:
        return self._live[i]

    def push(self, i: int, priority: Any) -> None:
        """Give id ``i`` the priority ``priority``; an earlier entry of ``i`` goes stale."""
        v = self._ver[i] + 1
        self._ver[i] = v
        if not self._live[i]:
            self._live[i] = True
            self._num_live += 1
        heapq.heappush(self._heap, (priority, i, v))
        if len(self._heap) > 4 * self._num_live + self.COMPACT_SLACK:
            self._compact()

    def discard(self, i: int) -> bool:
        """Remove id ``i``; returns whether it was live."""
        if not self._live[i]:
            return False
        self._live[i] = False
        self._ver[i] += 1
        self._num_live -= 1
        return True

    def peek(self) -> tuple[Any, int] | None:
        """``(priority, id)`` of the smallest live entry, or None when empty."""
        heap = self._heap
        while heap:
            p, i, v = heap[0]
            if self._live[i] and self._ver[i] == v:
                return p, i
            heapq.heappop(heap)
        return None

    def pop(self) -> tuple[Any, int]:
        """Remove and return ``(priority, id)`` of the smallest live entry.

        Raises:
            IndexError: the heap has no live entry.
        """
        top = self.peek()
        if top is None:
            raise IndexError("pop from an empty LazyHeap")
        heapq.heappop(self._heap)
        self._live[top[1]] = False
        self._num_live -= 1
        return top

    def clear(self) -> None:
        for _, i, _ in self._heap:
            self._live[i] = False
        self._heap.clear()
        self._num_live = 0

    def ordered(self) -> list[int]:
        """Live ids in pop order (first = next ``pop``); for tests and debugging."""
        return [i for _, i, v in sorted(self._heap) if self._live[i] and self._ver[i] == v]

    def _compact(self) -> None:
        ver, live = self._ver, self._live
        self._heap = [e for e in self._heap if live[e[1]] and ver[e[1]] == e[2]]
        heapq.heapify(self._heap)
