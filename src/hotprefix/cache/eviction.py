"""Eviction policies: which free-and-cached block gives up its K/V when the pool needs a block.

A policy only sees block events and keeps its own ordering of the *evictable* blocks (refcount 0,
still in the cache index). The pool owns the index and the refcounts; the policy never frees or
registers blocks itself. Policies are found by name in ``POLICIES`` (``@register``).

Invariant the pool relies on: after ``on_free(b)`` and until ``on_use(b)``/``evict()``/``on_removed(b)``,
``b`` is in the policy's evictable set exactly once; ``len(policy)`` is that set's size.

Imports no torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from hotprefix.cache.block_pool import AdmitInfo, KVBlock

POLICIES: dict[str, type["EvictionPolicy"]] = {}


def register(cls: type["EvictionPolicy"]) -> type["EvictionPolicy"]:
    POLICIES[cls.name] = cls
    return cls


def make_policy(name: str, num_blocks: int) -> "EvictionPolicy":
    try:
        return POLICIES[name](num_blocks)
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None


class EvictionPolicy(ABC):
    """Orders evictable blocks. One instance per pool."""

    name: ClassVar[str]

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks

    def admit(self, info: "AdmitInfo") -> bool:
        """Asked before a newly computed full block is registered; False keeps it uncached."""
        return True

    def on_cached(self, block: "KVBlock", info: "AdmitInfo") -> None:
        """A block was registered in the cache index (it is in use at this moment)."""

    def on_hit(self, block: "KVBlock") -> None:
        """A cached block was matched by a request's prefix lookup."""

    @abstractmethod
    def on_free(self, block: "KVBlock") -> None:
        """The block's refcount dropped to 0 while cached: it is now evictable."""

    @abstractmethod
    def on_use(self, block: "KVBlock") -> None:
        """An evictable block is in use again: it must leave the evictable set."""

    @abstractmethod
    def evict(self) -> "KVBlock":
        """Remove and return the victim. Only called when ``len(self) > 0``."""

    def on_removed(self, block: "KVBlock") -> None:
        """The block left the evictable set without being chosen (cache reset)."""
        self.on_use(block)

    @abstractmethod
    def __len__(self) -> int:
        """Number of evictable blocks."""


@register
class LRUPolicy(EvictionPolicy):
    """Least recently freed first. The pool frees a request's blocks tail first, so among the
    blocks of one request the descendants go before their ancestors."""

    name = "lru"

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self._queue: OrderedDict[int, "KVBlock"] = OrderedDict()

    def on_free(self, block: "KVBlock") -> None:
        self._queue[block.block_id] = block

    def on_use(self, block: "KVBlock") -> None:
        self._queue.pop(block.block_id, None)

    def evict(self) -> "KVBlock":
        return self._queue.popitem(last=False)[1]

    def __len__(self) -> int:
        return len(self._queue)

    def order(self) -> list[int]:
        """Block ids in eviction order (first = next victim); for tests and debugging."""
        return list(self._queue)
