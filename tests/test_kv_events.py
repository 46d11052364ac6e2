"""KV events (hotprefix.events): the stream of a real engine run rebuilds exactly the pool's
cached blocks (stores, evictions, tier moves, a reset with blocks in use); a subscriber that missed
batches recovers them from the replay socket; structs of vLLM's own shapes decode every message."""

# No ``from __future__ import annotations``: the local vLLM structs below need real annotations.
import random
import time
from typing import Any

import msgspec
import pytest
import zmq

from hotprefix import LLM
from hotprefix.cache.block_pool import BlockPool
from hotprefix.cache.hashing import BlockHasher, namespace_key
from hotprefix.cache.manager import CacheRequest, KVCacheManager
from hotprefix.config.sections import ConfigError
from hotprefix.events.publisher import ZmqEventPublisher, replay_endpoint_for
from hotprefix.events.recorder import PoolEventRecorder
from hotprefix.events.subscriber import EventSubscriber
from hotprefix.request.sampling import SamplingParams

BS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
ANY_PORT = "tcp://127.0.0.1:*"


class View:
    """What a subscriber knows: (block hash, medium) pairs, and each block's tokens."""

    def __init__(self) -> None:
        self.held: set[tuple[bytes, str]] = set()
        self.tokens: dict[bytes, tuple[int, ...]] = {}
        self.parents: dict[bytes, bytes | None] = {}

    def apply(self, batch: Any) -> None:
        for ev in batch.events:
            name = type(ev).__name__
            if name == "AllBlocksCleared":
                self.held.clear()
            elif name == "BlockStored":
                parent = ev.parent_block_hash
                for i, h in enumerate(ev.block_hashes):
                    self.held.add((h, ev.medium))
                    self.tokens[h] = tuple(ev.token_ids[i * ev.block_size:(i + 1) * ev.block_size])
                    self.parents[h] = parent
                    parent = h
            else:
                self.held.difference_update((h, ev.medium) for h in ev.block_hashes)

    def medium(self, medium: str) -> set[bytes]:
        return {h for h, m in self.held if m == medium}


def drain(llm: LLM, sub: EventSubscriber, view: View) -> None:
    assert llm.engine.kv_events.flush()
    pub = llm.engine.kv_events
    deadline = time.monotonic() + 5
    while sub.next_seq != pub.next_seq and time.monotonic() < deadline:
        for _, batch in sub.poll(0.2):
            assert batch is not None
            view.apply(batch)
    assert sub.next_seq == pub.next_seq


def subscribe(llm: LLM, fmt: str = "array") -> EventSubscriber:
    pub = llm.engine.kv_events
    return EventSubscriber(pub.endpoint, pub.replay_endpoint, fmt=fmt)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Conversations that share a 2-block system prefix, some with a second turn."""
    rng = random.Random(seed)
    system = [rng.randrange(100, 30000) for _ in range(2 * BS)]
    out = []
    for i in range(n):
        turn = system + [rng.randrange(100, 30000) for _ in range(rng.randrange(BS, 4 * BS))]
        out.append(turn)
        if i % 2:
            out.append(turn + [rng.randrange(100, 30000) for _ in range(2 * BS)])
    return out


def pool_blocks(llm: LLM) -> dict[bytes, tuple[int, ...]]:
    return {k: b.token_ids for k, b in llm.engine.cache.pool.index.items()}


def test_the_stream_rebuilds_the_pool_through_stores_evictions_and_a_reset(tiny_model_dir):
    llm = LLM(tiny_model_dir, num_blocks=24, num_threads=2, kv_events=ANY_PORT)
    sub, view = subscribe(llm), View()
    try:
        for p in prompts(10):
            llm.generate([p], GREEDY)
        pool = llm.engine.cache.pool
        assert pool.num_evictions > 0
        drain(llm, sub, view)
        assert view.medium("GPU") == set(pool_blocks(llm)) and len(view.held) == pool.num_cached
        for k, toks in pool_blocks(llm).items():  # tokens and chain as the pool has them
            assert view.tokens[k] == toks
            blk = pool.index[k]
            assert view.parents[k] == (None if blk.depth == 0 else blk.parent)

        # a reset while a request holds blocks: AllBlocksCleared, then the kept blocks again
        eng = llm.engine
        eng.add_request(prompts(1, seed=9)[0], GREEDY, request_id="held")
        eng.step()
        kept = pool_blocks(llm)
        llm.reset_prefix_cache()
        assert 0 < pool.num_cached <= len(kept)
        drain(llm, sub, view)
        assert view.medium("GPU") == set(pool_blocks(llm))
        while eng.has_unfinished():
            eng.step()
        llm.reset_prefix_cache()
        drain(llm, sub, view)
        assert view.held == set() and pool.num_cached == 0
    finally:
        sub.close()
        llm.close()


def test_evicted_blocks_are_reported_in_the_tier_medium(tiny_model_dir, tmp_path):
    llm = LLM(tiny_model_dir, num_blocks=24, num_threads=2, kv_events=ANY_PORT,
              kv_store=[f"disk:{tmp_path}"])
    sub, view = subscribe(llm), View()
    ever: set[bytes] = set()

    class Stored:
        def on_stored(self, block):
            ever.add(block.key)

        def on_removed(self, block):
            pass

        def on_cleared(self):
            pass

    pool = llm.engine.cache.pool
    pool.listeners.append(Stored())
    try:
        for p in prompts(10, seed=3):
            llm.generate([p], GREEDY)
        assert pool.num_evictions > 0
        drain(llm, sub, view)
        cached = set(pool_blocks(llm))
        assert view.medium("GPU") == cached
        # write-through: every block the pool evicted is still in the disk tier
        assert view.medium("DISK") == ever - cached
        assert {m for _, m in view.held} == {"GPU", "DISK"}
    finally:
        sub.close()
        llm.close()


def _request(mgr: KVCacheManager, rid: str, toks: list[int]) -> None:
    r = CacheRequest(rid, list(toks), len(toks))
    hits = mgr.lookup(r)
    assert mgr.allocate(r, len(toks) - BS * len(hits), BS * len(hits), hits)
    mgr.commit(r, len(toks))
    mgr.free(r)


def _bare(num_blocks: int = 64, **kw):
    pool = BlockPool(num_blocks, BS, "lru")
    mgr = KVCacheManager(pool, BlockHasher(namespace_key("m", "t"), BS))
    pub = ZmqEventPublisher(PoolEventRecorder(pool), ANY_PORT, ANY_PORT, **kw)
    return pool, mgr, pub


def _poll_until(sub: EventSubscriber, seq: int) -> list:
    got: list = []
    deadline = time.monotonic() + 5
    while (sub.next_seq is None or sub.next_seq < seq) and time.monotonic() < deadline:
        got += sub.poll(0.2)
    return got


def test_a_request_stores_one_chain_in_one_event():
    pool = BlockPool(64, BS, "lru")
    mgr = KVCacheManager(pool, BlockHasher(namespace_key("m", "t"), BS))
    rec = PoolEventRecorder(pool)
    assert [type(e).__name__ for e in rec.drain()] == ["AllBlocksCleared"]  # at start
    _request(mgr, "a", list(range(3 * BS + 5)))
    (ev,) = rec.drain()
    keys = mgr.hasher.keys(list(range(3 * BS)))
    assert ev.block_hashes == keys and ev.parent_block_hash is None
    assert ev.token_ids == list(range(3 * BS)) and ev.block_size == BS and ev.medium == "GPU"
    _request(mgr, "b", list(range(3 * BS)) + [7] * (2 * BS))  # continues the cached chain
    (ev,) = rec.drain()
    assert ev.parent_block_hash == keys[-1] and len(ev.block_hashes) == 2


def test_a_subscriber_that_missed_batches_recovers_them_from_the_replay_socket():
    pool, mgr, pub = _bare()
    sub = None
    try:
        for i in range(3):  # published before anyone listens: lost on the PUB socket
            _request(mgr, f"early{i}", [i + 1] * (2 * BS))
            assert pub.flush()
        sub = EventSubscriber(pub.endpoint, pub.replay_endpoint)
        time.sleep(0.3)  # the SUB connection is set up
        _request(mgr, "late", [9] * (2 * BS))
        assert pub.flush()
        got = _poll_until(sub, pub.next_seq)
        assert [s for s, _ in got] == list(range(pub.next_seq))
        assert sub.num_replayed >= 3 and sub.num_lost == 0
        view = View()
        for _, b in got:
            view.apply(b)
        assert view.medium("GPU") == set(pool.index)

        # a gap in the middle of the stream: unsubscribe, miss two batches, come back
        sub._sub.setsockopt(zmq.UNSUBSCRIBE, b"")
        time.sleep(0.2)
        for i in range(2):
            _request(mgr, f"missed{i}", [20 + i] * (3 * BS))
            assert pub.flush()
        sub._sub.setsockopt(zmq.SUBSCRIBE, b"")
        time.sleep(0.2)
        _request(mgr, "after", [30] * (2 * BS))
        assert pub.flush()
        more = _poll_until(sub, pub.next_seq)
        assert [s for s, _ in more] == list(range(got[-1][0] + 1, pub.next_seq))
        for _, b in more:
            view.apply(b)
        assert view.medium("GPU") == set(pool.index) and sub.num_lost == 0
    finally:
        if sub is not None:
            sub.close()
        pub.close()


def test_a_subscriber_that_missed_the_tail_gets_it_without_waiting_for_a_later_batch():
    pool, mgr, pub = _bare()
    sub = None
    try:
        for i in range(3):  # all published before the subscriber exists; nothing after it
            _request(mgr, f"r{i}", [i + 1] * (2 * BS))
            assert pub.flush()
        sub = EventSubscriber(pub.endpoint, pub.replay_endpoint)
        got = _poll_until(sub, pub.next_seq)
        assert [s for s, _ in got] == list(range(pub.next_seq)) and all(b is not None for _, b in got)
        assert sub.num_lost == 0 and sub.num_replayed == pub.next_seq
        view = View()
        for _, b in got:
            view.apply(b)
        assert view.medium("GPU") == set(pool.index) and len(pool.index) == 6
        assert sub.poll(0.0) == []  # nothing new: nothing returned twice
    finally:
        if sub is not None:
            sub.close()
        pub.close()


def test_batches_gone_from_the_replay_buffer_are_reported_lost():
    pool, mgr, pub = _bare(buffer_batches=2)
    sub = None
    try:
        for i in range(5):
            _request(mgr, f"r{i}", [i + 1] * (2 * BS))
            assert pub.flush()
        sub = EventSubscriber(pub.endpoint, pub.replay_endpoint)
        time.sleep(0.3)
        _request(mgr, "last", [50] * (2 * BS))
        assert pub.flush()
        got = _poll_until(sub, pub.next_seq)
        lost = [s for s, b in got if b is None]
        assert lost == [0, 1, 2, 3] and sub.num_lost == 4  # the buffer kept seq 4 only
        assert [s for s, b in got if b is not None] == [4, 5]
    finally:
        if sub is not None:
            sub.close()
        pub.close()


# --------------------------------------------------------------------------- vLLM's own shapes
ExternalBlockHash = bytes | int


class OldEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class OldKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(OldKVCacheEvent):  # vLLM <= 0.23 (array_like events, with medium)
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(OldKVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None


class AllBlocksCleared(OldKVCacheEvent):
    pass


class OldKVEventBatch(OldEventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def vllm_types(array_like: bool = False):
    """vLLM main's event structs (vllm/distributed/kv_events.py), with the fields its hybrid KV
    cache manager added: maps by default, ``array_like`` as vLLM had them up to 0.23."""

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False,
                       tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[ExternalBlockHash]
        parent_block_hash: ExternalBlockHash | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[ExternalBlockHash]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return KVEventBatch


@pytest.mark.parametrize("fmt", ["array", "map"])
def test_vllm_event_types_decode_our_messages(tiny_model_dir, fmt):
    llm = LLM(tiny_model_dir, num_blocks=24, num_threads=2, kv_events=ANY_PORT, kv_events_format=fmt,
              kv_events_topic="kv-events")
    pub = llm.engine.kv_events
    ctx = zmq.Context()
    raw = ctx.socket(zmq.SUB)  # a plain vLLM-style subscriber: (topic, seq, payload)
    raw.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    raw.connect(pub.endpoint)
    vllm_type = OldKVEventBatch if fmt == "array" else vllm_types()
    dec = msgspec.msgpack.Decoder(vllm_type)
    try:
        deadline = time.monotonic() + 10  # until the SUB connection is live (ZeroMQ's slow joiner)
        while time.monotonic() < deadline:
            llm.reset_prefix_cache()  # publishes an AllBlocksCleared
            assert pub.flush()
            if raw.poll(200):
                break
        while raw.poll(200):  # the handshake's batches
            raw.recv_multipart()
        for p in prompts(8, seed=5):
            llm.generate([p], GREEDY)
        llm.reset_prefix_cache()
        assert pub.flush()
        kinds: set[str] = set()
        seqs = []
        while raw.poll(500):
            topic, seq, payload = raw.recv_multipart()
            assert topic == b"kv-events" and len(seq) == 8
            seqs.append(int.from_bytes(seq, "big"))
            batch = dec.decode(payload)
            assert isinstance(batch.ts, float)
            for ev in batch.events:
                kinds.add(type(ev).__name__)
                if type(ev).__name__ == "BlockStored":
                    assert len(ev.token_ids) == ev.block_size * len(ev.block_hashes)
                    assert all(isinstance(h, bytes) and len(h) == 32 for h in ev.block_hashes)
        assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
        assert seqs == list(range(seqs[0], pub.next_seq))
    finally:
        raw.close(linger=0)
        ctx.term()
        llm.close()


def test_config_of_the_events(tiny_model_dir):
    assert replay_endpoint_for("tcp://*:5557", None) == "tcp://*:5558"
    assert replay_endpoint_for("tcp://10.0.0.1:5557", "tcp://*:6000") == "tcp://*:6000"
    assert replay_endpoint_for("tcp://*:5557", "none") is None
    with pytest.raises(ValueError):
        replay_endpoint_for("ipc:///tmp/x", None)
    with pytest.raises(ConfigError, match="kv_events_format"):
        LLM(tiny_model_dir, num_blocks=24, kv_events=ANY_PORT, kv_events_format="json")
    busy = zmq.Context().socket(zmq.PUB)
    port = busy.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(ConfigError, match="cannot bind"):
            LLM(tiny_model_dir, num_blocks=24, kv_events=f"tcp://127.0.0.1:{port}")
    finally:
        busy.close(linger=0)
    assert LLM(tiny_model_dir, num_blocks=24).engine.kv_events is None
