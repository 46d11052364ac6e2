"""The window groups of a hybrid pool: sliding-window layers keep only the blocks a query can see,
plus the windows before the points where later requests resume.

``kv_groups`` cuts a model's layers into groups that share one pool of pages. Group 0 (and every
full group: they share its block table) is the prefix cache as ``manager`` knows it. This module
is the rest: for each window group of window ``W`` it keeps a request's block table with holes,

  * a query at position p reads keys ``[p - W + 1, p]``, so a request computing from token ``c``
    holds only the blocks from ``first_needed(c)`` on; the ones before are released at once (a
    cached one stays findable: it is evictable);
  * a **hit point** is where a later request will resume: where a prompt ends, where the whole
    sequence ends (the next chat turn starts there), a cache breakpoint or message end given by the
    client, and where this request's prefix was seen to diverge from a cached one. The window
    blocks before a hit point are **kept** (evicted in the pool's normal order, like full blocks);
    every other released window block is **interior** and the first thing eviction takes
    (``BlockPool.low``);
  * a hit at block n needs group 0's blocks ``0..n-1`` and every window group's blocks
    ``first_needed(n * block_size)..n-1``; ``resume`` finds the longest such n at or below the full
    run. Never a block that is not there; token ids compared on every block.

A window block's key is its chain key tagged with its group (``group_key``): one state per block,
per group, as the pool's invariants demand. Knows nothing about tensors. Imports no torch.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

from hotprefix.cache.block import AdmitInfo, KVBlock
from hotprefix.cache.block_pool import BlockPool
from hotprefix.cache.hashing import BlockKey
from hotprefix.cache.kv_groups import first_needed_block, group_key, resume_point
from hotprefix.cache.window_keep import PROTECTED_KINDS, WindowKeeper

__all__ = ["PAD", "WindowGroups", "group_key"]

PAD = -1
"""Block-table entry of a window group where the request holds no block (out of every window)."""


@dataclass
class _WinState:
    tables: list[list[KVBlock | None]]
    """Per window group, the request's blocks by block index (None: not held)."""
    hit_points: dict[int, str] = field(default_factory=dict)
    """Block count -> kind: where later requests are expected to resume."""
    num_committed: int = 0
    released: list[int] = field(default_factory=list)
    """Per window group, the blocks before this index are released (or were never held)."""
    dups: dict[tuple[int, int], KVBlock] = field(default_factory=dict)
    """(group, block index) -> the cached copy of a block this request computed again: its
    window status follows this request's hit points at release."""


class WindowGroups:
    """The window groups' block tables, hits and hit points (one instance per manager)."""

    def __init__(self, pool: BlockPool, block_size: int, windows: dict[int, int]):
        """
        Args:
            windows: group index -> its window in keys, for every group but 0 (a full group
                past the first, as a model of 4 full and 22 window layers has with pages of 2
                layers, has window 0: it keeps every block, as group 0 does).
        """
        if not windows or 0 in windows or not any(windows.values()):
            raise ValueError("window groups need groups past 0, one of them with a window")
        self.pool = pool
        self.block_size = block_size
        self.groups = sorted(windows)
        self.windows = [windows[g] for g in self.groups]
        self.window = max(self.windows)
        self._reqs: dict[str, _WinState] = {}
        self.keeper = WindowKeeper(self)
        """Evicts a hit point's parts together (``window_keep``)."""
        self.hits_by_kind: Counter[str] = Counter()
        """Resumed hits by the kind of hit point whose window served them."""
        self.resumed_earlier = 0
        """Hits that resumed before the full groups' run because a window was gone."""

    # ------------------------------------------------------------------ arithmetic
    def first_needed(self, pos: int, window: int | None = None) -> int:
        """First block index that a query at ``pos`` (or later) reads, in a group of ``window``
        (default: the widest window; 0: a full group, which reads from block 0)."""
        return first_needed_block(pos, self.window if window is None else window, self.block_size)

    def window_blocks(self, n: int, window: int | None = None) -> range:
        """The block indices a group of ``window`` must hold to resume at block ``n``."""
        return range(self.first_needed(n * self.block_size, window), n)

    def _kept(self, st: _WinState, i: int, window: int) -> bool:
        """Whether a hit point of ``st`` has a window covering block ``i`` (else: interior)."""
        return any(self.first_needed(m * self.block_size, window) <= i < m for m in st.hit_points)

    # ------------------------------------------------------------------ lookup
    def resume(self, keys: Sequence[BlockKey], token_ids: Sequence[int], n_full: int) -> int:
        """The longest n <= ``n_full`` at which every window group holds the window's blocks
        (``kv_groups.resume_point``: the rule the router scores a hybrid replica by)."""
        bs = self.block_size
        lookup = self.pool.lookup
        return resume_point(
            n_full, zip(self.groups, self.windows), bs,
            lambda g, i: lookup(group_key(keys[i], g), token_ids[i * bs:(i + 1) * bs]) is not None)

    def window_hits(self, keys: Sequence[BlockKey], n: int) -> list[list[KVBlock]]:
        """Per group, its cached blocks of the window before block ``n``."""
        return [[self.pool.index[group_key(keys[i], g)] for i in self.window_blocks(n, w)]
                for g, w in zip(self.groups, self.windows)]

    # ------------------------------------------------------------------ allocation
    def pages_needed(self, request_id: str, num_computed: int, num_tokens: int, resume: int) -> int:
        """Pages an ``allocate`` of ``num_tokens`` more tokens after ``num_computed`` would take."""
        hi = -(-(num_computed + num_tokens) // self.block_size)
        st = self._reqs.get(request_id)
        need = 0
        for gi, w in enumerate(self.windows):
            lo = self.first_needed(num_computed, w)
            if st is None:
                held = set(self.window_blocks(resume, w)) if resume else set()
                need += sum(1 for i in range(lo, hi) if i not in held)
            else:
                t = st.tables[gi]
                need += sum(1 for i in range(lo, hi) if i >= len(t) or t[i] is None)
        return need

    def pages_to_hold(self, num_tokens: int, chunk: int) -> int:
        """Most pages the groups hold at once for one sequence of ``num_tokens`` computed in
        chunks of up to ``chunk`` tokens."""
        bs = self.block_size
        blocks = -(-num_tokens // bs)
        return sum(blocks if not w else min(blocks, -(-(w - 1 + chunk) // bs) + 1)
                   for w in self.windows)

    def evictable_hits(self, keys: Sequence[BlockKey], resume: int) -> int:
        """Window blocks a resume at ``resume`` would take out of the evictable ones."""
        if not resume:
            return 0
        return sum(1 for blocks in self.window_hits(keys, resume) for b in blocks
                   if b.ref_cnt == 0 and b.block_id not in self.pool.pinned)

    def release_out_of_window(self, request_id: str, num_computed: int) -> None:
        """Drop the request's blocks that no query from ``num_computed`` on will read."""
        st = self._reqs.get(request_id)
        if st is None:
            return
        for gi, (t, w) in enumerate(zip(st.tables, self.windows)):
            lo = min(self.first_needed(num_computed, w), len(t))
            for i in range(st.released[gi], lo):  # each block released once, not rescanned
                if t[i] is not None:
                    self._release(st, t[i], i, gi)
                    t[i] = None
            st.released[gi] = max(st.released[gi], lo)

    def admit(self, request_id: str, keys: Sequence[BlockKey], resume: int,
              hit_points: dict[int, str]) -> None:
        """A request's first allocation: reference the window hits before ``resume`` (before
        anything is allocated, which could evict them)."""
        st = self._reqs[request_id] = _WinState([[] for _ in self.groups], dict(hit_points),
                                                released=[0] * len(self.groups))
        if resume:
            self._take_hits(st, keys, resume)

    def allocate(self, request_id: str, num_computed: int, num_tokens: int) -> None:
        """Hold (and take) the blocks ``first_needed(num_computed)`` .. the end of the chunk in every
        window group. The caller has checked ``pages_needed`` against the pool."""
        st = self._reqs[request_id]
        hi = -(-(num_computed + num_tokens) // self.block_size)
        for t, w in zip(st.tables, self.windows):
            lo = self.first_needed(num_computed, w)
            if len(t) < hi:
                t.extend([None] * (hi - len(t)))
            want = [i for i in range(lo, hi) if t[i] is None]
            got = self.pool.allocate(len(want)) if want else []
            assert got is not None, "pages_needed was not checked"
            for i, b in zip(want, got):
                t[i] = b

    def _take_hits(self, st: _WinState, keys: Sequence[BlockKey], resume: int) -> None:
        hits = self.window_hits(keys, resume)
        last = hits[self.windows.index(self.window)][-1]
        kind = last.hit_kind or "window"
        self.hits_by_kind[kind] += 1
        # where this request resumed stays a hit point: when a later turn's tail is evicted, the
        # conversation can still resume from an earlier turn's end (measured: dropping old turns'
        # windows as interior lost more hits in a pool near its capacity: bench_hybrid_pool.py)
        st.hit_points.setdefault(resume, kind)
        for t, blocks in zip(st.tables, hits):
            self.pool.touch(blocks)
            lo = resume - len(blocks)
            t.extend([None] * (resume - len(t)))
            for i, b in enumerate(blocks, lo):
                t[i] = b
        st.num_committed = resume
        self.keeper.supersede(keys, resume)

    # ------------------------------------------------------------------ caching
    def commit(self, request_id: str, keys: Sequence[BlockKey], token_ids: Sequence[int],
               n_full: int, salt_of) -> None:
        """Cache the window blocks that are full and computed, where group 0 cached the block
        (the full groups' admission rules decide for every group)."""
        st = self._reqs.get(request_id)
        if st is None:
            return
        bs = self.block_size
        for i in range(st.num_committed, min(n_full, len(keys))):
            if keys[i] not in self.pool.index:
                continue  # not written (tail rule, cache_write off): its window blocks neither
            toks = token_ids[i * bs:(i + 1) * bs]
            for g, t in zip(self.groups, st.tables):
                b = t[i] if i < len(t) else None
                if b is None or b.key is not None:
                    continue
                key = group_key(keys[i], g)
                if key in self.pool.index:  # computed twice: the cached copy stays, this one
                    st.dups[(g, i)] = self.pool.index[key]  # is freed empty (``_release``)
                    continue
                self.cache_block(b, keys, toks, i, g, salt_of(i))
        st.num_committed = max(st.num_committed, n_full)

    def cache_block(self, b: KVBlock, keys: Sequence[BlockKey], token_ids: Sequence[int], i: int,
                    g: int, salt: str | None) -> bool:
        """Cache ``b`` as group ``g``'s block ``i`` (computed here, or loaded from a KV tier)."""
        b.group = g
        b.chain = (keys[i], keys[i - 1] if i else None)
        info = AdmitInfo(depth=i, parent=group_key(keys[i - 1], g) if i else None, salt=salt)
        return self.pool.cache_block(b, group_key(keys[i], g), token_ids, info)

    # ------------------------------------------------------------------ release
    def _release(self, st: _WinState, b: KVBlock, i: int, gi: int) -> None:
        window = self.windows[gi]
        cached = b if b.key is not None else st.dups.pop((self.groups[gi], i), None)
        if cached is not None and cached.key is not None:
            kept = not window or self._kept(st, i, window)
            kind = st.hit_points.get(i + 1)
            if kind is not None and (cached.hit_kind is None or kind in PROTECTED_KINDS):
                cached.hit_kind = kind
            if cached is b:
                b.kept = b.kept or kept
            elif kept:  # the copy this request computed again stands for it in its windows
                self.pool.revive(cached)
        self.pool.free([b])

    def free(self, request_id: str, keys: Sequence[BlockKey] | None = None) -> None:
        """Release every window block of the request; the sequence's end is a hit point."""
        st = self._reqs.pop(request_id, None)
        if st is None:
            return
        end = st.num_committed
        if end:
            st.hit_points.setdefault(end, "sequence_end")
        for gi, t in enumerate(st.tables):
            for i in range(len(t) - 1, -1, -1):
                if t[i] is not None:
                    self._release(st, t[i], i, gi)
        if end and keys is not None:
            # the next turn resumes at the sequence's end: the windows below it, of this prompt's
            # end, where it resumed and earlier turns, are interior now (``window_keep``)
            self.keeper.supersede(keys, end)

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> list[tuple[int, int]] | None:
        """The child holds the parent's window blocks of its first ``num_tokens`` tokens (a copy
        of the partial last one). Returns the pairs to copy, or None (nothing taken)."""
        st = self._reqs[parent_id]
        n_full, partial = divmod(num_tokens, self.block_size)
        new: list[KVBlock] = []
        if partial:
            got = self.pool.allocate(len(self.groups))
            if got is None:
                return None
            new = got
        tables, pairs = [], []
        for gi, t in enumerate(st.tables):
            shared = [b for b in t[:n_full] if b is not None]
            self.pool.share(shared)
            ct = list(t[:n_full]) + [None] * (n_full - len(t[:n_full]))
            if partial:
                ct.append(new[gi])
                pairs.append((t[n_full].block_id, new[gi].block_id))
            tables.append(ct)
        self._reqs[child_id] = _WinState(tables, dict(st.hit_points), min(st.num_committed, n_full),
                                         released=[0] * len(self.groups))
        return pairs

    # ------------------------------------------------------------------ views
    def tables(self, request_id: str) -> list[list[int]]:
        """Per window group, the request's block ids (``PAD`` where it holds none)."""
        st = self._reqs.get(request_id)
        if st is None:
            return [[] for _ in self.groups]
        return [[b.block_id if b is not None else PAD for b in t] for t in st.tables]

    def describe(self, num_groups: int) -> list[dict]:
        """Per group (0 .. ``num_groups - 1``): pages in use and cached (the operator's view)."""
        in_use = [0] * num_groups
        for st in self._reqs.values():
            for g, t in zip(self.groups, st.tables):
                in_use[g] += sum(b is not None for b in t)
        in_use[0] = self.pool.num_in_use - sum(in_use)  # the rest is group 0's
        cached = [0] * num_groups
        kept = [0] * num_groups
        for b in self.pool.index.values():
            cached[b.group] += 1
            kept[b.group] += b.kept
        return [{"group": g, "pages_in_use": in_use[g], "pages_cached": cached[g],
                 "pages_kept": kept[g] if g else cached[g]} for g in range(num_groups)]

    def num_held(self, request_id: str) -> int:
        st = self._reqs.get(request_id)
        return sum(b is not None for t in st.tables for b in t) if st else 0
