"""A hostile tenant against the real server (tiny random-weight model, real HTTP): no excerpt,
miss reason, stat or metric tells one tenant anything about another tenant's prompts beyond the
configured shared window; oversized and unencodable bodies are refused cleanly."""

from __future__ import annotations

import json
import os
import random
import re

import httpx
import pytest

from hotprefix.config.sections import ServerConfig
from server_support import LiveServer, tiny_config, wait_idle

BS = 16
SHARED = 32  # two shared blocks for the "shared" tenants
ADMIN = "sk-admin"
KEYS = {"sk-alice": "alice", "sk-bob": "bob", "sk-carol": "carol",
        "sk-sa": {"tenant": "sa", "shared_prefix_tokens": SHARED},
        "sk-sb": {"tenant": "sb", "shared_prefix_tokens": SHARED}}
SECRET = " internal note: escalation code ZETA-7781, vault PIN 4321, never tell the customer."


@pytest.fixture(scope="module")
def srv(tiny_model_dir, tmp_path_factory, default_tokenizer):
    d = tmp_path_factory.mktemp("sec")
    keys = d / "keys.json"
    keys.write_text(json.dumps(KEYS))
    cfg = tiny_config(tiny_model_dir, state_dir=str(d / "state"), max_model_len=1024)
    with LiveServer(cfg, ServerConfig(api_keys=str(keys), admin_key=ADMIN,
                                      max_request_bytes=64 * 1024)) as s:
        s.tokenizer = default_tokenizer
        s.state_path = str(d / "state")
        yield s


def h(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def complete(srv, key: str, prompt, **kw) -> httpx.Response:
    body = {"model": srv.model, "prompt": prompt, "max_tokens": 1, "temperature": 0, **kw}
    r = httpx.post(srv.url + "/v1/completions", json=body, headers=h(key), timeout=60)
    assert r.status_code == 200, r.text
    return r


def report(r: httpx.Response) -> dict:
    return r.json()["hotprefix"]["cache"]


def ids(srv, text: str) -> list[int]:
    return srv.tokenizer.encode(text, add_special_tokens=False)


def words(seed: int, n: int) -> list[int]:
    """n ordinary token ids (a private prompt nobody else can guess)."""
    rng = random.Random(seed)
    return [1000 + rng.randrange(20000) for _ in range(n)]


def test_excerpt_never_shows_another_tenants_text_past_the_shared_window(srv):
    public = ids(srv, "You are the support assistant of Harbor Logistics. Answer politely and briefly, "
                      "in plain English, about shipping, containers, customs paperwork, warehouse "
                      "opening hours and the internal tools of the company.")
    assert len(public) >= SHARED
    a_prompt = public[:SHARED] + ids(srv, SECRET) + words(1, 40)
    complete(srv, "sk-sa", a_prompt)
    # tenant sb: the same first 31 tokens, then something else
    b_prompt = public[:SHARED - 1] + ids(srv, " Tell me about your opening hours on Saturdays please.")
    rep = report(complete(srv, "sk-sb", b_prompt))
    assert rep["miss_reason"] == "diverged"  # inside the shared window: allowed, and useful
    assert rep["miss_position"] == SHARED - 1
    text = json.dumps(rep)
    for secret_word in ("ZETA", "7781", "4321", "PIN", "vault", "escalation"):
        assert secret_word not in text, rep
    # what sb sees cached is only shared-window text
    cached = rep["detail"]["cached_excerpt"]
    assert cached.startswith(srv.tokenizer.decode(public[SHARED - 13:SHARED - 1], skip_special_tokens=False))


def test_excerpt_without_a_shared_window_shows_nothing_of_another_tenant(srv):
    a_prompt = words(2, 20) + ids(srv, SECRET) + words(3, 20)
    complete(srv, "sk-alice", a_prompt)
    guess = a_prompt[:40] + [a_prompt[40] + 1] + a_prompt[41:]
    rep = report(complete(srv, "sk-bob", guess))
    assert rep["miss_reason"] == "cold" and rep["cached_tokens"] == 0
    assert "ZETA" not in json.dumps(rep) and "excerpt" not in json.dumps(rep)


def _visible(r: httpx.Response) -> tuple:
    rep = report(r)
    usage = r.json()["usage"]
    return (json.dumps(rep, sort_keys=True), r.headers["x-hotprefix-cache"],
            usage["prompt_tokens_details"], usage["prompt_tokens"])


def test_guessing_another_tenants_prompt_block_by_block_gets_the_same_answer(srv):
    secret = words(4, 6 * BS + 5)
    complete(srv, "sk-alice", secret)
    for nblocks in (1, 2, 4, 6):
        right = secret[:nblocks * BS] + [7] * (BS + 3)
        wrong = secret[:nblocks * BS - 1] + [(secret[nblocks * BS - 1] + 1) % 30000] + [7] * (BS + 3)
        # each guess goes first to a fresh tenant view (bob never writes these guesses: cache none)
        r_right = complete(srv, "sk-bob", right, hotprefix={"cache": "none"})
        r_wrong = complete(srv, "sk-bob", wrong, hotprefix={"cache": "none"})
        assert _visible(r_right) == _visible(r_wrong), nblocks
        assert report(r_right)["miss_reason"] == "cold"
    # the whole prompt, as alice sent it
    assert report(complete(srv, "sk-bob", secret, hotprefix={"cache": "none"}))["miss_reason"] == "cold"
    # bob's own stats hold no trace of the match; the operator's do, aggregated
    bob = httpx.get(srv.url + "/v1/cache/stats", headers=h("sk-bob")).json()
    assert "salt" not in json.dumps(bob)
    admin = httpx.get(srv.url + "/v1/cache/stats", headers=h(ADMIN)).json()
    assert admin["requests_by_reason"].get("salt", 0) >= 5
    assert admin["tenants"]["bob"]["requests_by_reason"].get("salt", 0) == 0


def test_after_reset_and_restart_a_third_tenant_hears_cold(srv, tiny_model_dir, tmp_path):
    secret = words(5, 3 * BS + 2)
    complete(srv, "sk-alice", secret)
    assert httpx.post(srv.url + "/v1/cache/reset", headers=h(ADMIN)).status_code == 200
    rep = report(complete(srv, "sk-carol", secret, hotprefix={"cache": "none"}))
    assert rep["miss_reason"] == "cold"
    # alice herself: the reset dropped her blocks and the memory of them
    assert report(complete(srv, "sk-alice", secret))["miss_reason"] == "cold"
    wait_idle(srv.url, headers=h(ADMIN))
    # a restart on the same state directory: carol still hears nothing about alice
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(KEYS))
    cfg = tiny_config(tiny_model_dir, state_dir=srv.state_path, max_model_len=1024)
    with LiveServer(cfg, ServerConfig(api_keys=str(keys), admin_key=ADMIN)) as s2:
        s2.tokenizer = srv.tokenizer
        assert report(complete(s2, "sk-carol", secret))["miss_reason"] == "cold"
        # alice's own blocks were cached before the restart: she is told they are gone
        assert report(complete(s2, "sk-alice", secret))["miss_reason"] == "evicted"


def test_a_tenant_reads_only_its_own_stats(srv):
    before = httpx.get(srv.url + "/v1/cache/stats", headers=h("sk-carol")).json()
    complete(srv, "sk-alice", words(6, 40))
    complete(srv, "sk-alice", words(6, 40))
    after = httpx.get(srv.url + "/v1/cache/stats", headers=h("sk-carol")).json()
    assert after["view"] == "tenant"
    assert after["requests"] == before["requests"]  # alice's traffic does not move carol's figures
    for key in ("top_prefixes", "tenants", "blocks_in_use", "blocks_cached", "kv_usage", "evictions",
                "running", "waiting"):
        assert key not in after, key
    complete(srv, "sk-carol", words(7, 40))
    mine = httpx.get(srv.url + "/v1/cache/stats", headers=h("sk-carol")).json()
    assert mine["requests"] == before["requests"] + 1
    admin = httpx.get(srv.url + "/v1/cache/stats", headers=h(ADMIN)).json()
    assert admin["view"] == "operator" and "top_prefixes" in admin
    assert {"alice", "carol"} <= set(admin["tenants"])
    assert admin["requests"] > mine["requests"]


def test_metrics_need_the_admin_key(srv):
    assert httpx.get(srv.url + "/metrics").status_code == 401
    assert httpx.get(srv.url + "/metrics", headers=h("sk-bob")).status_code == 403
    r = httpx.get(srv.url + "/metrics", headers=h(ADMIN))
    assert r.status_code == 200 and "hotprefix_prefix_cache_queries" in r.text
    assert "hotprefix_state_write_failures" in r.text


def test_public_metrics_show_no_cross_tenant_row(tiny_model_dir, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(KEYS))
    cfg = tiny_config(tiny_model_dir)
    with LiveServer(cfg, ServerConfig(api_keys=str(keys), public_metrics=True)) as s:
        prompt = list(range(1000, 1000 + 3 * BS + 1))
        complete(s, "sk-alice", prompt)
        complete(s, "sk-bob", prompt)
        r = httpx.get(s.url + "/metrics")
        assert r.status_code == 200
        assert 'reason="cold"' in r.text and 'reason="salt"' not in r.text
        admin_view = s.state.aengine.submit(lambda e: e.cache_stats()).result(30)
        assert admin_view["requests_by_reason"].get("salt") == 1  # the operator still has it


def _miss_metrics(s) -> dict[str, float]:
    text = httpx.get(s.url + "/metrics").text
    return {m[0]: float(m[1]) for m in re.findall(
        r'^hotprefix_prefix_cache_miss_tokens_total\{reason="(\w+)"\} (\S+)$', text, re.M)}


def test_public_metrics_move_alike_for_a_right_and_a_wrong_guess(tiny_model_dir, tmp_path):
    """With --public-metrics, an attacker sharing a window with its victim guesses the text after
    it: its own report says ``extended`` (or ``diverged``, after it cached a decoy) either way, and
    the miss counters must move the same way too. They had counted a right guess (another
    tenant's tokens: the operator's ``salt``) under ``cold``, a wrong one under the reason told."""
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(KEYS))
    with LiveServer(tiny_config(tiny_model_dir), ServerConfig(api_keys=str(keys),
                                                              public_metrics=True)) as s:
        window = words(40, SHARED)
        secret = words(41, 2 * BS)
        complete(s, "sk-sa", window + secret + [7])  # the victim caches window + secret

        def moved(prompt) -> dict[str, float]:
            before = _miss_metrics(s)
            r = complete(s, "sk-sb", prompt, hotprefix={"cache": "none"})
            after = _miss_metrics(s)
            moves = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
            return {"told": report(r)["miss_reason"], **moves}

        for told in ("extended", "diverged"):
            if told == "diverged":  # the attacker's own decoy: its guesses diverge from it at 4
                complete(s, "sk-sb", window + secret[:4] + words(42, 2 * BS - 4) + [7])
            right = moved(window + secret + [7])
            wrong = moved(window + secret[:4] + words(43, 2 * BS - 4) + [7])
            assert right == wrong, (right, wrong)
            assert right["told"] == told and set(right) == {"told", told}
        admin_view = s.state.aengine.submit(lambda e: e.cache_stats()).result(30)
        assert admin_view["requests_by_reason"].get("salt", 0) >= 2  # the operator still sees it


def test_state_files_are_private_and_keyed(srv):
    complete(srv, "sk-alice", words(8, 3 * BS + 1))
    wait_idle(srv.url, headers=h(ADMIN))
    st = srv.state_path
    assert os.stat(st).st_mode & 0o777 == 0o700
    for name in ("ledger.txt", "secret.key"):
        assert os.stat(os.path.join(st, name)).st_mode & 0o777 == 0o600, name
    # the ledger holds no unkeyed content hash: recompute what the old unsalted ledger wrote
    from hotprefix.cache.hashing import BlockHasher
    from hotprefix.cache.manager import CONTENT_ROOT

    content = BlockHasher(CONTENT_ROOT, BS).keys(words(8, 3 * BS + 1), namespace=CONTENT_ROOT)
    text = open(os.path.join(st, "ledger.txt")).read()
    assert text and all(k.hex() not in text and k.hex()[:32] not in text for k in content)


def test_oversized_body_is_413_before_parsing(srv):
    big = {"model": srv.model, "prompt": "x" * (200 * 1024), "max_tokens": 1}
    r = httpx.post(srv.url + "/v1/completions", json=big, headers=h("sk-alice"), timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit applies while the body streams in
        yield b'{"model": "m", "prompt": "'
        for _ in range(100):
            yield b"y" * 1024
        yield b'"}'
    r = httpx.post(srv.url + "/v1/completions", content=chunks(), timeout=30,
                   headers={**h("sk-alice"), "Content-Type": "application/json"})
    assert r.status_code == 413
    assert complete(srv, "sk-alice", "still fine").status_code == 200


@pytest.mark.parametrize("route,body,param", [
    ("/v1/chat/completions", '{"model": "M", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
     "messages[0].content"),
    ("/v1/chat/completions", '{"model": "M", "stream": true, "messages": [{"role": "user", '
     '"content": [{"type": "text", "text": "a\\udfffb"}]}]}', "messages[0].content[0].text"),
    ("/v1/completions", '{"model": "M", "prompt": "a\\ud800b"}', "prompt"),
    ("/v1/completions", '{"model": "M", "prompt": "ok", "stream": true, "stop": ["\\ud83d"]}', "stop"),
    ("/v1/cache/warm", '{"model": "M", "prompts": ["fine", "a\\ud800"]}', "prompts"),
])
def test_lone_surrogates_are_a_400_naming_the_field(srv, route, body, param):
    r = httpx.post(srv.url + route, content=body.replace('"M"', json.dumps(srv.model)),
                   headers={**h("sk-alice"), "Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "surrogate" in err["message"]


def test_text_too_long_for_the_model_is_refused_without_tokenizing(tiny_model_dir, monkeypatch):
    cfg = tiny_config(tiny_model_dir, max_model_len=64)
    with LiveServer(cfg, ServerConfig(max_request_bytes=1024 * 1024)) as s:
        calls = []
        real = s.state.tokenizer.encode
        monkeypatch.setattr(s.state.tokenizer, "encode", lambda *a, **k: calls.append(1) or real(*a, **k))
        big = "word " * (64 * s.state.tokenizer.max_token_bytes // 5 + 10)
        r = httpx.post(s.url + "/v1/completions", json={"model": s.model, "prompt": big}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert calls == []  # refused before the tokenizer saw it
        r = httpx.post(s.url + "/v1/chat/completions", timeout=30,
                       json={"model": s.model, "messages": [{"role": "user", "content": big}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        r = httpx.post(s.url + "/v1/messages", timeout=30,
                       json={"model": s.model, "max_tokens": 4, "messages": [{"role": "user", "content": big}]})
        assert r.status_code == 400 and calls == []
