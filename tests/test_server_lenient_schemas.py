"""The schemas real clients send: 20 pydantic models (sets, enums, optionals, nested models,
unions, formats) as the official client's ``chat.completions.parse`` makes them strict, on the
tiny random model at temperature 0 and 1: every answer parses into its model and validates against
its schema, except the keywords the server says it did not enforce (``x-hotprefix-unenforced`` and
``hotprefix.warnings``: ``uniqueItems`` for a set, never a keyword it did enforce). A schema that
cannot be honoured at all is still a 400.
"""

from __future__ import annotations

import datetime as dt
import enum
import json
import uuid
from typing import Annotated, Literal, Optional, Union

import httpx
import jsonschema
import openai
import pytest
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field

from server_support import LiveServer, tiny_config

Short = Annotated[str, Field(max_length=10)]
Small = Annotated[int, Field(ge=0, le=99)]


class Color(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Level(enum.IntEnum):
    low = 1
    high = 2


class Address(BaseModel):
    street: Short
    city: Short


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: Annotated[int, Field(ge=1, le=9)]


class Dog(BaseModel):
    kind: Literal["dog"]
    good: bool


class Person(BaseModel):
    name: Short
    age: Annotated[int, Field(ge=0, le=120)]


class Tagged(BaseModel):
    tags: Annotated[set[Short], Field(max_length=3)]


class Paint(BaseModel):
    color: Color
    coats: Small


class Nick(BaseModel):
    name: Short
    nickname: Optional[Short]


class User(BaseModel):
    person: Person
    address: Address


class Value(BaseModel):
    value: Union[Small, Short]


class Switch(BaseModel):
    kind: Literal["on", "off"]
    level: Level


class Basket(BaseModel):
    items: Annotated[list[Person], Field(max_length=2)]


class Event(BaseModel):
    at: dt.datetime
    day: dt.date


class Ticket(BaseModel):
    id: uuid.UUID
    seat: Small


class Score(BaseModel):
    score: Annotated[float, Field(ge=0, le=1)]
    passed: bool


class Digits(BaseModel):
    digits: Annotated[frozenset[Annotated[int, Field(ge=0, le=9)]], Field(max_length=4)]


class Pet(BaseModel):
    pet: Union[Cat, Dog] = Field(discriminator="kind")


class MaybeAddress(BaseModel):
    home: Optional[Address]
    work: Optional[Address]


class Pair(BaseModel):
    pair: tuple[Small, Short]


class Code(BaseModel):
    code: Annotated[str, Field(pattern=r"^[A-Z]{3}-[0-9]{2}$")]


class Palette(BaseModel):
    colors: Annotated[set[Color], Field(max_length=3)]
    name: Short


class Counts(BaseModel):
    counts: Annotated[list[Small], Field(min_length=1, max_length=3)]
    unit: Optional[Literal["kg", "lb"]]


class Profile(BaseModel):
    user: User
    pets: Annotated[list[Pet], Field(max_length=2)]
    tags: Annotated[set[Short], Field(max_length=2)]


MODELS = [Person, Tagged, Paint, Nick, User, Value, Switch, Basket, Event, Ticket, Score, Digits,
          Pet, MaybeAddress, Pair, Code, Palette, Counts, Profile, Address]
SETS = {Tagged, Digits, Palette, Profile}
assert len(MODELS) == 20


@pytest.fixture(scope="module")
def srv(tiny_model_dir):
    with LiveServer(tiny_config(tiny_model_dir)) as s:
        yield s


def _without(schema, keywords):
    """The schema less the keywords the server reported as not enforced."""
    if isinstance(schema, dict):
        return {k: _without(v, keywords) for k, v in schema.items() if k not in keywords}
    if isinstance(schema, list):
        return [_without(v, keywords) for v in schema]
    return schema


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_pydantic_schema_gives_valid_output(srv, model):
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
    schema = to_strict_json_schema(model)
    for temperature, seed in ((0, None), (1.0, 11)):
        raw = c.chat.completions.with_raw_response.parse(
            model=srv.model, messages=[{"role": "user", "content": f"Give me a {model.__name__}."}],
            response_format=model, temperature=temperature, seed=seed, max_tokens=400)
        parsed = raw.parse().choices[0].message.parsed
        assert isinstance(parsed, model)  # the client parsed it into the model
        unenforced = raw.headers.get("x-hotprefix-unenforced", "")
        keywords = {k.strip() for k in unenforced.split(",") if k.strip()}
        assert keywords == ({"uniqueItems"} if model in SETS else set()), model
        body = json.loads(raw.text)
        warnings = body["hotprefix"].get("warnings", [])
        assert [w["keywords"] for w in warnings] == ([sorted(keywords)] if keywords else [])
        text = body["choices"][0]["message"]["content"]
        jsonschema.validate(json.loads(text), _without(schema, keywords))


def test_what_cannot_be_honoured_is_still_refused(srv):
    bad = [{"type": "strng"}, {"type": "string", "minLength": 5, "maxLength": 2},
           {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}]
    for schema in bad:
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "model": srv.model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    # an unknown format is compiled as a plain string, and named
    r = httpx.post(srv.url + "/v1/responses", timeout=60, json={
        "model": srv.model, "input": "x", "max_output_tokens": 40, "text": {"format": {
            "type": "json_schema", "name": "a", "schema": {
                "type": "object", "properties": {"h": {"type": "string", "format": "hostname-ish", "maxLength": 5},
                                                 "n": {"not": {"type": "null"}, "type": "integer", "minimum": 0,
                                                       "maximum": 9}},
                "required": ["h", "n"], "additionalProperties": False}}}})
    assert r.status_code == 200
    assert r.headers["x-hotprefix-unenforced"] == "format:hostname-ish, not"
    assert r.json()["hotprefix"]["warnings"][0]["keywords"] == ["format:hostname-ish", "not"]
