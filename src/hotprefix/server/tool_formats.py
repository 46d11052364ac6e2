"""Tool-call formats by model family: how a model writes its calls, chosen from its chat template.

A template that renders ``tools`` itself (``Tokenizer.renders_tools``) was written for a model
tuned on one way of calling; the answer is read (and ``tool_choice: required`` enforced) in that
way:

- ``hermes`` (Hermes, Qwen 2.5/3, and every template that does not render tools, where the
  server's own tool block asks for it: ``server/tools.py``)::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

- ``llama3_json`` (Llama 3.1/3.2/3.3 templates: ``<|python_tag|>`` or the ``"parameters"``
  JSON instruction): the whole answer is one call, or several separated by ``;``, optionally after
  ``<|python_tag|>``::

      {"name": "get_weather", "parameters": {"city": "Paris"}}

- ``mistral`` (templates that write ``[TOOL_CALLS]``): text, then the marker and a JSON list::

      [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]

The markers ``<|python_tag|>`` and ``[TOOL_CALLS]`` are special tokens in those families'
vocabularies, which the detokenizer leaves out of the text; so an answer that *starts* with a
JSON object (``llama3_json``) or a JSON list of calls (``mistral``) reads as calls without its
marker too. The grammar of a required call writes the marker as text (only ``mistral`` has one).

Each format: ``grammar(functions, parallel)`` (a ``hotprefix.request.structured`` spec),
``parse(text, functions, parallel) -> (content, calls)`` for a whole answer, and
``stream(functions, parallel)``: an object with ``feed(text)`` and ``end()`` returning
``("content", text)`` / ``("call", call)`` events in order, like ``tools.CallStream``.

Knows nothing about the engine or HTTP.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from hotprefix.server import tools as T
from hotprefix.request.structured import JSON_OPTIONS, StructuredOutputsParams

PYTHON_TAG = "<|python_tag|>"
MISTRAL_MARKER = "[TOOL_CALLS]"


class CallEvents(Protocol):
    num_calls: int

    def feed(self, text: str) -> list[tuple[str, Any]]: ...

    def end(self) -> list[tuple[str, Any]]: ...


def as_call(obj: Any, names: set[str]) -> dict[str, Any] | None:
    """A decoded ``{"name", "arguments" | "parameters"}`` object as an OpenAI tool call, or None
    when it is not a call of one of ``names``."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    return {"id": T.new_call_id(), "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def _call_rules(functions: list[T.Function], args_key: str) -> tuple[str, list[str]]:
    """``(alternatives, rules)``: one ``%json`` rule per function, its arguments valid against its
    parameters (closed objects, as in ``tools.grammar``)."""
    rules = []
    for i, f in enumerate(functions):
        args = f.parameters
        if "properties" in args and "additionalProperties" not in args:
            args = {**args, "additionalProperties": False}
        schema = {"type": "object", "properties": {"name": {"const": f.name}, args_key: args},
                  "required": ["name", args_key], "additionalProperties": False,
                  "x-guidance": JSON_OPTIONS}
        rules.append(f"fn{i}: %json {json.dumps(schema, ensure_ascii=False)}")
    return " | ".join(f"fn{i}" for i in range(len(functions))), rules


class ToolFormat:
    """How one family writes tool calls."""

    name = "hermes"

    def grammar(self, functions: list[T.Function], parallel: bool) -> StructuredOutputsParams:
        return T.grammar(functions, parallel)

    def parse(self, text: str, functions: list[T.Function],
              parallel: bool = True) -> tuple[str | None, list[dict[str, Any]]]:
        return T.parse_calls(text, functions, parallel)

    def stream(self, functions: list[T.Function], parallel: bool = True) -> CallEvents:
        return T.CallStream(functions, parallel)


class _Buffered:
    """Streams a format whose calls are known only when they end: content passes through until
    ``is_start`` says the rest is calls (or text that may still become so is held back); from
    there the text is buffered and parsed at ``end``."""

    def __init__(self, fmt: "ToolFormat", functions: list[T.Function], parallel: bool):
        self._fmt, self._functions, self._parallel = fmt, functions, parallel
        self._held = ""
        self._calls: str | None = None
        self._content = ""
        self.num_calls = 0

    def feed(self, text: str) -> list[tuple[str, Any]]:
        if self._calls is not None:
            self._calls += text
            return []
        self._held += text
        at, hold = self._fmt.split(self._content, self._held)  # type: ignore[attr-defined]
        if at is not None:
            emit, self._calls, self._held = self._held[:at], self._held[at:], ""
        else:
            emit, self._held = self._held[:len(self._held) - hold], self._held[len(self._held) - hold:]
        self._content += emit
        return [("content", emit)] if emit else []

    def end(self) -> list[tuple[str, Any]]:
        if self._calls is None:
            rest, self._held = self._held, ""
            return [("content", rest)] if rest else []
        content, calls = self._fmt.parse(self._calls, self._functions, self._parallel)
        if not calls:
            return [("content", self._calls)]
        self.num_calls = len(calls)
        return ([("content", content)] if content else []) + [("call", c) for c in calls]


def _json_values(text: str, sep: str) -> list[Any] | None:
    """The JSON values of ``text``, ``sep``-separated (whitespace around allowed); None unless the
    whole text is such values."""
    dec = json.JSONDecoder()
    out, i, n = [], 0, len(text)
    while True:
        while i < n and text[i].isspace():
            i += 1
        try:
            obj, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        out.append(obj)
        while i < n and text[i].isspace():
            i += 1
        if i >= n:
            return out
        if not text.startswith(sep, i):
            return None
        i += len(sep)


class Llama3Json(ToolFormat):
    """Llama 3.x: the answer is ``{"name": ..., "parameters": {...}}`` (``; ``-separated when
    several), optionally after ``<|python_tag|>``; any other answer is content."""

    name = "llama3_json"

    def grammar(self, functions: list[T.Function], parallel: bool) -> StructuredOutputsParams:
        alts, rules = _call_rules(functions, "parameters")
        start = 'start: call ("; " call)*' if parallel else "start: call"
        return StructuredOutputsParams(grammar="\n".join([start, f"call: {alts}", *rules]))

    def parse(self, text: str, functions: list[T.Function],
              parallel: bool = True) -> tuple[str | None, list[dict[str, Any]]]:
        body = text.strip().removeprefix(PYTHON_TAG)
        if not body.lstrip().startswith("{"):
            return text, []
        values = _json_values(body, ";")
        names = {f.name for f in functions}
        calls = [c for c in (as_call(v, names) for v in values or []) if c is not None]
        if not values or len(calls) != len(values):
            return text, []
        return None, calls if parallel else calls[:1]

    def split(self, content: str, held: str) -> tuple[int | None, int]:
        """``(where the calls start in held, or None; characters to hold back)``: calls are the
        whole answer, so only an answer whose first text is ``{`` or the tag is one."""
        if content:
            return None, 0
        s = held.lstrip()
        if not s:
            return None, len(held)
        if s.startswith("{") or s.startswith(PYTHON_TAG):
            return len(held) - len(s), 0
        if PYTHON_TAG.startswith(s):
            return None, len(held)
        return None, 0

    def stream(self, functions: list[T.Function], parallel: bool = True) -> CallEvents:
        return _Buffered(self, functions, parallel)


class Mistral(ToolFormat):
    """Mistral: content, then ``[TOOL_CALLS]`` and a JSON list of ``{"name", "arguments"}``
    (an answer that starts with such a list, its marker dropped as a special token, too)."""

    name = "mistral"

    def grammar(self, functions: list[T.Function], parallel: bool) -> StructuredOutputsParams:
        alts, rules = _call_rules(functions, "arguments")
        body = 'call (", " call)*' if parallel else "call"
        start = f'start: "{MISTRAL_MARKER}[" {body} "]"'
        return StructuredOutputsParams(grammar="\n".join([start, f"call: {alts}", *rules]))

    def parse(self, text: str, functions: list[T.Function],
              parallel: bool = True) -> tuple[str | None, list[dict[str, Any]]]:
        i = text.find(MISTRAL_MARKER)
        if i >= 0:
            content, body = text[:i], text[i + len(MISTRAL_MARKER):]
        elif text.lstrip().startswith("[{"):
            content, body = "", text
        else:
            return text, []
        values = _json_values(body, ",")
        if values is not None and len(values) == 1 and isinstance(values[0], list):
            values = values[0]
        names = {f.name for f in functions}
        calls = [c for c in (as_call(v, names) for v in values or []) if c is not None]
        if not calls:
            return text, []
        return (content.strip() or None), calls if parallel else calls[:1]

    def split(self, content: str, held: str) -> tuple[int | None, int]:
        i = held.find(MISTRAL_MARKER)
        if i >= 0:
            return i, 0
        if not content:
            s = held.lstrip()
            if s.startswith("[{"):
                return len(held) - len(s), 0
            if not s or s == "[":
                return None, len(held)
        return None, T._partial_suffix(held, MISTRAL_MARKER)

    def stream(self, functions: list[T.Function], parallel: bool = True) -> CallEvents:
        return _Buffered(self, functions, parallel)


HERMES = ToolFormat()
FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HERMES, Llama3Json(), Mistral())}
"""Every format by name (vLLM's ``--tool-call-parser`` names where they exist)."""


def for_template(template: str | None, renders_tools: bool) -> ToolFormat:
    """The format a chat template's model writes: ``hermes`` for a template that does not render
    tools (the server's tool block asks for it) or that writes ``<tool_call>``; else by the
    family's marks."""
    if not renders_tools or not template:
        return HERMES
    if "<tool_call>" in template:
        return HERMES
    if MISTRAL_MARKER in template:
        return FORMATS["mistral"]
    if PYTHON_TAG in template or ("<|start_header_id|>" in template and '"parameters"' in template):
        return FORMATS["llama3_json"]
    return HERMES
