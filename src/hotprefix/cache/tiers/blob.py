"""The one self-describing blob that a KV tier stores for one block, and its storage key.

Layout of a blob (all integers little-endian)::

    b"HPKV"  version:u16  header_len:u32  header  payload  checksum[4]  [signature[32]]

``header`` is msgpack (msgspec) ``[key, parent, token_ids, layout, payload_len, flags]``;
``checksum`` is CRC-32 (zlib) over every byte before it — it detects accidental damage, at about
4 GB/s, where a cryptographic hash would cost most of the time a load takes; ``signature``, present only when the
``FLAG_SIGNED`` bit is set in ``flags``, is HMAC-SHA256 keyed by the replicas' shared secret over
every byte before it (checksum included).

What each check protects against:

- the key, parent, token ids, layout and payload length in the header are compared with what the
  lookup expects: a hash collision, a lookup under the wrong layout or a blob stored under the wrong
  name can never return another block's K/V;
- the checksum catches torn writes, truncation and bit rot (every burst of up to 32 bits, and any
  other accidental change but for a 2^-32 chance);
- the checksum is *not* a signature: anyone who can write to the store can forge a blob with a
  valid checksum. With a secret, only writers that know it produce entries that verify
  (``BadSignature`` otherwise). The secret does not hide the K/V: a reader of the store still sees
  the payload.

The storage key (``storage_key``) hashes the blob version, the layout and the block key, so an
entry of another layout or format version is never even looked up.

This module knows nothing about tiers, tensors or where a blob is kept. Imports no torch.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import zlib
from typing import Sequence

import msgspec

MAGIC = b"HPKV"
BLOB_VERSION = 2
"""Format version; a blob of another version is corrupt to this code (and has another storage key)."""
FLAG_SIGNED = 1
"""Header flag: an HMAC-SHA256 signature follows the checksum."""
CHECKSUM_LEN = 4
SIGNATURE_LEN = 32

_PREFIX = struct.Struct("<4sHI")  # magic, version, header length
_KNOWN_FLAGS = FLAG_SIGNED


class CorruptEntry(ValueError):
    """A blob is not the block asked for: bad magic or version, truncated, checksum mismatch, or a
    header field (key, parent, token ids, layout, payload length) that differs from the lookup's."""


class BadSignature(ValueError):
    """A blob's checksum is fine but its signature does not verify: unsigned (or signed by another
    secret) while a secret is configured, or signed while none is."""


class BlobHeader(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """The fields stored in front of the payload."""

    key: bytes
    """The block's chained key."""
    parent: bytes | None
    """The previous block's key (the namespace or None for block 0, as the caller chose)."""
    token_ids: tuple[int, ...]
    """The block's token ids."""
    layout: str
    """The runner's KV layout tag (dtype, layers, KV heads, head dim, block size)."""
    payload_len: int
    """Bytes of K/V that follow the header."""
    flags: int
    """Bit set: ``FLAG_SIGNED``."""


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(BlobHeader)


def storage_key(layout: str, key: bytes) -> str:
    """The name of a block's entry in every tier: hex of a hash over (blob version, layout, key)."""
    h = hashlib.blake2b(digest_size=32, person=b"hotprefix-tier")
    h.update(struct.pack("<HI", BLOB_VERSION, len(layout.encode())))
    h.update(layout.encode())
    h.update(bytes(key))
    return h.hexdigest()


def encode_blob(key: bytes, parent: bytes | None, token_ids: Sequence[int], layout: str,
                payload: bytes | bytearray | memoryview, *, secret: bytes | None = None) -> bytes:
    """Build the blob for one block.

    Args:
        key: the block's chained key.
        parent: the previous block's key (None allowed for block 0).
        token_ids: the block's token ids.
        layout: the runner's layout tag.
        payload: the block's K/V bytes.
        secret: when given, the blob is signed (HMAC-SHA256) with it.

    Returns:
        The blob, ready to store.
    """
    view = memoryview(payload).cast("B")
    header = _ENCODER.encode(BlobHeader(bytes(key), None if parent is None else bytes(parent),
                                        tuple(int(t) for t in token_ids), layout, view.nbytes,
                                        FLAG_SIGNED if secret else 0))
    parts = [_PREFIX.pack(MAGIC, BLOB_VERSION, len(header)), header, view]
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    parts.append(struct.pack("<I", crc))
    if secret:
        mac = hmac.new(secret, digestmod=hashlib.sha256)
        for part in parts:
            mac.update(part)
        parts.append(mac.digest())
    return b"".join(parts)


def decode_blob(blob: bytes | bytearray | memoryview, *, key: bytes, parent: bytes | None,
                token_ids: Sequence[int], layout: str, payload_len: int,
                secret: bytes | None = None) -> memoryview:
    """Verify a blob against what the lookup expects and return its payload: a read-only view
    into ``blob`` (no copy: a load moves each byte of K/V once more, into the pool).

    Order of the checks: structure and checksum (``CorruptEntry``), then the signature
    (``BadSignature``), then every header field (``CorruptEntry``).

    Raises:
        CorruptEntry: bad magic or version, truncated or trailing bytes, checksum mismatch, or a
            field that differs from the expected one.
        BadSignature: a secret is configured and the blob is unsigned or its HMAC does not verify,
            or the blob is signed and no secret is configured.
    """
    mv = memoryview(blob).cast("B")
    n = mv.nbytes
    if n < _PREFIX.size:
        raise CorruptEntry(f"truncated: {n} bytes")
    magic, version, header_len = _PREFIX.unpack_from(mv)
    if magic != MAGIC:
        raise CorruptEntry("bad magic")
    if version != BLOB_VERSION:
        raise CorruptEntry(f"blob version {version}, expected {BLOB_VERSION}")
    start = _PREFIX.size + header_len
    if start > n:
        raise CorruptEntry("truncated header")
    try:
        header = _DECODER.decode(mv[_PREFIX.size:start])
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise CorruptEntry(f"bad header: {e}") from None
    if header.flags & ~_KNOWN_FLAGS or header.payload_len < 0:
        raise CorruptEntry("bad header flags or length")
    signed = bool(header.flags & FLAG_SIGNED)
    end = start + header.payload_len
    expected = end + CHECKSUM_LEN + (SIGNATURE_LEN if signed else 0)
    if n != expected:
        raise CorruptEntry(f"{'truncated' if n < expected else 'trailing bytes'}: {n} bytes, expected {expected}")
    checksum = struct.pack("<I", zlib.crc32(mv[:end]))
    if checksum != mv[end:end + CHECKSUM_LEN]:
        raise CorruptEntry("checksum mismatch")
    if secret:
        if not signed:
            raise BadSignature("entry is not signed but a secret is configured")
        mac = hmac.new(secret, mv[:end + CHECKSUM_LEN], hashlib.sha256).digest()
        if not hmac.compare_digest(mac, mv[end + CHECKSUM_LEN:]):
            raise BadSignature("signature does not verify (another secret, or forged)")
    elif signed:
        raise BadSignature("entry is signed but no secret is configured")
    if header.key != bytes(key):
        raise CorruptEntry("key mismatch")
    if header.parent != (None if parent is None else bytes(parent)):
        raise CorruptEntry("parent mismatch")
    if header.token_ids != tuple(token_ids):
        raise CorruptEntry("token ids mismatch")
    if header.layout != layout:
        raise CorruptEntry("layout mismatch")
    if header.payload_len != payload_len:
        raise CorruptEntry(f"payload length {header.payload_len}, expected {payload_len}")
    return mv[start:end].toreadonly()


__all__ = ["BLOB_VERSION", "BadSignature", "BlobHeader", "CorruptEntry", "decode_blob", "encode_blob",
           "storage_key"]
