"""The cache's own routes: ``GET /v1/cache/stats`` (a tenant's own view, or the operator's),
``POST /v1/cache/warm`` (compute prompts' blocks ahead of traffic), ``POST /v1/cache/reset`` (admin)."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from hotprefix.engine.async_engine import RequestStream
from hotprefix.engine.engine import LLMEngine
from hotprefix.request.sampling import SamplingParams
from hotprefix.server import protocol as P
from hotprefix.server.deps import admin_dep, get_state, tenant_dep
from hotprefix.server.errors import engine_error
from hotprefix.server.generate import (CLIENT_CLOSED, chat_prompt, check_model, report_json, submit,
                                       text_prompt)
from hotprefix.server.state import ServerState
from hotprefix.server.streaming import collect
from hotprefix.server.tenants import Tenant

router = APIRouter()
TOP_PREFIXES = 10


@router.get("/v1/cache/stats")
async def cache_stats(tenant: Tenant = Depends(tenant_dep), state: ServerState = Depends(get_state)):
    if not tenant.admin:
        return await state.aengine.call(lambda e: e.cache_stats(tenant.salt))

    def read(e: LLMEngine) -> dict[str, Any]:
        s = e.cache_stats()
        s["top_prefixes"] = e.top_prefixes(TOP_PREFIXES)
        s["tenants"] = {state.tenants.name_of(salt): figures
                        for salt, figures in e.tenant_overview().items()}
        return s
    return await state.aengine.call(read)


@router.post("/v1/cache/reset")
async def cache_reset(tenant: Tenant = Depends(admin_dep), state: ServerState = Depends(get_state)):
    return await state.aengine.call(lambda e: e.reset_prefix_cache())


@router.post("/v1/cache/warm")
async def cache_warm(body: P.WarmRequest, request: Request, tenant: Tenant = Depends(tenant_dep),
                     state: ServerState = Depends(get_state)):
    check_model(state, body.model)
    if (body.prompts is None) == (body.messages is None):
        raise P.APIError(400, "Send exactly one of 'prompts' or 'messages'.", param="prompts")
    param = "prompts" if body.prompts is not None else "messages"
    items = body.prompts if body.prompts is not None else body.messages
    if not items:
        raise P.APIError(400, f"{param} is empty.", param=param)
    prompts: list[list[int]] = []
    for i, p in enumerate(items):  # type: ignore[arg-type]
        if body.prompts is not None:
            prompts.append(await text_prompt(state, p, f"prompts[{i}]"))
        else:
            prompts.append(await chat_prompt(state, p, f"messages[{i}]"))
    params = SamplingParams(temperature=0.0, max_tokens=1)
    streams: list[RequestStream] = []
    try:
        for i, ids in enumerate(prompts):
            if await request.is_disconnected():  # each submission waits for an engine step
                return Response(status_code=CLIENT_CLOSED)
            streams.append(await submit(state, ids, params, f"warm-{uuid.uuid4().hex}", tenant, None,
                                        f"{param}[{i}]", request=request))
        outs = []
        for s in streams:
            out = await collect(s, request)
            if out is None:
                return Response(status_code=CLIENT_CLOSED)
            if out.finish_reason == "error":
                raise engine_error(out)
            outs.append(out)
    finally:
        for s in streams:
            if not s.finished:
                s.abort_nowait()
    data = []
    for i, out in enumerate(outs):
        rep = report_json(out)
        data.append({"index": i, "prompt_tokens": len(out.prompt_token_ids),
                     "cached_tokens": out.num_cached_tokens,
                     "cached_blocks": out.num_cached_tokens // state.block_size,
                     "written_blocks": rep.get("written_blocks", 0),
                     "miss_reason": rep.get("miss_reason")})
    return {"object": "cache.warm", "data": data,
            "written_blocks": sum(d["written_blocks"] for d in data)}
