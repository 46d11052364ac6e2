"""The Responses API on the tiny random-weight model: OpenAI's shapes (whole and streamed, through
the official client), token-exact ``previous_response_id`` continuations that hit every earlier
token where a re-rendered history does not, a resent history continuing the same way, stored
responses per tenant (a hostile tenant gets the 404 of an id that never existed), bounded with
counted eviction, kept across a restart in the state directory (files 0600), deletable, and
``store: false`` keeping nothing; background responses and their cancellation.
"""

from __future__ import annotations

import json
import os
import stat

import httpx
import openai
import pytest

from hotprefix.config.sections import ServerConfig
from server_support import LiveServer, tiny_config, wait_idle

KEYS = os.path.join(os.path.dirname(__file__), "data", "server", "api_keys.json")
ALICE, BOB, OPS = "sk-alice-1", "sk-bob", "sk-ops"


@pytest.fixture(scope="module")
def srv(tiny_model_dir, tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    cfg = tiny_config(tiny_model_dir, state_dir=str(state))
    with LiveServer(cfg, ServerConfig(api_keys=KEYS)) as s:
        s.state_path = str(state)
        yield s


def post(srv, body, key=ALICE, **kw):
    return httpx.post(srv.url + "/v1/responses", json={"model": srv.model, **body},
                      headers={"Authorization": f"Bearer {key}"}, timeout=120, **kw)


def client(srv, key=ALICE) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=120)


def computed_blocks(n_prompt: int, n_out: int, block: int) -> int:
    """Tokens of the full blocks a finished request computed (its last sampled token is never
    fed back, so its K/V are not computed)."""
    return (n_prompt + n_out - 1) // block * block


def test_shape_through_the_official_client(srv):
    c = client(srv)
    r = c.responses.create(model=srv.model, input="Name three colours.", instructions="Be brief.",
                           max_output_tokens=8, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in r.output] == ["message"] and r.output[0].content[0].type == "output_text"
    assert r.output_text == r.output[0].content[0].text and r.output_text
    assert r.usage.output_tokens == 8 and r.usage.input_tokens_details.cached_tokens == 0
    extra = r.model_extra["hotprefix"]
    assert extra["cache"]["computed_tokens"] == r.usage.input_tokens
    assert extra["continuation"] == {"mode": "new"}
    again = c.responses.retrieve(r.id)
    assert again.output_text == r.output_text and again.usage.input_tokens == r.usage.input_tokens


def test_stream_event_sequence_and_the_stored_answer(srv):
    c = client(srv)
    events = list(c.responses.create(model=srv.model, input="Count to five.", max_output_tokens=6,
                                     temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == 6
    assert c.responses.retrieve(final.id).output_text == text


def test_continuation_is_token_exact_where_re_rendering_is_not(srv):
    """Three turns through previous_response_id: each prompt starts with the previous prompt and
    the sampled ids, so every full block computed before hits. The same conversation resent as
    chat text re-tokenizes the answers (the random weights' greedy answers are token pieces that
    the BPE merges differently: ``test_re_tokenizing_a_sampled_answer_differs``) and stops hitting
    inside the first answer."""
    bs = srv.state.block_size
    prev, stored = None, None
    for turn, text in enumerate(["Tell me a story.", "Go on.", "And then?"]):
        body = {"input": text, "max_output_tokens": 24, "temperature": 0}
        if prev is not None:
            body["previous_response_id"] = prev["id"]
        r = post(srv, body).json()
        rep, how = r["hotprefix"]["cache"], r["hotprefix"]["continuation"]
        if prev is not None:
            assert how == {"mode": "stored_tokens", "from": prev["id"], "reused_tokens": len(stored)}
            want = computed_blocks(prev["usage"]["input_tokens"], prev["usage"]["output_tokens"], bs)
            assert r["usage"]["input_tokens_details"]["cached_tokens"] == want, (turn, rep)
            assert rep["miss_reason"] in ("hit", "extended")  # never the client's fault
        prev = r
        rec = srv.state.responses.get(srv.state.responses.owner_key("alice"), r["id"])
        stored = rec.token_ids
    msgs = [{"role": m["role"], "content": m["content"]} for m in rec.conversation]
    chat = httpx.post(srv.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {ALICE}"},
                      json={"model": srv.model, "messages": msgs, "max_tokens": 1}, timeout=120).json()
    crep = chat["hotprefix"]["cache"]
    assert crep["miss_reason"] == "diverged" and crep["cached_tokens"] < len(stored) - 2 * bs, crep
    assert wait_idle(srv.url, headers={"Authorization": f"Bearer {OPS}"})["blocks_in_use"] == 0


def test_re_tokenizing_a_sampled_answer_differs(srv):
    """The premise, shown on one answer: its sampled ids are not what its text tokenizes to."""
    tok = srv.state.tokenizer
    r = post(srv, {"input": "Say something.", "max_output_tokens": 32, "temperature": 0}).json()
    rec = srv.state.responses.get(srv.state.responses.owner_key("alice"), r["id"])
    sampled = rec.token_ids[r["usage"]["input_tokens"]:]
    sampled = [t for t in sampled if t not in tok.eos_token_ids]
    assert tok.encode(tok.decode(sampled), add_special_tokens=False) != sampled


def test_a_resent_history_continues_from_the_stored_tokens(srv):
    """The Agents SDK's default: the whole history resent as items, the model's own output items
    (with their ids) among them: the prompt still starts with the stored ids."""
    bs = srv.state.block_size
    first = post(srv, {"input": [{"role": "user", "content": "Plan a trip."}], "instructions": "Be helpful.",
                       "max_output_tokens": 20, "temperature": 1.0}).json()
    items = [{"role": "user", "content": "Plan a trip."}] + first["output"] + [
        {"role": "user", "content": "Shorter please."}]
    r = post(srv, {"input": items, "instructions": "Be helpful.", "max_output_tokens": 4}).json()
    assert r["hotprefix"]["continuation"]["mode"] == "stored_tokens"
    want = computed_blocks(first["usage"]["input_tokens"], first["usage"]["output_tokens"], bs)
    assert r["usage"]["input_tokens_details"]["cached_tokens"] == want
    # a changed history is rendered again (and says why not)
    items[0] = {"role": "user", "content": "Plan a long trip."}
    r = post(srv, {"input": items, "instructions": "Be helpful.", "max_output_tokens": 4}).json()
    assert r["hotprefix"]["continuation"] == {"mode": "new"}
    # new instructions: re-rendered, the reason named
    r = post(srv, {"input": "More.", "previous_response_id": first["id"], "instructions": "Be terse.",
                   "max_output_tokens": 4}).json()
    assert r["hotprefix"]["continuation"] == {"mode": "re_rendered", "from": first["id"],
                                              "reason": "instructions_changed"}


def test_a_hostile_tenant_gets_the_404_of_an_id_that_never_existed(srv):
    mine = post(srv, {"input": "secret plans", "max_output_tokens": 2}).json()["id"]
    ghost = "resp_" + "0" * 32
    h = {"Authorization": f"Bearer {BOB}"}
    for rid in (mine, ghost):
        answers = [httpx.get(f"{srv.url}/v1/responses/{rid}", headers=h),
                   httpx.post(f"{srv.url}/v1/responses/{rid}/cancel", headers=h),
                   httpx.delete(f"{srv.url}/v1/responses/{rid}", headers=h),
                   post(srv, {"input": "continue", "previous_response_id": rid, "max_output_tokens": 2}, key=BOB)]
        bodies = [(a.status_code, json.dumps(a.json()).replace(rid, "ID")) for a in answers]
        if rid == mine:
            mine_bodies = bodies
        else:
            assert bodies == mine_bodies  # the same status and body, word for word
    assert all(code == 404 for code, _ in mine_bodies)
    assert "secret" not in json.dumps(mine_bodies)
    # no listing either: there is no route that enumerates responses
    assert httpx.get(f"{srv.url}/v1/responses", headers=h).status_code in (404, 405)
    # and the owner still has it, under any of its keys
    assert httpx.get(f"{srv.url}/v1/responses/{mine}", headers={"Authorization": "Bearer sk-alice-2"}).status_code == 200


def test_store_false_keeps_nothing_and_delete_removes_the_file(srv):
    before = set(os.listdir(os.path.join(srv.state_path, "responses")))
    r = post(srv, {"input": "ephemeral", "max_output_tokens": 2, "store": False}).json()
    assert httpx.get(f"{srv.url}/v1/responses/{r['id']}", headers={"Authorization": f"Bearer {ALICE}"}).status_code == 404
    assert set(os.listdir(os.path.join(srv.state_path, "responses"))) == before
    r = post(srv, {"input": "kept", "max_output_tokens": 2}).json()
    path = os.path.join(srv.state_path, "responses", r["id"] + ".json")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    d = httpx.delete(f"{srv.url}/v1/responses/{r['id']}", headers={"Authorization": f"Bearer {ALICE}"}).json()
    assert d == {"id": r["id"], "object": "response.deleted", "deleted": True}
    assert not os.path.exists(path)
    cont = post(srv, {"input": "x", "previous_response_id": r["id"], "max_output_tokens": 2})
    assert cont.status_code == 404


def test_background_response_and_cancel(srv):
    h = {"Authorization": f"Bearer {ALICE}"}
    done = post(srv, {"input": "hi", "max_output_tokens": 3, "background": True}).json()
    assert done["status"] in ("queued", "in_progress") and done["background"] is True
    long = post(srv, {"input": "write forever", "max_output_tokens": 1500, "background": True}).json()
    c = httpx.post(f"{srv.url}/v1/responses/{long['id']}/cancel", headers=h).json()
    assert c["status"] in ("cancelled", "completed", "incomplete")
    got = httpx.get(f"{srv.url}/v1/responses/{long['id']}", headers=h).json()
    assert got["status"] == c["status"]
    # a foreground response is not cancellable
    fg = post(srv, {"input": "hi", "max_output_tokens": 2}).json()
    assert httpx.post(f"{srv.url}/v1/responses/{fg['id']}/cancel", headers=h).status_code == 400
    stats = wait_idle(srv.url, headers={"Authorization": f"Bearer {OPS}"})
    assert stats["blocks_in_use"] == 0
    got = httpx.get(f"{srv.url}/v1/responses/{done['id']}", headers=h).json()
    assert got["status"] == "incomplete" and got["usage"]["output_tokens"] == 3


def test_bad_requests_name_the_field(srv):
    cases = [({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
              "input[0].content[0].type"),
             ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
             ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "strng"}}}},
              "response_format"),
             ({"input": "x", "background": True, "store": False}, "background")]
    for body, param in cases:
        r = post(srv, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()


def test_stored_responses_survive_a_restart_and_are_bounded(tiny_model_dir, tmp_path):
    cfg = tiny_config(tiny_model_dir, state_dir=str(tmp_path))
    with LiveServer(cfg, ServerConfig(max_stored_responses=2)) as s:
        ids = [post(s, {"input": f"turn {i}", "max_output_tokens": 2}).json()["id"] for i in range(3)]
        metrics = httpx.get(s.url + "/metrics").text
        assert "hotprefix_responses_evicted_total 1.0" in metrics
        assert "hotprefix_responses_stored 2.0" in metrics
        assert httpx.get(f"{s.url}/v1/responses/{ids[0]}").status_code == 404  # the oldest went
        kept = httpx.get(f"{s.url}/v1/responses/{ids[2]}").json()
    with LiveServer(cfg, ServerConfig(max_stored_responses=2)) as s:
        assert httpx.get(f"{s.url}/v1/responses/{ids[2]}").json() == kept
        r = post(s, {"input": "next", "previous_response_id": ids[2], "max_output_tokens": 2}).json()
        assert r["hotprefix"]["continuation"]["mode"] == "stored_tokens"
    assert sorted(os.listdir(tmp_path / "responses")) == sorted(f"{i}.json" for i in (ids[2], r["id"]))
