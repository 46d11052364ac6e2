"""One KV block as the cache sees it, and what is recorded about it when it is cached.

A leaf module: the pool (``block_pool``), the eviction policies (``eviction``) and the manager
all import it, and it imports nothing of theirs. It knows nothing about tensors (the K/V of
block ``block_id`` live in the runner) and nothing about requests. Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from hotprefix.cache.hashing import BlockKey


@dataclass(eq=False)
class KVBlock:
    """One block of ``block_size`` token slots in the KV pool."""

    block_id: int
    """Index into the runner's KV tensors."""
    ref_cnt: int = 0
    """Requests currently holding this block."""
    key: BlockKey | None = None
    """Content key when cached (full and registered), else None."""
    token_ids: tuple[int, ...] | None = None
    """The tokens the cached K/V were computed from (compared on every hit)."""
    parent: BlockKey | None = None
    """Key of the previous block in the chain (None for block 0)."""
    depth: int = 0
    """Block index within its sequence."""
    salt: str | None = None
    """Tenant salt that entered the key chain at this block (None elsewhere)."""
    num_hits: int = 0
    """Times this cached block was matched by a later request."""
    pinned_until: float = 0.0
    """Never evicted before this monotonic time (retention pin); 0 = not pinned."""
    priority: int = 0
    """Retention priority (higher = kept longer by priority-aware policies)."""
    group: int = 0
    """KV group whose key the block is cached under (``kv_groups``; 0: the full group)."""
    kept: bool = False
    """A window group's block inside the window before a hit point: evicted in the policy's
    order. A cached window block that is not kept is interior: evicted before anything else."""
    hit_kind: str | None = None
    """The kind of hit point that ends at this window block (``window_groups``), if any."""
    dead: bool = False
    """A hybrid pool's cached block that no hit can use any more (its hit points lost a block
    they need: ``window_keep``): evicted with the interior window blocks, before anything else."""
    chain: tuple[BlockKey, BlockKey | None] | None = None
    """A cached window group's block: (the chain key its group key was made from, the previous
    block's chain key or None at block 0). KV events name a window block by these, as vLLM names
    every group's blocks by the one chain hash (plus ``group_idx``)."""


@dataclass(frozen=True)
class AdmitInfo:
    """Where a block sits in its chain, given to ``BlockPool.cache_block`` when it is cached
    (the pool copies these onto the ``KVBlock``; policies read them there)."""

    depth: int
    """Block index within its request."""
    parent: BlockKey | None
    """Key of the previous block (the namespace for block 0)."""
    priority: int = 0
    """Retention priority requested for this block."""
    salt: str | None = None
    """Tenant salt that entered the key chain at this block."""
