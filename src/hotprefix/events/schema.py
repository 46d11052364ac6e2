"""vLLM's KV event types, as msgspec structs of the same shape, and their encoders.

A batch is ``KVEventBatch(ts, events, data_parallel_rank)``, always encoded as a positional
msgpack array; each event is a *tagged* struct (the tag is the class name). vLLM has put the events
on the wire in two ways, and both are offered (``CacheConfig.kv_events_format``):

  ``array``  tagged positional arrays, ``["BlockStored", hashes, parent, tokens, block_size,
             lora_id, medium, lora_name]`` (``array_like=True``: vLLM up to 0.23, SGLang, and every
             router built for them; routers updated for ``map`` read these too). The default.
  ``map``    tagged maps, ``{"type": "BlockStored", "block_hashes": ...}`` (vLLM after its PR
             42892 dropped ``array_like`` from the events).

Fields are vLLM's, in vLLM's order: a decoder of an older vLLM that knows fewer trailing fields
ignores ``lora_name``; one of a newer vLLM finds every field it requires. Block hashes are the
block keys' bytes (vLLM's ``ExternalBlockHash`` is ``bytes | int``; bytes is its default since it
hashes with sha256): a router that computes keys as hotprefix does (``hotprefix.router``) matches
them byte for byte. ``parent_block_hash`` is None for a chain's first block (the namespace is
not a block).

A hybrid pool (``cache.kv_groups``: sliding-window layers in groups of their own) announces every
group's blocks, as vLLM's hybrid KV cache manager does: each event carries ``group_idx`` (and a
``BlockStored`` the group's ``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window``), and a
block is named by its chain hash in every group (the hash of group 0's block at that position);
the trailing optional fields vLLM added for this, in its order (``extra_keys``, which hotprefix
leaves None, comes first). A pool of one group leaves them all None: its messages are those of
a vLLM before them, byte for byte (``omit_defaults``).

``medium`` names where the blocks are: ``GPU`` for the engine's KV pool (vLLM's name for its pool,
whatever the device), ``CPU`` / ``DISK`` / ``REDIS`` for the KV tiers below it (``TIER_MEDIA``).
Imports no torch.
"""

# No ``from __future__ import annotations``: msgspec resolves the fields of the classes that
# ``_event_types`` defines locally from the real annotations.
from dataclasses import dataclass
from typing import Any, Union

import msgspec

BlockHash = Union[bytes, int]
"""A block's hash on the wire (vLLM's ``ExternalBlockHash``); hotprefix sends ``bytes``."""
MEDIUM_POOL = "GPU"
"""The engine's KV pool, named as vLLM names its own (``MEDIUM_GPU``) on every device."""
TIER_MEDIA = {"host": "CPU", "disk": "DISK", "redis": "REDIS"}
"""KV tier kind (``hotprefix.cache.tiers``) -> the medium its blocks are reported in."""
SHARED_MEDIA = frozenset({"REDIS"})
"""Media shared by every replica that names the same store (a router may load them anywhere)."""
FORMATS = ("array", "map")
KIND_FULL = "full_attention"
"""``kv_cache_spec_kind`` of a full group (vLLM's ``KVCacheSpecKind.FULL_ATTENTION``)."""
KIND_WINDOW = "sliding_window"
"""``kv_cache_spec_kind`` of a sliding-window group (vLLM's ``KVCacheSpecKind.SLIDING_WINDOW``)."""


@dataclass(frozen=True)
class EventTypes:
    """One encoding's struct classes (same names and fields in both)."""

    KVEventBatch: Any
    BlockStored: Any
    BlockRemoved: Any
    AllBlocksCleared: Any
    format: str
    StoredOneGroup: Any = None
    """``BlockStored`` without vLLM's group fields, what a pool of one group sends: an
    ``array_like`` struct encodes every field, defaults too, so the array format needs the short
    shape to stay byte for byte what it was (same tag; ``BlockStored`` decodes it). The map
    format omits defaults: there it is ``BlockStored``."""
    RemovedOneGroup: Any = None
    """``BlockRemoved`` without ``group_idx``, likewise."""


def _event_types(array_like: bool) -> EventTypes:
    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True):
        """Base of the events (tag = class name)."""

    class BlockStored(KVCacheEvent):
        block_hashes: list[BlockHash]
        """A chain of blocks, first to last; each one's parent is the one before."""
        parent_block_hash: BlockHash | None
        """Parent of the first block; None for a sequence's first block."""
        token_ids: list[int]
        """The blocks' tokens, ``block_size`` per block, in order."""
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        """vLLM's extra keys of each block (hotprefix sends none: its keys carry them)."""
        group_idx: int | None = None
        """The blocks' KV group (``kv_groups``); None from a pool of one group."""
        kv_cache_spec_kind: str | None = None
        """The group's kind in vLLM's words (``KIND_FULL``, ``KIND_WINDOW``); None with one group."""
        kv_cache_spec_sliding_window: int | None = None
        """A window group's window in keys; None for a full group."""

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[BlockHash]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]

    stored, removed = (_one_group_types(KVCacheEvent) if array_like else (BlockStored, BlockRemoved))
    return EventTypes(KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared,
                      "array" if array_like else "map", stored, removed)


def _one_group_types(base: Any) -> tuple[Any, Any]:
    """``BlockStored`` and ``BlockRemoved`` as vLLM sent them before its group fields."""

    class BlockStored(base):
        block_hashes: list[BlockHash]
        parent_block_hash: BlockHash | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None

    class BlockRemoved(base):
        block_hashes: list[BlockHash]
        medium: str | None

    return BlockStored, BlockRemoved


ARRAY = _event_types(array_like=True)
MAP = _event_types(array_like=False)


def event_types(fmt: str = "array") -> EventTypes:
    """The struct classes of encoding ``fmt`` (``array`` or ``map``)."""
    if fmt not in FORMATS:
        raise ValueError(f"KV events format must be one of {FORMATS}, got {fmt!r}")
    return ARRAY if fmt == "array" else MAP


def decoder(fmt: str = "array") -> msgspec.msgpack.Decoder:
    """A decoder of ``KVEventBatch`` payloads in encoding ``fmt``."""
    return msgspec.msgpack.Decoder(event_types(fmt).KVEventBatch)
