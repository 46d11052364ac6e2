"""The OpenAI-compatible HTTP server: the app, its middleware and routers, and ``serve``.

``create_app(engine_config, server_config)`` builds the engine (in its own thread, see
``hotprefix.engine.async_engine``) and a FastAPI app around it; ``serve`` runs that app with uvicorn.

Routes live in their own modules: ``generate`` (``POST /v1/completions``,
``POST /v1/chat/completions``, both streaming as server-sent events with ``stream: true``),
``messages`` (``POST /v1/messages``, Anthropic's Messages API),
``responses`` (``/v1/responses``: OpenAI's Responses API with stored, token-exact conversations),
``token_routes`` (``POST /tokenize``, ``/detokenize``, ``/v1/messages/count_tokens``),
``cache_routes`` (``GET /v1/cache/stats``, ``POST /v1/cache/warm``, ``POST /v1/cache/reset``) and
``ops_routes`` (``GET /v1/models``, ``GET /health``, ``GET /metrics``), besides ``dashboard``
(``GET /dashboard``, the operator's live page). They reach the shared
``ServerState`` and the caller's tenant through ``deps``; errors are answered by ``errors``.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI

from hotprefix.config.sections import ConfigError, EngineConfig, ServerConfig
from hotprefix.engine.engine import LLMEngine
from hotprefix.server import (cache_routes, dashboard, errors, generate, messages, ops_routes, responses,
                              token_routes)
from hotprefix.server.limits import BodyLimit
from hotprefix.server.state import ServerState
from hotprefix.server.tenants import TenantRegistry

log = logging.getLogger(__name__)

MIN_REQUEST_BYTES = 1024


def create_app(engine_config: EngineConfig, server_config: ServerConfig | None = None,
               engine: LLMEngine | None = None, fleet_clock: bool = False) -> FastAPI:
    """Build the engine (unless given) and the FastAPI app; the engine thread starts here.

    ``fleet_clock``: this server is a fleet replica (``hotprefix.fleet.replica``) whose requests
    all come through the fleet's front end: it reads the front end's request number
    (``server/fleet_seq.py``). Never for a standalone server, where a client could send it.

    Raises:
        ConfigError: the API key file is unreadable or invalid, a server limit is out of range,
            or the state directory cannot be used.
    """
    server_config = server_config or ServerConfig()
    if server_config.max_request_bytes < MIN_REQUEST_BYTES:
        raise ConfigError(f"max_request_bytes must be >= {MIN_REQUEST_BYTES}, "
                          f"got {server_config.max_request_bytes}")
    if not server_config.max_cache_ttl_s >= 0:
        raise ConfigError(f"max_cache_ttl_s must be >= 0, got {server_config.max_cache_ttl_s}")
    # the key file is checked before the model loads, so a typo fails fast
    tenants = TenantRegistry.from_file(server_config.api_keys, server_config.admin_key,
                                       server_config.shared_prefix_tokens)
    engine = engine or LLMEngine(engine_config)
    state = ServerState(engine, server_config, tenants)
    state.reads_fleet_seq = fleet_clock
    responses.install(state)
    state.aengine.start()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        state.close()

    app = FastAPI(title="hotprefix", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible LLM server with automatic prefix caching.")
    app.state.hotprefix = state

    def count_rejected(status: int) -> None:
        state.metrics.rejected.labels(str(status)).inc()

    app.add_middleware(BodyLimit, max_bytes=server_config.max_request_bytes,
                       on_reject=lambda: count_rejected(413), shape=errors.too_large_body)
    errors.install(app, count_rejected)
    for module in (generate, messages, responses, token_routes, cache_routes, ops_routes, dashboard):
        app.include_router(module.router)
    app.include_router(token_routes.anthropic_router)
    return app


def serve(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    """Load the model, then serve the app on ``host:port`` until interrupted."""
    import uvicorn

    app = create_app(engine_config, server_config)
    state: ServerState = app.state.hotprefix
    log.info("hotprefix serving model '%s' on http://%s:%d/v1 (%s)", state.served_name,
             server_config.host, server_config.port,
             f"API keys from {server_config.api_keys}" if server_config.api_keys else "single tenant, no auth")
    uvicorn.run(app, host=server_config.host, port=server_config.port, log_level="info",
                timeout_graceful_shutdown=5)


__all__ = ["create_app", "serve"]
