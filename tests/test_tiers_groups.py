"""KV tiers under a hybrid pool (tiny random Gemma 3: 5 window layers of 40 keys, 1 full layer).

A tier entry holds a part per KV group (``cache/tiers/group_blob.py``), each verified alone: a
prompt cached, the pool emptied (reset, or a new engine on the same disk directory), the prompt
again comes from the tier with the same greedy tokens and bit-identical log probabilities; a bad
window part fails only that group's block (the hit resumes earlier, still exact); a whole-model
entry and a hybrid entry never read as each other."""

from __future__ import annotations

import glob
import os
import shutil
import struct
import time

import pytest
import torch

from hotprefix import LLM, SamplingParams
from hotprefix.cache.kv_groups import group_key
from hotprefix.cache.report import MissReason
from hotprefix.cache.tiers.blob import BadSignature, CorruptEntry, decode_blob, storage_key
from hotprefix.cache.tiers.group_blob import decode_groups, encode_groups

from model_support import save_random_model
from test_hybrid_engine import BS, GEMMA3, WINDOW

N_TOKENS = 300
N_BLOCKS = (N_TOKENS - 1) // BS  # cacheable blocks: 18
WINDOW_BLOCKS = 3  # a hit at block n needs blocks n-3 .. n-1 of a window group (40 keys, 16 a block)
P = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory, default_tokenizer):
    return save_random_model(tmp_path_factory.mktemp("tiny-gemma3-tiers"), default_tokenizer,
                             "Gemma3ForCausalLM", "Gemma3TextConfig", GEMMA3, norm_offset=0.0)


def _llm(d, stores=(), **kw) -> LLM:
    opts = dict(dtype="float32", block_size=BS, num_blocks=160, max_model_len=2048, num_threads=1)
    if stores:
        opts.update(kv_store=list(stores), kv_store_timeout=5.0)
    return LLM(str(d), **{**opts, **kw})


def _prompt(seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (N_TOKENS,), generator=g).tolist()


@pytest.fixture(scope="module")
def cold(gemma_dir):
    """(token ids, log probs) of a hybrid engine that reads no cache, per prompt seed."""
    llm = _llm(gemma_dir, enable_prefix_caching=False)
    vocab = llm.engine.runner.arch.vocab_size
    memo: dict = {}

    def get(seed: int):
        if seed not in memo:
            o = llm.generate([_prompt(seed, vocab)], P)[0]
            memo[seed] = (o.token_ids, o.outputs[0].logprobs)
        return memo[seed]
    get.vocab = vocab
    return get


def _run(llm: LLM, p: list[int]):
    o = llm.generate([p], P)[0]
    return o, (o.token_ids, o.outputs[0].logprobs)


def _disk(llm: LLM) -> dict:
    return llm.cache_stats()["tiers"]["disk"]


def _idle(llm: LLM) -> None:
    pool = llm.engine.cache.pool
    assert pool.num_in_use == 0
    pool.check_invariants()


def _files(d) -> list[str]:
    return sorted(glob.glob(os.path.join(str(d), "**", "*.blk"), recursive=True))


def _file_of(d, layout: str, key: bytes) -> str:
    skey = storage_key(layout, key)
    return next(f for f in _files(d) if os.path.basename(f).startswith(skey))


def _write(gemma_dir, store: str, p: list[int], **kw):
    """Run ``p`` once on a fresh engine over ``store``; returns (its output, the io layout, its
    block keys), with every write flushed."""
    with _llm(gemma_dir, [store], **kw) as w:
        o, got = _run(w, p)
        assert o.cache_report.sources == {"pool": 0}
        w.engine.cache.tiers.tiers.flush()
        assert _disk(w)["bytes_written"] > 0 and _disk(w)["dropped_writes"] == 0
        return got, w.engine.cache.tiers.io, w.engine.cache.hasher.keys(p)


# ---------------------------------------------------------------------- the entry format
def test_group_entry_round_trip_and_each_part_verified_alone():
    key, parent, toks, layout = b"k" * 32, b"p" * 32, (1, 2, 3), "kv1/test/G"
    parts = {0: b"a" * 64, 2: b"b" * 64, 3: b"c" * 64}
    blob = encode_groups(key, parent, toks, layout, parts)
    args = dict(key=key, parent=parent, token_ids=toks, layout=layout, payload_len=64)
    first, others, bad = decode_groups(blob, **args)
    assert bytes(first) == parts[0] and {g: bytes(v) for g, v in others.items()} == {2: parts[2], 3: parts[3]}
    assert bad == []
    # locate each part from the frame, flip one byte of its page: that part alone is dropped
    count = struct.unpack_from("<4sHH", blob)[2]
    table = [struct.unpack_from("<HI", blob, 8 + 6 * j) for j in range(count)]
    assert [g for g, _ in table] == [0, 2, 3]
    pos = 8 + 6 * count + 4
    offsets = {}
    for g, length in table:
        offsets[g] = (pos, length)
        pos += length
    assert pos == len(blob)
    for g in (2, 3):
        at = offsets[g][0] + offsets[g][1] // 2
        broken = blob[:at] + bytes([blob[at] ^ 1]) + blob[at + 1:]
        first, others, bad = decode_groups(broken, **args)
        assert bytes(first) == parts[0] and set(others) == {2, 3} - {g}
        assert [b for b, _ in bad] == [g] and isinstance(bad[0][1], CorruptEntry)
    at = offsets[0][0] + offsets[0][1] // 2  # group 0's part: the whole entry is refused
    with pytest.raises(CorruptEntry):
        decode_groups(blob[:at] + bytes([blob[at] ^ 1]) + blob[at + 1:], **args)
    with pytest.raises(CorruptEntry):  # the frame
        decode_groups(blob[:9] + bytes([blob[9] ^ 1]) + blob[10:], **args)
    with pytest.raises(CorruptEntry):  # another block's lookup
        decode_groups(blob, **{**args, "key": b"x" * 32})
    with pytest.raises(CorruptEntry):  # a whole-model blob is not a group entry
        decode_groups(blob[8 + 6 * count + 4:][:offsets[0][1]], **args)
    # the frame relabelled (checksum recomputed): group 2's part under group 3's number fails
    # group 3's key check
    import zlib
    frame = bytearray(blob[:8 + 6 * count])
    struct.pack_into("<HI", frame, 8 + 6, 3, table[1][1])
    struct.pack_into("<HI", frame, 8 + 12, 4, table[2][1])
    relabelled = bytes(frame) + struct.pack("<I", zlib.crc32(frame)) + blob[8 + 6 * count + 4:]
    _, others, bad = decode_groups(relabelled, **args)
    assert others == {} and sorted(g for g, _ in bad) == [3, 4]
    with pytest.raises(ValueError):
        encode_groups(key, parent, toks, layout, {2: b"b" * 64})


def test_group_entry_signed_parts():
    key, toks, layout = b"k" * 32, (5,), "kv1/test/G"
    args = dict(key=key, parent=None, token_ids=toks, layout=layout, payload_len=8)
    blob = encode_groups(key, None, toks, layout, {0: b"0" * 8, 1: b"1" * 8}, secret=b"s1")
    first, others, _ = decode_groups(blob, **args, secret=b"s1")
    assert bytes(first) == b"0" * 8 and bytes(others[1]) == b"1" * 8
    with pytest.raises(BadSignature):
        decode_groups(blob, **args, secret=b"s2")
    with pytest.raises(BadSignature):
        decode_groups(blob, **args)
    # a part signed with another secret spliced in: that part alone is refused
    other = encode_groups(key, None, toks, layout, {0: b"0" * 8, 1: b"9" * 8}, secret=b"s2")
    assert len(other) == len(blob)  # same sizes: the same frame
    half = 8 + 6 * 2 + 4 + struct.unpack_from("<HI", blob, 8)[1]
    spliced = blob[:half] + other[half:]
    first, others, bad = decode_groups(spliced, **args, secret=b"s1")
    assert bytes(first) == b"0" * 8 and others == {} and isinstance(bad[0][1], BadSignature)


# ---------------------------------------------------------------------- engines
def test_layout_stays_hybrid_with_tiers_and_entries_hold_every_group(gemma_dir, tmp_path, cold):
    store = f"disk:{tmp_path / 'kv'}"
    p = _prompt(1, cold.vocab)
    got, io, keys = _write(gemma_dir, store, p)
    assert got == cold(1)
    with _llm(gemma_dir, [store]) as llm:
        lay = llm.engine.runner.layout
        assert lay.hybrid and llm.engine.cache.windows is not None
        assert "/G5w0;0w40;1w40;2w40;3w40;4w40" in io.layout and "/L1/" in io.layout
    files = _files(tmp_path / "kv")
    written = (N_TOKENS + P.max_tokens - 1) // BS  # the prompt's blocks and the decoded ones
    assert written > N_BLOCKS and len(files) == written
    seq = p + list(got[0])  # the prompt and the generated tokens
    keys = llm.engine.cache.hasher.keys(seq)
    assert len(keys) >= written
    parent = None
    for i, key in enumerate(keys[:written]):
        blob = open(_file_of(tmp_path / "kv", io.layout, key), "rb").read()
        ns = llm.engine.cache.hasher.namespace
        first, others, bad = decode_groups(blob, key=key, parent=keys[i - 1] if i else ns,
                                           token_ids=seq[i * BS:(i + 1) * BS], layout=io.layout,
                                           payload_len=io.payload_len)
        # every window block was cached at the commit that cached its group-0 block
        assert bad == [] and sorted(others) == [1, 2, 3, 4, 5]
        assert len(first) == io.payload_len
        parent = key
    assert parent == keys[written - 1]


@pytest.mark.parametrize("how", ["reset", "restart"])
def test_round_trip_through_the_tier_is_exact(gemma_dir, tmp_path, cold, how):
    store = f"disk:{tmp_path / 'kv'}"
    p = _prompt(2, cold.vocab)
    with _llm(gemma_dir, [store]) as first:
        o, got = _run(first, p)
        assert o.cache_report.sources == {"pool": 0} and got == cold(2)
        first.engine.cache.tiers.tiers.flush()
        if how == "reset":
            first.reset_prefix_cache()
            assert first.engine.cache.pool.num_cached == 0
            o2, got2 = _run(first, p)
            llm = first
        else:
            llm = None
    if llm is None:
        llm = _llm(gemma_dir, [store])
        o2, got2 = _run(llm, p)
    with llm:
        assert o2.num_cached_tokens == N_BLOCKS * BS
        assert o2.cache_report.sources == {"pool": 0, "disk": N_BLOCKS * BS}
        assert got2 == cold(2)  # greedy tokens and every step's log probabilities, bit for bit
        assert _disk(llm)["corrupt"] == 0 and _disk(llm)["hit_blocks"] == N_BLOCKS
        s = llm.cache_stats()
        # only the windows before the resume point were installed, not every window page
        for g in s["kv_groups"][1:]:
            assert WINDOW_BLOCKS <= g["pages_cached"] < N_BLOCKS // 2
        assert s["kv_groups"][0]["pages_cached"] >= N_BLOCKS
        _idle(llm)
        o3, got3 = _run(llm, p)  # and now from the pool
        assert o3.cache_report.sources == {"pool": N_BLOCKS * BS} and got3 == cold(2)
        _idle(llm)


def _flip_part(path: str, group: int) -> None:
    """Flip a byte in the middle of ``group``'s page inside a group entry file."""
    data = bytearray(open(path, "rb").read())
    count = struct.unpack_from("<4sHH", data)[2]
    pos = 8 + 6 * count + 4
    for j in range(count):
        g, length = struct.unpack_from("<HI", data, 8 + 6 * j)
        if g == group:
            data[pos + length // 2] ^= 0x40
            open(path, "wb").write(bytes(data))
            return
        pos += length
    raise AssertionError(f"no part of group {group}")


@pytest.mark.parametrize("part", [2, 0])
def test_a_bad_part_fails_only_that_load(gemma_dir, tmp_path, cold, part):
    """Block 16's part of window group 2 flipped: group 2's block 16 is not installed, so the hit
    resumes at block 16 (whose window, blocks 13-15, every group has); group 0's part flipped:
    the entry is refused, the run ends at block 16. Either way exact, nothing left in use."""
    store = f"disk:{tmp_path / 'kv'}"
    p = _prompt(3, cold.vocab)
    _, io, keys = _write(gemma_dir, store, p)
    target = _file_of(tmp_path / "kv", io.layout, keys[16])
    _flip_part(target, part)
    with _llm(gemma_dir, [store]) as llm:
        o, got = _run(llm, p)
        assert got == cold(3)
        assert o.num_cached_tokens == 16 * BS
        assert o.cache_report.sources == {"pool": 0, "disk": 16 * BS}
        d = _disk(llm)
        assert d["corrupt"] == 1
        if part:
            assert o.cache_report.miss_reason == MissReason.WINDOW_EVICTED
            assert d["hit_blocks"] == N_BLOCKS  # every group-0 part was good
            # group 2's block 16, computed again, is cached now (the pool had none from the tier)
            assert group_key(keys[16], part) in llm.engine.cache.pool.index
        else:
            assert d["hit_blocks"] == 16  # refused whole (deleted, and written again below)
        _idle(llm)
        llm.engine.cache.tiers.tiers.flush()
    # the entry was written again, whole: by the repair (a bad window part) or the recompute
    blob = open(_file_of(tmp_path / "kv", io.layout, keys[16]), "rb").read()
    _, others, bad = decode_groups(blob, key=keys[16], parent=keys[15], token_ids=p[16 * BS:17 * BS],
                                   layout=io.layout, payload_len=io.payload_len)
    assert bad == [] and sorted(others) == [1, 2, 3, 4, 5]
    with _llm(gemma_dir, [store]) as again:
        o, got = _run(again, p)
        assert got == cold(3)
        assert o.num_cached_tokens == N_BLOCKS * BS and _disk(again)["corrupt"] == 0
        _idle(again)


def test_whole_model_and_group_entries_never_read_as_each_other(gemma_dir, tmp_path, cold):
    """A full-KV pool and a hybrid pool of one model share the namespace (the same K/V), but
    not the layout tag: their entries have other storage keys, so neither finds the other's; a
    file renamed to the other's storage key is refused as corrupt. Exact either way."""
    p = _prompt(4, cold.vocab)
    full_store, hyb_store = tmp_path / "full", tmp_path / "hyb"
    got_f, io_f, keys = _write(gemma_dir, f"disk:{full_store}", p, disable_hybrid_kv_cache_manager=True)
    got_h, io_h, keys_h = _write(gemma_dir, f"disk:{hyb_store}", p)
    assert keys == keys_h  # one namespace: the same chain keys
    assert io_f.layout != io_h.layout and "/L6/" in io_f.layout and "/G" not in io_f.layout
    assert io_f.payload_len == 6 * io_h.payload_len
    assert got_f[0] == got_h[0] == cold(4)[0]
    # each reads the other's directory: nothing found (misses), nothing corrupt
    for store, hybrid_reader in ((full_store, True), (hyb_store, False)):
        with _llm(gemma_dir, [f"disk:{store}"], disable_hybrid_kv_cache_manager=not hybrid_reader) as llm:
            o, got = _run(llm, p)
            assert o.num_cached_tokens == 0 and o.cache_report.sources == {"pool": 0}
            d = _disk(llm)
            assert d["hit_blocks"] == 0 and d["corrupt"] == 0 and d["misses"] >= 1
            assert got[0] == cold(4)[0]
            _idle(llm)
    # the files renamed to the reader's storage keys: refused (the magic differs), computed
    for src, dst_layout, hybrid_reader, src_layout in (
            (full_store, io_h.layout, True, io_f.layout), (hyb_store, io_f.layout, False, io_h.layout)):
        forged = tmp_path / f"forged-{hybrid_reader}"
        for i, key in enumerate(keys[:N_BLOCKS]):
            skey = storage_key(dst_layout, key)
            os.makedirs(forged / skey[:2], exist_ok=True)
            shutil.copy(_file_of(src, src_layout, key), forged / skey[:2] / f"{skey}.blk")
        with _llm(gemma_dir, [f"disk:{forged}"], disable_hybrid_kv_cache_manager=not hybrid_reader) as llm:
            o, got = _run(llm, p)
            assert o.num_cached_tokens == 0 and o.cache_report.sources == {"pool": 0}
            assert _disk(llm)["corrupt"] == 1  # the first block refused and deleted ends the run
            assert got[0] == cold(4)[0]
            _idle(llm)


def test_a_whole_model_entry_still_decodes_as_a_blob(gemma_dir, tmp_path, cold):
    """The full-KV pool of the same model keeps the old format: one blob per block."""
    p = _prompt(5, cold.vocab)
    _, io, keys = _write(gemma_dir, f"disk:{tmp_path / 'kv'}", p, disable_hybrid_kv_cache_manager=True)
    blob = open(_file_of(tmp_path / "kv", io.layout, keys[0]), "rb").read()
    assert blob[:4] == b"HPKV"
    with _llm(gemma_dir) as llm:
        ns = llm.engine.cache.hasher.namespace
    payload = decode_blob(blob, key=keys[0], parent=ns, token_ids=p[:BS], layout=io.layout,
                          payload_len=io.payload_len)
    assert len(payload) == io.payload_len


def _evict_windows(llm: LLM) -> None:
    """Evict every window page the pool caches, keeping group 0's (as pool pressure does: window
    pages go first)."""
    pool = llm.engine.cache.pool
    for b in [b for b in pool.index.values() if b.group]:
        pool.demote(b)
    pool.free(pool.allocate(len(pool.empty) + len(pool.low)) or [])
    assert not any(b.group for b in pool.index.values())


@pytest.mark.parametrize("lost", [None, 16])
def test_windows_the_pool_lost_come_back_from_the_tier(gemma_dir, tmp_path, cold, lost):
    """The pool keeps a prompt's group-0 run but none of its window pages: the fetch asks the tier
    for the window before the run's end too, and the hit covers the whole run again, from the
    tier (exact, nothing left in use). With one of those entries gone, the window run stops
    there: the hit resumes earlier (here at 0), computed, still exact."""
    store = f"disk:{tmp_path / 'kv'}"
    p = _prompt(5, cold.vocab)
    with _llm(gemma_dir, [store]) as llm:
        o, got = _run(llm, p)
        assert o.cache_report.sources == {"pool": 0} and got == cold(5)
        llm.engine.cache.tiers.tiers.flush()
        _evict_windows(llm)
        keys = llm.engine.cache.hasher.keys(p)
        assert all(keys[i] in llm.engine.cache.pool.index for i in range(N_BLOCKS))
        if lost is not None:
            os.remove(_file_of(tmp_path / "kv", llm.engine.cache.tiers.io.layout, keys[lost]))
        before = _disk(llm)["hit_blocks"]
        o2, got2 = _run(llm, p)
        assert got2 == cold(5)
        rep = o2.cache_report
        if lost is None:
            assert o2.num_cached_tokens == N_BLOCKS * BS
            assert rep.sources == {"pool": 0, "disk": N_BLOCKS * BS}
            # only the window before the run's end was read, not the whole prompt again
            assert _disk(llm)["hit_blocks"] - before == WINDOW_BLOCKS
        else:
            assert o2.num_cached_tokens == 0 and rep.miss_reason == MissReason.WINDOW_EVICTED
            assert _disk(llm)["hit_blocks"] - before == lost - (N_BLOCKS - WINDOW_BLOCKS)
        assert _disk(llm)["corrupt"] == 0
        _idle(llm)


@pytest.mark.parametrize("layout,num_blocks", [("hybrid", 10), ("full", 26)])
def test_a_tier_install_while_ordering_admissions_never_leaves_a_stale_hit(gemma_dir, cold, layout,
                                                                          num_blocks):
    """A's prefix is in the pool, B's only in the host tier, and the pool (60 pages hybrid, 26 blocks full KV) has no room
    for both. Both wait together: ordering them looks A up, then B, whose lookup installs B's
    blocks from the tier and evicts A's. A is looked up again before it is admitted (before, its
    stale hit reached the allocation: in the hybrid pool a KeyError on a window page that was
    gone, the engine step failed and both requests with it; in a full-KV pool A was admitted on
    blocks that now held B's K/V and generated other tokens: a wrong hit).
    Both exact, nothing left in use."""
    pa, pb = _prompt(6, cold.vocab), _prompt(7, cold.vocab)
    kw = {"disable_hybrid_kv_cache_manager": True} if layout == "full" else {}
    with _llm(gemma_dir, ["host:64MiB"], num_blocks=num_blocks, max_num_batched_tokens=64, **kw) as llm:
        _run(llm, pb)
        llm.engine.cache.tiers.tiers.flush()
        llm.reset_prefix_cache()
        assert _run(llm, pa)[1] == cold(6)
        eng = llm.engine
        ra, rb = eng.add_request(pa, P), eng.add_request(pb, P)
        t0 = time.monotonic()
        while eng.cache.tier_pending(rb) and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        before = eng.cache.pool.num_evictions
        outs = {}
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = (o.token_ids, o.outputs[0].logprobs)
        assert eng.cache.pool.num_evictions > before  # the install did evict
        assert outs[ra.request_id] == cold(6) and outs[rb.request_id] == cold(7)
        _idle(llm)
