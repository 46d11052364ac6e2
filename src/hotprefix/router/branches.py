"""Which cached blocks are read by more than one continuation: the router's view of the prefix tree.

Every prompt the router routes tells it, for each of its blocks, which block follows it. A block
followed by two different blocks is a *branch point*: a shared prefix (a system prompt, a document
asked about twice) ends at or after it. A block only ever followed by one block lies on a single
path: everything before the next branch point is read only by that path's requests (one
conversation's history).

The router uses this to price moving a request away from the replica that holds its prefix: the
holder's copy of the *private* part (``private_from``) has no other reader, so a move strands it
there (dead blocks that take pool space until that pool evicts them), while the holder's copy of a
shared part keeps serving the other continuations (copying it elsewhere replicates a hot prefix).

Bounded and forgetful like the decision memory (``TtlMap``): a branch forgotten reads as a path,
so the error is to price a move a little higher, never to lose a block. Imports no torch.
"""

from __future__ import annotations

from typing import Sequence

from hotprefix.cache.hashing import BlockKey
from hotprefix.router.memory import TtlMap

BRANCH = b""
"""Stored instead of a child key once a block has had two different children (no key is empty)."""


class BranchMap:
    """block key -> its one child seen so far, or ``BRANCH``."""

    def __init__(self, ttl_s: float, max_entries: int):
        self._next: TtlMap[BlockKey, bytes] = TtlMap(ttl_s, max_entries)

    def __len__(self) -> int:
        return len(self._next)

    def add(self, keys: Sequence[BlockKey], now: float) -> None:
        """A prompt of these block keys was routed: each block is followed by the next."""
        nxt = self._next
        for parent, child in zip(keys, keys[1:]):
            seen = nxt.get(parent, now)
            nxt.set(parent, child if seen is None or seen == child else BRANCH, now)

    def is_branch(self, key: BlockKey, follower: BlockKey | None, now: float) -> bool:
        """Does a block other than ``follower`` (None: any block) follow ``key``?"""
        seen = self._next.get(key, now)
        return seen is not None and (seen == BRANCH or seen != follower)

    def private_from(self, keys: Sequence[BlockKey], start: int, end: int, now: float) -> int:
        """The first index in ``[start, end]`` from which ``keys[i:end]`` are read by this prompt's
        path only: past the last branch point among ``keys[start:end]`` (a block followed by
        something other than this prompt's next block). ``end``: no private block."""
        for i in range(end - 1, start - 1, -1):
            if self.is_branch(keys[i], keys[i + 1] if i + 1 < len(keys) else None, now):
                return i + 1
        return start
