"""``text/chat_template.py`` renders what transformers' ``apply_chat_template(tokenize=False)``
renders: the same text (or both refuse) for every template here (the default model's, the tool
templates the server's tool-call formats are tested with, Gemma's, and templates using each
global, filter and tag transformers gives them) over conversations with tools, tool calls and
results, reasoning under each name, ``None`` fields, content parts, message objects and numpy
values; and a template cannot reach Python's internals through either."""

from __future__ import annotations

import dataclasses
import glob
import os

import numpy as np
import pydantic
import pytest
import transformers

from hotprefix.text import chat_template

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

FEATURES = {
    # namespace, loop controls, dict(), tojson's options, a generation block, raise_exception
    "features": (
        "{% set ns = namespace(n=0, last='') %}"
        "{% for m in messages %}{% if m['role'] == 'tool' %}{% continue %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}{% set ns.last = m['role'] %}"
        "{% if m['role'] == 'assistant' %}{% generation %}[A]{{ m['content'] }}{% endgeneration %}"
        "{% else %}<{{ m['role'] }}>{{ m['content'] | tojson(indent=2, sort_keys=True) }}{% endif %}"
        "{% if ns.n > 6 %}{% break %}{% endif %}\n{% endfor %}"
        "{{ dict(a=1, b=ns.last) | tojson(separators=(',', ':')) }}{{ dict.fromkeys(['x'], 0) | tojson }}"
        "{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}"
        "{{ bos_token }}|{{ eos_token }}{% if add_generation_prompt %}<gen>{% endif %}"),
    "reasoning": (
        "{% for m in messages %}{{ m.role }}:"
        "{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}|{{ m.thinking }}</think>{% endif %}"
        "{% if m.tool_calls is defined %}{% for c in m.tool_calls %}{{ c.function.name }}"
        "({{ c.function.arguments | tojson }}){% endfor %}{% endif %}"
        "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}"
        "{% if m.name is defined %}[{{ m.name }}]{% endif %}\n{% endfor %}"),
    "refuses_system": (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"),
    "whitespace": "  {% for m in messages %}\n    {{- m.role }}  \n  {%- if loop.last %}!{% endif %}\n{% endfor %}\n",
}

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                         "unit": {"enum": ["c", "f"]}},
                       "required": ["city"]}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}},
]


class PydMessage(pydantic.BaseModel):
    role: str
    content: str | None = None
    name: str | None = None


@dataclasses.dataclass
class DcMessage:
    role: str
    content: str


CONVERSATIONS = {
    "plain": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <b>&</b>"}],
    "turns": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "tool_calls": None},
              {"role": "user", "content": "naïve café 東京 🙂", "name": None}],
    "tools": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18 C"},
        {"role": "assistant", "content": "It is 18 C."}],
    "string_arguments": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "now", "arguments": "{}"}}]}],
    "reasoning": [{"role": "user", "content": "why?"},
                  {"role": "assistant", "content": "because", "reasoning_content": "let me think"},
                  {"role": "assistant", "content": "so", "thinking": "old name"},
                  {"role": "assistant", "content": "and", "reasoning": "third name", "reasoning_content": None}],
    "parts": [{"role": "user", "content": [{"type": "text", "text": "part one "}, {"type": "text", "text": "two"}]}],
    "objects": [PydMessage(role="user", content="from pydantic"), DcMessage(role="assistant", content="dc"),
                {"role": "user", "content": "np", "extra": {"n": np.int64(3), "f": np.float32(0.5),
                                                             "b": np.bool_(False)}}],
}


def _hf() -> transformers.PreTrainedTokenizerFast:
    from hotprefix.model.loader import default_model_path
    from hotprefix.text.tokenizer import Tokenizer

    base = Tokenizer.load(default_model_path()).hf
    return transformers.PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer,
                                                bos_token="<|im_start|>", eos_token="<|im_end|>",
                                                unk_token="<|endoftext|>")


def _templates() -> dict[str, str]:
    from hotprefix.model.loader import default_model_path
    from hotprefix.text.tokenizer import Tokenizer

    out = {"smollm2": Tokenizer.load(default_model_path()).chat_template}
    for path in sorted(glob.glob(os.path.join(HERE, "data", "templates", "*.jinja"))) + [
            os.path.join(REPO, "benchmarks", "gemma_chat_template.jinja")]:
        with open(path, encoding="utf-8") as f:
            out[os.path.basename(path)] = f.read()
    out.update(FEATURES)
    return out


def _outcome(fn):
    try:
        return fn()
    except Exception as e:  # both must refuse; the message is jinja's or the template's own
        return ("error", str(e).split("\n")[0] if "raise" in str(e) or "no system" in str(e) else "")


@pytest.fixture(scope="module")
def hf():
    return _hf()


@pytest.mark.parametrize("name", list(_templates()))
def test_each_template_renders_as_transformers_does(hf, name):
    template = _templates()[name]
    hf.chat_template = template
    rendered = 0
    for conv_name, conv in CONVERSATIONS.items():
        for tools in (None, TOOLS):
            for gen in (True, False):
                want = _outcome(lambda: hf.apply_chat_template(conv, tools=tools, add_generation_prompt=gen,
                                                               tokenize=False))
                got = _outcome(lambda: chat_template.render(template, conv, tools, gen, hf.special_tokens_map))
                assert got == want, (name, conv_name, tools is not None, gen)
                rendered += isinstance(want, str)
    assert rendered >= 8  # most cases render (a template refusing everything would prove little)


def test_a_template_refusing_a_conversation_refuses_it_here_too(hf):
    hf.chat_template = FEATURES["refuses_system"]
    conv = CONVERSATIONS["plain"]
    with pytest.raises(Exception, match="no system role"):
        hf.apply_chat_template(conv, tokenize=False)
    with pytest.raises(Exception, match="no system role"):
        chat_template.render(FEATURES["refuses_system"], conv, None, False, {})
    with pytest.raises(ValueError, match="empty conversation"):
        chat_template.render("x", [], None, False, {})
    with pytest.raises(ValueError, match="JSON schema"):
        chat_template.render("x", conv, [print], False, {})


HOSTILE = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{% set ns = namespace(_secret=1) %}{{ ns }}",
    "{% set ns = namespace() %}{% set ns._x = 1 %}{{ ns._x }}",
    "{{ dict.__class__ }}{{ dict.mro() }}",
    "{{ raise_exception.__globals__ }}",
    "{{ cycler.__init__.__globals__.os }}",
    "{{ messages.append(1) }}{{ messages }}",
]


@pytest.mark.parametrize("template", HOSTILE)
def test_a_hostile_template_gets_what_it_gets_in_transformers_and_no_python_internals(hf, template):
    hf.chat_template = template
    conv = CONVERSATIONS["plain"]
    want = _outcome(lambda: hf.apply_chat_template(conv, tokenize=False))
    got = _outcome(lambda: chat_template.render(template, conv, None, False, hf.special_tokens_map))
    assert got == want
    if isinstance(got, str):  # what rendered holds no module, class or function objects
        assert "<class" not in got and "<function" not in got and "<module" not in got and "os" != got
