"""Engine tests on a tiny random-weight Llama (fast): batching, chunked prefill, preemption,
prefix reuse, sampling, rejection of bad requests, no leaked blocks."""

from __future__ import annotations

import random

import pytest
import torch

from hotprefix import LLM, SamplingParams
from hotprefix.config.sections import ConfigError
from hotprefix.engine.scheduler import RequestRejected
from hotprefix.request.sampling import SamplingError


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return LLM(tiny_model_dir, num_blocks=256, block_size=16, enable_prefix_caching=False)


def rand_prompts(n, lo, hi, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def greedy(n=12):
    return SamplingParams(max_tokens=n, ignore_eos=True)


def test_same_tokens_alone_and_in_mixed_batch(tiny):
    prompts = rand_prompts(8, 5, 90)
    alone = [tiny.generate([p], greedy())[0].token_ids for p in prompts]
    batch = [o.token_ids for o in tiny.generate(prompts, greedy())]
    assert alone == batch
    assert all(len(t) == 12 for t in batch)
    assert tiny.cache_stats()["blocks_in_use"] == 0


def test_chunked_prefill_matches_one_shot(tiny_model_dir, tiny):
    prompts = rand_prompts(3, 100, 200, seed=1)
    one_shot = [o.token_ids for o in tiny.generate(prompts, greedy())]
    chunked = LLM(tiny_model_dir, num_blocks=256, max_num_batched_tokens=24, enable_prefix_caching=False)
    outs = chunked.generate(prompts, greedy())
    assert [o.token_ids for o in outs] == one_shot
    # with a 24-token budget the 100+ token prompts needed several steps: TTFT is after >1 step
    assert chunked.engine.scheduler.num_unfinished == 0


def test_preemption_under_tiny_pool_completes_correctly(tiny_model_dir, tiny):
    prompts = rand_prompts(6, 20, 40, seed=2)
    ref = [o.token_ids for o in tiny.generate(prompts, greedy(24))]
    small = LLM(tiny_model_dir, num_blocks=10, block_size=16, enable_prefix_caching=True)
    outs = small.generate(prompts, greedy(24))
    assert [o.token_ids for o in outs] == ref
    stats = small.cache_stats()
    assert stats["blocks_in_use"] == 0
    small.engine.cache.pool.check_invariants()


def test_preemption_actually_happens(tiny_model_dir):
    small = LLM(tiny_model_dir, num_blocks=8, block_size=16, enable_prefix_caching=False)
    eng = small.engine
    reqs = [eng.add_request(p, greedy(40)) for p in rand_prompts(4, 20, 30, seed=3)]
    while eng.has_unfinished():
        eng.step()
    assert sum(r.num_preemptions for r in reqs) > 0
    assert all(r.is_finished and r.num_output_tokens > 0 for r in reqs)
    assert eng.cache.pool.num_in_use == 0


def test_prefix_cache_hit_gives_same_tokens(tiny_model_dir, tiny):
    cached = LLM(tiny_model_dir, num_blocks=256, block_size=16)
    prefix = rand_prompts(1, 80, 80, seed=4)[0]
    prompts = [prefix + t for t in rand_prompts(4, 3, 20, seed=5)]
    ref = [o.token_ids for o in tiny.generate(prompts, greedy())]
    outs = [cached.generate([p], greedy())[0] for p in prompts]
    assert [o.token_ids for o in outs] == ref
    assert outs[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens == 80 for o in outs[1:])
    assert cached.cache_stats()["blocks_in_use"] == 0


def test_inflight_sharing_computes_shared_prefix_once(tiny_model_dir):
    llm = LLM(tiny_model_dir, num_blocks=256, block_size=16, max_num_batched_tokens=64)
    prefix = rand_prompts(1, 160, 160, seed=6)[0]
    prompts = [prefix + t for t in rand_prompts(4, 5, 10, seed=7)]
    computed = []
    llm.engine.on_step.append(lambda info: computed.append(info["num_tokens"]))
    outs = llm.generate(prompts, greedy(4))
    assert [o.num_cached_tokens for o in outs] == [0, 160, 160, 160]
    prompt_tokens = sum(len(p) for p in prompts)
    # the prefix was computed once, not 4 times
    assert sum(computed) - 3 * 4 <= prompt_tokens - 3 * 160 + 4


def test_cache_aware_admission_prefers_cached_prefix(tiny_model_dir):
    llm = LLM(tiny_model_dir, num_blocks=256, block_size=16, max_num_seqs=1)
    warm = rand_prompts(1, 64, 64, seed=8)[0]
    llm.generate([warm + [5]], greedy(1))
    eng = llm.engine
    cold = eng.add_request(rand_prompts(1, 70, 70, seed=9)[0], greedy(2))
    hot = eng.add_request(warm + [7, 8, 9], greedy(2))
    eng.step()
    assert hot.status.value == "running" and cold.status.value == "waiting"
    assert cold.num_skips == 1
    while eng.has_unfinished():
        eng.step()
    assert cold.is_finished and hot.is_finished


def test_fairness_bound(tiny_model_dir):
    llm = LLM(tiny_model_dir, num_blocks=256, block_size=16, max_num_seqs=1, max_skips=2)
    warm = rand_prompts(1, 64, 64, seed=10)[0]
    llm.generate([warm + [5]], greedy(1))
    eng = llm.engine
    cold = eng.add_request(rand_prompts(1, 40, 40, seed=11)[0], greedy(1))
    order = []
    hots = [eng.add_request(warm + [i, i + 1], greedy(1)) for i in range(6)]
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                order.append(o.request_id)
    assert order.index(cold.request_id) <= 2  # passed over at most max_skips times
    assert all(h.is_finished for h in hots)


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny):
    p = rand_prompts(2, 10, 20, seed=12)
    sp = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=10, ignore_eos=True)
    a = tiny.generate([p[0]], sp)[0].token_ids
    b = tiny.generate([p[0], p[1]], sp)[0].token_ids
    c = tiny.generate([p[0]], SamplingParams(temperature=0.9, seed=99, max_tokens=10, ignore_eos=True))[0].token_ids
    assert a == b
    assert a != c


def test_stop_token_ids_and_max_tokens(tiny):
    p = rand_prompts(1, 10, 10, seed=13)[0]
    full = tiny.generate([p], greedy(10))[0]
    stop_at = full.token_ids[3]
    out = tiny.generate([p], SamplingParams(max_tokens=10, stop_token_ids=[stop_at], ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[:full.token_ids.index(stop_at) + 1]  # the stop token is kept in ids, not text
    assert full.finish_reason == "length" and len(full.token_ids) == 10


def test_stop_string_truncates_text(tiny):
    p = rand_prompts(1, 10, 10, seed=14)[0]
    full = tiny.generate([p], greedy(12))[0]
    assert len(full.text) > 6
    needle = full.text[3:6]
    out = tiny.generate([p], SamplingParams(max_tokens=12, stop=[needle], ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[:full.text.find(needle)]


def test_timings_reported(tiny):
    out = tiny.generate([rand_prompts(1, 10, 10)[0]], greedy(5))[0]
    assert out.ttft_s is not None and out.ttft_s > 0
    assert len(out.token_latencies_s) == 4 and all(t >= 0 for t in out.token_latencies_s)


def test_rejections(tiny_model_dir, tiny):
    with pytest.raises(RequestRejected, match="max_model_len"):
        LLM(tiny_model_dir, num_blocks=64, max_model_len=32).generate([[5] * 40], greedy())
    with pytest.raises(RequestRejected, match="empty"):
        tiny.generate([[]], greedy())
    with pytest.raises(RequestRejected, match="token ids"):
        tiny.generate([[10**9]], greedy())
    with pytest.raises(SamplingError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(SamplingError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(SamplingError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ConfigError, match="unknown option"):
        LLM(tiny_model_dir, not_an_option=1)
    with pytest.raises(RequestRejected, match="KV pool"):
        LLM(tiny_model_dir, num_blocks=2, block_size=16).generate([[5] * 40], greedy())
    assert tiny.cache_stats()["blocks_in_use"] == 0


def test_abort_releases_blocks(tiny):
    eng = tiny.engine
    r = eng.add_request(rand_prompts(1, 50, 50)[0], greedy(50))
    eng.step()
    assert eng.cache.pool.num_in_use > 0
    assert eng.abort(r.request_id)
    assert eng.cache.pool.num_in_use == 0 and not eng.has_unfinished()


def test_deterministic_mode_bit_identical_logits(tiny_model_dir):
    llm = LLM(tiny_model_dir, num_blocks=64, block_size=16, deterministic=True)
    eng = llm.engine
    prompt = rand_prompts(1, 53, 53, seed=15)[0]
    r1 = eng.add_request(prompt, greedy(1))
    while eng.has_unfinished():
        eng.step()
    # uncached logits of the last prompt token, and cached: recompute with the first 48 tokens from cache
    r2 = eng.add_request(prompt, greedy(1))
    sched = eng.scheduler.schedule()
    assert sched.chunks[0].start == 48  # 3 blocks from cache
    tables = {c.request.request_id: eng.cache.block_table(c.request.request_id) for c in sched.chunks}
    cached_logits, _ = eng.runner.forward_logits(sched.chunks, tables)
    eng.scheduler.finish(r2, "abort")
    r3 = eng.add_request(prompt, greedy(1))
    eng.reset_prefix_cache()
    sched = eng.scheduler.schedule()
    assert sched.chunks[0].start == 0
    tables = {c.request.request_id: eng.cache.block_table(c.request.request_id) for c in sched.chunks}
    fresh_logits, _ = eng.runner.forward_logits(sched.chunks, tables)
    eng.scheduler.finish(r3, "abort")
    assert torch.equal(cached_logits, fresh_logits)
    assert r1.is_finished
