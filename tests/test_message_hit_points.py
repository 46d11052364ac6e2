"""Message ends as hit points of a hybrid pool (``server/message_ends.py``): the chat routes of
both APIs mark where the system prompt and the last turns end, the engine's request carries them,
and after every interior window block is evicted a new conversation with the same system prompt
still resumes at its end (without the marks it does not). A full-attention pool tokenizes
nothing more; another tenant sees nothing of them. A tiny random Gemma 3 (window 40) under the
real server."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from hotprefix.config.sections import ServerConfig
from hotprefix.server.message_ends import MAX_TURN_ENDS, cut_points
from server_support import LONG_SYSTEM, LiveServer, tiny_config, wait_idle
from model_support import save_random_model
from test_hybrid_engine import BS, GEMMA3, WINDOW
from test_window_groups import BS as CACHE_BS, evict_interior, hybrid, run

KEYS = os.path.join(os.path.dirname(__file__), "data", "server", "api_keys.json")
ALICE = {"Authorization": "Bearer sk-alice-1"}
BOB = {"Authorization": "Bearer sk-bob"}
ADMIN = {"Authorization": "Bearer sk-ops"}
SYSTEM = LONG_SYSTEM[:700]
"""About 140 tokens: several windows of 40."""
LONG_USER = ("Tell me about the reefer containers at the north yard, the berth plan for the next "
             "vessel, the customs papers for the hazardous cargo and the Tally invoice of last "
             "month, and say which of the tools is updated every fifteen minutes. ") * 2
"""About 100 tokens: the first prompt's end (and its window) lies well past the system's end."""


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory, default_tokenizer):
    return str(save_random_model(tmp_path_factory.mktemp("tiny-gemma3-hp"), default_tokenizer,
                                 "Gemma3ForCausalLM", "Gemma3TextConfig", GEMMA3, norm_offset=0.0))


def _server(gemma_dir, **engine) -> LiveServer:
    cfg = tiny_config(gemma_dir, block_size=BS, num_blocks=160, max_model_len=1024,
                      dtype="float32", num_threads=1, **engine)
    return LiveServer(cfg, ServerConfig(api_keys=KEYS))


@pytest.fixture(scope="module")
def srv(gemma_dir):
    with _server(gemma_dir) as s:
        yield s


@pytest.fixture(scope="module")
def full_srv(gemma_dir):
    """The same model with every layer's K/V kept: no window groups."""
    with _server(gemma_dir, disable_hybrid_kv_cache_manager=True) as s:
        yield s


def _reset(s: LiveServer) -> None:
    wait_idle(s.url, headers=ADMIN)
    assert httpx.post(s.url + "/v1/cache/reset", headers=ADMIN, timeout=30).status_code == 200


@pytest.fixture
def seen(srv, full_srv, monkeypatch):
    """Every request the engines queue: (server, its prompt ids, every message end it marks, the
    system ends among them: ``hit_point_tokens``; the rest are ``turn_end_tokens``)."""
    log: list[tuple[LiveServer, list[int], tuple[int, ...], tuple[int, ...]]] = []
    for s in (srv, full_srv):
        _reset(s)
        eng = s.state.engine
        orig = eng.add_request

        def add(*a, _orig=orig, _s=s, **kw):
            req = _orig(*a, **kw)
            log.append((_s, list(req.token_ids),
                        tuple(sorted(req.hit_point_tokens + req.turn_end_tokens)),
                        req.hit_point_tokens))
            return req
        monkeypatch.setattr(eng, "add_request", add)
    yield log
    for s in (srv, full_srv):
        assert wait_idle(s.url, headers=ADMIN)["blocks_in_use"] == 0


@pytest.fixture
def encodes(srv, full_srv, monkeypatch):
    """Tokenizer calls through each server's executor, by server."""
    counts = {srv: 0, full_srv: 0}
    for s in (srv, full_srv):
        orig = s.state.encode

        async def counted(fn, *args, _orig=orig, _s=s):
            counts[_s] += 1
            return await _orig(fn, *args)
        monkeypatch.setattr(s.state, "encode", counted)
    return counts


def _ids(tokenizer, messages, gen: bool) -> list[int]:
    """The chat template's rendering of ``messages`` tokenized, here in the test."""
    return tokenizer.encode(tokenizer.render_chat(messages, add_generation_prompt=gen),
                            add_special_tokens=False)


def _expected_ends(tokenizer, messages, cuts) -> tuple[int, ...]:
    """The length of the prompt cut after each of ``cuts`` messages, each checked to be a prefix of
    the whole prompt's tokens (so a message's end is exactly where its cut stops)."""
    full = _ids(tokenizer, messages, True)
    ends = []
    for c in cuts:
        cut = _ids(tokenizer, messages[:c], False)
        assert full[:len(cut)] == cut and len(cut) < len(full)
        ends.append(len(cut))
    return tuple(ends)


def _chat(s: LiveServer, messages, headers=ALICE) -> httpx.Response:
    r = httpx.post(s.url + "/v1/chat/completions", headers=headers, timeout=120, json={
        "model": s.model, "messages": messages, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    return r


def _messages(s: LiveServer, system, messages, headers=ALICE) -> httpx.Response:
    r = httpx.post(s.url + "/v1/messages", headers=headers, timeout=120, json={
        "model": s.model, "system": system, "messages": messages, "max_tokens": 2,
        "temperature": 0})
    assert r.status_code == 200, r.text
    return r


CONVERSATION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "When does the warehouse open?"},
    {"role": "assistant", "content": "At seven in the morning on weekdays."},
    {"role": "user", "content": "And on Saturdays?"},
    {"role": "assistant", "content": "It closes at two in the afternoon."},
    {"role": "user", "content": "Which tool plans the berths?"},
    {"role": "assistant", "content": "Dockside does."},
    {"role": "user", "content": "How often is it updated?"},
]


def test_cut_points_are_the_system_end_and_the_last_turn_ends():
    assert cut_points(CONVERSATION) == [1, 5, 7]  # not the first turn's end: at most two turns
    assert MAX_TURN_ENDS == 2
    assert cut_points(CONVERSATION[1:]) == [4, 6]  # no system prompt
    assert cut_points(CONVERSATION[:2]) == [1]
    assert cut_points(CONVERSATION[:1]) == []  # the whole prompt: its end is the prompt's end
    tool_turn = [*CONVERSATION[:2], {"role": "assistant", "content": "", "tool_calls": []},
                 {"role": "tool", "content": "{}"}]
    assert cut_points(tool_turn) == [1, 3]


def test_openai_chat_marks_the_system_end_and_the_last_two_turn_ends(srv, seen, encodes,
                                                                     default_tokenizer):
    assert srv.state.marks_message_ends
    _chat(srv, CONVERSATION)
    (server, ids, ends, system), = seen
    assert server is srv and ids == _ids(default_tokenizer, CONVERSATION, True)
    assert ends == _expected_ends(default_tokenizer, CONVERSATION, [1, 5, 7])
    assert system == ends[:1]  # the system end; the two turn ends give way to later turns
    assert _expected_ends(default_tokenizer, CONVERSATION, [3])[0] not in ends  # the first turn's
    assert encodes[srv] == 1 + len(ends)  # the prompt, then one cut per message end


def test_anthropic_messages_marks_the_system_end_and_the_turn_end(srv, seen, encodes,
                                                                   default_tokenizer):
    turns = CONVERSATION[1:4]
    _messages(srv, SYSTEM, turns)
    (server, ids, ends, system), = seen
    as_template = [{"role": "system", "content": SYSTEM}, *turns]
    assert server is srv and ids == _ids(default_tokenizer, as_template, True)
    assert ends == _expected_ends(default_tokenizer, as_template, [1, 3])
    assert system == ends[:1]
    assert encodes[srv] == 1 + len(ends)


def test_full_attention_pool_tokenizes_nothing_more(full_srv, seen, encodes):
    assert not full_srv.state.marks_message_ends
    _chat(full_srv, CONVERSATION)
    _messages(full_srv, SYSTEM, CONVERSATION[1:4])
    assert [(s is full_srv, e) for s, _, e, _ in seen] == [(True, ()), (True, ())]
    assert encodes[full_srv] == 2  # one tokenization per request: the prompt's


def _window_hits(s: LiveServer) -> dict[str, int]:
    return httpx.get(s.url + "/v1/cache/stats", headers=ADMIN, timeout=10).json()["window_hits_by_kind"]


def _evict_interior(s: LiveServer) -> int:
    """Evict every interior window block (in the engine's thread); returns how many there were."""
    def evict(engine) -> int:
        pool = engine.cache.pool
        n = len(pool.low)
        pool.free(pool.allocate(len(pool.empty) + n))
        assert not pool.low
        return n
    wait_idle(s.url, headers=ADMIN)
    return s.state.aengine.submit(evict).result(timeout=30)


def _second_conversation_after_eviction(s: LiveServer, headers=ALICE) -> dict:
    """A first chat (the system prompt, a long question), every interior window block evicted,
    then a second chat with the same system prompt and another question: its cache report."""
    _chat(s, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": LONG_USER}], headers)
    assert _evict_interior(s) > 0
    r = _chat(s, [{"role": "system", "content": SYSTEM},
                  {"role": "user", "content": "Is the gate open on Sundays?"}], headers)
    return r.json()["hotprefix"]["cache"]


def test_a_new_conversation_resumes_at_the_system_end(srv, seen, default_tokenizer, monkeypatch):
    system_end = len(_ids(default_tokenizer, [{"role": "system", "content": SYSTEM}], False))
    assert system_end > 3 * WINDOW and len(_ids(default_tokenizer, [
        {"role": "user", "content": LONG_USER}], False)) > WINDOW + 2 * BS
    aligned = system_end // BS * BS
    before = _window_hits(srv).get("message_end", 0)
    rep = _second_conversation_after_eviction(srv)
    assert seen[0][2] == (system_end,)  # the first chat's mark
    assert rep["cached_tokens"] >= aligned, rep
    assert _window_hits(srv).get("message_end", 0) == before + 1

    # the same without the marks: the full layers still hold the system prompt, the window layers
    # before its end were interior and are gone, so nothing is resumed there
    _reset(srv)
    monkeypatch.setattr(srv.state, "marks_message_ends", False)
    rep = _second_conversation_after_eviction(srv)
    assert seen[-1][2] == ()
    assert rep["cached_tokens"] < aligned, rep
    assert rep["miss_reason"] == "window_evicted"
    assert rep["detail"]["full_layers_cached_tokens"] >= aligned


def test_another_tenant_sees_nothing_of_the_marks(srv, seen):
    """Bob sends alice's system prompt after her marked chat and the eviction: his prompt shares
    none of her blocks (salted), so he gets no hit, no report or header that names a message
    end, and his own stats have no window figures."""
    _chat(srv, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": LONG_USER}])
    assert seen[0][2]  # alice's chat was marked
    _evict_interior(srv)
    r = _chat(srv, [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": "Is the gate open on Sundays?"}], BOB)
    rep = r.json()["hotprefix"]["cache"]
    assert rep["cached_tokens"] == 0 and rep["miss_reason"] == "cold", rep
    assert "message_end" not in r.text and "message_end" not in json.dumps(dict(r.headers))
    assert r.headers["x-hotprefix-cache"].startswith("cold;")
    mine = httpx.get(srv.url + "/v1/cache/stats", headers=BOB, timeout=10).json()
    assert mine["view"] == "tenant" and "window_hits_by_kind" not in mine
    assert "kv_groups" not in mine and "message_end" not in json.dumps(mine)
    assert seen[1][2]  # bob's own chat marks his own system end, in his own salted blocks


def test_shared_prefix_blocks_are_not_kept_by_a_tenants_marks():
    """A message end inside the blocks tenants share (``salt_from_block``) is not a hit point:
    after the interior blocks are evicted, a resume there fails; past them it holds."""
    system = [1, 2] * 20  # 40 tokens: 10 blocks of 4
    results = {}
    for shared in (0, 10):
        m = hybrid(400, window=9)
        run(m, "a", system + [0] * 21, hit_point_tokens=(len(system),), salt="t",
            salt_from_block=shared)
        evict_interior(m)
        b = run(m, "b", system + [2] * 9, salt="t", salt_from_block=shared)
        results[shared] = b.cache_report.cached_tokens
        assert b.full_hit_blocks == len(system) // CACHE_BS
    assert results[0] == len(system) and results[10] < len(system), results
