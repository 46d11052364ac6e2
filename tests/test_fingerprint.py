"""The model fingerprint (``files/fingerprint.py``): the namespace's root, remembered per file
identity, and never remembered for bytes that changed."""

import hashlib
import os

import pytest

from hotprefix.files import fingerprint
from hotprefix.files.fingerprint import files_digest


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache directory of the test's own, and files counted as settled at once."""
    monkeypatch.setenv("HOTPREFIX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(fingerprint, "SETTLED_S", 0.0)
    return tmp_path / "cache" / "fingerprints"


def _no_hashing(monkeypatch):
    def refuse(*_):
        raise AssertionError("the files were read again")
    monkeypatch.setattr(fingerprint, "_hash", refuse)


def test_the_digest_is_sha256_of_the_text_and_the_files_in_name_order(tmp_path, cache):
    """Whatever buffer reads them, and whether or not it was remembered."""
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    a.write_bytes(bytes(range(256)) * 5000 + b"tail")
    b.write_bytes(b"second file")
    want = hashlib.sha256(b"arch" + a.read_bytes() + b.read_bytes()).hexdigest()[:16]
    assert files_digest([str(b), str(a)], "arch") == want
    assert files_digest([str(a), str(b)], "arch") == want  # remembered: the same answer
    assert files_digest([str(a)], "arch") != want
    assert files_digest([str(a), str(b)], "other text") != want


def test_a_second_start_does_not_read_the_files(tmp_path, cache, monkeypatch):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"weights" * 1000)
    first = files_digest([str(f)], "arch")
    assert len(list(cache.iterdir())) == 1
    _no_hashing(monkeypatch)
    assert files_digest([str(f)], "arch") == first


def test_new_bytes_at_the_same_size_and_time_are_hashed_again(tmp_path, cache):
    """Rewritten in place with its modification time set back: the status-change time moved."""
    f = tmp_path / "m.gguf"
    f.write_bytes(b"A" * 4096)
    st = os.stat(f)
    old = files_digest([str(f)], "arch")
    f.write_bytes(b"B" * 4096)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(f).st_size == st.st_size and os.stat(f).st_mtime_ns == st.st_mtime_ns
    new = files_digest([str(f)], "arch")
    assert new != old
    assert new == hashlib.sha256(b"arch" + b"B" * 4096).hexdigest()[:16]


def test_a_file_changed_moments_ago_is_not_remembered(tmp_path, cache, monkeypatch):
    monkeypatch.setattr(fingerprint, "SETTLED_S", 3600.0)
    f = tmp_path / "m.gguf"
    f.write_bytes(b"still being written")
    files_digest([str(f)], "arch")
    assert not cache.exists() or not list(cache.iterdir())


def test_a_file_changing_while_it_is_read_is_not_remembered(tmp_path, cache, monkeypatch):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"part one")
    real = fingerprint._hash

    def hash_then_append(text, paths):
        digest = real(text, paths)
        with open(f, "ab") as out:
            out.write(b" and part two")
        return digest
    monkeypatch.setattr(fingerprint, "_hash", hash_then_append)
    files_digest([str(f)], "arch")
    assert not cache.exists() or not list(cache.iterdir())


@pytest.mark.parametrize("content", [b"not a digest", b"\xff\xfe", b"", b"0123456789abcdef0"])
def test_a_damaged_entry_is_passed_over(tmp_path, cache, content):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"weights")
    want = files_digest([str(f)], "arch")
    (entry,) = cache.iterdir()
    entry.write_bytes(content)
    assert files_digest([str(f)], "arch") == want


def test_an_unwritable_cache_directory_still_gives_the_digest(tmp_path, monkeypatch):
    blocker = tmp_path / "a file"
    blocker.write_bytes(b"")
    monkeypatch.setenv("HOTPREFIX_CACHE_DIR", str(blocker))
    monkeypatch.setattr(fingerprint, "SETTLED_S", 0.0)
    f = tmp_path / "m.gguf"
    f.write_bytes(b"weights")
    assert files_digest([str(f)], "arch") == hashlib.sha256(b"arch" + b"weights").hexdigest()[:16]


def test_a_missing_file_is_reported(tmp_path, cache):
    with pytest.raises(FileNotFoundError):
        files_digest([str(tmp_path / "gone.gguf")], "arch")
