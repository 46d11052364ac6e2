"""The pool of KV blocks: refcounts, the content index, and the three block states.

Every block is in exactly one state:
  * in use          ``ref_cnt > 0`` (it may also be cached: then other requests can share it);
  * free-and-cached ``ref_cnt == 0`` and its key is in the index: evictable, still findable;
  * free-and-empty  ``ref_cnt == 0`` and no key: handed out first.

Allocation takes empty blocks first, then asks the eviction policy for a victim; evicting removes
the key from the index before the block is reused. The pool remembers a bounded "ghost" list of
recently evicted keys so a later miss can be reported as ``evicted`` rather than ``cold``.

A hybrid pool (``window_groups``) also holds sliding-window groups' blocks: a free cached window
block outside every kept window is *interior* and sits in ``low``, which allocation empties before
it asks the policy: those are the first blocks eviction takes.

The pool only knows block ids and keys; the K/V tensors live in the runner. Imports no torch.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from typing import Callable, Protocol, Sequence

from hotprefix.cache.block import AdmitInfo, KVBlock
from hotprefix.cache.eviction import EvictionPolicy, make_policy
from hotprefix.cache.hashing import BlockKey
from hotprefix.cache.lazy_heap import LazyHeap


class PoolListener(Protocol):
    """Told what the pool's content index gains and loses (e.g. ``hotprefix.events``' recorder).

    Called on the thread that changes the pool; a listener must not change the pool itself.
    """

    def on_stored(self, block: KVBlock) -> None:
        """``block`` was just cached (key, parent, token ids and depth are set)."""

    def on_removed(self, block: KVBlock) -> None:
        """``block`` is about to lose its key (evicted): it still carries key, parent and tokens."""

    def on_cleared(self) -> None:
        """``reset`` dropped every free cached block (no ``on_removed`` for them); what is still
        cached (in use) is in ``index``."""


class BlockPool:
    """Blocks, their refcounts and the key -> block index."""

    def __init__(self, num_blocks: int, block_size: int, policy: str | EvictionPolicy = "lru",
                 ghost_size: int = 65536, max_pinned_fraction: float = 0.5,
                 clock=time.monotonic):
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.policy = make_policy(policy, num_blocks) if isinstance(policy, str) else policy
        self.index: dict[BlockKey, KVBlock] = {}
        self.empty: deque[int] = deque(range(num_blocks))
        self.children: dict[BlockKey, set[BlockKey]] = {}
        self.ghosts: OrderedDict[BlockKey, None] = OrderedDict()
        self.ghost_size = ghost_size
        self.pinned: dict[int, KVBlock] = {}  # free-and-cached blocks held back by a pin
        self.low: OrderedDict[int, KVBlock] = OrderedDict()
        """Free cached interior window blocks, least recently freed first: evicted first."""
        self.given_up: set[int] = set()
        """Blocks in ``low`` that the policy's order held until an eviction's cascade demoted them
        (``demote(evicted=True)``): when they lose their key the policy hears of it
        (``on_dropped``), as of its own victims, so its memory of evicted keys holds them."""
        self.max_pinned = int(num_blocks * max_pinned_fraction)
        self.num_pinned_blocks = 0  # cached blocks (any refcount) with an active pin
        self._pin_expiry = LazyHeap(num_blocks)  # block id -> pinned_until, for blocks with a pin
        self.clock = clock
        self.num_evictions = 0
        self.eviction_times: deque[float] = deque(maxlen=4096)
        self.num_in_use = 0
        self.on_policy_evict: Callable[[KVBlock], None] | None = None
        """Called with each block the policy gives up, before its key is dropped (a hybrid pool's
        ``window_keep``: the blocks that only served hits through it move to ``low``)."""
        self.listeners: list[PoolListener] = []
        """Told of every block cached, evicted, and of resets (``PoolListener``)."""

    # ------------------------------------------------------------------ queries
    def lookup(self, key: BlockKey, token_ids: Sequence[int] | None = None) -> KVBlock | None:
        """The cached block for ``key``; a token mismatch (hash collision) is a miss."""
        blk = self.index.get(key)
        if blk is None:
            return None
        if token_ids is not None and blk.token_ids is not None and tuple(token_ids) != blk.token_ids:
            return None
        return blk

    @property
    def num_free(self) -> int:
        """Blocks that an allocation can take now (empty + evictable, not pinned)."""
        self._expire_pins()
        return len(self.empty) + len(self.policy) + len(self.low)

    @property
    def num_cached(self) -> int:
        return len(self.index)

    def was_evicted(self, key: BlockKey) -> bool:
        return key in self.ghosts

    def cached_children(self, parent: BlockKey) -> list[KVBlock]:
        """Cached blocks whose previous block is ``parent`` (siblings of a missing block)."""
        return [self.index[k] for k in self.children.get(parent, ()) if k in self.index]

    # ------------------------------------------------------------------ refcounts
    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Take a reference on cached blocks found by a lookup."""
        for b in blocks:
            if b.ref_cnt == 0:
                if b.block_id in self.pinned:
                    del self.pinned[b.block_id]
                elif not self._leave_low(b):
                    self.policy.on_use(b)
                self.num_in_use += 1
            b.dead = False  # a hit uses it: alive again
            b.ref_cnt += 1
            b.num_hits += 1
            self.policy.on_hit(b)

    def share(self, blocks: Sequence[KVBlock]) -> None:
        """One more reference on blocks already in use (a forked sequence shares its prompt's)."""
        for b in blocks:
            if b.ref_cnt <= 0:
                raise RuntimeError(f"sharing block {b.block_id}, which is not in use")
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[KVBlock] | None:
        """``n`` blocks with refcount 1, or None (and nothing taken) if the pool cannot supply them."""
        if n > self.num_free:
            return None
        now = self.clock()
        out = []
        for _ in range(n):
            if self.empty:
                b = self.blocks[self.empty.popleft()]
            elif self.low:
                b = self.low.popitem(last=False)[1]
                if b.block_id in self.given_up:
                    self.given_up.discard(b.block_id)
                    self.policy.on_dropped(b)
                self._uncache(b, evicted=True)
                self.num_evictions += 1
                self.eviction_times.append(now)
            else:
                b = self.policy.evict()
                if self.on_policy_evict is not None:
                    self.on_policy_evict(b)  # still keyed: what it leaves useless goes to ``low``
                self._uncache(b, evicted=True)
                self.num_evictions += 1
                self.eviction_times.append(now)
            b.ref_cnt = 1
            self.num_in_use += 1
            out.append(b)
        return out

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """Drop one reference on each block, tail first, so descendants become evictable before
        their ancestors."""
        now = self.clock()
        for b in reversed(blocks):
            if b.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {b.block_id}")
            b.ref_cnt -= 1
            if b.ref_cnt:
                continue
            self.num_in_use -= 1
            if b.key is None:
                self.empty.append(b.block_id)
            elif b.pinned_until > now:
                self.pinned[b.block_id] = b
            elif b.dead or (b.group and not b.kept):
                self.low[b.block_id] = b
            else:
                self.policy.on_free(b)

    # ------------------------------------------------------------------ caching
    def cache_block(self, block: KVBlock, key: BlockKey, token_ids: Sequence[int],
                    info: AdmitInfo) -> bool:
        """Register a full, computed, in-use block under ``key``.

        Returns False (block stays uncached) if the key is already cached by another block.
        """
        assert block.ref_cnt > 0 and block.key is None
        if key in self.index:
            return False
        block.key = key
        block.token_ids = tuple(token_ids)
        block.parent = info.parent
        block.depth = info.depth
        block.num_hits = 0
        block.priority = info.priority
        self.index[key] = block
        block.salt = info.salt
        if info.parent is not None:
            self.children.setdefault(info.parent, set()).add(key)
        self.ghosts.pop(key, None)
        self.policy.on_cached(block)
        for listener in self.listeners:
            listener.on_stored(block)
        return True

    def demote(self, b: KVBlock, evicted: bool = False) -> None:
        """No hit can use cached block ``b`` any more: evict it before anything else (``low``). A
        block in use is marked and goes there when freed; a pinned one keeps its pin.
        ``evicted``: the policy's eviction of another block took its purpose (``window_keep``'s
        cascade), so it counts as evicted by the policy (``given_up``)."""
        if b.key is None:
            return
        b.dead, b.kept = True, False
        if b.ref_cnt or b.block_id in self.pinned or b.block_id in self.low:
            return
        self.policy.on_removed(b)
        self.low[b.block_id] = b
        if evicted:
            self.given_up.add(b.block_id)

    def _leave_low(self, b: KVBlock) -> bool:
        """Take ``b`` out of the interior queue (and ``given_up``) without evicting it; whether
        it was there."""
        self.given_up.discard(b.block_id)
        return self.low.pop(b.block_id, None) is not None

    def revive(self, b: KVBlock) -> None:
        """Cached block ``b`` serves hits again (a request recomputed it, or keeps a window that
        it is part of): back in the policy's order, a window block as kept."""
        if b.key is None:
            return
        b.dead = False
        b.kept = b.kept or bool(b.group)
        if b.ref_cnt == 0 and self._leave_low(b):
            self.policy.on_free(b)

    def pin(self, block: KVBlock, until: float) -> bool:
        """Keep a cached block from eviction until ``until`` (monotonic). Refused (False) when pins
        would exceed their share of the pool."""
        if block.key is None:
            return False
        if not block.pinned_until:  # a lapsed pin not yet expired still counts: extend it
            if self.num_pinned_blocks >= self.max_pinned:
                return False
            self.num_pinned_blocks += 1
        block.pinned_until = max(block.pinned_until, until)
        self._pin_expiry.push(block.block_id, block.pinned_until)
        return True

    def _expire_pins(self) -> None:
        if not self.num_pinned_blocks:
            return
        now = self.clock()
        expiry = self._pin_expiry
        while (top := expiry.peek()) is not None and top[0] <= now:
            bid = expiry.pop()[1]
            b = self.blocks[bid]
            b.pinned_until = 0.0
            self.num_pinned_blocks -= 1
            if self.pinned.pop(b.block_id, None) is not None:
                if b.dead:
                    self.low[b.block_id] = b
                else:
                    self.policy.on_free(b)

    def _uncache(self, b: KVBlock, evicted: bool) -> None:
        assert b.key is not None
        for listener in self.listeners:
            listener.on_removed(b)
        del self.index[b.key]
        if b.parent is not None:
            siblings = self.children.get(b.parent)
            if siblings is not None:
                siblings.discard(b.key)
                if not siblings:
                    del self.children[b.parent]
        if evicted and self.ghost_size:
            self.ghosts[b.key] = None
            if len(self.ghosts) > self.ghost_size:
                self.ghosts.popitem(last=False)
        if b.pinned_until:
            b.pinned_until = 0.0
            self.num_pinned_blocks -= 1
            self._pin_expiry.discard(b.block_id)
        b.key = None
        b.token_ids = None
        b.parent = None
        b.salt = None
        b.num_hits = 0
        b.priority = 0
        b.group = 0
        b.kept = False
        b.hit_kind = None
        b.dead = False
        b.chain = None

    def reset(self) -> tuple[int, int]:
        """Drop every free cached block and the memory of evicted keys (after a reset a miss is
        ``cold``, not ``evicted``). Returns (dropped, left_in_use)."""
        dropped = 0
        self.ghosts.clear()
        listeners, self.listeners = self.listeners, []  # one on_cleared, not one removal per block
        for b in list(self.index.values()):
            if b.ref_cnt == 0:
                if b.block_id in self.pinned:
                    del self.pinned[b.block_id]
                elif not self._leave_low(b):
                    self.policy.on_removed(b)
                self._uncache(b, evicted=False)
                self.empty.append(b.block_id)
                dropped += 1
        self.listeners = listeners
        for listener in listeners:
            listener.on_cleared()
        return dropped, len(self.index)

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """Raise AssertionError if any block is in more or fewer than one state."""
        empty = set(self.empty)
        assert len(empty) == len(self.empty), "duplicate in empty list"
        in_use = 0
        for b in self.blocks:
            states = (b.ref_cnt > 0) + (b.ref_cnt == 0 and b.key is not None) + (b.block_id in empty)
            assert states == 1, f"block {b.block_id} in {states} states (ref={b.ref_cnt}, key={b.key is not None})"
            assert b.ref_cnt >= 0
            if b.key is not None:
                assert self.index.get(b.key) is b, f"block {b.block_id} cached but not indexed"
            in_use += b.ref_cnt > 0
        assert in_use == self.num_in_use, f"num_in_use {self.num_in_use} != {in_use}"
        evictable = sum(1 for b in self.blocks if b.ref_cnt == 0 and b.key is not None)
        assert evictable == len(self.policy) + len(self.pinned) + len(self.low), \
            f"evictable {evictable} != policy {len(self.policy)} + pinned {len(self.pinned)} + low {len(self.low)}"
        assert self.given_up <= self.low.keys(), "a given-up block outside the interior queue"
        for b in self.low.values():
            assert b.ref_cnt == 0 and b.key is not None and (b.dead or (b.group and not b.kept)), \
                f"block {b.block_id} in the interior queue but not a free interior or dead block"
        assert len(self.index) == sum(1 for b in self.blocks if b.key is not None)
        pins = sum(1 for b in self.blocks if b.pinned_until)
        assert pins == self.num_pinned_blocks == len(self._pin_expiry), \
            f"pinned blocks {pins}, counted {self.num_pinned_blocks}, expiry entries {len(self._pin_expiry)}"
