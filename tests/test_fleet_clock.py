"""The fleet's eviction clock, live: the front end numbers the generation requests it routes
(``x-hotprefix-fleet-seq``, a client's header replaced), a fleet replica's server passes the number
to the engine as ``fleet_seq`` (a standalone server ignores it), and the policy's clock advances by
the fleet's requests (``KVCacheManager._ticks``).

No Ray cluster: the front end's app runs over a fake deployment handle, the replica's app is called
in-process (``fleet.asgi.call_asgi``), as a replica calls it.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from hotprefix.cache.block_pool import BlockPool
from hotprefix.cache.hashing import BlockHasher, namespace_key
from hotprefix.cache.manager import CacheRequest, KVCacheManager
from hotprefix.config.sections import ServerConfig
from hotprefix.fleet.asgi import call_asgi
from hotprefix.fleet.config import FleetConfig
from hotprefix.server.fleet_seq import FLEET_SEQ_HEADER, MAX_DIGITS, parse_fleet_seq
from server_support import tiny_config

BS = 4
COMPLETION = json.dumps({"prompt": "The harbor opens at seven.", "max_tokens": 2,
                         "temperature": 0}).encode()


# ---------------------------------------------------------------------- the front end
class FakeEngineHandle:
    """The ``EngineReplica`` deployment handle as ``Frontend._send`` uses it: every forwarded
    request is recorded and answered by ``answer`` (an ASGI app, or a plain 200)."""

    def __init__(self, answer: Any = None):
        self.sent: list[dict[str, Any]] = []
        self.answer = answer
        self.forward = self

    def options(self, **_: Any) -> "FakeEngineHandle":
        return self

    def remote(self, method: str, path: str, query: str, headers: list, body: bytes,
               hotprefix_route: Any = None) -> Any:
        self.sent.append({"method": method, "path": path, "headers": list(headers)})
        if self.answer is not None:
            return call_asgi(self.answer, method, path, query, headers, body)
        return self._ok()

    @staticmethod
    async def _ok() -> Any:
        yield 200, [("content-type", "application/json")]
        yield b"{}"


def frontend(handle: FakeEngineHandle, **fleet: Any) -> Any:
    pytest.importorskip("ray")
    from hotprefix.fleet.frontend import Frontend

    cls = next(c for c in Frontend.__mro__[1:] if c.__name__ == "Frontend")  # under serve.ingress
    return cls(handle, ServerConfig(), FleetConfig(router="round_robin", **fleet))


async def call(app: Any, method: str, path: str, headers: list, body: bytes = b"") -> tuple[int, bytes]:
    status, chunks = 0, []
    async for item in call_asgi(app, method, path, "", headers, body):
        if isinstance(item, tuple):
            status = item[0]
        else:
            chunks.append(item)
    return status, b"".join(chunks)


def seqs_sent(sent: dict[str, Any]) -> list[str]:
    return [v for k, v in sent["headers"] if k.lower() == FLEET_SEQ_HEADER]


def test_the_front_end_numbers_generation_requests_and_replaces_a_forged_number():
    handle = FakeEngineHandle()
    app = frontend(handle).__serve_build_asgi_app__()
    forged = [("content-type", "application/json"), (FLEET_SEQ_HEADER, "999999"),
              (FLEET_SEQ_HEADER.upper(), "5")]

    async def go() -> None:
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/completions"):
            assert (await call(app, "POST", path, forged, b"{}"))[0] == 200
        assert (await call(app, "GET", "/v1/models", forged))[0] == 200

    asyncio.run(go())
    posts, get = handle.sent[:4], handle.sent[4]
    numbers = [seqs_sent(s) for s in posts]
    assert all(len(n) == 1 for n in numbers), numbers  # one header each: the front end's
    values = [int(n[0]) for n in numbers]
    assert values == sorted(values) and len(set(values)) == len(values)
    assert values[-1] - values[0] == len(values) - 1  # one number per routed request
    assert "999999" not in sum(numbers, []) and "5" not in sum(numbers, [])
    assert seqs_sent(get) == []  # not a generation request: not numbered, the forged one removed


def test_without_the_fleet_clock_a_forged_number_is_still_removed():
    handle = FakeEngineHandle()
    app = frontend(handle, fleet_clock=False).__serve_build_asgi_app__()
    asyncio.run(call(app, "POST", "/v1/completions", [(FLEET_SEQ_HEADER, "12")], b"{}"))
    assert len(handle.sent) == 1 and seqs_sent(handle.sent[0]) == []


def test_the_front_ends_fan_out_drops_a_forged_number_too():
    from hotprefix.fleet.frontend import without_fleet_seq

    kept = without_fleet_seq([("authorization", "Bearer k"), (FLEET_SEQ_HEADER, "3"),
                              ("X-HotPrefix-Fleet-Seq", "4")])
    assert kept == [("authorization", "Bearer k")]


# ---------------------------------------------------------------------- parsing
@pytest.mark.parametrize("value", ["", "-1", "+3", " 7", "7 ", "1.0", "0x10", "١٢", "1_000",
                                   "9" * (MAX_DIGITS + 1), "abc"])
def test_a_malformed_number_is_none(value):
    assert parse_fleet_seq(value) is None


@pytest.mark.parametrize("value", ["0", "1", "42", "9" * MAX_DIGITS])
def test_a_well_formed_number_is_read(value):
    assert parse_fleet_seq(value) == int(value)


# ---------------------------------------------------------------------- the replica's server
class Server:
    """``create_app``'s app with the engine's ``add_request`` watched: the ``fleet_seq`` it got
    and each sequence's ``CacheRequest.fleet_seq``."""

    def __init__(self, model_dir: str, fleet_clock: bool):
        from hotprefix.server.app import create_app

        self.app = create_app(tiny_config(model_dir), ServerConfig(), fleet_clock=fleet_clock)
        self.state = self.app.state.hotprefix
        self.engine = self.state.engine
        self.got: list[tuple[Any, list[Any]]] = []
        add = self.engine.add_request

        def watched(*args: Any, **kw: Any) -> Any:
            req = add(*args, **kw)
            self.got.append((kw.get("fleet_seq"), [s.fleet_seq for s in self.engine.groups[req.request_id]]))
            return req
        self.engine.add_request = watched

    @property
    def clock(self) -> int:
        return self.engine.cache.pool.policy.now

    def body(self, data: bytes = COMPLETION) -> bytes:
        return json.dumps({"model": self.state.served_name, **json.loads(data)}).encode()

    def post(self, headers: list, body: bytes = COMPLETION, path: str = "/v1/completions") -> tuple[int, bytes]:
        return asyncio.run(call(self.app, "POST", path, [("content-type", "application/json"), *headers],
                                self.body(body)))


@pytest.fixture(scope="module")
def servers(tiny_model_dir):
    made = {"replica": Server(tiny_model_dir, True), "solo": Server(tiny_model_dir, False)}
    yield made
    for s in made.values():
        s.state.close()


def test_a_standalone_server_ignores_a_clients_number(servers):
    solo = servers["solo"]
    before = solo.clock
    status, body = solo.post([(FLEET_SEQ_HEADER, "1000")])
    assert status == 200, body
    assert solo.got[-1] == (None, [None])
    assert solo.clock - before == 1  # one tick: its own request, not the header's count


def test_a_fleet_replicas_server_passes_the_number_to_every_sequence(servers):
    rep = servers["replica"]
    status, _ = rep.post([(FLEET_SEQ_HEADER, "77")])
    assert status == 200 and rep.got[-1] == (77, [77])
    two = json.dumps({"prompt": "Two answers, please.", "max_tokens": 2, "n": 2}).encode()
    status, body = rep.post([(FLEET_SEQ_HEADER, "78")], two)
    assert status == 200 and len(json.loads(body)["choices"]) == 2
    assert rep.got[-1] == (78, [78, 78])
    chat = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).encode()
    assert rep.post([(FLEET_SEQ_HEADER, "79")], chat, "/v1/chat/completions")[0] == 200
    assert rep.got[-1] == (79, [79])
    msg = json.dumps({"max_tokens": 2,
                      "messages": [{"role": "user", "content": "Hi"}]}).encode()
    assert rep.post([(FLEET_SEQ_HEADER, "80")], msg, "/v1/messages")[0] == 200
    assert rep.got[-1] == (80, [80])


@pytest.mark.parametrize("value", ["-5", "12abc", "9" * (MAX_DIGITS + 1), "", "1e9"])
def test_a_malformed_number_is_ignored_without_error(servers, value):
    rep = servers["replica"]
    before = rep.clock
    status, body = rep.post([(FLEET_SEQ_HEADER, value)])
    assert status == 200, body
    assert rep.got[-1] == (None, [None])
    assert rep.clock - before == 1


def test_a_replica_behind_the_front_end_ages_by_the_fleets_requests(tiny_model_dir):
    """Front end -> a fresh replica's real app for every other request (the rest go to another
    replica): the replica's clock advances by the front end's count."""
    rep = Server(tiny_model_dir, True)
    try:
        run_through_front_end(rep)
    finally:
        rep.state.close()


def run_through_front_end(rep: Server) -> None:

    class TwoReplicas(FakeEngineHandle):
        def remote(self, method, path, query, headers, body, hotprefix_route=None):
            self.answer = rep.app if len(self.sent) % 2 == 0 else None
            return super().remote(method, path, query, headers, body, hotprefix_route)

    handle = TwoReplicas()
    app = frontend(handle).__serve_build_asgi_app__()
    forged = [("content-type", "application/json"), (FLEET_SEQ_HEADER, "123456789")]
    n_before = len(rep.got)
    clock0 = rep.clock

    async def go() -> None:
        for _ in range(6):
            assert (await call(app, "POST", "/v1/completions", forged, rep.body()))[0] == 200

    asyncio.run(go())
    mine = [g[0] for g in rep.got[n_before:]]
    sent = [int(seqs_sent(s)[0]) for s in handle.sent]
    assert mine == sent[0::2] and len(mine) == 3  # the replica got the front end's numbers
    # its first request: 1 tick; then the fleet's requests since its previous one
    expected = 1 + (mine[-1] - mine[0])
    assert rep.clock - clock0 == expected and expected > len(mine)


# ---------------------------------------------------------------------- the cache's clock
def manager() -> KVCacheManager:
    return KVCacheManager(BlockPool(64, BS, "freq"), BlockHasher(namespace_key("m", "t"), BS), True)


def admit(m: KVCacheManager, rid: str, tokens: list[int], fleet_seq: int | None) -> CacheRequest:
    r = CacheRequest(request_id=rid, token_ids=tokens, num_prompt_tokens=len(tokens),
                     fleet_seq=fleet_seq)
    hits = m.lookup(r)
    n_hit = len(hits) * BS
    assert m.allocate(r, len(tokens) - n_hit, n_hit, hits)
    m.commit(r, len(tokens))
    return r


def test_two_replicas_clocks_count_the_fleets_requests():
    fleet = [manager(), manager()]
    alone = [manager(), manager()]
    seen: list[list[int]] = [[], []]
    for seq in range(1, 11):  # round robin: odd numbers to replica 0, even to replica 1
        i = (seq - 1) % 2
        tokens = [seq % 7 + 1] * (2 * BS)
        fleet[i].free(admit(fleet[i], f"r{seq}", tokens, seq))
        alone[i].free(admit(alone[i], f"r{seq}", tokens, None))
        seen[i].append(seq)
    for i in range(2):
        assert fleet[i].pool.policy.now == 1 + seen[i][-1] - seen[i][0]  # the fleet's count
        assert alone[i].pool.policy.now == len(seen[i])  # one per own request
        assert fleet[i].pool.policy.now > alone[i].pool.policy.now


def test_a_fork_adds_no_tick_and_a_repeated_number_one():
    m = manager()
    parent = admit(m, "a", [1] * (2 * BS), 5)
    now = m.pool.policy.now
    child = CacheRequest(request_id="a#1", token_ids=[1] * (2 * BS), num_prompt_tokens=2 * BS,
                         fleet_seq=5)
    m.fork(parent, child, 2 * BS)  # an n > 1 request's other sequence: shares, no admission
    assert m.pool.policy.now == now
    m.free(child)
    m.free(parent)
    again = admit(m, "a", [1] * (2 * BS), 5)  # re-admitted (a preemption): not larger, 1 tick
    assert m.pool.policy.now == now + 1
    m.free(again)
    admit(m, "b", [2] * (2 * BS), 9)
    assert m.pool.policy.now == now + 1 + (9 - 5)


def test_a_restarted_front_end_counts_again_from_its_new_numbers():
    """The front end restarts and numbers from 1 again: the replica follows the new count at once
    (one tick for the first), instead of ticking once a request until it passes the old one."""
    m = manager()
    ticks = []
    for i, seq in enumerate((100, 104, 1, 3, 7)):
        before = m.pool.policy.now
        m.free(admit(m, f"r{i}", [i + 1] * (2 * BS), seq))
        ticks.append(m.pool.policy.now - before)
    assert ticks == [1, 4, 1, 2, 4]
