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
                    include_usage: bool,
                    finish: Callable[[RequestOutput], dict[str, Any]]) -> StreamingResponse:
    """Server-sent events for one request; ``finish(out)`` records it and returns its cache report."""
    obj = "chat.completion.chunk" if chat else "text_completion"

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
                if out.new_text:
                    yield sse(chunk(out.new_text, None))
                if not out.finished:
                    continue
                hp = {"hotprefix": {"cache": finish(out)}}
                yield sse(chunk(None if chat else "", out.finish_reason, **hp))
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
