"""How the scheduler cuts prompts into steps (``engine/scheduler.py``): a hybrid pool's prefill
chunk cap (``SchedulerConfig.window_prefill_chunk``) and one prompt part-way at a time. The real
scheduler and cache manager, no model."""

from __future__ import annotations

from hotprefix.cache.block_pool import BlockPool
from hotprefix.cache.hashing import BlockHasher, namespace_key
from hotprefix.cache.manager import KVCacheManager
from hotprefix.config.sections import SchedulerConfig
from hotprefix.engine.request import Request
from hotprefix.engine.scheduler import Scheduler
from hotprefix.request.sampling import SamplingParams

from test_window_groups import BS, hybrid


def full_pool(num_blocks: int) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, BS), BlockHasher(namespace_key("s", "t"), BS))


def steps(m: KVCacheManager, config: SchedulerConfig, prompts: dict[str, int]) -> list[list[tuple]]:
    """Every step's chunks, ``(request, tokens)``, until each prompt (its length given) has been
    computed and one token generated."""
    sched = Scheduler(config, m, 1 << 16)
    for i, (rid, n) in enumerate(prompts.items()):
        sched.add(Request(rid, [1 + (7 * i + j) % 50 for j in range(n)], n,
                          params=SamplingParams(max_tokens=1)))
    out = []
    while sched.num_unfinished:
        s = sched.schedule()
        out.append([(c.request.request_id, c.num_tokens) for c in s.chunks])
        for r in sched.update(s, {c.request.request_id: 0 for c in s.chunks if c.wants_logits}):
            sched.finish(r, "length")
    assert m.pool.num_in_use == 0
    return out


def test_a_hybrid_pool_prefills_one_capped_prompt_at_a_time():
    cfg = SchedulerConfig(max_num_batched_tokens=64, window_prefill_chunk=16)
    got = steps(hybrid(400), cfg, {"a": 40, "b": 40, "c": 8})
    # a's chunks are capped; b, whose first chunk would leave most of its prompt, waits for a's
    # last chunk; c (its whole prompt in one chunk) is not held back
    assert got == [[("a", 16), ("c", 8)], [("a", 16)], [("a", 8), ("b", 16)], [("b", 16)],
                   [("b", 8)]]


def test_uncapped_and_full_attention_pools_fill_the_step():
    for m, cfg in ((hybrid(400), SchedulerConfig(max_num_batched_tokens=64, window_prefill_chunk=0)),
                   (full_pool(200), SchedulerConfig(max_num_batched_tokens=64))):
        got = steps(m, cfg, {"a": 40, "b": 40, "c": 8})
        # no cap: the step takes all of a and what its budget has left of b; c waits for room
        assert got == [[("a", 40), ("b", 24)], [("b", 16), ("c", 8)]], m.windows


def test_a_prompt_part_way_does_not_hold_back_decodes():
    cfg = SchedulerConfig(max_num_batched_tokens=64, window_prefill_chunk=16)
    sched = Scheduler(cfg, hybrid(400), 1 << 16)
    short = Request("short", [3] * 8, 8, params=SamplingParams(max_tokens=4))
    sched.add(short)
    s = sched.schedule()
    sched.update(s, {"short": 0})
    sched.add(Request("long", [4] * 40, 40, params=SamplingParams(max_tokens=1)))
    s = sched.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in s.chunks] == [("short", 1), ("long", 16)]
