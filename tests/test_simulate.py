"""The trace-replay simulator: formats, synthetic tokens, engine agreement, MIN bound, retention
controls, the store tier, sweep."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hotprefix import simulate as sim
from hotprefix.simulate import TraceRequest
from sim_support import exit_2


def keyed(chain_ids, n_prompt=None, bs=16, **kw) -> TraceRequest:
    """A request whose full blocks are the given (already chained) ids."""
    ids = list(chain_ids)
    n = n_prompt if n_prompt is not None else len(ids) * bs + 1  # +1: every block can hit
    return TraceRequest(n, n, ids, **kw)


def scan_trace(warm=30, docs=100, doc_blocks=60, sys_blocks=4):
    """A shared system prompt used ``warm`` times, then single-use long documents, then once more."""
    reqs, nid = [], 10_000
    sysp = list(range(sys_blocks))
    for _ in range(warm):
        reqs.append(keyed(sysp + [nid, nid + 1]))
        nid += 2
    for _ in range(docs):
        reqs.append(keyed(list(range(nid, nid + doc_blocks))))
        nid += doc_blocks
    reqs.append(keyed(sysp + [nid]))
    return reqs


# ---------------------------------------------------------------------------- formats
def test_mooncake_subblocks_and_partial_last_block():
    keys = sim.mooncake_keys([7, 9], 512 + 100, 16)
    assert len(keys) == 32 + 6  # 100 tokens of the partial block = 6 full sub-blocks
    assert len(set(keys)) == len(keys)
    again = sim.mooncake_keys([7, 11], 1024, 16)
    assert keys[:32] == again[:32] and keys[32] != again[32]
    assert sim.mooncake_keys([7, 9], 1000, 512) == sim.mooncake_keys([7], 512, 512)
    assert sim.mooncake_keys([8, 9], 1024, 512)[1] != sim.mooncake_keys([7, 9], 1024, 512)[1]  # chained
    with pytest.raises(ValueError):
        sim.mooncake_keys([1], 512, 48)


def test_synthetic_tokens_one_distinct_id_per_block():
    toks = sim.synthetic_tokens([7, 9], 64, 16, 64 + 20)
    assert len(toks) == 84
    assert toks[0::16] == [28, 29, 30, 31, 36, 37] and set(toks) - set(toks[0::16]) == {0}
    assert sim.synthetic_tokens([5], 16, 16, 20) == [5] + [0] * 19  # a partial block past the ids
    with pytest.raises(ValueError, match="do not cover"):
        sim.synthetic_tokens([5], 16, 16, 32)


def test_ids_replay_like_the_same_trace_as_real_tokens():
    """Synthetic tokens are a stand-in only: the same trace written with real (random) tokens,
    equal exactly where the ids are equal, replays to the same hits, request by request."""
    reqs = random_trace(4, n_req=150)
    rng = random.Random(0)
    block = {}
    as_tokens = []
    for r in reqs:
        toks = []
        for x in r.block_ids:
            if x not in block:
                block[x] = [rng.randrange(1, 50_000) for _ in range(16)]
            toks += block[x]
        toks = (toks + [1] * 16)[:r.num_prompt_tokens]
        as_tokens.append(TraceRequest(len(toks), len(toks), None, toks))
    for pol in ("lru", "freq", "min"):
        a = sim.replay(reqs, 20 * 16, pol, 16, keep_per_request=True)
        b = sim.replay(as_tokens, 20 * 16, pol, 16, keep_per_request=True)
        assert a.per_request_hits == b.per_request_hits and a.evictions == b.evictions > 0, pol
    keys = sim.request_keys(reqs, 16)  # keys given up front: the manager hashes no prompt again
    for pol in ("lru", "freq"):
        assert (sim.replay(reqs, 20 * 16, pol, 16, keys=keys, keep_per_request=True).per_request_hits
                == sim.replay(reqs, 20 * 16, pol, 16, keep_per_request=True).per_request_hits)


def test_trace_formats(tmp_path):
    p = tmp_path / "t.jsonl"
    lines = [
        {"timestamp": 1500, "input_length": 1100, "output_length": 3, "hash_ids": [1, 2, 3]},
        {"block_keys": ["aa" * 8, "bb" * 8, "cc" * 8], "block_size": 16, "num_prompt_tokens": 40,
         "num_output_tokens": 2, "timestamp": 3.0, "cache": "none"},
        {"token_ids": list(range(50)), "priority": 2, "pin_ttl_s": 5},
    ]
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    a, b, c = sim.load_trace(str(p), 16)
    assert a.block_ids == [1, 2, 3] and a.timestamp == 1.5
    assert b.num_tokens == 41 and b.block_ids == [int("aa" * 7, 16), int("bb" * 7, 16)]
    assert not b.cache_write
    assert c.block_ids is None and c.priority == 2 and c.pin_ttl_s == 5.0
    assert [len(k) for k in sim.request_keys([a, b, c], 16)] == [1100 // 16, 41 // 16, 50 // 16]
    with pytest.raises(ValueError, match="block_size 16"):
        sim.load_trace(str(p), 32)
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({"input_length": 1100, "hash_ids": [1, 2]}) + "\n")
    with pytest.raises(ValueError, match="cover"):
        sim.load_trace(str(short), 16)


def test_request_log_keys_replay_as_chained_blocks(tmp_path):
    """Logged keys become synthetic tokens: a line that repeats another's first keys hits them."""
    p = tmp_path / "log.jsonl"
    k = [f"{i:02x}" * 32 for i in range(1, 6)]
    lines = [{"block_keys": k[:3], "block_size": 16, "num_prompt_tokens": 50, "num_output_tokens": 1},
             {"block_keys": k[:2] + k[3:5], "block_size": 16, "num_prompt_tokens": 65,
              "num_output_tokens": 1}]
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    res = sim.replay(sim.load_trace(str(p), 16), 100 * 16, "lru", 16, keep_per_request=True)
    assert res.per_request_hits == [0, 2]


# ---------------------------------------------------------------------------- engine agreement
@pytest.mark.parametrize("policy", ["lru", "freq"])
def test_simulator_and_engine_agree(tiny_model_dir, policy):
    """The same token trace through LLM.generate (one request at a time) and the simulator gives
    the same cached tokens, request by request, with evictions happening."""
    from hotprefix import LLM
    from hotprefix.request.sampling import SamplingParams

    rng = random.Random(3)
    shared = [[rng.randrange(100, 5000) for _ in range(48)] for _ in range(3)]
    prompts = []
    for _ in range(24):
        p = list(rng.choice(shared)[:rng.choice([16, 32, 48])])
        p += [rng.randrange(100, 5000) for _ in range(rng.randrange(1, 40))]
        prompts.append(p)
    num_blocks = 12
    llm = LLM(tiny_model_dir, num_blocks=num_blocks, block_size=16, eviction_policy=policy)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    engine_hits = [llm.generate(p, params)[0].num_cached_tokens for p in prompts]
    res = sim.replay([TraceRequest(len(p), len(p), None, p) for p in prompts],
                     num_blocks * 16, policy, 16, keep_per_request=True)
    assert [h * 16 for h in res.per_request_hits] == engine_hits
    assert sum(engine_hits) > 0 and res.evictions > 0


# ---------------------------------------------------------------------------- bounds
def random_trace(seed, n_req=40, n_convs=6, max_len=10):
    """Conversations that grow (each turn extends a previous one) plus one-off requests."""
    rng = random.Random(seed)
    convs = [[] for _ in range(n_convs)]
    nid = 0
    reqs = []
    for _ in range(n_req):
        c = rng.randrange(n_convs + 2)
        if c >= n_convs:  # one-off
            chain = list(range(nid, nid + rng.randrange(1, max_len)))
            nid += len(chain)
        else:
            conv = convs[c]
            if len(conv) >= max_len:
                conv.clear()
            conv.extend(range(nid, nid + rng.randrange(1, 4)))
            nid += 3
            chain = [-1 - x if i == 0 else x for i, x in enumerate(conv)]  # a conversation's root
        reqs.append(keyed(chain, n_prompt=len(chain) * 16 + rng.choice([-5, 1, 7])))
    return reqs


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), cap=st.integers(10, 40))
def test_min_bounds_every_online_policy(seed, cap):
    reqs = random_trace(seed)
    keys = sim.request_keys(reqs, 16)
    best = sim.replay(reqs, cap * 16, "min", 16, keys=keys).hit_blocks
    ceil = sim.ceiling(reqs, 16, keys).hit_blocks
    assert best <= ceil
    for name in sorted(sim.POLICIES):
        got = sim.replay(reqs, cap * 16, name, 16).hit_blocks
        assert 0 <= got <= best, name


@pytest.mark.parametrize("policy", ["lru", "freq"])
def test_no_block_is_stranded(policy):
    """Tree-aware eviction: a cached block's parent is always cached too."""
    from hotprefix.cache.block_pool import BlockPool
    from hotprefix.cache.hashing import BlockHasher
    from hotprefix.cache.manager import CacheRequest, KVCacheManager

    pool = BlockPool(25, 16, policy, ghost_size=0)
    mgr = KVCacheManager(pool, BlockHasher(sim.SIM_NAMESPACE, 16))
    for i, r in enumerate(random_trace(11, n_req=300)):
        req = CacheRequest(str(i), r.tokens(16), r.num_prompt_tokens)
        hits = mgr.lookup(req)
        mgr.allocate(req, r.num_tokens - 16 * len(hits), 16 * len(hits), hits)
        mgr.commit(req, r.num_tokens)
        mgr.free(req)
        for b in pool.index.values():
            assert b.depth == 0 or b.parent in pool.index
    pool.check_invariants()
    assert pool.num_evictions > 0


@pytest.mark.parametrize("seed", [5, 6, 7])
def test_lru_stack_distances_match_replay(seed):
    """One stack-distance pass gives exactly the LRU replay's hits at every capacity (partial
    blocks included: their slot is taken during the request and left empty after)."""
    reqs = random_trace(seed, n_req=200)
    hist = sim.lru_stack_hits(reqs, 16)
    for cap in (12, 13, 20, 35, 60):
        assert sim.hits_at(hist, cap) == sim.replay(reqs, cap * 16, "lru", 16).hit_blocks


# ---------------------------------------------------------------------------- scan resistance
def test_freq_keeps_system_prompt_through_a_scan_lru_does_not():
    reqs = scan_trace()
    cap = 2000 * 16  # 2000 blocks; the documents bring 6000
    for name, want in (("freq", 4), ("lru", 0)):
        res = sim.replay(reqs, cap, name, 16, keep_per_request=True)
        assert res.per_request_hits[-1] == want, name


# ---------------------------------------------------------------------------- retention controls
def test_cache_none_reads_but_writes_nothing():
    reqs = [keyed([1, 2, 3]),
            keyed([1, 2, 3, 4, 5], cache_write=False),
            keyed([1, 2, 3, 4, 5, 6])]
    res = sim.replay(reqs, 100 * 16, "lru", 16, keep_per_request=True)
    assert res.per_request_hits == [0, 3, 3]  # blocks 4, 5 were never written
    assert res.written_blocks == 3 + 3
    only = sim.replay([keyed([9, 8, 7], cache_write=False)] * 2, 100 * 16, "lru", 16,
                      keep_per_request=True)
    assert only.written_blocks == 0 and only.per_request_hits == [0, 0]


def _flood(t0, n, nid, blocks=10):
    return [keyed(list(range(nid + i * blocks, nid + (i + 1) * blocks)), timestamp=t0 + i)
            for i in range(n)]


@pytest.mark.parametrize("policy", ["lru", "freq"])
def test_pins_hold_until_their_ttl_then_become_ordinary(policy):
    sysp = [1, 2, 3]
    pinned = keyed(sysp, timestamp=0.0, pin_ttl_s=100.0)
    # within the TTL: a flood of 20 x 10 blocks through a 40-block pool does not evict the pin
    reqs = [pinned] + _flood(1.0, 20, 1000) + [keyed(sysp + [99], timestamp=50.0)]
    res = sim.replay(reqs, 40 * 16, policy, 16, keep_per_request=True)
    assert res.per_request_hits[-1] == 3
    # after the TTL: the same flood evicts it like any block
    reqs = [pinned] + _flood(200.0, 20, 1000) + [keyed(sysp + [99], timestamp=300.0)]
    res = sim.replay(reqs, 40 * 16, policy, 16, keep_per_request=True)
    assert res.per_request_hits[-1] == 0


def test_pins_are_bounded_by_their_share_of_the_pool():
    big = keyed(list(range(30)), timestamp=0.0, pin_ttl_s=1000.0)  # 30 blocks, share = 20
    reqs = [big] + _flood(1.0, 20, 1000) + [keyed(list(range(30)) + [99], timestamp=5.0)]
    res = sim.replay(reqs, 40 * 16, "lru", 16, max_pinned_fraction=0.5, keep_per_request=True)
    assert res.per_request_hits[-1] == 20  # the pinned head survived, the unpinned tail did not
    assert res.truncated_requests == 0


def test_pin_with_injected_clock_on_the_pool():
    from hotprefix.cache.block import AdmitInfo
    from hotprefix.cache.block_pool import BlockPool

    now = [0.0]
    pool = BlockPool(4, 16, "freq", clock=lambda: now[0])
    a = pool.allocate(1)[0]
    pool.cache_block(a, b"k", (), AdmitInfo(0, None))
    assert pool.pin(a, 10.0)
    pool.free([a])
    assert pool.num_free == 3  # pinned: not evictable
    pool.allocate(3)
    assert pool.allocate(1) is None
    now[0] = 11.0
    assert pool.num_free == 1  # the pin expired: an ordinary evictable block
    assert pool.allocate(1) == [a] and pool.lookup(b"k") is None


def test_priority_outlives_recency_under_freq():
    low = keyed([1, 2], priority=0)
    high = keyed([5, 6], priority=3)
    reqs = [high, low] + _flood(0, 3, 1000, blocks=4) + [keyed([5, 6, 7]), keyed([1, 2, 3])]
    res = sim.replay(reqs, 8 * 16, "freq", 16, keep_per_request=True)
    assert res.per_request_hits[-2:] == [2, 0]


# ---------------------------------------------------------------------------- admission rule
def test_admission_tail_caches_a_long_tail_only_when_its_head_was_seen():
    head = list(range(4))
    long1 = keyed(head + list(range(100, 120)))  # 24 blocks, 384+ tokens
    long2 = keyed(head + list(range(100, 121)))
    res = sim.replay([long1, long2, long2], 100 * 16, "lru", 16, admission_tail_tokens=64,
                     keep_per_request=True)
    # first: only the 4 head blocks are written; second: head seen -> tail written; third hits all
    assert res.per_request_hits == [0, 4, 25]
    off = sim.replay([long1, long2], 100 * 16, "lru", 16, keep_per_request=True)
    assert off.per_request_hits == [0, 24]


# ---------------------------------------------------------------------------- store tier
def test_store_serves_a_block_the_pool_evicted_and_puts_it_back():
    a, b = keyed([1, 2, 3]), keyed([10, 11, 12])  # 3 full blocks + 1 partial = the whole pool
    reqs = [a, b, a, a]
    alone = sim.replay(reqs, 4 * 16, "lru", 16, keep_per_request=True)
    assert alone.per_request_hits == [0, 0, 0, 3]  # b evicted a from the pool
    res = sim.replay(reqs, 4 * 16, "lru", 16, keep_per_request=True, kv_store_capacity_tokens=10 * 16)
    assert res.per_request_hits == [0, 0, 3, 3]  # the store served a; it went back into the pool
    assert res.by_tier() == {"pool": 3, "store": 3} and res.store_hit_blocks == 3
    assert res.evictions == alone.evictions and res.written_blocks == alone.written_blocks
    assert res.store is not None and res.store.written_blocks == 6 and res.store.evictions == 0


def test_store_is_an_lru_of_its_own_capacity():
    """A store of 6 blocks under a pool of 4: reads count as use, so the block set read last
    survives the next writes and the one written earlier goes."""
    a, b, c = keyed([1, 2, 3]), keyed([10, 11, 12]), keyed([20, 21, 22])
    res = sim.replay([a, b, a, c, a, b], 4 * 16, "lru", 16, keep_per_request=True,
                     kv_store_capacity_tokens=6 * 16)
    # c's write drops b (a was read after b was written); b's rewrite then drops c
    assert res.per_request_hits == [0, 0, 3, 0, 3, 0]
    store = res.store
    assert store is not None and len(store) == store.num_blocks == 6
    assert store.evictions == 6 and store.written_blocks == 12
    keys = sim.request_keys([a, b, c], 16)
    assert all(k in store for k in keys[0][:3] + keys[1][:3]) and not any(k in store for k in keys[2])


def test_store_serves_only_the_run_right_after_the_pool_hits():
    """A miss the store cannot fill ends the hit, even if the store holds later blocks."""
    tier = sim.StoreTier(4 * 16, 16)
    tier.write([b"k0", b"k2", b"k3"])
    assert tier.serve([b"k0", b"k1", b"k2", b"k3"], 0, 4) == 1
    assert tier.serve([b"k0", b"k1", b"k2", b"k3"], 2, 4) == 2
    assert tier.serve([b"k0", b"k1", b"k2", b"k3"], 2, 3) == 1  # never past the lookup limit
    with pytest.raises(ValueError):
        sim.StoreTier(15, 16)


# ---------------------------------------------------------------------------- CLI
def _write_mooncake(path, n=300, seed=0):
    rng = random.Random(seed)
    nid, convs, lines = 1, {}, []
    for i in range(n):
        c = rng.randrange(40)
        ids = convs.get(c, [0]) + list(range(nid, nid + rng.randrange(1, 6)))
        nid += 6
        if rng.random() < 0.3:
            ids = [0] + list(range(nid, nid + 20))
            nid += 20
        else:
            convs[c] = ids
        lines.append({"timestamp": i * 100, "input_length": len(ids) * 512 - rng.randrange(0, 500),
                      "output_length": 10, "hash_ids": ids})
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")


def test_cli_json_and_min(tmp_path, capsys):
    p = tmp_path / "mc.jsonl"
    _write_mooncake(p)
    out = {}
    for pol in ("lru", "min", None):
        argv = [str(p), "--capacity-tokens", "60000", "--block-size", "512", "--json"]
        assert sim.main(argv + (["--policy", pol] if pol else [])) == 0
        out[pol] = json.loads(capsys.readouterr().out)
    assert out[None]["policy"] == sim.default_policy()
    for o in out.values():
        assert {"block_hit_ratio", "token_hit_ratio", "policy", "capacity_tokens"} <= set(o)
        assert o["capacity_tokens"] == 60000
    assert out["min"]["block_hit_ratio"] >= out["lru"]["block_hit_ratio"] > 0
    from hotprefix.cli import main as cli_main

    assert cli_main(["simulate", str(p), "--capacity-tokens", "60000", "--block-size", "512",
                     "--json", "--policy", "min"]) == 0
    assert json.loads(capsys.readouterr().out)["block_hit_ratio"] == out["min"]["block_hit_ratio"]


def test_cli_store_tier_json(tmp_path, capsys):
    p = tmp_path / "mc.jsonl"
    _write_mooncake(p)
    base = [str(p), "--capacity-tokens", "60000", "--block-size", "512", "--json"]
    assert sim.main(base) == 0
    alone = json.loads(capsys.readouterr().out)
    assert alone["hit_tokens_by_tier"] == {"pool": alone["hit_tokens"]} and "kv_store" not in alone
    assert sim.main(base + ["--kv-store-capacity-tokens", "600000"]) == 0
    out = json.loads(capsys.readouterr().out)
    by_tokens, by_blocks = out["hit_tokens_by_tier"], out["hit_blocks_by_tier"]
    assert set(by_tokens) == set(by_blocks) == set(out["block_hit_ratio_by_tier"]) == {"pool", "store"}
    assert sum(by_tokens.values()) == out["hit_tokens"] and sum(by_blocks.values()) == out["hit_blocks"]
    assert by_tokens["pool"] == alone["hit_tokens"]  # write-through: the pool behaves as alone
    assert by_tokens["store"] > 0 and out["block_hit_ratio"] > alone["block_hit_ratio"]
    ratios = out["block_hit_ratio_by_tier"]
    assert abs(ratios["pool"] + ratios["store"] - out["block_hit_ratio"]) < 2e-6
    assert out["kv_store"]["capacity_tokens"] == 600000 and out["kv_store"]["num_blocks"] == 1171
    assert out["kv_store"]["written_blocks"] > 0
    assert sim.main(base[:-1] + ["--kv-store-capacity-tokens", "600000"]) == 0
    assert "store" in capsys.readouterr().out
    for bad in (["--kv-store-capacity-tokens", "100"], ["--kv-store-capacity-tokens", "600000",
                                                        "--policy", "ceiling"]):
        assert sim.main(base + bad) == 2
    assert sim.main([str(p), "--sweep", "--kv-store-capacity-tokens", "600000"]) == 2
    capsys.readouterr()


def test_cli_sweep_writes_plot_json_and_sizing(tmp_path, capsys):
    p = tmp_path / "mc.jsonl"
    _write_mooncake(p)
    d = tmp_path / "out"
    assert sim.main([str(p), "--sweep", "--out", str(d), "--block-size", "512", "--points", "6",
                     "--bytes-per-token", "46080", "--policy", "lru,freq"]) == 0
    text = capsys.readouterr().out
    assert (d / "mrc.png").stat().st_size > 1000
    res = json.loads((d / "mrc.json").read_text())
    assert set(res["policies"]) == {"lru", "freq", "min"}
    assert res["stack_check"]["stack"] == res["stack_check"]["replay"]
    caps = res["capacities_tokens"]
    assert caps == sorted(caps) and len(caps) == 6
    for name, ys in res["policies"].items():
        assert all(0 <= y <= res["ceiling"] + 1e-9 for y in ys)
        assert all(m >= y - 1e-9 for m, y in zip(res["policies"]["min"], ys))
    a = res["advice"]["lru"]
    assert a["kv_cache_memory_bytes"] == a["capacity_tokens"] * 46080
    assert "--kv-cache-memory" in text


GOOD_LINE = '{"timestamp": 0, "input_length": 1024, "hash_ids": [1, 2]}'


@pytest.mark.parametrize("line, says", [
    ("[1, 2, 3]", "must be a JSON object, got list"),
    ("5", "must be a JSON object, got int"),
    ("null", "must be a JSON object, got null"),
    ('{"timestamp": 0, "input_length": 100, "hash_ids": null}', "field 'hash_ids' must be a list"),
    ('{"timestamp": 0, "input_length": 100, "hash_ids": 5}', "field 'hash_ids' must be a list"),
    ('{"timestamp": 0, "input_length": 100, "hash_ids": ["a"]}', "field 'hash_ids[0]' must be an integer"),
    ('{"timestamp": null, "input_length": 100, "hash_ids": [1]}', "field 'timestamp' must be a number"),
    ('{"timestamp": NaN, "input_length": 100, "hash_ids": [1]}', "field 'timestamp' must be a finite"),
    ('{"timestamp": Infinity, "input_length": 100, "hash_ids": [1]}', "field 'timestamp' must be a finite"),
    ('{"timestamp": 0, "input_length": null, "hash_ids": [1]}', "field 'input_length' must be an integer"),
    ('{"timestamp": 0, "input_length": -900, "hash_ids": [1]}', "field 'input_length' must be >= 0"),
    ('{"timestamp": 0, "input_length": 100, "output_length": -1, "hash_ids": [1]}',
     "field 'output_length' must be >= 0"),
    ('{"timestamp": 0, "hash_ids": [1, 2]}', "missing field 'input_length'"),
    ('{"timestamp": 0, "input_length": 100, "hash_ids": [1], "priority": null}',
     "field 'priority' must be an integer"),
    ('{"timestamp": 0, "input_length": 100, "hash_ids": [1], "ttl_s": -5}', "field 'ttl_s' must be >= 0"),
    ('{"token_ids": 5}', "field 'token_ids' must be a list"),
    ('{"token_ids": "abc"}', "field 'token_ids' must be a list"),
    ('{"block_keys": [1], "num_prompt_tokens": 16}', "field 'block_keys[0]' must be a hex string"),
    ('{"block_keys": ["00ff"], "num_prompt_tokens": -1}', "field 'num_prompt_tokens' must be >= 0"),
    ('{"timestamp": 1, "input_length": 1024, "hash_ids": [1, 2]', "not valid JSON (Expecting ',' "
                                                                  "delimiter at column 58)"),
])
def test_a_bad_trace_line_is_named_by_file_line_and_field(tmp_path, capsys, line, says):
    p = tmp_path / "t.jsonl"
    p.write_text(f"{GOOD_LINE}\n\n{line}\n{GOOD_LINE}\n")  # the bad line is line 3 (blank lines count)
    err = exit_2([str(p), "--capacity-tokens", "10000"], capsys)
    assert err.startswith(f"hotprefix simulate: error: {p}:3: ") and says in err, err
    with pytest.raises(ValueError, match=f"^{p}:3: "):
        sim.load_trace(str(p), 16)


@pytest.mark.parametrize("content", [b"timestamp,ContextTokens,GeneratedTokens\n2023,374,44\n",
                                     b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03\xab\xae\x05\x00\n"])
def test_a_first_line_not_json_says_the_simulator_reads_jsonl(tmp_path, capsys, content):
    p = tmp_path / "t.csv"
    p.write_bytes(content)
    err = exit_2([str(p), "--capacity-tokens", "10000"], capsys)
    assert f"{p}:1: not valid JSON (" in err
    assert "reads JSONL traces" in err and "Mooncake" in err and "CSV and gzip" in err


def test_limit_replays_the_first_n_requests(tmp_path, capsys):
    p = tmp_path / "t.jsonl"
    p.write_text(f"{GOOD_LINE}\n{GOOD_LINE}\n")
    assert [len(sim.load_trace(str(p), 16, n)) for n in (0, 1, 2, 5, None)] == [0, 1, 2, 2, 2]
    assert sim.main([str(p), "--capacity-tokens", "10000", "--limit", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] == 1


@pytest.mark.parametrize("flag, value", [
    ("--block-size", "0"), ("--block-size", "-16"), ("--limit", "0"), ("--limit", "-1"),
    ("--points", "0"), ("--points", "1"), ("--points", "-3"), ("--capacity-tokens", "0"),
    ("--admission-tail-tokens", "-1"), ("--bytes-per-token", "0"),
])
def test_nonsense_numbers_are_refused_at_parsing(tmp_path, capsys, flag, value):
    p = tmp_path / "t.jsonl"
    p.write_text(f"{GOOD_LINE}\n")
    argv = [str(p)]
    if flag in ("--points", "--bytes-per-token"):
        argv += ["--sweep", "--out", str(tmp_path / "out")]
    if flag != "--capacity-tokens" and "--sweep" not in argv:
        argv += ["--capacity-tokens", "10000"]
    err = exit_2(argv + [flag, value], capsys)
    assert f"argument {flag}: must be " in err and repr(value) in err


def test_unusable_sweep_out_and_capacity_are_errors(tmp_path, capsys):
    p = tmp_path / "t.jsonl"
    p.write_text(f"{GOOD_LINE}\n")
    err = exit_2([str(p), "--sweep", "--out", str(p), "--bytes-per-token", "1000"], capsys)
    assert f"--out {p}: cannot make the output directory" in err
    err = exit_2([str(p), "--capacity-tokens", "15"], capsys)
    assert "--capacity-tokens must hold at least one block (16 tokens)" in err


@pytest.mark.parametrize("flags", [["--router", "round_robin"], ["--drop-events", "0.9"],
                                   ["--tokens-per-second", "1000"], ["--prefill-weight", "2"]])
def test_fleet_flags_without_replicas_are_errors(tmp_path, capsys, flags):
    p = tmp_path / "t.jsonl"
    p.write_text(f"{GOOD_LINE}\n")
    err = exit_2([str(p), "--capacity-tokens", "10000", *flags], capsys)
    assert f"{flags[0]} needs --replicas" in err


@pytest.mark.parametrize("policy", ["lru", "freq", "min"])
def test_a_huge_pool_allocates_only_what_the_trace_can_fill(policy):
    """A capacity far beyond the trace's footprint replays with that footprint's blocks (not
    10^14 of them) and gives the figures of a pool just large enough never to evict."""
    from hotprefix.simulate.pool import pool_blocks

    reqs = random_trace(8, n_req=150)
    for i, r in enumerate(reqs):
        r.timestamp, r.pin_ttl_s = float(i), 30.0 * (i % 3)
    sizes = [-(-r.num_tokens // 16) for r in reqs]
    distinct = len({k for ks in sim.request_keys(reqs, 16) for k in ks})
    assert pool_blocks(reqs, 10**15, 16) == distinct + max(sizes) < sum(sizes)
    enough = (sum(sizes) + max(sizes)) * 16  # below the cheap bound: a full pool of this size
    assert pool_blocks(reqs, enough, 16) == enough // 16
    huge = sim.replay(reqs, 10**15, policy, 16, admission_tail_tokens=48, keep_per_request=True)
    ref = sim.replay(reqs, enough, policy, 16, admission_tail_tokens=48, keep_per_request=True)
    assert huge.per_request_hits == ref.per_request_hits and huge.hit_blocks > 0
    assert (huge.evictions, huge.written_blocks, huge.truncated_requests) == (0, ref.written_blocks, 0)
    assert huge.to_json()["num_blocks"] == 10**15 // 16


def test_default_model_bytes_per_token():
    # the default model is a dependency (make setup installs it): missing, it is a failure
    assert sim.model_bytes_per_token(None, 4) == 46080


@pytest.mark.parametrize("kv_heads,key_length", [(2, 48), (None, None)])
def test_kv_shape_from_a_gguf_header(tmp_path, kv_heads, key_length):
    """The KV shape from a GGUF's header as gguf's writer lays it out (head count, KV heads and
    key length where written, else the attention heads and embedding / heads); a damaged or
    truncated file is a ModelLoadError, never another exception."""
    import gguf

    from hotprefix.model.metadata import KVShape, ModelLoadError, read_kv_shape

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_block_count(5)
    w.add_embedding_length(256)
    w.add_head_count(8)
    if kv_heads is not None:
        w.add_head_count_kv(kv_heads)
        w.add_key_length(key_length)
    w.add_token_list([f"t{i}" for i in range(300)])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    want = KVShape(5, kv_heads or 8, key_length or 32)
    assert read_kv_shape(str(path)) == want
    whole = path.read_bytes()
    for broken in (whole[:40], whole[:len(whole) // 2], b"GGUF\xff\xff\xff\xff" + whole[8:], b"nope"):
        path.write_bytes(broken)
        with pytest.raises(ModelLoadError, match="cannot read the KV shape"):
            read_kv_shape(str(path))


def test_simulator_and_its_sizing_import_no_torch():
    import subprocess
    import sys

    code = ("import sys, hotprefix.simulate as s\n"
            "from hotprefix.model.metadata import ModelLoadError\n"
            "try:\n    s.model_bytes_per_token(None, 4)\nexcept (ModelLoadError, ImportError):\n    pass\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_cli_sliding_window_hybrid_against_full_kv(tmp_path, capsys):
    """``--sliding-window --local-layers``: the engine's hybrid pool replayed beside the full-KV
    pool at the same bytes. Where the full-KV pool evicts, the hybrid one hits more (measured on
    this trace: 1.09x at 120,000 tokens; 0.96x at 30,000, where the eviction policy's victims
    break chains: README); with room for everything both hit alike."""
    p = tmp_path / "mc.jsonl"
    _write_mooncake(p)
    base = [str(p), "--block-size", "512", "--json", "--sliding-window", "2048",
            "--local-layers", "15/18"]
    assert sim.main(base + ["--capacity-tokens", "120000"]) == 0
    mid = json.loads(capsys.readouterr().out)
    assert mid["layout"]["page_layers"] == 3 and len(mid["layout"]["groups"]) == 6
    assert mid["hybrid"]["token_hit_ratio"] > 1.05 * mid["full_kv"]["token_hit_ratio"] > 0
    assert sim.main(base + ["--capacity-tokens", "100000000"]) == 0
    roomy = json.loads(capsys.readouterr().out)
    assert roomy["hybrid"]["hit_tokens"] == roomy["full_kv"]["hit_tokens"] > 0
    assert roomy["hybrid_over_full_kv"] == 1.0
    for bad in (["--capacity-tokens", "60000", "--local-layers", "x"],
                ["--capacity-tokens", "60000", "--policy", "min"]):
        assert sim.main(base + bad) == 2
    assert sim.main([str(p), "--capacity-tokens", "60000", "--sliding-window", "512"]) == 2
