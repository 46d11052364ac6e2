"""The Responses API's answer as output items, whole or as OpenAI's streaming event sequence.

``Answer`` turns the model's text into output items as it arrives (the text as one ``message``
item with one ``output_text`` part, each tool call as a ``function_call`` item, read in the model's
tool format: ``server/tool_formats.py``) and, for a stream, into the events in OpenAI's order::

    response.created, response.in_progress,
    response.output_item.added (message), response.content_part.added,
    response.output_text.delta..., response.output_text.done, response.content_part.done,
    response.output_item.done,
    response.output_item.added (function_call), response.function_call_arguments.delta,
    response.function_call_arguments.done, response.output_item.done, ...
    response.completed | response.incomplete (the whole response, usage and cache report)

each with its ``sequence_number``; an engine failure is an ``error`` event then ``response.failed``.

Knows the event shapes; the route (``server/responses.py``) runs the request and stores it.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi.responses import StreamingResponse

from hotprefix.engine.async_engine import RequestStream
from hotprefix.engine.engine import RequestOutput
from hotprefix.server import constraints as C
from hotprefix.server import responses_protocol as R
from hotprefix.server.errors import engine_error


class Answer:
    """One answer's output items, built from its text as it streams (``feed``) or at once."""

    def __init__(self, constraint: C.Constraint):
        self._calls = None
        if constraint.tool_mode != "none" and constraint.functions:
            self._calls = constraint.format.stream(constraint.functions, constraint.parallel)
        self.items: list[dict[str, Any]] = []
        self._text_item: dict[str, Any] | None = None
        self._text = ""

    def feed(self, text: str, last: bool) -> list[tuple[str, dict[str, Any]]]:
        """Events (``(type, fields)``) for new text; ``last``: the answer ends with it."""
        if self._calls is None:
            events = self._text_events(text) if text else []
        else:
            events = []
            for kind, v in self._calls.feed(text) + (self._calls.end() if last else []):
                events += self._text_events(v) if kind == "content" else self._call_events(v)
        if last:
            if not self.items:  # an empty answer is one empty message
                events += self._text_events("")
            events += self._close_text()
        return events

    def _text_events(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        out = []
        if self._text_item is None:
            item = R.message_item("", status="in_progress")
            self._text_item, self._text = item, ""
            idx = len(self.items)
            self.items.append(item)
            out += [("response.output_item.added", {"output_index": idx, "item": dict(item)}),
                    ("response.content_part.added", {"item_id": item["id"], "output_index": idx,
                                                     "content_index": 0, "part": R.output_text("")})]
        if text:
            self._text += text
            out.append(("response.output_text.delta", {
                "item_id": self._text_item["id"], "output_index": self.items.index(self._text_item),
                "content_index": 0, "delta": text, "logprobs": []}))
        return out

    def _close_text(self) -> list[tuple[str, dict[str, Any]]]:
        item = self._text_item
        if item is None:
            return []
        self._text_item = None
        idx = self.items.index(item)
        text = self._text.strip() if self._calls is not None and self._calls.num_calls else self._text
        item.update(status="completed", content=[R.output_text(text)])
        return [("response.output_text.done", {"item_id": item["id"], "output_index": idx,
                                               "content_index": 0, "text": text, "logprobs": []}),
                ("response.content_part.done", {"item_id": item["id"], "output_index": idx,
                                                "content_index": 0, "part": R.output_text(text)}),
                ("response.output_item.done", {"output_index": idx, "item": dict(item)})]

    def _call_events(self, call: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        out = self._close_text()
        item = R.call_item(call)
        idx = len(self.items)
        self.items.append(item)
        args = item["arguments"]
        return out + [
            ("response.output_item.added", {"output_index": idx, "item": {**item, "status": "in_progress",
                                                                          "arguments": ""}}),
            ("response.function_call_arguments.delta", {"item_id": item["id"], "output_index": idx,
                                                        "delta": args}),
            ("response.function_call_arguments.done", {"item_id": item["id"], "output_index": idx,
                                                       "arguments": args}),
            ("response.output_item.done", {"output_index": idx, "item": dict(item)})]


def whole(constraint: C.Constraint, text: str) -> list[dict[str, Any]]:
    """A finished answer's output items."""
    a = Answer(constraint)
    a.feed(text, last=True)
    return a.items


def stream_events(stream: RequestStream, constraint: C.Constraint, started: dict[str, Any],
                  done: Callable[[RequestOutput, list[dict[str, Any]]], Awaitable[dict[str, Any]]]
                  ) -> StreamingResponse:
    """The event stream of one response. ``started``: the response object while it runs;
    ``done(out, items)``: records the finished request and returns the final response object."""
    answer = Answer(constraint)
    seq = {"n": 0}

    def event(kind: str, fields: dict[str, Any]) -> str:
        data = {"type": kind, **fields, "sequence_number": seq["n"]}
        seq["n"] += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"

    async def events() -> AsyncIterator[str]:
        finished = False
        try:
            yield event("response.created", {"response": started})
            yield event("response.in_progress", {"response": started})
            async for out in stream:
                if out.finish_reason == "error":
                    err = engine_error(out)
                    yield event("error", R.error_event(err.message))
                    yield event("response.failed", {"response": {
                        **started, "status": "failed", "error": R.error_object(err.message)}})
                    return
                for kind, fields in answer.feed(out.new_text, out.finished):
                    yield event(kind, fields)
                if out.finished:
                    finished = True
                    final = await done(out, answer.items)
                    kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
                    yield event(kind, {"response": final})
            if not finished:
                yield event("error", R.error_event("the request ended without an answer"))
        finally:
            if not stream.finished:
                stream.abort_nowait()

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
