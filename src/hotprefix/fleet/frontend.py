"""The fleet's front end: one OpenAI-compatible HTTP API over the engine replicas (a Ray Serve
ingress deployment).

Every request is forwarded, as received, to one replica, which answers it with the single server's
app; the front end adds only what needs the whole fleet:

  * routing: it reads the tenant (API key -> salt) and tokenizes the prompt as the replicas do
    (``hints.PromptKeys``), and hands the block keys to the request router (``request_router``);
  * faults: a request whose replica died before answering is sent again to another replica
    (``max_retries``); a stream already under way cannot be, and ends;
  * the fleet's clock: it numbers the generation requests it routes (``NUMBERED_PATHS``) and sends
    the number in ``x-hotprefix-fleet-seq`` (``hotprefix.server.fleet_seq``), always removing the
    header a client sent under that name, so only the front end moves the replicas' eviction
    clocks. The count is this front end's: with several front-end replicas each would number its
    own requests, and a replica's clock would then jump between unrelated counts (``fleet_app``
    runs one);
  * fleet views: ``/v1/cache/stats`` (a tenant: its own figures summed over the replicas; the
    admin: the fleet's figures, each replica's and the router's), ``/metrics`` (every replica's
    series labelled ``replica``, plus the router's), ``/health`` and ``/v1/cache/reset`` (admin:
    every replica). Each replica enforces the keys itself, as the single server does.

Knows nothing about the engine's internals. Imports no torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from hotprefix.cache.hashing import BlockKey
from hotprefix.fleet.config import FleetConfig
from hotprefix.fleet.hints import PromptKeys, RouteHint
from hotprefix.fleet.merge import merge_metrics, merge_stats
from hotprefix.fleet.replica import REPLICA_HEADER
from hotprefix.fleet.live import routers
from hotprefix.server.errors import shaped_body, too_large_body
from hotprefix.server.fleet_seq import FLEET_SEQ_HEADER
from hotprefix.server.limits import BodyLimit
from hotprefix.server.tenants import TenantRegistry
from hotprefix.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

ENGINE_DEPLOYMENT = "EngineReplica"
FANOUT_TIMEOUT_S = 60.0
"""How long the fan-out (stats, metrics, health, reset) waits for the replicas' answers."""
KEYS_TRIES = 120
"""Tries (a second apart) to get the replicas' tokenizer and namespace at start."""
HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "date", "server"}
RETRYABLE = (RayActorError,)
"""Errors that mean the replica is gone (``ActorDiedError``, ``ActorUnavailableError``)."""
NUMBERED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/cache/warm")
"""POST routes whose requests reach a replica's cache: each gets the fleet's next number."""


def without_fleet_seq(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """``headers`` less every ``x-hotprefix-fleet-seq`` (a client's must never reach a replica)."""
    return [(k, v) for k, v in headers if k.lower() != FLEET_SEQ_HEADER]


def _not_all_ok(replies: dict[str, "Reply"]) -> Response | None:
    """The answer for a fleet route when not every replica answered 200: 503 when none answered,
    else the first replica's own refusal (401, 403...); None when all did."""
    if not replies:
        return _error(503, "no replica answered", code="no_replica")
    bad = next((r for r in replies.values() if r.status != 200), None)
    return None if bad is None else bad.response()


def _error(status: int, message: str, code: str | None = None, path: str = "") -> Response:
    """The fleet's own refusal, in the shape of the API at ``path`` (``errors.shaped_body``:
    Anthropic's under ``/v1/messages``, else OpenAI's)."""
    return JSONResponse(shaped_body(path, status, message, code), status_code=status)


class Reply:
    """One replica's answer, read whole (``body``) or still streaming (``rest``)."""

    def __init__(self, status: int, headers: list[tuple[str, str]], body: bytes = b"",
                 rest: AsyncIterator[bytes] | None = None):
        self.status, self.headers, self.body, self.rest = status, headers, body, rest

    @property
    def replica(self) -> str | None:
        return next((v for k, v in self.headers if k == REPLICA_HEADER), None)

    def response(self) -> Response:
        hdrs = {k: v for k, v in self.headers if k not in HOP_HEADERS}
        if self.rest is not None:
            return StreamingResponse(self.rest, status_code=self.status, headers=hdrs)
        return Response(self.body, status_code=self.status, headers=hdrs)

    def json(self) -> Any:
        return json.loads(self.body)


@serve.ingress()
class Frontend:
    """See the module docstring."""

    def __init__(self, engine: DeploymentHandle, server_config: Any, fleet_config: FleetConfig):
        self.engine = engine
        self.server_config = server_config
        self.fleet = fleet_config
        self.tenants = TenantRegistry.from_file(server_config.api_keys, server_config.admin_key,
                                                server_config.shared_prefix_tokens)
        self.keys: PromptKeys | None = None
        self._keys_lock = asyncio.Lock()
        self._keys_task: asyncio.Task | None = None
        self.num_numbered = 0
        """Generation requests this front end has numbered (the last number sent)."""

    def _number(self, method: str, path: str, headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """The headers to forward: the client's ``x-hotprefix-fleet-seq`` removed and, for a
        generation request with ``fleet_clock``, this front end's next number in its place."""
        headers = without_fleet_seq(headers)
        if self.fleet.fleet_clock and method == "POST" and path in NUMBERED_PATHS:
            self.num_numbered += 1
            headers.append((FLEET_SEQ_HEADER, str(self.num_numbered)))
        return headers

    async def _prompt_keys(self) -> PromptKeys | None:
        """The replicas' tokenizer, namespace and block size (asked of one replica, once)."""
        if self.keys is None and self.fleet.router == "prefix":
            async with self._keys_lock:
                if self.keys is None:
                    info = await self.engine.info.remote()
                    tok = await asyncio.to_thread(Tokenizer.load, info["tokenizer"],
                                                  info.get("chat_template"))
                    self.keys = PromptKeys(tok, BlockKey(bytes.fromhex(info["namespace"])),
                                           info["block_size"], info["hash_algo"], self.tenants,
                                           info["max_model_len"])
        return self.keys

    async def _start_keys(self) -> None:
        """Load the routing keys' tokenizer in the background as the app starts, so that the first
        request does not wait for it (a replica still starting is waited for)."""
        async def load() -> None:
            for _ in range(KEYS_TRIES):
                try:
                    await self._prompt_keys()
                    return
                except Exception as e:
                    log.info("routing keys not ready (%s); retrying", type(e).__name__)
                    await asyncio.sleep(1.0)
        self._keys_task = asyncio.get_running_loop().create_task(load())

    # ------------------------------------------------------------------ forwarding
    async def _send(self, method: str, path: str, query: str,
                    headers: list[tuple[str, str]], body: bytes, hint: RouteHint) -> Reply:
        """One request to one replica, resent while its replica dies before answering.

        Raises:
            RayActorError: every try found its replica gone.
        """
        last: Exception | None = None
        for attempt in range(self.fleet.max_retries + 1):
            gen = self.engine.options(stream=True).forward.remote(method, path, query, headers,
                                                                  body, hotprefix_route=hint)
            try:
                status, hdrs = await gen.__anext__()
                if any(k == "content-type" and v.startswith("text/event-stream") for k, v in hdrs):
                    return Reply(status, hdrs, rest=self._rest(gen))
                return Reply(status, hdrs, b"".join([c async for c in gen]))
            except RETRYABLE as e:
                last = e
                log.warning("replica gone before answering %s %s (try %d): %s", method, path,
                            attempt + 1, type(e).__name__)
        assert last is not None
        raise last

    @staticmethod
    async def _rest(gen: Any) -> AsyncIterator[bytes]:
        try:
            async for chunk in gen:
                yield chunk
        except RETRYABLE as e:  # the replica died mid-stream: the stream ends here
            log.warning("replica gone mid-stream: %s", type(e).__name__)

    async def _each(self, request: Request, method: str, path: str) -> dict[str, Reply]:
        """The same request to every live replica (Ray Serve's broadcast): replica name -> its
        reply; a replica that died meanwhile is left out."""
        headers = without_fleet_seq([(k, v) for k, v in request.headers.items()
                                     if k not in HOP_HEADERS])
        try:  # these routes take no body: none is read or sent to every replica
            response = self.engine.broadcast("call", method, path, request.url.query, headers, b"")
            results = await response.results_async(timeout_s=FANOUT_TIMEOUT_S, return_exceptions=True)
        except Exception as e:  # no replica (yet): the routes answer 503
            log.warning("fan-out of %s %s failed: %s", method, path, type(e).__name__)
            return {}
        replies = [Reply(*r) for r in results if isinstance(r, tuple)]
        return {r.replica: r for r in replies if r.replica is not None}

    def __serve_build_asgi_app__(self) -> FastAPI:
        """The HTTP app (built in the replica: a FastAPI app does not pickle)."""
        @contextlib.asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            await self._start_keys()
            yield

        api = FastAPI(title="hotprefix fleet", version="0.1.0", lifespan=lifespan,
                      description="OpenAI-compatible LLM server: engine replicas behind "
                                  "prefix-aware routing.")
        api.add_api_route("/v1/cache/stats", self.cache_stats, methods=["GET"])
        api.add_api_route("/metrics", self.metrics, methods=["GET"])
        api.add_api_route("/health", self.health, methods=["GET"])
        api.add_api_route("/v1/cache/reset", self.cache_reset, methods=["POST"])
        api.add_api_route("/{path:path}", self.forward,
                          methods=["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
        api.add_middleware(BodyLimit, max_bytes=self.server_config.max_request_bytes,
                           shape=too_large_body)  # before any route reads a body
        return api

    # ------------------------------------------------------------------ fleet routes
    async def cache_stats(self, request: Request) -> Response:
        replies = await self._each(request, "GET", "/v1/cache/stats")
        if (failed := _not_all_ok(replies)) is not None:
            return failed
        views = {n: r.json() for n, r in replies.items()}
        merged = merge_stats(views)
        if any(v.get("view") == "operator" for v in views.values()):
            merged["replicas"] = views
            merged["router"] = self._router_view()
        return JSONResponse(merged)

    def _router_view(self) -> dict[str, Any]:
        router = routers.get(ENGINE_DEPLOYMENT)
        if router is None:
            return {"policy": self.fleet.router}
        core = router.core
        return {"policy": router.policy, "replicas": list(core.replicas), "work": core.view(),
                "indexed_blocks": dict(core.index.num_blocks),
                "decisions_by_reason": dict(router.num_decisions),
                "kv_events": sorted(router._events_at)}

    async def metrics(self, request: Request) -> Response:
        replies = await self._each(request, "GET", "/metrics")
        if (failed := _not_all_ok(replies)) is not None:
            return failed
        try:
            text = merge_metrics({n: r.body.decode() for n, r in replies.items()})
        except ValueError as e:
            return _error(502, f"a replica's metrics did not parse: {e}", code="bad_metrics")
        router = routers.get(ENGINE_DEPLOYMENT)
        lines = ["# HELP hotprefix_fleet_replicas Engine replicas that answered.",
                 "# TYPE hotprefix_fleet_replicas gauge", f"hotprefix_fleet_replicas {len(replies)}",
                 "# HELP hotprefix_router_decisions_total Routing decisions by reason.",
                 "# TYPE hotprefix_router_decisions_total counter"]
        for reason, n in sorted((router.num_decisions if router is not None else {}).items()):
            lines.append(f'hotprefix_router_decisions_total{{reason="{reason}"}} {n}')
        return Response(text + ("\n".join(lines) + "\n").encode(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def health(self, request: Request) -> Response:
        replies = await self._each(request, "GET", "/health")
        ok = [r for r in replies.values() if r.status == 200]
        router = routers.get(ENGINE_DEPLOYMENT)  # a replica that died is not among the replies
        n = max(len(replies), len(router.core.replicas) if router is not None else 0,
                self.fleet.replicas)
        body = {"status": "ok" if ok and len(ok) == n else "degraded" if ok else "unavailable",
                "replicas": n, "replicas_ok": len(ok)}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def cache_reset(self, request: Request) -> Response:
        replies = await self._each(request, "POST", "/v1/cache/reset")
        if (failed := _not_all_ok(replies)) is not None:
            return failed
        return JSONResponse({**merge_stats({n: r.json() for n, r in replies.items()}),
                             "replicas": {n: r.json() for n, r in replies.items()}})

    # ------------------------------------------------------------------ everything else
    async def forward(self, request: Request) -> Response:
        body = b""
        limit = self.server_config.max_request_bytes
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                return JSONResponse(too_large_body(request.url.path, f"The request body is larger "
                                                                     f"than {limit} bytes."), status_code=413)
        headers = list(request.headers.items())
        hint = RouteHint()
        if request.method == "POST":
            try:
                keys = await self._prompt_keys()
            except Exception as e:  # no replica yet, or its tokenizer unreadable here: route by load
                log.warning("no routing keys (%s: %s): requests go by load", type(e).__name__, e)
                keys = None
            if keys is not None:
                hint = await asyncio.to_thread(keys.hint, request.url.path, dict(request.headers), body)
        numbered = self.num_numbered
        headers = self._number(request.method, request.url.path, headers)  # as it is routed
        if self.num_numbered != numbered:
            hint = dataclasses.replace(hint, fleet_seq=self.num_numbered)
        try:
            reply = await self._send(request.method, request.url.path, request.url.query,
                                     headers, body, hint)
        except RETRYABLE:
            return _error(503, "no replica could serve the request (replicas died); try again",
                          "replica_unavailable", request.url.path)
        except BackPressureError:
            return _error(503, "every replica's queue is full; try again", "overloaded", request.url.path)
        except Exception as e:  # a replica failed outside the app's own error handling
            log.exception("forwarding %s %s failed", request.method, request.url.path)
            return _error(502, f"the replica failed: {type(e).__name__}", "replica_error", request.url.path)
        return reply.response()
