"""``POST /v1/messages``: the Anthropic Messages API, as JSON or as its server-sent events.

The request becomes chat template messages (``anthropic_protocol.conversation``) and goes through
the same path as the OpenAI routes (``generate.submit``, ``final_output``, ``finish``), with its
``cache_control`` marks as cache hints: each mark pins the prompt's blocks up to it for its TTL.
Usage is reported Anthropic's way (``input_tokens``, ``cache_read_input_tokens``,
``cache_creation_input_tokens``, ``output_tokens``) and the cache report rides along as
``hotprefix`` and the ``x-hotprefix-cache`` header. Every error on this route, the caller's key and
the body's validation included, is answered in Anthropic's shape
(``{"type": "error", "error": {"type", "message"}}``) by ``AnthropicRoute``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Callable, cast

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from hotprefix.engine.async_engine import RequestStream
from hotprefix.engine.engine import RequestOutput
from hotprefix.request.sampling import SamplingError, SamplingParams
from hotprefix.text.common import common_prefix_len
from hotprefix.server import anthropic_protocol as A
from hotprefix.server import anthropic_tools as AT
from hotprefix.server import constraints as C
from hotprefix.server import tools as T
from hotprefix.server.anthropic_protocol import encode_prompt
from hotprefix.server.deps import get_state, tenant_dep
from hotprefix.server.errors import describe_validation
from hotprefix.server.event_stream import NO_ANSWER, EventAdapter, Pieces, named_event, respond
from hotprefix.server.generate import (CLIENT_CLOSED, CacheHints, cache_header, check_fits,
                                       check_model, final_output, finish, submit)
from hotprefix.server.message_ends import NO_ENDS, message_ends
from hotprefix.server.protocol import APIError
from hotprefix.server.state import ServerState
from hotprefix.server.tenants import Tenant, token_scope
from hotprefix.text.tokenizer import TokenizerError

ROUTE = "messages"
"""The route's label in metrics and request logs."""


class AnthropicRoute(APIRoute):
    """An API route whose errors (API errors, body validation, a body over the limit) are answered
    in Anthropic's error shape instead of OpenAI's."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except APIError as e:
                return _error(request, e.status, e.message, e.headers)
            except RequestValidationError as e:
                message, _param, _code = describe_validation(e)
                return _error(request, 400, message)
            except StarletteHTTPException as e:  # a streamed body over the limit (413)
                return _error(request, e.status_code, str(e.detail), getattr(e, "headers", None))

        return route


def _error(request: Request, status: int, message: str,
           headers: dict[str, str] | None = None) -> Response:
    state: ServerState = request.app.state.hotprefix
    state.metrics.rejected.labels(str(status)).inc()
    return JSONResponse(A.error_body(status, message), status_code=status, headers=headers or None)


router = APIRouter(route_class=AnthropicRoute)


def with_tools(state: ServerState, prompt: A.Prompt, functions: list[T.Function]) -> A.Prompt:
    """The prompt with the tools rendered (the template's way, or the tool block in the system
    turn) and tool calls and results as the chat template takes them (``server/tools.py``)."""
    if not functions and not any(m.get("tool_calls") or m["role"] == "tool" for m in prompt.messages):
        return prompt
    return A.Prompt(T.render_messages(prompt.messages, functions, state.tokenizer.renders_tools),
                    prompt.prefill)


async def prompt_and_hints(state: ServerState, conv: A.Conversation,
                           functions: list[T.Function] = (), scope: str | None = None
                           ) -> tuple[list[int], CacheHints]:
    """The prompt's token ids, its breakpoints as ``(end token, ttl_s)`` pins and, on a hybrid
    pool, where its messages end (``server/message_ends.py``).

    A breakpoint's end is where the prompt cut after the marked block stops agreeing with the whole
    prompt (at most the cut's length): the blocks wholly before it are the marked prefix.
    """
    functions = list(functions)
    tools = [f.raw for f in functions] if functions and state.tokenizer.renders_tools else None
    prompt = with_tools(state, conv.prompt, functions)
    texts = [str(m.get("content") or "") for m in prompt.messages] + [prompt.prefill or ""]
    check_fits(state, texts + [json.dumps(tools or "")], "messages")
    try:
        ids = await state.encode(encode_prompt, state.tokenizer, prompt, tools, scope)
        breakpoints = []
        for cut, ttl in conv.breakpoints:
            cut_ids = await state.encode(encode_prompt, state.tokenizer, with_tools(state, cut, functions),
                                         tools)
            breakpoints.append((common_prefix_len(ids, cut_ids), ttl))
        ends = await message_ends(state, prompt.messages, ids, tools) if ids else NO_ENDS
    except TokenizerError as e:
        raise APIError(400, str(e), param="messages") from None
    if not ids:
        raise APIError(400, "The conversation renders to an empty prompt.", param="messages")
    if conv.whole_prompt_ttl_s is not None:
        breakpoints.append((len(ids), conv.whole_prompt_ttl_s))
    return ids, CacheHints(breakpoints=tuple(breakpoints), message_ends=ends)


def sampling(body: A.MessagesRequest) -> SamplingParams:
    try:
        return SamplingParams(temperature=1.0 if body.temperature is None else body.temperature,
                              top_p=1.0 if body.top_p is None else body.top_p,
                              top_k=-1 if body.top_k is None else body.top_k,
                              max_tokens=body.max_tokens, stop=body.stop_sequences or None)
    except SamplingError as e:
        message = str(e)
        if e.param == "stop":  # the engine's name for what this API calls stop_sequences
            message = "stop_sequences" + message.removeprefix("stop")
        param = {"stop": "stop_sequences"}.get(e.param or "", e.param)
        raise APIError(400, message, param=param) from None


async def matched_stop(state: ServerState, body: A.MessagesRequest, out: RequestOutput) -> str | None:
    """The stop sequence that ended the output, or None (end of turn, length)."""
    stops = [s for s in body.stop_sequences or () if s]
    if out.finish_reason != "stop" or not stops:
        return None
    last = out.token_ids[-1] if out.token_ids else None
    if last is not None and last in state.tokenizer.eos_token_ids:
        return None
    if len(stops) == 1:
        return stops[0]
    # several: the one that starts first in the text past the answer (decoded with the stop string)
    full = cast(str, await state.encode(state.tokenizer.decode, out.token_ids))
    rest = full[len(out.text):]
    return min(stops, key=lambda s: (rest.find(s) if s in rest else len(rest) + 1, -len(s)))


def usage(state: ServerState, out: RequestOutput) -> dict[str, int]:
    written = out.cache_report.written_blocks if out.cache_report is not None else 0
    return A.usage(len(out.prompt_token_ids), len(out.token_ids), out.num_cached_tokens, written,
                   state.block_size)


def message_json(state: ServerState, rid: str, content: list[dict[str, Any]], stop_reason: str | None,
                 stop_sequence: str | None, u: dict[str, int]) -> dict[str, Any]:
    return {"id": rid, "type": "message", "role": "assistant", "model": state.served_name,
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": u}


@router.post(A.MESSAGES_PATH)
async def messages(body: A.MessagesRequest, request: Request,
                   tenant: Tenant = Depends(tenant_dep), state: ServerState = Depends(get_state)):
    check_model(state, body.model)
    bad = A.unsupported(body)
    if bad:
        raise APIError(400, bad[1], param=bad[0], code="unsupported_parameter")
    constraint = AT.constraint(body.tools, body.tool_choice, state.tool_format)
    ids, hints = await prompt_and_hints(state, A.conversation(body), constraint.offered,
                                        token_scope(tenant))
    params = sampling(body)
    if constraint.spec is not None:  # compiled now: a bad schema is this request's 400
        constraint = await C.compile_for(state.engine, constraint, tenant.salt)
        params.structured_outputs = constraint.spec
    rid = f"msg_{uuid.uuid4().hex}"
    stream = await submit(state, ids, params, rid, tenant, None, "messages", hints, request)
    if body.stream:
        resp = stream_messages(state, body, stream, rid, tenant, constraint)
        resp.headers.update(C.unenforced_header(constraint))
        return resp
    out = await final_output(stream, request)
    if out is None:
        return Response(status_code=CLIENT_CLOSED)
    rep = finish(state, out, ROUTE, tenant)
    stop = await matched_stop(state, body, out)
    content = AT.content(constraint, out.text)
    reason = A.stop_reason(out.finish_reason, stop)
    if reason == "end_turn" and any(b["type"] == "tool_use" for b in content):
        reason = "tool_use"
    msg = message_json(state, rid, content, reason, stop, usage(state, out))
    return JSONResponse({**msg, "hotprefix": {"cache": rep}},
                        headers={"x-hotprefix-cache": cache_header(rep), **C.unenforced_header(constraint)})


def event(kind: str, data: dict[str, Any]) -> str:
    return named_event(kind, {"type": kind, **data})


class MessageEvents(EventAdapter):
    """Anthropic's events for one message (``stream_messages``): content blocks numbered in order,
    at most one text block open at a time, each tool call a ``tool_use`` block of its own."""

    def __init__(self, state: ServerState, body: A.MessagesRequest, rid: str, tenant: Tenant,
                 constraint: C.Constraint | None):
        self._state, self._body, self._rid, self._tenant = state, body, rid, tenant
        self._pieces = Pieces(constraint)
        self._next = 0  # the next block's index
        self._text: int | None = None  # the open text block's index
        self._num_tools = 0  # tool_use blocks sent

    def started(self, out: RequestOutput) -> list[str]:
        start = event("message_start", {"message": message_json(
            self._state, self._rid, [], None, None, usage(self._state, out))})
        return [start] + ([] if self._pieces.with_tools else self._text_events(""))

    def step(self, out: RequestOutput) -> list[str]:
        events = []
        for kind, v in self._pieces.feed(out.new_text, out.finished):
            events += self._text_events(v) if kind == "content" else self._call_events(v)
        return events

    async def finish(self, out: RequestOutput) -> list[str]:
        state = self._state
        rep = finish(state, out, ROUTE, self._tenant)
        stop = await matched_stop(state, self._body, out)
        events = self._close_text()
        reason = A.stop_reason(out.finish_reason, stop)
        if reason == "end_turn" and self._num_tools:
            reason = "tool_use"
        delta = {"stop_reason": reason, "stop_sequence": stop}
        return events + [event("message_delta", {"delta": delta, "usage": usage(state, out),
                                                 "hotprefix": {"cache": rep}}),
                         event("message_stop", {})]

    def failed(self, err: APIError) -> list[str]:
        return [event("error", A.error_body(500, err.message))]

    def ended(self, finished: bool) -> list[str]:
        return [] if finished else [event("error", A.error_body(500, NO_ANSWER))]

    def _text_events(self, text: str) -> list[str]:
        out = []
        if self._text is None:
            self._text, self._next = self._next, self._next + 1
            out.append(event("content_block_start", {"index": self._text,
                                                     "content_block": {"type": "text", "text": ""}}))
        if text:
            out.append(event("content_block_delta", {"index": self._text,
                                                     "delta": {"type": "text_delta", "text": text}}))
        return out

    def _close_text(self) -> list[str]:
        if self._text is None:
            return []
        i, self._text = self._text, None
        return [event("content_block_stop", {"index": i})]

    def _call_events(self, call: dict[str, Any]) -> list[str]:
        block = AT.tool_use_block(call)
        i, self._next = self._next, self._next + 1
        self._num_tools += 1
        return self._close_text() + [
            event("content_block_start", {"index": i, "content_block": {**block, "input": {}}}),
            event("content_block_delta", {"index": i, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}}),
            event("content_block_stop", {"index": i})]


def stream_messages(state: ServerState, body: A.MessagesRequest, stream: RequestStream, rid: str,
                    tenant: Tenant, constraint: C.Constraint | None = None) -> StreamingResponse:
    """Anthropic's events: ``message_start`` (with the prompt's usage, once it has run),
    ``content_block_start``, ``content_block_delta``..., ``content_block_stop``, ``message_delta``
    (stop reason, final usage, the cache report), ``message_stop``; ``error`` if the engine fails.
    With tools, text that may open a call is held back until it is known (``tools.CallStream``);
    each call is a ``tool_use`` block with one ``input_json_delta``."""
    return respond(stream, MessageEvents(state, body, rid, tenant, constraint))
