"""hotprefix.files.atomic: the one atomic write (temporary name, fsync, rename, fsync of the directory)."""

from __future__ import annotations

import os
import stat

import pytest

from hotprefix.files import atomic
from hotprefix.files.atomic import atomic_path, commit, write_atomic, write_temp


@pytest.fixture
def synced(monkeypatch):
    """The paths ``os.fsync`` was called on, in order."""
    seen: list[str] = []
    real = os.fsync

    def fsync(fd):
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    return seen


def test_write_atomic_replaces_whole_private_and_synced(tmp_path, synced):
    p = tmp_path / "state.json"
    p.write_bytes(b"old")
    write_atomic(p, b"new")
    assert p.read_bytes() == b"new"
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert os.listdir(tmp_path) == ["state.json"]  # no temporary file left
    assert synced[-1] == str(tmp_path)  # the directory, after the rename
    assert len(synced) == 2 and synced[0].endswith(".tmp")  # the file's bytes, before it


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    p = tmp_path / "f"
    p.write_bytes(b"old")

    def no_rename(a, b):
        raise OSError(28, "no space left")

    monkeypatch.setattr(atomic.os, "replace", no_rename)
    with pytest.raises(OSError):
        write_atomic(p, b"new")
    assert p.read_bytes() == b"old" and os.listdir(tmp_path) == ["f"]


def test_atomic_path_for_a_writer_that_opens_the_file_itself(tmp_path, synced):
    out = tmp_path / "k.so"
    with atomic_path(out) as tmp:
        assert os.path.dirname(tmp) == str(tmp_path) and tmp.endswith(".tmp")
        with open(tmp, "wb") as f:
            f.write(b"\x7fELF")
        assert not out.exists()  # not there until the block ends
    assert out.read_bytes() == b"\x7fELF" and os.listdir(tmp_path) == ["k.so"]
    with pytest.raises(RuntimeError), atomic_path(tmp_path / "x") as tmp:
        raise RuntimeError("the compiler failed")
    assert os.listdir(tmp_path) == ["k.so"]


def test_a_directory_appears_whole_and_never_over_another(tmp_path, synced):
    saved = tmp_path / "tok"
    with atomic_path(saved, directory=True, replace=False) as tmp:
        (open(os.path.join(tmp, "a.json"), "w")).close()
    assert os.listdir(saved) == ["a.json"]
    assert any(s.endswith("a.json") for s in synced)  # every file in it flushed
    with pytest.raises(OSError), atomic_path(saved, directory=True, replace=False) as tmp:
        (open(os.path.join(tmp, "b.json"), "w")).close()  # another process saved it first
    assert os.listdir(saved) == ["a.json"] and os.listdir(tmp_path) == ["tok"]


def test_the_two_halves_for_a_caller_that_decides_under_its_lock(tmp_path):
    final = tmp_path / "e.blk"
    tmp = write_temp(final, b"blob")
    assert not final.exists() and os.path.basename(tmp).startswith(".e.blk.")
    commit(tmp, final)
    assert final.read_bytes() == b"blob" and not os.path.exists(tmp)
