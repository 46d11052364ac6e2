"""Operational routes: ``GET /v1/models``, ``GET /health`` (ok / degraded / 503), ``GET /metrics``."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from hotprefix.engine.async_engine import EngineStopped
from hotprefix.server import protocol as P
from hotprefix.server.deps import get_state, metrics_dep, tenant_dep
from hotprefix.server.metrics import CONTENT_TYPE, public_reasons
from hotprefix.server.state import ServerState
from hotprefix.server.tenants import Tenant

router = APIRouter()
HEALTH_TIMEOUT_S = 30


@router.get("/v1/models")
async def models(tenant: Tenant = Depends(tenant_dep), state: ServerState = Depends(get_state)):
    return {"object": "list", "data": [{
        "id": state.served_name, "object": "model", "created": state.created,
        "owned_by": "hotprefix", "max_model_len": state.max_model_len}]}


@router.get("/health")
async def health(state: ServerState = Depends(get_state)):
    """200 ``ok``; 200 ``degraded`` while state cannot be persisted (requests still served);
    503 when the engine thread is gone or does not answer."""
    if not state.aengine.is_alive:
        raise P.APIError(503, "the engine is not running", type="server_error", code="engine_stopped")
    try:
        st = await asyncio.wait_for(state.aengine.call(lambda e: e.state_health()),
                                    timeout=HEALTH_TIMEOUT_S)
    except (asyncio.TimeoutError, EngineStopped):
        raise P.APIError(503, "the engine is not responding", type="server_error",
                         code="engine_unresponsive") from None
    if st["status"] != "ok" or state.log_failures:
        return {"status": "degraded", "state": st, "request_log_write_failures": state.log_failures}
    return {"status": "ok"}


@router.get("/metrics", dependencies=[Depends(metrics_dep)])
async def metrics(state: ServerState = Depends(get_state)):
    stats = await state.aengine.call(lambda e: e.cache_stats())
    if state.config.public_metrics:  # readable by tenants: no cross-tenant row to watch
        stats = public_reasons(stats)
    return Response(state.metrics.render(stats), media_type=CONTENT_TYPE)
