"""Packed weights kept on disk (``model/packed_store.py``): a second start maps them instead of
packing, with the same bits; a store that is damaged, another layout's, another file's, or cannot
be written is passed over, and the model packs."""

import json
import mmap
import os
import struct
import time

import numpy as np
import pytest
import torch
from test_kquants import _write_gguf

from hotprefix.files import fingerprint
from hotprefix.model import gguf_blocks, packed_store
from hotprefix.model.attention import AttentionMetadata, PrefillSeq
from hotprefix.model.llama import LlamaModel
from hotprefix.model.loader import load_model
from hotprefix.model.packed_store import PackedStore, prune

KINDS = {"token_embd": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K",
         "attn_output": "Q5_0", "ffn_gate": "Q4_K", "ffn_up": "Q5_K", "ffn_down": "Q6_K"}


@pytest.fixture
def store_dir(tmp_path, monkeypatch):
    """A store directory of the test's own; every model kept, and files counted as settled at once
    (the fingerprint is remembered for a file written moments ago)."""
    d = tmp_path / "packed"
    monkeypatch.setattr(packed_store, "cache_dir", lambda kind: d)
    monkeypatch.setattr(packed_store, "MIN_BYTES", 0)
    monkeypatch.setattr(fingerprint, "SETTLED_S", 0.0)
    monkeypatch.setenv("HOTPREFIX_CACHE_DIR", str(tmp_path / "cache"))  # the fingerprints' memo
    return d


def start(path, width="a16"):
    """What ``ModelRunner`` does: the model's store, the model, the store written for next time."""
    loaded = load_model(str(path))
    kept = PackedStore([str(path)], loaded.arch.fingerprint_json(), width, loaded.identity)
    model = LlamaModel(loaded.arch, loaded.weights, torch.device("cpu"), torch.bfloat16, "gguf", True,
                       loaded.blocks, activations="int8" if width == "a8" else "int16", kept=kept)
    writer = kept.keep(loaded.fingerprint_digest)
    if writer is not None:
        writer.join()
    return model, kept


def packed(model) -> list[torch.Tensor]:
    ws = [model.lm_head] + [w for layer in model.layers for w in layer.values() if hasattr(w, "packed")]
    return [w.packed for w in ws]


def logits(model, n=37):
    caches = [(torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16),
               torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)) for _ in range(2)]
    ids = torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(7))
    meta = AttentionMetadata(slot_mapping=torch.arange(n), prefills=[PrefillSeq(0, n, n, torch.arange(4))])
    return model.forward(ids, torch.arange(n), caches, meta, None)


def in_map(kept: PackedStore, t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes lie in the store file's bytes as the store holds them."""
    whole = np.frombuffer(kept._data, np.uint8)
    lo = whole.ctypes.data
    return lo <= t.data_ptr() and t.data_ptr() + t.numel() <= lo + whole.size


def no_packing(monkeypatch):
    def refuse(*_):
        raise AssertionError("a weight was packed")
    monkeypatch.setattr(gguf_blocks, "pack_groups_reference", refuse)
    monkeypatch.setattr("hotprefix.model.qlinear._packer", lambda lib: refuse)


@pytest.mark.parametrize("huge", [True, False])
def test_a_second_start_maps_the_packed_weights_with_the_same_bits(tmp_path, store_dir, monkeypatch,
                                                                   huge):
    """Mapped where the kernel maps the file in 2 MiB pages, else read into anonymous memory (the
    GEMMs stream the weights: 4 KiB pages cost decode 14%); either way no weight is packed."""
    monkeypatch.setattr(packed_store, "huge_mapped", lambda mm: huge)
    path = tmp_path / "m.gguf"
    _write_gguf(path, KINDS)
    first, kept = start(path)
    assert kept.path is None and kept.packed == len(packed(first))
    stores = list(store_dir.glob("*.bin"))
    assert len(stores) == 1 and stores[0].name.endswith("-a16.bin")
    with monkeypatch.context() as m:
        no_packing(m)
        second, kept2 = start(path)
    assert kept2.path == stores[0] and kept2.packed == 0
    for a, b in zip(packed(first), packed(second), strict=True):
        assert torch.equal(a, b)
    assert all(in_map(kept2, t) for t in packed(second))  # views of the store's bytes, no copy
    assert isinstance(kept2._data, mmap.mmap) == huge
    assert torch.equal(logits(first), logits(second))
    # 8-bit activations: their own store (their tables carry the flag)
    a8, kept8 = start(path, "a8")
    assert kept8.path is None and len(list(store_dir.glob("*.bin"))) == 2
    assert torch.equal(logits(start(path, "a8")[0]), logits(a8))


def corrupt_table(store: os.PathLike, key_part: str) -> None:
    """Flip a bit of one weight's table (a group's offset) in the store file."""
    raw = bytearray(open(store, "rb").read())
    n = struct.unpack("<Q", raw[len(packed_store.MAGIC):len(packed_store.MAGIC) + 8])[0]
    index = json.loads(raw[len(packed_store.MAGIC) + 8:len(packed_store.MAGIC) + 8 + n])["weights"]
    off = next(v[0] for k, v in index.items() if key_part in k)
    raw[off + 9] ^= 0x10  # the second group's offset
    open(store, "wb").write(raw)


def rewrite_index(store: os.PathLike, change) -> None:
    """The store file with its index (the parsed JSON) changed by ``change``, the same length."""
    m = len(packed_store.MAGIC)
    raw = bytearray(open(store, "rb").read())
    n = struct.unpack("<Q", raw[m:m + 8])[0]
    body = json.dumps(change(json.loads(raw[m + 8:m + 8 + n]))).encode()
    raw[m:m + 8 + len(body)] = struct.pack("<Q", len(body)) + body
    open(store, "wb").write(raw)


def first_weight(index: dict, value) -> dict:
    index["weights"][next(iter(index["weights"]))] = value
    return index


@pytest.mark.parametrize("damage", ["truncated", "header", "table", "layout", "huge-index",
                                    "negative-offset", "outside", "unaligned", "not-a-pair",
                                    "index-a-list"])
def test_a_damaged_store_is_passed_over_and_written_again(tmp_path, store_dir, monkeypatch, damage):
    path = tmp_path / "m.gguf"
    _write_gguf(path, KINDS)
    fresh, _ = start(path)
    (store,) = store_dir.glob("*.bin")
    if damage == "truncated":
        os.truncate(store, store.stat().st_size // 2)
    elif damage == "header":
        store.write_bytes(b"not a store" + store.read_bytes()[11:])
    elif damage == "table":
        corrupt_table(store, "layers.1.mlp.gate_proj")
    elif damage == "layout":
        monkeypatch.setattr(packed_store, "layout_version", lambda: "0123456789ab")
    elif damage == "huge-index":
        m = len(packed_store.MAGIC)
        raw = bytearray(store.read_bytes())
        raw[m:m + 8] = struct.pack("<Q", 1 << 62)
        store.write_bytes(raw)
    else:
        size = store.stat().st_size
        rewrite_index(store, {"negative-offset": lambda i: first_weight(i, [-4096, 8]),
                              "outside": lambda i: first_weight(i, [4096, size]),
                              "unaligned": lambda i: first_weight(i, [4097, 8]),
                              "not-a-pair": lambda i: first_weight(i, {"offset": 4096}),
                              "index-a-list": lambda i: [i]}[damage])
    again, kept = start(path)
    if damage == "table":  # only that weight is packed again; the others come from the store
        assert kept.path == store and kept.packed == 1
    else:
        assert kept.path is None and kept.packed == len(packed(fresh))
    for a, b in zip(packed(fresh), packed(again), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(logits(fresh), logits(again))
    with monkeypatch.context() as m:  # written whole again: the next start packs nothing
        no_packing(m)
        third, kept3 = start(path)
    assert kept3.path is not None and kept3.packed == 0
    assert torch.equal(logits(third), logits(fresh))


def test_a_rewritten_model_file_never_meets_the_old_store(tmp_path, store_dir):
    path = tmp_path / "m.gguf"
    _write_gguf(path, KINDS, seed=0)
    old, _ = start(path)
    os.unlink(path)  # the same name, other weights
    _write_gguf(path, KINDS, seed=1)
    new, kept = start(path)
    assert kept.path is None and kept.packed == len(packed(new))
    loaded = load_model(str(path))
    fresh = LlamaModel(loaded.arch, loaded.weights, torch.device("cpu"), torch.bfloat16, "gguf", True,
                       loaded.blocks)
    assert torch.equal(logits(new), logits(fresh))
    assert not torch.equal(logits(new), logits(old))
    assert len(list(store_dir.glob("*.bin"))) == 2  # one per fingerprint


def test_nothing_is_kept_for_an_unsettled_file_or_an_unwritable_directory(tmp_path, store_dir, monkeypatch):
    path = tmp_path / "m.gguf"
    _write_gguf(path, KINDS)
    monkeypatch.setattr(fingerprint, "SETTLED_S", 3600.0)  # written just now: not remembered
    model, kept = start(path)
    assert kept.packed > 0 and not store_dir.exists()
    monkeypatch.setattr(fingerprint, "SETTLED_S", 0.0)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setattr(packed_store, "cache_dir", lambda kind: blocker / "packed")
    model2, kept2 = start(path)  # the write fails (logged); the model runs
    assert kept2.packed > 0 and torch.equal(logits(model2), logits(model))


def test_a_file_changed_after_it_was_mapped_is_not_kept(tmp_path, store_dir):
    """Rewritten with the very same bytes after the load mapped it (and hashed again, so its
    fingerprint is remembered for the new identity): its bytes may differ from those packed, so
    nothing is kept."""
    path = tmp_path / "m.gguf"
    _write_gguf(path, KINDS)
    loaded = load_model(str(path))
    kept = PackedStore([str(path)], loaded.arch.fingerprint_json(), "a16", loaded.identity)
    LlamaModel(loaded.arch, loaded.weights, torch.device("cpu"), torch.bfloat16, "gguf", True,
               loaded.blocks, kept=kept)
    digest = loaded.fingerprint
    data = path.read_bytes()
    os.unlink(path)
    path.write_bytes(data)
    assert fingerprint.files_digest([str(path)], loaded.arch.fingerprint_json()) == digest
    assert fingerprint.remembered_digest([str(path)], loaded.arch.fingerprint_json()) == digest
    kept.keep(loaded.fingerprint_digest).join()
    assert not store_dir.exists()


def test_nothing_is_kept_where_it_would_leave_the_disk_nearly_full(tmp_path, store_dir, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(100 << 30, 91 << 30, 9 << 30))
    path = tmp_path / "m.gguf"
    _write_gguf(path, KINDS)
    _, kept = start(path)  # 9 GiB free of 100: a store would leave under a tenth
    assert kept.packed > 0 and not list(store_dir.glob("*.bin"))
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(100 << 30, 80 << 30, 20 << 30))
    start(path)
    assert len(list(store_dir.glob("*.bin"))) == 1


def test_without_the_packing_sources_nothing_is_kept_or_read(tmp_path, store_dir, monkeypatch):
    path = tmp_path / "m.gguf"
    _write_gguf(path, KINDS)
    fresh, _ = start(path)
    monkeypatch.setattr(packed_store, "_LAYOUT_SOURCES", ("no-such-file.c",))
    model, kept = start(path)
    assert kept.path is None and kept.packed > 0 and kept.keep("0" * 16) is None
    assert torch.equal(logits(model), logits(fresh))


def test_small_models_are_not_kept(tmp_path, store_dir, monkeypatch):
    monkeypatch.setattr(packed_store, "MIN_BYTES", 1 << 30)
    path = tmp_path / "m.gguf"
    _write_gguf(path, KINDS)
    _, kept = start(path)
    assert kept.packed > 0 and not store_dir.exists()


def test_prune_keeps_the_most_recently_used(tmp_path):
    now = time.time()
    files = []
    for i in range(6):
        f = tmp_path / f"{i:016x}-layout-a16.bin"
        f.write_bytes(b"x")
        os.utime(f, (now - 100 * i, now - 100 * i))
        files.append(f)
    old_tmp, new_tmp = tmp_path / ".a.bin.1.tmp", tmp_path / ".b.bin.2.tmp"
    for f, age in ((old_tmp, 7200), (new_tmp, 10)):
        f.write_bytes(b"")
        os.utime(f, (now - age, now - age))
    newest = files[5]  # just written, whatever its time
    prune(newest, keep=3)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([new_tmp.name, files[0].name, files[1].name, newest.name])


def test_a_kept_store_leaves_the_page_cache_once_on_disk(tmp_path, store_dir, monkeypatch):
    """The store's written pages are dropped after they reach the disk (fsync, then
    ``POSIX_FADV_DONTNEED`` over the whole file), so the next start reads it back in large folios
    it can map 2 MiB at a time rather than copy it; the file is whole and maps as before."""
    if not hasattr(os, "posix_fadvise"):
        pytest.skip("no posix_fadvise here: the pages stay, as before")
    calls = []
    real_fsync, real_fadvise = os.fsync, os.posix_fadvise
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(("fsync", fd)), real_fsync(fd))[1])
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: (
        calls.append(("fadvise", off, n, advice, os.fstat(fd).st_size)), real_fadvise(fd, off, n, advice))[1])
    path = tmp_path / "m.gguf"
    _write_gguf(path, KINDS)
    first, kept = start(path)
    (store,) = store_dir.glob("*.bin")
    advised = [c for c in calls if c[0] == "fadvise"]
    assert advised == [("fadvise", 0, 0, os.POSIX_FADV_DONTNEED, store.stat().st_size)]
    assert calls.index(advised[0]) > 0 and calls[calls.index(advised[0]) - 1][0] == "fsync"
    with monkeypatch.context() as m:
        no_packing(m)
        second, kept2 = start(path)
    assert kept2.path == store and torch.equal(logits(first), logits(second))


def test_a_file_system_refusing_the_advice_still_keeps_the_store(tmp_path, store_dir, monkeypatch):
    def refuse(fd, off, n, advice):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "posix_fadvise", refuse, raising=False)
    path = tmp_path / "m.gguf"
    _write_gguf(path, KINDS)
    first, _ = start(path)
    (store,) = store_dir.glob("*.bin")
    with monkeypatch.context() as m:
        no_packing(m)
        second, kept2 = start(path)
    assert kept2.path == store and torch.equal(logits(first), logits(second))


def test_a_small_file_is_not_counted_as_huge_mapped(tmp_path):
    f = tmp_path / "small.bin"
    f.write_bytes(b"x" * (1 << 20))  # under one 2 MiB page
    with open(f, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    assert packed_store.huge_mapped(mm) is False
    mm.close()  # no view of it left behind


def test_the_runner_keeps_and_maps_the_default_model(tmp_path, store_dir):
    """Through ``LLM``: ``packed_cache`` on keeps the packed weights and the next start maps them
    (the same greedy tokens); off, nothing is kept or read."""
    from hotprefix import LLM
    from hotprefix.request.sampling import SamplingParams

    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    kw = {"kv_cache_memory": "32MiB", "num_threads": 2, "weights": "gguf"}  # gguf at every level
    off = LLM(packed_cache=False, **kw)
    assert off.engine.runner.keeping is None and not store_dir.exists()
    want = off.generate("The capital of France is", sp)[0].outputs[0].token_ids
    first = LLM(**kw)
    first.engine.runner.keeping.join()
    assert len(list(store_dir.glob("*.bin"))) == 1
    second = LLM(**kw)
    assert second.engine.runner.keeping is None  # nothing packed: nothing to write
    assert second.generate("The capital of France is", sp)[0].outputs[0].token_ids == want
    assert first.engine.namespace == second.engine.namespace == off.engine.namespace
    model = second.engine.runner.model
    assert all(in_map(model_store(second), t) for t in packed(model))


def model_store(llm) -> PackedStore:
    """The store an ``LLM``'s model took its weights from (kept by the model's ``_Packer``)."""
    return llm.engine.runner.kept
