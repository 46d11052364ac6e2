"""Eviction that keeps a hybrid pool's hit points whole: what no hit can use leaves first.

A hit at block n needs the full groups' blocks ``0..n-1`` *and* every window group's window before
n (``window_groups``). The eviction policy orders single blocks; left alone, it takes a
conversation's last full block and leaves the window after it cached (useless: no hit can reach
it), or keeps a conversation's full chain whose every window is gone. Here, the parts of a hit
point go together, and what has lost its purpose moves to the pool's ``low`` queue (evicted before
anything else) the moment it does:

  * **a full block is evicted** (the policy took block d of a chain): every window block at index
    ``>= d`` on the chains through it is dead. Then the longest resume point ``m* <= d`` still
    whole on that chain is found (``kv_groups.resume_point``); the full and window blocks in
    ``[m*, d)`` serve no hit either and are dead too, down to the first block that another cached
    chain goes on from (a shared system prompt stays) or that a running request holds;
  * **a kept window block is evicted**: the other window groups' blocks at its index (same or
    narrower window) lose every hit point they served. If no hit point past it on its chain is
    whole any more, the chain is cut as for a full block: from the longest resume point still
    whole to the chain's leaf, its full and window blocks serve no hit and are dead (not past a
    branch, nor when a running request holds the chain). Left alone, a conversation whose last
    window the policy took kept its ~100 full blocks in the policy's order, useless;
  * **a later turn resumed past an earlier one** (``supersede``): the windows of the conversation's
    earlier prompt, sequence and turn ends, below the window this request reads, are demoted. In
    a chat only the last turn's end is where the next turn resumes; a pool that keeps every turn's
    window holds ``window + turns x turn length`` per conversation instead of one window, and
    near its capacity the sessions whose windows it keeps twice cost other sessions their only
    one (bench_swa_chat_replay, a pool of 6.5 sessions' full K/V: no turn re-prefilled without the
    turn ends' windows, 9 of 80 with them). A branch (a cached block with another child) stops it, and so does a window a
    client asked for (cache breakpoint), a system prompt's end (``message_end``: where other
    conversations resume) or one seen as a divergence point.

A dead block that a request recomputes or hits is alive again (``BlockPool.revive``, ``touch``).
Never a wrong hit: this only changes *when* blocks are evicted, never what a lookup accepts.
Imports no torch.
"""

from __future__ import annotations

from typing import Any, Sequence

from hotprefix.cache.block import KVBlock
from hotprefix.cache.hashing import BlockKey
from hotprefix.cache.kv_groups import first_needed_block, group_key, resume_point

PROTECTED_KINDS = frozenset({"breakpoint", "message_end", "divergence"})
"""Hit points that ``supersede`` never demotes: a client asked for them, other conversations resume
there (a system prompt's end), or another prompt went on differently there. A ``turn_end`` (an
earlier turn of the same conversation) is not one of them."""
SUPERSEDE_WINDOWS = 4
"""How far below a resumed request's window ``supersede`` looks, in windows: each turn demotes the
ones just below it, so a conversation's older turn ends were demoted by the turns before."""


class WindowKeeper:
    """The cascade of one hybrid pool (``BlockPool.on_policy_evict``) and ``supersede``."""

    def __init__(self, groups: Any):
        """``groups``: the pool's ``window_groups.WindowGroups`` (pool, block_size, groups,
        windows, window)."""
        self.wg = groups
        self.pool = groups.pool
        self.num_dead = 0
        """Blocks marked dead so far (demoted to ``low``), for stats and tests."""
        self.pool.on_policy_evict = self.on_policy_evict

    def _demote(self, b: KVBlock | None, victim: KVBlock) -> None:
        if b is not None and b is not victim and not b.dead and b.ref_cnt == 0:
            self.pool.demote(b, evicted=True)
            self.num_dead += 1

    # ------------------------------------------------------------------ the cascade
    def on_policy_evict(self, b: KVBlock) -> None:
        if b.key is None:
            return
        if b.group == 0:
            self._full_evicted(b)
        elif b.chain is not None:
            self._window_evicted(b)

    def _window_evicted(self, b: KVBlock) -> None:
        wg, pool, index = self.wg, self.pool, self.pool.index
        w = wg.windows[wg.groups.index(b.group)]
        for g, wo in zip(wg.groups, wg.windows):
            if g != b.group and 0 < wo <= w:
                self._demote(index.get(group_key(b.chain[0], g)), b)
        if not b.kept:
            return
        # the hit points it served are gone: if none past it on its chain is whole, cut the chain
        top = index.get(b.chain[0])
        if top is None or top.group or top.depth != b.depth:
            return
        below = [top]  # its chain from here to the leaf, not past a branch
        while True:
            kids = [c for c in map(index.get, pool.children.get(below[-1].key, ()))
                    if c is not None and not c.group]
            if not kids:
                break
            if len(kids) > 1:
                return  # another chain goes on from here: its hit points may need these
            below.append(kids[0])
        above = self._chain_to(top.parent, b.depth)
        if above is None:
            return
        chain = above + below
        gone = b.key
        m = resume_point(len(chain), zip(wg.groups, wg.windows), wg.block_size,
                         lambda g, j: (k := group_key(chain[j].key, g)) != gone and k in index)
        if m <= b.depth:  # else a hit point past it still has its window
            self._cut(chain, m, b)

    def _full_evicted(self, b: KVBlock) -> None:
        wg, pool, index = self.wg, self.pool, self.pool.index
        # window blocks at its index and below it in the tree: no hit reaches them now
        for g in wg.groups:
            stack = [group_key(b.key, g)]
            while stack:
                k = stack.pop()
                blk = index.get(k)
                if blk is None:
                    continue
                self._demote(blk, b)
                stack.extend(pool.children.get(k, ()))
        chain = self._chain_to(b.parent, b.depth)
        if chain is None:
            return
        m = resume_point(b.depth, zip(wg.groups, wg.windows), wg.block_size,
                         lambda g, i: group_key(chain[i].key, g) in index)
        self._cut(chain + [b], m, b)

    def _chain_to(self, parent: BlockKey | None, d: int) -> list[KVBlock] | None:
        """The cached full blocks ``0..d-1`` that end at ``parent``, root first; None when the
        chain is broken (or is not one of this pool's chains: left to the policy)."""
        index = self.pool.index
        chain: list[KVBlock] = []
        while len(chain) < d:
            blk = index.get(parent) if parent is not None else None
            if blk is None or blk.group or blk.depth != d - 1 - len(chain):
                return None
            chain.append(blk)
            parent = blk.parent
        chain.reverse()
        return chain

    def _cut(self, chain: list[KVBlock], m: int, victim: KVBlock) -> None:
        """Demote ``chain``'s full blocks from its end down to index ``m`` (the longest resume
        point still whole) and their window blocks: they serve no hit. Stops at a block that a
        running request holds or that another cached chain goes on from."""
        wg, pool, index = self.wg, self.pool, self.pool.index
        for j in range(len(chain) - 1, m - 1, -1):
            blk = chain[j]
            nxt = chain[j + 1].key if j + 1 < len(chain) else None
            if blk is not victim and (blk.ref_cnt or any(
                    k != nxt for k in pool.children.get(blk.key, ()))):
                return  # held by a running request, or another cached chain goes on from here
            for g in wg.groups:  # at or past m*: no longer in any window a live hit needs
                self._demote(index.get(group_key(blk.key, g)), victim)
            self._demote(blk, victim)

    # ------------------------------------------------------------------ superseded turn ends
    def supersede(self, keys: Sequence[BlockKey], resume: int) -> None:
        """A request resumed at block ``resume`` of its chain: demote the kept windows of earlier
        prompt and sequence ends just below the window it reads (see the module's docstring)."""
        wg, pool, index = self.wg, self.pool, self.pool.index
        bs = wg.block_size
        lo = first_needed_block(resume * bs, wg.window, bs)
        span = max(1, -(-wg.window // bs))
        stop = max(0, lo - SUPERSEDE_WINDOWS * span)
        protect_below = lo  # window blocks at or above this index serve a protected hit point
        # from a window above ``lo``: a hit point there (or a branch) has a window reaching below it
        for i in range(min(lo + span, len(keys) - 1) - 1, stop - 1, -1):
            if any(k != keys[i + 1] for k in pool.children.get(keys[i], ())):
                return  # a branch: the windows below may serve the other chain's hit points
            blocks = [index.get(group_key(keys[i], g)) for g in wg.groups]
            if any(blk is not None and blk.hit_kind in PROTECTED_KINDS for blk in blocks):
                protect_below = min(protect_below, i + 1 - span)  # its window: [i + 1 - span, i]
            if i >= protect_below:
                continue
            for blk, w in zip(blocks, wg.windows):
                if blk is not None and w and blk.kept and blk.ref_cnt == 0 \
                        and blk.block_id not in pool.pinned:
                    pool.demote(blk)
                    self.num_dead += 1
