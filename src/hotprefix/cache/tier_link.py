"""Between the pool and the KV tiers: fetch a request's missing prefix blocks from the tiers in the
background, install the verified ones into fresh pool blocks, and write newly cached blocks through.

The flow for one request:
  ``start_fetch``  at arrival: the blocks past the pool's hit run are looked up in the tiers by a
                   worker thread (one batched round trip per tier, every blob verified there);
  ``pending``      while the fetch runs and its deadline has not passed, the scheduler holds the
                   request back (other requests keep stepping); past the deadline it computes;
  ``install``      when the fetch is done: the fetched run that continues the pool's current run
                   is copied into fresh pool blocks and registered as cached, so the ordinary
                   lookup finds it; tokens per source are kept for the cache report;
  ``store``        after a step, blocks that became cached are copied out and queued for the
                   tiers' background writer (dropped and counted when its queue is full).

A hybrid pool (``window_groups``) writes, with each block group 0 caches, every other group's page
of that block the pool holds then (in one entry: ``tiers.group_blob``): all of them, as a chunk's
window blocks are all cached at the commit that caches its group-0 blocks; a window block's
``kept`` status is only known when the request releases it, later, and would cost a second write.
An install then places the group-0 run and, of the window pages that came with it, those of the
windows before the point where the request can resume (``kv_groups.resume_point`` over what the
pool holds and what verified), so the manager's ``WindowGroups.resume`` finds them. When the pool
still holds a prompt's group-0 run but not the windows its end needs (window blocks are the first
thing eviction takes), the fetch also asks for the entries of the window before the run's end
(a second run, so a miss there does not cut the first) and installs their window pages alone.

Moving bytes in and out of pool blocks is the runner's job (``BlockIO``); this module only
knows keys, block ids and bytes. Imports no torch.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from hotprefix.cache.block import AdmitInfo, KVBlock
from hotprefix.cache.block_pool import BlockPool
from hotprefix.cache.hashing import BlockHasher, BlockKey
from hotprefix.cache.kv_groups import group_key, resume_point
from hotprefix.cache.request import CacheRequest
from hotprefix.cache.rules import cacheable_blocks
from hotprefix.cache.tiers import FetchedBlock, TierEntry, TierStack
from hotprefix.cache.window_groups import WindowGroups

log = logging.getLogger(__name__)

FETCH_WORKERS = 2
EWMA = 0.2
"""Weight of the newest measurement in the load and compute speed estimates."""


class PoolOwner(Protocol):
    """What the tier link reads and calls on the cache manager."""

    block_size: int
    pool: BlockPool
    hasher: BlockHasher
    windows: WindowGroups | None

    def keys(self, req: CacheRequest) -> list[BlockKey]: ...

    def pool_run(self, req: CacheRequest) -> list[KVBlock]: ...

    def record_loaded(self, req: CacheRequest, i: int) -> None: ...


class BlockIO(Protocol):
    """Copies the K/V of pool blocks to bytes and back (implemented by the runner): whole-model
    blocks, or a hybrid pool's pages (one group's layers)."""

    layout: str
    payload_len: int

    def read_blocks(self, block_ids: Sequence[int]) -> list[bytes]: ...

    def write_blocks(self, block_ids: Sequence[int], payloads: Sequence[bytes]) -> None: ...


@dataclass
class TierFetch:
    """One request's fetch in flight."""

    start: int
    """Block index of the first block asked for past the pool's run."""
    future: Future
    """Its result: (the window run, the run past the pool's), each a list of ``FetchedBlock``."""
    deadline: float
    """Monotonic time after which the request stops waiting and computes."""
    window_start: int = 0
    """A hybrid pool: the first block of the window run (blocks whose group-0 page the pool
    holds but whose window pages a hit at the run's end needs; == ``start`` when none)."""
    resume_before: int = 0
    """Where the pool alone could resume when the fetch started (a hybrid pool)."""


@dataclass
class TierState:
    """Per request: its fetch and what the tiers supplied."""

    fetch: TierFetch | None = None
    loaded: dict[str, int] = field(default_factory=dict)
    """Blocks installed from each tier for this request."""
    repair: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """Block index -> the groups whose parts of its entry failed verification: once this request
    has cached those groups' blocks, the entry is written again, whole."""


class TierLink:
    """The manager's connection to a ``TierStack`` through a runner's ``BlockIO``."""

    def __init__(self, tiers: TierStack, io: BlockIO, timeout_s: float):
        self.tiers = tiers
        self.io = io
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(FETCH_WORKERS, thread_name_prefix="hotprefix-tier-fetch")
        self._state: dict[str, TierState] = {}
        self.timeouts = 0
        """Fetches that missed their deadline (the request computed instead)."""
        self.skipped_slow = 0
        """Fetches not started because loading was measured slower than computing."""
        self.load_s_per_block: float | None = None
        self.compute_s_per_token: float | None = None

    # ------------------------------------------------------------------ speed estimates
    def observe_compute(self, num_tokens: int, seconds: float) -> None:
        """A forward step of ``num_tokens`` tokens took ``seconds`` (from the engine)."""
        if num_tokens > 0 and seconds > 0:
            self.compute_s_per_token = _ewma(self.compute_s_per_token, seconds / num_tokens)

    def _timed_fetch(self, entries: list[TierEntry]) -> list[FetchedBlock]:
        t0 = time.monotonic()
        out = self.tiers.fetch_run(entries, self.io.payload_len, self.timeout_s)
        if out:
            self.load_s_per_block = _ewma(self.load_s_per_block, (time.monotonic() - t0) / len(out))
        return out

    def worth_loading(self, num_blocks: int, block_size: int) -> bool:
        """Whether reading ``num_blocks`` is expected to beat computing them (True until both
        speeds were measured)."""
        if self.load_s_per_block is None or self.compute_s_per_token is None:
            return True
        return self.load_s_per_block < self.compute_s_per_token * block_size

    # ------------------------------------------------------------------ reads
    def start_fetch(self, m: PoolOwner, req: CacheRequest) -> None:
        """Look up the blocks past the pool's current hit run in the tiers, in the background;
        on a hybrid pool whose windows end before that run does, also the window blocks before
        the run's end (``_window_run``)."""
        if req.request_id in self._state:
            return
        st = self._state[req.request_id] = TierState()
        keys = m.keys(req)
        limit = min(len(keys), cacheable_blocks(req.num_prompt_tokens, m.block_size))
        start = len(m.pool_run(req))
        wstart, resume = self._window_run(m, req, keys, start)
        if start >= limit and wstart >= start:
            return
        bs = m.block_size
        if not self.worth_loading(max(0, limit - start) + start - wstart, bs):
            self.skipped_slow += 1
            return

        def entries(lo: int, hi: int) -> list[TierEntry]:
            return [TierEntry(keys[i], keys[i - 1] if i else m.hasher.namespace,
                              tuple(req.token_ids[i * bs:(i + 1) * bs])) for i in range(lo, hi)]
        deadline = time.monotonic() + self.timeout_s
        fut = self._pool.submit(self._fetch_runs, entries(wstart, start), entries(start, limit))
        st.fetch = TierFetch(start, fut, deadline, wstart, resume)

    @staticmethod
    def _window_run(m: PoolOwner, req: CacheRequest, keys: Sequence[BlockKey], run: int
                    ) -> tuple[int, int]:
        """(first block of the window run, where the pool alone resumes). The pool holds the
        group-0 run ``0..run-1`` but its windows let a hit resume only at an earlier kept point:
        the tier entries of the window a hit at ``run`` reads carry those window pages (none:
        ``(run, run)``)."""
        w = m.windows
        if w is None or not run:
            return run, run
        resume = w.resume(keys, req.token_ids, run)
        return (run, run) if resume == run else (max(resume, w.first_needed(run * m.block_size)), resume)

    def _fetch_runs(self, window: list[TierEntry], tail: list[TierEntry]
                    ) -> tuple[list[FetchedBlock], list[FetchedBlock]]:
        """Two verified runs: the window run's and the one past the pool's (a miss in one does
        not cut the other)."""
        return (self._timed_fetch(window) if window else [],
                self._timed_fetch(tail) if tail else [])

    def pending(self, req: CacheRequest) -> bool:
        """Whether the request should wait for its fetch (running and within its deadline)."""
        st = self._state.get(req.request_id)
        if st is None or st.fetch is None or st.fetch.future.done():
            return False
        if time.monotonic() < st.fetch.deadline:
            return True
        st.fetch.future.cancel()
        st.fetch = None
        self.timeouts += 1
        return False

    def wait_any(self, timeout_s: float) -> bool:
        """Block until one of the fetches in flight ends (or ``timeout_s``); False if none runs."""
        futures = [st.fetch.future for st in self._state.values()
                   if st.fetch is not None and not st.fetch.future.done()]
        if not futures:
            return False
        wait(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)
        return True

    def install(self, m: PoolOwner, req: CacheRequest) -> None:
        """Copy a finished fetch's run into fresh pool blocks (once); a failed fetch is ignored."""
        st = self._state.get(req.request_id)
        if st is None or st.fetch is None or not st.fetch.future.done():
            return
        fetch, st.fetch = st.fetch, None
        try:
            wfetched, fetched = fetch.future.result()
        except Exception as e:  # a tier bug must not fail the request: compute instead
            log.warning("tier fetch failed: %s", e)
            return
        if not fetched and not wfetched:
            return
        keys = m.keys(req)
        bs = m.block_size
        ahead = max(0, len(m.pool_run(req)) - fetch.start)  # cached meanwhile by another request
        want = max(0, len(fetched) - ahead)
        new = (m.pool.allocate(min(want, m.pool.num_free)) or []) if want else []
        run = len(m.pool_run(req))  # after allocating: an eviction may have shortened the run
        skip = run - fetch.start
        use = fetched[skip:] if 0 <= skip < len(fetched) else []
        use = use[:len(new)]
        ids, payloads, placed = [], [], []
        pages: dict[int, dict[int, memoryview]] = {}
        for j, fb in enumerate(wfetched):  # window pages of blocks whose group-0 page the pool holds
            i = fetch.window_start + j
            if i >= run:
                break
            if fb.parts:
                pages[i] = fb.parts
            if fb.bad:
                st.repair[i] = fb.bad
        for j, (blk, fb) in enumerate(zip(new, use)):
            i = run + j
            if keys[i] in m.pool.index:  # cached meanwhile by another request
                break
            ids.append(blk.block_id)
            payloads.append(fb.payload)
            placed.append((i, blk, fb.tier))
            if fb.parts:
                pages[i] = fb.parts
            if fb.bad:
                st.repair[i] = fb.bad
        if ids:
            self.io.write_blocks(ids, payloads)
        for i, blk, tier in placed:
            toks = req.token_ids[i * bs:(i + 1) * bs]
            info = AdmitInfo(depth=i, parent=keys[i - 1] if i else m.hasher.namespace,
                             priority=req.priority if req.retains(i) else 0,
                             salt=req.salt if i == req.salt_from_block else None)
            if not m.pool.cache_block(blk, keys[i], toks, info):
                break
            st.loaded[tier] = st.loaded.get(tier, 0) + 1
            m.record_loaded(req, i)
        held = self._install_windows(m, req, keys, pages) if m.windows is not None and pages else []
        m.pool.free(new)  # installed blocks become free-and-cached, the rest empty again
        m.pool.free(held)  # after the full blocks they make reachable (as ``manager.free``)
        if held and wfetched:  # the blocks the window run moved the resume point over
            assert m.windows is not None
            now = m.windows.resume(keys, req.token_ids, len(m.pool_run(req)))
            gained = max(0, min(now, fetch.start) - fetch.resume_before)
            if gained:
                tier = wfetched[0].tier
                st.loaded[tier] = st.loaded.get(tier, 0) + gained

    def _install_windows(self, m: PoolOwner, req: CacheRequest, keys: Sequence[BlockKey],
                         pages: dict[int, dict[int, memoryview]]) -> list[KVBlock]:
        """Place the fetched window pages of the windows before the resume point the pool and
        ``pages`` allow; returns the blocks taken (the caller frees them, cached)."""
        w = m.windows
        assert w is not None
        bs = m.block_size
        index = m.pool.index

        def holds(g: int, i: int) -> bool:
            return group_key(keys[i], g) in index or g in pages.get(i, ())

        n = resume_point(len(m.pool_run(req)), zip(w.groups, w.windows), bs, holds)
        want = [(g, i) for g, win in zip(w.groups, w.windows) for i in w.window_blocks(n, win)
                if g in pages.get(i, ()) and group_key(keys[i], g) not in index]
        if not want:
            return []
        blocks = m.pool.allocate(min(len(want), m.pool.num_free)) or []
        want = want[:len(blocks)]
        self.io.write_blocks([b.block_id for b in blocks], [pages[i][g] for g, i in want])
        for b, (g, i) in zip(blocks, want):
            salt = req.salt if i == req.salt_from_block else None
            if group_key(keys[i], g) in index or not w.cache_block(
                    b, keys, req.token_ids[i * bs:(i + 1) * bs], i, g, salt):
                b.group, b.chain = 0, None  # freed empty
                continue
            b.kept = True  # the window before the point this request resumes at
        return blocks

    def sources(self, req: CacheRequest, cached_blocks: int, block_size: int) -> dict[str, int]:
        """Prompt tokens served from cache, by where they came from (``pool`` first)."""
        st = self._state.get(req.request_id)
        loaded = dict(st.loaded) if st is not None else {}
        from_tiers = min(sum(loaded.values()), cached_blocks)
        out = {"pool": (cached_blocks - from_tiers) * block_size}
        for t, n in loaded.items():  # a hit shorter than the loaded run (a hybrid pool resumed
            n = min(n, from_tiers)   # earlier) counts only the loaded blocks it covers
            from_tiers -= n
            out[t] = n * block_size
        return out

    def forget(self, req: CacheRequest) -> None:
        st = self._state.pop(req.request_id, None)
        if st is not None and st.fetch is not None:
            st.fetch.future.cancel()

    # ------------------------------------------------------------------ writes
    def store(self, m: PoolOwner, req: CacheRequest, placed: list[tuple[int, KVBlock]]) -> None:
        """Queue blocks that this step cached for the tiers (write-through), and the loaded
        blocks whose entries lacked a bad part that the pool now holds (``TierState.repair``)."""
        st = self._state.get(req.request_id)
        if st is not None and st.repair:
            placed = placed + self._repairs(m, req, st)
        if not placed:
            return
        keys = m.keys(req)
        bs = m.block_size
        payloads = self._payloads(m, keys, placed)
        for (i, blk), payload in zip(placed, payloads):
            entry = TierEntry(keys[i], keys[i - 1] if i else m.hasher.namespace,
                              tuple(req.token_ids[i * bs:(i + 1) * bs]))
            own = req.retains(i)
            ttl = req.pin_ttl_for((i + 1) * bs) if own else 0.0
            self.tiers.store(entry, payload, ttl_s=ttl or None, priority=req.priority if own else 0)

    @staticmethod
    def _repairs(m: PoolOwner, req: CacheRequest, st: TierState) -> list[tuple[int, KVBlock]]:
        keys = m.keys(req)
        out = []
        for i, groups in list(st.repair.items()):
            blk = m.pool.index.get(keys[i])
            if blk is None:  # evicted meanwhile: nothing to write it from
                del st.repair[i]
            elif all(group_key(keys[i], g) in m.pool.index for g in groups):
                del st.repair[i]
                out.append((i, blk))
        return out

    def _payloads(self, m: PoolOwner, keys: Sequence[BlockKey], placed: list[tuple[int, KVBlock]]
                  ) -> list[bytes] | list[dict[int, bytes]]:
        """Per placed block, its K/V bytes; a hybrid pool's: group -> page, of every group the
        pool holds the block of now (group 0's always), read in one copy."""
        if m.windows is None:
            return self.io.read_blocks([blk.block_id for _, blk in placed])
        owners: list[tuple[int, int]] = []
        ids: list[int] = []
        for j, (i, blk) in enumerate(placed):
            owners.append((j, 0))
            ids.append(blk.block_id)
            for g in m.windows.groups:
                b = m.pool.index.get(group_key(keys[i], g))
                if b is not None:
                    owners.append((j, g))
                    ids.append(b.block_id)
        out: list[dict[int, bytes]] = [{} for _ in placed]
        for (j, g), page in zip(owners, self.io.read_blocks(ids)):
            out[j][g] = page
        return out

    def stats(self, block_size: int) -> dict[str, dict]:
        """Per tier: the stack's counters, ``hit_tokens``, and the link's own counters."""
        link = {"fetch_timeouts": self.timeouts, "fetches_skipped_slow": self.skipped_slow,
                "load_ms_per_block": None if self.load_s_per_block is None else self.load_s_per_block * 1e3,
                "compute_ms_per_block": None if self.compute_s_per_token is None
                else self.compute_s_per_token * block_size * 1e3}
        return {name: {**s, "hit_tokens": s.get("hit_blocks", 0) * block_size, **link}
                for name, s in self.tiers.stats().items()}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.tiers.close()


__all__ = ["BlockIO", "PoolOwner", "TierLink"]


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - EWMA) * old + EWMA * new
