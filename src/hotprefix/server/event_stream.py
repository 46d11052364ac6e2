"""The one skeleton of a streamed answer, shared by every streaming route: iterate the engine's
outputs, hand each to the API's adapter (which turns it into that API's server-sent events), send
the API's error event when the engine fails, and abort the request in ``finally`` when the stream
stops before the request finished (the client went away), so its blocks are released.

Also here: the two SSE framings (a bare ``data:`` line, OpenAI's; a named ``event:`` then
``data:``, Anthropic's and the Responses API's) and ``Pieces``, an answer's text as content and
tool calls as it streams.

Knows no API's event shapes: those are the adapters' (``streaming.py``: OpenAI's completion and
chat chunks; ``messages.py``: Anthropic's message events; ``responses_stream.py``: the Responses
API's events).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any, AsyncIterator

from fastapi.responses import StreamingResponse

from hotprefix.engine.async_engine import RequestStream
from hotprefix.engine.engine import RequestOutput
from hotprefix.server import constraints as C
from hotprefix.server.errors import engine_error
from hotprefix.server.protocol import APIError

NO_ANSWER = "the request ended without an answer"
"""The error message of a stream that ended before its request finished."""


def sse(obj: Any) -> str:
    """A bare ``data:`` event (OpenAI's framing)."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def named_event(kind: str, data: dict[str, Any], ensure_ascii: bool = True) -> str:
    """An ``event: kind`` then its ``data:`` (Anthropic's and the Responses API's framing)."""
    body = json.dumps(data, separators=(',', ':'), ensure_ascii=ensure_ascii)
    return f"event: {kind}\ndata: {body}\n\n"


class Pieces:
    """An answer's text, as it streams, in ``("content", text)`` and ``("call", call_dict)`` pieces.

    With tools offered (``constraint.tool_mode`` not ``none``), calls are read out in the model's
    tool format (``server/tool_formats.py``) and text that may open a call is held back until it
    is known; without, each non-empty new text is one content piece."""

    def __init__(self, constraint: C.Constraint | None):
        self._calls = None
        if constraint is not None and constraint.tool_mode != "none" and constraint.functions:
            self._calls = constraint.format.stream(constraint.functions, constraint.parallel)

    @property
    def with_tools(self) -> bool:
        return self._calls is not None

    @property
    def num_calls(self) -> int:
        """Tool calls read so far (0 without tools)."""
        return self._calls.num_calls if self._calls is not None else 0

    def feed(self, text: str, last: bool) -> list[tuple[str, Any]]:
        """The pieces of new text; ``last``: the answer ends with it (held-back text is let go)."""
        if self._calls is None:
            return [("content", text)] if text else []
        return self._calls.feed(text) + (self._calls.end() if last else [])


class EventAdapter(ABC):
    """One API's events for one request: what the skeleton (``events``) sends at each point.
    Every method returns the events, already framed, in the order they go out."""

    def opening(self) -> list[str]:
        """Before the engine's first output."""
        return []

    def started(self, out: RequestOutput) -> list[str]:
        """On the first output, before its ``step``."""
        return []

    @abstractmethod
    def step(self, out: RequestOutput) -> list[str]:
        """An output's new text (and, for several choices, the choices that ended with it)."""

    @abstractmethod
    async def finish(self, out: RequestOutput) -> list[str]:
        """After the ``step`` of the request's finished output: records the request and closes
        the answer (stop reason, usage, the cache report)."""

    @abstractmethod
    def failed(self, err: APIError) -> list[str]:
        """The engine failed running the request; the stream ends with these."""

    def ended(self, finished: bool) -> list[str]:
        """The engine's outputs ran out (``finished``: the request finished)."""
        return []


async def events(stream: RequestStream, adapter: EventAdapter) -> AsyncIterator[str]:
    """The events of one request, through its API's adapter. A stream that stops before the
    request finished (the client went away, an error) aborts the request."""
    try:
        for e in adapter.opening():
            yield e
        first = True
        finished = False
        async for out in stream:
            if out.finish_reason == "error":
                for e in adapter.failed(engine_error(out)):
                    yield e
                return
            if first:
                first = False
                for e in adapter.started(out):
                    yield e
            for e in adapter.step(out):
                yield e
            if out.finished:
                finished = True
                for e in await adapter.finish(out):
                    yield e
        for e in adapter.ended(finished):
            yield e
    finally:
        if not stream.finished:
            stream.abort_nowait()


def respond(stream: RequestStream, adapter: EventAdapter) -> StreamingResponse:
    """The streamed HTTP response of one request (no caching, no proxy buffering)."""
    return StreamingResponse(events(stream, adapter), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
