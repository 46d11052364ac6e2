"""The metadata in a GGUF file's header (key -> value), read straight from its bytes: one reader
for the loader (``model/gguf_file.py``, which goes on to the tensor table) and the vocabulary
builder (``text/spm_vocab.py``). Little-endian GGUF v2/v3 only (what the converters write).

Values are Python values: scalars, strings, numeric arrays as lists (or, asked for, as numpy
views of the buffer), string arrays as ``LazyStrings``, stepped over until first indexed (a 49k
vocabulary and its merges are 150,000 strings).

This module knows nothing about tensors, architectures or vocabularies: only the header's layout.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}
"""GGUF value types with a fixed size -> struct format."""
STRING, ARRAY = 8, 9


class LazyStrings(Sequence):
    """A metadata array of strings, decoded on first access (its length is known at once)."""

    def __init__(self, buf: memoryview, offset: int, count: int):
        self._buf, self._offset, self._count, self._items = buf, offset, count, None

    def __len__(self) -> int:
        return self._count

    def _decoded(self) -> list[str]:
        if self._items is None:
            items, off, buf = [], self._offset, self._buf
            length = struct.Struct("<Q").unpack_from
            for _ in range(self._count):
                n, = length(buf, off)
                items.append(str(buf[off + 8:off + 8 + n], "utf-8"))
                off += 8 + n
            self._items = items
        return self._items

    def __getitem__(self, i):
        return self._decoded()[i]

    def __iter__(self):  # not Sequence's: one __getitem__ call an item (0.4 s for 262k)
        return iter(self._decoded())


def read_string(buf: memoryview, off: int) -> tuple[str, int]:
    """The length-prefixed UTF-8 string at ``off`` and the offset after it."""
    n, = struct.unpack_from("<Q", buf, off)
    return str(buf[off + 8:off + 8 + n], "utf-8"), off + 8 + n


def read_fields(buf: memoryview, numpy_arrays: bool = False) -> tuple[dict[str, Any], int, int]:
    """The header's metadata, the offset of the tensor table that follows it, and its tensor
    count. ``numpy_arrays``: numeric arrays as numpy views of ``buf`` (valid while it is), else
    lists.

    Raises:
        ValueError, struct.error, IndexError, UnicodeDecodeError: not a GGUF file this reads.
    """
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError("not a GGUF file")
    version, = struct.unpack_from("<I", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (big-endian or too old) is not read here")
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    off = 24

    def value(vtype: int, off: int) -> tuple[Any, int]:
        if vtype in SCALARS:
            fmt = SCALARS[vtype]
            return struct.unpack_from(fmt, buf, off)[0], off + struct.calcsize(fmt)
        if vtype == STRING:
            return read_string(buf, off)
        if vtype != ARRAY:
            raise ValueError(f"unknown GGUF value type {vtype}")
        itype, count = struct.unpack_from("<IQ", buf, off)
        off += 12
        if itype in SCALARS:
            dt = np.dtype(SCALARS[itype])
            arr = np.frombuffer(buf, dt, count, off)
            return (arr if numpy_arrays else arr.tolist()), off + dt.itemsize * count
        if itype == STRING:
            start = off
            for _ in range(count):
                off += 8 + struct.unpack_from("<Q", buf, off)[0]
            return LazyStrings(buf, start, count), off
        items = []
        for _ in range(count):
            v, off = value(itype, off)
            items.append(v)
        return items, off

    fields: dict[str, Any] = {}
    for _ in range(n_kv):
        key, off = read_string(buf, off)
        vtype, = struct.unpack_from("<I", buf, off)
        fields[key], off = value(vtype, off + 4)
    return fields, off, n_tensors


def read_file_metadata(path: str, keys: Collection[str]) -> dict[str, Any]:
    """The named metadata keys of a GGUF file, read straight from its mapped header: numeric
    arrays as numpy arrays (copies), string arrays as lists, scalars and strings as they are.
    Other keys are stepped over without building their values; tensor infos are not read.

    Raises:
        OSError: the file cannot be read.
        ValueError: not a GGUF file this reads (empty, truncated, another format or version).
    """
    with open(path, "rb") as f:
        try:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as e:  # an empty file
            raise ValueError(f"{path}: unreadable GGUF metadata ({e})") from None
    with mm:
        buf, fields = memoryview(mm), None
        try:
            fields, _, _ = read_fields(buf, numpy_arrays=True)
            return {k: v.copy() if isinstance(v, np.ndarray) else list(v) if isinstance(v, LazyStrings)
                    else v for k, v in fields.items() if k in keys}
        except (ValueError, struct.error, IndexError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: unreadable GGUF metadata ({e})") from None
        finally:
            fields = None  # its arrays are views of the map: gone before it closes
            buf.release()
