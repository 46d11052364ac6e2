"""Content-addressed block keys.

A block's key is a chained hash ``H(parent_key, token_ids, extra_keys)``. The chain's root is the
**namespace** (a fingerprint of the model weights and of the tokenizer), so blocks computed by another
checkpoint or tokenizer can never be found. Extra keys are type-tagged (``("salt", "tenant-a")``,
``("adapter", "x")``) and serialized with their tag and length, so different kinds never collide.

``sha256`` is the default and is safe when several tenants share the pool. ``fast`` uses Python's
built-in 64-bit tuple hash: cheaper, valid only inside one process, and collisions can be
constructed deliberately, so never use it with several tenants (a token comparison on every hit
still keeps a collision from returning wrong K/V, but it could evict or shadow another's blocks).

Imports no torch.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from typing import NewType, Sequence

BlockKey = NewType("BlockKey", bytes)
ExtraKey = tuple[str, str]

_KINDS = ("salt", "adapter", "mm", "custom")


def namespace_key(model_fingerprint: str, tokenizer_fingerprint: str) -> BlockKey:
    """The root of every key chain for this model + tokenizer."""
    data = b"hotprefix/ns/v1\0" + model_fingerprint.encode() + b"\0" + tokenizer_fingerprint.encode()
    return BlockKey(hashlib.sha256(data).digest())


def _encode_extras(extra_keys: Sequence[ExtraKey]) -> bytes:
    out = bytearray()
    for kind, value in extra_keys:
        if kind not in _KINDS:
            raise ValueError(f"unknown extra key kind {kind!r}; known: {_KINDS}")
        k, v = kind.encode(), str(value).encode()
        out += struct.pack("<HI", len(k), len(v)) + k + v
    return bytes(out)


def hash_block(parent: BlockKey, token_ids: Sequence[int], extra_keys: Sequence[ExtraKey] = (),
               algo: str = "sha256") -> BlockKey:
    """Key of one full block, chained to its parent's key."""
    if algo == "fast":
        return BlockKey(hash((parent, tuple(token_ids), tuple(extra_keys))).to_bytes(8, "little", signed=True))
    h = hashlib.sha256(parent)
    h.update(struct.pack("<I", len(token_ids)))
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(b"\1" + _encode_extras(extra_keys))
    return BlockKey(h.digest())


class BlockHasher:
    """Computes the key chain of a token sequence, block by block, for one namespace.

    ``salt`` enters at block ``salt_from_block`` (0 = the first block: full tenant isolation; k > 0
    lets tenants share the first k blocks, e.g. a common system prompt, and isolates the rest).
    """

    def __init__(self, namespace: BlockKey, block_size: int, algo: str = "sha256"):
        self.namespace = namespace
        self.block_size = block_size
        self.algo = algo

    def extend(self, keys: list[BlockKey], token_ids: Sequence[int], salt: str | None = None,
               salt_from_block: int = 0, namespace: BlockKey | None = None) -> list[BlockKey]:
        """Append keys for every full block of ``token_ids`` not yet in ``keys`` (in place)."""
        bs = self.block_size
        parent = keys[-1] if keys else (namespace or self.namespace)
        for i in range(len(keys), len(token_ids) // bs):
            extra: tuple[ExtraKey, ...] = (("salt", salt),) if salt is not None and i == salt_from_block else ()
            parent = hash_block(parent, token_ids[i * bs:(i + 1) * bs], extra, self.algo)
            keys.append(parent)
        return keys

    def keys(self, token_ids: Sequence[int], salt: str | None = None, salt_from_block: int = 0,
             namespace: BlockKey | None = None) -> list[BlockKey]:
        return self.extend([], token_ids, salt, salt_from_block, namespace)
