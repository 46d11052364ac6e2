"""Which replica holds which block, in which medium: the router's index, fed by KV events.

``apply`` takes one replica's decoded ``KVEventBatch`` events (``hotprefix.events.schema``, or
vLLM's own structs of the same shape): ``BlockStored`` adds (block hash, medium) for that replica,
``BlockRemoved`` takes it away, ``AllBlocksCleared`` forgets everything the replica held.
``forget`` does the same when a replica leaves the fleet or its event stream had a gap that its
replay could not fill. ``runs`` answers, for a request's block keys, how far each replica's
leading run reaches in its pool and how much further a tier carries it.

A hybrid replica (``cache.kv_groups``: sliding-window layers in groups of their own) names its
window groups' blocks by their chain hash plus ``group_idx`` (vLLM's hybrid events); the index
files them under ``group_key(hash, group)`` and learns each group's window from
``kv_cache_spec_sliding_window``. Its pool run is then where the replica would resume: the longest
n such that the full chain ``0..n-1`` is there and every window group holds the window before n
(``kv_groups.resume_point``, the rule ``WindowGroups.resume`` applies). A replica whose events
carry no group past 0 is scored by its full chain, as before.

Knows nothing about sockets, load or routing policy. Imports no torch.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

from hotprefix.cache.kv_groups import group_key, resume_point
from hotprefix.events.schema import KIND_FULL, KIND_WINDOW, MEDIUM_POOL, SHARED_MEDIA

Holder = Callable[[bytes, str], bool]
"""Extra knowledge (e.g. the router's own decisions): does replica ``r`` hold key ``k`` in its pool?"""


class BlockIndex:
    """block hash -> {replica: set of media}."""

    def __init__(self, shared_media: Iterable[str] = SHARED_MEDIA):
        self.blocks: dict[bytes, dict[str, set[str]]] = {}
        self.shared_media = frozenset(shared_media)
        """Media every replica can load from (a shared Redis/Valkey tier)."""
        self.num_blocks: dict[str, int] = {}
        """Replica -> (block, medium) entries it holds."""
        self.listeners: list[Callable[[str, bytes], None]] = []
        """Called with (replica, key) for every key an event names (the router drops its guesses)."""
        self.windows: dict[str, tuple[int, dict[int, int]]] = {}
        """A hybrid replica -> (its block size, {group past 0: its window in keys, 0: a full
        group}), from its events; kept across its resets (the model stays)."""

    # ------------------------------------------------------------------ updates
    def apply(self, replica: str, events: Sequence[Any]) -> None:
        """Apply one batch's events from ``replica``, in order."""
        for ev in events:
            name = type(ev).__name__
            if name == "BlockStored":
                medium = ev.medium or MEDIUM_POOL
                group = getattr(ev, "group_idx", None) or 0
                if group:
                    self._learn(replica, ev, group)
                for h in ev.block_hashes:
                    self._add(replica, _key(h, group), medium)
            elif name == "BlockRemoved":
                medium = ev.medium or MEDIUM_POOL
                group = getattr(ev, "group_idx", None) or 0
                for h in ev.block_hashes:
                    self._remove(replica, _key(h, group), medium)
            elif name == "AllBlocksCleared":
                self.forget(replica)

    def _learn(self, replica: str, ev: Any, group: int) -> None:
        """A window group's window, from a ``BlockStored`` of it."""
        kind = getattr(ev, "kv_cache_spec_kind", None)
        window = getattr(ev, "kv_cache_spec_sliding_window", None) or 0
        if kind not in (KIND_FULL, KIND_WINDOW, None):
            window = 0  # another kind (chunked local, mamba...): every block is asked for
        self.windows.setdefault(replica, (ev.block_size, {}))[1][group] = window

    def _add(self, replica: str, key: bytes, medium: str) -> None:
        media = self.blocks.setdefault(key, {}).setdefault(replica, set())
        if medium not in media:
            media.add(medium)
            self.num_blocks[replica] = self.num_blocks.get(replica, 0) + 1
        for cb in self.listeners:
            cb(replica, key)

    def _remove(self, replica: str, key: bytes, medium: str) -> None:
        holders = self.blocks.get(key)
        media = holders.get(replica) if holders else None
        if media is not None and medium in media:
            media.discard(medium)
            self.num_blocks[replica] -= 1
            if not media:
                del holders[replica]  # type: ignore[union-attr]
                if not holders:
                    del self.blocks[key]
        for cb in self.listeners:
            cb(replica, key)

    def forget(self, replica: str, groups: bool = False) -> None:
        """Drop every block known of ``replica`` (cleared, gone, or its stream broke); ``groups``:
        its window groups too (it left the fleet)."""
        if groups:
            self.windows.pop(replica, None)
        if not self.num_blocks.pop(replica, 0):
            return
        empty = []
        for key, holders in self.blocks.items():
            if holders.pop(replica, None) is not None and not holders:
                empty.append(key)
        for key in empty:
            del self.blocks[key]

    # ------------------------------------------------------------------ queries
    def holds(self, replica: str, key: bytes, medium: str = MEDIUM_POOL) -> bool:
        holders = self.blocks.get(key)
        return bool(holders) and medium in holders.get(replica, ())  # type: ignore[union-attr]

    def runs(self, keys: Sequence[bytes], replicas: Sequence[str],
             also_holds: Holder | None = None) -> dict[str, tuple[int, int]]:
        """Per replica: ``(pool, tier)``: its pool holds ``keys[:pool]`` and a tier it can load from
        (its own, or a shared one) holds ``keys[pool:pool + tier]``.

        Args:
            also_holds: counts as the replica's pool too (the router's remembered decisions).
        """
        pool_run = {r: 0 for r in replicas}
        active = set(replicas)
        i = 0
        n = len(keys)
        while active and i < n:
            holders = self.blocks.get(keys[i]) or {}
            for r in list(active):
                media = holders.get(r)
                if not ((media is not None and MEDIUM_POOL in media)
                        or (also_holds is not None and also_holds(r, keys[i]))):
                    active.discard(r)
                    pool_run[r] = i
            i += 1
        for r in active:
            pool_run[r] = n
        group_keys: dict[tuple[int, int], bytes] = {}
        for r in replicas:
            if pool_run[r] and r in self.windows:
                pool_run[r] = self._resume(r, keys, pool_run[r], also_holds, group_keys)
        out = {}
        for r in replicas:
            j = pool_run[r]
            while j < n and self._in_tier(r, keys[j]):
                j += 1
            out[r] = (pool_run[r], j - pool_run[r])
        return out

    def _resume(self, replica: str, keys: Sequence[bytes], n_full: int, also_holds: Holder | None,
                group_keys: dict[tuple[int, int], bytes]) -> int:
        """Where hybrid ``replica`` would resume a prompt whose full chain it holds to ``n_full``.

        A window block counts when an event says the replica holds it; where no event has told
        of the block's full-group copy either (the router's remembered decisions only), the
        router's guess is that the replica computed the window too."""
        bs, groups = self.windows[replica]

        def holds(g: int, i: int) -> bool:
            gk = group_keys.get((g, i))
            if gk is None:
                gk = group_keys[(g, i)] = group_key(keys[i], g)
            if self.holds(replica, gk):
                return True
            return (also_holds is not None and not self.holds(replica, keys[i])
                    and also_holds(replica, keys[i]))

        return resume_point(n_full, sorted(groups.items()), bs, holds)

    def _in_tier(self, replica: str, key: bytes) -> bool:
        holders = self.blocks.get(key)
        if not holders:
            return False
        own = holders.get(replica, ())
        if any(m != MEDIUM_POOL for m in own):
            return True
        return any(m in self.shared_media for media in holders.values() for m in media)


def _key(h: bytes | int, group: int = 0) -> bytes:
    """A block hash as bytes (an int hash, from a publisher that sends ints, as 8 big-endian
    bytes); a window group's, tagged with its group (``group_key``: the key the index files it
    under, apart from the full group's block of the same hash)."""
    key = h if isinstance(h, bytes) else int(h).to_bytes(8, "big", signed=False)
    return group_key(key, group) if group else key
