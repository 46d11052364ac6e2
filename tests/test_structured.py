"""Structured outputs and tools without a model: grammars compile (or fail naming the error),
masks allow exactly the grammar's continuations, the compiled-grammar cache is per tenant, the
tool block renders stably, tool calls parse whole and streamed.

A random walk through each grammar (a seeded choice among its allowed tokens at each step)
stands in for the model: what it produces must parse and validate.
"""

from __future__ import annotations

import json
import random
import re

import jsonschema
import numpy as np
import pytest
import torch

from hotprefix.request.sampling import SamplingError, SamplingParams
from hotprefix.server import tools as T
from hotprefix.request.structured import GrammarCompiler, GrammarError, StructuredOutputsParams


@pytest.fixture(scope="module")
def compiler(default_tokenizer):
    c = GrammarCompiler(default_tokenizer, default_tokenizer.vocab_size, default_tokenizer.eos_token_ids)
    yield c
    c.close()


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 18, "maximum": 99}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["color", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "number", "minimum": -10, "maximum": 10}, "y": {"type": "integer"}},
        "required": ["x", "y"], "additionalProperties": False},
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["point", "code"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1},
                                      "count": {"type": "integer", "exclusiveMinimum": 0, "maximum": 50}},
     "required": ["score", "count"], "additionalProperties": False},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-f0-9]{8}$"},
                                      "kind": {"const": "user"}},
     "required": ["id", "kind"], "additionalProperties": False},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                          {"type": "string", "maxLength": 4}, {"type": "null"}]}},
     "required": ["value"], "additionalProperties": False},
    {"type": "object", "properties": {"grid": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 3, "items": {"type": "integer", "minimum": -5, "maximum": 5}}}},
     "required": ["grid"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"$ref": "#/$defs/person"},
                                      "friends": {"type": "array", "items": {"$ref": "#/$defs/person"},
                                                  "maxItems": 2}},
     "required": ["user", "friends"], "additionalProperties": False,
     "$defs": {"person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                           "role": {"enum": ["admin", "guest"]}},
                          "required": ["name", "role"], "additionalProperties": False}}},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
                                      "ok": {"type": "boolean"}, "note": {"type": "string", "maxLength": 10}},
     "required": ["date", "ok"], "additionalProperties": False},
    {"type": "string", "enum": ["north", "south", "east", "west"]},
    {"type": "integer", "minimum": 100, "maximum": 999},
]


def walk(state, eos: frozenset[int], seed: int, max_steps: int = 300) -> list[int]:
    """Tokens of a seeded random walk through the grammar's allowed tokens, until it stops:
    EOS half the time it is allowed, else a random allowed token."""
    rng = random.Random(seed)
    eos_ids = sorted(eos)
    out: list[int] = []
    for _ in range(max_steps):
        allowed = state.allowed()
        ends = [t for t in eos_ids if allowed[t]]
        if ends and rng.random() < 0.5:
            tok = ends[0]
        else:
            allowed[eos_ids] = False
            ids = np.flatnonzero(allowed.numpy())
            assert len(ids) or ends, "the grammar allows no token"
            tok = int(ids[rng.randrange(len(ids))]) if len(ids) else ends[0]
        state.accept(tok)
        out.append(tok)
        if tok in eos or state.is_stopped:
            return out
    raise AssertionError("the walk did not end")


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_json_schema_walks_validate(compiler, default_tokenizer, i):
    eos = default_tokenizer.eos_token_ids
    g = compiler.compile(StructuredOutputsParams(json=SCHEMAS[i]))
    for seed in range(3):
        toks = walk(g.new_state(), eos, seed)
        text = default_tokenizer.decode([t for t in toks if t not in eos])
        jsonschema.validate(json.loads(text), SCHEMAS[i])


def test_regex_choice_and_lark_walks_match(compiler, default_tokenizer):
    eos = default_tokenizer.eos_token_ids
    cases = [(StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"), lambda s: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", s)),
             (StructuredOutputsParams(choice=["yes", "no", "maybe later"]), lambda s: s in ("yes", "no", "maybe later")),
             (StructuredOutputsParams(grammar='start: "a" ("b" | "c")+ "."'), lambda s: re.fullmatch(r"a[bc]+\.", s))]
    for spec, ok in cases:
        for seed in range(3):
            toks = walk(compiler.compile(spec).new_state(), eos, seed)
            text = default_tokenizer.decode([t for t in toks if t not in eos])
            assert ok(text), (spec, text)


def test_json_object_takes_objects_only(compiler, default_tokenizer):
    g = compiler.compile(StructuredOutputsParams(json_object=True))
    ok = g.new_state()
    for t in default_tokenizer.encode('{"a": [1, 2], "b": {"c": null}}', add_special_tokens=False):
        assert ok.allowed()[t]
        ok.accept(t)
    assert ok.is_stopped
    bad = g.new_state()
    first = default_tokenizer.encode("[1]", add_special_tokens=False)[0]
    assert not bad.allowed()[first]


def test_mask_sets_disallowed_logits_to_minus_inf(compiler):
    state = compiler.compile(StructuredOutputsParams(choice=["yes", "no"])).new_state()
    allowed = state.allowed()
    logits = torch.randn(compiler.vocab_size + 7)  # a padded vocabulary: the pad is disallowed
    masked = state.mask_logits(logits.clone())
    assert torch.isinf(masked[compiler.vocab_size:]).all()
    keep = torch.isfinite(masked[:compiler.vocab_size])
    assert torch.equal(keep, allowed[:compiler.vocab_size]) and 0 < int(keep.sum()) < 100


@pytest.mark.parametrize("spec,words", [
    (dict(json={"type": "strng"}), "strng"),
    (dict(json='{"type": "object", "properties": {"a": {"$ref": "#/defs/missing"}}}'), "missing"),
    (dict(json="{not json"), "invalid json"),
    (dict(regex="[a-z"), "unclosed"),
    (dict(grammar="start: undefined_rule"), "undefined_rule"),
])
def test_bad_spec_is_a_grammar_error_naming_it(compiler, spec, words):
    with pytest.raises(GrammarError) as e:
        compiler.compile(StructuredOutputsParams(**spec))
    assert words in str(e.value).lower()


def test_spec_shape_errors():
    with pytest.raises(GrammarError):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(GrammarError):
        StructuredOutputsParams()
    with pytest.raises(GrammarError):
        StructuredOutputsParams(choice=[])
    with pytest.raises(SamplingError) as e:  # vLLM's dict form, through SamplingParams
        SamplingParams(structured_outputs={"regex": "a", "whitespace_pattern": " "})
    assert e.value.param == "structured_outputs"
    p = SamplingParams(guided_decoding={"choice": ["a", "b"]})  # vLLM's older name
    assert p.structured_outputs == StructuredOutputsParams(choice=["a", "b"])


def test_compiled_grammars_are_kept_per_tenant(compiler):
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"secret_field_x": {"type": "integer"}}})
    a1 = compiler.compile(spec, "salt-a")
    assert compiler.compile(spec, "salt-a") is a1  # cached for its tenant
    b = compiler.compile(spec, "salt-b")
    assert b is not a1  # another tenant compiles its own: no shared entry, no faster hit
    # a tenant's error names its own spec only
    with pytest.raises(GrammarError) as e:
        compiler.compile(StructuredOutputsParams(json={"type": "nope"}), "salt-b")
    assert "secret_field_x" not in str(e.value)


def test_states_are_independent(compiler, default_tokenizer):
    g = compiler.compile(StructuredOutputsParams(choice=["alpha", "beta"]))
    s1, s2 = g.new_state(), g.new_state()
    a = default_tokenizer.encode("alpha", add_special_tokens=False)
    for t in a:
        s1.accept(t)
    assert s1.is_stopped and not s2.is_stopped
    fork = s2.fork()
    assert torch.equal(fork.allowed(), s2.allowed())


# ---------------------------------------------------------------------------- tools
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "maxLength": 10}}, "required": ["tz"]}}}


def test_tool_block_is_stable_and_canonical():
    a = T.tools_block(T.parse_tools([WEATHER, TIME]))
    reordered_keys = {"function": dict(reversed(list(WEATHER["function"].items()))), "type": "function"}
    assert T.tools_block(T.parse_tools([reordered_keys, TIME])) == a  # same tools, same bytes
    assert T.tools_block(T.parse_tools([TIME, WEATHER])) != a  # the order of the tools is the client's
    msgs = T.render_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x"}],
                             T.parse_tools([WEATHER]), native=False)
    assert msgs[0]["content"].startswith("Be brief.\n\n# Tools") and '"get_weather"' in msgs[0]["content"]


@pytest.mark.parametrize("bad,param", [
    ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name"),
    ([{"type": "retrieval"}], "tools[0]"),
    ([WEATHER, WEATHER], "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], "tools[0].function.parameters"),
])
def test_bad_tools_name_the_field(bad, param):
    with pytest.raises(T.ToolError) as e:
        T.parse_tools(bad)
    assert e.value.param == param


def test_tool_choice():
    fs = T.parse_tools([WEATHER, TIME])
    assert T.pick(fs, None) == ("auto", fs) and T.pick([], None) == ("none", [])
    assert T.pick(fs, "none") == ("none", [])
    mode, chosen = T.pick(fs, {"type": "function", "function": {"name": "get_time"}})
    assert mode == "required" and [f.name for f in chosen] == ["get_time"]
    for bad in ("sometimes", {"type": "function", "function": {"name": "nope"}}):
        with pytest.raises(T.ToolError):
            T.pick(fs, bad)


@pytest.mark.parametrize("parallel", [True, False])
def test_tool_grammar_walks_are_valid_calls(compiler, default_tokenizer, parallel):
    fs = T.parse_tools([WEATHER, TIME])
    eos = default_tokenizer.eos_token_ids
    g = compiler.compile(T.grammar(fs, parallel))
    schemas = {f.name: f.parameters for f in fs}
    for seed in range(4):
        text = default_tokenizer.decode([t for t in walk(g.new_state(), eos, seed) if t not in eos])
        content, calls = T.parse_calls(text, fs)
        assert content is None and calls, text
        assert parallel or text.count(T.CALL_OPEN) == 1
        for c in calls:
            jsonschema.validate(json.loads(c["function"]["arguments"]), schemas[c["function"]["name"]])


def test_parse_calls_and_stream_agree():
    fs = T.parse_tools([WEATHER])
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "unknown_fn", "arguments": {}}\n</tool_call>')
    content, calls = T.parse_calls(text, fs)
    assert content == "Let me check." and len(calls) == 1
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "unit": "C"}
    for step in (1, 4, 17):
        cs = T.CallStream(fs)
        events = []
        for i in range(0, len(text), step):
            events += cs.feed(text[i:i + step])
        events += cs.end()
        streamed = "".join(v for k, v in events if k == "content")
        assert streamed.strip() == content
        assert [v["function"] for k, v in events if k == "call"] == [calls[0]["function"]]
    assert T.parse_calls("no call here <tool", fs) == ("no call here <tool", [])
    cs = T.CallStream(fs)
    assert [v for _, v in cs.feed("a <tool") + cs.end()] == ["a ", "<tool"]


def test_offline_chat_renders_tools_and_constrains(tiny_model_dir):
    from hotprefix import LLM

    llm = LLM(model=tiny_model_dir, num_threads=2, num_blocks=64)
    msgs = [{"role": "user", "content": "Weather in Oslo?"}]
    fs = T.parse_tools([WEATHER])
    out = llm.chat(msgs, SamplingParams(max_tokens=60, structured_outputs=T.grammar(fs, False)),
                   tools=[WEATHER])[0]
    assert '"get_weather"' in out.prompt and "# Tools" in out.prompt  # the tool block, rendered
    content, calls = T.parse_calls(out.outputs[0].text, fs)  # random weights, valid call
    assert out.outputs[0].finish_reason == "stop" and len(calls) == 1
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), WEATHER["function"]["parameters"])
    with pytest.raises(ValueError):
        llm.chat(msgs, tools=[{"type": "function", "function": {"name": "bad name"}}])
