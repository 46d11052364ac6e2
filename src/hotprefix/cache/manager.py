"""KV cache manager: the prefix cache as the scheduler sees it.

Per request it keeps the block table (list of ``KVBlock``) and the chain of block keys, and offers
four operations, in the order a request meets them:

  ``lookup``    longest run of cached full blocks (at most ``len(tokens) - 1`` tokens), with a
                miss report saying why the prompt did not hit further;
  ``allocate``  take references on the hit blocks and fresh blocks for the tokens to compute;
  ``commit``    after a step, register every block that became full (prefill chunks and decodes);
  ``free``      drop the request's references (tail first).

It also tracks *in-flight* keys (blocks that a running request will compute) so the scheduler can
hold back a waiting request that would otherwise recompute the same prefix in the same step.

Knows nothing about tensors, tokenizers or HTTP. Imports no torch.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from hotprefix.cache.block import AdmitInfo, KVBlock
from hotprefix.cache.block_pool import BlockPool
from hotprefix.cache.diagnosis import miss_reason
from hotprefix.cache.hashing import BlockHasher, BlockKey
from hotprefix.cache.ledger import ContentLedger
from hotprefix.cache.report import CacheReport, MissReason
from hotprefix.cache.request import CacheRequest
from hotprefix.cache.rules import cacheable_blocks
from hotprefix.cache.stats import CacheStats, request_figures
from hotprefix.text.common import common_prefix_len

from hotprefix.cache.window_groups import WindowGroups

if TYPE_CHECKING:  # the tiers package (redis, msgspec) loads only when tiers are configured
    from hotprefix.cache.tier_link import TierLink

log = logging.getLogger(__name__)

CONTENT_ROOT = BlockKey(b"hotprefix/content-root")
MAX_TENANT_STATS = 1024


@dataclass
class _ReqState:
    blocks: list[KVBlock] = field(default_factory=list)
    num_committed: int = 0  # leading blocks that are cached (hit or registered) or settled
    num_hit_blocks: int = 0
    write_stopped: bool = False
    pending: list[BlockKey] = field(default_factory=list)
    tail_ok: bool | None = None  # admission_tail_tokens: the prompt's head was seen before


class KVCacheManager:
    """Block tables, prefix lookup, block registration and the cache's statistics."""

    def __init__(self, pool: BlockPool, hasher: BlockHasher, enable_prefix_caching: bool = True,
                 stats_window: int = 1000, ledger: ContentLedger | None = None,
                 admission_tail_tokens: int | None = None):
        self.pool = pool
        # Blocks past this many prompt tokens are written only when the prompt's first
        # ``admission_tail_tokens`` tokens were seen before (None = write every block).
        self.admission_tail_tokens = admission_tail_tokens
        self._seen_heads: OrderedDict[BlockKey, None] = OrderedDict()  # for admission_tail_tokens
        self.hasher = hasher
        self.block_size = pool.block_size
        self.enabled = enable_prefix_caching
        self.stats = CacheStats(window=stats_window)
        """Every request, with cross-tenant duplication shown as ``salt`` (the operator's view)."""
        self._tenant_stats: OrderedDict[str | None, CacheStats] = OrderedDict()
        self.tiers: TierLink | None = None
        """The KV tiers below the pool (set by the engine with ``--kv-store``), or None."""
        self.fixed_prefix: list[int] = []
        """Token ids every chat prompt starts with (the template's fixed opening), set by the engine."""
        self.ledger = ledger if ledger is not None else ContentLedger()
        self.namespace_tag = hasher.namespace.hex()[:16]
        self._reqs: dict[str, _ReqState] = {}
        self.pending: dict[BlockKey, str] = {}  # key -> id of the request computing it
        self.windows: WindowGroups | None = None
        """A hybrid pool's sliding-window groups (``window_groups``; set by the engine), or None:
        every layer's K/V kept for every block."""
        self._fleet_seq: int | None = None  # the latest CacheRequest.fleet_seq admitted

    # ------------------------------------------------------------------ keys
    def keys(self, req: CacheRequest) -> list[BlockKey]:
        """The request's block keys, extended to every full block of its tokens."""
        self.hasher.extend(req.block_keys, req.token_ids, req.salt, req.salt_from_block)
        return req.block_keys

    def block_table(self, request_id: str) -> list[int] | list[list[int]]:
        """The request's block ids; with window groups, one table per group (the full group's
        first, ``window_groups.PAD`` where a window group holds no block)."""
        st = self._reqs.get(request_id)
        table = [b.block_id for b in st.blocks] if st else []
        if self.windows is None:
            return table
        return [table, *self.windows.tables(request_id)]

    def pages_to_hold(self, num_tokens: int, chunk: int) -> int:
        """Most pool blocks one sequence of ``num_tokens`` holds at once, computed in chunks of up
        to ``chunk`` tokens (a hybrid pool's window groups hold only their windows)."""
        blocks = math.ceil(num_tokens / self.block_size)
        return blocks + (self.windows.pages_to_hold(num_tokens, chunk) if self.windows else 0)

    def num_blocks_held(self, request_id: str) -> int:
        st = self._reqs.get(request_id)
        held = len(st.blocks) if st else 0
        return held + (self.windows.num_held(request_id) if self.windows is not None else 0)

    # ------------------------------------------------------------------ lookup
    def lookup(self, req: CacheRequest) -> list[KVBlock]:
        """Cached blocks for the longest matching run of leading full blocks (blocks a finished
        tier fetch brought in count: they are installed in the pool first).

        Never covers the last known token: it must be computed to have logits. Nothing for a
        request that does not read the cache (``read_cache=False``).
        """
        if not self.enabled or not req.read_cache:
            return []
        if self.tiers is not None:
            self.tiers.install(self, req)
        hits = self.pool_run(req)
        req.full_hit_blocks = len(hits)
        if self.windows is not None and hits:
            hits = hits[:self.windows.resume(req.block_keys, req.token_ids, len(hits))]
        return hits

    def pool_run(self, req: CacheRequest) -> list[KVBlock]:
        """The longest run of leading full blocks cached in the pool now."""
        keys = self.keys(req)
        bs = self.block_size
        limit = min(len(keys), cacheable_blocks(len(req.token_ids), bs))
        hits: list[KVBlock] = []
        for i in range(limit):
            blk = self.pool.lookup(keys[i], req.token_ids[i * bs:(i + 1) * bs])
            if blk is None:
                break
            hits.append(blk)
        return hits

    def start_tier_fetch(self, req: CacheRequest) -> None:
        """At arrival: look the blocks past the pool's hit run up in the KV tiers, in the background."""
        if self.enabled and self.tiers is not None:
            self.tiers.start_fetch(self, req)

    def tier_pending(self, req: CacheRequest) -> bool:
        """Whether the request is waiting for its tier fetch (within the fetch's deadline)."""
        return self.tiers is not None and self.tiers.pending(req)

    def record_loaded(self, req: CacheRequest, i: int) -> None:
        """Block ``i`` of ``req`` was installed from a tier: remember its content as cached."""
        self._record_content(req, i)

    def inflight_owner(self, req: CacheRequest, num_hit_blocks: int) -> str | None:
        """Id of another running request that is computing this request's next block, if any."""
        keys = req.block_keys
        if not self.enabled or num_hit_blocks >= len(keys):
            return None
        owner = self.pending.get(keys[num_hit_blocks])
        return owner if owner is not None and owner != req.request_id else None

    # ------------------------------------------------------------------ allocate / commit / free
    def num_free_after(self, hits: Sequence[KVBlock] = ()) -> int:
        """Blocks an allocation could take once ``hits`` are referenced (an evictable hit stops
        being free; a pinned free block was never counted in ``num_free``)."""
        evictable_hits = sum(1 for b in hits if b.ref_cnt == 0 and b.block_id not in self.pool.pinned)
        return self.pool.num_free - evictable_hits

    def can_allocate(self, req: CacheRequest, num_new_tokens: int, num_computed_tokens: int,
                     hits: list[KVBlock] = ()) -> bool:
        st = self._reqs.get(req.request_id)
        held = len(st.blocks) if st else 0
        need = math.ceil((num_computed_tokens + num_new_tokens) / self.block_size) - held - len(hits)
        free = self.num_free_after(hits)
        if self.windows is not None:
            w = self.windows
            resume = len(hits) if st is None else 0
            need += w.pages_needed(req.request_id, num_computed_tokens, num_new_tokens, resume)
            free -= w.evictable_hits(self.keys(req), resume)
        return need <= free

    def allocate(self, req: CacheRequest, num_new_tokens: int, num_computed_tokens: int,
                 hits: list[KVBlock] = ()) -> bool:
        """Make the request hold enough blocks for ``num_computed_tokens + num_new_tokens``.

        ``hits`` (from ``lookup``, only at admission) are referenced first. Returns False and takes
        nothing if the pool cannot supply the blocks.
        """
        if self.windows is not None:  # what no query from here on reads: released first
            self.windows.release_out_of_window(req.request_id, num_computed_tokens)
        if not self.can_allocate(req, num_new_tokens, num_computed_tokens, hits):
            return False
        st = self._reqs.get(req.request_id)
        first = st is None
        if first:
            st = self._reqs[req.request_id] = _ReqState()
            self.pool.policy.on_request(self._ticks(req))
        if hits:
            self.pool.touch(hits)
            st.blocks.extend(hits)
            st.num_committed = st.num_hit_blocks = len(hits)
            self._retain_hits(req, hits)
        if first and self.windows is not None:
            self.windows.admit(req.request_id, self.keys(req), len(hits), self._hit_points(req))
        need = math.ceil((num_computed_tokens + num_new_tokens) / self.block_size) - len(st.blocks)
        if need > 0:
            new = self.pool.allocate(need)
            assert new is not None
            st.blocks.extend(new)
        if self.windows is not None:
            self.windows.allocate(req.request_id, num_computed_tokens, num_new_tokens)
        if first and self.enabled and req.cache_write:
            # Blocks of the known prompt this request is about to compute: others may wait for them.
            keys = self.keys(req)
            for key in keys[st.num_committed:]:
                if key not in self.pending and key not in self.pool.index:
                    self.pending[key] = req.request_id
                    st.pending.append(key)
        return True

    def _ticks(self, req: CacheRequest) -> int:
        """Requests the eviction clock advances by at this admission (``CacheRequest.fleet_seq``)."""
        seq = req.fleet_seq
        if seq is None:
            return 1
        # the latest, not the largest: a restarted front end counts from 1 again, and two requests
        # admitted out of their routing order tick one request too many, never a restart's worth
        last, self._fleet_seq = self._fleet_seq, seq
        return seq - last if last is not None and seq > last else 1

    def commit(self, req: CacheRequest, num_computed_tokens: int) -> None:
        """Register the blocks that are full and computed after a step."""
        st = self._reqs.get(req.request_id)
        if st is None or not self.enabled:
            return
        n_full = num_computed_tokens // self.block_size
        if n_full <= st.num_committed:
            return
        keys = self.keys(req)
        bs = self.block_size
        tail_rule = self.admission_tail_tokens is not None and not req.expect_reuse
        tail_from = self._tail_block(req, keys, st) if tail_rule else None
        placed: list[tuple[int, KVBlock]] = []
        tenant = self.tenant_stats(req.salt)
        for i in range(st.num_committed, min(n_full, len(keys), len(st.blocks))):
            blk = st.blocks[i]
            key = keys[i]
            if self.pending.get(key) == req.request_id:
                del self.pending[key]
            if blk.key is not None or st.write_stopped or not req.cache_write:
                continue
            if key in self.pool.index:  # computed twice (both requests started together, or
                self.pool.revive(self.pool.index[key])  # a hybrid resume): keep one copy, alive
                continue
            if tail_from is not None and i >= tail_from:
                st.write_stopped = True  # the tail of a long prompt whose head is new: not written
                continue
            toks = req.token_ids[i * bs:(i + 1) * bs]
            info = AdmitInfo(depth=i, parent=keys[i - 1] if i else self.hasher.namespace,
                             priority=req.priority if req.retains(i) else 0,
                             salt=req.salt if i == req.salt_from_block else None)
            if not self.pool.cache_block(blk, key, toks, info):
                st.write_stopped = True  # descendants of an unadmitted block are unreachable
                continue
            ttl = req.pin_ttl_for((i + 1) * bs) if req.retains(i) else 0.0
            if ttl > 0:
                self.pool.pin(blk, self.pool.clock() + ttl)
            self.stats.written_blocks += 1
            tenant.written_blocks += 1
            if req.cache_report is not None:
                req.cache_report.written_blocks += 1
            self._record_content(req, i)
            placed.append((i, blk))
        st.num_committed = max(st.num_committed, n_full)
        if self.windows is not None:
            self.windows.commit(req.request_id, keys, req.token_ids, n_full,
                                lambda i: req.salt if i == req.salt_from_block else None)
        if self.tiers is not None:
            self.tiers.store(self, req, placed)  # write-through to the KV tiers

    def _hit_points(self, req: CacheRequest) -> dict[int, str]:
        """Block counts where later requests are expected to resume (``window_groups``)."""
        bs = self.block_size
        points: dict[int, str] = {}
        for ends, kind in ((req.hit_point_tokens, "message_end"), (req.turn_end_tokens, "turn_end")):
            for end in ends:
                if req.retains(end // bs - 1):  # a tenant's message ends keep its own blocks only
                    points.setdefault(end // bs, kind)
        for end, _ in req.pin_breakpoints:
            points.setdefault(end // bs, "breakpoint")
        cacheable = cacheable_blocks(req.num_prompt_tokens, bs)
        n = req.full_hit_blocks
        if 0 < n < cacheable and self.pool.cached_children(self.keys(req)[n - 1]):
            points.setdefault(n, "divergence")  # another cached prompt goes on differently here
        points.setdefault(cacheable, "prompt_end")
        points.pop(0, None)
        return points

    def _retain_hits(self, req: CacheRequest, hits: Sequence[KVBlock]) -> None:
        """A request's retention renews the blocks it reads from cache, as it would have set it on
        blocks it wrote: their priority is raised to the request's (never lowered) and their pins
        are extended (within the pool's pin share). A request that writes nothing changes nothing."""
        if not req.cache_write:
            return
        now = self.pool.clock()
        for i, blk in enumerate(hits):
            if not req.retains(i):
                continue
            blk.priority = max(blk.priority, req.priority)
            ttl = req.pin_ttl_for((i + 1) * self.block_size)
            if ttl > 0:
                self.pool.pin(blk, now + ttl)

    def _tail_block(self, req: CacheRequest, keys: list[BlockKey], st: _ReqState) -> int | None:
        """First block index not to write under ``admission_tail_tokens``, or None (write all).

        A prompt longer than the threshold has its head (the blocks inside the first
        ``admission_tail_tokens`` tokens) remembered in a bounded list; its tail is written only
        when that head was seen before (by an earlier request, or as a cached hit now).
        """
        limit = self.admission_tail_tokens
        assert limit is not None
        head = limit // self.block_size
        if req.num_prompt_tokens <= limit or head == 0 or head > len(keys):
            return None
        if st.tail_ok is None:  # decided once, at the request's first commit
            key = keys[head - 1]
            st.tail_ok = st.num_hit_blocks >= head or key in self._seen_heads
            self._seen_heads[key] = None
            self._seen_heads.move_to_end(key)
            if len(self._seen_heads) > max(1024, self.pool.num_blocks):
                self._seen_heads.popitem(last=False)
        return None if st.tail_ok else head

    def free(self, req: CacheRequest) -> None:
        """Release every block the request holds (finished, aborted or preempted)."""
        if self.tiers is not None:
            self.tiers.forget(req)
        st = self._reqs.pop(req.request_id, None)
        if st is None:
            return
        for key in st.pending:
            if self.pending.get(key) == req.request_id:
                del self.pending[key]
        # full blocks first: the window blocks they make reachable are freed after them, so an
        # order by free time never takes a window before the full chain it ends
        self.pool.free(st.blocks)
        if self.windows is not None:
            self.windows.free(req.request_id, self.keys(req))

    def fork(self, parent: CacheRequest, child: CacheRequest, num_tokens: int) -> list[tuple[int, int]] | None:
        """Let ``child``, another sequence of ``parent``'s prompt, start from ``parent``'s K/V of
        its first ``num_tokens`` tokens: one more reference on each full block, and a fresh block
        for a partial last one (copy-on-write at the fork: the two sequences write different
        tokens into it next).

        Returns:
            The (parent's block id, child's block id) pairs whose contents the caller copies
            (none when ``num_tokens`` ends on a block boundary), or None, taking nothing, when the
            pool has no block for the copy.
        """
        st = self._reqs[parent.request_id]
        n_full = num_tokens // self.block_size
        partial = num_tokens % self.block_size != 0
        new: list[KVBlock] = []
        if partial:
            got = self.pool.allocate(1)
            if got is None:
                return None
            new = got
        window_pairs: list[tuple[int, int]] = []
        if self.windows is not None:
            got_w = self.windows.fork(parent.request_id, child.request_id, num_tokens)
            if got_w is None:
                self.pool.free(new)
                return None
            window_pairs = got_w
        shared = st.blocks[:n_full]
        self.pool.share(shared)
        self._reqs[child.request_id] = _ReqState(
            blocks=shared + new, num_committed=min(st.num_committed, n_full),
            num_hit_blocks=min(st.num_hit_blocks, n_full), write_stopped=st.write_stopped,
            tail_ok=st.tail_ok)
        child.block_keys = list(self.keys(parent)[:n_full])
        return ([(st.blocks[n_full].block_id, new[0].block_id)] if partial else []) + window_pairs

    def reset(self) -> dict[str, int]:
        """Drop every free cached block; blocks in use stay. Returns counts."""
        dropped, kept = self.pool.reset()
        self.ledger.clear()
        return {"dropped_blocks": dropped, "in_use_blocks_kept": kept}

    # ------------------------------------------------------------------ miss report
    def report(self, req: CacheRequest, hits: list[KVBlock]) -> CacheReport:
        """Why the prompt did (not) hit further; recorded in the stats. Call once per request."""
        bs = self.block_size
        n_prompt = req.num_prompt_tokens
        cacheable = cacheable_blocks(n_prompt, bs)
        n_hit = len(hits)
        cached_tokens = n_hit * bs
        rep = CacheReport(cached_tokens, n_prompt - cached_tokens)
        if self.tiers is not None:
            rep.sources = self.tiers.sources(req, n_hit, bs)
        else:
            rep.sources = {"pool": cached_tokens}
        if not self.enabled:
            rep.miss_reason, rep.detail = MissReason.COLD, {"note": "prefix caching is disabled"}
        elif not req.read_cache:
            rep.miss_reason = MissReason.READ_SKIPPED
            rep.detail = {"note": "prompt log probabilities need the logits of every prompt "
                                  "position: the cache was not read"}
        elif cacheable == 0:
            rep.miss_reason = MissReason.TOO_SHORT
            rep.detail = {"note": f"the prompt has {n_prompt} tokens; a block holds {bs} and the "
                                  "last token is always computed"}
        elif n_hit < min(cacheable, req.full_hit_blocks):  # a hybrid pool resumed earlier
            rep.miss_reason, rep.miss_position = MissReason.WINDOW_EVICTED, cached_tokens
            rep.detail = {"resumed_at_token": cached_tokens,
                          "full_layers_cached_tokens": req.full_hit_blocks * bs,
                          "note": "the sliding-window layers' K/V before the longer prefix were "
                                  "evicted; the hit resumed at an earlier kept hit point"}
            if self.windows is not None:
                self.windows.resumed_earlier += 1
        elif n_hit < cacheable:
            miss = miss_reason(self, req, n_hit)
            rep.miss_reason, rep.miss_position, rep.detail = miss.reason, miss.position, miss.detail
            req.operator_reason = miss.operator_reason
        missed = n_prompt - cached_tokens
        self.stats.record(n_prompt, cached_tokens, rep.miss_reason, missed, req.operator_reason)
        self.tenant_stats(req.salt).record(n_prompt, cached_tokens, rep.miss_reason, missed)
        req.cache_report = rep
        return rep

    def tenant_stats(self, salt: str | None) -> CacheStats:
        """The statistics of one tenant (by salt), created on first use; the oldest drop first."""
        st = self._tenant_stats.get(salt)
        if st is None:
            st = self._tenant_stats[salt] = CacheStats(window=self.stats.window)
            if len(self._tenant_stats) > MAX_TENANT_STATS:
                self._tenant_stats.popitem(last=False)
        else:
            self._tenant_stats.move_to_end(salt)
        return st

    def record_cause(self, req: CacheRequest, cause: str | None) -> None:
        """After the text diagnosis: count the request's missed tokens under (reason, cause, block)."""
        rep = req.cache_report
        if rep is None:
            return
        block = (rep.detail or {}).get("block_index")
        self.tenant_stats(req.salt).record_cause(rep.miss_reason, cause, block, rep.computed_tokens)
        self.stats.record_cause(req.operator_reason or rep.miss_reason, cause, block, rep.computed_tokens)

    def content_keys(self, req: CacheRequest, n: int) -> list[BlockKey]:
        """Key chain of the tokens alone: no namespace, no salt (for namespace/salt diagnosis)."""
        if len(req.content_keys) < n:
            self.hasher.extend(req.content_keys, req.token_ids[:n * self.block_size],
                               namespace=CONTENT_ROOT)
        return req.content_keys

    def fixed_prefix_len(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of ``token_ids`` are the chat template's fixed opening.

        A prompt that matches a cached one only inside that opening shares nothing of its own.
        """
        fp = self.fixed_prefix
        return common_prefix_len(token_ids[:len(fp)], fp) if fp else 0

    def _record_content(self, req: CacheRequest, i: int) -> None:
        if i >= self.ledger.max_depth:
            return
        content = self.content_keys(req, i + 1)[i]
        self.ledger.record(content, self.namespace_tag, req.salt if i >= req.salt_from_block else None)

    # ------------------------------------------------------------------ stats
    def usage(self) -> float:
        return self.pool.num_in_use / self.pool.num_blocks

    def snapshot(self) -> dict[str, Any]:
        """The operator's view: the pool, every request, cross-tenant duplication as ``salt``."""
        p = self.pool
        now = p.clock()
        recent = [t for t in p.eviction_times if now - t <= 60.0]
        return {
            "view": "operator",
            "enabled": self.enabled,
            "block_size": self.block_size,
            "blocks_total": p.num_blocks,
            "blocks_in_use": p.num_in_use,
            "blocks_cached": p.num_cached,
            "blocks_empty": len(p.empty),
            "blocks_pinned": p.num_pinned_blocks,
            "capacity_tokens": p.num_blocks * self.block_size,
            "kv_usage": self.usage(),
            **request_figures(self.stats),
            "evictions": p.num_evictions,
            "evictions_per_second": len(recent) / 60.0,
            "eviction_policy": p.policy.name,
            "eviction_policy_state": p.policy.describe(),
            **self._window_figures(),
        }

    def _window_figures(self) -> dict[str, Any]:
        """A hybrid pool's groups and hits by hit kind (operator only: they move with every
        tenant's traffic)."""
        w = self.windows
        if w is None:
            return {}
        return {"kv_groups": w.describe(len(w.groups) + 1),
                "blocks_interior": len(self.pool.low),
                "window_hits_by_kind": dict(w.hits_by_kind),
                "window_resumed_earlier": w.resumed_earlier}

    def tenant_snapshot(self, salt: str | None) -> dict[str, Any]:
        """One tenant's view: its own requests only, and nothing that moves with other tenants'
        traffic (no pool occupancy, evictions or other tenants' prefixes)."""
        st = self._tenant_stats.get(salt) or CacheStats(window=self.stats.window)
        return {"view": "tenant", "enabled": self.enabled, "block_size": self.block_size,
                "capacity_tokens": self.pool.num_blocks * self.block_size,
                "eviction_policy": self.pool.policy.name, **request_figures(st)}

    def tenants_overview(self) -> dict[str | None, dict[str, Any]]:
        """Per-tenant request figures for the operator, keyed by salt (None = no salt)."""
        return {salt: request_figures(st) for salt, st in self._tenant_stats.items()}

    def top_prefixes(self, n: int = 10) -> list[dict[str, Any]]:
        """Cached root-side blocks with the most hits (no content, only ids and counts)."""
        blocks = sorted((b for b in self.pool.index.values()), key=lambda b: (-b.num_hits, b.depth))
        return [{"key": b.key.hex()[:16], "depth": b.depth, "hits": b.num_hits,
                 "tokens": (b.depth + 1) * self.block_size, "in_use": b.ref_cnt > 0}
                for b in blocks[:n] if b.num_hits > 0]
