"""Property test: random sequences of admit / append / free / reset on the real cache code keep
every invariant after each step, and when every request has ended no block is in use."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hotprefix.cache.block_pool import BlockPool
from hotprefix.cache.eviction import POLICIES, FreqCreditPolicy
from hotprefix.cache.hashing import BlockHasher, namespace_key
from hotprefix.cache.manager import CacheRequest, KVCacheManager

from cache_support import assert_pool_consistent

BS = 4
VOCAB = 3  # tiny vocabulary so prefixes collide often


class EagerWindowFreq(FreqCreditPolicy):
    """freq with a credit window learned after every reuse gap, from a low quantile, with a
    half-request floor, so the lapsed-credit eviction path runs within a few steps."""

    credit_requests = 0.5
    credit_window_quantile = 0.05
    window_update_every = 1
    gap_samples_half_life = 8


class CacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.manager: KVCacheManager | None = None
        self.live: dict[str, tuple[CacheRequest, int]] = {}  # id -> (req, num_computed)
        self.n = 0

    @rule(num_blocks=st.integers(4, 24), policy=st.sampled_from(sorted(POLICIES) + ["eager-window"]))
    @precondition(lambda self: self.manager is None)
    def setup(self, num_blocks, policy):
        pol = EagerWindowFreq(num_blocks) if policy == "eager-window" else policy
        pool = BlockPool(num_blocks, BS, pol, ghost_size=16)
        self.manager = KVCacheManager(pool, BlockHasher(namespace_key("m", "t"), BS))

    @rule(tokens=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30),
          salt=st.sampled_from([None, "a"]))
    @precondition(lambda self: self.manager is not None)
    def admit(self, tokens, salt):
        m = self.manager
        self.n += 1
        r = CacheRequest(f"r{self.n}", list(tokens), len(tokens), salt=salt)
        hits = m.lookup(r)
        assert len(hits) * BS <= len(tokens) - 1, "more than prompt-1 tokens from cache"
        for i, b in enumerate(hits):
            assert b.token_ids == tuple(tokens[i * BS:(i + 1) * BS]), "hit with different tokens"
        n_hit = len(hits) * BS
        if m.allocate(r, len(tokens) - n_hit, n_hit, hits):
            m.report(r, hits)
            m.commit(r, len(tokens))
            self.live[r.request_id] = (r, len(tokens))
        else:
            assert m.num_blocks_held(r.request_id) == 0, "failed allocation took blocks"

    @rule(data=st.data(), tok=st.integers(0, VOCAB - 1))
    @precondition(lambda self: self.live)
    def append(self, data, tok):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        r, n = self.live[rid]
        r.token_ids.append(tok)
        if self.manager.allocate(r, 1, n):
            self.manager.commit(r, n + 1)
            self.live[rid] = (r, n + 1)
        else:
            r.token_ids.pop()
        assert self.manager.num_blocks_held(rid) == math.ceil(self.live[rid][1] / BS)

    @rule(data=st.data())
    @precondition(lambda self: self.live)
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        r, _ = self.live.pop(rid)
        self.manager.free(r)

    @rule()
    @precondition(lambda self: self.manager is not None)
    def reset(self):
        in_use = sum(1 for b in self.manager.pool.blocks if b.ref_cnt > 0 and b.key is not None)
        out = self.manager.reset()
        assert out["in_use_blocks_kept"] == in_use
        assert all(b.ref_cnt > 0 for b in self.manager.pool.index.values())

    @rule()
    @precondition(lambda self: self.manager is not None)
    def finish_all(self):
        for r, _ in self.live.values():
            self.manager.free(r)
        self.live.clear()
        assert self.manager.pool.num_in_use == 0, "a block is still in use after every request ended"
        assert all(b.ref_cnt == 0 for b in self.manager.pool.blocks)

    @invariant()
    def pool_invariants(self):
        if self.manager is None:
            return
        assert_pool_consistent(self.manager, self.live, BS)


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


def serve(m: KVCacheManager, rid: str, tokens: list[int]) -> list | None:
    """One request from lookup to free, its whole prompt in one step; the cache hits it got, or
    None if the pool could not hold it."""
    r = CacheRequest(rid, list(tokens), len(tokens))
    hits = m.lookup(r)
    n_hit = len(hits) * BS
    if not m.allocate(r, len(tokens) - n_hit, n_hit, hits):
        return None
    m.commit(r, len(tokens))
    m.free(r)
    return hits


@given(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=20), min_size=1, max_size=15))
@settings(max_examples=100, deadline=None)
def test_cached_tokens_equal_longest_common_full_block_prefix(prompts):
    """With a pool large enough to never evict, the hit length is the longest common full-block
    prefix with any earlier prompt (capped at len-1)."""
    m = KVCacheManager(BlockPool(400, BS), BlockHasher(namespace_key("m", "t"), BS))
    seen: list[list[int]] = []
    for i, p in enumerate(prompts):
        expect = 0
        for q in seen:
            c = 0
            while c < min(len(p), len(q)) and p[c] == q[c]:
                c += 1
            expect = max(expect, min(c, len(q), len(p) - 1) // BS)
        hits = serve(m, f"r{i}", p)
        assert hits is not None and len(hits) == expect
        seen.append(p)
    assert m.pool.num_in_use == 0


@given(st.integers(4, 32), st.sampled_from(["lru", "freq", "eager-window"]),
       st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=24), min_size=1, max_size=40))
@settings(max_examples=150, deadline=None)
def test_eviction_never_strands_a_cached_block_behind_a_missing_parent(num_blocks, policy, prompts):
    """Requests one at a time: every policy (freq with a lapsing credit included) evicts leaves
    before their ancestors, so a cached block's parent is always cached."""
    pol = EagerWindowFreq(num_blocks) if policy == "eager-window" else policy
    m = KVCacheManager(BlockPool(num_blocks, BS, pol), BlockHasher(namespace_key("m", "t"), BS))
    for i, toks in enumerate(prompts):
        if serve(m, f"r{i}", toks) is None:
            continue  # larger than the pool
        for blk in m.pool.index.values():
            assert blk.depth == 0 or blk.parent in m.pool.index, f"{policy}: stranded block"
        m.pool.check_invariants()
