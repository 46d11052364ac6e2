"""Getting a request's outputs to the client: all at once (``collect``) or as server-sent events
(``stream_response``), in the OpenAI chunk shapes for completions and chat. A client that goes
away aborts its request, so its blocks are released."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from hotprefix.engine.async_engine import RequestStream
from hotprefix.engine.engine import RequestOutput
from hotprefix.server import protocol as P
from hotprefix.server.errors import engine_error

DISCONNECT_POLL_S = 0.5
"""How often a non-streaming request checks whether its client is still there."""


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def collect(stream: RequestStream, request: Request) -> RequestOutput | None:
    """The final output, or None if the client went away (the request is then aborted)."""
    async def last() -> RequestOutput:
        final = None
        async for out in stream:
            final = out
        assert final is not None
        return final

    task = asyncio.ensure_future(last())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                return None
    finally:
        if not task.done():
            task.cancel()
        stream.abort_nowait()


def stream_response(stream: RequestStream, chat: bool, rid: str, created: int, model: str,
                    include_usage: bool, finish: Callable[[RequestOutput], dict[str, Any]],
                    constraint: Any = None) -> StreamingResponse:
    """Server-sent events for one request; ``finish(out)`` records it and returns its cache report.
    With tools (``constraint.tool_mode`` not ``none``), tool calls stream in OpenAI's delta shape
    (``server/tools.py``'s ``CallStream``: text that may open a call is held back until it is known)."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    calls = None
    if chat and constraint is not None and constraint.tool_mode != "none" and constraint.functions:
        from hotprefix.server.tools import CallStream

        calls = CallStream(constraint.functions, constraint.parallel)
    num_calls = [0]

    def deltas(text: str, last: bool) -> list[dict[str, Any]]:
        """The chunks for new text: content, and each tool call as its first delta (id, name)
        and its arguments."""
        if calls is None:
            return [chunk(text, None)] if text else []
        out = []
        for kind, v in calls.feed(text) + (calls.end() if last else []):
            if kind == "content":
                out.append(chunk(v, None))
                continue
            i, num_calls[0] = num_calls[0], num_calls[0] + 1
            for d in ({"index": i, "id": v["id"], "type": "function",
                       "function": {"name": v["function"]["name"], "arguments": ""}},
                      {"index": i, "function": {"arguments": v["function"]["arguments"]}}):
                c = chunk(None, None)
                c["choices"][0]["delta"] = {"tool_calls": [d]}
                out.append(c)
        return out

    def chunk(delta_text: str | None, finish_reason: str | None, **extra: Any) -> dict[str, Any]:
        if chat:
            delta = {} if delta_text is None else {"content": delta_text}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": delta_text or "", "logprobs": None,
                      "finish_reason": finish_reason}
        c = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice], **extra}
        if include_usage and "usage" not in c:
            c["usage"] = None
        return c

    async def events() -> AsyncIterator[str]:
        try:
            if chat:
                first = chunk(None, None)
                first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                yield sse(first)
            async for out in stream:
                if out.finish_reason == "error":
                    yield sse(engine_error(out).body())
                    break
                for c in deltas(out.new_text, out.finished):
                    yield sse(c)
                if not out.finished:
                    continue
                hp = {"hotprefix": {"cache": finish(out)}}
                reason = out.finish_reason
                if calls is not None and calls.num_calls and reason == "stop":
                    reason = "tool_calls"
                yield sse(chunk(None if chat else "", reason, **hp))
                if include_usage:
                    u = P.usage(len(out.prompt_token_ids), len(out.token_ids), out.num_cached_tokens)
                    yield sse({"id": rid, "object": obj, "created": created, "model": model,
                               "choices": [], "usage": u, **hp})
            yield "data: [DONE]\n\n"
        finally:
            if not stream.finished:
                stream.abort_nowait()

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
