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

Knows the event shapes; the route (``server/responses.py``) runs the request and stores it, and the
shared skeleton (``server/event_stream.py``) runs the stream (``ResponseEvents`` is its adapter).
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from fastapi.responses import StreamingResponse

from hotprefix.engine.async_engine import RequestStream
from hotprefix.engine.engine import RequestOutput
from hotprefix.server import constraints as C
from hotprefix.server import responses_protocol as R
from hotprefix.server.event_stream import NO_ANSWER, EventAdapter, Pieces, named_event, respond
from hotprefix.server.protocol import APIError


class Answer:
    """One answer's output items, built from its text as it streams (``feed``) or at once."""

    def __init__(self, constraint: C.Constraint):
        self._pieces = Pieces(constraint)
        self.items: list[dict[str, Any]] = []
        self._text_item: dict[str, Any] | None = None
        self._text = ""

    def feed(self, text: str, last: bool) -> list[tuple[str, dict[str, Any]]]:
        """Events (``(type, fields)``) for new text; ``last``: the answer ends with it."""
        events = []
        for kind, v in self._pieces.feed(text, last):
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
        text = self._text.strip() if self._pieces.num_calls else self._text
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


class ResponseEvents(EventAdapter):
    """The Responses API's events for one response (``stream_events``), numbered in order."""

    def __init__(self, constraint: C.Constraint, started: dict[str, Any],
                 done: Callable[[RequestOutput, list[dict[str, Any]]], Awaitable[dict[str, Any]]]):
        self._answer = Answer(constraint)
        self._started, self._done = started, done
        self._num_events = 0

    def _event(self, kind: str, fields: dict[str, Any]) -> str:
        data = {"type": kind, **fields, "sequence_number": self._num_events}
        self._num_events += 1
        return named_event(kind, data, ensure_ascii=False)

    def opening(self) -> list[str]:
        return [self._event("response.created", {"response": self._started}),
                self._event("response.in_progress", {"response": self._started})]

    def step(self, out: RequestOutput) -> list[str]:
        return [self._event(kind, fields) for kind, fields in self._answer.feed(out.new_text, out.finished)]

    async def finish(self, out: RequestOutput) -> list[str]:
        final = await self._done(out, self._answer.items)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return [self._event(kind, {"response": final})]

    def failed(self, err: APIError) -> list[str]:
        return [self._event("error", R.error_event(err.message)),
                self._event("response.failed", {"response": {
                    **self._started, "status": "failed", "error": R.error_object(err.message)}})]

    def ended(self, finished: bool) -> list[str]:
        return [] if finished else [self._event("error", R.error_event(NO_ANSWER))]


def stream_events(stream: RequestStream, constraint: C.Constraint, started: dict[str, Any],
                  done: Callable[[RequestOutput, list[dict[str, Any]]], Awaitable[dict[str, Any]]]
                  ) -> StreamingResponse:
    """The event stream of one response. ``started``: the response object while it runs;
    ``done(out, items)``: records the finished request and returns the final response object."""
    return respond(stream, ResponseEvents(constraint, started, done))
