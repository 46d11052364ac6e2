"""GGUF weight blocks -> the ``gguf`` mode's packed layout (``qgemm.c``), without loss.

Each GGUF block type is read into small integers and the scales that turn them into weights,
exactly as ``gguf.quants.dequantize`` does (``w = D * q + M``), then packed in groups of 16
outputs for the kernel. No value is re-quantized or rounded:

- Q4_0, Q4_1: 4-bit ``q`` with fp16 ``D`` and ``M`` per 32 inputs (Q4_0: ``M = -8 D``, exact);
- Q8_0: int8 ``q`` with fp16 ``D`` (``M = 0``);
- Q5_0: ``q - 16`` as 4-bit low nibbles and a plane of fifth bits, with fp16 ``D`` (``M = 0``);
- Q4_K: 4-bit ``q``; per 32 inputs the 6-bit ``sc`` and ``mn`` of the file, per 256 its fp16 ``d``
  and ``dmin``, so ``D = d * sc`` and ``M = -dmin * mn`` are the file's own fp32 products;
- Q5_K: the same with ``q`` (0..31) as Q5_0's nibbles and fifth bits;
- Q6_K: ``q - 32`` as 4-bit low nibbles and a plane of their two top bits, one int8 scale per 16
  inputs (two per 32-block) and an fp16 ``d``.

The bytes held are near the file's: 0.58 a weight for Q4_K (the file: 0.5625), 0.83 for Q6_K
(0.82), 0.70 for Q5_K (0.69), 0.6875 for Q5_0 (the file's), 1.125 for Q8_0 (1.06), 0.625 for
Q4_0 / Q4_1.
A stack of tensors (Q/K/V, gate/up) keeps each group's own format; a group that holds rows of two
types is packed 8-bit when both are of the first four, and refused otherwise (``PackError``: the
model then multiplies that stack in fp32).

``pack_weight`` decides each group's format and writes the buffer's table; the groups are filled
by ``qpack.c`` (a ``fill`` the caller passes: ``qlinear.QuantWeight``) or, where no kernels build,
by the numpy code here, which is also the reference the tests compare ``qpack.c`` with, byte for
byte. A matrix's rows are raw bytes [..., bytes a row], rows in C order of the leading axes: the
loader gives un-permuted Q/K rows as a view of the file's bytes (no copy). After packing, rows read
from a read-only memory map have their pages dropped from the process (``release_pages``).

This module knows nothing about the kernels' calls: only bytes.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Callable
from typing import Protocol

import numpy as np

BLOCK = 32
"""Inputs per kernel block (one activation scale each)."""
LANES = 16
"""Outputs per packed group: one AVX-512 lane each."""
SUPER = 256
"""Inputs per k-quant super-block (8 kernel blocks)."""
QF_Q4, QF_Q8, QF_K4, QF_K5, QF_K6, QF_Q5 = range(6)
"""The kernel's group formats (``qgemm.c``'s ``QF_*``)."""
FORMAT = {"Q4_0": QF_Q4, "Q4_1": QF_Q4, "Q8_0": QF_Q8, "Q5_0": QF_Q5,
          "Q4_K": QF_K4, "Q5_K": QF_K5, "Q6_K": QF_K6}
"""GGUF block type -> the format its groups are packed in."""
GGUF_TYPES = tuple(FORMAT)
"""GGUF block types the ``gguf`` mode multiplies with directly."""
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q5_0": 22, "Q4_K": 144, "Q5_K": 176,
               "Q6_K": 210}
"""Bytes of one GGUF block."""
BLOCK_INPUTS = {kind: SUPER if kind.endswith("_K") else BLOCK for kind in BLOCK_BYTES}
"""Inputs of one GGUF block."""
PACK_KINDS = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K")
"""GGUF block types as ``qpack.c`` numbers them (its ``GK_*``)."""


class PackError(ValueError):
    """Tensors that cannot share one packed weight (rows of a k-quant and of another type in one
    group of 16)."""


def block_columns(kind: str, raw: np.ndarray) -> int:
    """Input columns of a GGUF matrix held as ``raw`` bytes [..., bytes a row] of ``kind``."""
    return raw.shape[-1] // BLOCK_BYTES[kind] * BLOCK_INPUTS[kind]


def block_rows(raw: np.ndarray) -> int:
    """Rows of a GGUF matrix held as ``raw`` bytes [..., bytes a row]."""
    return int(np.prod(raw.shape[:-1], dtype=np.int64))


def _f16(b: np.ndarray) -> np.ndarray:
    """The last axis' 2 bytes as one fp16."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 scale bytes [..., 12] -> 6-bit (sc, mn) [..., 8] (llama.cpp's
    ``get_scale_min_k4``)."""
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def decode(kind: str, raw: np.ndarray, k: int) -> tuple:
    """GGUF blocks [n, bytes a row] of an [n, k] tensor -> its fields: ``(q, D, M)`` with q
    [n, k/32, 32] and fp16 D, M [n, k/32] for the first four types; ``(q, s1, s2, d, d2)`` for the
    k-quants, with int8 s1, s2 [n, k/32] (sc and mn, or Q6_K's two scales) and fp16 d, d2
    [n, k/256] (d and -dmin; Q6_K: d and zeros)."""
    n = raw.shape[0]
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, -1, BLOCK_BYTES[kind])
    nb = k // BLOCK
    if kind == "Q8_0":
        return b[..., 2:].view(np.int8), _f16(b[..., :2]), np.zeros((n, nb), np.float16)
    if kind in ("Q4_0", "Q4_1", "Q5_0"):
        off = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6}[kind]
        qs = b[..., off:off + 16]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # element i low nibble, i + 16 high
        d = _f16(b[..., :2])
        if kind == "Q4_1":
            return q, d, _f16(b[..., 2:4])
        if kind == "Q4_0":
            return q, d, (d.astype(np.float32) * -8).astype(np.float16)  # exact: a power of two
        qh = np.ascontiguousarray(b[..., 2:6]).view("<u4")[..., 0]
        hi = (qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1
        q = (q | (hi.astype(np.uint8) << 4)).astype(np.int8) - np.int8(16)
        return q, d, np.zeros((n, nb), np.float16)
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _scale_min_k4(b[..., 4:16])
        qs = b[..., -128:].reshape(n, -1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
        q = (qs & 0x0F).reshape(n, -1, 8, 32)  # sub-block 2i: low nibbles of 32 bytes, 2i + 1 high
        if kind == "Q5_K":
            qh = b[..., 16:48].reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
            q = (q | ((qh & 1) << 4)).astype(np.int8)
        return (q.reshape(n, nb, 32), sc.reshape(n, nb).astype(np.int8),
                mn.reshape(n, nb).astype(np.int8), d, (-dmin.astype(np.float32)).astype(np.float16))
    if kind == "Q6_K":
        ql, qh, scales, d = b[..., :128], b[..., 128:192], b[..., 192:208], _f16(b[..., 208:210])
        lo = ql.reshape(n, -1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)
        hi = qh.reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
        q = ((lo & 0x0F).reshape(n, -1, 8, 32) | ((hi & 3) << 4).reshape(n, -1, 8, 32))
        q = q.astype(np.int8) - np.int8(32)
        s = scales.view(np.int8).reshape(n, nb, 2)
        return q.reshape(n, nb, 32), s[..., 0], s[..., 1], d, np.zeros_like(d)
    raise PackError(f"GGUF block type {kind} has no packed layout")


LOCAL = (QF_Q4, QF_Q8, QF_Q5)
"""Formats whose blocks carry their own fp16 scales (the others: per 256-input super-block)."""


def group_bytes(fmt: int, nb: int) -> int:
    """Bytes of one group of 16 outputs over ``nb`` blocks (``qgemm.c``'s ``qg_group_bytes``)."""
    if fmt == QF_Q5:
        return nb * (256 + 64 + 32)
    qbytes = {QF_Q4: 256, QF_K4: 256, QF_K5: 320, QF_K6: 384}.get(fmt, 512)
    return nb * (qbytes + 64) if fmt in LOCAL else nb // 8 * (8 * (qbytes + 32) + 64)


def _pad(a: np.ndarray, groups: int) -> np.ndarray:
    """Rows padded with zeros to ``groups * LANES``."""
    pad = groups * LANES - a.shape[0]
    return np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) if pad else a


def _lanes(s: np.ndarray, groups: int) -> np.ndarray:
    """Per-row values [n, blocks] -> bytes [groups, blocks, 16 lanes * itemsize]."""
    s = _pad(s, groups)
    return s.reshape(groups, LANES, -1).transpose(0, 2, 1).copy().view(np.uint8)


def _values(q: np.ndarray, bits: int, groups: int) -> np.ndarray:
    """q [n, nb, 32] -> the kernel's value bytes [groups, nb, 256 or 512]."""
    q = _pad(q, groups)
    nb = q.shape[1]
    if bits == 4:
        # input i = 16 hi + 2 j + e -> chunk j, byte 2 lane + e, nibble hi
        t = q.astype(np.uint8).reshape(groups, LANES, nb, 2, 8, 2).transpose(0, 2, 4, 1, 5, 3)
        return (t[..., 0] | (t[..., 1] << 4)).reshape(groups, nb, 256)
    t = q.astype(np.int8).reshape(groups, LANES, nb, 16, 2).transpose(0, 2, 3, 1, 4)
    return t.reshape(groups, nb, 512).view(np.uint8)


def _fifth_bits(u: np.ndarray, groups: int) -> np.ndarray:
    """Bit 4 of u [n, nb, 32] -> the plane [groups, nb, 64]: byte 2 lane + e of plane j / 4 holds
    input 2 j + e's in bit 2 (j % 4) and input 2 j + 16 + e's in bit 2 (j % 4) + 1."""
    t = (_pad(u, groups) >> 4).astype(np.uint8)
    nb = t.shape[1]
    t = t.reshape(groups, LANES, nb, 2, 2, 4, 2)  # [g, lane, nb, hi, plane, j % 4, e]
    shift = (2 * np.arange(4, dtype=np.uint8)[:, None] + np.arange(2, dtype=np.uint8)[None, :])  # [j%4, hi]
    planes = (t << shift.T[None, None, None, :, None, :, None]).sum(axis=(3, 5), dtype=np.uint8)
    return planes.transpose(0, 2, 3, 1, 4).reshape(groups, nb, 64)  # [g, nb, plane, lane, e]


def _top_two_bits(u: np.ndarray, groups: int) -> np.ndarray:
    """Bits 4-5 of u [n, nb, 32] -> the planes [groups, nb, 128]: byte 2 lane + e of plane j / 2
    holds input 2 j + e's in bits 4 (j % 2) + 0-1 and input 2 j + 16 + e's in bits 4 (j % 2) + 2-3."""
    t = (_pad(u, groups) >> 4).astype(np.uint8)
    nb = t.shape[1]
    t = t.reshape(groups, LANES, nb, 2, 4, 2, 2)  # [g, lane, nb, hi, plane, j % 2, e]
    shift = (4 * np.arange(2, dtype=np.uint8)[None, :] + 2 * np.arange(2, dtype=np.uint8)[:, None])  # [hi, j%2]
    planes = (t << shift[None, None, None, :, None, :, None]).sum(axis=(3, 5), dtype=np.uint8)
    return planes.transpose(0, 2, 3, 1, 4).reshape(groups, nb, 128)  # [g, nb, plane, lane, e]


def _pack_run(fmt: int, fields: tuple, groups: int) -> np.ndarray:
    """One format's fields for ``groups`` groups -> bytes [groups, group_bytes]."""
    if fmt == QF_Q5:
        u = fields[0].astype(np.int16) + 16  # 0..31
        out = np.concatenate([_values(u & 0x0F, 4, groups), _fifth_bits(u, groups),
                              _lanes(fields[1].astype(np.float16), groups)], axis=-1)
        return out.reshape(groups, -1)
    if fmt == QF_K6:
        u = fields[0].astype(np.int16) + 32  # 0..63
        vals = np.concatenate([_values(u & 0x0F, 4, groups), _top_two_bits(u, groups)], axis=-1)
    elif fmt == QF_K5:
        u = fields[0].astype(np.int16)  # 0..31
        vals = np.concatenate([_values(u & 0x0F, 4, groups), _fifth_bits(u, groups)], axis=-1)
    else:
        vals = _values(fields[0], 4 if fmt in (QF_Q4, QF_K4) else 8, groups)
    if fmt in LOCAL:
        _, d, m = fields
        out = np.concatenate([vals, _lanes(d.astype(np.float16), groups),
                              _lanes(m.astype(np.float16), groups)], axis=-1)
        return out.reshape(groups, -1)
    _, s1, s2, d, d2 = fields
    nsb = d.shape[1]
    blocks = np.concatenate([vals, _lanes(s1, groups), _lanes(s2, groups)], axis=-1)
    sup = np.concatenate([_lanes(d, groups), _lanes(d2, groups)], axis=-1)  # [groups, nsb, 64]
    return np.concatenate([blocks.reshape(groups, nsb, -1), sup], axis=-1).reshape(groups, -1)


Fill = Callable[[np.ndarray, int, int, np.ndarray, np.ndarray], None]
"""``fill(buf, groups, k, row_addresses, row_kinds)``: writes every group the table at the start of
``buf`` names, reading row r's GGUF blocks at address ``row_addresses[r]``, of type
``PACK_KINDS[row_kinds[r]]`` (``qlinear``'s call of ``qpack.c``)."""


def group_formats(parts: list[tuple[str, np.ndarray]]) -> list[int]:
    """Each group's format for tensors stacked along the output dimension. Raises PackError for a
    group mixing a k-quant with another type."""
    kinds = [kind for kind, _ in parts]
    starts = np.cumsum([0, *(block_rows(raw) for _, raw in parts)])
    n = int(starts[-1])
    fmts = []
    for g in range(-(-n // LANES)):  # the formats of the parts with rows in group g
        lo, hi = g * LANES, min(n, (g + 1) * LANES)
        here = {FORMAT[kinds[i]] for i in range(len(parts)) if starts[i] < hi and starts[i + 1] > lo}
        if len(here) > 1 and not here <= set(LOCAL):
            raise PackError(f"rows of {' and '.join(sorted(set(kinds)))} share a group of "
                            f"{LANES} outputs")
        fmts.append(here.pop() if len(here) == 1 else QF_Q8)  # Q4_0 / Q4_1 / Q5_0 / Q8_0 rows: 8-bit
    return fmts


def row_addresses(raw: np.ndarray) -> np.ndarray:
    """The address of each row of ``raw`` [..., bytes a row] (any strides between rows; a row's
    bytes contiguous), rows in C order of the leading axes, as int64."""
    lead = raw.shape[:-1]
    off = np.zeros(lead, np.int64)
    for ax, (size, stride) in enumerate(zip(lead, raw.strides[:-1])):
        shape = [1] * len(lead)
        shape[ax] = size
        off = off + (np.arange(size, dtype=np.int64) * stride).reshape(shape)
    return raw.ctypes.data + off.reshape(-1)


NARROW_FLAG = 8
"""Bit of a table entry that marks a weight whose products take 8-bit activations
(``qgemm_layout.h``'s group_narrow); the format is the entry's low 3 bits."""


class Kept(Protocol):
    """Packed buffers kept from an earlier start (``model.packed_store.PackedStore``)."""

    def take(self, key: str, head: np.ndarray, nbytes: int) -> np.ndarray | None:
        """The buffer kept under ``key`` if its table is ``head`` and it is ``nbytes`` long."""

    def put(self, key: str, buf: np.ndarray) -> None:
        """``buf``, packed now, to be kept under ``key``."""


def pack_head(parts: list[tuple[str, np.ndarray]], k: int,
              narrow: bool = False) -> tuple[np.ndarray, tuple[int, ...], int]:
    """The packed buffer's table (one int64 ``offset << 4 | format`` per group, ``NARROW_FLAG``
    in every entry when ``narrow``), each group's format and the buffer's length in bytes, from
    the parts' types and shapes alone (no block is read). Raises as ``pack_weight``."""
    for kind, raw in parts:
        if raw.shape[-1] * BLOCK_INPUTS[kind] != k * BLOCK_BYTES[kind]:
            raise ValueError(f"{kind} rows of {raw.shape[-1]} bytes do not hold {k} inputs")
    fmts = group_formats(parts)
    groups = len(fmts)
    sizes_g = np.array([group_bytes(f, k // BLOCK) for f in fmts], np.int64)
    offsets = 8 * groups + np.concatenate([[0], np.cumsum(sizes_g)[:-1]]).astype(np.int64)
    head = (offsets << 4) | np.array(fmts, np.int64) | (NARROW_FLAG if narrow else 0)
    return head, tuple(fmts), 8 * groups + int(sizes_g.sum())


def pack_weight(parts: list[tuple[str, np.ndarray]], k: int, fill: Fill | None = None,
                narrow: bool = False, kept: Kept | None = None,
                key: str = "") -> tuple[np.ndarray, tuple[int, ...]]:
    """Tensors stacked along the output dimension, each (GGUF type, raw bytes [..., bytes a row])
    -> (the packed buffer: ``pack_head``'s table, then the groups; each group's format). The
    groups are written by ``fill`` (``qpack.c``), or without it by the numpy reference
    (``pack_groups_reference``); either way the rows' pages of a read-only file map are dropped
    afterwards (``release_pages``). With ``kept``, the buffer it kept under ``key`` with this
    table and length is returned instead, no row read; else the one packed here is handed to it.
    Raises PackError for a group mixing a k-quant with another type, ValueError for rows whose
    length is not whole blocks of ``k`` inputs."""
    head, fmts, nbytes = pack_head(parts, k, narrow)
    groups = len(fmts)
    if kept is not None:
        buf = kept.take(key, head, nbytes)
        if buf is not None:
            return buf, fmts
    if fill is None:
        buf = np.concatenate([head.view(np.uint8), *pack_groups_reference(parts, k, fmts)])
    else:
        # np.empty: numpy asks for transparent huge pages for large arrays. Faulting them in costs
        # the load 0.2-1.3 s of system time here (the kernel compacting memory), 4 KiB pages about
        # 0.25 s, but the GEMMs then stream through 4 KiB pages: decode took ~9% more CPU time
        buf = np.empty(nbytes, np.uint8)
        buf[:8 * groups] = head.view(np.uint8)
        if any(raw.strides[-1] != 1 for _, raw in parts):
            parts = [(kind, np.ascontiguousarray(raw)) for kind, raw in parts]
        addresses = np.concatenate([row_addresses(raw) for _, raw in parts])
        kinds = np.concatenate([np.full(block_rows(raw), PACK_KINDS.index(kind), np.int64)
                                for kind, raw in parts])
        fill(buf, groups, k, addresses, kinds)
    for _, raw in parts:
        release_pages(raw)
    if kept is not None:
        kept.put(key, buf)
    return buf, fmts


def pack_groups_reference(parts: list[tuple[str, np.ndarray]], k: int,
                          fmts: list[int]) -> list[np.ndarray]:
    """The groups' bytes in numpy, one array a run of consecutive groups of one format: the
    reference ``qpack.c`` is tested against, and the path where no kernels build."""
    parts = [(kind, raw.reshape(-1, raw.shape[-1])) for kind, raw in parts]
    starts = np.cumsum([0, *(raw.shape[0] for _, raw in parts)])
    n, groups = int(starts[-1]), len(fmts)
    decoded = [decode(kind, raw, k) for kind, raw in parts]
    runs, g0 = [], 0
    for g in range(1, groups + 1):  # consecutive groups of one format
        if g == groups or fmts[g] != fmts[g0]:
            runs.append((g0, g))
            g0 = g
    chunks = []
    for g0, g1 in runs:
        lo, hi = g0 * LANES, min(n, g1 * LANES)
        pieces = [tuple(f[max(lo, s) - s:min(hi, e) - s] for f in decoded[i])
                  for i, (s, e) in enumerate(zip(starts[:-1], starts[1:])) if s < hi and e > lo]
        fields = tuple(np.concatenate(col) for col in zip(*pieces))
        chunks.append(_pack_run(fmts[g0], fields, g1 - g0).reshape(-1))
    return chunks


_MADV_DONTNEED = 4
"""Linux's MADV_DONTNEED: a file mapping's pages leave the process (not the page cache)."""


def _file_mapped(raw: np.ndarray) -> bool:
    """Whether ``raw`` is a read-only view of a memory-mapped file (``np.memmap`` mode 'r')."""
    if raw.flags.writeable:
        return False
    base = raw
    while base is not None and not isinstance(base, mmap.mmap):
        base = getattr(base, "base", None)
    return isinstance(base, mmap.mmap)


def release_pages(raw: np.ndarray) -> None:
    """Drop the pages under ``raw`` from this process' resident memory where it is a read-only
    view of a file mapping (the GGUF reader's): they were read once to pack them, and the page
    cache keeps them; a later read maps them again. Elsewhere (or off Linux): nothing."""
    if not _file_mapped(raw) or raw.size == 0:
        return
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return
    page = mmap.PAGESIZE
    lo = raw.ctypes.data + min(0, int(np.sum(np.minimum(raw.strides, 0) * (np.array(raw.shape) - 1))))
    hi = raw.ctypes.data + int(np.sum(np.maximum(raw.strides, 0) * (np.array(raw.shape) - 1))) + 1
    lo -= lo % page
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise(lo, hi - lo, _MADV_DONTNEED)


def unpack_weight(buf: np.ndarray, n: int, k: int) -> np.ndarray:
    """The fp32 [n, k] weight a packed buffer holds, read back in numpy (``D * q + M``, in the
    kernel's order): the packing's inverse, an oracle for the C kernels' reading of it."""
    groups, nb = -(-n // LANES), k // BLOCK
    head = np.ascontiguousarray(buf[:8 * groups]).view(np.int64)
    out = np.empty((groups * LANES, k), np.float32)
    for g in range(groups):
        fmt, off = int(head[g] & (NARROW_FLAG - 1)), int(head[g] >> 4)
        raw = buf[off:off + group_bytes(fmt, nb)]
        bits = 8 if fmt == QF_Q8 else 4  # the low nibbles; Q5_0, Q5_K and Q6_K add their planes
        qbytes = {QF_Q4: 256, QF_K4: 256, QF_K5: 320, QF_K6: 384}.get(fmt, 512)
        if fmt == QF_Q5:
            blk = raw.reshape(nb, 352)
            dlo = dhi = blk[:, 320:].copy().view(np.float16).astype(np.float32)  # [nb, lane]
            m = np.zeros_like(dlo)
        elif fmt in LOCAL:
            blk = raw.reshape(nb, qbytes + 64)
            d = blk[:, qbytes:qbytes + 32].copy().view(np.float16).astype(np.float32)  # [nb, lane]
            m = blk[:, qbytes + 32:].copy().view(np.float16).astype(np.float32)
            dlo = dhi = d
        else:
            sb = raw.reshape(nb // 8, -1)
            blk = sb[:, :-64].reshape(nb, qbytes + 32)
            sc = blk[:, qbytes:].copy().view(np.int8).astype(np.float32)  # [nb, 32]
            dd = np.repeat(sb[:, -64:].copy().view(np.float16).astype(np.float32), 8, axis=0)
            dlo = dd[:, :16] * sc[:, :16]
            dhi = dd[:, :16] * sc[:, 16:] if fmt == QF_K6 else dlo
            m = np.zeros_like(dlo) if fmt == QF_K6 else dd[:, 16:] * sc[:, 16:]
        v = blk[:, :256 if bits == 4 else 512]
        if bits == 4:
            t = v.reshape(nb, 8, LANES, 2)
            q = np.stack([t & 0x0F, t >> 4], -1).transpose(2, 0, 4, 1, 3)  # [lane, nb, hi, j, e]
        else:
            q = v.view(np.int8).reshape(nb, 16, LANES, 2).transpose(2, 0, 1, 3)
        q = q.reshape(LANES, nb, BLOCK).astype(np.float32)
        if fmt in (QF_Q5, QF_K5):  # the fifth bits: plane j // 4, bit 2 (j % 4) + hi, byte 2 lane + e
            p = blk[:, 256:320].reshape(nb, 2, LANES, 2)  # [nb, plane, lane, e]
            sh = (2 * np.arange(4)[None, :] + np.arange(2)[:, None]).astype(np.uint8)  # [hi, j % 4]
            h = (p[:, None, :, None, :, :] >> sh[None, :, None, :, None, None]) & 1  # [nb, hi, pl, j%4, lane, e]
            q = q + 16 * h.transpose(4, 0, 1, 2, 3, 5).reshape(LANES, nb, BLOCK).astype(np.float32)
            q = q - 16 if fmt == QF_Q5 else q
        if fmt == QF_K6:  # the top two bits: plane j // 2, bits 4 (j % 2) + 2 hi, byte 2 lane + e
            p = blk[:, 256:384].reshape(nb, 4, LANES, 2)  # [nb, plane, lane, e]
            sh = (4 * np.arange(2)[None, :] + 2 * np.arange(2)[:, None]).astype(np.uint8)  # [hi, j % 2]
            h = (p[:, None, :, None, :, :] >> sh[None, :, None, :, None, None]) & 3  # [nb, hi, pl, j%2, lane, e]
            q = q + 16 * h.transpose(4, 0, 1, 2, 3, 5).reshape(LANES, nb, BLOCK).astype(np.float32) - 32
        scale = np.concatenate([np.repeat(dlo.T[..., None], 16, -1),
                                np.repeat(dhi.T[..., None], 16, -1)], -1)  # [lane, nb, 32]
        w = scale * q
        mm = np.broadcast_to(m.T[..., None], w.shape)
        add = mm != 0 if fmt in LOCAL else np.full(w.shape, fmt != QF_K6)  # as qg_dequant_rows
        w = np.where(add, w + mm, w)
        out[g * LANES:(g + 1) * LANES] = w.reshape(LANES, k)
    return out[:n]
