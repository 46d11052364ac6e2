"""Tool-call formats by family (``server/tool_formats.py``): each family's answers parse whole and
streamed in any pieces (with and without the marker a detokenizer drops), the format is chosen
from the chat template, and on the tiny random model with each family's template a required call
is forced in the family's format and comes back as a valid OpenAI tool call (whole, streamed, and
in the Responses API), with the call and its result rendered back by the template.
"""

from __future__ import annotations

import json
import os

import httpx
import jsonschema
import pytest

from hotprefix.server import tool_formats as F
from hotprefix.server import tools as T
from server_support import LiveServer, tiny_config

TEMPLATES = os.path.join(os.path.dirname(__file__), "data", "templates")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"]}}}
FUNCS = T.parse_tools([WEATHER, TIME])

ANSWERS = {  # family -> (answer text, expected content, expected [(name, arguments)])
    "hermes": [('Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n'
                '</tool_call>', "Sure.", [("get_weather", {"city": "Oslo", "unit": "celsius"})])],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}', None,
         [("get_weather", {"city": "Oslo", "unit": "celsius"})]),
        ('<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}; '
         '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "fahrenheit"}}', None,
         [("get_time", {"zone": "CET"}), ("get_weather", {"city": "Rome", "unit": "fahrenheit"})]),
        ('The weather is {"nice"} today.', 'The weather is {"nice"} today.', []),
        ('{"name": "unknown", "parameters": {}}', '{"name": "unknown", "parameters": {}}', []),
    ],
    "mistral": [
        ('Let me look. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}, '
         '{"name": "get_time", "arguments": {"zone": "CET"}}]', "Let me look.",
         [("get_weather", {"city": "Oslo", "unit": "celsius"}), ("get_time", {"zone": "CET"})]),
        ('[{"name": "get_time", "arguments": {"zone": "UTC"}}]', None, [("get_time", {"zone": "UTC"})]),
        ("[1, 2] is a list.", "[1, 2] is a list.", []),
    ],
}


def _calls(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("family", sorted(ANSWERS))
def test_answers_parse_whole_and_streamed(family):
    fmt = F.FORMATS[family]
    for text, content, calls in ANSWERS[family]:
        got_content, got = fmt.parse(text, FUNCS)
        assert (got_content, _calls(got)) == (content, calls), text
        for step in (1, 3, 7, len(text)):
            s = fmt.stream(FUNCS)
            events = []
            for i in range(0, len(text), step):
                events += s.feed(text[i:i + step])
            events += s.end()
            streamed = "".join(v for k, v in events if k == "content")
            assert (streamed.strip() or None) == (content.strip() if content else None), (text, step)
            assert _calls([v for k, v in events if k == "call"]) == calls, (text, step)


def test_the_format_comes_from_the_template():
    read = lambda name: open(os.path.join(TEMPLATES, name)).read()  # noqa: E731
    assert F.for_template(read("llama3_tools.jinja"), True).name == "llama3_json"
    assert F.for_template(read("mistral_tools.jinja"), True).name == "mistral"
    assert F.for_template(read("hermes_tools.jinja"), True).name == "hermes"
    assert F.for_template(read("mistral_tools.jinja"), False).name == "hermes"  # the server's tool block
    assert F.for_template(None, False).name == "hermes"


@pytest.fixture(scope="module", params=["llama3_json", "mistral", "hermes"])
def family_srv(request, tiny_model_dir):
    name = {"llama3_json": "llama3_tools", "mistral": "mistral_tools", "hermes": "hermes_tools"}[request.param]
    cfg = tiny_config(tiny_model_dir, chat_template=os.path.join(TEMPLATES, name + ".jinja"))
    with LiveServer(cfg) as s:
        s.family = request.param
        yield s


def chat(srv, **body):
    r = httpx.post(srv.url + "/v1/chat/completions", json={"model": srv.model, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r


def test_a_forced_call_in_the_familys_format(family_srv):
    srv = family_srv
    assert srv.state.tool_format.name == srv.family and srv.state.tokenizer.renders_tools
    msgs = [{"role": "user", "content": "Weather in Oslo?"}]
    for parallel in (False, True):
        out = chat(srv, messages=msgs, tools=[WEATHER, TIME], tool_choice="required", max_tokens=120,
                   temperature=1.0, seed=3, parallel_tool_calls=parallel).json()["choices"][0]
        calls = out["message"]["tool_calls"]
        assert out["finish_reason"] == "tool_calls" and calls and (parallel or len(calls) == 1)
        for c in calls:
            schema = {"get_weather": WEATHER, "get_time": TIME}[c["function"]["name"]]["function"]["parameters"]
            jsonschema.validate(json.loads(c["function"]["arguments"]), schema)
    named = chat(srv, messages=msgs, tools=[WEATHER, TIME], max_tokens=120, temperature=1.0, seed=3,
                 tool_choice={"type": "function", "function": {"name": "get_time"}}).json()
    assert [c["function"]["name"] for c in named["choices"][0]["message"]["tool_calls"]] == ["get_time"]
    # streamed: the call arrives in OpenAI's delta shape
    with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=120, json={
            "model": srv.model, "messages": msgs, "tools": [WEATHER], "tool_choice": "required",
            "max_tokens": 120, "seed": 3, "parallel_tool_calls": False, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [tc for ch in chunks for c in ch["choices"] for tc in (c["delta"].get("tool_calls") or [])]
    assert deltas and deltas[0]["function"]["name"] == "get_weather"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # the call and its result go back through the family's template
    back = msgs + [out["message"], {"role": "tool", "tool_call_id": calls[0]["id"], "content": "12 C"}]
    t = httpx.post(srv.url + "/tokenize", json={"messages": back, "tools": [WEATHER, TIME]}).json()
    prompt = srv.state.tokenizer.decode(t["tokens"], skip_special_tokens=False)
    assert "12 C" in prompt and calls[0]["function"]["name"] in prompt
    assert chat(srv, messages=back, tools=[WEATHER, TIME], max_tokens=2).json()["usage"]["prompt_tokens"] == t["count"]


def test_responses_api_calls_in_the_familys_format(family_srv):
    srv = family_srv
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    r = httpx.post(srv.url + "/v1/responses", timeout=120, json={
        "model": srv.model, "input": "Weather in Oslo?", "tools": [tool], "tool_choice": "required",
        "parallel_tool_calls": False, "max_output_tokens": 120}).json()
    calls = [o for o in r["output"] if o["type"] == "function_call"]
    assert calls and calls[0]["name"] == "get_weather" and calls[0]["call_id"].startswith("call_")
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])
    nxt = httpx.post(srv.url + "/v1/responses", timeout=120, json={
        "model": srv.model, "previous_response_id": r["id"], "tools": [tool], "max_output_tokens": 2,
        "input": [{"type": "function_call_output", "call_id": calls[0]["call_id"], "output": "12 C"}]}).json()
    assert nxt["hotprefix"]["continuation"]["mode"] == "stored_tokens"  # a tool result appends
    assert nxt["hotprefix"]["cache"]["miss_reason"] in ("hit", "extended")
    user = httpx.post(srv.url + "/v1/responses", timeout=120, json={
        "model": srv.model, "previous_response_id": nxt["id"], "tools": [tool], "max_output_tokens": 2,
        "input": "And tomorrow?"}).json()
    how, rep = user["hotprefix"]["continuation"], user["hotprefix"]["cache"]
    assert how["mode"] == "stored_tokens" and rep["miss_reason"] in ("hit", "extended")
    want = (nxt["usage"]["input_tokens"] + nxt["usage"]["output_tokens"] - 1) // srv.state.block_size
    assert user["usage"]["input_tokens_details"]["cached_tokens"] == want * srv.state.block_size
    # Mistral's template moves the tools to the last user turn: a re-rendered history would differ
    # from what the model saw; the stored tokens are kept, and the answer says so
    assert how.get("template_rewrites_history", False) == (srv.family == "mistral")
