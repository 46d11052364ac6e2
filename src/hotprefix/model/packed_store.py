"""The ``gguf`` mode's packed weights kept on disk, and mapped at the next start instead of packed.

Packing a GGUF's blocks into the kernels' layout (``gguf_blocks``, ``qpack.c``) reads the whole
file and writes a buffer about its size into fresh memory: about a second of a 1B model's start and
most of an 8B's (the fresh pages' first touch is system time). The packed bytes depend only on the
file's bytes, the architecture, the activations' width and the packing code, so once a model has
started they are written to one file under ``cache_dir("packed")``, named by the model's
fingerprint (``files.fingerprint``), the layout's version (a hash of the packing code) and the
width. A later start maps that file privately (copy on write; nothing writes it) and each weight
is a view of it: nothing is packed, no fresh memory is touched, and the page cache's pages are
mapped as they are (2 MiB at a time where the file system keeps large folios).

Trust, as the fingerprint's: a store is looked up only under a fingerprint ``files.fingerprint``
remembered for the file as it is now (it never hashes here), and written only when, after the
packing, that fingerprint is remembered and the file's identity is what it was before the packing.
Each weight's table (the group offsets and formats the kernels address by) is computed again from
the file's tensor types and shapes and must equal the stored one, and the stored length the
weight's: a store damaged there, short, or not this layout's is passed over (logged) and the
weights are packed, then kept again. A store that cannot be written (read-only or full disk) is
logged and passed over.

Disk: one file about the model file's size per model and width; the ``MAX_KEPT`` most recently
used are kept, and older ones removed when a new one is written; none is written where it would
leave less than ``MIN_FREE`` (or a tenth of the file system) free. Models whose packed weights are
under ``MIN_BYTES`` pack in a fraction of a second and are not kept.

Memory: where the kernel maps the file in 2 MiB pages (``huge_mapped``) the weights are views of
the page cache, shared by every process that maps the store (a fleet's replicas on one machine);
elsewhere the file is read into anonymous memory, as packing would have filled.

numpy and the standard library; knows nothing of the kernels.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import shutil
import struct
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from hotprefix.files.atomic import atomic_path
from hotprefix.files.cachedir import cache_dir
from hotprefix.files.fingerprint import identities, remembered_digest

log = logging.getLogger(__name__)

MAGIC = b"hotprefix packed weights\n"
"""A store file's first bytes; then the index's length (8 bytes, little-endian), the index (JSON:
the layout, each weight's key -> [offset in the file, length]) and the weights, each at a
multiple of ``ALIGN``."""
ALIGN = 4096
"""Alignment of each weight in a store file (a page)."""
MIN_BYTES = 256 << 20
"""Packed weights under this many bytes are not kept (they pack in a fraction of a second)."""
MAX_KEPT = 3
"""Store files kept (the most recently used); older ones are removed when one is written."""
MIN_FREE = 1 << 30
"""Bytes a store's write leaves free on its file system at the least (or a tenth of it, if more):
a KV disk tier or a log beside it must not find the disk full."""
_LAYOUT_SOURCES = ("gguf_blocks.py", "qpack.c", "qgemm_layout.h")
"""The code that decides the packed bytes: a change to any of it is a new layout."""


def layout_version() -> str:
    """A hash of the packing code (``_LAYOUT_SOURCES``)."""
    h = hashlib.sha256()
    for name in _LAYOUT_SOURCES:
        h.update(Path(__file__).with_name(name).read_bytes())
    return h.hexdigest()[:12]


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class PackedStore:
    """One model's packed weights: those a store file kept (``take``), and those packed this start
    (``put``), which ``keep`` writes to a new store file on a thread."""

    def __init__(self, paths: list[str], text: str, width: str, identity: list[tuple] | None):
        """``paths`` and ``text``: the model's files and the text hashed with them
        (``files.fingerprint.files_digest``'s); ``width``: the activations' width (``a16``, ``a8``),
        part of the name (its tables differ); ``identity``: the files' identities
        (``files.fingerprint.identities``, sorted by path) taken before their bytes were mapped
        (None: unknown, nothing is read or kept). A file whose identity is no longer that one has
        other bytes than those mapped: its store is neither read nor written."""
        self.paths, self.text, self.width = sorted(paths), text, width
        try:
            self.layout = layout_version()
        except OSError as e:  # the packing code's sources are not installed: nothing kept or read
            log.info("packed weights not kept (%s)", e)
            identity = None
        self._identity = identity
        self.path: Path | None = None
        """The store file this start read, or None."""
        self._index: dict[str, list[int]] = {}
        self._data: mmap.mmap | np.ndarray | None = None  # the store file's bytes
        self._weights: dict[str, np.ndarray] = {}  # every weight, in order: taken or packed
        self.packed = 0
        """Weights packed this start (not found in the store)."""
        self._seen: Path | None = None  # the store file found at start (read, or passed over)
        digest = remembered_digest(self.paths, text) if self._unchanged() else None
        if digest is not None:
            self._open(self._file(digest))

    def _unchanged(self) -> bool:
        """Whether the files are still those whose bytes were mapped."""
        try:
            return self._identity is not None and identities(self.paths) == self._identity
        except OSError:
            return False

    def _file(self, digest: str) -> Path:
        return cache_dir("packed") / f"{digest}-{self.layout}-{self.width}.bin"

    def _open(self, path: Path) -> None:
        try:
            with open(path, "rb") as f:
                index = self._read_index(f)
                self._data = _huge_map_or_read(f)
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            self._seen = path
            log.warning("packed weights %s passed over (%s): packing the model", path, e)
            return
        self._index, self.path = index, path
        self._seen = path
        try:
            os.utime(path)  # the most recently used are kept
        except OSError:
            pass

    def _read_index(self, f) -> dict:
        """A store file's index, checked against the file: this layout's, and every weight
        inside the file at an aligned offset. Raises ValueError."""
        size = os.fstat(f.fileno()).st_size
        head = f.read(len(MAGIC) + 8)
        if len(head) < len(MAGIC) + 8 or not head.startswith(MAGIC):
            raise ValueError("not a store file")
        (n,) = struct.unpack("<Q", head[len(MAGIC):])
        if n > min(size, 1 << 24):
            raise ValueError("an index longer than the file")
        index = json.loads(f.read(n))  # a UnicodeDecodeError and a JSONDecodeError are ValueErrors
        if not isinstance(index, dict) or index.get("layout") != self.layout:
            raise ValueError("another layout")
        weights = index.get("weights")
        if not isinstance(weights, dict) or not all(
                isinstance(w, list) and len(w) == 2 and all(type(v) is int and v >= 0 for v in w)
                and w[0] % ALIGN == 0 and w[0] + w[1] <= size for w in weights.values()):
            raise ValueError("a weight outside the file")
        return weights

    def take(self, key: str, head: np.ndarray, nbytes: int) -> np.ndarray | None:
        """The weight kept under ``key`` as a view of the store file, if its table is ``head``
        and it is ``nbytes`` long; else None (logged where the store has the key)."""
        where = self._index.get(key)
        if where is None or self._data is None:
            return None
        off, nb = where
        buf = np.frombuffer(self._data, np.uint8, nb, off)
        table = head.view(np.uint8)
        if nb != nbytes or not np.array_equal(buf[:table.size], table):
            log.warning("packed weights %s: %s does not match the model: packed again", self.path, key)
            return None
        self._weights[key] = buf
        return buf

    def put(self, key: str, buf: np.ndarray) -> None:
        """A weight packed this start, to be kept."""
        self._weights[key] = buf
        self.packed += 1

    def keep(self, fingerprint: str | Future) -> threading.Thread | None:
        """Write a new store file, on a thread of low priority, where weights were packed this
        start and they are at least ``MIN_BYTES``: once ``fingerprint`` (the model's, or its future)
        is known and remembered for the files as they were before the packing. Returns the
        thread, or None where nothing is written."""
        total = sum(b.nbytes for b in self._weights.values())
        if not self.packed or total < MIN_BYTES or self._identity is None:
            return None
        t = threading.Thread(target=self._write, args=(fingerprint, dict(self._weights)),
                             name="packed-store", daemon=True)
        t.start()
        return t

    def _write(self, fingerprint: str | Future, weights: dict[str, np.ndarray]) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (OSError, AttributeError):
            pass
        try:
            digest = fingerprint.result() if isinstance(fingerprint, Future) else fingerprint
            if not self._unchanged() or remembered_digest(self.paths, self.text) != digest:
                log.info("packed weights not kept: the model file changed or is not settled")
                return
            path = self._file(digest)
            if path.exists() and path != self._seen:  # another process (a replica) kept it
                return
            path.parent.mkdir(parents=True, exist_ok=True)
            disk = shutil.disk_usage(path.parent)
            need = sum(b.nbytes for b in weights.values()) + max(MIN_FREE, disk.total // 10)
            if disk.free < need:
                log.info("packed weights not kept: %.1f GiB free in %s, %.1f GiB wanted",
                         disk.free / 2**30, path.parent, need / 2**30)
                return
            self.write(path, weights)
        except Exception as e:  # a read-only or full disk: the next start packs again
            log.info("packed weights not kept (%s)", e)
            return
        log.info("packed weights kept in %s (%.0f MiB) for the next start", path,
                 path.stat().st_size / 2**20)
        prune(path)

    def write(self, path: Path, weights: dict[str, np.ndarray]) -> Path:
        """``weights`` in a store file at ``path``, whole or not at all (``files.atomic``)."""
        start = 0  # where the weights begin: after the index, whose offsets say where that is
        while True:
            index, off = {}, start
            for key, buf in weights.items():
                index[key] = [off, buf.nbytes]
                off = _align(off + buf.nbytes)
            body = json.dumps({"layout": self.layout, "weights": index}).encode()
            if _align(len(MAGIC) + 8 + len(body)) == start:
                break
            start = _align(len(MAGIC) + 8 + len(body))
        with atomic_path(path) as tmp:
            os.chmod(tmp, 0o644)
            with open(tmp, "wb") as f:
                f.write(MAGIC + struct.pack("<Q", len(body)) + body)
                for key, buf in weights.items():
                    f.seek(index[key][0])
                    f.write(memoryview(np.ascontiguousarray(buf)).cast("B"))
                f.truncate(max(off + nb for off, nb in index.values()))
                _leave_page_cache(f)
        return path


def _leave_page_cache(f) -> None:
    """The written file's pages out of the page cache (written to disk first): a page cache
    filled by writes holds the file in small folios, which the next start cannot map 2 MiB at a
    time (``huge_mapped``) and so copies the whole store into anonymous memory (the 1B's 650 MiB:
    1.9 s of its start, against 0.6 s to read it back in large folios and 0.01 s to map it after);
    read back from disk, the kernel keeps it in large folios where the file system can."""
    if not hasattr(os, "posix_fadvise"):
        return
    f.flush()
    os.fsync(f.fileno())
    try:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError as e:  # advice only: a file system that refuses it keeps the store all the same
        log.debug("page cache advice refused for %s (%s)", f.name, e)


def huge_mapped(mm: mmap.mmap) -> bool:
    """Whether at least half of a file mapping is mapped 2 MiB at a time (``FilePmdMapped`` in
    ``/proc/self/smaps``) once one byte of each 2 MiB is read: the file system keeps the file in
    large folios and the kernel maps them whole (ext4 and xfs on recent kernels)."""
    view = np.frombuffer(mm, np.uint8)
    start = view.ctypes.data
    int(view[::2 << 20].sum())  # one read each 2 MiB: a fault maps the whole folio where it can
    del view
    try:
        with open("/proc/self/smaps") as f:
            ours = False
            for line in f:
                if "-" in line.split(" ", 1)[0] and not line[0].isupper():  # a mapping's first line
                    ours = int(line.split("-", 1)[0], 16) == start
                elif ours and line.startswith("FilePmdMapped:"):
                    return int(line.split()[1]) * 1024 >= len(mm) // 2
    except (OSError, ValueError):
        pass
    return False


def _huge_map_or_read(f) -> mmap.mmap | np.ndarray:
    """The store file's bytes: its private mapping where the kernel maps it in 2 MiB pages
    (``huge_mapped``), else read into anonymous memory, which numpy asks to back with huge pages:
    the GEMMs stream the weights, and through 4 KiB pages a 1B model's decode took 14% longer
    (55.5 against 48.5 ms a token, side by side)."""
    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mm.madvise(mmap.MADV_HUGEPAGE)
    if huge_mapped(mm):
        return mm
    mm.close()
    data = np.empty(os.fstat(f.fileno()).st_size, np.uint8)
    f.seek(0)
    got = f.readinto(memoryview(data))
    if got != data.size:
        raise ValueError(f"read {got} of {data.size} bytes")
    return data


def prune(newest: Path, keep: int = MAX_KEPT, stale_s: float = 3600.0) -> None:
    """Remove all but the ``keep`` most recently used store files beside ``newest`` (which stays),
    and temporary files left by writers that died more than ``stale_s`` ago."""
    now = time.time()
    stores = []
    for p in newest.parent.iterdir():
        try:
            st = p.stat()
        except OSError:
            continue
        if p.name.endswith(".tmp"):
            if now - st.st_mtime > stale_s:
                p.unlink(missing_ok=True)
        elif p.name.endswith(".bin") and p != newest:
            stores.append((st.st_mtime, p))
    for _, p in sorted(stores, reverse=True)[keep - 1:]:
        p.unlink(missing_ok=True)
