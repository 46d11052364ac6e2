"""The routing core (hotprefix.router) over replicas that are real cache managers publishing real
KV events: a conversation's turns follow its prefix, overload beats affinity, the router's memory
of its own decisions gives affinity with events off, prompt_cache_key sticks, misses go to the
least work and spread between reports, tier blocks are cheaper than a prefill, keys match the replicas' (tenant salt included),
a replica that leaves or resets is forgotten, and the ZeroMQ feed keeps the index current."""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest

from hotprefix.cache.block_pool import BlockPool
from hotprefix.cache.hashing import BlockHasher, namespace_key
from hotprefix.cache.manager import CacheRequest, KVCacheManager
from hotprefix.events.publisher import ZmqEventPublisher
from hotprefix.events.recorder import PoolEventRecorder
from hotprefix.events.schema import ARRAY
from hotprefix.router import Router, RouterConfig
from hotprefix.router.feed import EventFeed

BS = 16
NS = namespace_key("model-fp", "tokenizer-fp")


class Replica:
    """One replica's cache: the engine's manager and pool, with the events recorder."""

    def __init__(self, name: str, num_blocks: int = 512, tier_media=()):
        self.name = name
        self.pool = BlockPool(num_blocks, BS, "lru")
        self.mgr = KVCacheManager(self.pool, BlockHasher(NS, BS))
        self.rec = PoolEventRecorder(self.pool, tier_media)
        self.served = 0

    def serve(self, toks: list[int], salt: str | None = None) -> int:
        r = CacheRequest(f"{self.name}-{self.served}", list(toks), len(toks), salt=salt)
        self.served += 1
        hits = self.mgr.lookup(r)
        assert self.mgr.allocate(r, len(toks) - BS * len(hits), BS * len(hits), hits)
        self.mgr.commit(r, len(toks))
        self.mgr.free(r)
        return len(hits)


class Fleet:
    def __init__(self, n: int = 4, config: RouterConfig | None = None, events: bool = True, **kw):
        self.replicas = {f"r{i}": Replica(f"r{i}", **kw) for i in range(n)}
        self.t = 0.0
        self.router = Router(list(self.replicas), BS, config, BlockHasher(NS, BS), clock=lambda: self.t)
        self.events = events
        self.sync()

    def sync(self) -> None:
        for name, rep in self.replicas.items():
            evs = rep.rec.drain()
            if self.events:
                self.router.apply_events(name, evs)

    def send(self, toks, key=None, salt=None, finish=True):
        d = self.router.route_tokens(toks, salt=salt, prompt_cache_key=key)
        hits = self.replicas[d.replica].serve(toks, salt)
        self.sync()
        if finish:
            self.router.finished(d)
        return d, hits


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 50000) for _ in range(n)]


def conversations(n: int, turns: int, seed: int = 0, system: int = 2 * BS):
    """Turn prompts of ``n`` conversations sharing a system prompt, interleaved turn by turn."""
    rng = random.Random(seed)
    sys_prompt = rand_tokens(rng, system)
    convs = [sys_prompt + rand_tokens(rng, rng.randrange(2 * BS, 6 * BS)) for _ in range(n)]
    order = []
    for t in range(turns):
        for c in range(n):
            if t:
                convs[c] = convs[c] + rand_tokens(rng, rng.randrange(BS, 3 * BS))
            order.append((c, t, list(convs[c])))
    return order


def play_rounds(fleet: Fleet, order) -> dict[int, str]:
    """Send conversation turns; the requests of one round are in flight together. Every later turn
    must go to its conversation's replica and hit exactly the previous turn's full blocks.
    Returns conversation -> replica."""
    home: dict[int, str] = {}
    prev_len: dict[int, int] = {}
    in_flight = []
    for c, t, toks in order:
        if c == 0:  # a new round: the previous one's requests have ended
            for d in in_flight:
                fleet.router.finished(d)
            in_flight = []
        d, hits = fleet.send(toks, finish=False)
        in_flight.append(d)
        if t == 0:
            home[c] = d.replica
        else:
            assert d.replica == home[c] and d.reason == "prefix"
            assert hits == d.hit_blocks == prev_len[c] // BS  # the previous turn's full blocks
        prev_len[c] = len(toks)
    return home


def test_a_conversations_turns_go_to_the_replica_holding_its_prefix():
    home = play_rounds(Fleet(4), conversations(8, 3))
    # first turns share only the system prompt: its holder's growing load sends the rest elsewhere
    assert len(set(home.values())) >= 3 and max(Counter(home.values()).values()) <= 4


def test_with_one_replica_overloaded_new_misses_and_its_prefixes_go_elsewhere():
    fleet = Fleet(4, num_blocks=4096)
    rng = random.Random(1)
    doc = rand_tokens(rng, 2000 * BS)  # worth more than the holder's load: only overload moves it
    d0, _ = fleet.send(doc)
    holder = d0.replica
    fleet.router.set_load(holder, 120_000)  # > 1.5 x mean + 65536, < w x the doc's tokens
    picks = Counter(fleet.send(rand_tokens(rng, 4 * BS))[0].replica for _ in range(40))
    assert holder not in picks and len(picks) == 3
    d, _ = fleet.send(doc + rand_tokens(rng, BS))
    assert d.replica != holder and d.reason == "overloaded"
    diverted = d.replica  # it computed the doc too
    fleet.router.set_load(holder, 0)
    for r in fleet.replicas:
        fleet.router.set_load(r, 0)
    d, hits = fleet.send(doc + rand_tokens(rng, 2 * BS))
    assert d.replica in (holder, diverted) and hits == 2000


def test_below_the_threshold_affinity_wins_over_a_small_load_difference():
    fleet = Fleet(2)
    rng = random.Random(2)
    doc = rand_tokens(rng, 40 * BS)
    holder = fleet.send(doc)[0].replica
    fleet.router.set_load(holder, 300)  # some queued work, far below the slack
    d, hits = fleet.send(doc + rand_tokens(rng, BS))
    assert d.replica == holder and hits == 40


def test_with_events_off_the_routers_own_decisions_give_affinity():
    cfg = RouterConfig(decision_ttl_s=60.0)
    fleet = Fleet(4, cfg, events=False)
    home = play_rounds(fleet, conversations(6, 3, seed=3))  # all share a system prompt
    assert len(set(home.values())) >= 2
    assert fleet.router.index.blocks == {}  # no event ever reached it
    fleet.t += 61.0  # the memory has expired: a new turn is a miss for the router
    c, _, toks = conversations(6, 4, seed=3)[-1]
    d = fleet.router.route_tokens(toks + [1] * BS)
    assert d.reason == "least_loaded" and d.hit_blocks == 0


def test_prompt_cache_key_gives_affinity_while_its_replica_is_not_overloaded():
    fleet = Fleet(4)
    rng = random.Random(4)
    first = fleet.send(rand_tokens(rng, 3 * BS), key="user-42")[0].replica
    for _ in range(10):  # unrelated prompts, same key
        d, _ = fleet.send(rand_tokens(rng, 3 * BS), key="user-42")
        assert d.replica == first and d.reason == "prompt_cache_key"
    others = Counter(fleet.send(rand_tokens(rng, 3 * BS), key=f"k{i}")[0].replica for i in range(30))
    assert len(others) >= 3
    fleet.router.set_load(first, 10**6)
    d, _ = fleet.send(rand_tokens(rng, 3 * BS), key="user-42")
    assert d.replica != first


def test_misses_go_to_the_least_work_and_spread_between_reports():
    fleet = Fleet(4)
    rng = random.Random(5)
    picks = Counter(fleet.send(rand_tokens(rng, 3 * BS))[0].replica for _ in range(200))
    assert len(picks) == 4 and max(picks.values()) < 100  # ties are drawn: never every miss to one
    for r, x in {"r0": 0, "r1": 1000, "r2": 2000, "r3": 3000}.items():
        fleet.router.set_load(r, x)
    # 200 misses before the next report: each is counted at once, so they fill the gaps
    picks = Counter(fleet.send(rand_tokens(rng, 3 * BS), finish=False)[0].replica for _ in range(200))
    assert picks["r0"] > picks["r1"] > picks["r2"] > picks["r3"] > 0
    works = [fleet.router.work_s(r) for r in fleet.router.replicas]
    assert max(works) - min(works) <= (3 * BS) / RouterConfig.default_prefill_tok_s + 1e-9


def test_tier_blocks_are_cheaper_than_a_prefill_and_a_shared_tier_serves_everyone():
    router = Router(["a", "b", "c"], BS, hasher=BlockHasher(NS, BS))
    rng = random.Random(6)
    toks = rand_tokens(rng, 10 * BS + 1)
    keys = BlockHasher(NS, BS).keys(toks[:10 * BS])
    t = ARRAY
    router.apply_events("a", [t.BlockStored(keys[:4], None, toks[:4 * BS], BS, None, "GPU", None)])
    router.apply_events("b", [t.BlockStored(keys, None, toks[:10 * BS], BS, None, "REDIS", None)])
    runs = router.index.runs(keys, router.replicas)
    assert runs == {"a": (4, 6), "b": (0, 10), "c": (0, 10)}  # the shared tier is everyone's
    d = router.route_tokens(toks)
    assert d.replica == "a" and (d.hit_blocks, d.tier_blocks) == (4, 6)
    cfg = RouterConfig()  # an idle fleet: the cost is the time to first token, at the default rate
    assert d.prefill_tokens == 1
    assert d.cost == pytest.approx((1 + cfg.tier_weight * 6 * BS) / cfg.default_prefill_tok_s)
    router2 = Router(["a", "b"], BS, hasher=BlockHasher(NS, BS))
    router2.apply_events("b", [t.BlockStored(keys, None, toks[:10 * BS], BS, None, "DISK", None)])
    assert router2.index.runs(keys, ["a", "b"]) == {"a": (0, 0), "b": (0, 10)}  # a local tier is not
    assert router2.route_tokens(toks).replica == "b"


def test_keys_are_the_replicas_own_tenant_salt_included():
    fleet = Fleet(3)
    rng = random.Random(7)
    doc = rand_tokens(rng, 6 * BS)
    holder = fleet.send(doc, salt="tenant-a")[0].replica
    d = fleet.router.route_tokens(doc + [3] * BS, salt="tenant-a")
    assert d.replica == holder and d.hit_blocks == 6
    d = fleet.router.route_tokens(doc + [3] * BS, salt="tenant-b")
    assert d.hit_blocks == 0 and d.reason == "least_loaded"


def test_a_replica_that_leaves_or_resets_is_forgotten():
    fleet = Fleet(3)
    rng = random.Random(8)
    doc = rand_tokens(rng, 6 * BS)
    holder = fleet.send(doc)[0].replica
    fleet.replicas[holder].pool.reset()
    fleet.sync()  # AllBlocksCleared
    assert fleet.router.index.num_blocks.get(holder, 0) == 0
    holder = fleet.send(doc)[0].replica
    fleet.router.remove_replica(holder)
    assert holder not in fleet.router.replicas and fleet.router.index.num_blocks.get(holder) is None
    for _ in range(20):
        assert fleet.router.route_tokens(doc + [5] * BS).replica != holder


def test_eviction_events_move_the_prefix_away():
    fleet = Fleet(2, num_blocks=16)
    rng = random.Random(9)
    doc = rand_tokens(rng, 6 * BS)
    holder = fleet.send(doc)[0].replica
    fleet.replicas[holder].serve(rand_tokens(rng, 15 * BS))  # evicts the doc behind the router's back
    fleet.sync()
    keys = fleet.router.hasher.keys(doc)
    runs = fleet.router.index.runs(keys, fleet.router.replicas)
    pool = fleet.replicas[holder].pool
    left = next(i for i, k in enumerate(keys) if k not in pool.index)
    assert left < 6 and runs[holder] == (left, 0)  # exactly what the pool still holds


def test_the_event_feed_follows_replicas_over_zeromq():
    reps = {n: Replica(n) for n in ("r0", "r1")}
    pubs = {n: ZmqEventPublisher(r.rec, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
            for n, r in reps.items()}
    router = Router(list(reps), BS, hasher=BlockHasher(NS, BS))
    feed = EventFeed(router)
    try:
        for n, p in pubs.items():
            feed.connect(n, p.endpoint, p.replay_endpoint)
        time.sleep(0.3)
        rng = random.Random(10)
        docs = [rand_tokens(rng, 5 * BS) for _ in range(4)]
        for i, doc in enumerate(docs):
            reps[f"r{i % 2}"].serve(doc)
        for p in pubs.values():
            assert p.flush()
        keys = [router.hasher.keys(doc) for doc in docs]

        def indexed() -> bool:  # every doc's five blocks are known on the replica that served it
            return all(router.index.runs(k, router.replicas)[f"r{i % 2}"][0] == 5
                       for i, k in enumerate(keys))

        deadline = time.monotonic() + 10  # a SUB socket joins late; the replay socket fills the gap
        while not indexed() and time.monotonic() < deadline:
            feed.poll(0.1)
        assert feed.num_batches >= 2
        for i, doc in enumerate(docs):
            d = router.route_tokens(doc + [7] * BS)
            assert d.replica == f"r{i % 2}" and d.hit_blocks == 5
    finally:
        feed.close()
        for p in pubs.values():
            p.close()


def test_config_is_checked():
    with pytest.raises(ValueError):
        RouterConfig(policy="smallest_tree")
    with pytest.raises(ValueError):
        RouterConfig(default_prefill_tok_s=0)
    with pytest.raises(RuntimeError):
        Router([], BS).route([], 10)


def test_a_burst_on_one_system_prompt_spreads_and_conversations_keep_their_replica():
    fleet = Fleet(4)
    rng = random.Random(11)
    system = rand_tokens(rng, 4 * BS)
    burst = [fleet.send(system + rand_tokens(rng, 3 * BS), finish=False)[0] for _ in range(30)]
    assert len({d.replica for d in burst}) == 4  # one holder does not take them all
    for d in burst:
        fleet.router.finished(d)
    # a conversation that goes on past the system prompt still finds its replica
    turn = system + rand_tokens(rng, 3 * BS)
    home = fleet.send(turn)[0].replica
    d, hits = fleet.send(turn + rand_tokens(rng, 2 * BS))
    assert d.replica == home and d.reason == "prefix" and hits == 7
