"""Eviction policies: which free-and-cached block gives up its K/V when the pool needs a block.

A policy only sees block events and keeps its own ordering of the *evictable* blocks (refcount 0,
still in the cache index). The pool owns the index and the refcounts; the policy never frees or
registers blocks itself. Policies are found by name in ``POLICIES`` (``@register``).

Invariant the pool relies on: after ``on_free(b)`` and until ``on_use(b)``/``evict()``/``on_removed(b)``,
``b`` is in the policy's evictable set exactly once; ``len(policy)`` is that set's size.

A policy decides what leaves the cache, never what enters it: every full computed block is cached
unless the manager's admission rule (``admission_tail_tokens``) or ``cache: "none"`` holds it back.

Imports no torch.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from typing import ClassVar

from hotprefix.cache.block import KVBlock
from hotprefix.cache.lazy_heap import LazyHeap

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

    def on_cached(self, block: KVBlock) -> None:
        """A block was registered in the cache index (it is in use at this moment; its depth,
        parent, priority and salt are set)."""

    def on_hit(self, block: KVBlock) -> None:
        """A cached block was matched by a request's prefix lookup."""

    @abstractmethod
    def on_free(self, block: KVBlock) -> None:
        """The block's refcount dropped to 0 while cached: it is now evictable."""

    @abstractmethod
    def on_use(self, block: KVBlock) -> None:
        """An evictable block is in use again: it must leave the evictable set."""

    @abstractmethod
    def evict(self) -> KVBlock:
        """Remove and return the victim. Only called when ``len(self) > 0``."""

    def on_removed(self, block: KVBlock) -> None:
        """The block left the evictable set without being chosen (cache reset, or a hybrid pool
        demoted it to its interior queue: ``on_dropped`` follows if a cascade gave it up)."""
        self.on_use(block)

    def on_dropped(self, block: KVBlock) -> None:
        """A block the policy's order still held was given up by another eviction's cascade
        (a hybrid pool's window keeper demoted it, and its page has now been reused): for
        policies that learn from what they evicted, it is an eviction they did not choose."""

    def on_request(self, ticks: int = 1) -> None:
        """A request was admitted (its first allocation); policies may use it as a clock.
        ``ticks``: the requests it stands for (in a fleet, this one and those routed to other
        replicas since this replica's previous one: ``CacheRequest.fleet_seq``)."""

    def describe(self) -> dict[str, float | int | None]:
        """What the policy has learned, for the cache stats (JSON-safe)."""
        return {}

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
        self._queue: OrderedDict[int, KVBlock] = OrderedDict()

    def on_free(self, block: KVBlock) -> None:
        self._queue[block.block_id] = block

    def on_use(self, block: KVBlock) -> None:
        self._queue.pop(block.block_id, None)

    def evict(self) -> KVBlock:
        return self._queue.popitem(last=False)[1]

    def __len__(self) -> int:
        return len(self._queue)

    def order(self) -> list[int]:
        """Block ids in eviction order (first = next victim); for tests and debugging."""
        return list(self._queue)


@register
class FreqCreditPolicy(EvictionPolicy):
    """Recency plus a log-frequency credit, with a bounded memory of evicted keys' counts.

    When a block becomes evictable it gets the fixed priority
    ``t_free + credit_requests * (log2(count) + priority)`` and the smallest priority is evicted
    first (ties: deeper block first, then the earlier free). ``t`` is a request counter
    (``on_request``: in a fleet, the fleet's requests, so that a replica that sees 1/R of them
    ages its blocks as one cache of the fleet's size would; measured on the Mooncake trace, 4 x 3M:
    0.961x one 12M cache with the fleet's clock, 0.941x with the replica's own),
    ``count`` the number of distinct requests that referenced the block's key, and
    ``priority`` the block's retention priority (each level is worth one doubling of the count).

    * Scan-resistant: a block seen k times keeps a lead of ``credit_requests * log2(k)`` requests
      over single-use blocks, so a burst of one-off long documents cannot flush a shared system
      prompt, while a prefix whose uses stopped still ages out (the credit is added to the last
      free time, not accumulated).
    * Tree-aware: a request that references a block also references all its ancestors, so a parent's
      count and last free time are never below its child's and its depth is smaller: descendants
      are always evicted before their ancestors, and no cached block is stranded behind an evicted
      parent.
    * A FIFO history of ``history_mult * num_blocks`` evicted keys remembers their counts, so a
      prefix that comes back after an eviction is not treated as new (a ghost list; a count-min
      sketch would be a cheaper substitute at very large pools).
    * The credit lapses with age: the policy measures the reuse gaps it sees (requests between a
      block's last free and its next reference, from hits and from evicted keys that come back)
      and keeps their ``credit_window_quantile`` as the *credit window* (never below
      ``credit_requests``). A block idle for longer than the window is past the horizon in which
      most re-references happen, and there recency alone predicts better than the count: the
      oldest such block is evicted first, whatever its credit (blocks with a retention priority
      above 0 excepted). In a small pool the victims are young and the credit decides; in a large
      one the policy turns into LRU, where a frequency credit only keeps dead prefixes.
    * Cycles larger than the pool (``_looping``): where blocks evicted fresh come back as often as
      recomputed ones, a block recomputed after an eviction is evicted first until it is hit, so
      the sessions that fit keep hitting instead of each being evicted just before it returns.
    """

    name = "freq"
    credit_requests: ClassVar[float] = 1000.0
    """Credit, in requests, per doubling of a block's reference count."""
    history_mult: ClassVar[int] = 8
    """Evicted keys remembered, as a multiple of the pool's block count."""
    credit_window_quantile: ClassVar[float] = 0.9
    """Quantile of the observed reuse gaps past which a block's frequency credit lapses."""
    gap_samples_half_life: ClassVar[int] = 4096
    """Reuse-gap samples after which older samples weigh half (the window follows the workload)."""
    window_update_every: ClassVar[int] = 256
    """Reuse-gap samples between two recomputations of the credit window (none before the first)."""
    loop_horizon_mult: ClassVar[float] = 4.0
    """``_looping``: an evicted key that has not come back within this many mean return delays
    counts as not come back."""
    loop_memory_mult: ClassVar[int] = 4
    """Outcomes of one class, as a multiple of the pool's block count, after which they weigh half."""
    loop_min_outcomes: ClassVar[int] = 64
    """Outcomes of blocks evicted fresh needed before the verdict can be 'cycling'."""
    loop_fresh_return: ClassVar[float] = 0.85
    """Fraction of blocks evicted fresh that must come back for 'cycling'..."""
    loop_return_ratio: ClassVar[float] = 0.9
    """... and at least this fraction of the rate of blocks evicted on probation."""
    _GAP_BUCKETS_PER_OCTAVE: ClassVar[int] = 8
    _GAP_BUCKETS: ClassVar[int] = 8 * 40

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self.now = 0
        self._count = [0] * num_blocks       # per block id: requests that referenced the key
        self._last = [-1] * num_blocks       # request counter at the last count increment
        self._block: list[KVBlock | None] = [None] * num_blocks
        self._heap = LazyHeap(num_blocks)    # the evictable set: id -> (t_free + credit, -depth, seq)
        self._seq = 0
        # key -> (count, t_free, t_evict, eviction number, class or -1 once tallied, dropped)
        self._history: OrderedDict[bytes, tuple[int, int, int, int, int, bool]] = OrderedDict()
        self._history_size = self.history_mult * num_blocks
        self._t_free = [0] * num_blocks      # request counter when the block last became evictable
        self._by_age: OrderedDict[int, None] = OrderedDict()  # evictable, priority <= 0, free order
        self._gap_hist = [0.0] * self._GAP_BUCKETS
        self._gap_samples = 0
        self._probation = [False] * num_blocks  # recomputed after an eviction, not hit since
        self._evictions = 0
        self._pending: deque[tuple[int, int, bytes]] = deque()  # (t_evict, number, key), by age
        self._outcome = [[0.0, 0.0], [0.0, 0.0]]  # class -> [came back, did not] (decayed)
        self._delay = 0.0  # moving mean of the requests from an eviction to the key's return
        self.credit_window = math.inf
        """Requests of idleness after which a block's credit no longer protects it (learned)."""

    def _observe_gap(self, gap: int) -> None:
        b = min(self._GAP_BUCKETS - 1, int(self._GAP_BUCKETS_PER_OCTAVE * math.log2(1 + max(0, gap))))
        self._gap_hist[b] += 1.0
        self._gap_samples += 1
        if self._gap_samples % self.gap_samples_half_life == 0:
            self._gap_hist = [x * 0.5 for x in self._gap_hist]
        if self._gap_samples % self.window_update_every == 0:
            want = self.credit_window_quantile * sum(self._gap_hist)
            acc = 0.0
            for i, x in enumerate(self._gap_hist):
                acc += x
                if acc >= want:
                    edge = 2.0 ** ((i + 1) / self._GAP_BUCKETS_PER_OCTAVE) - 1
                    self.credit_window = max(self.credit_requests, edge)
                    break

    def on_request(self, ticks: int = 1) -> None:
        self.now += max(1, ticks)

    def describe(self) -> dict[str, float | int | None]:
        w = self.credit_window
        return {"credit_requests": self.credit_requests,
                "credit_window_requests": None if math.isinf(w) else round(w, 1),
                "reuse_gaps_observed": self._gap_samples}

    def on_cached(self, block: KVBlock) -> None:
        bid = block.block_id
        count, t_free, t_evict, _, cls, dropped = self._history.pop(block.key,
                                                                 (0, -1, -1, -1, -1, False))
        if t_free >= 0:
            self._observe_gap(self.now - t_free)
            if cls >= 0:  # within the horizon
                d = self.now - t_evict
                if not dropped:  # the horizon is learned from the policy's own choices: a
                    # cascade gives a session's blocks up together and they return together,
                    # so counted one by one they would set every key's horizon to one session's
                    # delay and expire the other sessions' pending keys early
                    self._delay = 0.9 * self._delay + 0.1 * d if self._delay else float(max(1, d))
                self._tally(cls, 0)
        self._count[bid] = count + 1
        self._last[bid] = self.now
        self._probation[bid] = t_free >= 0

    def _tally(self, cls: int, outcome: int) -> None:
        row = self._outcome[cls]  # each class ages by its own outcomes: once the pool keeps a
        row[outcome] += 1.0       # stable set, only recomputed blocks are evicted, and the verdict
        if row[0] + row[1] > self.loop_memory_mult * self.num_blocks:  # must not fade with them
            row[0] *= 0.5
            row[1] *= 0.5

    def _expire(self) -> None:
        """Evicted keys that have stayed away ``loop_horizon_mult`` times the mean return delay
        count as not come back."""
        horizon = self.loop_horizon_mult * self._delay
        while self._pending and self._delay and self.now - self._pending[0][0] > horizon:
            _, n_ev, key = self._pending.popleft()
            rec = self._history.get(key)
            if rec is not None and rec[3] == n_ev and rec[4] >= 0:
                self._tally(rec[4], 1)
                self._history[key] = rec[:4] + (-1,) + rec[5:]

    def _looping(self) -> bool:
        """Whether blocks evicted before any hit come back (within ``loop_horizon_mult`` mean
        return delays) about as often as blocks evicted on probation (recomputed after an
        eviction, not hit since), and most of them do: the pool cycles through a working set
        larger than itself (chat sessions taking turns), and LRU order evicts each before it
        returns. There a recomputed block is evicted before the blocks that are hitting, which
        then keep hitting. Where blocks evicted fresh mostly do not come back (one-off documents)
        and recomputed ones do, a recomputed block keeps its count's credit (ARC's lesson: the
        ghosts decide)."""
        (f_back, f_not), (r_back, r_not) = self._outcome
        if f_back + f_not < self.loop_min_outcomes:
            return False
        fresh = f_back / (f_back + f_not)
        recomputed = (r_back + 1.0) / (r_back + r_not + 1.0)
        return fresh >= max(self.loop_fresh_return, self.loop_return_ratio * recomputed)

    def on_hit(self, block: KVBlock) -> None:
        bid = block.block_id
        self._probation[bid] = False
        if self._last[bid] != self.now:
            self._count[bid] += 1
            self._last[bid] = self.now

    def on_free(self, block: KVBlock) -> None:
        bid = block.block_id
        self._block[bid] = block
        self._t_free[bid] = self.now
        self._by_age.pop(bid, None)
        if block.priority <= 0:
            self._by_age[bid] = None
        credit = self.credit_requests * (math.log2(self._count[bid] or 1) + block.priority)
        lead = 0 if self._probation[bid] and block.priority <= 0 and self._looping() else 1
        self._seq += 1
        self._heap.push(bid, (lead, self.now + credit, -block.depth, self._seq))

    def _leave(self, bid: int) -> None:
        """The block leaves the evictable set (its heap entry goes stale)."""
        if self._heap.discard(bid):
            self._block[bid] = None
            self._by_age.pop(bid, None)

    def on_use(self, block: KVBlock) -> None:
        bid = block.block_id
        if bid in self._heap:  # an idle cached block is referenced again: one reuse gap
            self._observe_gap(self.now - self._t_free[bid])
        self._leave(bid)

    def evict(self) -> KVBlock:
        bid = next(iter(self._by_age), -1)
        if bid < 0 or self.now - self._t_free[bid] <= self.credit_window:
            top = self._heap.peek()
            assert top is not None, "evict() with no evictable block"
            bid = top[1]
        block = self._block[bid]
        assert block is not None
        self._leave(bid)
        self._remember(bid, block, False)
        return block

    def on_dropped(self, block: KVBlock) -> None:
        self._remember(block.block_id, block, True)

    def _remember(self, bid: int, block: KVBlock, dropped: bool) -> None:
        self._evictions += 1
        cls = 1 if self._probation[bid] else 0 if self._count[bid] <= 1 else -1
        if self._history_size and block.key is not None:
            self._history[block.key] = (self._count[bid], self._t_free[bid], self.now,
                                        self._evictions, cls, dropped)
            if cls >= 0:
                self._pending.append((self.now, self._evictions, block.key))
                if len(self._pending) > self._history_size:  # older than every record: nothing
                    self._pending.popleft()                    # to tally (bounded before a return)
            self._expire()
            if len(self._history) > self._history_size:
                self._history.popitem(last=False)

    def on_removed(self, block: KVBlock) -> None:
        self._leave(block.block_id)

    def order(self) -> list[int]:
        """Block ids in eviction order (first = next victim); for tests and debugging."""
        lapsed = [b for b in self._by_age if self.now - self._t_free[b] > self.credit_window]
        skip = set(lapsed)
        return lapsed + [b for b in self._heap.ordered() if b not in skip]

    def __len__(self) -> int:
        return len(self._heap)
