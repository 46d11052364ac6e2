"""Token utilities on the tiny model: ``/tokenize`` counts equal ``usage.prompt_tokens`` of the same
request (a prompt, chat messages, chat messages with tools), ``/detokenize`` round-trips them,
llama-server's field names work, Anthropic's ``count_tokens`` equals ``usage.input_tokens`` of the
same Messages request (through the official client), and none of them touches the KV pool or
depends on another tenant's data.
"""

from __future__ import annotations

import os

import anthropic
import httpx
import pytest

from hotprefix.config.sections import ServerConfig
from server_support import LONG_SYSTEM, LiveServer, tiny_config, wait_idle

KEYS = os.path.join(os.path.dirname(__file__), "data", "server", "api_keys.json")
ALICE, BOB, OPS = "sk-alice-1", "sk-bob", "sk-ops"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def srv(tiny_model_dir):
    with LiveServer(tiny_config(tiny_model_dir), ServerConfig(api_keys=KEYS)) as s:
        yield s


def call(srv, path, body, key=ALICE):
    r = httpx.post(srv.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)
    return r


def stats(srv):
    return wait_idle(srv.url, headers={"Authorization": f"Bearer {OPS}"})


def test_counts_equal_prompt_tokens_and_round_trip(srv):
    text = "The quick brown fox jumps over the lazy dog. Ünïcödé and emoji 🦊 too."
    t = call(srv, "/tokenize", {"model": srv.model, "prompt": text, "return_token_strs": True}).json()
    assert t["count"] == len(t["tokens"]) == len(t["token_strs"]) and t["max_model_len"] == srv.state.max_model_len
    assert t["token_strs"] == srv.state.tokenizer.hf.convert_ids_to_tokens(t["tokens"])  # vLLM's pieces
    comp = call(srv, "/v1/completions", {"model": srv.model, "prompt": text, "max_tokens": 1}).json()
    assert comp["usage"]["prompt_tokens"] == t["count"]
    assert call(srv, "/detokenize", {"tokens": t["tokens"]}).json()["prompt"] == text
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    for extra in ({}, {"tools": [WEATHER]}):
        t = call(srv, "/tokenize", {"messages": msgs, **extra}).json()
        chat = call(srv, "/v1/chat/completions", {"model": srv.model, "messages": msgs, "max_tokens": 1,
                                                  **extra}).json()
        assert chat["usage"]["prompt_tokens"] == t["count"], extra
    with_tools = call(srv, "/tokenize", {"messages": msgs, "tools": [WEATHER]}).json()["count"]
    assert with_tools > t["count"] - 1 and with_tools != call(srv, "/tokenize", {"messages": msgs}).json()["count"]
    no_gen = call(srv, "/tokenize", {"messages": msgs, "add_generation_prompt": False}).json()["count"]
    assert no_gen < call(srv, "/tokenize", {"messages": msgs}).json()["count"]


def test_messages_with_the_tokenizers_specials(srv):
    """vLLM's ``add_special_tokens`` on chat messages: the tokenizer's own specials around the
    rendered template (the fuzzer found a tokenizer class without build_inputs_with_special_tokens)."""
    msgs = [{"role": "user", "content": "hello"}]
    plain = call(srv, "/tokenize", {"messages": msgs}).json()["tokens"]
    r = call(srv, "/tokenize", {"messages": msgs, "add_special_tokens": True})
    assert r.status_code == 200
    assert r.json()["tokens"] == srv.state.tokenizer.add_specials(plain)
    assert plain[0] in r.json()["tokens"] and len(r.json()["tokens"]) >= len(plain)


def test_llama_server_field_names(srv):
    t = call(srv, "/tokenize", {"content": "hello world", "with_pieces": True}).json()
    assert [p["piece"] for p in t["tokens"]] == ["hello", " world"]
    ids = [p["id"] for p in t["tokens"]]
    assert call(srv, "/detokenize", {"tokens": ids}).json()["content"] == "hello world"


def test_bad_bodies_name_the_field(srv):
    r = call(srv, "/detokenize", {"tokens": [1, 10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens[1]"
    r = call(srv, "/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]})
    assert r.status_code == 400
    r = call(srv, "/tokenize", {"prompt": "a", "model": "other-model"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    assert call(srv, "/tokenize", {"prompt": "a"}, key="sk-nobody").status_code == 401


def test_anthropic_count_tokens_equals_input_tokens(srv):
    c = anthropic.Anthropic(base_url=srv.url, api_key=ALICE, max_retries=0)
    kw = dict(system="You are terse.", messages=[{"role": "user", "content": "What is two plus two?"}],
              tools=[{"name": "add", "description": "Add", "input_schema": {
                  "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}])
    counted = c.messages.count_tokens(model=srv.model, **kw)
    sent = c.messages.create(model=srv.model, max_tokens=1, **kw)
    u = sent.usage  # Anthropic's three input figures add up to the prompt
    assert counted.input_tokens == u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
    with pytest.raises(anthropic.BadRequestError) as e:  # Anthropic's error shape
        c.messages.count_tokens(model=srv.model, messages=[])
    assert e.value.body["type"] == "error"


def test_token_utilities_never_touch_the_pool_or_see_other_tenants(srv):
    base = stats(srv)
    msgs = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "hi"}]
    # bob caches a long prompt; what alice tokenizes does not depend on it
    before = call(srv, "/tokenize", {"messages": msgs}, key=ALICE).json()
    call(srv, "/v1/chat/completions", {"model": srv.model, "messages": msgs, "max_tokens": 1}, key=BOB)
    mid = stats(srv)
    for _ in range(3):
        assert call(srv, "/tokenize", {"messages": msgs}, key=ALICE).json() == before
        call(srv, "/detokenize", {"tokens": before["tokens"]}, key=ALICE)
        call(srv, "/v1/messages/count_tokens", {"model": srv.model, "messages": [{"role": "user", "content": "hi"}]})
    after = stats(srv)
    for k in ("queries_tokens", "hit_tokens", "requests", "written_blocks", "blocks_in_use"):
        assert after[k] == mid[k], k
    assert mid["requests"] == base["requests"] + 1  # the chat request counted; the utilities did not
