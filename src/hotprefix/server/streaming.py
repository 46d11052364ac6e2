"""Getting a request's outputs to the client: all at once (``collect``) or as server-sent events
(``stream_response``), in the OpenAI chunk shapes for completions and chat, a chunk per choice
(``n``), with log probabilities when asked. A client that goes away aborts its request (every
choice of it), so its blocks are released.

The stream runs on the shared skeleton (``server/event_stream.py``); ``ChunkStream`` is its OpenAI
adapter."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from hotprefix.engine.async_engine import RequestStream
from hotprefix.engine.engine import RequestOutput
from hotprefix.server import logprobs as L
from hotprefix.server import protocol as P
from hotprefix.server.protocol import APIError
from hotprefix.server.event_stream import EventAdapter, Pieces, respond, sse

DISCONNECT_POLL_S = 0.5
"""How often a non-streaming request checks whether its client is still there."""


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




DONE = "data: [DONE]\n\n"
"""OpenAI's last event, after an answer and after an error alike."""


@dataclass
class _Choice:
    """Where one choice (``n``) of a stream stands."""

    pieces: Pieces
    """Its text as content and tool calls."""
    num_calls: int = 0
    """Tool calls sent (the next call's ``index``)."""
    num_logprobs: int = 0
    """Tokens whose log probabilities were sent."""
    offset: int = 0
    """Completions: the ``text_offset`` of the next token."""
    ended: bool = False
    """Its finish reason was sent (or is going out with this output)."""


@dataclass
class ChunkStream(EventAdapter):
    """OpenAI's chunks (``chat.completion.chunk`` or ``text_completion``) for one request, each
    choice as its own chunks (``choices[0].index``) ending with its own finish reason; the cache
    report rides on the request's last chunk, then the usage chunk when asked."""

    chat: bool
    rid: str
    created: int
    model: str
    include_usage: bool
    record: Callable[[RequestOutput], dict[str, Any]]
    """Records the finished request; returns its cache report."""
    constraint: Any = None
    """With tools (chat only), calls stream in OpenAI's delta shape."""
    view: LogprobView | None = None
    choices: dict[int, _Choice] = field(default_factory=dict)
    closing: list[tuple[int, str]] = field(default_factory=list)
    """The choices that ended with the current output, and their finish reasons."""

    def _choice(self, i: int) -> _Choice:
        if i not in self.choices:
            self.choices[i] = _Choice(Pieces(self.constraint if self.chat else None))
        return self.choices[i]

    def chunk(self, i: int, delta_text: str | None, finish_reason: str | None,
              **extra: Any) -> dict[str, Any]:
        if self.chat:
            delta = {} if delta_text is None else {"content": delta_text}
            choice: dict[str, Any] = {"index": i, "delta": delta, "logprobs": None,
                                      "finish_reason": finish_reason}
        else:
            choice = {"index": i, "text": delta_text or "", "logprobs": None,
                      "finish_reason": finish_reason}
        c = {"id": self.rid, "object": self._object, "created": self.created, "model": self.model,
             "choices": [choice], **extra}
        if self.include_usage and "usage" not in c:
            c["usage"] = None
        return c

    @property
    def _object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _end_chunk(self, i: int, reason: str, **extra: Any) -> str:
        return sse(self.chunk(i, None if self.chat else "", reason, **extra))

    def started(self, out: RequestOutput) -> list[str]:
        """Chat: each choice's role chunk. Completions with ``echo``: each choice's prompt."""
        if self.chat:
            firsts = []
            for i in range(len(out.outputs)):
                first = self.chunk(i, None, None)
                first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                firsts.append(sse(first))
            return firsts
        if self.view is not None and self.view.echo is not None:
            return [sse(c) for c in self._echo_chunks(out)]
        return []

    def step(self, out: RequestOutput) -> list[str]:
        events = []
        self.closing = []
        for comp in out.outputs:
            ch = self._choice(comp.index)
            if ch.ended:
                continue
            done = comp.finish_reason is not None
            chunks = self._deltas(comp.index, ch, comp.new_text, done)
            events += [sse(c) for c in self._with_logprobs(comp, ch, chunks)]
            if done:
                ch.ended = True
                reason = comp.finish_reason
                if ch.pieces.num_calls and reason == "stop":
                    reason = "tool_calls"
                self.closing.append((comp.index, reason))
        if not out.finished:
            events += [self._end_chunk(i, reason) for i, reason in self.closing]
        return events

    async def finish(self, out: RequestOutput) -> list[str]:
        hp = {"hotprefix": {"cache": self.record(out)}}
        last = len(self.closing) - 1
        events = [self._end_chunk(i, reason, **(hp if j == last else {}))
                  for j, (i, reason) in enumerate(self.closing)]
        if self.include_usage:
            u = P.usage(len(out.prompt_token_ids), out.num_generated_tokens, out.num_cached_tokens)
            events.append(sse({"id": self.rid, "object": self._object, "created": self.created,
                               "model": self.model, "choices": [], "usage": u, **hp}))
        return events

    def failed(self, err: APIError) -> list[str]:
        return [sse(err.body()), DONE]

    def ended(self, finished: bool) -> list[str]:
        return [DONE]

    def _deltas(self, i: int, ch: _Choice, text: str, last: bool) -> list[dict[str, Any]]:
        """The chunks for a choice's new text: content, and each tool call as its first delta
        (id, name) and its arguments."""
        out = []
        for kind, v in ch.pieces.feed(text, last):
            if kind == "content":
                out.append(self.chunk(i, v, None))
                continue
            n, ch.num_calls = ch.num_calls, ch.num_calls + 1
            for d in ({"index": n, "id": v["id"], "type": "function",
                       "function": {"name": v["function"]["name"], "arguments": ""}},
                      {"index": n, "function": {"arguments": v["function"]["arguments"]}}):
                c = self.chunk(i, None, None)
                c["choices"][0]["delta"] = {"tool_calls": [d]}
                out.append(c)
        return out

    def _with_logprobs(self, comp: Any, ch: _Choice, chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The choice's new tokens' log probabilities on its first chunk of this step (a chunk
        with empty text when the text is held back)."""
        view = self.view
        if view is None or not view.show or comp.logprobs is None:
            return chunks
        start, end = ch.num_logprobs, len(comp.logprobs)
        if end <= start:
            return chunks
        ch.num_logprobs = end
        ids, positions = comp.token_ids[start:end], comp.logprobs[start:end]
        if self.chat:
            lp = {"content": L.chat_content(ids, positions, view.k, view.text), "refusal": None}
        else:
            lp = L.completion_logprobs(ids, positions, view.k, view.text, ch.offset)
            ch.offset += sum(len(t) for t in lp["tokens"])
        content = [c for c in chunks if "tool_calls" not in c["choices"][0].get("delta", {})]
        if not content:
            content = [self.chunk(comp.index, "", None)]
            chunks = content + chunks
        content[0]["choices"][0]["logprobs"] = lp
        return chunks

    def _echo_chunks(self, out: RequestOutput) -> list[dict[str, Any]]:
        """Completions with ``echo``: each choice's first chunk is the prompt."""
        view = self.view
        assert view is not None
        chunks = []
        for i in range(len(out.outputs)):
            c = self.chunk(i, view.echo, None)
            if view.show and out.prompt_logprobs is not None:
                lp = L.completion_logprobs(out.prompt_token_ids, out.prompt_logprobs, view.k, view.text)
                c["choices"][0]["logprobs"] = lp
                self._choice(i).offset = sum(len(t) for t in lp["tokens"])
            else:
                self._choice(i).offset = len(view.echo or "")
            chunks.append(c)
        return chunks


def stream_response(stream: RequestStream, chat: bool, rid: str, created: int, model: str,
                    include_usage: bool, finish: Callable[[RequestOutput], dict[str, Any]],
                    constraint: Any = None, view: LogprobView | None = None) -> StreamingResponse:
    """Server-sent events for one request; ``finish(out)`` records it and returns its cache report.
    Each choice (``n``) streams as its own chunks (``choices[0].index``), ending with its own
    finish reason; the cache report rides on the request's last chunk. With ``view``, each chunk
    carries its tokens' log probabilities. With tools (``constraint.tool_mode`` not ``none``), tool
    calls stream in OpenAI's delta shape (``server/tools.py``'s ``CallStream``: text that may open
    a call is held back until it is known)."""
    return respond(stream, ChunkStream(chat, rid, created, model, include_usage, finish,
                                       constraint, view))
