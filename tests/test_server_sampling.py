"""The real server on the tiny random model, driven by the official ``openai`` client: n > 1 on one
prefill (chat and completions, stream and not), best_of, log probabilities in OpenAI's shapes
(streaming included), echo, logit_bias and penalties, their 400s, no block left after a client
leaves a multi-choice stream."""

from __future__ import annotations

import httpx
import openai
import pytest

from hotprefix.config.sections import ServerConfig
from server_support import LiveServer, tiny_config, wait_idle


@pytest.fixture(scope="module")
def srv(tiny_model_dir):
    cfg = tiny_config(tiny_model_dir, max_model_len=512, block_size=16, dtype="float32")
    with LiveServer(cfg, ServerConfig()) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)


def stats(srv):
    return httpx.get(srv.url + "/v1/cache/stats", timeout=10).json()


def words(tag, n=60):
    return " ".join(f"{tag}{i}" for i in range(n))


def chat(client, srv, content, **kw):
    return client.chat.completions.create(model=srv.model, messages=[{"role": "user", "content": content}],
                                          **kw)


# ---------------------------------------------------------------- n > 1

def test_chat_n4_computes_the_prompt_once_and_repeats_with_its_seed(client, srv):
    one = chat(client, srv, words("alpha"), max_tokens=5, temperature=1.0, seed=3)
    before = stats(srv)
    four = chat(client, srv, words("gamma"), max_tokens=5, temperature=1.0, seed=3, n=4,
                logprobs=True, extra_body={"ignore_eos": True})
    after = stats(srv)
    assert [c.index for c in four.choices] == [0, 1, 2, 3]
    assert len({c.message.content for c in four.choices}) >= 3  # distinct at temperature 1
    # the same number of prompt tokens, computed once: one request in the stats, one report
    assert four.usage.prompt_tokens == one.usage.prompt_tokens
    assert after["requests"] - before["requests"] == 1
    assert after["queries_tokens"] - before["queries_tokens"] == four.usage.prompt_tokens
    rep, rep1 = four.model_extra["hotprefix"]["cache"], one.model_extra["hotprefix"]["cache"]
    for r in (rep, rep1):  # (the chat template's fixed opening may be cached: the same for both)
        assert r["computed_tokens"] + r["cached_tokens"] == one.usage.prompt_tokens
        assert r["written_blocks"] == (one.usage.prompt_tokens - r["cached_tokens"]) // 16
    assert four.usage.completion_tokens == sum(len(c.logprobs.content) for c in four.choices) == 20
    again = chat(client, srv, words("gamma"), max_tokens=5, temperature=1.0, seed=3, n=4)
    assert [c.message.content for c in again.choices] == [c.message.content for c in four.choices]
    two = chat(client, srv, words("gamma"), max_tokens=5, temperature=1.0, seed=3, n=2)
    assert [c.message.content for c in two.choices] == [c.message.content for c in four.choices[:2]]
    assert wait_idle(srv.url)["blocks_in_use"] == 0


def test_completions_n_streams_each_choice_as_the_whole_answer(client, srv):
    kw = dict(model=srv.model, prompt=words("delta"), max_tokens=6, temperature=1.0, seed=8, n=3)
    whole = client.completions.create(**kw)
    texts = {0: "", 1: "", 2: ""}
    reasons: dict[int, list] = {0: [], 1: [], 2: []}
    for ev in client.completions.create(stream=True, **kw):
        for c in ev.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                reasons[c.index].append(c.finish_reason)
    assert texts == {c.index: c.text for c in whole.choices}
    assert all(r == [whole.choices[i].finish_reason] for i, r in reasons.items())


def test_chat_stream_n2_with_logprobs_equals_the_whole_answer(client, srv):
    kw = dict(max_tokens=6, temperature=0.7, seed=2, n=2, logprobs=True, top_logprobs=3)
    whole = chat(client, srv, words("eps"), **kw)
    got: dict[int, list] = {0: [], 1: []}
    text = {0: "", 1: ""}
    roles = set()
    for ev in chat(client, srv, words("eps"), stream=True, **kw):
        for c in ev.choices:
            if c.delta.role:
                roles.add(c.index)
            text[c.index] += c.delta.content or ""
            if c.logprobs is not None:
                got[c.index] += [(t.token, round(t.logprob, 5), [a.token for a in t.top_logprobs])
                                 for t in c.logprobs.content]
    assert roles == {0, 1}
    for ch in whole.choices:
        assert text[ch.index] == ch.message.content
        assert got[ch.index] == [(t.token, round(t.logprob, 5), [a.token for a in t.top_logprobs])
                                 for t in ch.logprobs.content]
        assert len(ch.logprobs.content) == 6


def test_best_of_returns_the_most_likely(client, srv):
    kw = dict(model=srv.model, prompt=words("zeta"), max_tokens=4, temperature=1.0, seed=5)
    best = client.completions.create(best_of=4, n=2, **kw)
    every = client.completions.create(n=4, logprobs=0, **kw)
    total = sorted(((sum(c.logprobs.token_logprobs), c.text) for c in every.choices), reverse=True)
    assert [c.text for c in best.choices] == [t for _, t in total[:2]]


def test_client_leaving_a_multi_choice_stream_frees_every_block(srv):
    body = {"model": srv.model, "prompt": words("eta"), "max_tokens": 400, "ignore_eos": True,
            "temperature": 1.0, "n": 3, "stream": True}
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", srv.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for i, _ in enumerate(r.iter_lines()):
                if i > 12:
                    break
    assert wait_idle(srv.url)["blocks_in_use"] == 0


# ---------------------------------------------------------------- log probabilities

def test_chat_top_logprobs_shape_and_greedy_maximum(client, srv):
    r = chat(client, srv, words("theta"), max_tokens=5, temperature=0, logprobs=True, top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        tops = [a.logprob for a in t.top_logprobs]
        assert len(tops) == 5 and tops == sorted(tops, reverse=True) and all(v <= 0 for v in tops)
        assert t.logprob == tops[0] and t.token == t.top_logprobs[0].token  # greedy: the top one
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token or "\ufffd" in t.token
    plain = chat(client, srv, words("theta"), max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completions_echo_with_logprobs(client, srv):
    prompt = words("iota", 30)
    r = client.completions.create(model=srv.model, prompt=prompt, max_tokens=3, temperature=0,
                                  echo=True, logprobs=2)
    c = r.choices[0]
    lp = c.logprobs
    n = r.usage.prompt_tokens + r.usage.completion_tokens
    assert c.text.startswith(prompt) and len(lp.tokens) == len(lp.token_logprobs) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(2 <= len(t) <= 3 for t in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert r.model_extra["hotprefix"]["cache"]["miss_reason"] == "read_skipped"
    plain = client.completions.create(model=srv.model, prompt=prompt, max_tokens=3, temperature=0,
                                      logprobs=2)
    assert plain.choices[0].logprobs.tokens == lp.tokens[r.usage.prompt_tokens:]
    only_echo = client.completions.create(model=srv.model, prompt=prompt, max_tokens=3,
                                          temperature=0, echo=True)
    assert only_echo.choices[0].text == c.text and only_echo.choices[0].logprobs is None
    streamed = "".join(ev.choices[0].text for ev in client.completions.create(
        model=srv.model, prompt=prompt, max_tokens=3, temperature=0, echo=True, stream=True))
    assert streamed == c.text


# ---------------------------------------------------------------- penalties and logit_bias

def test_logit_bias_bans_and_forces_tokens_and_penalties_are_accepted(client, srv):
    prompt = words("kappa", 20)
    kw = dict(model=srv.model, prompt=prompt, max_tokens=6, temperature=0, logprobs=0)
    first = client.completions.create(**kw).choices[0].logprobs.tokens[0]
    tok = srv.state.tokenizer
    same = [i for i in range(tok.vocab_size) if tok.decode([i], skip_special_tokens=False) == first]
    assert same
    banned = client.completions.create(logit_bias={str(i): -100 for i in same}, **kw)
    assert first not in banned.choices[0].logprobs.tokens
    forced = client.completions.create(logit_bias={"777": 100}, **{**kw, "temperature": 1.0})
    assert forced.choices[0].logprobs.tokens == [tok.decode([777])] * 6
    pen = client.completions.create(presence_penalty=1.5, frequency_penalty=-0.5,
                                    extra_body={"repetition_penalty": 1.2}, **kw)
    assert pen.choices[0].text


BAD = [
    ("chat", {"n": 0}, "n"), ("chat", {"n": 65}, "n"), ("chat", {"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"), ("chat", {"presence_penalty": 2.5}, "presence_penalty"),
    ("chat", {"frequency_penalty": -3}, "frequency_penalty"), ("chat", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("chat", {"logit_bias": {"5": 150}}, "logit_bias"), ("chat", {"logit_bias": {"99999999": 1}}, "logit_bias"),
    ("chat", {"repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"logprobs": 6}, "logprobs"), ("completions", {"best_of": 1, "n": 2}, "best_of"),
    ("completions", {"best_of": 3, "stream": True}, "best_of"), ("completions", {"best_of": 99}, "best_of"),
]


@pytest.mark.parametrize("route,change,param", BAD, ids=[f"{r}-{p}-{i}" for i, (r, _, p) in enumerate(BAD)])
def test_out_of_range_is_a_400_naming_the_parameter(srv, route, change, param):
    body = {"model": srv.model, "max_tokens": 2, **change}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    r = httpx.post(f"{srv.url}/v1/{'chat/completions' if route == 'chat' else 'completions'}",
                   json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_logprobs_do_not_show_whether_another_tenant_cached_the_prompt(tiny_model_dir):
    """bob's choices and log probabilities are the same whether alice cached his prompt or not."""
    import os

    keys = os.path.join(os.path.dirname(__file__), "data", "server", "api_keys.json")
    cfg = tiny_config(tiny_model_dir, max_model_len=512, block_size=16, dtype="float32")
    with LiveServer(cfg, ServerConfig(api_keys=keys)) as s:
        def ask(key):
            c = openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0, timeout=60)
            r = c.completions.create(model=s.model, prompt=words("omega"), max_tokens=4, n=2,
                                     temperature=1.0, seed=1, logprobs=3)
            return [(ch.text, ch.logprobs.token_logprobs, ch.logprobs.top_logprobs)
                    for ch in r.choices], r.usage.prompt_tokens_details.cached_tokens

        ask("sk-alice-1")  # alice caches the prompt
        with_alice, cached = ask("sk-bob")
        assert cached == 0
        reset = httpx.post(s.url + "/v1/cache/reset", headers={"Authorization": "Bearer sk-ops"},
                           timeout=30)
        assert reset.status_code == 200 and reset.json()["dropped_blocks"] > 0
        alone, cached = ask("sk-bob")
        assert cached == 0 and alone == with_alice
