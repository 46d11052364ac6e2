"""The hosted APIs' cache hints, driven by the official ``openai`` and ``anthropic`` clients against
the real server on a tiny random-weight model with a 64-block pool: OpenAI's ``prompt_cache_key``
and ``prompt_cache_retention``, Anthropic's ``/v1/messages`` with ``cache_control`` breakpoints and
its usage figures, the server's caps on every hint, and tenant isolation of the hints."""

from __future__ import annotations

import os
import random

import anthropic
import httpx
import openai
import pytest

from hotprefix.cache.block_pool import BlockPool
from hotprefix.cache.hashing import BlockHasher, namespace_key
from hotprefix.cache.manager import KVCacheManager
from hotprefix.cache.request import CacheRequest
from hotprefix.config.sections import ServerConfig
from server_support import LiveServer, tiny_config, wait_idle

KEYS = os.path.join(os.path.dirname(__file__), "data", "server", "api_keys.json")
ADMIN = {"Authorization": "Bearer sk-ops"}
GREEDY = {"temperature": 0}
"""Sampling parameters are accepted but no longer in the anthropic client's signature."""
NUM_BLOCKS = 64
BLOCK = 16
WORDS = ("harbor container vessel customs manifest berth crane cargo tally dock yard schedule "
         "invoice weather delay inspection reefer pallet forklift gate truck rail barge pilot "
         "tug anchor quay warehouse shipment booking").split()


def text(tag: str, n_words: int) -> str:
    """Distinct text of about ``n_words`` tokens, starting with ``tag``."""
    rng = random.Random(tag)
    return tag + ": " + " ".join(rng.choice(WORDS) for _ in range(n_words))


def make_server(tiny_model_dir, **server_options) -> LiveServer:
    cfg = tiny_config(tiny_model_dir, num_blocks=NUM_BLOCKS, max_model_len=512,
                      **server_options.pop("engine", {}))
    return LiveServer(cfg, ServerConfig(api_keys=KEYS, **server_options))


@pytest.fixture(scope="module")
def srv(tiny_model_dir):
    with make_server(tiny_model_dir) as s:
        yield s


@pytest.fixture(autouse=True)
def fresh_cache(request):
    """Each test starts from an empty pool (and checks that nothing stays in use)."""
    if "srv" in request.fixturenames:
        s = request.getfixturevalue("srv")
        wait_idle(s.url, headers=ADMIN)
        assert httpx.post(s.url + "/v1/cache/reset", headers=ADMIN, timeout=30).status_code == 200
    yield
    if "srv" in request.fixturenames:
        assert wait_idle(request.getfixturevalue("srv").url, headers=ADMIN)["blocks_in_use"] == 0


def oai(srv, key="sk-alice-1") -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=60)


def ant(srv, key="sk-alice-1") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key=key, max_retries=0, timeout=60)


def chat(srv, system: str, key="sk-alice-1", **hints):
    return oai(srv, key).chat.completions.create(
        model=srv.model, max_tokens=2, temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": "Hi"}], **hints)


def cached(resp) -> int:
    return resp.usage.prompt_tokens_details.cached_tokens


def report(resp) -> dict:
    return resp.model_extra["hotprefix"]["cache"]


def stats(srv) -> dict:
    return httpx.get(srv.url + "/v1/cache/stats", headers=ADMIN, timeout=30).json()


def burst(srv, tag: str, n: int = 10) -> None:
    """Single-use traffic: n distinct ~300-token prompts, several times the pool."""
    c = oai(srv, "sk-alice-1")
    for i in range(n):
        c.completions.create(model=srv.model, prompt=text(f"{tag} scan {i}", 300), max_tokens=1,
                             temperature=0)


def messages_create(srv, system, user="Hi", key="sk-alice-1", ttl=None, **kw):
    block = {"type": "text", "text": system}
    if ttl is not None:
        block["cache_control"] = {"type": "ephemeral", "ttl": ttl}
    return ant(srv, key).messages.with_raw_response.create(
        model=srv.model, max_tokens=2, extra_body=GREEDY, system=[block],
        messages=[{"role": "user", "content": user}], **kw)


# ---------------------------------------------------------------------------- the cache's side
def _manager(num_blocks=16, clock=lambda: 0.0, **kw) -> KVCacheManager:
    pool = BlockPool(num_blocks, 4, "freq", clock=clock)
    return KVCacheManager(pool, BlockHasher(namespace_key("m", "t"), 4), **kw)


def _run(m: KVCacheManager, rid: str, tokens, **kw) -> CacheRequest:
    r = CacheRequest(request_id=rid, token_ids=list(tokens), num_prompt_tokens=len(tokens), **kw)
    hits = m.lookup(r)
    m.report(r, hits)
    assert m.allocate(r, len(tokens) - len(hits) * 4, len(hits) * 4, hits)
    m.commit(r, len(tokens))
    m.free(r)
    return r


def test_breakpoints_pin_blocks_up_to_their_end_with_the_longest_covering_ttl():
    m = _manager()
    _run(m, "a", range(17), pin_breakpoints=((8, 300.0), (13, 3600.0), (4, 60.0)))
    pins = [b.pinned_until for b in m.pool.blocks if b.key is not None]
    assert pins == [3600.0, 3600.0, 3600.0, 0.0]  # blocks ending at 4, 8, 12; 16 is past 13
    m2 = _manager()
    _run(m2, "b", range(17), pin_breakpoints=((8, 300.0),), pin_ttl_s=30.0)
    assert [b.pinned_until for b in m2.pool.blocks if b.key is not None] == [300.0, 300.0, 30.0, 30.0]


def test_a_hit_renews_retention_and_a_read_only_request_changes_nothing():
    now = [0.0]
    m = _manager(clock=lambda: now[0])
    _run(m, "w", range(9))
    assert m.pool.num_pinned_blocks == 0
    _run(m, "ro", range(9), cache_write=False, pin_ttl_s=50.0, priority=3)
    assert m.pool.num_pinned_blocks == 0 and {b.priority for b in m.pool.blocks} == {0}
    now[0] = 10.0
    _run(m, "r", range(9), pin_ttl_s=50.0, priority=2)
    hit = [b for b in m.pool.blocks if b.key is not None]
    assert [b.pinned_until for b in hit] == [60.0, 60.0] and [b.priority for b in hit] == [2, 2]
    _run(m, "low", range(9), priority=-5)  # a lower priority never demotes a block
    assert [b.priority for b in hit] == [2, 2]


def test_retention_skips_the_shared_window_of_a_salted_request():
    m = _manager()
    _run(m, "t", range(17), salt="tenant:x", salt_from_block=2, pin_ttl_s=9.0, priority=4)
    blocks = sorted((b for b in m.pool.blocks if b.key is not None), key=lambda b: b.depth)
    assert [(b.pinned_until, b.priority) for b in blocks] == [(0.0, 0), (0.0, 0), (9.0, 4), (9.0, 4)]


def test_expect_reuse_admits_the_tail_of_a_new_long_prompt():
    m = _manager(num_blocks=32, admission_tail_tokens=8)
    plain = _run(m, "p", range(100, 124))
    keyed = _run(m, "k", range(200, 224), expect_reuse=True)
    assert plain.cache_report.written_blocks == 2 and keyed.cache_report.written_blocks == 6


# ---------------------------------------------------------------------------- retention
def test_hinted_prefixes_survive_a_burst_that_evicts_an_unhinted_one(srv):
    keyed, day, marked, plain = (text(t, 90) for t in ("keyed", "day", "marked", "plain"))
    chat(srv, keyed, prompt_cache_key="support-bot")
    chat(srv, day, prompt_cache_retention="24h")
    messages_create(srv, marked, ttl="1h")
    chat(srv, plain)
    evictions = stats(srv)["evictions"]
    burst(srv, "survive")
    assert stats(srv)["evictions"] - evictions > NUM_BLOCKS  # the pool turned over
    # the unhinted prefix is gone; every hinted one is still there
    assert cached(chat(srv, plain)) == 0
    again = chat(srv, keyed, prompt_cache_key="support-bot")
    assert cached(again) >= 80 and report(again)["miss_reason"] == "hit"
    assert cached(chat(srv, day, prompt_cache_retention="24h")) >= 80
    u = messages_create(srv, marked, ttl="1h").parse().usage
    assert u.cache_read_input_tokens >= 80


def test_in_memory_retention_is_the_default_behaviour(srv):
    plain = text("in memory", 90)
    chat(srv, plain, prompt_cache_retention="in_memory")
    assert stats(srv)["blocks_pinned"] == 0
    burst(srv, "in-memory")
    assert cached(chat(srv, plain, prompt_cache_retention="in_memory")) == 0


def test_retention_24h_pins_a_prefix_that_was_already_cached(srv):
    doc = text("already cached", 90)
    chat(srv, doc)
    assert stats(srv)["blocks_pinned"] == 0
    hit = chat(srv, doc, prompt_cache_retention="24h")  # a hit renews the retention of its blocks
    assert cached(hit) >= 80
    assert stats(srv)["blocks_pinned"] == cached(hit) // BLOCK
    burst(srv, "refresh")
    assert cached(chat(srv, doc)) == cached(hit)


def test_prompt_cache_key_admits_the_tail_under_admission_rule(tiny_model_dir):
    with make_server(tiny_model_dir, engine={"admission_tail_tokens": 32}) as s:
        c = oai(s)
        plain = c.completions.create(model=s.model, prompt=text("tail plain", 200), max_tokens=1)
        keyed = c.completions.create(model=s.model, prompt=text("tail keyed", 200), max_tokens=1,
                                     extra_body={"prompt_cache_key": "docs"})
        assert report(plain)["written_blocks"] == 2  # only the head of a new long prompt
        assert report(keyed)["written_blocks"] == keyed.usage.prompt_tokens // BLOCK
        again = c.completions.create(model=s.model, prompt=text("tail keyed", 200) + " more",
                                     max_tokens=1)
        assert cached(again) == report(keyed)["written_blocks"] * BLOCK


# ---------------------------------------------------------------------------- Anthropic usage
def test_anthropic_usage_reports_cache_writes_then_reads(srv):
    system = text("anthropic usage", 120)
    first_raw = messages_create(srv, system, "What are the opening hours?", ttl="5m")
    first = first_raw.parse()
    rep1 = first.model_extra["hotprefix"]["cache"]
    u1 = first.usage
    assert u1.cache_read_input_tokens == 0 and u1.cache_creation_input_tokens > 0
    assert u1.cache_creation_input_tokens == rep1["written_blocks"] * BLOCK
    total1 = rep1["cached_tokens"] + rep1["computed_tokens"]
    assert u1.input_tokens + u1.cache_creation_input_tokens + u1.cache_read_input_tokens == total1
    assert 0 <= u1.input_tokens < BLOCK
    assert first.type == "message" and first.role == "assistant" and first.content[0].type == "text"
    assert first.stop_reason in ("max_tokens", "end_turn") and 1 <= u1.output_tokens <= 2
    assert first_raw.headers["x-hotprefix-cache"].startswith("cold; cached=0")

    second = messages_create(srv, system, "Where do I file customs paperwork?", ttl="5m").parse()
    rep2 = second.model_extra["hotprefix"]["cache"]
    u2 = second.usage
    assert u2.cache_read_input_tokens > 0
    assert u2.cache_read_input_tokens == rep2["cached_tokens"]
    assert u2.input_tokens + u2.cache_creation_input_tokens + u2.cache_read_input_tokens == \
        rep2["cached_tokens"] + rep2["computed_tokens"]
    full = (rep2["cached_tokens"] + rep2["computed_tokens"]) // BLOCK * BLOCK
    written = rep2["written_blocks"] * BLOCK
    assert u2.cache_creation_input_tokens == min(written, full - rep2["cached_tokens"])


def test_anthropic_streaming_with_the_official_client(srv):
    system = text("streaming", 100)
    c = ant(srv)
    with c.messages.stream(model=srv.model, max_tokens=6, extra_body=GREEDY,
                           system=[{"type": "text", "text": system,
                                    "cache_control": {"type": "ephemeral"}}],
                           messages=[{"role": "user", "content": "Hello"}]) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert final.content[0].text == streamed
    assert final.usage.output_tokens == 6 and final.stop_reason == "max_tokens"
    assert final.usage.cache_read_input_tokens == 0 and final.usage.cache_creation_input_tokens > 0
    # the same request without streaming gives the same text, now from cache
    again = c.messages.create(model=srv.model, max_tokens=6, extra_body=GREEDY,
                              system=[{"type": "text", "text": system}],
                              messages=[{"role": "user", "content": "Hello"}])
    assert again.content[0].text == streamed
    assert again.usage.cache_read_input_tokens == final.usage.cache_creation_input_tokens
    kinds = [e.type for e in c.messages.create(
        model=srv.model, max_tokens=3, extra_body=GREEDY, stream=True,
        messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well,"}])]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) <= {"content_block_delta"}


def test_anthropic_stop_sequences_and_text_blocks(srv):
    c = ant(srv)
    conv = [{"role": "user", "content": [{"type": "text", "text": "Go "},
                                         {"type": "text", "text": "on"}]}]
    probe = c.messages.create(model=srv.model, max_tokens=12, extra_body=GREEDY, messages=conv)
    said = probe.content[0].text
    assert probe.stop_reason == "max_tokens" and probe.stop_sequence is None and len(said) > 8
    stop = said[len(said) // 2:len(said) // 2 + 3]
    for stops in ([stop], ["\u0000never", stop]):  # one stop string; several (found by decoding)
        cut = c.messages.create(model=srv.model, max_tokens=12, extra_body=GREEDY, messages=conv,
                                stop_sequences=stops)
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
        assert said.startswith(cut.content[0].text) and stop not in cut.content[0].text


# ---------------------------------------------------------------------------- caps
def test_a_client_cannot_exceed_the_servers_caps(tiny_model_dir):
    with make_server(tiny_model_dir, max_cache_ttl_s=60.0) as s:
        pool = s.state.engine.cache.pool
        chat(s, text("capped day", 90), prompt_cache_retention="24h")
        messages_create(s, text("capped hour", 90), ttl="1h")
        st = stats(s)
        assert st["blocks_pinned"] > 0
        now = pool.clock()
        pins = [b.pinned_until - now for b in pool.blocks if b.pinned_until]
        assert pins and max(pins) <= 60.0  # clamped to the server's maximum TTL
        # many distinct 24h prompts: the pins never take more than half the pool
        for i in range(8):
            chat(s, text(f"pin flood {i}", 90), prompt_cache_retention="24h")
            st = stats(s)
            assert st["blocks_pinned"] <= NUM_BLOCKS // 2
        assert st["blocks_pinned"] == NUM_BLOCKS // 2
        # the unpinned half still serves a long prompt
        r = oai(s).completions.create(model=s.model, prompt=text("after pins", 300), max_tokens=1)
        assert r.usage.prompt_tokens > 300
        # a request cannot pin beyond the schema's maximum either
        with pytest.raises(openai.BadRequestError):
            oai(s).completions.create(model=s.model, prompt="x", max_tokens=1,
                                      extra_body={"hotprefix": {"ttl_s": 10 ** 9}})


def test_zero_max_ttl_turns_pins_off(tiny_model_dir):
    with make_server(tiny_model_dir, max_cache_ttl_s=0.0) as s:
        chat(s, text("no pins", 90), prompt_cache_retention="24h")
        messages_create(s, text("no pins either", 90), ttl="1h")
        assert stats(s)["blocks_pinned"] == 0


def test_breakpoint_pins_only_the_prefix_up_to_it(srv):
    system = text("breakpoint", 60)
    r = ant(srv).messages.create(
        model=srv.model, max_tokens=1, extra_body=GREEDY,
        system=[{"type": "text", "text": system, "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        messages=[{"role": "user", "content": text("long unmarked question", 120)}])
    total = r.usage.input_tokens + r.usage.cache_creation_input_tokens
    # the breakpoint ends where the system prompt's rendering stops agreeing with the whole prompt
    tok = srv.state.tokenizer
    whole = tok.encode_chat([{"role": "system", "content": system},
                             {"role": "user", "content": text("long unmarked question", 120)}])
    cut = tok.encode_chat([{"role": "system", "content": system}])
    end = next(i for i, (a, b) in enumerate(zip(whole, cut)) if a != b)
    assert len(whole) == total and 40 < end < 100
    assert stats(srv)["blocks_pinned"] == end // BLOCK  # the system prompt's blocks only
    pool = srv.state.engine.cache.pool
    now = pool.clock()
    pins = [b.pinned_until - now for b in pool.blocks if b.pinned_until]
    assert 3500 < max(pins) <= 3600


# ---------------------------------------------------------------------------- tenants
def test_prompt_cache_key_stays_inside_the_tenant(srv):
    doc = text("tenant isolation", 90)
    a1 = chat(srv, doc, key="sk-alice-1", prompt_cache_key="shared-key", prompt_cache_retention="24h")
    a2 = chat(srv, doc, key="sk-alice-2", prompt_cache_key="shared-key")
    assert cached(a1) == 0 and cached(a2) >= 80  # same tenant (alice), two keys: shared
    b1 = chat(srv, doc, key="sk-bob", prompt_cache_key="shared-key")
    assert cached(b1) == 0 and report(b1)["miss_reason"] == "cold"  # alice's key gives bob nothing
    assert cached(chat(srv, doc, key="sk-bob")) == cached(a2)  # bob's own blocks now
    fresh = chat(srv, text("never sent", 90), key="sk-bob")
    same = ("cached_tokens", "miss_reason", "miss_position", "detail", "sources")
    assert [report(b1)[k] for k in same] == [report(fresh)[k] for k in same]  # as if never seen


def test_hints_never_retain_the_shared_window(srv):
    """carol and dave share their first 256 tokens by configuration: a tenant's hints do not pin or
    favour those shared blocks (they belong to no tenant), only the tenant's own blocks after them."""
    inside = text("shared window", 90)  # ~100 tokens: all inside the shared window
    r = messages_create(srv, inside, key="sk-carol", ttl="1h").parse()
    chat(srv, inside, key="sk-carol", prompt_cache_retention="24h", prompt_cache_key="k")
    assert r.usage.cache_creation_input_tokens > 0 and stats(srv)["blocks_pinned"] == 0
    assert max(b.priority for b in srv.state.engine.cache.pool.blocks) == 0
    assert messages_create(srv, inside, key="sk-dave").parse().usage.cache_read_input_tokens > 0
    past = text("past the window", 300)  # 16 shared blocks, then carol's own
    n = chat(srv, past, key="sk-carol", prompt_cache_retention="24h").usage.prompt_tokens
    assert n > 300 and stats(srv)["blocks_pinned"] == n // BLOCK - 256 // BLOCK


# ---------------------------------------------------------------------------- errors
def test_anthropic_errors_have_anthropics_shape(srv):
    c = ant(srv)
    base = dict(model=srv.model, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(**base, tools=[{"type": "web_search_20250305", "name": "web_search"}])
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "tools" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError) as e:
        ant(srv, key="sk-nobody").messages.create(**base)
    assert e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(**{**base, "model": "claude-nonexistent"})
    assert "does not exist" in e.value.body["error"]["message"]
    http = httpx.Client(base_url=srv.url, headers={"x-api-key": "sk-alice-1",
                                                  "anthropic-version": "2023-06-01"}, timeout=30)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}

    def system(cache_control):
        return {**base, "system": [{"type": "text", "text": "s", "cache_control": cache_control}]}

    bad_bodies = [
        {"model": srv.model, "messages": [{"role": "user", "content": "Hi"}]},  # no max_tokens
        {**base, "messages": [{"role": "user", "content": [image]}]},
        system({"type": "persistent"}),
        system({"type": "ephemeral", "ttl": "2h"}),
        {**base, "messages": [{"role": "user", "content": [
            {"type": "text", "text": str(i), "cache_control": {"type": "ephemeral"}} for i in range(5)]}]},
        {**base, "temperature": 1.5},
        {**base, "unknown_field": 1},
        {**base, "messages": []},
        "not json",
    ]
    for body in bad_bodies:
        r = http.post("/v1/messages", **({"content": body} if isinstance(body, str) else {"json": body}))
        assert r.status_code == 400, (body, r.text)
        j = r.json()
        assert j["type"] == "error" and j["error"]["type"] == "invalid_request_error", j
        assert isinstance(j["error"]["message"], str) and j["error"]["message"]
    # the message names where in the body, not the string branch of a string-or-blocks field
    r = http.post("/v1/messages", json=system({"type": "ephemeral", "ttl": "2h"}))
    assert "system[0].cache_control.ttl" in r.json()["error"]["message"]
    r = http.post("/v1/messages", json={**base, "stop_sequences": [""]})
    assert r.json()["error"]["message"].startswith("stop_sequences ")
    # errors raised before the route runs take its shape too: a body over the limit that says
    # its length (as every client does), a method the route does not take
    r = http.post("/v1/messages", content=b"x" * (srv.state.config.max_request_bytes + 1),
                  headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert r.json() == {"type": "error", "error": {"type": "request_too_large",
                                                   "message": r.json()["error"]["message"]}}
    r = http.get("/v1/messages")
    assert r.status_code == 405 and r.json()["type"] == "error", r.text
    # the OpenAI routes keep OpenAI's error shape
    r = http.post("/v1/completions", content=b"x" * (srv.state.config.max_request_bytes + 1),
                  headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = http.post("/v1/chat/completions", json={"model": srv.model, "messages": []})
    assert r.status_code == 400 and "error" in r.json() and "type" not in r.json()


def test_openai_hint_values_are_checked(srv):
    c = oai(srv)
    with pytest.raises(openai.BadRequestError) as e:
        chat(srv, "x", prompt_cache_retention="forever")
    assert e.value.body["param"] == "prompt_cache_retention"
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=srv.model, max_tokens=1,
                                  messages=[{"role": "user", "content": "Hi"}],
                                  prompt_cache_key="k" * 5000)


def test_openapi_lists_the_messages_route(srv):
    doc = httpx.get(srv.url + "/openapi.json", timeout=30).json()
    assert "/v1/messages" in doc["paths"]
