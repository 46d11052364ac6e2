"""The Responses API: ``POST /v1/responses`` (streamed or not, or in the background),
``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``, ``DELETE /v1/responses/{id}``.

A request's prompt is built one of three ways, said in its ``hotprefix.continuation``:

- ``stored_tokens``: it continues a stored response (``previous_response_id``, or a history the
  client resent that holds that response's output items, unchanged): the prompt is that
  response's token ids (its prompt and the tokens it generated) plus the tokens of what follows
  (``server/continuation.py``). Every earlier token is the same as before, so the earlier turns
  hit the cache whatever the template and tokenizer would make of their text.
- ``re_rendered``: the conversation is rendered again as a chat request would be, because the
  request changed what precedes the history (``instructions_changed``, ``tools_changed``) or the
  template rewrites an earlier answer's text once later turns exist (``template_rewrites_answer``:
  the server's doing, so a miss it causes is reported as the server's, never as a change of the
  client's). A template that only renders earlier turns differently (Mistral's tools before the
  last user turn) keeps the stored tokens (``template_rewrites_history: true`` says so).
- ``new``: no stored response to continue.

Stored responses (``store``, the default) belong to the caller's tenant
(``server/response_store.py``): another tenant's id is answered exactly as an id that never
existed (404), for reading, continuing, cancelling and deleting. ``store: false`` keeps nothing.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from hotprefix.engine.engine import RequestOutput
from hotprefix.request.sampling import SamplingError, SamplingParams
from hotprefix.server import constraints as C
from hotprefix.server import responses_protocol as R
from hotprefix.server import responses_stream as S
from hotprefix.server import tools as T
from hotprefix.server.continuation import continue_ids, template_messages
from hotprefix.server.deps import get_state, tenant_dep
from hotprefix.server.generate import (CLIENT_CLOSED, cache_header, chat_prompt_and_ends, check_model,
                                       final_output, finish, openai_hints, submit)
from hotprefix.server.protocol import APIError
from hotprefix.server.response_store import ResponseStore, StoredResponse
from hotprefix.server.state import ServerState
from hotprefix.server.tenants import Tenant

ROUTE = "responses"
"""The route's label in metrics and request logs."""
router = APIRouter()


def install(state: ServerState) -> None:
    """Open the response store (in the state directory when there is one) and its metrics."""
    state.responses = ResponseStore(state.config.max_stored_responses,
                                    state.config.max_stored_response_bytes,
                                    state.engine.config.cache.state_dir)
    state.metrics.registry.register(state.responses)


def not_found(rid: str) -> APIError:
    """The one answer for an id that does not exist, was deleted or evicted, or is another's."""
    return APIError(404, f"No response found with id '{rid}'.", param="response_id", code="not_found")


class Prompt:
    """A request's prompt and how it was built (``continuation``)."""

    def __init__(self, ids: list[int], conversation: list[dict[str, Any]], how: dict[str, Any]):
        self.ids, self.conversation, self.how = ids, conversation, how


def _resent(store: ResponseStore, owner: str, items: list[dict[str, Any]]) -> tuple[StoredResponse, int] | None:
    """``(stored response, items it covers)`` when the input resends a stored response's history
    and output items, unchanged (the last such item found from the end)."""
    for k in range(len(items) - 1, -1, -1):
        iid = items[k].get("id") if isinstance(items[k], dict) else None
        prev = store.by_item(owner, iid) if isinstance(iid, str) else None
        if prev is None:
            continue
        try:
            if R.input_messages(items[:k + 1]) == prev.conversation:
                return prev, k + 1
        except R.ItemError:
            return None
        return None
    return None


async def build_prompt(state: ServerState, body: R.ResponsesRequest, owner: str,
                       constraint: C.Constraint, tools: list[dict[str, Any]] | None,
                       tenant: Tenant | None = None) -> Prompt:
    store: ResponseStore = state.responses
    native = state.tokenizer.renders_tools
    prev, new_items = None, body.input
    if body.previous_response_id:
        prev = store.get(owner, body.previous_response_id)
        if prev is None:
            raise not_found(body.previous_response_id)
        if prev.response.get("status") in ("queued", "in_progress"):
            raise APIError(400, f"Response '{prev.id}' is still running; continue it once it has "
                                "finished.", param="previous_response_id")
    elif isinstance(body.input, list):
        found = _resent(store, owner, body.input)
        if found is not None:
            prev, new_items = found[0], body.input[found[1]:]
    try:
        new = R.input_messages(new_items)
    except R.ItemError as e:
        raise APIError(400, str(e), param=e.param) from None
    conversation = (prev.conversation if prev is not None else []) + new
    how: dict[str, Any] = {"mode": "new"}
    if prev is not None:
        how = {"mode": "re_rendered", "from": prev.id}
        if prev.instructions != body.instructions:
            how["reason"] = "instructions_changed"
        elif R.canonical_tools(prev.tools) != R.canonical_tools(tools):
            how["reason"] = "tools_changed"
        else:
            head = template_messages(prev.instructions, prev.conversation[:-1], constraint.offered, native)
            tail = T.render_messages(new, [], native) if new else []
            tmpl_tools = [f.raw for f in constraint.offered] if native and constraint.offered else None
            cont = await state.encode(continue_ids, state.tokenizer, head, tmpl_tools, prev.token_ids,
                                      prev.ended_with_eos, tail)
            if cont is not None:
                how = {"mode": "stored_tokens", "from": prev.id, "reused_tokens": len(prev.token_ids)}
                if cont.rewrites_history:
                    how["template_rewrites_history"] = True
                return Prompt(cont.ids, conversation, how)
            how["reason"] = "template_rewrites_answer"
    msgs = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
    if not msgs:
        raise APIError(400, "input must contain at least one item.", param="input")
    ids, _ = await chat_prompt_and_ends(state, msgs, "input", constraint.offered, ends=False,
                                        tenant=tenant)
    return Prompt(ids, conversation, how)


def sampling(body: R.ResponsesRequest, max_tokens: int) -> SamplingParams:
    try:
        return SamplingParams(temperature=1.0 if body.temperature is None else body.temperature,
                              top_p=1.0 if body.top_p is None else body.top_p, max_tokens=max_tokens)
    except SamplingError as e:
        raise APIError(400, str(e), param=e.param) from None


def report(rep: dict[str, Any], how: dict[str, Any]) -> dict[str, Any]:
    """The cache report of a re-rendered continuation names the server as the cause of a miss that
    its re-rendering made (never a change of the client's)."""
    if how.get("reason") == "template_rewrites_answer" and rep.get("miss_reason") == "diverged":
        rep["detail"] = {**(rep.get("detail") or {}), "likely_cause": "server_re_rendered",
                         "hint": "the model's chat template rewrites an earlier answer once later "
                                 "turns exist, so the server rendered the stored conversation "
                                 "again; nothing the client sent changed"}
    return rep


@router.post("/v1/responses")
async def create(body: R.ResponsesRequest, request: Request, tenant: Tenant = Depends(tenant_dep),
                 state: ServerState = Depends(get_state)):
    check_model(state, body.model)
    if body.background and body.store is False:
        raise APIError(400, "background responses must be stored (store: true).", param="background")
    if body.background and body.stream:
        raise APIError(400, "background and stream together are not supported by this server.",
                       param="stream")
    store: ResponseStore = state.responses
    owner = store.owner_key(tenant.name)
    try:
        tools = R.chat_tools(body.tools)
        choice = R.chat_tool_choice(body.tool_choice)
        rf = R.response_format(body.text)
    except R.ItemError as e:
        raise APIError(400, str(e), param=e.param) from None
    constraint = C.from_parts(rf, tools, choice, body.parallel_tool_calls, state.tool_format)
    prompt = await build_prompt(state, body, owner, constraint, tools, tenant)
    params = sampling(body, body.max_output_tokens or max(1, state.max_model_len - len(prompt.ids)))
    if constraint.spec is not None:
        constraint = await C.compile_for(state.engine, constraint, tenant.salt)
        params.structured_outputs = constraint.spec
    rid, created = R.new_id(R.RESPONSE_ID_PREFIX), int(time.time())
    stream = await submit(state, prompt.ids, params, rid, tenant, body.hotprefix, "input",
                          openai_hints(body, len(prompt.ids)), request)  # type: ignore[arg-type]
    extra = {"continuation": prompt.how, **({"warnings": C.unenforced_warning(constraint)}
                                            if constraint.unenforced else {})}
    headers = C.unenforced_header(constraint)
    running = R.response_object(rid, body, state.served_name, "in_progress", [], None, created)

    async def done(out: RequestOutput, items: list[dict[str, Any]]) -> dict[str, Any]:
        rep = report(finish(state, out, ROUTE, tenant), prompt.how)
        status = "incomplete" if out.finish_reason == "length" else "completed"
        obj = R.response_object(rid, body, state.served_name, status, items,
                                R.usage(len(out.prompt_token_ids), len(out.token_ids), out.num_cached_tokens),
                                created, "max_output_tokens" if status == "incomplete" else None)
        obj["hotprefix"] = {"cache": rep, **extra}
        if body.store is not False:
            eos = state.tokenizer.eos_token_ids
            rec = StoredResponse(
                rid, owner, created, obj, body.instructions, tools,
                prompt.conversation + R.items_as_messages(items),
                list(out.prompt_token_ids) + list(out.token_ids),
                out.finish_reason == "stop" and bool(out.token_ids) and out.token_ids[-1] in eos,
                bool(body.background))
            await asyncio.to_thread(store.put, rec)
        return obj

    if body.stream:
        resp = S.stream_events(stream, constraint, running, done)
        resp.headers.update(headers)
        return resp
    if body.background:
        rec = StoredResponse(rid, owner, created, {**running, "status": "queued"}, body.instructions,
                             tools, background=True)
        await asyncio.to_thread(store.put, rec)
        task = asyncio.ensure_future(_background(state, stream, constraint, done, rec))
        state.background_responses[rid] = (task, stream)
        task.add_done_callback(lambda _t: state.background_responses.pop(rid, None))
        return JSONResponse(rec.response, headers=headers)
    out = await final_output(stream, request)
    if out is None:
        return Response(status_code=CLIENT_CLOSED)
    obj = await done(out, S.whole(constraint, out.text))
    return JSONResponse(obj, headers={"x-hotprefix-cache": cache_header(obj["hotprefix"]["cache"]),
                                      **headers})


async def _background(state: ServerState, stream: Any, constraint: C.Constraint, done: Any,
                      rec: StoredResponse) -> None:
    """Run a background response to its end and store the answer (or its failure)."""
    final = None
    async for out in stream:
        final = out
    if final is None or not final.finished:
        return  # cancelled: ``cancel`` stored it
    if final.finish_reason == "abort":
        return
    if final.finish_reason == "error":
        rec.response = {**rec.response, "status": "failed",
                        "error": R.error_object(final.error or "engine error")}
        await asyncio.to_thread(state.responses.put, rec)
        return
    await done(final, S.whole(constraint, final.text))


def _owner(state: ServerState, tenant: Tenant) -> str:
    return state.responses.owner_key(tenant.name)


def _owned(state: ServerState, tenant: Tenant, response_id: str):
    """The tenant's stored response ``response_id``; another tenant's or none: the same 404."""
    rec = state.responses.get(_owner(state, tenant), response_id)
    if rec is None:
        raise not_found(response_id)
    return rec


@router.get("/v1/responses/{response_id}")
async def retrieve(response_id: str, tenant: Tenant = Depends(tenant_dep),
                   state: ServerState = Depends(get_state)):
    return JSONResponse(_owned(state, tenant, response_id).response)


@router.delete("/v1/responses/{response_id}")
async def delete(response_id: str, tenant: Tenant = Depends(tenant_dep),
                 state: ServerState = Depends(get_state)):
    _owned(state, tenant, response_id)
    running = state.background_responses.pop(response_id, None)
    if running is not None:
        running[0].cancel()
        running[1].abort_nowait()
    await asyncio.to_thread(state.responses.delete, _owner(state, tenant), response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


@router.post("/v1/responses/{response_id}/cancel")
async def cancel(response_id: str, tenant: Tenant = Depends(tenant_dep),
                 state: ServerState = Depends(get_state)):
    rec = _owned(state, tenant, response_id)
    if not rec.background:
        raise APIError(400, "Only responses created with background: true can be cancelled.",
                       param="response_id")
    running = state.background_responses.pop(response_id, None)
    if running is not None and rec.response.get("status") in ("queued", "in_progress"):
        running[0].cancel()
        await running[1].abort()
        rec.response = {**rec.response, "status": "cancelled"}
        await asyncio.to_thread(state.responses.put, rec)
    return JSONResponse(rec.response)
