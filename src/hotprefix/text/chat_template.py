"""Chat templates rendered as transformers' ``apply_chat_template(..., tokenize=False)`` renders
them, without importing transformers (0.4-0.6 s of every start: ``text/tokenizer_snapshot.py``).

The same Jinja environment (jinja2's immutable sandbox, ``trim_blocks`` and ``lstrip_blocks``,
loop controls, ``{% generation %}`` blocks rendered as their body), the same globals
(``raise_exception``, ``strftime_now``, ``dict``, a ``namespace`` that refuses ``_`` names) and
``tojson`` filter, and the same inputs: messages as plain JSON data with their ``None`` fields
dropped and their reasoning under each name a template reads, tools as given, the tokenizer's
named special tokens as variables. ``tests/test_chat_template.py`` renders a corpus of
conversations through this and through transformers and requires the same text; transformers
stays the reference (a tokenizer built by it renders through it).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
"""Names a message's reasoning is passed under (transformers' order: the first is the standard
one templates read)."""


class _Generation(jinja2.ext.Extension):
    """``{% generation %} ... {% endgeneration %}`` (assistant-token masks): its body as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # not jinja's own: that one escapes HTML characters
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` in a template, without a class object to climb out of."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja's ``namespace`` refusing ``_``-prefixed attributes (no way to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja's signature trick)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got "
                f"{name!r}. Please rename the attribute.")


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The template compiled once per text."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


def _plain(value: Any) -> Any:
    """Only JSON types reach the template (anything else as a placeholder naming its type)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if type(value).__module__ == "numpy" and hasattr(value, "item"):  # a numpy scalar
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _messages(conversation: Any) -> list[dict]:
    """Each message a plain dict without its ``None`` fields, its reasoning under every name
    (transformers turns message objects into dicts, drops ``None`` fields, then makes the data
    plain: plain data first gives the same dicts, ``None`` staying ``None``)."""
    out = []
    for message in _plain(conversation):
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got "
                            f"{message!r}.")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render(source: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
           add_generation_prompt: bool, special_tokens: Mapping[str, str]) -> str:
    """The conversation as the template ``source`` writes it.

    Args:
        tools: JSON schemas (dicts) or None.
        special_tokens: the tokenizer's named special tokens (``bos_token``, ``eos_token``, ...).
    Raises:
        ValueError: an empty conversation or a tool that is not a dict; jinja2's errors (a
            template's ``raise_exception``, a syntax error) as they come.
    """
    if not messages:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one "
                         "message.")
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise ValueError("Tools should either be a JSON schema, or a callable function with type "
                         "hints and a docstring suitable for auto-conversion to a schema.")
    return compile_template(source).render(
        messages=_messages(messages), tools=_plain(tools), documents=None,
        add_generation_prompt=add_generation_prompt, **_plain(dict(special_tokens)))
