"""The KV tiers below the pool, fastest first: verified batched reads, background write-through.

``fetch_run`` answers "how many of these blocks, from the first, can be loaded, and their K/V":
one batched round trip per tier for the keys still missing, then every blob is verified
(``blob.decode_blob``: checksum, signature, key, parent, token ids, layout, length) before it
counts; the first block that no tier has, or that fails verification, ends the run, and a bad
entry is deleted and counted. ``store`` queues a block for the background writer, which writes it
to every tier; a full queue drops the write and counts it, never blocking the caller.

A hybrid pool's stack is ``grouped``: an entry holds one part per KV group (``group_blob``), each
verified alone; a bad part of a window group is counted (``corrupt`` / ``bad_signature``) and
left out of the fetched block, while the rest of the block still counts (the entry is kept: its
group-0 part is good).

A tier that fails is degraded (skipped for reads and writes) and retried after ``retry_after_s``;
no call here raises because a tier failed. Blocks served by a slower tier are also queued for the
faster tiers that lacked them (read-through fill), so the next load is served closer.

This module knows nothing about tensors, pools or requests: it moves opaque payload bytes under
block keys. Imports no torch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from hotprefix.cache.tiers.base import PutItem, Tier, TierError, TierOptions, TierTimeout
from hotprefix.cache.tiers.blob import BadSignature, CorruptEntry, decode_blob, encode_blob, storage_key
from hotprefix.cache.tiers.group_blob import decode_groups, encode_groups
from hotprefix.cache.tiers.health import TierHealth
from hotprefix.cache.tiers.registry import make_tier
from hotprefix.cache.tiers.writer import BackgroundWriter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TierEntry:
    """What a lookup wants verified for one block."""

    key: bytes
    """The block's chained key (it already carries the namespace and the tenant salt)."""
    parent: bytes | None
    """The previous block's key (the namespace, or None, for block 0)."""
    token_ids: tuple[int, ...]
    """The block's token ids."""


@dataclass(frozen=True)
class FetchedBlock:
    """One verified block of a fetched run."""

    tier: str
    """Name of the tier that served it (``host``, ``disk``, ``redis``; ``disk2``... for a second
    tier of one kind)."""
    payload: bytes | memoryview
    """The K/V bytes exactly as given to ``store`` (a read-only view into the verified blob);
    in a grouped stack, group 0's page."""
    parts: dict[int, memoryview] = field(default_factory=dict)
    """A grouped stack: group -> page of every other group whose part verified (else empty)."""
    bad: tuple[int, ...] = ()
    """A grouped stack: the groups whose parts failed verification (counted, left out)."""


@dataclass(frozen=True)
class _WriteJob:
    """One blob for the writer: a block to encode, or an already verified blob to copy up."""

    skey: str
    targets: tuple[int, ...]
    """Indexes of the tiers to write."""
    ttl_s: float
    priority: int
    entry: TierEntry | None = None
    payload: bytes | dict[int, bytes] | None = None
    """A block's K/V bytes; in a grouped stack, group -> page."""
    blob: bytes | None = None


class TierStack:
    """The tiers of one engine, fastest first. Thread-safe: any number of threads may fetch while
    the writer thread writes.

    Args:
        urls: tier URLs, fastest first: ``host:8GiB``, ``disk:/path``, ``redis://host:port/db``,
            ``rediss://user:password@host:port/db``.
        layout: the runner's layout tag (dtype, layers, KV heads, head dim, block size); part of
            every storage key and checked inside every blob.
        secret: when set, entries are signed with it (HMAC-SHA256) and unsigned entries, or entries
            signed with another secret, are rejected (a ``str`` is taken as its UTF-8 bytes).
        max_bytes: byte budget of the disk tier(s); None = unbounded.
        timeout_s: socket timeout of network tiers, seconds.
        ttl_s: default expiry of network tier entries, seconds.
        queue_blocks: capacity of the writer's queue, in blocks.
        retry_after_s: how long a failed tier is skipped before it is tried again.
        grouped: entries hold one part per KV group (``group_blob``: a hybrid pool's); payloads
            given to ``store`` are then ``{group: page}`` and ``payload_len`` is one page's size.

    Raises:
        ValueError: a URL or a setting is malformed (a failing tier never raises).
    """

    def __init__(self, urls: list[str], layout: str, *, secret: bytes | None = None,
                 max_bytes: int | None = None, timeout_s: float = 2.0, ttl_s: float = 86400.0,
                 queue_blocks: int = 256, retry_after_s: float = 5.0, grouped: bool = False):
        if timeout_s <= 0 or ttl_s <= 0 or retry_after_s < 0 or queue_blocks < 1:
            raise ValueError("TierStack: timeout_s and ttl_s must be positive, retry_after_s "
                             "non-negative, queue_blocks at least 1")
        if isinstance(secret, str):
            secret = secret.encode()
        if secret is not None and not secret:
            raise ValueError("TierStack: an empty secret signs nothing; pass None for no secret")
        self.layout = layout
        self.grouped = grouped
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s
        self._secret = secret
        options = TierOptions(max_bytes=max_bytes, timeout_s=timeout_s, ttl_s=ttl_s)
        self._tiers: list[Tier] = []
        try:
            for url in urls:
                self._tiers.append(make_tier(url, options))
        except Exception:
            for tier in self._tiers:
                tier.close()
            raise
        self.names: list[str] = []
        """Tier names, fastest first: the kind, numbered from the second of one kind on."""
        for tier in self._tiers:
            n = sum(1 for t in self._tiers[:len(self.names)] if t.kind == tier.kind)
            self.names.append(tier.kind if n == 0 else f"{tier.kind}{n + 1}")
        self._health = [TierHealth(name, retry_after_s) for name in self.names]
        self._writer: BackgroundWriter[_WriteJob] = BackgroundWriter(self._write_batch, queue_blocks)
        self._closed = False

    # ------------------------------------------------------------------ reads
    def fetch_run(self, entries: list[TierEntry], payload_len: int,
                  deadline_s: float | None = None) -> list[FetchedBlock]:
        """The longest verified run of blocks from ``entries[0]``.

        Args:
            entries: the blocks wanted, in order (each one's parent is the previous one's key).
            payload_len: the exact payload size of one block in this layout.
            deadline_s: time budget for the whole call, in seconds from now (None = none). Past
                it, no further tier is asked and the verified run so far is returned. One round
                trip is bounded by ``timeout_s``, not by this budget.

        Returns:
            One ``FetchedBlock`` per block of the run (possibly empty). Never raises because a
            tier failed.
        """
        n = len(entries)
        if n == 0 or not self._tiers:
            return []
        t0 = time.monotonic()
        end = None if deadline_s is None else t0 + deadline_s
        skeys = [storage_key(self.layout, e.key) for e in entries]
        found: list[tuple[int, bytes] | None] = [None] * n
        asked: list[list[int]] = [[] for _ in self._tiers]
        missing = list(range(n))
        for ti, (tier, health) in enumerate(zip(self._tiers, self._health)):
            if not missing:
                break
            if not health.available():
                continue
            if end is not None and time.monotonic() >= end:
                health.count(timeouts=1)
                break
            t = time.monotonic()
            try:
                blobs = tier.get_many([skeys[i] for i in missing])
            except TierError as e:
                health.failed(str(e), timeout=isinstance(e, TierTimeout))
                continue
            health.succeeded()
            health.count(loads=1, load_seconds=time.monotonic() - t)
            asked[ti] = missing
            for i, blob in zip(missing, blobs):
                if blob is not None:
                    found[i] = (ti, blob)
            missing = [i for i in missing if found[i] is None]

        out: list[FetchedBlock] = []
        for i, e in enumerate(entries):
            got = found[i]
            if got is None:
                break
            ti, blob = got
            if end is not None and time.monotonic() >= end:
                self._health[ti].count(timeouts=1)
                break
            t = time.monotonic()
            parts: dict = {}
            bad: list = []
            try:
                if self.grouped:
                    payload, parts, bad = decode_groups(
                        blob, key=e.key, parent=e.parent, token_ids=e.token_ids, layout=self.layout,
                        payload_len=payload_len, secret=self._secret)
                else:
                    payload = decode_blob(blob, key=e.key, parent=e.parent, token_ids=e.token_ids,
                                          layout=self.layout, payload_len=payload_len, secret=self._secret)
            except CorruptEntry as err:
                self._drop_bad(ti, skeys[i], "corrupt", err)
                break
            except BadSignature as err:
                self._drop_bad(ti, skeys[i], "bad_signature", err)
                break
            self._health[ti].count(hit_blocks=1, bytes_read=len(blob), load_seconds=time.monotonic() - t)
            for g, err in bad:  # a window group's part alone: that group's block is not loaded
                self._health[ti].count(**{"bad_signature" if isinstance(err, BadSignature) else "corrupt": 1})
                log.warning("KV tier %s: dropped group %d's part of an entry (%s)", self.names[ti], g, err)
            out.append(FetchedBlock(self.names[ti], payload, parts, tuple(g for g, _ in bad)))
            faster = tuple(tj for tj in range(ti) if i in asked[tj])
            if faster and not bad:
                self._offer(_WriteJob(skeys[i], faster, self.ttl_s, 0, blob=blob))
        last = min(len(out), n - 1)  # the position that ended the run (or the last one)
        for ti, positions in enumerate(asked):
            misses = sum(1 for p in positions if p <= last and (found[p] is None or found[p][0] != ti))
            if misses:
                self._health[ti].count(misses=misses)
        return out

    def _drop_bad(self, ti: int, skey: str, counter: str, err: Exception) -> None:
        """Count a bad entry and delete it from its tier."""
        health = self._health[ti]
        health.count(**{counter: 1})
        log.warning("KV tier %s: deleted a bad entry (%s)", self.names[ti], err)
        try:
            self._tiers[ti].delete(skey)
        except TierError as e:
            health.failed(str(e), timeout=isinstance(e, TierTimeout))

    # ------------------------------------------------------------------ writes
    def store(self, entry: TierEntry, payload: bytes | dict[int, bytes], *, ttl_s: float | None = None,
              priority: int = 0) -> bool:
        """Queue a block for every tier (write-through); never blocks.

        Args:
            entry: the block's key, parent and token ids.
            payload: its K/V bytes (kept as given until written); a grouped stack: group -> page,
                group 0's always.
            ttl_s: a retention pin: network tiers keep the entry ``max(ttl_s, default)`` seconds.
            priority: retention priority; budgeted tiers evict lower priorities first.

        Returns:
            False when the queue was full (the write is dropped and counted at every tier).
        """
        if not self._tiers:
            return True
        ttl = self.ttl_s if ttl_s is None else max(self.ttl_s, float(ttl_s))
        job = _WriteJob(storage_key(self.layout, entry.key), tuple(range(len(self._tiers))), ttl,
                        int(priority), entry=entry, payload=payload)
        return self._offer(job)

    def _offer(self, job: _WriteJob) -> bool:
        if self._writer.offer(job):
            return True
        for ti in job.targets:
            self._health[ti].count(dropped_writes=1)
        return False

    def _write_batch(self, jobs: list[_WriteJob]) -> None:
        """Runs on the writer thread: encode, then one ``put_many`` per tier."""
        items: list[tuple[_WriteJob, PutItem]] = []
        for job in jobs:
            blob = job.blob
            if blob is None:
                e = job.entry
                encode = encode_groups if self.grouped else encode_blob
                blob = encode(e.key, e.parent, e.token_ids, self.layout, job.payload, secret=self._secret)
            items.append((job, PutItem(job.skey, blob, job.ttl_s, job.priority)))
        for ti, (tier, health) in enumerate(zip(self._tiers, self._health)):
            mine = [item for job, item in items if ti in job.targets]
            if not mine:
                continue
            if not health.available():
                health.count(dropped_writes=len(mine))
                continue
            try:
                written = tier.put_many(mine)
            except TierError as e:
                health.failed(str(e), timeout=isinstance(e, TierTimeout))
                health.count(dropped_writes=len(mine))
                continue
            health.succeeded()
            health.count(bytes_written=written)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until the writer's queue is empty; False if ``timeout_s`` passed first."""
        return self._writer.wait_idle(timeout_s)

    def delete(self, key: bytes) -> None:
        """Remove a block's entry from every tier (a failing tier is counted, not raised)."""
        skey = storage_key(self.layout, key)
        for tier, health in zip(self._tiers, self._health):
            try:
                tier.delete(skey)
            except TierError as e:
                health.failed(str(e), timeout=isinstance(e, TierTimeout))

    # ------------------------------------------------------------------ state
    def stats(self) -> dict[str, dict]:
        """Per tier name: ``kind``, ``url`` (no password), the counters of ``TierCounters``
        (``hit_blocks``, ``misses``, ``bytes_read``, ``bytes_written``, ``dropped_writes``,
        ``corrupt``, ``bad_signature``, ``timeouts``, ``errors``, ``load_seconds``, ``loads``),
        ``status`` (``ok``/``degraded``), ``last_error``, ``entries`` and ``bytes`` held (None for a
        shared network tier), ``evictions``."""
        out: dict[str, dict] = {}
        for name, tier, health in zip(self.names, self._tiers, self._health):
            entries, nbytes = tier.usage()
            out[name] = {"kind": tier.kind, "url": tier.url, **health.snapshot(),
                         "entries": entries, "bytes": nbytes, "evictions": tier.evictions}
        return out

    def healthy(self) -> bool:
        """Whether no tier is degraded."""
        return all(h.status == "ok" for h in self._health)

    def close(self) -> None:
        """Write what is queued (for up to ``timeout_s``), stop the writer, release the tiers.
        Writes still queued then are dropped and counted. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for job in self._writer.close(self.timeout_s):
            for ti in job.targets:
                self._health[ti].count(dropped_writes=1)
        for tier in self._tiers:
            tier.close()

    def __enter__(self) -> "TierStack":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TierStack({[t.url for t in self._tiers]!r}, layout={self.layout!r})"


__all__ = ["FetchedBlock", "TierEntry", "TierStack"]
