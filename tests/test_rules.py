"""Rules kept in one place: the last-token rule, the greedy threshold, the default max_tokens, sizes,
the API-key file's model and the stats window (no model)."""

from __future__ import annotations

import random

import pytest

from hotprefix.cache.block_pool import BlockPool
from hotprefix.cache.hashing import BlockHasher, namespace_key
from hotprefix.cache.manager import CacheRequest, KVCacheManager
from hotprefix.cache.rules import cacheable_blocks
from hotprefix.cache.stats import CacheStats
from hotprefix.config.sections import ConfigError, parse_bytes
from hotprefix.request.sampling import DEFAULT_MAX_TOKENS, MIN_TEMPERATURE, SamplingParams
from hotprefix.server.tenants import parse_keys
from hotprefix.simulate.traces import TraceRequest, lookup_limit

BS = 4


@pytest.mark.parametrize("num_tokens, blocks", [(0, 0), (1, 0), (4, 0), (5, 1), (8, 1), (9, 2), (12, 2)])
def test_cacheable_blocks_never_cover_the_last_token(num_tokens, blocks):
    assert cacheable_blocks(num_tokens, BS) == blocks


def _finish(m: KVCacheManager, r: CacheRequest) -> None:
    hits = m.lookup(r)
    n_hit = len(hits) * BS
    assert m.allocate(r, r.num_prompt_tokens - n_hit, n_hit, hits)
    m.commit(r, r.num_prompt_tokens)
    m.free(r)


@pytest.mark.parametrize("n", [4, 7, 8, 9, 12])
def test_manager_and_simulator_apply_the_same_rule(n):
    m = KVCacheManager(BlockPool(16, BS, "lru"), BlockHasher(namespace_key("m", "t"), BS), True)
    tokens = list(range(100, 100 + n))
    _finish(m, CacheRequest("a", list(tokens), n))
    hits = m.lookup(CacheRequest("b", list(tokens), n))
    assert len(hits) == cacheable_blocks(n, BS)
    trace = TraceRequest(num_prompt_tokens=n, num_tokens=n, token_ids=tokens)
    assert lookup_limit(trace, n // BS, BS) == cacheable_blocks(n, BS)


def test_tiny_temperatures_are_greedy_in_sampling_params():
    for t in (0, 0.0, 1e-300, MIN_TEMPERATURE / 2):
        p = SamplingParams(temperature=t)
        assert p.greedy and p.temperature == 0.0
    p = SamplingParams(temperature=MIN_TEMPERATURE)
    assert not p.greedy and p.temperature == MIN_TEMPERATURE
    assert SamplingParams().max_tokens == DEFAULT_MAX_TOKENS


@pytest.mark.parametrize("value, size", [
    ("2GiB", 2 * 1024**3), ("512MB", 512 * 1000**2), ("1073741824", 1073741824), (1073741824, 1073741824),
    ("2Gi", 2 * 1024**3), (" 1.5 G ", 1_500_000_000), ("64kib", 65536), (2e9, 2_000_000_000),
])
def test_parse_bytes_accepts(value, size):
    assert parse_bytes(value) == size


@pytest.mark.parametrize("value", ["", "abc", "2GiB junk", "1.5.3", "1e9", "2 G i B", "-1", "0", 0, -5,
                                   True, None, float("nan"), float("inf")])
def test_parse_bytes_refuses(value):
    with pytest.raises(ConfigError):
        parse_bytes(value)


@pytest.mark.parametrize("entry, field", [
    ({"tenant": "x", "priority": 1.5}, "priority"), ({"tenant": "x", "salt": "s"}, "'salt'"),
    ({"tenant": "x", "shared_prefix_tokens": None}, "shared_prefix_tokens"), ({"tenant": ""}, "tenant"),
    ({"tenant": "x", "ttl_s": True}, "ttl_s"),
])
def test_key_file_errors_name_the_entry_and_the_setting_not_the_key(entry, field):
    with pytest.raises(ConfigError) as e:
        parse_keys({"sk-secret-123": entry})
    msg = str(e.value)
    assert "key sk-s...:" in msg and field in msg and "secret" not in msg


def test_key_entry_shared_prefix_defaults_to_the_servers():
    keys = parse_keys({"k1": "alice", "k2": {"tenant": "bob", "shared_prefix_tokens": 0}}, default_shared=32)
    assert keys["k1"].shared_prefix_tokens == 32 and keys["k2"].shared_prefix_tokens == 0


@pytest.mark.parametrize("window", [0, 1, 3, 50])
def test_stats_window_is_bounded_and_its_sums_run(window):
    s = CacheStats(window=window)
    rng = random.Random(window)
    for i in range(200):
        q = rng.randint(0, 40)
        s.record(q, rng.randint(0, q), "hit", 0)
        assert len(s.recent) == min(window, i + 1)
        qs, hs = sum(x for x, _ in s.recent), sum(h for _, h in s.recent)
        assert (s.recent_queried_tokens, s.recent_hit_tokens) == (qs, hs)
        assert s.recent_hit_rate == (hs / qs if qs else 0.0)
    s.reset()
    assert not s.recent and s.recent_hit_rate == 0.0 and s.recent.maxlen == window
