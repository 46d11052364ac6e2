"""Replay a trace through the real prefix cache, one request at a time, and the infinite-cache
ceiling.

Each request goes through the same ``KVCacheManager`` / ``BlockPool`` / eviction policy the engine
uses (lookup -> allocate -> commit -> free) at a given pool capacity, with its tokens (real or
synthetic, ``traces``) hashed by the manager as a live request's are; optionally a simulated store
tier below the pool (``tier``). ``SimResult`` counts block and token hits (by tier), evictions and
the requests that hit nothing. Knows nothing about trace files, sweeps or the command line.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from hotprefix.cache.eviction import EvictionPolicy
from hotprefix.cache.hashing import BlockKey
from hotprefix.cache.kv_groups import GroupLayout
from hotprefix.cache.ledger import ContentLedger
from hotprefix.cache.manager import CacheRequest, KVCacheManager
from hotprefix.cache.window_groups import WindowGroups
from hotprefix.config.sections import CacheConfig, SchedulerConfig
from hotprefix.simulate.min_policy import MinPolicy, next_uses
from hotprefix.simulate.pool import pool_blocks, sim_pool
from hotprefix.simulate.tier import TIER_NAME, StoreTier
from hotprefix.simulate.traces import TraceRequest, lookup_limit, request_keys, sim_hasher


@dataclass
class SimResult:
    """What one replay measured."""

    policy: str
    """Eviction policy name (``min``, ``ceiling`` or a registered one)."""
    capacity_tokens: int
    """Pool capacity replayed (for the ceiling: the tokens it would need to hold everything)."""
    block_size: int
    """Tokens per block."""
    num_requests: int = 0
    """Requests replayed."""
    prompt_blocks: int = 0
    """Full prompt blocks over all requests."""
    hit_blocks: int = 0
    """Prompt blocks served from cache (the pool and the store tier)."""
    store_hit_blocks: int = 0
    """Of ``hit_blocks``: those the store tier served (pool misses it held)."""
    prompt_tokens: int = 0
    """Prompt tokens over all requests."""
    hit_tokens: int = 0
    """Prompt tokens served from cache."""
    evictions: int = 0
    """Cached blocks evicted."""
    written_blocks: int = 0
    """Blocks added to the cache."""
    zero_hit_requests: int = 0
    """Requests that hit no block."""
    truncated_requests: int = 0
    """Requests larger than the pool: only what fits was written."""
    seconds: float = 0.0
    """Wall time of the replay."""
    per_request_hits: list[int] = field(default_factory=list)
    """Hit blocks of each request, all tiers (filled with ``keep_per_request``)."""
    store: StoreTier | None = None
    """The simulated store tier below the pool, or None."""

    @property
    def block_hit_ratio(self) -> float:
        return self.hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    @property
    def token_hit_ratio(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def add_request(self, r: TraceRequest, hit_blocks: int, store_hit_blocks: int = 0) -> None:
        """Count one replayed request that hit its first ``hit_blocks`` blocks, of which the last
        ``store_hit_blocks`` came from the store tier."""
        self.num_requests += 1
        self.prompt_blocks += r.num_prompt_tokens // self.block_size
        self.hit_blocks += hit_blocks
        self.store_hit_blocks += store_hit_blocks
        self.prompt_tokens += r.num_prompt_tokens
        self.hit_tokens += hit_blocks * self.block_size
        self.zero_hit_requests += hit_blocks == 0

    def by_tier(self) -> dict[str, int]:
        """Hit blocks by where they came from: ``pool``, and ``store`` when there is one."""
        out = {"pool": self.hit_blocks - self.store_hit_blocks}
        if self.store is not None:
            out[TIER_NAME] = self.store_hit_blocks
        return out

    def to_json(self) -> dict[str, Any]:
        tiers = self.by_tier()
        bs = self.block_size
        out = {
            "policy": self.policy, "capacity_tokens": self.capacity_tokens,
            "block_size": self.block_size, "num_blocks": self.capacity_tokens // self.block_size,
            "block_hit_ratio": round(self.block_hit_ratio, 6),
            "token_hit_ratio": round(self.token_hit_ratio, 6),
            "requests": self.num_requests, "zero_hit_requests": self.zero_hit_requests,
            "zero_hit_request_ratio": round(self.zero_hit_requests / max(1, self.num_requests), 6),
            "prompt_blocks": self.prompt_blocks, "hit_blocks": self.hit_blocks,
            "prompt_tokens": self.prompt_tokens, "hit_tokens": self.hit_tokens,
            "evictions": self.evictions, "written_blocks": self.written_blocks,
            "truncated_requests": self.truncated_requests, "seconds": round(self.seconds, 3),
            "hit_blocks_by_tier": tiers,
            "hit_tokens_by_tier": {k: n * bs for k, n in tiers.items()},
            "block_hit_ratio_by_tier": {k: round(n / max(1, self.prompt_blocks), 6)
                                        for k, n in tiers.items()},
            "token_hit_ratio_by_tier": {k: round(n * bs / max(1, self.prompt_tokens), 6)
                                        for k, n in tiers.items()},
        }
        if self.store is not None:
            s = self.store
            out["kv_store"] = {"capacity_tokens": s.capacity_tokens, "num_blocks": s.num_blocks,
                               "written_blocks": s.written_blocks, "evictions": s.evictions}
        return out


class _Clock:
    """The pool's clock during a replay: the current request's timestamp."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def default_policy() -> str:
    """The engine's default eviction policy (``CacheConfig.eviction_policy``)."""
    return CacheConfig.eviction_policy


def replay(reqs: Sequence[TraceRequest], capacity_tokens: int, policy: str | None = None,
           block_size: int = CacheConfig.block_size, admission_tail_tokens: int | None = None,
           max_pinned_fraction: float = 0.5, keep_per_request: bool = False,
           keys: Sequence[Sequence[BlockKey]] | None = None,
           kv_store_capacity_tokens: int | None = None,
           layout: GroupLayout | None = None) -> SimResult:
    """Replay ``reqs`` one at a time through a real ``KVCacheManager`` of ``capacity_tokens``.

    Every request carries its tokens (synthetic for traces of ids); the manager hashes them, or
    takes the prompt's keys from ``keys`` when given (the same hasher's keys of the same tokens).

    Args:
        policy: a name in the engine's ``POLICIES``, or ``min`` (Belady); None = the engine default.
        keys: precomputed ``request_keys`` (needed by ``min``, computed if omitted; saves hashing).
        kv_store_capacity_tokens: a simulated store tier of this many tokens below the pool
            (``tier.StoreTier``): written through, serves the pool's misses it holds.
        layout: a hybrid pool's KV groups (``kv_groups.parse_layer_mix``): the same bytes as
            ``capacity_tokens`` of whole-model blocks, in pages of the groups' layers, with
            the engine's window groups (``window_groups``); each request runs in the engine's
            chunks (``SchedulerConfig.prefill_chunk``) so its window groups release as it goes.
    Returns:
        the measured ``SimResult`` (``per_request_hits`` filled when ``keep_per_request``).
    """
    policy = policy or default_policy()
    if policy == "min" and keys is None:
        keys = request_keys(reqs, block_size)
    num_blocks = pool_blocks(reqs, capacity_tokens, block_size, keys)
    nu: list[list[int]] | None = None
    min_pol: MinPolicy | None = None
    pol: str | EvictionPolicy = policy
    if policy == "min":
        nu = next_uses(keys)  # type: ignore[arg-type]
        pol = min_pol = MinPolicy(num_blocks)
    clock = _Clock()
    hybrid = layout is not None and layout.hybrid
    if hybrid:
        if policy == "min":
            raise ValueError("Belady's min is not defined over a hybrid pool's groups")
        num_blocks = layout.pages_for_blocks(num_blocks)
    pool = sim_pool(num_blocks, capacity_tokens, block_size, pol, clock, max_pinned_fraction)
    if min_pol is not None:
        min_pol.index = pool.index
    # max_depth=0: no content records (the ledger serves miss reports, which a replay never asks)
    mgr = KVCacheManager(pool, sim_hasher(block_size), True,
                         ledger=ContentLedger(max_entries=1, max_depth=0),
                         admission_tail_tokens=admission_tail_tokens)
    if hybrid:
        if kv_store_capacity_tokens:
            raise ValueError("a store tier holds whole-model blocks: not with a hybrid pool")
        mgr.windows = WindowGroups(pool, block_size,
                                   {g: grp.window for g, grp in enumerate(layout.groups) if g})
    store = StoreTier(kv_store_capacity_tokens, block_size) if kv_store_capacity_tokens else None
    res = SimResult(policy, capacity_tokens, block_size, store=store)
    t0 = time.perf_counter()
    bs = block_size
    for i, r in enumerate(reqs):
        clock.t = r.timestamp
        tokens = r.tokens(bs)
        n_prompt = r.num_prompt_tokens
        # at admission the request holds its prompt; the computed output joins it before commit
        creq = CacheRequest(str(i), tokens[:n_prompt] if len(tokens) > n_prompt else tokens, n_prompt,
                            cache_write=r.cache_write, priority=r.priority, pin_ttl_s=r.pin_ttl_s,
                            block_keys=list(keys[i][:n_prompt // bs]) if keys is not None else [])
        if min_pol is not None:
            min_pol.begin(keys[i], nu[i])  # type: ignore[index]
        hits = mgr.lookup(creq)
        h = len(hits)
        if hybrid:
            if len(creq.token_ids) < len(tokens):
                creq.token_ids.extend(tokens[len(creq.token_ids):])
            res.truncated_requests += not _run_chunked(mgr, creq, hits, r.num_tokens)
            mgr.free(creq)
            res.add_request(r, h, 0)
            if keep_per_request:
                res.per_request_hits.append(h)
            continue
        s = 0
        if store is not None:  # the pool's miss, looked up in the store: its run is loaded
            prompt_keys = mgr.keys(creq)
            s = store.serve(prompt_keys, h, lookup_limit(r, len(prompt_keys), bs))
        n_tokens = r.num_tokens
        free = mgr.num_free_after(hits)
        if math.ceil(n_tokens / bs) - h > free:  # larger than the pool: write what fits
            n_tokens = (h + free) * bs
            res.truncated_requests += 1
            s = min(s, n_tokens // bs - h)
        if not mgr.allocate(creq, n_tokens - h * bs, h * bs, hits):
            raise RuntimeError(f"request {i}: the pool refused {n_tokens} tokens")
        if len(creq.token_ids) < len(tokens):
            creq.token_ids.extend(tokens[len(creq.token_ids):])
        mgr.commit(creq, n_tokens)  # blocks loaded from the store are cached like computed ones
        if store is not None:  # write-through of every block the pool cached now
            blocks = pool.blocks
            store.write([k for b in mgr.block_table(creq.request_id)[h:]
                         if (k := blocks[b].key) is not None])
        mgr.free(creq)
        res.add_request(r, h + s, s)
        if keep_per_request:
            res.per_request_hits.append(h + s)
    res.evictions = pool.num_evictions
    res.written_blocks = mgr.stats.written_blocks
    res.seconds = time.perf_counter() - t0
    return res


def _run_chunked(mgr: KVCacheManager, creq: CacheRequest, hits: list, n_tokens: int) -> bool:
    """A request's tokens through a hybrid pool chunk by chunk, as the scheduler runs them (its
    window groups hold only the window as it goes). False when the pool ran out (what was
    computed stays committed)."""
    bs = mgr.block_size
    done = len(hits) * bs
    chunk = SchedulerConfig().prefill_chunk(True, bs)
    first = True
    while done < n_tokens:
        n = min(chunk, n_tokens - done)
        if not mgr.allocate(creq, n, done, hits if first else []):
            return False
        first = False
        done += n
        mgr.commit(creq, done)
    return True


def ceiling(reqs: Sequence[TraceRequest], block_size: int,
            keys: Sequence[Sequence[BlockKey]] | None = None) -> SimResult:
    """The infinite-cache ceiling: every written block stays forever (no pool needed)."""
    keys = keys if keys is not None else request_keys(reqs, block_size)
    seen: set[BlockKey] = set()
    res = SimResult("ceiling", 0, block_size)
    t0 = time.perf_counter()
    for r, ks in zip(reqs, keys):
        lim = lookup_limit(r, len(ks), block_size)
        h = 0
        while h < lim and ks[h] in seen:
            h += 1
        if r.cache_write:
            new = ks[h:r.num_tokens // block_size]
            res.written_blocks += sum(1 for k in new if k not in seen)
            seen.update(new)
        res.add_request(r, h)
    res.capacity_tokens = len(seen) * block_size
    res.seconds = time.perf_counter() - t0
    return res
