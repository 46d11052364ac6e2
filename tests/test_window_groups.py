"""The hybrid pool (``cache/kv_groups.py``, ``cache/window_groups.py``): sliding-window groups keep
only the window's blocks and the windows before hit points, on the real cache code, no model."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hotprefix.cache.block_pool import BlockPool
from hotprefix.cache.hashing import BlockHasher, namespace_key
from hotprefix.cache.kv_groups import parse_layer_mix, plan_groups
from hotprefix.cache.manager import CacheRequest, KVCacheManager
from hotprefix.cache.report import MissReason
from hotprefix.cache.window_groups import WindowGroups, group_key

from cache_support import assert_pool_consistent

BS = 4
VOCAB = 3


def hybrid(num_pages: int, window: int = 9, groups: int = 2, policy: str = "lru",
           full_groups: int = 1) -> KVCacheManager:
    """A manager over a hybrid pool: ``full_groups`` full groups (group 0 and more with window 0)
    and ``groups`` window groups."""
    pool = BlockPool(num_pages, BS, policy, ghost_size=16)
    m = KVCacheManager(pool, BlockHasher(namespace_key("m", "t"), BS))
    windows = {g: 0 for g in range(1, full_groups)}
    windows.update({g: window for g in range(full_groups, full_groups + groups)})
    m.windows = WindowGroups(pool, BS, windows)
    return m


def run(m: KVCacheManager, rid: str, tokens: list[int], chunk: int = 1000, decode: int = 0,
        **kw) -> CacheRequest:
    """One request from lookup to free: its prompt in chunks of ``chunk`` tokens, then ``decode``
    more tokens one at a time (token 0)."""
    r = CacheRequest(rid, list(tokens), len(tokens), **kw)
    hits = m.lookup(r)
    done = len(hits) * BS
    first = True
    while done < len(r.token_ids):
        n = min(chunk, len(r.token_ids) - done)
        assert m.allocate(r, n, done, hits if first else []), "pool too small for the test"
        if first:
            m.report(r, hits)
            first = False
        done += n
        m.commit(r, done)
        if done == len(r.token_ids) and decode:
            decode -= 1
            r.token_ids.append(0)
    m.free(r)
    m.pool.check_invariants()
    return r


def evict_interior(m: KVCacheManager) -> None:
    """Take (and give back empty) every empty and interior block: the interior ones are evicted."""
    m.pool.free(m.pool.allocate(len(m.pool.empty) + len(m.pool.low)))


def test_layouts():
    g = plan_groups(18, [i for i in range(18) if i % 6 != 5], 512)
    assert g.page_layers == 3 and g.num_full_groups == 1 and g.num_window_groups == 5
    assert g.groups[0].layers == (5, 11, 17) and g.groups[1].layers == (0, 1, 2)
    assert sorted(layer for grp in g.groups for layer in grp.layers) == list(range(18))
    assert g.pages_for_blocks(10) == 60
    assert plan_groups(18, g.groups[1].layers, 512, hybrid=False).groups[0].layers == tuple(range(18))
    assert not plan_groups(4, [], 0).hybrid
    mix = parse_layer_mix("15/18", 512)
    assert [grp.layers for grp in mix.groups] == [grp.layers for grp in g.groups]
    assert parse_layer_mix("4/6", 64).page_layers == 2


def test_a_running_request_holds_only_its_window():
    m = hybrid(200, window=9)
    r = CacheRequest("a", [1] * 40, 40)
    assert m.allocate(r, 8, 0)
    for done in range(8, 40, 4):
        m.commit(r, done)
        assert m.allocate(r, 4, done)
        for t in m.windows.tables("a"):
            held = [i for i, b in enumerate(t) if b >= 0]
            assert held[0] == m.windows.first_needed(done) and held[-1] == (done + 3) // BS
    m.free(r)
    assert m.pool.num_in_use == 0


def test_hit_needs_every_groups_window_and_resumes_at_a_kept_point():
    m = hybrid(400, window=9)
    system = [1, 2] * 20  # 40 tokens: 10 blocks
    a = run(m, "a", system + [0] * 7, hit_point_tokens=(len(system),))
    assert a.cache_report.miss_reason == MissReason.COLD
    # interior window blocks of a (before its system-prompt window) are cached but evicted first
    low = list(m.pool.low.values())
    assert low and all(b.group and not b.kept for b in low)
    # evict every interior block: the hit at the system prompt's end survives
    evict_interior(m)
    assert not m.pool.low
    b = run(m, "b", system + [2] * 9)
    assert b.full_hit_blocks == 10 and b.cache_report.cached_tokens == 40
    assert m.windows.hits_by_kind["message_end"] == 1


def test_window_evicted_resumes_earlier_and_says_so():
    """a is still running past the point where b diverges: a holds the full blocks, but its window
    blocks there were interior and are evicted; b resumes at a's kept message end and the report
    says why."""
    m = hybrid(400, window=9)
    a = CacheRequest("a", [1, 2, 0] * 27, 81, hit_point_tokens=(16,))
    done = 0
    while done < 81:
        n = min(8, 81 - done)
        assert m.allocate(a, n, done)
        done += n
        m.commit(a, done)
    evict_interior(m)
    r = run(m, "b", [1, 2, 0] * 14 + [0, 2, 2, 2, 2])
    assert r.full_hit_blocks == 10
    rep = r.cache_report
    assert rep.miss_reason == MissReason.WINDOW_EVICTED and rep.cached_tokens == 16
    assert rep.detail["full_layers_cached_tokens"] == 40
    assert m.windows.resumed_earlier == 1 and m.windows.hits_by_kind["message_end"] == 1
    m.free(a)
    assert m.pool.num_in_use == 0


def test_interior_before_kept_before_full():
    m = hybrid(60, window=5)
    run(m, "a", list(range(3)) * 10, hit_point_tokens=(12,))  # 30 tokens, 7 full blocks
    pool = m.pool
    full_cached = {b.block_id for b in pool.index.values() if b.group == 0}
    kept = {b.block_id for b in pool.index.values() if b.group and b.kept}
    assert kept and pool.low
    taken = pool.allocate(len(pool.empty) + len(pool.low))
    assert {b.block_id for b in pool.index.values() if b.group == 0} == full_cached
    assert {b.block_id for b in pool.index.values() if b.group} == kept
    assert taken is not None
    pool.free(taken)


def test_bytes_per_cached_token_at_4096():
    """Gemma 3's mix (3 of 18 layers full, window 512) with block 16: a cached 4,096-token prompt
    holds under 0.35x the pages of the full-KV pool (3/18 of the layers at full length plus the
    window at the prompt's end)."""
    layout = parse_layer_mix("15/18", 512)
    base_pages = 4096 // 16 * (18 // layout.page_layers)
    pool = BlockPool(4000, 16, "lru")
    m = KVCacheManager(pool, BlockHasher(namespace_key("m", "t"), 16))
    m.windows = WindowGroups(pool, 16, {i: g.window for i, g in enumerate(layout.groups) if i})
    tokens = [i % 97 for i in range(4097)]
    r = CacheRequest("a", tokens, len(tokens))
    done = 0
    while done < len(tokens):
        n = min(512, len(tokens) - done)
        assert m.allocate(r, n, done)
        done += n
        m.commit(r, done)
    m.free(r)
    evict_interior(m)  # only the kept windows and full blocks stay
    cached = len(pool.index)
    assert cached / base_pages <= 0.35, cached / base_pages
    # and the whole prompt hits again
    r2 = CacheRequest("b", tokens + [5], len(tokens) + 1)
    assert len(m.lookup(r2)) == 4096 // 16


class HybridMachine(RuleBasedStateMachine):
    """Random admissions (in chunks), decodes, frees, forks and resets on a hybrid pool: the pool's
    invariants hold per group after every step, every hit has every group's window with the
    same tokens, and the resume point is the longest such."""

    def __init__(self):
        super().__init__()
        self.m: KVCacheManager | None = None
        self.live: dict[str, tuple[CacheRequest, int]] = {}
        self.n = 0

    @rule(pages=st.integers(12, 60), window=st.sampled_from([2, 5, 9, 13]),
          groups=st.integers(1, 3), policy=st.sampled_from(["lru", "freq"]),
          full_groups=st.integers(1, 2))
    @precondition(lambda self: self.m is None)
    def setup(self, pages, window, groups, policy, full_groups):
        self.m = hybrid(pages, window, groups, policy, full_groups)

    @rule(tokens=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40),
          chunk=st.integers(1, 16), mark=st.integers(0, 40),
          turn_ends=st.lists(st.integers(0, 40), max_size=2))
    @precondition(lambda self: self.m is not None)
    def admit(self, tokens, chunk, mark, turn_ends):
        m = self.m
        self.n += 1
        r = CacheRequest(f"r{self.n}", list(tokens), len(tokens), hit_point_tokens=(mark,),
                         turn_end_tokens=tuple(turn_ends))
        hits = m.lookup(r)
        n = len(hits)
        assert n * BS <= len(tokens) - 1
        keys = m.keys(r)
        for i, b in enumerate(hits):
            assert b.token_ids == tuple(tokens[i * BS:(i + 1) * BS]) and b.group == 0
        w = m.windows
        for blocks, win in zip(w.window_hits(keys, n) if n else [], w.windows):
            for i, b in zip(w.window_blocks(n, win), blocks):
                assert b.token_ids == tuple(tokens[i * BS:(i + 1) * BS]) and b.group
        for longer in range(n + 1, r.full_hit_blocks + 1):  # the resume point is the longest
            assert any(m.pool.lookup(group_key(keys[i], g)) is None
                       for g, win in zip(w.groups, w.windows) for i in w.window_blocks(longer, win))
        c = min(chunk, len(tokens) - n * BS)
        if m.allocate(r, c, n * BS, hits):
            m.report(r, hits)
            m.commit(r, n * BS + c)
            self.live[r.request_id] = (r, n * BS + c)
        else:
            assert m.num_blocks_held(r.request_id) == 0, "failed allocation took blocks"

    @rule(data=st.data(), tok=st.integers(0, VOCAB - 1))
    @precondition(lambda self: self.live)
    def step(self, data, tok):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        r, done = self.live[rid]
        if done == len(r.token_ids):
            r.token_ids.append(tok)
        n = min(data.draw(st.integers(1, 8)), len(r.token_ids) - done)
        if self.m.allocate(r, n, done):
            self.m.commit(r, done + n)
            self.live[rid] = (r, done + n)
        w = self.m.windows
        for t, win in zip(w.tables(rid), w.windows):  # allocate released what no query reads
            assert all(b < 0 for b in t[:w.first_needed(done, win)]), "a block out of the window is held"
            assert all(b >= 0 for b in t[w.first_needed(done, win):]), "a block in the window is missing"

    @rule(data=st.data())
    @precondition(lambda self: self.live)
    def fork(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        r, done = self.live[rid]
        if done != len(r.token_ids):
            return
        self.n += 1
        c = CacheRequest(f"r{self.n}", list(r.token_ids), r.num_prompt_tokens)
        pairs = self.m.fork(r, c, done)
        if pairs is not None:
            self.live[c.request_id] = (c, done)

    @rule(data=st.data())
    @precondition(lambda self: self.live)
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        r, _ = self.live.pop(rid)
        self.m.free(r)

    @rule()
    @precondition(lambda self: self.m is not None)
    def reset(self):
        self.m.reset()
        assert all(b.ref_cnt > 0 for b in self.m.pool.index.values())

    @rule()
    @precondition(lambda self: self.m is not None)
    def finish_all(self):
        for r, _ in self.live.values():
            self.m.free(r)
        self.live.clear()
        assert self.m.pool.num_in_use == 0 and all(b.ref_cnt == 0 for b in self.m.pool.blocks)
        assert not self.m.pool.pinned

    @invariant()
    def invariants(self):
        if self.m is not None:
            assert_pool_consistent(self.m, self.live, BS)


TestHybridMachine = HybridMachine.TestCase
TestHybridMachine.settings = settings(max_examples=120, stateful_step_count=40, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])
