"""KV events of a hybrid pool (sliding-window groups, ``cache/window_groups.py``) and the router
that reads them: every group's blocks are announced with vLLM's group fields, vLLM's own structs
decode them in both encodings, a pool of one group sends what it sent before, and the router
scores a hybrid replica by where its manager would actually resume (no model)."""

# No ``from __future__ import annotations``: the local vLLM structs below need real annotations.
import random
from typing import Any

import msgspec
import pytest

from hotprefix.cache.block_pool import BlockPool
from hotprefix.cache.hashing import BlockHasher, namespace_key
from hotprefix.cache.kv_groups import first_needed_block, group_key, resume_point
from hotprefix.cache.manager import CacheRequest, KVCacheManager
from hotprefix.cache.rules import cacheable_blocks
from hotprefix.cache.window_groups import WindowGroups
from hotprefix.events.recorder import PoolEventRecorder
from hotprefix.events.schema import event_types
from hotprefix.router import Router

from test_kv_events import vllm_types

BS = 4
NS = namespace_key("m", "t")
WINDOWS = {1: 0, 2: 9, 3: 9}
"""Group 1: a second full group (window 0); groups 2 and 3: windows of 9 keys."""


def hybrid(num_pages: int, windows: dict[int, int] = WINDOWS, fmt: str = "array"):
    """A manager over a hybrid pool, and a recorder that knows its groups."""
    pool = BlockPool(num_pages, BS, "lru")
    m = KVCacheManager(pool, BlockHasher(NS, BS))
    m.windows = WindowGroups(pool, BS, windows)
    return m, PoolEventRecorder(pool, fmt=fmt, windows=windows)


def run(m: KVCacheManager, rid: str, tokens: list[int], chunk: int = 8, **kw) -> CacheRequest:
    """One request from lookup to free, its prompt in chunks of ``chunk`` tokens."""
    r = CacheRequest(rid, list(tokens), len(tokens), **kw)
    hits = m.lookup(r)
    done = len(hits) * BS
    first = True
    while done < len(tokens):
        n = min(chunk, len(tokens) - done)
        assert m.allocate(r, n, done, hits if first else []), "pool too small for the test"
        first = False
        done += n
        m.commit(r, done)
    m.free(r)
    return r


def evict_interior(m: KVCacheManager) -> None:
    """Take (and give back empty) every empty and interior block: the interior ones are evicted."""
    m.pool.free(m.pool.allocate(len(m.pool.empty) + len(m.pool.low)))


def resume_len(m: KVCacheManager, tokens: list[int]) -> int:
    """Blocks the manager would serve ``tokens`` from now (its own lookup)."""
    return len(m.lookup(CacheRequest("probe", list(tokens), len(tokens))))


class GroupView:
    """What a subscriber knows: per (group, hash), the block's tokens and parent hash."""

    def __init__(self) -> None:
        self.held: dict[tuple[int, bytes], tuple[tuple[int, ...], bytes | None]] = {}
        self.specs: dict[int, tuple[Any, Any]] = {}

    def apply(self, events) -> None:
        for ev in events:
            name = type(ev).__name__
            if name == "AllBlocksCleared":
                self.held.clear()
            elif name == "BlockStored":
                assert ev.group_idx is not None and ev.medium == "GPU"
                self.specs[ev.group_idx] = (ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window)
                parent = ev.parent_block_hash
                for i, h in enumerate(ev.block_hashes):
                    toks = tuple(ev.token_ids[i * ev.block_size:(i + 1) * ev.block_size])
                    self.held[(ev.group_idx, h)] = (toks, parent)
                    parent = h
            else:
                assert ev.group_idx is not None
                for h in ev.block_hashes:
                    del self.held[(ev.group_idx, h)]


def pool_view(m: KVCacheManager) -> dict[tuple[int, bytes], tuple[tuple[int, ...], bytes | None]]:
    """The pool's cached blocks as a subscriber should see them: window blocks under the chain
    key of group 0's block at their position (the group-tagged key is that key's ``group_key``)."""
    out = {}
    for key, b in m.pool.index.items():
        if b.group:
            chain, parent = b.chain
            assert group_key(chain, b.group) == key
        else:
            chain, parent = key, b.parent
        out[(b.group, chain)] = (b.token_ids, None if b.depth == 0 else parent)
    return out


def conversation(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3) for _ in range(n)]


# --------------------------------------------------------------------------- the events
def test_every_groups_blocks_are_announced_with_the_group_and_its_window():
    m, rec = hybrid(400)
    view = GroupView()
    view.apply(rec.drain())
    system = [1, 2] * 20  # 10 blocks
    run(m, "a", system + [0] * 7, hit_point_tokens=(len(system),))
    evs = rec.drain()
    stored = [e for e in evs if type(e).__name__ == "BlockStored"]
    # one chain of one group per event, every group announced
    assert sorted(e.group_idx for e in stored) == [0, 1, 2, 3]
    assert all(len(e.token_ids) == BS * len(e.block_hashes) for e in stored)
    by_group = {e.group_idx: e for e in stored}
    assert by_group[0].kv_cache_spec_kind == by_group[1].kv_cache_spec_kind == "full_attention"
    assert by_group[0].kv_cache_spec_sliding_window is None
    assert by_group[2].kv_cache_spec_kind == "sliding_window"
    assert by_group[2].kv_cache_spec_sliding_window == by_group[3].kv_cache_spec_sliding_window == 9
    # a window group's blocks are named by the chain hashes of group 0's blocks there
    keys = m.hasher.keys(system + [0] * 4)
    assert by_group[0].block_hashes == keys[:len(by_group[0].block_hashes)]
    assert set(by_group[2].block_hashes) <= set(by_group[0].block_hashes)
    view.apply(evs)
    assert view.held == pool_view(m)

    # interior window blocks evicted: one BlockRemoved per group, with the group
    evict_interior(m)
    evs = rec.drain()
    removed = [e for e in evs if type(e).__name__ == "BlockRemoved"]
    assert removed and all(e.group_idx in (2, 3) for e in removed)
    assert len({e.group_idx for e in removed}) == len(removed)
    view.apply(evs)
    assert view.held == pool_view(m)

    # more traffic, evictions of every group, a reset with a request holding blocks
    rng = random.Random(1)
    small, rec2 = hybrid(60)
    view2 = GroupView()
    for i in range(30):
        run(small, f"r{i}", system[:rng.randrange(8, 40)] + conversation(rng, rng.randrange(4, 30)),
            hit_point_tokens=(rng.randrange(4, 30),))
        view2.apply(rec2.drain())
        assert view2.held == pool_view(small)
    assert small.pool.num_evictions > 0
    held = CacheRequest("held", system[:24], 24)
    assert small.allocate(held, 24, 0)
    small.commit(held, 24)
    small.pool.reset()
    view2.apply(rec2.drain())
    assert view2.held == pool_view(small) and view2.held
    small.free(held)


def test_a_pool_of_one_group_sends_what_it_sent_before():
    """No group fields in either encoding: the array stays 7 fields (8 with the tag), the map
    has no group keys."""
    for fmt in ("array", "map"):
        pool = BlockPool(8, BS, "lru")
        m = KVCacheManager(pool, BlockHasher(NS, BS))
        rec = PoolEventRecorder(pool, fmt=fmt)
        for i in range(4):
            run(m, f"r{i}", [i] * 13)
        t = event_types(fmt)
        raw = msgspec.msgpack.decode(msgspec.msgpack.encode(t.KVEventBatch(0.0, rec.drain())))
        kinds = set()
        for ev in raw[1]:
            name = ev[0] if fmt == "array" else ev["type"]
            kinds.add(name)
            if fmt == "array":
                assert len(ev) == {"BlockStored": 8, "BlockRemoved": 3, "AllBlocksCleared": 1}[name]
            else:
                assert not {"group_idx", "extra_keys", "kv_cache_spec_kind"} & set(ev)
        assert kinds == {"AllBlocksCleared", "BlockStored", "BlockRemoved"}


# --------------------------------------------------------------------------- vLLM's own shapes
ExternalBlockHash = bytes | int


class _OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class _OldBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


def _old_vllm_types():
    """vLLM <= 0.23 (array_like events with medium, none of the later fields)."""

    class BlockStored(_OldEvent):
        block_hashes: list[ExternalBlockHash]
        parent_block_hash: ExternalBlockHash | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None

    class BlockRemoved(_OldEvent):
        block_hashes: list[ExternalBlockHash]
        medium: str | None

    class AllBlocksCleared(_OldEvent):
        pass

    class KVEventBatch(_OldBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return KVEventBatch


def _hybrid_traffic(fmt: str) -> tuple[KVCacheManager, list[bytes]]:
    """Payloads of a hybrid pool's events (stores, interior and policy evictions, a reset)."""
    m, rec = hybrid(48, fmt=fmt)
    t = event_types(fmt)
    payloads = [msgspec.msgpack.encode(t.KVEventBatch(0.0, rec.drain()))]
    rng = random.Random(3)
    for i in range(12):
        run(m, f"r{i}", conversation(rng, rng.randrange(12, 40)), hit_point_tokens=(8,))
        if i % 4 == 3:
            evict_interior(m)
        payloads.append(msgspec.msgpack.encode(t.KVEventBatch(float(i), rec.drain())))
    m.pool.reset()
    payloads.append(msgspec.msgpack.encode(t.KVEventBatch(99.0, rec.drain())))
    assert m.pool.num_evictions > 0
    return m, payloads


@pytest.mark.parametrize("fmt", ["array", "map"])
def test_vllm_event_types_decode_a_hybrid_pools_messages(fmt):
    m, payloads = _hybrid_traffic(fmt)
    dec = msgspec.msgpack.Decoder(vllm_types(array_like=fmt == "array"))
    view = GroupView()
    kinds, groups = set(), set()
    for p in payloads:
        batch = dec.decode(p)
        for ev in batch.events:
            kinds.add(type(ev).__name__)
            if type(ev).__name__ != "AllBlocksCleared":
                groups.add(ev.group_idx)
        view.apply(batch.events)
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    assert groups == {0, 1, 2, 3}
    assert view.specs == {0: ("full_attention", None), 1: ("full_attention", None),
                          2: ("sliding_window", 9), 3: ("sliding_window", 9)}
    assert view.held == pool_view(m)  # after the reset: what is still cached (nothing in use)
    if fmt == "array":  # a decoder of a vLLM before the group fields reads every message too
        old = msgspec.msgpack.Decoder(_old_vllm_types())
        assert sum(len(old.decode(p).events) for p in payloads) == sum(
            len(dec.decode(p).events) for p in payloads)


# --------------------------------------------------------------------------- the router
def test_the_shared_rule_is_window_groups_own():
    """``resume_point`` over a pool's window blocks answers what ``WindowGroups.resume`` does."""
    m, _ = hybrid(400)
    a = CacheRequest("a", [1, 2, 0] * 27, 81, hit_point_tokens=(16,))
    done = 0
    while done < 81:
        assert m.allocate(a, min(8, 81 - done), done)
        done = min(done + 8, 81)
        m.commit(a, done)
    evict_interior(m)
    keys = m.hasher.keys(a.token_ids[:80])
    w = m.windows
    got = [w.resume(keys, a.token_ids, n) for n in range(21)]
    held = {(b.group, b.depth) for b in m.pool.index.values() if b.group}
    assert got == [resume_point(n, WINDOWS.items(), BS, lambda g, i: (g, i) in held)
                   for n in range(21)]
    assert got[20] == 20  # a still holds the window at its end
    assert got[10] == got[4] == 4  # the window before block 10 was interior: a's message end
    assert first_needed_block(16, 9, BS) == w.first_needed(16) == 2
    m.free(a)


def _router(rec: PoolEventRecorder) -> Router:
    rt = Router(["h"], BS, hasher=BlockHasher(NS, BS), clock=lambda: 0.0)
    rt.apply_events("h", rec.drain())
    return rt


def _score(rt: Router, tokens: list[int], replica: str = "h") -> int:
    keys = rt.hasher.keys(tokens[:len(tokens) // BS * BS])
    return rt.index.runs(keys[:cacheable_blocks(len(tokens), BS)], [replica])[replica][0]


def test_the_router_scores_where_the_replica_resumes_not_the_full_chain():
    """a is still running past where b diverges: the replica holds the full chain b reads, but
    its window there was interior and is evicted; it resumes b at a's kept message end."""
    m, rec = hybrid(400)
    plain = PoolEventRecorder(m.pool)  # the same pool's events without the groups
    a = CacheRequest("a", [1, 2, 0] * 27, 81, hit_point_tokens=(16,))
    done = 0
    while done < 81:
        assert m.allocate(a, min(8, 81 - done), done)
        done = min(done + 8, 81)
        m.commit(a, done)
    rt, blind = _router(rec), _router(plain)
    b = [1, 2, 0] * 14 + [0, 2, 2, 2, 2]
    assert _score(rt, b) == resume_len(m, b) == 10  # every window still there
    evict_interior(m)
    rt.apply_events("h", rec.drain())
    blind.apply_events("h", plain.drain())
    assert resume_len(m, b) == 4
    assert _score(rt, b) == 4
    assert _score(blind, b) == 10  # by the full chain alone: the hit it would not get
    # route() says the same, also after a decision the router remembers for every block
    for _ in range(2):
        assert rt.route(rt.hasher.keys(b[:44]), len(b)).hit_blocks == 4
    m.free(a)
    rt.apply_events("h", rec.drain())
    assert _score(rt, b) == resume_len(m, b)


def test_the_router_matches_the_managers_lookup_through_evictions():
    rng = random.Random(7)
    m, rec = hybrid(90)
    rt = _router(rec)
    system = [1, 2, 0, 1] * 6
    convos = [system + conversation(rng, 10) for _ in range(5)]
    shorter = 0
    for step in range(60):
        s = rng.randrange(len(convos))
        convos[s] += conversation(rng, rng.randrange(3, 14))
        cut = len(convos[s]) - rng.randrange(0, 9)
        run(m, f"t{step}", convos[s][:cut], chunk=rng.choice([4, 8, 16]),
            hit_point_tokens=(len(system),))
        if step % 7 == 6:
            evict_interior(m)
        rt.apply_events("h", rec.drain())
        for c in convos + [system + [2] * 9]:
            probe = c + [0]
            want = resume_len(m, probe)
            assert _score(rt, probe) == want, (step, len(probe))
            full = len(m.pool_run(CacheRequest("p", probe, len(probe))))
            shorter += want < full
    assert m.pool.num_evictions > 0
    assert shorter > 0  # some probes resumed before their full chain: the window rule was exercised


def test_a_replica_without_group_fields_is_scored_as_before_and_a_leaver_is_forgotten():
    m, rec = hybrid(400)
    run(m, "a", [1, 2] * 20 + [0] * 7, hit_point_tokens=(40,))
    rt = _router(rec)
    assert "h" in rt.index.windows and rt.index.windows["h"] == (BS, WINDOWS)
    rt.apply_events("h", [event_types().AllBlocksCleared()])
    assert rt.index.windows["h"] == (BS, WINDOWS)  # a reset keeps the model's groups
    rt.remove_replica("h")
    assert "h" not in rt.index.windows
    # a one-group replica's events: no group learnt, the full chain counts
    pool = BlockPool(64, BS, "lru")
    one = KVCacheManager(pool, BlockHasher(NS, BS))
    rec1 = PoolEventRecorder(pool)
    rt2 = _router(rec1)
    tokens = [1, 2] * 20 + [0] * 7
    run(one, "a", tokens)
    rt2.apply_events("h", rec1.drain())
    assert rt2.index.windows == {}
    assert _score(rt2, tokens) == resume_len(one, tokens) == 11
