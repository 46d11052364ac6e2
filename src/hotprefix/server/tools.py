"""Tool calling for the chat routes: validate ``tools``, render them into the prompt, build the
grammar that ``tool_choice: required`` or a named function enforces, and read tool calls out of
the model's text (whole or streamed).

The one format (Hermes / Qwen 2.5, which many small chat models were tuned on): when the model's
chat template renders ``tools`` itself (``Tokenizer.renders_tools``) it is used as it is;
otherwise (the embedded SmolLM2's template) the tools are described in a block appended to the
system turn (``tools_block``), each function's JSON on one line with sorted keys, so the same
tools always render to the same bytes and the system turn plus the tool block stay one cached
prefix. The model answers a call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Assistant messages with ``tool_calls`` render back in that form and ``tool`` messages as
``<tool_response>...</tool_response>`` in a ``tool`` turn (when the template does not render them).

Knows nothing about the engine; the grammar is a ``hotprefix.request.structured`` spec.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from hotprefix.request.structured import JSON_OPTIONS, StructuredOutputsParams

MAX_TOOLS = 128
"""Most functions one request may offer."""
NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""OpenAI's rule for a function name."""
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL_RE = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.S)

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n")
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


class ToolError(ValueError):
    """A bad ``tools`` / ``tool_choice`` / tool message; ``param`` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Function:
    """One offered function."""

    name: str
    description: str | None
    parameters: dict[str, Any]
    """Its arguments' JSON schema (``{"type": "object"}`` when the tool gave none)."""
    raw: dict[str, Any]
    """The tool as the client sent it (``{"type": "function", "function": {...}}``)."""


def parse_tools(tools: list[dict[str, Any]] | None) -> list[Function]:
    """The request's ``tools`` checked (OpenAI's shape); ToolError names the bad one."""
    if not tools:
        return []
    if len(tools) > MAX_TOOLS:
        raise ToolError(f"tools takes at most {MAX_TOOLS} functions", "tools")
    out: list[Function] = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise ToolError(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}", where)
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise ToolError(f"{where}.function.name must be 1-64 letters, digits, '_' or '-'",
                            f"{where}.function.name")
        if any(o.name == name for o in out):
            raise ToolError(f"{where}: the function name {name!r} is given twice", f"{where}.function.name")
        params = f.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise ToolError(f"{where}.function.parameters must be a JSON schema object",
                            f"{where}.function.parameters")
        desc = f.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ToolError(f"{where}.function.description must be a string", f"{where}.function.description")
        out.append(Function(name, desc, params or {"type": "object"}, t))
    return out


def pick(functions: list[Function], tool_choice: str | dict[str, Any] | None) -> tuple[str, list[Function]]:
    """``(mode, functions it may call)``: mode ``none``, ``auto`` or ``required`` (a named
    function is ``required`` of that one)."""
    if tool_choice is None:
        return ("auto" if functions else "none"), functions
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ToolError("tool_choice must be 'none', 'auto', 'required' or "
                            "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
        if tool_choice == "required" and not functions:
            raise ToolError("tool_choice 'required' needs tools", "tool_choice")
        return tool_choice, functions if tool_choice != "none" else []
    name = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
    if not isinstance(name, str):
        raise ToolError("a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                        "tool_choice")
    chosen = [f for f in functions if f.name == name]
    if not chosen:
        raise ToolError(f"tool_choice names the function {name!r}, which is not among the tools",
                        "tool_choice")
    return "required", chosen


def canonical(obj: Any) -> str:
    """One line of JSON, sorted keys: the same tool always renders to the same bytes."""
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(", ", ": "))


def tools_block(functions: list[Function]) -> str:
    """The system-turn block describing the tools (for templates that do not render tools)."""
    lines = [canonical({"type": "function", "function": {
        k: v for k, v in (("name", f.name), ("description", f.description), ("parameters", f.parameters))
        if v is not None}}) for f in functions]
    return TOOLS_PREAMBLE + "\n".join(lines) + TOOLS_POSTAMBLE


def call_text(name: str, arguments: Any) -> str:
    """A tool call as the model writes it."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            pass  # kept as the string it was
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CALL_CLOSE}"


def render_messages(messages: list[dict[str, Any]], functions: list[Function], native: bool) -> list[dict[str, Any]]:
    """Messages for the chat template. ``native``: the template renders tools and tool calls
    itself (arguments handed over as objects); otherwise the tool block joins the system turn
    and tool calls and results become text in the format above."""
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if native:
            if calls:
                m["tool_calls"] = [{"type": "function", "id": c.get("id"), "function": {
                    "name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments"))}}
                    for c in calls]
            out.append(m)
            continue
        m.pop("tool_call_id", None)
        if calls:
            parts = [m.get("content") or ""] + [call_text(c["function"]["name"], c["function"].get("arguments"))
                                                for c in calls]
            m["content"] = "\n".join(p for p in parts if p)
        if m["role"] == "tool":
            m["content"] = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
        out.append(m)
    if functions and not native:
        block = tools_block(functions)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def grammar(functions: list[Function], parallel: bool) -> StructuredOutputsParams:
    """The grammar of one tool call (``parallel``: one or more, a newline apart) of one of
    ``functions``, its arguments valid against the function's parameters (an object schema with
    properties and no word on others gets ``additionalProperties: false``: every output still
    validates against the given schema, and a model cannot add keys until max_tokens)."""
    rules = []
    for i, f in enumerate(functions):
        args = f.parameters
        if "properties" in args and "additionalProperties" not in args:
            args = {**args, "additionalProperties": False}  # still valid against the given schema
        schema = {"type": "object", "properties": {"name": {"const": f.name}, "arguments": args},
                  "required": ["name", "arguments"], "additionalProperties": False,
                  "x-guidance": JSON_OPTIONS}
        rules.append(f"fn{i}: %json {json.dumps(schema, ensure_ascii=False)}")
    alts = " | ".join(f"fn{i}" for i in range(len(functions)))
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    lark = "\n".join([start, f'call: "{CALL_OPEN}\\n" ({alts}) "\\n{CALL_CLOSE}"', *rules])
    return StructuredOutputsParams(grammar=lark)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _as_call(body: str, names: set[str]) -> dict[str, Any] | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = _arguments(args)
    return {"id": new_call_id(), "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def parse_calls(text: str, functions: list[Function], parallel: bool = True) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` read from a whole answer: each ``<tool_call>`` block naming an
    offered function is a call (only the first when not ``parallel``); the text before the
    first call is the content (None when empty). No valid call: the text is all content."""
    names = {f.name for f in functions}
    calls = []
    first = None
    for m in _CALL_RE.finditer(text):
        call = _as_call(m.group(1), names)
        if call is not None:
            calls.append(call)
            first = m.start() if first is None else first
    if not calls:
        return text, []
    content = text[:first].strip()
    return (content or None), (calls if parallel else calls[:1])


class CallStream:
    """Reads tool calls out of streamed text: ``feed(new_text)`` and ``end()`` return events,
    ``("content", text)`` or ``("call", call_dict)``, in order. Text that may start a
    ``<tool_call>`` is held back until it is known not to."""

    def __init__(self, functions: list[Function], parallel: bool = True):
        self._names = {f.name for f in functions}
        self._parallel = parallel
        self._buf = ""
        self.num_calls = 0

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self._buf += text
        events: list[tuple[str, Any]] = []
        while True:
            i = self._buf.find(CALL_OPEN)
            if i < 0:
                keep = _partial_suffix(self._buf, CALL_OPEN)
                emit, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                if emit and not self.num_calls:
                    events.append(("content", emit))
                return events
            if i and not self.num_calls:
                events.append(("content", self._buf[:i]))
            self._buf = self._buf[i:]
            j = self._buf.find(CALL_CLOSE)
            if j < 0:
                return events
            body, self._buf = self._buf[len(CALL_OPEN):j], self._buf[j + len(CALL_CLOSE):]
            call = _as_call(body.strip(), self._names)
            if call is None:
                if not self.num_calls:
                    events.append(("content", CALL_OPEN + body + CALL_CLOSE))
            elif self._parallel or not self.num_calls:
                self.num_calls += 1
                events.append(("call", call))

    def end(self) -> list[tuple[str, Any]]:
        rest, self._buf = self._buf, ""
        return [("content", rest)] if rest and not self.num_calls else []


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
