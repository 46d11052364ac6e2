"""The Responses API's shapes (``/v1/responses``): the request, its input items as chat messages,
its tools in chat's shape, and the response object with its output items.

- ``input``: a string (one user message) or items: messages (``{"role", "content"}``, content a
  string or ``input_text`` / ``output_text`` parts), ``function_call`` items (an assistant turn's
  ``tool_calls``; consecutive ones, and the assistant message before them, are one turn) and
  ``function_call_output`` items (``tool`` turns). ``reasoning`` items are dropped (no model
  here reasons in a separate channel); images, files and item references are refused by name.
- ``instructions``: the system turn, first. ``tools``: ``{"type": "function", "name",
  "description", "parameters"}``; other tool types are refused by name.
- The response: ``output`` items (a ``message`` with one ``output_text`` part when the answer has
  text, a ``function_call`` item per call), ``usage`` with ``input_tokens_details.cached_tokens``
  and, as on the other routes, the cache report under ``hotprefix``.

Knows nothing about the engine or storage.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import ConfigDict, Field

from hotprefix.server import protocol as P

RESPONSE_ID_PREFIX = "resp_"
MAX_INPUT_ITEMS = 4096
"""Most input items one request may give."""
UNSUPPORTED_PARTS = ("input_image", "input_file", "input_audio")


class ResponsesRequest(P._Checked):
    """``POST /v1/responses``. Typed where this server acts on a field; OpenAI fields it does not
    act on (``metadata``, ``include``, ``truncation``, ``reasoning``, ``service_tier``, ``user``,
    ``safety_identifier``...) are accepted and ignored, as vLLM does: clients send them freely."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    model: str | None = Field(None, max_length=512)
    input: str | list[dict[str, Any]] = Field(..., max_length=MAX_INPUT_ITEMS)
    instructions: str | None = None
    previous_response_id: str | None = Field(None, max_length=128)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    """``{"format": {"type": "text" | "json_object" | "json_schema", "name", "schema", "strict"}}``."""
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool | None = False
    store: bool | None = True
    background: bool | None = False
    """Run detached: the answer is stored and polled with ``GET /v1/responses/{id}`` (and can be
    cancelled); needs ``store``."""
    metadata: dict[str, Any] | None = None
    prompt_cache_key: str | None = Field(None, max_length=P.MAX_CACHE_KEY_CHARS)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    hotprefix: P.CacheControl | None = None


class ItemError(ValueError):
    """A bad input item or tool; ``param`` names it (``input[3].content[0].type``)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ItemError(f"{where} must be a string or a list of content parts", where)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            out.append(str(part.get("text") or ""))
        elif kind == "refusal":
            out.append(str(part.get("refusal") or ""))
        elif kind in UNSUPPORTED_PARTS:
            raise ItemError(f"{where}[{j}]: {kind} is not supported by this server (text only)",
                            f"{where}[{j}].type")
        else:
            raise ItemError(f"{where}[{j}]: unknown content part type {kind!r}", f"{where}[{j}].type")
    return "".join(out)


def input_messages(inp: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as chat message dicts (``protocol.message_dicts``' shape)."""
    if isinstance(inp, str):
        return [{"role": "user", "content": inp}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(inp):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ItemError(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ItemError(f"{where}.role must be user, system, developer or assistant", f"{where}.role")
            text = _text(item.get("content"), f"{where}.content")
            out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            name, args = item.get("name"), item.get("arguments", "")
            if not isinstance(name, str) or not isinstance(args, str):
                raise ItemError(f"{where}: a function_call has a name and arguments (a JSON string)", where)
            call = {"id": str(item.get("call_id") or item.get("id") or ""), "type": "function",
                    "function": {"name": name, "arguments": args}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # the same turn
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id") or ""), "content": text})
        elif kind == "reasoning":
            continue
        else:
            raise ItemError(f"{where}: input items of type {kind!r} are not supported by this server "
                            "(messages, function_call, function_call_output)", f"{where}.type")
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools in chat's shape (``{"type": "function", "function": {...}}``)."""
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise ItemError(f"tools[{i}]: {kind!r} tools are not supported by this server (function "
                            "tools only)", f"tools[{i}].type")
        if isinstance(t.get("function"), dict):  # chat's shape, sent here: taken as it is
            out.append(t)
            continue
        f = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        out.append({"type": "function", "function": f})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """``{"type": "function", "name": ...}`` as chat's ``{"type": "function", "function": {...}}``."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        raise ItemError("tool_choice allowed_tools is not supported by this server", "tool_choice")
    return choice


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise ItemError("text.format must be an object", "text.format")
    if fmt.get("type") == "json_schema":
        js = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": js}
    return {"type": fmt.get("type")}


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or new_id("msg_"), "type": "message", "role": "assistant", "status": status,
            "content": [output_text(text)] if status != "in_progress" else []}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    """An OpenAI chat tool call as a ``function_call`` output item."""
    return {"id": "fc_" + call["id"].removeprefix("call_"), "type": "function_call", "status": status,
            "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"] if status != "in_progress" else ""}


def output_items(content: str | None, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The answer's output items: its text as one message (when any), then each call."""
    items = [message_item(content)] if content or not calls else []
    return items + [call_item(c) for c in calls]


def items_as_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items as the chat messages that continue the conversation (one assistant turn)."""
    text = "".join(p.get("text", "") for it in items if it["type"] == "message" for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function",
              "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in items if it["type"] == "function_call"]
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        msg["tool_calls"] = calls
    return [msg]


def usage(num_input: int, num_output: int, num_cached: int) -> dict[str, Any]:
    return {"input_tokens": num_input, "input_tokens_details": {"cached_tokens": int(num_cached)},
            "output_tokens": num_output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": num_input + num_output}


def response_object(rid: str, body: ResponsesRequest, model: str, status: str,
                    output: list[dict[str, Any]], usage_: dict[str, Any] | None,
                    created_at: int | None = None, incomplete: str | None = None,
                    error: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``response`` object (OpenAI's field set)."""
    return {
        "id": rid, "object": "response", "created_at": created_at or int(time.time()),
        "status": status, "background": bool(body.background), "error": error,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "model": model, "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
        "tools": body.tools or [], "text": body.text or {"format": {"type": "text"}},
        "truncation": "disabled", "store": body.store is not False, "metadata": body.metadata or {},
        "usage": usage_, "user": None,
    }


def canonical_tools(tools: list[dict[str, Any]] | None) -> str:
    """The tools as one canonical text (a continuation keeps the stored tokens only when the tools
    are the same)."""
    return json.dumps(tools or [], sort_keys=True, ensure_ascii=False)


def error_object(message: str, code: str = "server_error") -> dict[str, Any]:
    """The Responses API's ``error`` of a failed response (``{"code", "message"}``); its ``error``
    stream event is this with ``"param": None`` (``error_event``)."""
    return {"code": code, "message": message}


def error_event(message: str, code: str = "server_error") -> dict[str, Any]:
    """The fields of the Responses API's ``error`` stream event."""
    return {**error_object(message, code), "param": None}
