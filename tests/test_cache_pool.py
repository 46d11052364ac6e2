"""Unit tests of the torch-free prefix cache: exact block ids, eviction order, keys, reports."""

from __future__ import annotations

import sys

import pytest

from hotprefix.cache.block import AdmitInfo
from hotprefix.cache.block_pool import BlockPool
from hotprefix.cache.hashing import BlockHasher, hash_block, namespace_key
from hotprefix.cache.manager import CacheRequest, KVCacheManager

BS = 4
NS = namespace_key("model-a", "tok-a")


def make(num_blocks=10, policy="lru", enabled=True):
    pool = BlockPool(num_blocks, BS, policy)
    return KVCacheManager(pool, BlockHasher(NS, BS), enabled)


def req(rid, tokens, salt=None, **kw):
    return CacheRequest(request_id=rid, token_ids=list(tokens), num_prompt_tokens=len(tokens), salt=salt, **kw)


def run_prefill(m: KVCacheManager, r: CacheRequest) -> list:
    """Admit a request, compute its whole prompt in one step, register its blocks."""
    hits = m.lookup(r)
    m.report(r, hits)
    n_hit = len(hits) * BS
    assert m.allocate(r, r.num_prompt_tokens - n_hit, n_hit, hits)
    m.commit(r, r.num_prompt_tokens)
    return hits


def finish(m: KVCacheManager, r: CacheRequest) -> list:
    """``run_prefill`` then end the request (its blocks become evictable)."""
    hits = run_prefill(m, r)
    m.free(r)
    return hits


def test_cache_module_imports_no_torch():
    import subprocess
    code = ("import sys, pkgutil, importlib, hotprefix.cache as c\n"
            "for m in pkgutil.iter_modules(c.__path__): importlib.import_module('hotprefix.cache.' + m.name)\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_keys_chain_and_namespace():
    h = BlockHasher(NS, BS)
    a = h.keys([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert len(a) == 2  # the partial third block has no key
    b = h.keys([1, 2, 3, 4, 5, 6, 7, 9])
    assert a[0] == b[0] and a[1] != b[1]
    other = BlockHasher(namespace_key("model-b", "tok-a"), BS).keys([1, 2, 3, 4])
    assert other[0] != a[0]
    tok = BlockHasher(namespace_key("model-a", "tok-b"), BS).keys([1, 2, 3, 4])
    assert tok[0] != a[0]
    # the same second block after a different first block has a different key (chained)
    c = h.keys([9, 9, 9, 9, 5, 6, 7, 8])
    assert c[1] != a[1]


def test_extra_keys_are_type_tagged():
    p = NS
    assert hash_block(p, [1, 2], [("salt", "x")]) != hash_block(p, [1, 2], [("adapter", "x")])
    assert hash_block(p, [1, 2], [("salt", "x")]) != hash_block(p, [1, 2])
    with pytest.raises(ValueError):
        hash_block(p, [1, 2], [("bogus", "x")])


def test_salt_at_block_zero_and_shared_prefix():
    h = BlockHasher(NS, BS)
    toks = list(range(12))
    a, b = h.keys(toks, salt="A"), h.keys(toks, salt="B")
    assert all(x != y for x, y in zip(a, b))
    a2, b2 = h.keys(toks, salt="A", salt_from_block=2), h.keys(toks, salt="B", salt_from_block=2)
    assert a2[:2] == b2[:2] and a2[2] != b2[2]


def test_exact_block_ids_and_hits():
    m = make(10)
    r1 = req("r1", range(10))  # 2 full blocks + 2 tokens
    run_prefill(m, r1)
    assert m.block_table("r1") == [0, 1, 2]
    assert m.pool.num_cached == 2  # the partial block is not cached
    m.free(r1)
    # LRU order after free: tail first -> [2 is empty], cached 1 then 0
    assert list(m.pool.empty)[-1] == 2
    assert m.pool.policy.order() == [1, 0]

    r2 = req("r2", list(range(8)) + [99, 98, 97])
    hits = run_prefill(m, r2)
    assert [b.block_id for b in hits] == [0, 1]
    assert r2.cache_report.cached_tokens == 8 and r2.cache_report.miss_reason == "hit"
    assert m.block_table("r2") == [0, 1, 3]
    m.free(r2)
    m.pool.check_invariants()


def test_last_token_always_computed():
    m = make(10)
    r1 = req("r1", range(8))
    finish(m, r1)
    r2 = req("r2", range(8))  # identical, exactly 2 blocks
    hits = run_prefill(m, r2)
    assert len(hits) == 1  # 7 tokens max from cache -> 1 full block
    assert r2.cache_report.cached_tokens == 4 and r2.cache_report.computed_tokens == 4
    assert r2.cache_report.miss_reason == "hit"  # everything cacheable hit
    m.free(r2)


def test_eviction_order_lru_tail_first():
    m = make(4)
    ra = req("a", range(100, 108))  # blocks 0,1
    finish(m, ra)
    rb = req("b", range(200, 208))  # blocks 2,3
    finish(m, rb)
    assert m.pool.policy.order() == [1, 0, 3, 2]
    rc = req("c", range(300, 307))  # needs 2 blocks: evicts a's tail (1) then a's root (0)
    run_prefill(m, rc)
    assert m.block_table("c") == [1, 0]
    assert m.pool.num_evictions == 2
    assert m.pool.was_evicted(ra.block_keys[0]) and m.pool.was_evicted(ra.block_keys[1])
    m.free(rc)
    # a's blocks are gone: a miss reported as evicted
    ra2 = req("a2", range(100, 108))
    run_prefill(m, ra2)
    assert ra2.cache_report.miss_reason == "evicted"
    m.free(ra2)
    m.pool.check_invariants()


def test_hit_block_leaves_free_queue_and_returns_to_tail():
    m = make(6)
    r1 = req("r1", range(8))
    finish(m, r1)
    r2 = req("r2", range(20, 28))
    finish(m, r2)
    assert m.pool.policy.order() == [1, 0, 3, 2]
    r3 = req("r3", list(range(4)) + [50, 51, 52, 53, 54])
    run_prefill(m, r3)  # hits block 0 of r1
    assert m.pool.policy.order() == [1, 3, 2]
    m.free(r3)
    assert m.pool.policy.order()[-1] == 0  # freed again: most recent, after its new sibling (tail first)


def test_allocate_fails_atomically():
    m = make(3)
    r1 = req("r1", range(8))
    run_prefill(m, r1)  # holds 2 blocks
    r2 = req("r2", range(50, 62))  # needs 3
    assert not m.allocate(r2, 12, 0)
    assert m.num_blocks_held("r2") == 0 and m.pool.num_in_use == 2
    m.free(r1)
    assert m.allocate(r2, 12, 0)
    m.free(r2)
    m.pool.check_invariants()
    assert m.pool.num_in_use == 0


def test_hash_collision_is_a_miss():
    m = make(6)
    r1 = req("r1", range(9))
    finish(m, r1)
    # forge: same key, different tokens -> lookup compares tokens and misses
    forged = req("r2", [7, 7, 7, 7, 1])
    forged.block_keys = [r1.block_keys[0]]
    assert m.lookup(forged) == []


def test_reset_keeps_in_use_blocks():
    m = make(8)
    r1 = req("r1", range(9))
    run_prefill(m, r1)
    r2 = req("r2", range(50, 59))
    finish(m, r2)
    out = m.reset()
    assert out == {"dropped_blocks": 2, "in_use_blocks_kept": 2}
    assert m.pool.num_cached == 2
    m.free(r1)
    m.pool.check_invariants()


def test_decode_blocks_registered_for_multiturn():
    m = make(10)
    r1 = req("r1", range(6))
    run_prefill(m, r1)
    for t in range(100, 104):  # decode 4 tokens: the sequence reaches 10 tokens
        r1.token_ids.append(t)
        m.allocate(r1, 1, len(r1.token_ids) - 1)
        m.commit(r1, len(r1.token_ids))
    m.free(r1)
    assert m.pool.num_cached == 2  # 10 tokens -> 2 full blocks, the second holds answer tokens
    turn2 = req("t2", r1.token_ids + [7, 7, 7])
    hits = run_prefill(m, turn2)
    assert len(hits) == 2


def test_inflight_sharing_owner():
    m = make(10)
    a = req("a", range(12))
    hits = m.lookup(a)
    m.report(a, hits)
    assert m.allocate(a, 4, 0)  # first chunk only
    b = req("b", list(range(12)) + [5])
    assert m.inflight_owner(b, len(m.lookup(b))) == "a"
    m.commit(a, 4)
    assert len(m.lookup(b)) == 1  # block 0 is now cached
    assert m.inflight_owner(b, 1) == "a"  # block 1 still being computed by a
    m.free(a)
    assert m.inflight_owner(b, 1) is None  # a gone: nothing pending


def test_miss_reasons_diverged_salt_namespace_too_short(tmp_path):
    from hotprefix.cache.ledger import ContentLedger
    from hotprefix.cache.state_dir import StateDir

    m = KVCacheManager(BlockPool(20, BS), BlockHasher(NS, BS), True,
                       ledger=ContentLedger(StateDir(str(tmp_path))))
    base = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    finish(m, req("a", base, salt="t1"))
    d = req("d", base[:5] + [99] + base[6:], salt="t1")
    run_prefill(m, d)
    assert d.cache_report.miss_reason == "diverged"
    assert d.cache_report.miss_position == 5
    assert d.cache_report.detail["block_index"] == 1
    m.free(d)
    # another tenant sending t1's prompt is told "cold", like any new prompt; only the operator's
    # aggregate shows the cross-tenant duplicate as "salt"
    s = req("s", base, salt="t2")
    run_prefill(m, s)
    assert s.cache_report.miss_reason == "cold" and s.cache_report.cached_tokens == 0
    assert "salt" not in str(s.cache_report)
    assert m.snapshot()["requests_by_reason"].get("salt") == 1
    assert m.tenant_snapshot("t2")["requests_by_reason"] == {"cold": 1}
    m.free(s)
    short = req("x", [1, 2, 3])
    run_prefill(m, short)
    assert short.cache_report.miss_reason == "too_short"
    m.ledger.flush()
    # a "restart" under another namespace with the same state directory
    m2 = KVCacheManager(BlockPool(20, BS), BlockHasher(namespace_key("model-a", "tok-NEW"), BS), True,
                        ledger=ContentLedger(StateDir(str(tmp_path))))
    n = req("n", base, salt="t1")
    run_prefill(m2, n)
    assert n.cache_report.miss_reason == "namespace"
    other = req("o", base, salt="t3")  # never cached these tokens itself: no namespace hint
    run_prefill(m2, other)
    assert other.cache_report.miss_reason == "cold"
    cold = req("c", [5] * 11)
    run_prefill(m2, cold)
    assert cold.cache_report.miss_reason == "cold"


def test_stats_counts():
    m = make(10)
    finish(m, req("a", range(9)))
    finish(m, req("b", range(9)))
    s = m.snapshot()
    assert s["queries_tokens"] == 18 and s["hit_tokens"] == 8
    assert s["hit_rate"] == pytest.approx(8 / 18)
    assert s["blocks_in_use"] == 0 and s["blocks_cached"] == 2 and s["written_blocks"] == 2
    assert s["miss_tokens_by_reason"] == {"cold": 9}
    assert s["requests_by_reason"] == {"cold": 1, "hit": 1}


def test_pins_block_eviction_until_expiry():
    now = [0.0]
    pool = BlockPool(4, BS, clock=lambda: now[0])
    m = KVCacheManager(pool, BlockHasher(NS, BS))
    sysp = req("sys", range(9), pin_ttl_s=10.0)
    finish(m, sysp)
    assert pool.num_pinned_blocks == 2 and pool.num_free == 2  # 1 empty + partial block freed
    other = req("o", range(50, 62))  # needs 3 blocks, only 2 evictable/empty
    assert not m.allocate(other, 12, 0)
    now[0] = 11.0  # the pin expires: blocks become ordinary cached blocks
    assert pool.num_free == 4
    assert m.allocate(other, 12, 0)
    pool.check_invariants()


def test_admit_info_and_disabled_cache():
    m = make(6, enabled=False)
    r1 = req("a", range(9))
    finish(m, r1)
    assert m.pool.num_cached == 0
    r2 = req("b", range(9))
    assert m.lookup(r2) == []
    info = AdmitInfo(depth=0, parent=None)
    assert info.depth == 0 and info.priority == 0 and info.salt is None


def test_cache_write_false_writes_nothing():
    m = make(6)
    r = req("a", range(9), cache_write=False)
    finish(m, r)
    assert m.pool.num_cached == 0 and r.cache_report.written_blocks == 0


def test_freq_credit_lapses_past_the_learned_reuse_window():
    """freq learns the reuse gaps it sees; a block idle past that window loses its credit, and the
    oldest such block goes first (LRU), while inside the window the frequency credit decides."""
    from hotprefix.cache.eviction import FreqCreditPolicy

    class SmallCredit(FreqCreditPolicy):
        credit_requests = 4.0  # also the window's floor

    pol = SmallCredit(4)
    m = KVCacheManager(BlockPool(4, BS, pol), BlockHasher(NS, BS))
    assert pol.credit_window == float("inf")  # nothing observed yet: plain frequency credit
    hot = list(range(5))  # one full block (the 5th token is never cached)
    for i in range(300):  # re-referenced every request: 299 gaps of one request
        finish(m, req(f"hot{i}", hot))
    assert pol.credit_window == 4.0  # the gaps are ~1 request; the floor holds
    assert m.snapshot()["eviction_policy_state"] == {
        "credit_requests": 4.0, "credit_window_requests": 4.0, "reuse_gaps_observed": 299}
    hot_block = m.pool.lookup(m.hasher.keys(hot)[0])
    cold = req("cold", range(100, 105))  # one new block, count 1, freed after the hot one
    finish(m, cold)
    cold_block = m.pool.lookup(m.hasher.keys(list(range(100, 105)))[0])
    # idle 1 request: inside the window the hot block's credit (4*log2(300)) protects it
    assert pol.order()[:2] == [cold_block.block_id, hot_block.block_id]
    for i in range(4):  # 4 more requests that allocate nothing cached: both idle > 4 requests
        r = req(f"tiny{i}", range(200 + i, 202 + i))
        m.allocate(r, 2, 0)
        m.free(r)
    assert pol.order()[:2] == [hot_block.block_id, cold_block.block_id]  # oldest first now
    m.pool.allocate(2)  # the two empty blocks
    victim = m.pool.allocate(1)[0]
    assert victim.block_id == hot_block.block_id and m.pool.lookup(m.hasher.keys(hot)[0]) is None
    m.pool.check_invariants()


def test_repin_after_a_lapsed_pin_counts_the_block_once():
    """A pin that lapsed but was not yet expired (no allocation looked) is extended, not counted
    a second time: the pin count returns to 0 when the new pin expires."""
    now = [0.0]
    pool = BlockPool(4, BS, clock=lambda: now[0])
    a = pool.allocate(1)[0]
    pool.cache_block(a, b"k", (1, 2, 3, 4), AdmitInfo(depth=0, parent=None))
    assert pool.pin(a, 5.0) and pool.num_pinned_blocks == 1
    now[0] = 6.0  # lapsed; nothing has called num_free since
    assert pool.pin(a, 20.0) and pool.num_pinned_blocks == 1
    pool.free([a])
    pool.check_invariants()
    assert pool.num_free == 3  # still pinned until 20
    now[0] = 21.0
    assert pool.num_free == 4 and pool.num_pinned_blocks == 0
    pool.check_invariants()


def test_lazy_heap_replaces_discards_and_orders():
    from hotprefix.cache.lazy_heap import LazyHeap

    h = LazyHeap(5)
    for i, p in [(0, 5.0), (1, 1.0), (2, 3.0), (3, 3.0)]:
        h.push(i, p)
    h.push(1, 9.0)  # replaces 1's entry
    assert h.discard(0) and not h.discard(0) and not h.discard(4)
    assert len(h) == 3 and 0 not in h and 1 in h
    assert h.ordered() == [2, 3, 1]  # ties by id
    assert h.peek() == (3.0, 2)
    assert [h.pop()[1] for _ in range(3)] == [2, 3, 1]
    assert h.peek() is None and len(h) == 0
    with pytest.raises(IndexError):
        h.pop()
    for _ in range(3000):  # stale entries are compacted away
        h.push(4, 1.0)
    assert len(h._heap) <= 4 * len(h) + LazyHeap.COMPACT_SLACK + 1
