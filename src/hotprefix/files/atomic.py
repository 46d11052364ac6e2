"""The one atomic write: a file (or a directory) appears whole under its name or not at all, and
survives a crash once the write returns.

Everything is written under a temporary name in the destination's own directory, flushed to the
disk (``fsync`` of every file written, then of the directory after the rename), and renamed into
place, so a reader sees the old entry or the new one, never a half-written one, and a power cut
after the call does not leave a torn or empty file behind the new name. A failed write removes its
temporary file and leaves the old entry alone.

- ``write_atomic(path, data)``: bytes in hand (state files, stored responses);
- ``atomic_path(path)``: a temporary name for a writer that opens the file itself (a compiler's
  ``-o``, ``numpy.savez``), or with ``directory=True`` a temporary directory (a saved tokenizer);
- ``write_temp`` then ``commit``: the two halves, for a caller that decides between them under its
  own lock (the disk tier's eviction).

Standard library only; knows nothing of what the files hold.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator


def _temp_name(path: str | os.PathLike) -> dict[str, str]:
    """``mkstemp``'s arguments for a temporary name beside ``path``: ``.<name>.<random>.tmp``
    (hidden, and ending ``.tmp``: a directory scan, such as the disk tier's, passes over it)."""
    d, name = os.path.split(os.path.abspath(path))
    return {"dir": d, "prefix": f".{name}.", "suffix": ".tmp"}


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # a directory on a file system that cannot sync one: the rename still holds
        if not os.path.isdir(path):
            raise
    finally:
        os.close(fd)


def _fsync_tree(path: str) -> None:
    if os.path.isdir(path):
        for d, _, names in os.walk(path):
            for n in names:
                _fsync(os.path.join(d, n))
            _fsync(d)
    else:
        _fsync(path)


def _remove(tmp: str) -> None:
    if os.path.isdir(tmp):
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def commit(tmp: str, path: str | os.PathLike, replace: bool = True) -> None:
    """Flush ``tmp`` (a file, or a directory and every file in it) to the disk and rename it to
    ``path``, then flush the directory that holds it. ``replace=False``: fail (``OSError``) where
    ``path`` exists (a directory saved first by another process). ``tmp`` is removed on failure."""
    try:
        _fsync_tree(tmp)
        (os.replace if replace else os.rename)(tmp, path)
    except BaseException:
        _remove(tmp)
        raise
    _fsync(os.path.dirname(os.path.abspath(path)))


def write_temp(path: str | os.PathLike, data: bytes, mode: int = 0o600) -> str:
    """``data`` in a new temporary file (``mode``) beside ``path``, not yet renamed: ``commit`` it
    (or remove it). Raises OSError, leaving nothing behind."""
    fd, tmp = tempfile.mkstemp(**_temp_name(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
    except BaseException:
        _remove(tmp)
        raise
    return tmp


def write_atomic(path: str | os.PathLike, data: bytes, mode: int = 0o600) -> None:
    """Replace ``path`` with ``data`` (file mode ``mode``): see the module docstring."""
    commit(write_temp(path, data, mode), path)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, directory: bool = False,
                replace: bool = True) -> Iterator[str]:
    """A temporary name beside ``path`` (an empty file, or an empty directory with ``directory``)
    for the caller to fill; committed to ``path`` when the block ends, removed if it raises."""
    if directory:
        tmp = tempfile.mkdtemp(**_temp_name(path))
    else:
        fd, tmp = tempfile.mkstemp(**_temp_name(path))
        os.close(fd)
    try:
        yield tmp
    except BaseException:
        _remove(tmp)
        raise
    commit(tmp, path, replace=replace)
