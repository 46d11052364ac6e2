"""Eviction order of a byte-budgeted tier: lowest retention priority first, then least recently
read or written.

Only sizes, priorities and recency of storage keys live here; the tier holding the bytes removes
what ``victims`` names. Not thread-safe by itself: its tier calls it under the tier's lock.
Imports no torch.
"""

from __future__ import annotations

from collections import OrderedDict


class PriorityLRU:
    """Sizes of entries, kept in eviction order."""

    def __init__(self, max_bytes: int | None):
        self.max_bytes = max_bytes
        """Budget in bytes; None = unbounded."""
        self.nbytes = 0
        """Sum of the sizes of the entries."""
        self._where: dict[str, tuple[int, int]] = {}  # key -> (priority, size)
        self._by_priority: dict[int, OrderedDict[str, None]] = {}  # oldest first

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def priority(self, key: str) -> int | None:
        got = self._where.get(key)
        return None if got is None else got[0]

    def add(self, key: str, size: int, priority: int = 0) -> None:
        """Insert or replace an entry as the most recently used of its priority."""
        self.remove(key)
        self._where[key] = (priority, size)
        self._by_priority.setdefault(priority, OrderedDict())[key] = None
        self.nbytes += size

    def touch(self, key: str) -> None:
        """Mark an entry as just read."""
        got = self._where.get(key)
        if got is not None:
            self._by_priority[got[0]].move_to_end(key)

    def remove(self, key: str) -> int:
        """Forget an entry; returns its size (0 when absent)."""
        got = self._where.pop(key, None)
        if got is None:
            return 0
        priority, size = got
        ring = self._by_priority[priority]
        del ring[key]
        if not ring:
            del self._by_priority[priority]
        self.nbytes -= size
        return size

    def fits(self, size: int) -> bool:
        return self.max_bytes is None or size <= self.max_bytes

    def victims(self, size: int, priority: int) -> list[str] | None:
        """Entries to remove (in order) so that a new entry of ``size`` bytes and ``priority``
        fits the budget, or None when it should not be admitted: it is larger than the budget, or
        only entries of a higher priority could make room (the new one would be the first to go).
        Nothing is removed here."""
        if self.max_bytes is None:
            return []
        if size > self.max_bytes:
            return None
        need = self.nbytes + size - self.max_bytes
        out: list[str] = []
        for p in sorted(self._by_priority):
            if need <= 0:
                break
            if p > priority:
                return None
            for key in self._by_priority[p]:
                if need <= 0:
                    break
                out.append(key)
                need -= self._where[key][1]
        return out if need <= 0 else None


__all__ = ["PriorityLRU"]
