"""Raw-HTTP tests of the server on a tiny random-weight model: every bad input gets OpenAI-style
error JSON with the right status, the engine survives, and the extension features (retention
controls, warm, request log, metrics, admin reset, queue limit) behave."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest

from hotprefix.cli import build_parser
from hotprefix.config.sections import ServerConfig
from hotprefix.server.tenants import tenant_tag
from server_support import LONG_SYSTEM, LiveServer, tiny_config, wait_idle

MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def log_path(tmp_path_factory):
    return str(tmp_path_factory.mktemp("reqlog") / "requests.jsonl")


@pytest.fixture(scope="module")
def srv(tiny_model_dir, log_path):
    cfg = tiny_config(tiny_model_dir, max_model_len=MAX_MODEL_LEN)
    with LiveServer(cfg, ServerConfig(log_requests=log_path)) as s:
        yield s


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


def ok_body(srv, **kw):
    return {"model": srv.model, "prompt": "Hello there", "max_tokens": 2, "temperature": 0, **kw}


def chat_body(srv, **kw):
    return {"model": srv.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **kw}


def assert_error(resp, status, param=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


BAD_COMPLETIONS = [
    ("max_tokens", {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": -5}),
    ("max_tokens", {"max_tokens": "7"}),
    ("max_tokens", {"max_tokens": 1.5}),
    ("temperature", {"temperature": -0.1}),
    ("temperature", {"temperature": "hot"}),
    ("top_p", {"top_p": 0}),
    ("top_p", {"top_p": 1.5}),
    ("top_k", {"top_k": 0}),
    ("prompt", {"prompt": ""}),
    ("prompt", {"prompt": []}),
    ("prompt", {"prompt": 42}),
    ("prompt", {"prompt": [-1, 5]}),
    ("prompt", {"prompt": [10**9]}),
    ("prompt", {"prompt": ["a", "b"]}),
    ("prompt", {"prompt": "word " * (MAX_MODEL_LEN + 10)}),
    ("model", {"model": "gpt-nonexistent"}),
    ("model", {"model": 3}),
    ("stop", {"stop": [""]}),
    ("stop", {"stop": 5}),
    ("stream", {"stream": "yes"}),
    ("seed", {"seed": 2**70}),
    ("n", {"n": 0}),
    ("logprobs", {"logprobs": 6}),
    ("logit_bias", {"logit_bias": {"x": 1}}),
    ("frobnicate", {"frobnicate": True}),
    ("hotprefix.cache", {"hotprefix": {"cache": "forever"}}),
    ("hotprefix.ttl_s", {"hotprefix": {"ttl_s": -1}}),
    ("hotprefix.bogus", {"hotprefix": {"bogus": 1}}),
    ("stop[1]", {"stop": ["a", 1]}),  # the list's item, not the string branch of str | list
    ("stop", {"stop": [f"s{i}" for i in range(65)]}),  # each is searched after every token
    ("stop", {"stop": "x" * 1001}),
    ("stop_token_ids", {"stop_token_ids": list(range(65))}),
]


@pytest.mark.parametrize("param,change", BAD_COMPLETIONS, ids=[f"{p}-{i}" for i, (p, _) in enumerate(BAD_COMPLETIONS)])
def test_bad_completion_gets_400(srv, http, param, change):
    assert_error(http.post("/v1/completions", json=ok_body(srv, **change)), 400, param)


BAD_CHATS = [
    ("messages", {"messages": []}),
    ("messages", {"messages": "hi"}),
    ("messages[0].role", {"messages": [{"role": "wizard", "content": "x"}]}),
    ("messages[0].content", {"messages": [{"role": "user", "content": 5}]}),
    ("messages[0].content[0].type", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]}),
    ("messages[0].content[0].text", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
    ("max_completion_tokens", {"max_completion_tokens": 0}),
    ("temperature", {"temperature": -1}),
    ("tools[0].function.name", {"tools": [{"type": "function", "function": {"name": "not a name"}}]}),
    ("messages", {"messages": [{"role": "user", "content": "word " * (MAX_MODEL_LEN + 10)}]}),
]


@pytest.mark.parametrize("param,change", BAD_CHATS, ids=[p for p, _ in BAD_CHATS])
def test_bad_chat_gets_400(srv, http, param, change):
    assert_error(http.post("/v1/chat/completions", json=chat_body(srv, **change)), 400, param)


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b'"just a string"', b"null",
                                 b'{"model": "x", "prompt": "a", "temperature": NaN}',
                                 b"\xff\xfe garbage"])
def test_malformed_body_gets_400(http, raw):
    for route in ("/v1/completions", "/v1/chat/completions", "/v1/cache/warm"):
        assert_error(http.post(route, content=raw, headers={"content-type": "application/json"}), 400)


def test_missing_field_names_it(srv, http):
    err = assert_error(http.post("/v1/completions", json={"model": srv.model}), 400, "prompt")
    assert "prompt" in err["message"]


def test_too_long_prompt_says_context_length(srv, http):
    err = assert_error(http.post("/v1/completions",
                                 json=ok_body(srv, prompt="word " * (MAX_MODEL_LEN + 10))), 400, "prompt")
    assert err["code"] == "context_length_exceeded" and str(MAX_MODEL_LEN) in err["message"]


def test_unknown_route_and_method(http):
    assert_error(http.get("/v1/nothing-here"), 404)
    assert_error(http.post("/v1/engines/x/completions", json={}), 404)
    assert_error(http.get("/v1/completions"), 405)


def test_engine_alive_after_bad_input(srv, http):
    assert http.get("/health").json() == {"status": "ok"}
    r = http.post("/v1/completions", json=ok_body(srv))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert srv.state.aengine.num_step_errors == 0


def test_tiny_temperature_is_greedy_not_a_crash(srv, http):
    r = http.post("/v1/completions", json=ok_body(srv, temperature=1e-300, max_tokens=3))
    assert r.status_code == 200, r.text
    greedy = http.post("/v1/completions", json=ok_body(srv, temperature=0, max_tokens=3)).json()
    assert r.json()["choices"][0]["text"] == greedy["choices"][0]["text"]


def test_usage_and_cache_report_shape(srv, http):
    r = http.post("/v1/chat/completions", json=chat_body(srv))
    assert r.status_code == 200
    body = r.json()
    u = body["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert type(u["prompt_tokens_details"]["cached_tokens"]) is int
    rep = body["hotprefix"]["cache"]
    assert set(rep) == {"cached_tokens", "computed_tokens", "written_blocks", "sources",
                        "miss_reason", "miss_position", "detail"}
    assert rep["sources"] == {"pool": rep["cached_tokens"]}  # no KV tier on this server
    assert re.fullmatch(r"[a-z_]+; cached=\d+; computed=\d+", r.headers["x-hotprefix-cache"])


def test_retention_cache_none_writes_nothing(srv, http):
    msgs = [{"role": "system", "content": "NONE-TEST " + LONG_SYSTEM}, {"role": "user", "content": "a"}]
    r1 = http.post("/v1/chat/completions", json=chat_body(srv, messages=msgs, hotprefix={"cache": "none"}))
    assert r1.status_code == 200, r1.text
    assert r1.json()["hotprefix"]["cache"]["written_blocks"] == 0
    r2 = http.post("/v1/chat/completions", json=chat_body(srv, messages=msgs))
    assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert r2.json()["hotprefix"]["cache"]["written_blocks"] > 0
    r3 = http.post("/v1/chat/completions", json=chat_body(srv, messages=msgs))
    assert r3.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 256


def test_retention_ttl_pins_blocks(srv, http):
    msgs = [{"role": "system", "content": "PIN-TEST " + LONG_SYSTEM}, {"role": "user", "content": "a"}]
    before = http.get("/v1/cache/stats").json()["blocks_pinned"]
    r = http.post("/v1/chat/completions", json=chat_body(srv, messages=msgs,
                                                          hotprefix={"ttl_s": 600, "priority": 5}))
    assert r.status_code == 200
    written = r.json()["hotprefix"]["cache"]["written_blocks"]
    assert written > 0
    assert http.get("/v1/cache/stats").json()["blocks_pinned"] >= before + written


def test_warm_then_first_user_hits(srv, http):
    system = "WARM-TEST " + LONG_SYSTEM
    r = http.post("/v1/cache/warm", json={"messages": [[{"role": "system", "content": system}]]})
    assert r.status_code == 200, r.text
    d = r.json()["data"][0]
    assert d["cached_tokens"] == 0 and d["written_blocks"] > 10
    chat = http.post("/v1/chat/completions", json=chat_body(srv, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": "first question"}]))
    assert chat.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= (d["written_blocks"] - 1) * 16
    again = http.post("/v1/cache/warm", json={"prompts": ["warm me " * 40, "and me " * 40]}).json()
    assert [x["index"] for x in again["data"]] == [0, 1]
    assert_error(http.post("/v1/cache/warm", json={}), 400)
    assert_error(http.post("/v1/cache/warm", json={"prompts": [""]}), 400)


def test_warm_stops_submitting_when_its_client_leaves(srv, http):
    """Each warm prompt's submission waits for an engine step: a client gone before they are all in
    must not leave the engine computing the rest for nobody. The engine thread is held while the
    client sends a warm body of 30 prompts and hangs up, then let go."""
    import socket
    import threading

    before = http.get("/v1/cache/stats").json()["requests"]
    release = threading.Event()
    held = srv.state.aengine.submit(lambda e: release.wait(30))
    body = json.dumps({"prompts": [f"leaving client prompt {i} " * 12 for i in range(30)]}).encode()
    with socket.create_connection(("127.0.0.1", srv.port)) as sock:
        sock.sendall(b"POST /v1/cache/warm HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        time.sleep(0.5)  # the handler is waiting on its first submission
    time.sleep(0.5)  # the server has seen the connection close
    release.set()
    held.result(30)
    stats = wait_idle(srv.url)
    assert stats["blocks_in_use"] == 0
    assert stats["requests"] - before <= 2, stats["requests"] - before  # not the 30


def test_streaming_events_and_final_usage(srv, http):
    with http.stream("POST", "/v1/chat/completions",
                     json=chat_body(srv, stream=True, max_tokens=4,
                                    stream_options={"include_usage": True})) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["finish_reason"] == "length"
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4
    assert isinstance(last["usage"]["prompt_tokens_details"]["cached_tokens"], int)
    assert "written_blocks" in last["hotprefix"]["cache"]
    assert all(c["usage"] is None for c in chunks[:-1])


def test_metrics_exposition(srv, http):
    text = http.get("/metrics").text
    for name in ("hotprefix_prefix_cache_queries_total", "hotprefix_prefix_cache_hits_total",
                 "hotprefix_prefix_cache_hit_rate", "hotprefix_kv_cache_usage_ratio",
                 "hotprefix_prefix_cache_evictions_total", "hotprefix_blocks_cached",
                 "hotprefix_blocks_in_use", "hotprefix_num_requests_running",
                 "hotprefix_num_requests_waiting", "hotprefix_time_to_first_token_seconds_bucket",
                 "hotprefix_e2e_request_latency_seconds_count", "hotprefix_prompt_tokens_total",
                 "hotprefix_generation_tokens_total"):
        assert re.search(rf"^{name}(\{{[^}}]*\}})? ", text, re.M), name
    m = re.search(r'^hotprefix_prefix_cache_miss_tokens_total\{reason="cold"\} (\S+)', text, re.M)
    assert m and float(m.group(1)) > 0
    hits = float(re.search(r"^hotprefix_prefix_cache_hits_total (\S+)", text, re.M).group(1))
    assert hits > 0  # earlier tests in this module hit the cache


def test_request_log_has_keys_not_text(srv, http, log_path):
    r = http.post("/v1/completions", json=ok_body(srv, prompt="SECRET-PROMPT " * 20, max_tokens=2))
    rid = r.json()["id"]
    lines = [json.loads(ln) for ln in open(log_path)]
    mine = [ln for ln in lines if ln["request_id"] == rid]
    assert len(mine) == 1
    entry = mine[0]
    assert entry["num_prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert entry["num_output_tokens"] == 2
    assert len(entry["block_keys"]) == (entry["num_prompt_tokens"] + 2) // 16
    assert all(re.fullmatch(r"[0-9a-f]{64}", k) for k in entry["block_keys"])
    assert entry["tenant"] == tenant_tag(None)
    assert "SECRET" not in open(log_path).read()


def test_cache_reset_open_without_key_file(http):
    r = http.post("/v1/cache/reset")
    assert r.status_code == 200 and "dropped_blocks" in r.json()
    assert http.get("/v1/cache/stats").json()["blocks_cached"] == 0


def test_serve_flags_default_from_config():
    args = build_parser().parse_args(["serve"])
    d = ServerConfig()
    assert (args.host, args.port, args.api_keys, args.shared_prefix_tokens) == \
        (d.host, d.port, d.api_keys, d.shared_prefix_tokens)
    args = build_parser().parse_args(["serve", "m.gguf", "--port", "9", "--api-keys", "k.json",
                                      "--max-waiting", "3"])
    assert (args.model_pos, args.port, args.api_keys, args.max_waiting) == ("m.gguf", 9, "k.json", 3)


def test_queue_full_gets_503_with_retry_after(tiny_model_dir):
    cfg = tiny_config(tiny_model_dir, max_num_seqs=1, max_waiting=1)
    with LiveServer(cfg) as s:
        long = {"model": s.model, "prompt": "Tell me a story", "max_tokens": 1500, "ignore_eos": True,
                "temperature": 0}

        async def scenario():
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
                async with c.stream("POST", "/v1/completions", json={**long, "stream": True}) as r1:
                    assert r1.status_code == 200
                    lines = r1.aiter_lines()  # keep a reference: a finalized iterator closes r1
                    await lines.__anext__()  # running now (max_num_seqs=1)
                    t2 = asyncio.create_task(c.post("/v1/completions", json=long))
                    for _ in range(200):
                        if (await c.get("/v1/cache/stats")).json()["waiting"] >= 1:
                            break
                        await asyncio.sleep(0.02)
                    r3 = await c.post("/v1/completions", json=long)
                    assert r3.status_code == 503, r3.text
                    assert r3.headers["retry-after"].isdigit()
                    assert r3.json()["error"]["code"] == "queue_full"
                t2.cancel()  # both clients go away: their requests are aborted
            return True

        assert asyncio.run(scenario())
        assert wait_idle(s.url)["blocks_in_use"] == 0
        assert httpx.get(s.url + "/health").status_code == 200


def test_failed_engine_step_fails_only_its_requests(tiny_model_dir):
    with LiveServer(tiny_config(tiny_model_dir)) as s:
        engine = s.state.engine
        real_step = engine.step
        calls = {"n": 0}

        def flaky_step():
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("injected failure")
            return real_step()

        engine.step = flaky_step
        body = {"model": s.model, "prompt": "Hello there", "max_tokens": 2, "temperature": 0}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=30)
        assert_error(r, 500)
        assert r.json()["error"]["code"] == "engine_error"
        assert s.state.aengine.num_step_errors == 1
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert wait_idle(s.url)["blocks_in_use"] == 0
