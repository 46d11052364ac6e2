"""Anthropic's tools on ``/v1/messages``, mapped onto the OpenAI routes' machinery
(``server/tools.py``, ``server/constraints.py``): the same rendering, grammar and parsing.

- ``tools: [{"name", "description", "input_schema"}]`` are functions with those parameters;
  ``tool_choice`` ``auto`` / ``any`` / ``tool`` (named) / ``none`` are OpenAI's ``auto`` /
  ``required`` / a named function / ``none``; ``disable_parallel_tool_use`` is
  ``parallel_tool_calls: false``.
- ``tool_use`` blocks of an assistant turn become its ``tool_calls``; ``tool_result`` blocks of a
  user turn become ``tool`` turns (before the turn's text).
- An answer's calls become ``tool_use`` content blocks (``id`` ``toolu_...``, ``input`` the
  arguments object) with ``stop_reason: "tool_use"``; streamed, each is a ``content_block_start``
  then one ``input_json_delta``.

Knows the request shapes; not the engine.
"""

from __future__ import annotations

import json
from typing import Any

from hotprefix.server import tool_formats as F
from hotprefix.server import tools as T
from hotprefix.server.constraints import Constraint
from hotprefix.server.protocol import APIError


def _bad(message: str) -> APIError:
    return APIError(400, message, param="tools")


def functions(tools: list[dict[str, Any]] | None) -> list[T.Function]:
    """Anthropic's client tools as functions; server tools (``web_search``...) are refused."""
    out = []
    for i, t in enumerate(tools or []):
        if not isinstance(t, dict) or "input_schema" not in t or t.get("type") not in (None, "custom"):
            raise _bad(f"tools.{i}: only client tools ({{name, description, input_schema}}) are "
                       "supported by this server")
        f = {"name": t.get("name"), "parameters": t["input_schema"]}
        if t.get("description") is not None:
            f["description"] = t["description"]
        out.append({"type": "function", "function": f})
    try:
        return T.parse_tools(out)
    except T.ToolError as e:
        raise _bad(str(e).replace("tools[", "tools.").replace("].function", "")) from None


def constraint(tools: list[dict[str, Any]] | None, tool_choice: dict[str, Any] | None,
               fmt: F.ToolFormat = F.HERMES) -> Constraint:
    """The request's tool handling (and, for ``any`` / ``tool``, the grammar of the call, in the
    model's format ``fmt``)."""
    offered = functions(tools)
    tc = tool_choice or {}
    kind = tc.get("type", "auto")
    parallel = not tc.get("disable_parallel_tool_use", False)
    choice: Any = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        choice = {"type": "function", "function": {"name": tc.get("name")}}
    if choice is None:
        raise APIError(400, f"tool_choice.type must be auto, any, tool or none; got {kind!r}",
                       param="tool_choice")
    if not offered:
        if kind in ("any", "tool"):
            raise APIError(400, f"tool_choice {kind!r} needs tools", param="tool_choice")
        return Constraint(format=fmt)
    try:
        mode, callable_ = T.pick(offered, choice)
    except T.ToolError as e:
        raise APIError(400, str(e), param="tool_choice") from None
    spec = None
    if mode == "required":
        parallel = parallel and kind == "any"
        spec = fmt.grammar(callable_, parallel)
    return Constraint(spec, "tool_choice" if spec else None, mode, callable_, parallel, offered, fmt)


def history(role: str, blocks: list[Any]) -> list[dict[str, Any]]:
    """A turn's content blocks as chat messages: text joined; an assistant's ``tool_use`` blocks
    as its ``tool_calls``; a user's ``tool_result`` blocks as ``tool`` turns before its text."""
    text = "".join(b.text for b in blocks if b.type == "text")
    if role == "assistant":
        calls = [{"id": b.id, "type": "function",
                  "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                 for b in blocks if b.type == "tool_use"]
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            msg["tool_calls"] = calls
        return [msg]
    out = []
    for b in blocks:
        if b.type == "tool_result":
            content = b.content if isinstance(b.content, str) else "".join(p.text for p in b.content or [])
            out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                        "content": f"Error: {content}" if b.is_error else content})
    if text or not out:
        out.append({"role": role, "content": text})
    return out


def tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI-shaped call as Anthropic's ``tool_use`` block."""
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
            "name": call["function"]["name"], "input": json.loads(call["function"]["arguments"])}


def content(c: Constraint, text: str) -> list[dict[str, Any]]:
    """The answer's content blocks: its text (when any) and its tool calls."""
    if c.tool_mode == "none" or not c.functions:
        return [{"type": "text", "text": text}]
    before, calls = c.format.parse(text, c.functions, c.parallel)
    if not calls:
        return [{"type": "text", "text": text}]
    return ([{"type": "text", "text": before}] if before else []) + [tool_use_block(x) for x in calls]
