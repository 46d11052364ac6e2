"""A hybrid pool's tier entry: one block's K/V as a part per KV group, each verified on its own.

A hybrid pool (``kv_groups``) keeps a block's K/V in one page per group: group 0's (the full
group, whose chain the tiers are keyed by) for every cached block, a window group's only while the
pool still has it. An entry holds group 0's part always and each other group's part that the pool
had when the entry was written. Layout (integers little-endian)::

    b"HPKG"  version:u16  count:u16  (group:u16  length:u32) * count  crc32(all before)[4]  parts

Each part is an ordinary blob (``blob.encode_blob``) of that group's page: its key is the group's
block key (the chain key for group 0, ``kv_groups.group_key`` for the others), its parent the
chain's parent, with the block's token ids and the entry's layout; so each part carries its own
checksum and, with a secret, its own signature, and is checked as a whole-model block is. The frame
(group list and lengths) has its own checksum; it is not signed, and needs not be: a part moved to
another group's place fails that group's key check.

On a load, a bad frame or a bad group-0 part rejects the whole entry (``CorruptEntry`` or
``BadSignature``, as ``decode_blob``); a bad part of another group is dropped alone and reported,
so that group's block is not installed and a hit resumes where the groups still present allow.

Knows nothing about tiers, tensors or pools. Imports no torch.
"""

from __future__ import annotations

import struct
import zlib
from typing import Mapping, Sequence

from hotprefix.cache.kv_groups import group_key
from hotprefix.cache.tiers.blob import BadSignature, CorruptEntry, decode_blob, encode_blob

MAGIC = b"HPKG"
GROUP_BLOB_VERSION = 1
_HEAD = struct.Struct("<4sHH")  # magic, version, part count
_PART = struct.Struct("<HI")  # group, part length


def part_key(key: bytes, group: int) -> bytes:
    """The key a group's part is stored and checked under."""
    return bytes(key) if group == 0 else bytes(group_key(key, group))


def encode_groups(key: bytes, parent: bytes | None, token_ids: Sequence[int], layout: str,
                  parts: Mapping[int, bytes | memoryview], *, secret: bytes | None = None) -> bytes:
    """Build the entry of one block from its groups' pages.

    Args:
        key: the block's chain key (group 0's key).
        parent: the previous block's chain key (the namespace, or None, at block 0).
        token_ids: the block's token ids.
        layout: the runner's layout tag (pages and groups).
        parts: group -> that group's page bytes; group 0 must be there.
        secret: when given, every part is signed (HMAC-SHA256) with it.

    Raises:
        ValueError: no group-0 part.
    """
    if 0 not in parts:
        raise ValueError("a group entry needs group 0's part")
    groups = sorted(parts)
    blobs = [encode_blob(part_key(key, g), parent, token_ids, layout, parts[g], secret=secret)
             for g in groups]
    frame = _HEAD.pack(MAGIC, GROUP_BLOB_VERSION, len(groups)) + b"".join(
        _PART.pack(g, len(b)) for g, b in zip(groups, blobs))
    return b"".join([frame, struct.pack("<I", zlib.crc32(frame)), *blobs])


def decode_groups(blob: bytes | bytearray | memoryview, *, key: bytes, parent: bytes | None,
                  token_ids: Sequence[int], layout: str, payload_len: int,
                  secret: bytes | None = None
                  ) -> tuple[memoryview, dict[int, memoryview], list[tuple[int, ValueError]]]:
    """Verify an entry against what the lookup expects.

    Returns:
        (group 0's page, {group: page} of the other groups whose parts verified, [(group, error)]
        of the parts that did not). Pages are read-only views into ``blob``.

    Raises:
        CorruptEntry: the frame is damaged (bad magic, version, checksum or lengths), group 0's
            part is missing, or group 0's part fails a check of ``decode_blob``.
        BadSignature: group 0's part fails its signature check.
    """
    mv = memoryview(blob).cast("B")
    n = mv.nbytes
    if n < _HEAD.size:
        raise CorruptEntry(f"truncated: {n} bytes")
    magic, version, count = _HEAD.unpack_from(mv)
    if magic != MAGIC:
        raise CorruptEntry("bad magic")
    if version != GROUP_BLOB_VERSION:
        raise CorruptEntry(f"group entry version {version}, expected {GROUP_BLOB_VERSION}")
    frame_end = _HEAD.size + count * _PART.size
    if frame_end + 4 > n:
        raise CorruptEntry("truncated frame")
    if struct.pack("<I", zlib.crc32(mv[:frame_end])) != mv[frame_end:frame_end + 4]:
        raise CorruptEntry("frame checksum mismatch")
    table = [_PART.unpack_from(mv, _HEAD.size + j * _PART.size) for j in range(count)]
    groups = [g for g, _ in table]
    if not groups or groups[0] != 0 or groups != sorted(set(groups)):
        raise CorruptEntry("bad group list (group 0 first, each group once)")
    if frame_end + 4 + sum(length for _, length in table) != n:
        raise CorruptEntry("part lengths do not add up to the entry's size")
    pos = frame_end + 4
    first: memoryview | None = None
    parts: dict[int, memoryview] = {}
    bad: list[tuple[int, ValueError]] = []
    for g, length in table:
        piece = mv[pos:pos + length]
        pos += length
        try:
            page = decode_blob(piece, key=part_key(key, g), parent=parent, token_ids=token_ids,
                               layout=layout, payload_len=payload_len, secret=secret)
        except (CorruptEntry, BadSignature) as e:
            if g == 0:
                raise
            bad.append((g, e))
            continue
        if g == 0:
            first = page
        else:
            parts[g] = page
    assert first is not None
    return first, parts, bad


__all__ = ["GROUP_BLOB_VERSION", "decode_groups", "encode_groups", "part_key"]
