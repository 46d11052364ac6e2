"""A GGUF file's metadata and tensor table, read straight from its header, and its tensors as
views of one read-only memory map: what the loader needs, in a few tens of milliseconds.

``gguf.GGUFReader`` builds a numpy record for every element of every metadata array: for a 49k
vocabulary and its merges that is about 150,000 records and 2 s before the first weight is read
(llama.cpp reads the same header in C in a blink). Here metadata values are Python values (what
``ReaderField.contents()`` returns): scalars, strings, numeric arrays as lists; a string array
(tokens, merges) is only stepped over, its strings decoded when first indexed. Tensors carry the
reader's names and shapes (``name``, ``shape`` fastest dimension first, ``tensor_type``,
``n_bytes``, ``data``: typed for F16/F32/..., bytes [..., bytes a row] for block types), and their
``data`` are views of the file's ``np.memmap`` (mode 'r'), so ``gguf_blocks.release_pages`` can
drop their pages after packing. Little-endian GGUF v2/v3 only (what the converters write).

This module knows nothing about architectures or weights' meaning: only the file's layout.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

from hotprefix.files.gguf_header import read_fields, read_string

_TYPED = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}
"""Tensor types held as numbers (as ``GGUFReader`` types them); the others as bytes."""


class GgufFormatError(ValueError):
    """Not a GGUF file this reader understands."""


@dataclass
class GgufTensor:
    name: str
    """The tensor's name in the file (``blk.0.attn_q.weight``)."""
    shape: tuple[int, ...]
    """Dimensions, fastest first (GGUF's order)."""
    tensor_type: GGMLQuantizationType
    """Its element or block type."""
    n_bytes: int
    """Bytes of its data."""
    data: np.ndarray
    """A view of the file's memory map: numbers [slowest .. fastest] for F16/F32/int types, bytes
    [..., bytes a row] for block types."""


class GgufFile:
    """The header of a GGUF file (``fields``: key -> value) and its tensors (``tensors``)."""

    def __init__(self, path: str):
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        self.data = mm.view(np.ndarray)  # slicing a memmap costs several times an ndarray's
        buf = memoryview(mm)
        try:
            self.fields, self.tensors = _parse(buf, self.data)
        except (struct.error, IndexError, UnicodeDecodeError, ValueError) as e:
            raise GgufFormatError(f"{path}: unreadable GGUF header ({e})") from None


def _parse(buf: memoryview, data: np.ndarray) -> tuple[dict[str, Any], list[GgufTensor]]:
    fields, off, n_tensors = read_fields(buf)
    infos = []
    for _ in range(n_tensors):
        name, off = read_string(buf, off)
        n_dims, = struct.unpack_from("<I", buf, off)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, off + 4)
        ttype, offset = struct.unpack_from("<IQ", buf, off + 4 + 8 * n_dims)
        off += 4 + 8 * n_dims + 12
        infos.append((name, dims, GGMLQuantizationType(ttype), offset))
    align = int(fields.get("general.alignment", 32))
    if align <= 0 or align & (align - 1):
        raise ValueError(f"alignment {align} is not a power of two")
    start = -(-off // align) * align
    tensors, seen = [], set()
    for name, dims, ttype, offset in infos:
        if name in seen:
            raise ValueError(f"tensor {name} appears twice")
        seen.add(name)
        n_elems = int(np.prod(dims, dtype=np.int64))
        block, size = GGML_QUANT_SIZES[ttype]
        n_bytes = n_elems * size // block
        lo = start + offset
        if lo + n_bytes > data.shape[0]:
            raise ValueError(f"tensor {name} reaches past the end of the file")
        np_dims = tuple(reversed(dims))
        if ttype in _TYPED:
            arr = data[lo:lo + n_bytes].view(_TYPED[ttype]).reshape(np_dims)
        else:
            arr = data[lo:lo + n_bytes].reshape(quant_shape_to_byte_shape(np_dims, ttype))
        tensors.append(GgufTensor(name, tuple(dims), ttype, n_bytes, arr))
    return fields, tensors
