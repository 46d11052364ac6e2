"""The simulated pool: a real ``BlockPool`` of a given capacity, with no more blocks allocated than
the trace can ever fill.

A ``BlockPool`` (and its eviction policy) allocates per-block state for its whole capacity up
front, so a pool of 10^8 tokens costs gigabytes even for a 2-request trace. A replay never holds
more than the trace's distinct full blocks (cached) plus one request's blocks (in use) at once;
a pool at least that large never evicts and never truncates a request, whatever its size. So a
larger capacity is replayed with exactly that many blocks, and the same result: only the share of
the pool that pins may take is still computed from the capacity asked for. Knows nothing about
trace files, routing or the command line.
"""

from __future__ import annotations

from typing import Callable, Sequence

from hotprefix.cache.block_pool import BlockPool
from hotprefix.cache.eviction import EvictionPolicy
from hotprefix.cache.hashing import BlockKey
from hotprefix.simulate.traces import TraceRequest, sim_hasher


def pool_blocks(reqs: Sequence[TraceRequest], capacity_tokens: int, block_size: int,
                keys: Sequence[Sequence[BlockKey]] | None = None) -> int:
    """Blocks to allocate for a pool of ``capacity_tokens``: ``capacity_tokens // block_size``,
    capped at the most the trace can hold at once (its distinct full blocks + its largest request).

    Args:
        keys: the requests' ``request_keys`` when already computed (saves hashing them here).
    Raises:
        ValueError: the capacity is less than one block.
    """
    num_blocks = capacity_tokens // block_size
    if num_blocks < 1:
        raise ValueError(f"capacity {capacity_tokens} tokens is less than one block of {block_size}")
    sizes = [-(-r.num_tokens // block_size) for r in reqs]
    largest = max(sizes, default=0)
    if num_blocks <= largest + sum(sizes):  # cheap bound first: may the pool fill at all?
        return num_blocks
    if keys is None:
        hasher = sim_hasher(block_size)
        distinct = len({k for r in reqs for k in hasher.keys(r.tokens(block_size))})
    else:
        distinct = len({k for ks in keys for k in ks})
    return max(1, min(num_blocks, distinct + largest))


def sim_pool(num_blocks: int, capacity_tokens: int, block_size: int, policy: str | EvictionPolicy,
             clock: Callable[[], float], max_pinned_fraction: float = 0.5) -> BlockPool:
    """A ``BlockPool`` of ``num_blocks`` (``pool_blocks``) that replays as one of
    ``capacity_tokens`` would: pins may take the share of the capacity asked for. No ghost list
    (a replay never asks why a block missed).

    Args:
        policy: an eviction policy name, or a policy made for ``num_blocks``.
        clock: the pool's clock (the replay's current timestamp).
    """
    pool = BlockPool(num_blocks, block_size, policy, ghost_size=0,
                     max_pinned_fraction=max_pinned_fraction, clock=clock)
    pool.max_pinned = int(capacity_tokens // block_size * max_pinned_fraction)
    return pool
