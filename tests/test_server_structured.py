"""Structured outputs and tools through the real server and the real default model, driven by the
official ``openai`` client: json_schema outputs validate, vLLM's guided_* fields hold, a schema
that does not compile is a 400 naming its error, tool_choice required / named gives valid calls,
a tool result goes back in, tool calls stream in OpenAI's delta shape, a constrained greedy answer
is the same alone, batched and from cache, and one tenant's schemas stay its own.

One server for the module (model loaded once).
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from server_support import LONG_SYSTEM, default_model_server, wait_idle

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def srv():
    with default_model_server() as s:
        yield s


def client(srv, key="sk-alice-1") -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=120)


def ask(srv, user, key="sk-alice-1", system=None, **kw):
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    kw.setdefault("max_tokens", 80)
    kw.setdefault("temperature", 0)
    return client(srv, key).chat.completions.create(model=srv.model, messages=msgs, **kw)


def schema_format(schema, name="answer"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                      "age": {"type": "integer", "minimum": 18, "maximum": 90}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "sizes": {"type": "array", "items": {"type": "integer", "minimum": 1,
                                                                           "maximum": 9},
                                                "minItems": 1, "maxItems": 3}},
     "required": ["color", "sizes"], "additionalProperties": False},
    {"type": "object", "properties": {
        "city": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                  "code": {"type": "string", "pattern": "^[A-Z]{3}$"}},
                 "required": ["name", "code"], "additionalProperties": False},
        "open": {"type": "boolean"}},
     "required": ["city", "open"], "additionalProperties": False},
]


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_json_schema_outputs_validate(srv, i):
    for temperature, seed in ((0, None), (1.0, 7)):
        r = ask(srv, "Describe one example as JSON.", response_format=schema_format(SCHEMAS[i]),
                temperature=temperature, seed=seed, max_tokens=120)
        c = r.choices[0]
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), SCHEMAS[i])


def test_json_object_and_vllm_fields(srv):
    r = ask(srv, "Give me a JSON object.", response_format={"type": "json_object"}, max_tokens=120)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: still the start of an object
        assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith("{")
    c = client(srv)
    choices = ["alpha", "beta", "gamma delta"]
    for body in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        t = c.completions.create(model=srv.model, prompt="Pick one:", max_tokens=10, temperature=0,
                                 extra_body=body).choices[0]
        assert t.text in choices and t.finish_reason == "stop"
    rx = r"[0-9]{3}-[A-Z]{2}"
    t = c.completions.create(model=srv.model, prompt="A code:", max_tokens=12, temperature=1.0, seed=3,
                             extra_body={"guided_regex": rx}).choices[0]
    assert re.fullmatch(rx, t.text) and t.finish_reason == "stop"
    # completions take response_format too; max_tokens truncation is "length"
    t = c.completions.create(model=srv.model, prompt="JSON:", max_tokens=3, temperature=0,
                             extra_body={"response_format": schema_format(SCHEMAS[2])}).choices[0]
    assert t.finish_reason == "length" and t.text.startswith("{")


@pytest.mark.parametrize("body,param,words", [
    ({"response_format": schema_format({"type": "strng"})}, "response_format", "strng"),
    ({"response_format": schema_format({"type": "string", "pattern": "[a-"})}, "response_format", "unclosed"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "xml"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "json_schema"),
    ({"guided_regex": "(a"}, "guided_regex", "regex"),
    ({"guided_choice": []}, "guided_choice", "choice"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex", "one output constraint"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
                                                                                   "function": {"name": "g"}}},
     "tool_choice", "'g'"),
])
def test_bad_constraints_are_400s_naming_the_error(srv, body, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        ask(srv, "x", max_tokens=4, extra_body=body)
    err = e.value.body
    assert err["param"] == param and words in err["message"], err
    stats = wait_idle(srv.url, headers={"Authorization": "Bearer sk-ops"})
    assert stats["blocks_in_use"] == 0


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
CONVERT = {"type": "function", "function": {
    "name": "convert", "description": "Convert an amount between currencies",
    "parameters": {"type": "object", "properties": {"amount": {"type": "number", "minimum": 0, "maximum": 1e6},
                                                    "to": {"type": "string", "pattern": "^[A-Z]{3}$"}},
                   "required": ["amount", "to"]}}}
TOOLS = [WEATHER, CONVERT]


def check_call(call, tool):
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == tool["function"]["name"]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_named_and_required_tool_choice_give_valid_calls(srv):
    for tool in TOOLS:
        r = ask(srv, "What is the weather in Paris?", tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": tool["function"]["name"]}})
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
        assert not c.message.content
        check_call(c.message.tool_calls[0], tool)
    r = ask(srv, "Convert 12 euros to dollars.", tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    check_call(c.message.tool_calls[0], {t["function"]["name"]: t for t in TOOLS}[
        c.message.tool_calls[0].function.name])


def test_tool_round_trip_and_the_tool_block_is_cached(srv):
    first = ask(srv, "What is the weather in Oslo?", system=LONG_SYSTEM, tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    msgs = [{"role": "system", "content": LONG_SYSTEM},
            {"role": "user", "content": "What is the weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 4, "sky": "cloudy"}'}]
    r = client(srv).chat.completions.create(model=srv.model, messages=msgs, tools=TOOLS, max_tokens=24,
                                            temperature=0)
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls")
    assert c.message.content or c.message.tool_calls
    # the second request re-read the system turn, the tool block and the first turn from cache
    first_prompt = first.usage.prompt_tokens
    assert r.usage.prompt_tokens > first_prompt
    assert r.usage.prompt_tokens_details.cached_tokens >= (first_prompt // 16 - 1) * 16


def test_tool_calls_stream_in_openai_delta_shape(srv):
    stream = client(srv).chat.completions.create(
        model=srv.model, messages=[{"role": "user", "content": "Weather in Rome?"}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=80,
        temperature=0, stream=True)
    parts, reasons, ids, names = [], [], [], []
    for chunk in stream:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        assert not d.content
        for tc in d.tool_calls or []:
            assert tc.index == 0
            ids += [tc.id] if tc.id else []
            names += [tc.function.name] if tc.function.name else []
            parts.append(tc.function.arguments or "")
        reasons.append(chunk.choices[0].finish_reason)
    assert reasons[-1] == "tool_calls" and names == ["get_weather"] and len(ids) == 1
    jsonschema.validate(json.loads("".join(parts)), WEATHER["function"]["parameters"])
    whole = ask(srv, "Weather in Rome?", tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert whole.choices[0].message.tool_calls[0].function.arguments == "".join(parts)


def test_constrained_greedy_is_the_same_alone_batched_and_cached(srv):
    fmt = schema_format(SCHEMAS[1])
    key = "sk-bob"
    user = "Pick a color and sizes."

    def one():
        r = ask(srv, user, key=key, system=LONG_SYSTEM, response_format=fmt, max_tokens=60)
        return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens

    cold, cold_cached = one()
    warm, warm_cached = one()
    assert cold_cached == 0 and warm_cached > 0 and warm == cold
    with ThreadPoolExecutor(4) as pool:  # with three other requests in the same steps
        others = [pool.submit(ask, srv, f"Tell me about {w}.", key=key, max_tokens=40, temperature=1.0)
                  for w in ("ships", "ports", "cranes")]
        batched = pool.submit(one)
        assert batched.result()[0] == cold
        for f in others:
            f.result()


def test_a_tenants_schemas_stay_its_own(srv):
    secret = {"type": "object", "properties": {"alice_private_field_q": {"type": "integer"}},
              "required": ["alice_private_field_q"], "additionalProperties": False}
    ask(srv, "x", key="sk-alice-1", response_format=schema_format(secret), max_tokens=8)
    ask(srv, "x", key="sk-bob", response_format=schema_format(secret), max_tokens=8)
    grammars = srv.state.engine.grammars
    scopes = {scope for scope, _ in grammars._cache}
    salts = {srv.state.tenants.authenticate(k).salt for k in ("sk-alice-1", "sk-bob")}
    assert salts <= scopes and len(salts) == 2  # one compiled entry per tenant, never shared
    with pytest.raises(openai.BadRequestError) as e:
        ask(srv, "x", key="sk-bob", response_format=schema_format({"type": "object", "properties": {
            "b": {"$ref": "#/missing"}}}), max_tokens=4)
    assert "alice_private_field_q" not in json.dumps(e.value.body)


ANT_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]


def test_anthropic_tools_round_trip_and_stream(srv):
    import anthropic

    c = anthropic.Anthropic(base_url=srv.url, api_key="sk-alice-1", max_retries=0, timeout=120)
    greedy = {"temperature": 0}  # not in the anthropic client's signature any more
    user = {"role": "user", "content": "What is the weather in Lima?"}
    r = c.messages.create(model=srv.model, max_tokens=80, messages=[user], tools=ANT_TOOLS,
                          tool_choice={"type": "tool", "name": "get_weather"}, extra_body=greedy)
    assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["tool_use"]
    use = r.content[0]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER["function"]["parameters"])
    back = c.messages.create(model=srv.model, max_tokens=16, tools=ANT_TOOLS, extra_body=greedy, messages=[
        user, {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name,
                                                 "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "9 C, fog"}]}])
    assert back.content and back.usage.cache_read_input_tokens > 0  # the tool block, from cache
    with c.messages.stream(model=srv.model, max_tokens=80, messages=[user], tools=ANT_TOOLS,
                           tool_choice={"type": "any", "disable_parallel_tool_use": True},
                           extra_body=greedy) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert "content_block_start" in kinds and final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["tool_use"]
    name = final.content[0].name
    jsonschema.validate(final.content[0].input, {t["name"]: t for t in ANT_TOOLS}[name]["input_schema"])


def test_reordered_tools_name_the_miss_cause(srv):
    import httpx

    def post(tools):
        body = {"model": srv.model, "max_tokens": 2, "temperature": 0, "tools": tools,
                "messages": [{"role": "system", "content": "You route travel questions."},
                             {"role": "user", "content": "Hi"}]}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60,
                       headers={"Authorization": "Bearer sk-alice-2"})
        assert r.status_code == 200, r.text
        return r.json()["hotprefix"]["cache"]

    post(TOOLS)
    same = post(TOOLS)
    assert same["cached_tokens"] > 0
    swapped = post(list(reversed(TOOLS)))
    assert swapped["miss_reason"] == "diverged" and swapped["detail"]["likely_cause"] == "tools_changed"
