"""``host:SIZE`` — blobs in this process's RAM, within a byte budget (``host:8GiB``).

Useful below a device pool: a block evicted from GPU memory is read back from host RAM instead of
being recomputed. Lost when the process ends. Eviction: lowest priority first, then least recently
read or written. Imports no torch.
"""

from __future__ import annotations

import threading
from typing import Sequence

from hotprefix.cache.tiers.base import PutItem, Tier, TierOptions, register
from hotprefix.cache.tiers.lru import PriorityLRU
from hotprefix.config.sections import ConfigError, parse_bytes


@register("host")
class HostTier(Tier):
    """In-process RAM, LRU by bytes. Thread-safe."""

    kind = "host"

    def __init__(self, url: str, max_bytes: int):
        super().__init__(url)
        self._lock = threading.Lock()
        self._blobs: dict[str, bytes] = {}
        self._order = PriorityLRU(max_bytes)

    @classmethod
    def from_url(cls, url: str, options: TierOptions) -> "HostTier":
        size = url.partition(":")[2]
        try:
            return cls(url, parse_bytes(size))
        except ConfigError as e:
            raise ValueError(f"host tier {url!r}: {e}") from None

    def get_many(self, skeys: Sequence[str]) -> list[bytes | None]:
        with self._lock:
            out = [self._blobs.get(k) for k in skeys]
            for k, b in zip(skeys, out):
                if b is not None:
                    self._order.touch(k)
            return out

    def put_many(self, items: Sequence[PutItem]) -> int:
        written = 0
        with self._lock:
            for it in items:
                self._remove(it.skey)
                victims = self._order.victims(len(it.blob), it.priority)
                if victims is None:
                    self.evictions += 1
                    continue
                for k in victims:
                    self._remove(k)
                    self.evictions += 1
                self._blobs[it.skey] = it.blob
                self._order.add(it.skey, len(it.blob), it.priority)
                written += len(it.blob)
        return written

    def delete(self, skey: str) -> None:
        with self._lock:
            self._remove(skey)

    def _remove(self, skey: str) -> None:
        self._blobs.pop(skey, None)
        self._order.remove(skey)

    def usage(self) -> tuple[int | None, int | None]:
        with self._lock:
            return len(self._order), self._order.nbytes

    def close(self) -> None:
        with self._lock:
            self._blobs.clear()
            self._order = PriorityLRU(self._order.max_bytes)


__all__ = ["HostTier"]
