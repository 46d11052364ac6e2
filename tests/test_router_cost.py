"""The routing core's cost model on constructed fleet states (torch-free, no sockets): a replica busy
decoding is priced by its decode work, a burst of decisions between two reports spreads, a prefix
every replica holds is no reason to pile up (choose by work), an overloaded holder yields and the
replica that takes its prompt becomes a holder, reports supersede the router's own accounting,
measured rates count, and the fleet simulator runs on the same core (its modelled TTFT is the
router's expected TTFT)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from hotprefix.cache.hashing import BlockHasher, namespace_key
from hotprefix.events.schema import ARRAY
from hotprefix.router import Router, RouterConfig
from hotprefix.router.branches import BranchMap
from hotprefix.simulate import TraceRequest
from hotprefix.simulate.fleet import replay_fleet

BS = 16
NS = namespace_key("model-fp", "tokenizer-fp")
HASHER = BlockHasher(NS, BS)


def toks(rng: random.Random, n_blocks: int) -> list[int]:
    return [rng.randrange(1, 50000) for _ in range(n_blocks * BS)]


def router(n: int = 2, **cfg) -> Router:
    t = [0.0]
    r = Router([f"r{i}" for i in range(n)], BS, RouterConfig(**cfg), HASHER, clock=lambda: t[0])
    r.t = t  # type: ignore[attr-defined]
    for name in r.replicas:  # every replica measured: 1,000 prefill tok/s, 50 ms a decoded token
        r.report(name, 0, 0, prefill_tok_s=1000.0, decode_token_s=0.05, output_tokens=0)
    return r


def hold(r: Router, replica: str, prompt: list[int]) -> None:
    """``replica`` holds ``prompt``'s full blocks, as its KV events say."""
    n = len(prompt) // BS * BS
    r.apply_events(replica, [ARRAY.BlockStored(HASHER.keys(prompt[:n]), None, prompt[:n], BS, None,
                                               "GPU", None)])


def test_a_replica_busy_decoding_is_priced_by_its_decode_work():
    rng = random.Random(1)
    doc = toks(rng, 30)  # 480 tokens: 0.48 s of prefill saved on its holder
    r = router(2)
    hold(r, "r0", doc)
    # r0 decodes 8 sequences with 50 tokens left each: 400 x 50 ms = 20 s of work, no prompt left
    r.report("r0", prefill_tokens=0, decode_tokens=400)
    d = r.route_tokens(doc + toks(rng, 1))
    assert d.replica == "r1" and d.reason == "overloaded"
    assert d.ttft_s == pytest.approx((31 * BS) / 1000.0)
    # the same replica nearly done decoding keeps its prefix
    r.finished(d)
    other = toks(rng, 30)
    hold(r, "r0", other)
    r.report("r0", prefill_tokens=0, decode_tokens=4)  # 0.2 s < the 0.48 s it saves
    d = r.route_tokens(other + toks(rng, 1))
    assert d.replica == "r0" and d.reason == "prefix" and d.hit_blocks == 30


def test_a_burst_between_reports_spreads_over_the_fleet():
    rng = random.Random(2)
    r = router(3)
    picks = Counter(r.route_tokens(toks(rng, 8)).replica for _ in range(24))  # no report between
    assert picks == {"r0": 8, "r1": 8, "r2": 8}
    # 24 new sessions at once on one system prompt only r0 holds: they do not pile onto r0
    r = router(3)
    system = toks(rng, 40)
    hold(r, "r0", system)
    picks = Counter(r.route_tokens(system + toks(rng, 4)).replica for _ in range(24))
    assert len(picks) == 3 and max(picks.values()) <= 16  # r0 takes more: it has nothing to copy
    works = [r.work_s(n) for n in r.replicas]  # the same time to first token everywhere
    assert max(works) - min(works) <= (44 * BS + 1) / 1000.0
    # a report sampled after them supersedes the router's own count; one sampled before does not
    before = r.work_s("r1")
    r.report("r1", 0, 0, sampled_at=-1.0)
    assert r.work_s("r1") == pytest.approx(before)
    r.report("r1", 0, 0)
    assert r.work_s("r1") == 0.0


def test_a_prefix_every_replica_holds_is_chosen_by_work():
    rng = random.Random(3)
    system = toks(rng, 60)
    r = router(3)
    for name in r.replicas:
        hold(r, name, system)
    r.report("r0", 3000, 0)  # 3 s of prompts queued
    r.report("r1", 0, 10)    # 0.5 s of decoding
    r.report("r2", 500, 0)   # 0.5 s of prompts, and twice as fast
    r.report("r2", 500, 0, prefill_tok_s=2000.0)
    d = r.route_tokens(system + toks(rng, 3))
    assert d.replica == "r2" and d.reason == "least_loaded" and d.hit_blocks == 60


def test_an_overloaded_holder_yields_and_the_other_replica_becomes_a_holder():
    rng = random.Random(4)
    doc = toks(rng, 100)  # 1.6 s of prefill saved on its holder
    r = router(2)
    hold(r, "r0", doc)
    r.report("r0", 1000, 0)  # 1 s queued: affinity wins
    d = r.route_tokens(doc + toks(rng, 1))
    assert d.replica == "r0" and d.reason == "prefix"
    r.finished(d)
    r.report("r0", 2000, 0)  # 2 s queued > 1.6 s saved: it yields
    d = r.route_tokens(doc + toks(rng, 1))
    assert d.replica == "r1" and d.reason == "overloaded"
    r.finished(d)
    runs = r.index.runs(HASHER.keys(doc), r.replicas,
                        lambda rep, k: r.memory.get((k, rep), 0.0) is not None)
    assert runs == {"r0": (100, 0), "r1": (100, 0)}  # the hot prefix is on both now
    r.report("r0", 0, 0)
    picks = Counter(r.route_tokens(doc + toks(rng, 1)).replica for _ in range(40))
    assert len(picks) == 2  # both holders share it by work


def test_a_replica_that_has_not_measured_yet_is_priced_at_the_fleets_rates():
    r = Router(["a", "b", "c"], BS, RouterConfig(), HASHER)
    assert r.rates("a") == (RouterConfig.default_prefill_tok_s, RouterConfig.default_decode_token_s)
    r.report("a", 0, 0, prefill_tok_s=400.0, decode_token_s=0.1)
    r.report("b", 0, 0, prefill_tok_s=800.0, decode_token_s=0.2)
    assert r.rates("c") == (600.0, pytest.approx(0.15))
    r.report("c", 1200, 2)
    assert r.work_s("c") == pytest.approx(1200 / 600 + 2 * 0.15)


def test_the_simulator_prices_requests_with_the_routers_cost_model():
    rng = random.Random(5)
    reqs = []
    for i in range(60):  # 5 documents, 12 questions each, half a second apart
        n = rng.randrange(20, 40) * BS + 1
        reqs.append(TraceRequest(n, n, [1000 * (i % 5) + b for b in range(n // BS)],
                                 timestamp=0.5 * i, num_output_tokens=20))
    fast_slow = replay_fleet(reqs, 2, 10**6, "prefix", "lru", BS, tokens_per_s=[4000.0, 1000.0],
                             decode_tokens_per_s=[100.0, 100.0])
    f, s = fast_slow.per_replica
    assert f.computed_tokens > s.computed_tokens  # the faster replica takes more of the work
    assert len(fast_slow.ttfts) == len(reqs)
    assert fast_slow.ttfts == pytest.approx(fast_slow.router_ttfts)  # the same core, the same model
    rr = replay_fleet(reqs, 2, 10**6, "round_robin", "lru", BS, tokens_per_s=[4000.0, 1000.0],
                      decode_tokens_per_s=[100.0, 100.0])
    assert fast_slow.ttft()["mean"] < rr.ttft()["mean"]
    assert fast_slow.block_hit_ratio > rr.block_hit_ratio
    one = replay_fleet(reqs[:1], 1, 10**6, "prefix", "lru", BS, tokens_per_s=500.0)
    assert one.ttfts == [pytest.approx(reqs[0].num_prompt_tokens / 500.0)]


def _docs(n_docs: int, questions: int, seed: int) -> list[TraceRequest]:
    """Documents (their own blocks), each asked ``questions`` times, interleaved, 0.3 s apart."""
    rng = random.Random(seed)
    docs = [[10_000 * d + b for b in range(rng.randrange(20, 60))] for d in range(n_docs)]
    reqs = []
    for q in range(questions):
        for d in rng.sample(range(n_docs), n_docs):
            ids = docs[d] + [10**7 + len(reqs)]  # the question: a block of its own
            n = len(ids) * BS + 1
            reqs.append(TraceRequest(n, n, ids, timestamp=0.3 * len(reqs), num_output_tokens=16))
    return reqs


def _chats(n: int, turns: int, seed: int) -> list[TraceRequest]:
    """Conversations on one 2-block system prompt, turns interleaved, 0.3 s apart."""
    rng = random.Random(seed)
    chains = [list(range(2)) + [1000 * (c + 1) + b for b in range(rng.randrange(6, 12))] for c in range(n)]
    reqs = []
    for t in range(turns):
        for c in range(n):
            if t:
                chains[c] = chains[c] + [10**6 + 100 * len(reqs) + b for b in range(rng.randrange(2, 6))]
            k = len(chains[c]) * BS + 1
            reqs.append(TraceRequest(k, k, list(chains[c]), timestamp=0.3 * len(reqs), num_output_tokens=16))
    return reqs


@pytest.mark.parametrize("trace", ["docs", "chats"])
def test_the_default_cost_model_holds_on_more_than_one_trace_shape(trace):
    """No constant tuned on one trace: on documents and on chats, each replica's pool a third of
    the working set, the defaults keep most of one big cache's hit ratio, far above the blind
    routers', and beat their modelled TTFT."""
    reqs = _docs(16, 6, 1) if trace == "docs" else _chats(25, 5, 2)
    from hotprefix import simulate as sim

    blocks = {k for r in reqs for k in r.block_ids}
    cap = len(blocks) * BS // 3  # a replica holds a third of the working set; the fleet of 4, all
    kw = dict(block_size=BS, tokens_per_s=1500.0, decode_tokens_per_s=50.0)
    px = replay_fleet(reqs, 4, cap, "prefix", "lru", **kw)
    rr = replay_fleet(reqs, 4, cap, "round_robin", "lru", **kw)
    ll = replay_fleet(reqs, 4, cap, "least_loaded", "lru", **kw)
    one = sim.replay(reqs, 4 * cap, "lru", BS).block_hit_ratio
    # the fleet acts as one cache: documents 1.0x, chats on one system prompt 0.996x (0.79x before
    # new prompts were placed by the pools' fill: they followed the prompt to its two holders)
    assert px.block_hit_ratio >= 0.95 * one
    assert px.block_hit_ratio >= 1.5 * max(rr.block_hit_ratio, ll.block_hit_ratio)
    assert px.ttft()["mean"] < min(rr.ttft()["mean"], ll.ttft()["mean"])


def test_the_branch_map_tells_a_private_path_from_a_shared_prefix():
    rng = random.Random(7)
    a, b, c, d, e = (HASHER.keys(toks(rng, 1))[0] for _ in range(5))
    m = BranchMap(600.0, 1000)
    m.add([a, b, c], 0.0)
    assert m.private_from([a, b, c, e], 0, 3, 0.0) == 0  # one path so far: all of it private
    m.add([a, b, d], 0.0)  # a second continuation of a, b
    assert m.is_branch(b, c, 0.0) and not m.is_branch(a, b, 0.0)
    assert m.private_from([a, b, c, e], 0, 3, 0.0) == 2  # past the branch point b: c alone
    assert m.private_from([a, b], 0, 2, 0.0) == 2  # a prompt ending at the branch: nothing private
    assert m.private_from([a, b, c], 0, 3, 601.0) == 0  # forgotten: a path again


def test_a_conversation_keeps_its_replica_where_a_shared_prefix_would_be_copied():
    """The same holder, queue and prefix: a conversation's own history (a private path) stays,
    since moving strands the holder's copy; a prefix two continuations read moves to the idle
    replica and is replicated there."""
    rng = random.Random(8)
    doc = toks(rng, 30)
    turn = doc + toks(rng, 1)  # 496 tokens on r0: 0.5 s of prefill saved there
    picks = {}
    for shared in (False, True):
        r = router(2)
        hold(r, "r0", turn)
        r.branches.add(HASHER.keys(turn), 0.0)  # the previous turn was routed
        if shared:  # and another question on the same document
            r.branches.add(HASHER.keys(doc + toks(rng, 1)), 0.0)
        r.report("r0", prefill_tokens=700)  # 0.7 s queued: more than it saves, less than saved + stranded
        d = r.route_tokens(turn + toks(rng, 2))
        picks[shared] = (d.replica, d.reason)
    assert picks == {False: ("r0", "prefix"), True: ("r1", "overloaded")}


def test_new_prompts_fill_the_pools_at_the_same_pace():
    """A quiet fleet (each prompt computed before the next arrives), one short system prompt on
    r0 only, new conversations: with the pools' sizes reported they spread by fill from the first
    one; without them they follow the prompt to r0 until its empty blocks run out (and its pool
    then holds every conversation's later turns). A pool twice as large takes the largest share."""
    rng = random.Random(9)
    system = toks(rng, 2)
    convs = [system + toks(rng, 8) for _ in range(30)]

    def run(pools: list[int], report_pools: bool) -> list[str]:
        r = router(len(pools))
        empty = {name: n - (2 if name == "r0" else 0) for name, n in zip(r.replicas, pools)}
        hold(r, "r0", system)
        picks = []
        for c in convs:
            for name, n in zip(r.replicas, pools):
                r.report(name, 0, 0, empty_blocks=empty[name], pool_blocks=n if report_pools else None)
            d = r.route_tokens(c + [7])
            empty[d.replica] -= d.prefill_tokens // BS
            picks.append(d.replica)
            r.t[0] += 1.0
        if report_pools:  # the view: reported fill plus the decision made since
            assert {n: (v["filled_blocks"], v["pool_blocks"]) for n, v in r.view().items()} == {
                n: (p - empty[n], p) for n, p in zip(r.replicas, pools)}
        return picks

    blind = run([100] * 3, False)
    assert blind[:10] == ["r0"] * 10  # 98 empty blocks: ten conversations follow the prompt
    even = Counter(run([100] * 3, True))
    assert max(even.values()) - min(even.values()) <= 2
    big = Counter(run([100, 200, 100], True))
    view = Router(["a"], BS, RouterConfig(), HASHER).view()["a"]
    assert view["filled_blocks"] is None and view["pool_blocks"] is None  # not reported: no term
    assert big["r1"] >= 14 and big["r1"] > max(big["r0"], big["r2"]) + 4


def test_a_prefix_in_a_shared_tier_is_everyones_and_spreads_by_work():
    """A hot system prompt its holder wrote to a shared (Redis) tier: every replica can load it at
    tier_weight of a prefill, so a burst of new sessions spreads by work, where without the tier
    the holder takes the larger share (the others would compute the prompt)."""
    rng = random.Random(10)
    system = toks(rng, 60)  # 960 tokens
    n = len(system)
    shares = {}
    for tier in (False, True):
        r = router(3)
        hold(r, "r0", system)
        if tier:
            r.apply_events("r0", [ARRAY.BlockStored(HASHER.keys(system), None, system, BS, None,
                                                    "REDIS", None)])
        assert r.index.runs(HASHER.keys(system), r.replicas)["r1"] == ((0, 60) if tier else (0, 0))
        picks = Counter(r.route_tokens(system + toks(rng, 4)).replica for _ in range(30))
        shares[tier] = picks["r0"]
    assert shares[True] < shares[False] and shares[True] <= 14


def test_a_busy_fleet_copies_a_shared_prefix_whose_one_holder_every_request_queues_on():
    """Chat sessions on one system prompt only r0 holds, arriving a little faster than one replica
    serves them (each replica reports the work it has left): the fleet is busy, its utilization
    high, so a second of prefill is worth many; but a replica the router is not sending to delays
    nobody with a prefill. r1 copies the prompt and the sessions spread. (A weight derived from the
    fleet's traffic alone priced r1's copy at the fleet's queue and sent every session to r0.)"""
    rng = random.Random(9)
    system = toks(rng, 40)  # 0.64 s of prefill saved on its holder
    r = router(2)
    hold(r, "r0", system)
    left = {"r0": 0.0, "r1": 0.0}  # seconds of work each replica has
    picks = []
    for _ in range(40):  # one every 0.2 s, each decoding 5 tokens (0.25 s of work)
        r.t[0] += 0.2
        for name in left:
            left[name] = max(0.0, left[name] - 0.2)
            r.report(name, 0, left[name] / 0.05)
        d = r.route_tokens(system + toks(rng, 4), decode_tokens=5)
        left[d.replica] += d.prefill_tokens / 1000.0 + 0.25
        picks.append(d.replica)
    assert "r1" in picks[:15]
    assert Counter(picks)["r1"] >= 12  # then both holders share the sessions by work


def test_a_burst_at_one_instant_after_busy_traffic_spreads():
    """24 sessions within 10 ms on a prompt one replica holds, after a minute of traffic to it:
    the arrival rate measured over a burst is enormous, yet the other replica's queue is empty."""
    rng = random.Random(10)
    system = toks(rng, 40)
    r = router(2)
    hold(r, "r0", system)
    for _ in range(10):
        r.t[0] += 6.0
        r.finished(r.route_tokens(system + toks(rng, 4), decode_tokens=20))
    picks = []
    for _ in range(24):
        r.t[0] += 0.0004
        picks.append(r.route_tokens(system + toks(rng, 4), decode_tokens=20).replica)
    assert min(Counter(picks).values()) >= 8


def test_a_report_keeps_counting_the_requests_still_on_their_way():
    """Requests the front end numbered (``fleet_seq``) and the router sent to r0 reach its
    scheduler some time later (Ray Serve's queue, the replica's own tokenization). A report
    sampled meanwhile names the numbers its scheduler holds: the ones it does not name stay
    counted, so a burst does not land on the replica whose report went out first. A report
    that names none (no fleet clock) counts everything routed before it, as before."""
    rng = random.Random(12)
    r = router(2)
    sent = [r.route_tokens(toks(rng, 8), tag=seq) for seq in (1, 2, 3)]
    assert [d.replica for d in sent].count("r0") >= 1
    on_r0 = [d for d in sent if d.replica == "r0"]
    per_request = r.work_s("r0") / len(on_r0)
    r.t[0] += 0.01
    held = on_r0[0].pending.tag
    r.report("r0", 8 * BS, 0, fleet_seqs=[held])  # only the first has arrived
    assert r.work_s("r0") == pytest.approx(len(on_r0) * per_request)  # the others still count
    r.report("r0", 8 * BS * len(on_r0), 0, fleet_seqs=[d.pending.tag for d in on_r0])
    assert r.work_s("r0") == pytest.approx(len(on_r0) * per_request)  # each counted once
    r.route_tokens(toks(rng, 8))  # an unnumbered request: the time rule
    late = r.route_tokens(toks(rng, 8), tag=4)
    r.t[0] += 0.01
    for name in r.replicas:  # r0's earlier report named its numbered ones: its tokens hold them
        r.report(name, 0, 0, fleet_seqs=[])
    expected = {name: 0.0 for name in r.replicas}  # left: number 4, and those r1 never named
    for d in [x for x in sent if x.replica == "r1"] + [late]:
        expected[d.replica] += per_request
    for name in r.replicas:
        assert r.work_s(name) == pytest.approx(expected[name])
    for d in sent + [late]:  # until they end
        r.finished(d)
    assert r.work_s("r0") == 0.0 and r.work_s("r1") == 0.0


def test_a_holder_filled_ahead_of_its_share_keeps_its_conversation():
    """Fill balance prices the blocks a write adds, not the lead earlier writes made: r0 is 64
    blocks past its share of two mostly empty pools (each conversation it holds grew there), yet
    the next turn of a 21-block conversation it holds adds one block there and stays; a new prompt
    of the same size goes to the emptier pool."""
    rng = random.Random(11)
    conv = toks(rng, 21) + toks(rng, 1)[:5]
    r = router(2)
    hold(r, "r0", conv)
    r.branches.add(HASHER.keys(conv), 0.0)  # the previous turn was routed
    for name, filled in (("r0", 148), ("r1", 20)):
        r.report(name, 0, 0, empty_blocks=512 - filled, pool_blocks=512)
    d = r.route_tokens(conv + toks(rng, 1))
    assert (d.replica, d.reason, d.hit_blocks) == ("r0", "prefix", 21)
    assert r.eviction_s("r0", 16) == pytest.approx(16 / 1000.0)  # one block, at r0's rate
    fresh = r.route_tokens(toks(rng, 22) + [7])
    assert (fresh.replica, fresh.reason) == ("r1", "least_loaded")
