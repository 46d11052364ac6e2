"""The real server with the real default model, driven by the official ``openai`` client:
completions, chat, streaming, usage.cached_tokens, tenants (API key file), admin routes.

One server for the module (model loaded once); max_tokens stays small.
"""

from __future__ import annotations

import os

import httpx
import openai
import pytest

from hotprefix.config.sections import EngineConfig, ServerConfig
from server_support import LONG_SYSTEM, LiveServer, wait_idle

KEYS = os.path.join(os.path.dirname(__file__), "data", "server", "api_keys.json")
pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def srv():
    cfg = EngineConfig.from_options(kv_cache_memory="512MiB", num_threads=2)
    with LiveServer(cfg, ServerConfig(api_keys=KEYS)) as s:
        yield s


def client(srv, key="sk-alice-1") -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=120)


def chat(srv, system, user="Hi", key="sk-alice-1", max_tokens=4):
    return client(srv, key).chat.completions.create(
        model=srv.model, max_tokens=max_tokens, temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}])


def cached(resp) -> int:
    n = resp.usage.prompt_tokens_details.cached_tokens
    assert type(n) is int
    return n


def test_models_lists_the_served_model(srv):
    ids = [m.id for m in client(srv).models.list().data]
    assert ids == [srv.model]


def test_completion_with_usage_and_cache_header(srv):
    raw = client(srv).completions.with_raw_response.create(
        model=srv.model, prompt="The capital of France is", max_tokens=4, temperature=0)
    resp = raw.parse()
    assert resp.object == "text_completion"
    assert isinstance(resp.choices[0].text, str) and resp.choices[0].text.strip()
    assert resp.choices[0].finish_reason in ("length", "stop")
    u = resp.usage
    assert u.prompt_tokens > 0 and 1 <= u.completion_tokens <= 4
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert cached(resp) == 0  # a 5-token prompt cannot fill a block
    assert raw.headers["x-hotprefix-cache"].startswith("too_short; cached=0")
    assert resp.model_extra["hotprefix"]["cache"]["miss_reason"] == "too_short"


def test_second_request_sharing_a_long_system_prompt_hits(srv):
    system = "[hit-test] " + LONG_SYSTEM
    first = chat(srv, system, "Where is my container?")
    second = chat(srv, system, "When do warehouses open?")
    assert cached(first) == 0
    assert first.model_extra["hotprefix"]["cache"]["miss_reason"] == "cold"
    assert first.model_extra["hotprefix"]["cache"]["written_blocks"] >= first.usage.prompt_tokens // 16 - 1
    n = cached(second)
    assert n >= 300 and n % 16 == 0, n
    assert n <= second.usage.prompt_tokens - 1
    rep = second.model_extra["hotprefix"]["cache"]
    assert rep["cached_tokens"] == n and rep["computed_tokens"] == second.usage.prompt_tokens - n
    assert isinstance(second.choices[0].message.content, str)


def test_chat_stream_matches_non_stream_and_ends_with_usage(srv):
    system = "[stream-test] " + LONG_SYSTEM
    full = chat(srv, system, "Hello!", max_tokens=5)
    stream = client(srv).chat.completions.create(
        model=srv.model, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "system", "content": system}, {"role": "user", "content": "Hello!"}])
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content  # greedy: same tokens, cached or not
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == full.usage.completion_tokens
    assert cached(last) >= 300  # the non-streamed request warmed the system prompt
    assert last.model_extra["hotprefix"]["cache"]["miss_reason"] == "hit"


def test_completion_stream_without_usage(srv):
    chunks = list(client(srv).completions.create(
        model=srv.model, prompt="Once upon a time", max_tokens=4, temperature=0, stream=True))
    assert len(chunks) >= 2
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert "hotprefix" in chunks[-1].model_extra
    assert "".join(c.choices[0].text for c in chunks).strip()


def test_tenants_never_share_blocks(srv):
    system = "[tenant-test] " + LONG_SYSTEM
    alice1 = chat(srv, system, "q1", key="sk-alice-1")
    bob = chat(srv, system, "q1", key="sk-bob")
    alice2 = chat(srv, system, "q2", key="sk-alice-2")  # another key of the same tenant
    assert cached(alice1) == 0
    assert cached(bob) == 0
    # bob is told nothing about alice's copy: the same answer as for a prompt nobody sent
    assert bob.model_extra["hotprefix"]["cache"]["miss_reason"] == "cold"
    assert cached(alice2) >= 300


def test_tenants_share_only_the_configured_common_prefix(srv):
    system = "[shared-test] " + LONG_SYSTEM
    carol = chat(srv, system, "q", key="sk-carol")
    dave = chat(srv, system, "q", key="sk-dave")
    assert cached(carol) == 0
    assert dave.usage.prompt_tokens > 256 + 16
    assert cached(dave) == 256  # the first 256 tokens are shared, the rest is salted


def test_missing_or_wrong_key_gets_401(srv):
    with pytest.raises(openai.AuthenticationError):
        client(srv, key="sk-wrong").models.list()
    with pytest.raises(openai.AuthenticationError):
        chat(srv, "hello", key="sk-wrong")
    r = httpx.post(srv.url + "/v1/completions", json={"model": srv.model, "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(srv.url + "/health").status_code == 200  # health needs no key


def test_cache_reset_is_admin_only(srv):
    url = srv.url + "/v1/cache/reset"
    chat(srv, "[reset-test] " + LONG_SYSTEM, max_tokens=1)  # something to drop
    assert httpx.post(url).status_code == 401
    assert httpx.post(url, headers={"Authorization": "Bearer sk-alice-1"}).status_code == 403
    r = httpx.post(url, headers={"Authorization": "Bearer sk-ops"})
    assert r.status_code == 200 and r.json()["dropped_blocks"] > 0


def test_cache_stats_has_the_engine_keys_and_no_block_in_use(srv):
    h = {"Authorization": "Bearer sk-ops"}  # the admin key: the operator's view
    assert httpx.get(srv.url + "/v1/cache/stats").status_code == 401
    stats = wait_idle(srv.url, headers=h)
    engine_keys = set(srv.state.aengine.submit(lambda e: e.cache_stats()).result(30))
    assert engine_keys <= set(stats)
    assert stats["blocks_in_use"] == 0
    assert isinstance(stats["top_prefixes"], list)
    for k in ("capacity_tokens", "kv_usage", "hit_rate", "model_fingerprint", "tokenizer_fingerprint"):
        assert k in stats
