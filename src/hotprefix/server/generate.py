"""``POST /v1/completions`` and ``POST /v1/chat/completions``: one path for both.

Each route turns its body into prompt token ids (tokenizing off the event loop), then
``respond`` checks the model and the parameters, submits the request with the tenant's cache
options, and answers as JSON or as a stream, with the cache report in the body (``hotprefix``),
a header (``x-hotprefix-cache``) and a structured log line.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from hotprefix.cache.report import CacheReport
from hotprefix.engine.async_engine import RequestStream
from hotprefix.engine.engine import RequestOutput
from hotprefix.request.sampling import SamplingError, SamplingParams
from hotprefix.server import constraints as C
from hotprefix.server import logprobs as L
from hotprefix.server import protocol as P
from hotprefix.server import tools as T
from hotprefix.server.deps import get_state, tenant_dep
from hotprefix.server.errors import SUBMIT_ERRORS, engine_error, rejection
from hotprefix.server.fleet_seq import fleet_seq
from hotprefix.server.message_ends import NO_ENDS, MessageEnds, message_ends
from hotprefix.server.state import ServerState
from hotprefix.server.streaming import LogprobView, collect, stream_response
from hotprefix.server.tenants import Tenant, token_scope
from hotprefix.text.tokenizer import TokenizerError

request_log = logging.getLogger("hotprefix.requests")
router = APIRouter()

CLIENT_CLOSED = 499
"""Status logged for a request whose client went away before the answer."""


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model not in state.model_names:
        raise P.APIError(400, f"The model '{model}' does not exist; this server serves "
                              f"'{state.served_name}'.", param="model", code="model_not_found")


@dataclass(frozen=True)
class CacheHints:
    """The cache hints a hosted API's client sent (OpenAI's, Anthropic's), before the server's caps."""

    expect_reuse: bool = False
    """The prompt is expected to recur (``prompt_cache_key``): admit its blocks, favour them."""
    breakpoints: tuple[tuple[int, float], ...] = ()
    """``(end token, ttl_s)``: pin the prompt's blocks up to each end token for that long."""
    message_ends: MessageEnds = NO_ENDS
    """Token offsets where the system prompt and earlier turns end (``server/message_ends.py``):
    hit points of a hybrid pool. The server's own, not the client's; none on other pools."""


def openai_hints(body: P.CompletionRequest | P.ChatCompletionRequest, num_prompt_tokens: int,
                 message_ends: MessageEnds = NO_ENDS) -> CacheHints:
    """``prompt_cache_key`` and ``prompt_cache_retention`` as cache hints, with the chat's
    ``message_ends``."""
    keep = body.prompt_cache_retention == "24h"
    return CacheHints(expect_reuse=bool(body.prompt_cache_key),
                      breakpoints=((num_prompt_tokens, P.RETENTION_24H_S),) if keep else (),
                      message_ends=message_ends)


def cache_options(state: ServerState, tenant: Tenant, ctl: P.CacheControl | None,
                  hints: CacheHints | None = None) -> dict[str, Any]:
    """The engine's cache options for a request: the tenant's salt and defaults, the request's
    hints, every pin clamped to the server's ``max_cache_ttl_s`` (the pool caps the pinned share)."""
    cache_write = tenant.cache_write and not (ctl is not None and ctl.cache == "none")
    priority = ctl.priority if ctl is not None and ctl.priority is not None else tenant.priority
    ttl = ctl.ttl_s if ctl is not None and ctl.ttl_s is not None else tenant.ttl_s
    max_ttl = state.config.max_cache_ttl_s
    hints = hints or CacheHints()
    priority = int(priority or 0) + (P.CACHE_KEY_PRIORITY if hints.expect_reuse else 0)
    return {"cache_salt": tenant.salt,
            "salt_from_block": tenant.shared_prefix_tokens // state.block_size,
            "cache_write": cache_write,
            "priority": max(-P.MAX_PRIORITY, min(priority, P.MAX_PRIORITY)),
            "pin_ttl_s": min(float(ttl or 0.0), max_ttl),
            "pin_breakpoints": tuple((end, min(t, max_ttl)) for end, t in hints.breakpoints
                                     if min(t, max_ttl) > 0),
            "expect_reuse": hints.expect_reuse,
            "hit_point_tokens": hints.message_ends.system,
            "turn_end_tokens": hints.message_ends.turns}


def sampling(body: P._SamplingFields, max_tokens: int | None,
             extra: dict[str, Any] | None = None) -> SamplingParams:
    """The request's sampling parameters; ``extra``: more ``SamplingParams`` fields (n, logprobs,
    penalties... from ``server/logprobs.py``)."""
    opts: dict[str, Any] = dict(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=-1 if body.top_k is None else body.top_k, seed=body.seed,
        stop=body.stop if body.stop else None, stop_token_ids=body.stop_token_ids,
        ignore_eos=bool(body.ignore_eos))
    if max_tokens is not None:
        opts["max_tokens"] = max_tokens
    opts.update(extra or {})
    try:
        return SamplingParams(**opts)
    except SamplingError as e:
        raise P.APIError(400, str(e), param=e.param) from None


async def submit(state: ServerState, prompt: list[int], params: SamplingParams, rid: str,
                 tenant: Tenant, ctl: P.CacheControl | None, prompt_param: str,
                 hints: CacheHints | None = None, request: Request | None = None) -> RequestStream:
    """Queue the request with its cache options; ``request``: the HTTP request, whose fleet number
    (``server/fleet_seq.py``) a fleet replica passes on as ``fleet_seq``."""
    seq = None if request is None else fleet_seq(state.reads_fleet_seq, request.headers)
    try:
        return await state.aengine.add_request(prompt, params, rid, user_data=tenant.tag,
                                               fleet_seq=seq,
                                               **cache_options(state, tenant, ctl, hints))
    except SUBMIT_ERRORS as e:
        raise rejection(e, prompt_param) from None


def check_fits(state: ServerState, texts: list[str], param: str) -> None:
    """Refuse, without tokenizing it, text that cannot fit in ``max_model_len`` tokens whatever
    its tokens (more UTF-8 bytes than ``max_model_len`` times the longest token's)."""
    n = sum(len(t.encode("utf-8")) for t in texts)
    if n > state.max_model_len * state.tokenizer.max_token_bytes:
        raise P.APIError(400, f"The {param} has {n} bytes of text, more than {state.max_model_len} "
                              "tokens can hold (max_model_len).", param=param,
                         code="context_length_exceeded")


async def chat_prompt(state: ServerState, messages: list[P.ChatMessage], param: str = "messages",
                      functions: list[T.Function] | None = None) -> list[int]:
    """The conversation's token ids, with ``functions`` (the request's tools) rendered by the
    template when it can, else as the system turn's tool block (``server/tools.py``)."""
    return (await chat_prompt_and_ends(state, messages, param, functions, ends=False))[0]


async def chat_prompt_and_ends(state: ServerState, messages: list[P.ChatMessage] | list[dict[str, Any]],
                               param: str = "messages", functions: list[T.Function] | None = None,
                               ends: bool = True, add_generation_prompt: bool = True,
                               tenant: Tenant | None = None) -> tuple[list[int], MessageEnds]:
    """``chat_prompt``'s token ids and, with ``ends``, where its messages end
    (``message_ends``: empty unless the pool is hybrid). ``messages``: the request's, or chat
    message dicts already (``P.message_dicts``' shape). ``tenant``: tokenize from the prefixes
    this tenant's earlier prompts tokenized (``Tokenizer.encode``'s scope); None: no cache."""
    if not messages:
        raise P.APIError(400, "messages must contain at least one message.", param=param)
    dicts = [dict(m) for m in messages] if isinstance(messages[0], dict) else \
        P.message_dicts(messages)  # type: ignore[arg-type]
    tools = None
    if functions or any(d.get("tool_calls") or d["role"] == "tool" for d in dicts):
        native = state.tokenizer.renders_tools
        dicts = T.render_messages(dicts, functions or [], native)
        tools = [f.raw for f in functions] if native and functions else None
    check_fits(state, [str(m.get("content") or "") for m in dicts] + [json.dumps(tools or "")], param)
    try:
        ids = await state.encode(state.tokenizer.encode_chat, dicts, add_generation_prompt, tools,
                                 token_scope(tenant))
    except TokenizerError as e:
        raise P.APIError(400, str(e), param=param) from None
    if not ids:
        raise P.APIError(400, "The conversation renders to an empty prompt.", param=param)
    return ids, (await message_ends(state, dicts, ids, tools) if ends else NO_ENDS)


async def text_prompt(state: ServerState, prompt: Any, param: str) -> list[int]:
    """A prompt given as text or as token ids; refused when empty."""
    empty = P.APIError(400, f"{'The prompt' if param == 'prompt' else param} is empty.", param=param)
    if isinstance(prompt, str) and not prompt:
        raise empty
    if isinstance(prompt, str):
        check_fits(state, [prompt], param)
    ids = await state.encode(state.tokenizer.encode, prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise empty
    return ids


def report_json(out: RequestOutput) -> dict[str, Any]:
    """The cache report as the API returns it (a request that never ran reports ``not_admitted``)."""
    rep = out.cache_report or CacheReport.not_admitted(len(out.prompt_token_ids))
    return rep.to_json()


def cache_header(report: dict[str, Any]) -> str:
    return f"{report.get('miss_reason')}; cached={report.get('cached_tokens', 0)}; " \
           f"computed={report.get('computed_tokens', 0)}"


def finish(state: ServerState, out: RequestOutput, route: str, tenant: Tenant) -> dict[str, Any]:
    """Metrics + structured log for a finished request; returns its cache report."""
    rep = report_json(out)
    if state.replica is not None:  # one replica of a fleet (hotprefix.fleet) names itself
        rep["replica"] = state.replica
    n_prompt, n_out = len(out.prompt_token_ids), out.num_generated_tokens  # every choice's
    state.metrics.observe_finished(route, out.finish_reason, n_prompt, out.num_cached_tokens,
                                   n_out, out.ttft_s, out.e2e_s)
    request_log.info(json.dumps({
        "request_id": out.request_id, "route": route, "tenant": tenant.name,
        "prompt_tokens": n_prompt, "completion_tokens": n_out,
        "cached_tokens": out.num_cached_tokens, "miss_reason": rep.get("miss_reason"),
        "finish_reason": out.finish_reason, "ttft_s": out.ttft_s, "e2e_s": out.e2e_s}))
    return rep


async def respond(state: ServerState, body: P.CompletionRequest | P.ChatCompletionRequest,
                  request: Request, tenant: Tenant, ids: list[int], max_tokens: int | None,
                  chat: bool, constraint: C.Constraint, ends: MessageEnds = NO_ENDS) -> Response:
    route, field = ("chat", "messages") if chat else ("completions", "prompt")
    params = sampling(body, max_tokens, L.sampling_fields(body))
    if constraint.spec is not None:  # compiled now: a schema error is this request's 400
        constraint = await C.compile_for(state.engine, constraint, tenant.salt)
        params.structured_outputs = constraint.spec
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    stream = await submit(state, ids, params, rid, tenant, body.hotprefix, field,
                          openai_hints(body, len(ids), ends), request)
    view = logprob_view(state, body, ids, params)
    if body.stream:
        inc = bool(body.stream_options and body.stream_options.include_usage)
        resp = stream_response(stream, chat, rid, created, state.served_name, inc,
                               lambda out: finish(state, out, route, tenant), constraint, view)
        resp.headers.update(C.unenforced_header(constraint))
        return resp
    out = await final_output(stream, request)
    if out is None:
        return Response(status_code=CLIENT_CLOSED)
    rep = finish(state, out, route, tenant)
    choices = []
    for comp in out.outputs:
        reason, lp = comp.finish_reason, None
        if chat:
            message, reason = C.answer(constraint, comp.text, reason)
            if view is not None:
                lp = L.chat_logprobs(comp.token_ids, comp.logprobs, view.k, view.text)
            choice: dict[str, Any] = {"message": message}
        else:
            text, ids_shown, positions = comp.text, comp.token_ids, comp.logprobs
            if view is not None and view.echo is not None:
                text = view.echo + text
                ids_shown = out.prompt_token_ids + comp.token_ids
                positions = (out.prompt_logprobs or []) + (comp.logprobs or [])
            if view is not None and view.show:
                lp = L.completion_logprobs(ids_shown, positions, view.k, view.text)
            choice = {"text": text}
        choices.append({"index": comp.index, **choice, "logprobs": lp, "finish_reason": reason})
    return JSONResponse({
        "id": rid, "object": obj_name(chat), "created": created, "model": state.served_name,
        "choices": choices,
        "usage": P.usage(len(out.prompt_token_ids), out.num_generated_tokens, out.num_cached_tokens),
        "hotprefix": {"cache": rep, **warnings(constraint)}},
        headers={"x-hotprefix-cache": cache_header(rep), **C.unenforced_header(constraint)})


def warnings(constraint: C.Constraint) -> dict[str, Any]:
    """``{"warnings": [...]}`` for the body's ``hotprefix`` object when the request's output
    constraint leaves keywords unenforced, else nothing."""
    w = C.unenforced_warning(constraint)
    return {"warnings": w} if w else {}


def obj_name(chat: bool) -> str:
    return "chat.completion" if chat else "text_completion"


def logprob_view(state: ServerState, body: P.CompletionRequest | P.ChatCompletionRequest,
                 ids: list[int], params: SamplingParams) -> LogprobView | None:
    """How the answer shows log probabilities and the echoed prompt; None when it shows neither."""
    echo = None
    if isinstance(body, P.CompletionRequest) and body.echo:
        echo = body.prompt if isinstance(body.prompt, str) else (
            body.prompt[0] if isinstance(body.prompt, list) and body.prompt
            and isinstance(body.prompt[0], str) else state.tokenizer.decode(ids))
    if params.logprobs is None and echo is None:
        return None
    return LogprobView(k=params.logprobs or 0, text=L.TokenText(state.tokenizer), echo=echo,
                       show=params.logprobs is not None)


async def final_output(stream: RequestStream, request: Request) -> RequestOutput | None:
    """The request's last output; None when the client went away; an engine failure raised."""
    out = await collect(stream, request)
    if out is not None and out.finish_reason == "error":
        raise engine_error(out)
    return out


def check_request(state: ServerState, body: P.CompletionRequest | P.ChatCompletionRequest) -> C.Constraint:
    """The model and the parameters checked; the request's output constraint."""
    check_model(state, body.model)
    bad = P.unsupported(body)
    if bad:
        raise P.APIError(400, bad[1], param=bad[0], code="unsupported_parameter")
    return C.from_request(body, state.tool_format)


@router.post("/v1/completions")
async def completions(body: P.CompletionRequest, request: Request,
                      tenant: Tenant = Depends(tenant_dep), state: ServerState = Depends(get_state)):
    constraint = check_request(state, body)
    prompt: Any = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise P.APIError(400, "Only one prompt per request is supported.", param="prompt")
        prompt = prompt[0]
    ids = await text_prompt(state, prompt, "prompt")
    return await respond(state, body, request, tenant, ids, body.max_tokens, chat=False,
                         constraint=constraint)


@router.post("/v1/chat/completions")
async def chat_completions(body: P.ChatCompletionRequest, request: Request,
                           tenant: Tenant = Depends(tenant_dep), state: ServerState = Depends(get_state)):
    constraint = check_request(state, body)
    ids, ends = await chat_prompt_and_ends(state, body.messages, functions=constraint.offered,
                                           tenant=tenant)
    max_tokens = body.max_completion_tokens or body.max_tokens
    if max_tokens is None:  # chat: until the model stops or the context is full
        max_tokens = max(1, state.max_model_len - len(ids))
    return await respond(state, body, request, tenant, ids, max_tokens, chat=True,
                         constraint=constraint, ends=ends)
