"""KV tiers end to end on the tiny random-weight model: a restart reads its prefix back from disk,
a second engine reuses the first's prefix through a real Valkey, and every bad entry (a flipped
byte, a missing middle block, another layout, another namespace, another secret) truncates the
hit at that block with the right counter while the greedy output stays equal to a cold run."""

from __future__ import annotations

import glob
import os
import random

import pytest
import torch

from hotprefix import LLM
from hotprefix.cache.tiers.blob import storage_key
from hotprefix.request.sampling import SamplingParams
from valkey_support import valkey_server

BS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
N_BLOCKS = 6


def prompt(seed: int, n: int = BS * N_BLOCKS + 5) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 30000) for _ in range(n)]


def make(tiny_model_dir, stores, **kw) -> LLM:
    opts = dict(num_blocks=128, num_threads=2, kv_store=list(stores), kv_store_timeout=5.0)
    opts.update(kw)
    return LLM(tiny_model_dir, **opts)


@pytest.fixture(scope="module")
def cold(tiny_model_dir):
    """Greedy outputs of a plain engine (no cache reuse), per prompt seed."""
    llm = LLM(tiny_model_dir, num_blocks=128, num_threads=2, enable_prefix_caching=False)
    memo: dict = {}

    def get(p: list[int], dtype: str | None = None) -> list[int]:
        """None = the default dtype (the one every other engine here runs)."""
        key = (tuple(p), dtype)
        if key not in memo:
            eng = llm if dtype is None else LLM(tiny_model_dir, num_blocks=128, num_threads=2,
                                                      enable_prefix_caching=False, dtype=dtype)
            memo[key] = eng.generate([p], GREEDY)[0].token_ids
        return memo[key]
    return get


def run(llm: LLM, p: list[int], **kw):
    return llm.generate([p], GREEDY, **kw)[0]


def tier(llm: LLM, name: str) -> dict:
    return llm.cache_stats()["tiers"][name]


def idle(llm: LLM) -> None:
    assert llm.cache_stats()["blocks_in_use"] == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_restart_reads_its_prefix_back_from_disk(tiny_model_dir, tmp_path, cold, dtype):
    store = f"disk:{tmp_path / 'kv'}"
    p = prompt(1)
    with make(tiny_model_dir, [store], dtype=dtype) as first:
        o1 = run(first, p)
        assert o1.cache_report.sources == {"pool": 0}
        first.engine.cache.tiers.tiers.flush()
        assert tier(first, "disk")["bytes_written"] > 0
    with make(tiny_model_dir, [store], dtype=dtype) as second:  # a new process, same directory
        o2 = run(second, p)
        assert o2.num_cached_tokens == N_BLOCKS * BS
        assert o2.cache_report.sources == {"pool": 0, "disk": N_BLOCKS * BS}
        assert tier(second, "disk")["hit_tokens"] == N_BLOCKS * BS
        assert o2.token_ids == o1.token_ids == cold(p, dtype)
        idle(second)


def test_two_engines_share_a_prefix_through_valkey(tiny_model_dir, cold):
    with valkey_server() as (url, _):
        p = prompt(2)
        with make(tiny_model_dir, [url]) as a, make(tiny_model_dir, [url]) as b:
            run(a, p)
            a.engine.cache.tiers.tiers.flush()
            o = run(b, p)
            assert o.cache_report.sources.get("redis") == N_BLOCKS * BS
            assert o.token_ids == cold(p)
            # a different tenant on the same store finds nothing of it
            other = run(b, p, cache_salt="tenant-x")
            assert other.num_cached_tokens == 0 and other.token_ids == cold(p)
            idle(a)
            idle(b)


def test_cache_none_writes_nothing_to_any_tier(tiny_model_dir, tmp_path):
    store = f"disk:{tmp_path / 'kv'}"
    with make(tiny_model_dir, [store]) as llm:
        run(llm, prompt(3), cache_write=False)
        llm.engine.cache.tiers.tiers.flush()
        assert tier(llm, "disk")["bytes_written"] == 0
        assert not glob.glob(str(tmp_path / "kv" / "**" / "*.blk"), recursive=True)


def _write_disk(tiny_model_dir, store, p, **kw) -> None:
    with make(tiny_model_dir, [store], **kw) as w:
        run(w, p)
        w.engine.cache.tiers.tiers.flush()


def _block_files(d) -> list[str]:
    return sorted(glob.glob(os.path.join(str(d), "**", "*.blk"), recursive=True))


@pytest.mark.parametrize("fault", ["flip", "truncate", "missing"])
def test_a_bad_disk_entry_truncates_the_hit_there(tiny_model_dir, tmp_path, cold, fault):
    store = f"disk:{tmp_path / 'kv'}"
    p = prompt(4)
    _write_disk(tiny_model_dir, store, p)
    files = _block_files(tmp_path / "kv")
    assert len(files) == N_BLOCKS
    # block 3's file, named by its storage key (the layout and the block's chained key)
    with make(tiny_model_dir, [store]) as probe:
        key3 = probe.engine.cache.hasher.keys(p)[3]
        skey = storage_key(probe.engine.cache.tiers.io.layout, key3)
    target = next(f for f in files if os.path.basename(f).startswith(skey))
    data = open(target, "rb").read()
    if fault == "flip":
        i = len(data) // 2
        open(target, "wb").write(data[:i] + bytes([data[i] ^ 0x40]) + data[i + 1:])
    elif fault == "truncate":
        open(target, "wb").write(data[:len(data) - 100])
    else:
        os.unlink(target)
    with make(tiny_model_dir, [store]) as llm:
        o = run(llm, p)
        assert o.cache_report.sources == {"pool": 0, "disk": 3 * BS}
        assert o.num_cached_tokens == 3 * BS
        assert o.token_ids == cold(p)
        t = tier(llm, "disk")
        if fault == "missing":
            assert t["corrupt"] == 0 and t["misses"] >= 1
        else:
            assert t["corrupt"] == 1  # counted and deleted ...
        idle(llm)
        llm.engine.cache.tiers.tiers.flush()  # ... and written again, whole, by the recompute
    with make(tiny_model_dir, [store]) as again:
        o = run(again, p)
        assert o.cache_report.sources == {"pool": 0, "disk": N_BLOCKS * BS}
        assert o.token_ids == cold(p) and tier(again, "disk")["corrupt"] == 0


def test_another_layout_or_namespace_never_matches(tiny_model_dir, tmp_path, cold, default_tokenizer):
    store = f"disk:{tmp_path / 'kv'}"
    p = prompt(5)
    _write_disk(tiny_model_dir, store, p)
    from hotprefix.model.dtype_probe import probed_cpu_dtype

    other = "float32" if probed_cpu_dtype().dtype == torch.bfloat16 else "bfloat16"  # not the default
    with make(tiny_model_dir, [store], dtype=other) as other_layout:
        o = run(other_layout, p)
        assert o.num_cached_tokens == 0 and o.token_ids == cold(p, other)
        assert tier(other_layout, "disk")["corrupt"] == 0
    with make(tiny_model_dir, [store], block_size=32) as other_blocks:
        assert run(other_blocks, p).num_cached_tokens == 0
    # another tokenizer fingerprint = another namespace: other block keys
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    default_tokenizer.save_json(str(tok_dir / "tokenizer.json"))
    import json
    j = json.loads((tok_dir / "tokenizer.json").read_text())
    j.setdefault("added_tokens", [])
    j["normalizer"] = {"type": "NFC"}
    (tok_dir / "tokenizer.json").write_text(json.dumps(j))
    with make(tiny_model_dir, [store], tokenizer=str(tok_dir / "tokenizer.json")) as other_ns:
        o = run(other_ns, p)
        assert o.num_cached_tokens == 0 and o.token_ids == cold(p)


def test_entries_signed_with_another_secret_are_rejected(tiny_model_dir, tmp_path, cold):
    store = f"disk:{tmp_path / 'kv'}"
    p = prompt(6)
    _write_disk(tiny_model_dir, store, p, kv_store_secret="replica-secret-A")
    with make(tiny_model_dir, [store], kv_store_secret="replica-secret-B") as llm:
        o = run(llm, p)
        assert o.num_cached_tokens == 0 and o.token_ids == cold(p)
        assert tier(llm, "disk")["bad_signature"] == 1
    _write_disk(tiny_model_dir, store, p, kv_store_secret="replica-secret-A")
    os.environ["HP_TEST_SECRET"] = "replica-secret-A"
    try:
        with make(tiny_model_dir, [store], kv_store_secret="env:HP_TEST_SECRET") as llm:
            assert run(llm, p).cache_report.sources.get("disk") == N_BLOCKS * BS
    finally:
        del os.environ["HP_TEST_SECRET"]


def test_a_valkey_killed_mid_run_fails_no_request(tiny_model_dir, cold):
    with valkey_server() as (url, server):
        with make(tiny_model_dir, [url], kv_store_timeout=1.0) as llm:
            p1, p2, p3 = prompt(7), prompt(8), prompt(9)
            assert run(llm, p1).token_ids == cold(p1)
            server.stop()
            for p in (p2, p3, p1):
                assert run(llm, p).token_ids == cold(p)  # the pool still serves; nothing fails
            t = tier(llm, "redis")
            assert t["errors"] + t["dropped_writes"] >= 1 and t["status"] == "degraded"
            idle(llm)


def test_tiers_show_in_stats_and_metrics(tiny_model_dir, tmp_path):
    import httpx

    from hotprefix.config.sections import EngineConfig, ServerConfig
    from server_support import LiveServer

    cfg = EngineConfig.from_options(model=tiny_model_dir, num_blocks=128, num_threads=2,
                                    kv_store=[f"disk:{tmp_path / 'kv'}"])
    with LiveServer(cfg, ServerConfig()) as s:
        body = {"model": s.model, "prompt": prompt(10), "max_tokens": 2}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["hotprefix"]["cache"]["sources"] == {"pool": 0}
        stats = httpx.get(s.url + "/v1/cache/stats", timeout=30).json()
        assert set(stats["tiers"]) == {"disk"}
        assert {"hit_tokens", "bytes_read", "bytes_written", "dropped_writes", "corrupt", "timeouts",
                "errors"} <= set(stats["tiers"]["disk"])
        metrics = httpx.get(s.url + "/metrics", timeout=30).text
        assert 'hotprefix_kv_tier_bytes_written_total{tier="disk"}' in metrics
        assert 'hotprefix_kv_tier_up{tier="disk"} 1.0' in metrics


def test_a_tier_measured_slower_than_compute_is_not_read(tiny_model_dir, tmp_path, cold):
    store = f"disk:{tmp_path / 'kv'}"
    p = prompt(11)
    _write_disk(tiny_model_dir, store, p)
    with make(tiny_model_dir, [store]) as llm:
        link = llm.engine.cache.tiers
        link.load_s_per_block, link.compute_s_per_token = 1.0, 1e-4  # as if the store were far away
        o = run(llm, p)
        assert o.num_cached_tokens == 0 and o.token_ids == cold(p)
        assert tier(llm, "disk")["fetches_skipped_slow"] == 1
        link.load_s_per_block, link.compute_s_per_token = 1.0, 1e-4  # the steps above updated both
        assert link.worth_loading(6, BS) is False
        link.load_s_per_block = 1e-6  # measured fast again: read
        assert link.worth_loading(6, BS) is True
