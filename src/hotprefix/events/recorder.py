"""What a block pool gains and loses, as vLLM's KV events: a ``BlockPool`` listener.

The pool calls ``on_stored`` when a block is cached, ``on_removed`` just before a cached block's
key is dropped (eviction), and ``on_cleared`` after ``reset`` (instead of one removal per dropped
block). The recorder keeps a cheap record of each, under a lock (the pool runs on the engine's
thread, the publisher drains from its own), and ``drain`` turns the records into events:

  * consecutive stored blocks that form a chain become one ``BlockStored`` (parent of the first,
    every block's hash, their tokens concatenated), as vLLM sends a request's new blocks;
  * consecutive removals become one ``BlockRemoved`` in the pool's medium; when KV tiers are
    configured they are written through, so an evicted block is still in them: it is reported
    as stored in each tier's medium (``BlockStored`` with medium ``DISK``...) right after;
  * a reset becomes ``AllBlocksCleared`` followed by ``BlockStored`` for the blocks still in the
    pool (those in use survive a reset), so a subscriber's view stays exact. A subscriber forgets
    tier entries at a reset; a block it later reads back into the pool is reported again.

A hybrid pool's window groups (``cache.window_groups``) are announced too, when the recorder is
given their windows: every event then carries its group (``group_idx``; a ``BlockStored`` also
the group's kind and window), window blocks are named by their chain hash as vLLM names them
(``KVBlock.chain``; not the group-tagged key the pool files them under), consecutive stores or
removals of several groups become one event per group (and per chain), and only group 0's
evicted blocks are reported in the tiers' media (the tiers hold group 0's blocks). Without the
windows (a pool of one group) events carry no group fields and window blocks are not announced.

Tier media are hints: a tier's own evictions (its byte budget, a Redis TTL) and writes dropped by
a full queue are not reported. The recorder also emits ``AllBlocksCleared`` first, when it starts.

Knows nothing about sockets or encodings. Imports no torch.
"""

from __future__ import annotations

import threading
from itertools import chain
from typing import Any, Mapping, Sequence

from hotprefix.cache.block import KVBlock
from hotprefix.cache.block_pool import BlockPool
from hotprefix.events.schema import KIND_FULL, KIND_WINDOW, MEDIUM_POOL, EventTypes, event_types

_STORED, _REMOVED, _CLEARED = 0, 1, 2


class PoolEventRecorder:
    """Records a pool's cache changes (``BlockPool.listeners``) and drains them as KV events.

    Args:
        pool: the pool to listen to (the recorder adds itself to ``pool.listeners``).
        tier_media: media of the KV tiers below the pool (``schema.TIER_MEDIA``), fastest first.
        fmt: the events' encoding (``array`` or ``map``): which struct classes ``drain`` builds.
        windows: a hybrid pool's groups past 0 -> their windows in keys (0: a full group), as
            ``WindowGroups`` takes them; None (one group): no group fields, no window blocks.
    """

    def __init__(self, pool: BlockPool, tier_media: Sequence[str] = (), fmt: str = "array",
                 windows: Mapping[int, int] | None = None):
        self.pool = pool
        self.block_size = pool.block_size
        self.types: EventTypes = event_types(fmt)
        self.tier_media = list(dict.fromkeys(tier_media))
        self.specs: dict[int, tuple[str, int | None]] | None = None
        """Group -> (``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``); None: one group."""
        if windows:
            self.specs = {0: (KIND_FULL, None)}
            self.specs.update({g: (KIND_WINDOW, w) if w else (KIND_FULL, None)
                               for g, w in windows.items()})
        self._lock = threading.Lock()
        self._records: list[tuple[Any, ...]] = [(_CLEARED,)]
        self.num_records = 0
        """Records taken so far (stored + removed + cleared), for tests and stats."""
        pool.listeners.append(self)

    # ------------------------------------------------------------------ pool callbacks
    def _record(self, kind: int, b: KVBlock) -> tuple[Any, ...]:
        """(kind, hash, parent hash, tokens, group) of a cached block."""
        if b.group and b.chain is not None:
            key, parent = b.chain  # the chain hash, as vLLM names every group's blocks
        else:
            key, parent = b.key, b.parent
        return (kind, key, None if b.depth == 0 else parent, b.token_ids, b.group)

    def on_stored(self, block: KVBlock) -> None:
        """A block was cached (its key, parent and tokens are set). A window group's block is
        announced only when the recorder knows the groups (``windows``)."""
        if block.group and self.specs is None:
            return
        rec = self._record(_STORED, block)
        with self._lock:
            self._records.append(rec)

    def on_removed(self, block: KVBlock) -> None:
        """A cached block is about to lose its key (it still carries key, parent and tokens)."""
        if block.group and self.specs is None:
            return
        rec = self._record(_REMOVED, block)
        with self._lock:
            self._records.append(rec)

    def on_cleared(self) -> None:
        """The pool was reset: what is still cached is re-announced after the clear."""
        kept = sorted((b for b in self.pool.index.values() if not b.group or self.specs is not None),
                      key=lambda b: (b.group, b.depth))  # parents first
        recs = [self._record(_STORED, b) for b in kept]
        with self._lock:
            self._records.append((_CLEARED,))
            self._records.extend(recs)

    def detach(self) -> None:
        """Stop listening to the pool."""
        if self in self.pool.listeners:
            self.pool.listeners.remove(self)

    # ------------------------------------------------------------------ draining
    def pending(self) -> int:
        """Records not drained yet."""
        return len(self._records)

    def drain(self) -> list[Any]:
        """The events recorded since the last drain, in order (coalesced as the module says)."""
        with self._lock:
            recs, self._records = self._records, []
        self.num_records += len(recs)
        t = self.types
        out: list[Any] = []
        i, n = 0, len(recs)
        while i < n:
            kind = recs[i][0]
            j = i + 1
            while j < n and recs[j][0] == kind and kind != _CLEARED:
                j += 1
            run = recs[i:j]
            if kind == _CLEARED:
                out.append(t.AllBlocksCleared())
                i = j
                continue
            for group, part in _by_group(recs[i:j]):
                if kind == _STORED:
                    out.extend(self._chains(part, MEDIUM_POOL, group))
                    continue
                hashes = [r[1] for r in part]
                if self.specs is None:
                    out.append(t.RemovedOneGroup(hashes, MEDIUM_POOL))
                else:
                    out.append(t.BlockRemoved(hashes, MEDIUM_POOL, group))
                if not group:  # the tiers hold group 0's blocks (write-through)
                    for medium in self.tier_media:
                        out.extend(self._chains(part, medium, group))
            i = j
        return out

    def _chains(self, run: list[tuple[Any, ...]], medium: str, group: int) -> list[Any]:
        """``BlockStored`` events for records ``run`` (all of ``group``): one per maximal chain of
        consecutive blocks."""
        out = []
        start = 0
        for k in range(1, len(run) + 1):
            if k == len(run) or run[k][2] != run[k - 1][1]:
                part = run[start:k]
                fields = ([r[1] for r in part], part[0][2],
                          list(chain.from_iterable(r[3] for r in part)), self.block_size, None,
                          medium, None)
                if self.specs is None:
                    out.append(self.types.StoredOneGroup(*fields))
                else:
                    out.append(self.types.BlockStored(*fields, None, group,
                                                      *self.specs.get(group, (None, None))))
                start = k
        return out


def _by_group(run: list[tuple[Any, ...]]) -> list[tuple[int, list[tuple[Any, ...]]]]:
    """``run``'s records split by group, each in its order, groups in order of first record (a
    window group's blocks are cached block by block between the other groups')."""
    parts: dict[int, list[tuple[Any, ...]]] = {}
    for r in run:
        parts.setdefault(r[4], []).append(r)
    return list(parts.items())
