"""Getting a request's outputs to the client: all at once (``collect``) or as server-sent events
(``stream_response``), in the OpenAI chunk shapes for completions and chat, a chunk per choice
(``n``), with log probabilities when asked. A client that goes away aborts its request (every
choice of it), so its blocks are released."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from hotprefix.engine.async_engine import RequestStream
from hotprefix.engine.engine import RequestOutput
from hotprefix.server import logprobs as L
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


@dataclass(frozen=True)
class LogprobView:
    """How a stream shows log probabilities (``server/logprobs.py``)."""

    k: int
    """Alternatives per token."""
    text: L.TokenText
    echo: str | None = None
    """Completions with ``echo``: the prompt's text, sent first (with its tokens' log
    probabilities when the request asked for ``logprobs``)."""
    show: bool = True
    """Whether the request asked for log probabilities (``echo`` alone does not)."""


def stream_response(stream: RequestStream, chat: bool, rid: str, created: int, model: str,
                    include_usage: bool, finish: Callable[[RequestOutput], dict[str, Any]],
                    constraint: Any = None, view: LogprobView | None = None) -> StreamingResponse:
    """Server-sent events for one request; ``finish(out)`` records it and returns its cache report.
    Each choice (``n``) streams as its own chunks (``choices[0].index``), ending with its own
    finish reason; the cache report rides on the request's last chunk. With ``view``, each chunk
    carries its tokens' log probabilities. With tools (``constraint.tool_mode`` not ``none``), tool
    calls stream in OpenAI's delta shape (``server/tools.py``'s ``CallStream``: text that may open
    a call is held back until it is known)."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    with_tools = chat and constraint is not None and constraint.tool_mode != "none" \
        and constraint.functions
    calls: dict[int, Any] = {}
    num_calls: dict[int, int] = {}
    sent_lps: dict[int, int] = {}  # per choice: tokens whose log probabilities were sent
    offsets: dict[int, int] = {}  # per choice: text_offset of the next token (completions)
    ended: set[int] = set()

    def call_stream(i: int) -> Any:
        if i not in calls:
            calls[i] = constraint.format.stream(constraint.functions, constraint.parallel)
        return calls[i]

    def deltas(i: int, text: str, last: bool) -> list[dict[str, Any]]:
        """The chunks for a choice's new text: content, and each tool call as its first delta
        (id, name) and its arguments."""
        if not with_tools:
            return [chunk(i, text, None)] if text else []
        cs = call_stream(i)
        out = []
        for kind, v in cs.feed(text) + (cs.end() if last else []):
            if kind == "content":
                out.append(chunk(i, v, None))
                continue
            n = num_calls.get(i, 0)
            num_calls[i] = n + 1
            for d in ({"index": n, "id": v["id"], "type": "function",
                       "function": {"name": v["function"]["name"], "arguments": ""}},
                      {"index": n, "function": {"arguments": v["function"]["arguments"]}}):
                c = chunk(i, None, None)
                c["choices"][0]["delta"] = {"tool_calls": [d]}
                out.append(c)
        return out

    def chunk(i: int, delta_text: str | None, finish_reason: str | None, **extra: Any) -> dict[str, Any]:
        if chat:
            delta = {} if delta_text is None else {"content": delta_text}
            choice: dict[str, Any] = {"index": i, "delta": delta, "logprobs": None,
                                      "finish_reason": finish_reason}
        else:
            choice = {"index": i, "text": delta_text or "", "logprobs": None,
                      "finish_reason": finish_reason}
        c = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice], **extra}
        if include_usage and "usage" not in c:
            c["usage"] = None
        return c

    def with_logprobs(i: int, comp: Any, chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The choice's new tokens' log probabilities on its first chunk of this step (a chunk
        with empty text when the text is held back)."""
        if view is None or not view.show or comp.logprobs is None:
            return chunks
        start, end = sent_lps.get(i, 0), len(comp.logprobs)
        if end <= start:
            return chunks
        sent_lps[i] = end
        ids, positions = comp.token_ids[start:end], comp.logprobs[start:end]
        if chat:
            lp = {"content": L.chat_content(ids, positions, view.k, view.text), "refusal": None}
        else:
            lp = L.completion_logprobs(ids, positions, view.k, view.text, offsets.get(i, 0))
            offsets[i] = offsets.get(i, 0) + sum(len(t) for t in lp["tokens"])
        content = [c for c in chunks if "tool_calls" not in c["choices"][0].get("delta", {})]
        if not content:
            content = [chunk(i, "", None)]
            chunks = content + chunks
        content[0]["choices"][0]["logprobs"] = lp
        return chunks

    def echo_chunks(out: RequestOutput, n: int) -> list[dict[str, Any]]:
        """Completions with ``echo``: each choice's first chunk is the prompt."""
        out_chunks = []
        for i in range(n):
            c = chunk(i, view.echo, None)
            if view.show and out.prompt_logprobs is not None:
                lp = L.completion_logprobs(out.prompt_token_ids, out.prompt_logprobs, view.k, view.text)
                c["choices"][0]["logprobs"] = lp
                offsets[i] = sum(len(t) for t in lp["tokens"])
            else:
                offsets[i] = len(view.echo or "")
            out_chunks.append(c)
        return out_chunks

    async def events() -> AsyncIterator[str]:
        try:
            first_out = True
            async for out in stream:
                if out.finish_reason == "error":
                    yield sse(engine_error(out).body())
                    break
                comps = out.outputs
                if first_out:
                    first_out = False
                    if chat:
                        for i in range(len(comps)):
                            first = chunk(i, None, None)
                            first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                            yield sse(first)
                    elif view is not None and view.echo is not None:
                        for c in echo_chunks(out, len(comps)):
                            yield sse(c)
                closing = []
                for comp in comps:
                    i = comp.index
                    if i in ended:
                        continue
                    done = comp.finish_reason is not None
                    for c in with_logprobs(i, comp, deltas(i, comp.new_text, done)):
                        yield sse(c)
                    if done:
                        ended.add(i)
                        reason = comp.finish_reason
                        if calls.get(i) is not None and calls[i].num_calls and reason == "stop":
                            reason = "tool_calls"
                        closing.append((i, reason))
                if out.finished:
                    hp = {"hotprefix": {"cache": finish(out)}}
                    for j, (i, reason) in enumerate(closing):
                        last = j == len(closing) - 1
                        yield sse(chunk(i, None if chat else "", reason, **(hp if last else {})))
                else:
                    for i, reason in closing:
                        yield sse(chunk(i, None if chat else "", reason))
                if not out.finished:
                    continue
                if include_usage:
                    u = P.usage(len(out.prompt_token_ids), out.num_generated_tokens,
                                out.num_cached_tokens)
                    yield sse({"id": rid, "object": obj, "created": created, "model": model,
                               "choices": [], "usage": u, **hp})
            yield "data: [DONE]\n\n"
        finally:
            if not stream.finished:
                stream.abort_nowait()

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
