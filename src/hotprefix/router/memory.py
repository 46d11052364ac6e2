"""A bounded map with a time to live: the router's memory of its own decisions.

Used twice by the router: (block key, replica) for every block it sent to a replica (the fallback
that gives affinity when KV events are off, late or dropped: a block shared by many conversations
is remembered for every replica it went to), and ``prompt_cache_key`` -> replica.
The oldest entries go first when it is full; an entry older than ``ttl_s`` reads as absent.
Imports no torch.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class TtlMap(Generic[K, V]):
    """key -> value, each entry valid for ``ttl_s`` after it was last set; at most ``max_entries``."""

    def __init__(self, ttl_s: float, max_entries: int):
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._d: OrderedDict[K, tuple[V, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._d)

    def set(self, key: K, value: V, now: float) -> None:
        d = self._d
        if key in d:
            d.move_to_end(key)
        d[key] = (value, now + self.ttl_s)
        while len(d) > self.max_entries:
            d.popitem(last=False)

    def get(self, key: K, now: float) -> V | None:
        hit = self._d.get(key)
        if hit is None:
            return None
        if hit[1] <= now:
            del self._d[key]
            return None
        return hit[0]

    def discard(self, key: K, value: V | None = None) -> None:
        """Drop ``key`` (only when it maps to ``value``, if given)."""
        hit = self._d.get(key)
        if hit is not None and (value is None or hit[0] == value):
            del self._d[key]

    def discard_if(self, pred: Callable[[K, V], bool]) -> None:
        """Drop every entry for which ``pred(key, value)`` holds (e.g. those of a replica that left)."""
        for k in [k for k, (v, _) in self._d.items() if pred(k, v)]:
            del self._d[k]
