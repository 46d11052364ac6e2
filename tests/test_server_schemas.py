"""`json_schema` with `strict` on 20 schemas through a real server and the official `openai` client:
every answer parses and validates with `jsonschema`, at temperature 0 and at temperature 1.

The model is the tiny random-weight one (its tokens are the default model's vocabulary), so the
answers are whatever the grammar lets a model with no preference write: deep nesting, the longest
strings the schema allows, numbers at their bounds. That is a harsher check of the grammar than a
trained model that writes short, plausible JSON (tests/test_server_structured.py does that).
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from server_support import LiveServer, tiny_config
from test_structured import SCHEMAS as WALKED

MORE = [
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                               "minItems": 2, "maxItems": 2}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"temp": {"type": "number", "minimum": -40, "maximum": 60},
                                      "unit": {"enum": ["C", "F"]}},
     "required": ["temp", "unit"], "additionalProperties": False},
    {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{4}$"},
                                      "qty": {"type": "integer", "minimum": 1, "maximum": 12},
                                      "gift": {"type": "boolean"}},
     "required": ["sku", "qty", "gift"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "integer", "minimum": 0, "maximum": 3}}, "required": ["c"], "additionalProperties": False}},
        "required": ["b"], "additionalProperties": False}},
     "required": ["a"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string", "maxLength": 3},
                                                                  "v": {"type": "integer", "minimum": 0,
                                                                        "maximum": 99}},
                                "required": ["k", "v"], "additionalProperties": False},
     "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,6}\\.(com|org)$"}},
     "required": ["email"], "additionalProperties": False},
    {"type": "object", "properties": {"status": {"enum": ["ok", "error", 404, None]},
                                      "retry": {"type": "boolean"}},
     "required": ["status"], "additionalProperties": False},
    {"type": "object", "properties": {"ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
                                      "label": {"type": "string", "minLength": 2, "maxLength": 6}},
     "required": ["ratio", "label"], "additionalProperties": False},
]
SCHEMAS = WALKED + MORE


@pytest.fixture(scope="module")
def srv(tiny_model_dir):
    with LiveServer(tiny_config(tiny_model_dir, max_model_len=1024)) as s:
        yield s


def test_twenty_schemas():
    assert len(SCHEMAS) >= 20


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_strict_json_schema_answers_validate(srv, i):
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
    fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i], "strict": True}}
    for temperature, seed in ((0, None), (1.0, 11 + i)):
        r = c.chat.completions.create(model=srv.model, messages=[{"role": "user", "content": "JSON, please."}],
                                      response_format=fmt, temperature=temperature, seed=seed, max_tokens=400)
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (temperature, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[i])
