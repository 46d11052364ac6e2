"""The OpenAI-compatible HTTP server: routes, auth, streaming, errors.

``create_app(engine_config, server_config)`` builds the engine (in its own thread, see
``hotprefix.engine.async_engine``) and a FastAPI app around it; ``serve`` runs that app with uvicorn.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streaming as server-sent
events with ``stream: true``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``,
``GET /v1/cache/stats``, ``POST /v1/cache/warm``, ``POST /v1/cache/reset`` (admin).

Every error is OpenAI-style JSON ``{"error": {message, type, param, code}}``: 400 for bad input,
401/403 for keys, 404 for unknown routes, 503 (with Retry-After) when the waiting queue is full.
Tokenization happens here, off the engine thread; the engine only ever sees token ids.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import threading
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hotprefix.config import ConfigError, EngineConfig, ServerConfig
from hotprefix.engine.async_engine import AsyncEngine, EngineStopped, QueueFull, RequestStream
from hotprefix.engine.engine import LLMEngine, RequestOutput
from hotprefix.engine.request import Request as EngineRequest
from hotprefix.engine.scheduler import RequestRejected
from hotprefix.sampling import SamplingError, SamplingParams
from hotprefix.server import protocol as P
from hotprefix.server.limits import CODE as TOO_LARGE_CODE, BodyLimit
from hotprefix.server.metrics import CONTENT_TYPE, ServerMetrics
from hotprefix.server.tenants import AuthError, Tenant, TenantRegistry, tenant_tag
from hotprefix.server.metrics import fold_operator_reasons
from hotprefix.tokenizer import TokenizerError

log = logging.getLogger(__name__)
request_log = logging.getLogger("hotprefix.requests")

GREEDY_EPS = 1e-5
"""Temperatures below this are treated as greedy (dividing logits by ~0 would overflow)."""
RETRY_AFTER_S = 1
DISCONNECT_POLL_S = 0.5


class ServerState:
    """What the route handlers share: the engine front, tenants, metrics, names."""

    def __init__(self, engine: LLMEngine, server_config: ServerConfig, tenants: TenantRegistry):
        self.engine = engine
        self.config = server_config
        self.tenants = tenants
        self.metrics = ServerMetrics()
        self.block_size = engine.block_size
        self.max_model_len = engine.max_model_len
        base = os.path.basename(engine.model_path or "") or engine.model_name
        for ext in (".gguf", ".safetensors"):
            base = base[:-len(ext)] if base.endswith(ext) else base
        self.served_name = server_config.served_model_name or base
        self.model_names = {self.served_name, engine.model_name, base}
        if engine.model_path:
            self.model_names.add(engine.model_path)
        self.created = int(time.time())
        self.tokenizer = engine.tokenizer
        self._tok_lock = threading.Lock()
        self._log_file = _open_private(server_config.log_requests) if server_config.log_requests else None
        self.log_failures = 0
        self.aengine = AsyncEngine(engine, engine.config.scheduler.max_waiting,
                                   on_finish=self._on_finish if self._log_file else None)

    # -------------------------------------------------------------- tokenizing (off the loop)
    async def encode(self, fn, *args) -> list[int]:
        def run() -> list[int]:
            with self._tok_lock:
                return fn(*args)
        return await asyncio.to_thread(run)

    # -------------------------------------------------------------- --log-requests (engine thread)
    def _on_finish(self, req: EngineRequest, out: RequestOutput | None) -> None:
        tenant = req.user_data if isinstance(req.user_data, str) else "-"
        line = {"timestamp": time.time(), "request_id": req.request_id, "tenant": tenant,
                "num_prompt_tokens": req.num_prompt_tokens,
                "num_output_tokens": req.num_output_tokens, "block_size": self.block_size,
                "block_keys": self.engine.request_block_keys(req),
                "cached_tokens": max(0, req.num_cached_tokens),
                "finish_reason": out.finish_reason if out is not None else "abort"}
        assert self._log_file is not None
        try:  # a full disk must not fail the request: count it, log it once
            self._log_file.write(json.dumps(line) + "\n")
            self._log_file.flush()
        except OSError as e:
            if not self.log_failures:
                log.error("cannot write the request log %s: %s (requests go on)",
                          self.config.log_requests, e)
            self.log_failures += 1

    def close(self) -> None:
        self.aengine.shutdown()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


# ---------------------------------------------------------------------------- helpers
def _open_private(path: str):
    """Open a state/log file for appending, readable by this user only (mode 0600)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.chmod(path, 0o600)
    return os.fdopen(fd, "a")


def _bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization")
    if auth:
        scheme, _, value = auth.partition(" ")
        return value.strip() if scheme.lower() == "bearer" else auth.strip()
    return request.headers.get("x-api-key")


_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|function-.*|json-or-python\[.*\]"
                       r"|nullable\[.*\]|union\[.*\]|literal\[.*\]|tagged-union\[.*\]|[A-Z]\w*)$")


def _param_from_loc(loc: tuple) -> str | None:
    """``("body", "messages", 0, "role")`` -> ``messages[0].role`` (pydantic's union tags dropped)."""
    out = ""
    for i, p in enumerate(loc):
        if i == 0 and p in ("body", "query", "path", "header"):
            continue
        if isinstance(p, int):
            out += f"[{p}]"
        elif not _TYPE_TAG.match(str(p)):
            out += ("." if out else "") + str(p)
    return out or None


def _validation_message(err: dict[str, Any], param: str | None) -> str:
    typ = err.get("type", "")
    if typ == "json_invalid":
        return f"We could not parse the JSON body of your request: {err.get('ctx', {}).get('error', 'invalid JSON')}."
    if typ == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}"
    if typ == "missing":
        return f"Missing required parameter: '{param}'." if param else "The request body is missing."
    msg = err.get("msg", "invalid value")
    return f"Invalid value for '{param}': {msg}." if param else f"Invalid request: {msg}."


def _cache_header(report: dict[str, Any]) -> str:
    return f"{report.get('miss_reason')}; cached={report.get('cached_tokens', 0)}; " \
           f"computed={report.get('computed_tokens', 0)}"


def _report(out: RequestOutput) -> dict[str, Any]:
    if out.cache_report is not None:
        return dict(out.cache_report)
    n = len(out.prompt_token_ids)
    return {"cached_tokens": 0, "computed_tokens": n, "written_blocks": 0,
            "miss_reason": "not_admitted", "miss_position": None, "detail": None}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


# ---------------------------------------------------------------------------- the app
def create_app(engine_config: EngineConfig, server_config: ServerConfig | None = None,
               engine: LLMEngine | None = None) -> FastAPI:
    """Build the engine (unless given) and the FastAPI app; the engine thread starts here.

    Raises:
        ConfigError: the API key file is unreadable or invalid.
    """
    server_config = server_config or ServerConfig()
    if server_config.max_request_bytes < 1024:
        raise ConfigError(f"max_request_bytes must be >= 1024, got {server_config.max_request_bytes}")
    # the key file is checked before the model loads, so a typo fails fast
    tenants = TenantRegistry.from_file(server_config.api_keys, server_config.admin_key,
                                       server_config.shared_prefix_tokens)
    engine = engine or LLMEngine(engine_config)
    state = ServerState(engine, server_config, tenants)
    state.aengine.start()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        state.close()

    app = FastAPI(title="hotprefix", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible LLM server with automatic prefix caching.")
    app.state.hotprefix = state
    app.add_middleware(BodyLimit, max_bytes=server_config.max_request_bytes,
                       on_reject=lambda: state.metrics.rejected.labels("413").inc())

    # ------------------------------------------------------------------ errors
    @app.exception_handler(P.APIError)
    async def _api_error(request: Request, exc: P.APIError):
        state.metrics.rejected.labels(str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        state.metrics.rejected.labels("400").inc()
        errors = exc.errors()
        err = next((e for e in errors if e.get("type") == "value_error"), errors[0] if errors else {})
        param = _param_from_loc(tuple(err.get("loc", ())))
        code = "invalid_json" if err.get("type") == "json_invalid" else None
        if err.get("type") == "json_invalid":
            param = None
        return JSONResponse(P.error_body(_validation_message(err, param), param=param, code=code),
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            msg = f"Unknown route: {request.method} {request.url.path}"
            code = "not_found"
        elif exc.status_code == 405:
            msg = f"Method {request.method} is not allowed on {request.url.path}"
            code = "method_not_allowed"
        elif exc.status_code == 413:
            state.metrics.rejected.labels("413").inc()
            msg, code = str(exc.detail), TOO_LARGE_CODE
        else:
            msg, code = str(exc.detail), None
        return JSONResponse(P.error_body(msg, code=code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(P.error_body("internal server error", type="server_error"), status_code=500)

    # ------------------------------------------------------------------ auth
    def tenant_dep(request: Request) -> Tenant:
        try:
            return state.tenants.authenticate(_bearer(request))
        except AuthError as e:
            raise P.APIError(e.status, str(e), code="invalid_api_key") from None

    def admin_dep(tenant: Tenant = Depends(tenant_dep)) -> Tenant:
        try:
            state.tenants.require_admin(tenant)
        except AuthError as e:
            raise P.APIError(e.status, str(e), type="permission_error", code="permission_denied") from None
        return tenant

    # ------------------------------------------------------------------ request building
    def check_model(model: str | None) -> None:
        if model is not None and model not in state.model_names:
            raise P.APIError(400, f"The model '{model}' does not exist; this server serves "
                                  f"'{state.served_name}'.", param="model", code="model_not_found")

    def engine_options(tenant: Tenant, ctl: P.CacheControl | None) -> dict[str, Any]:
        cache_write = tenant.cache_write and not (ctl is not None and ctl.cache == "none")
        priority = ctl.priority if ctl is not None and ctl.priority is not None else tenant.priority
        ttl = ctl.ttl_s if ctl is not None and ctl.ttl_s is not None else tenant.ttl_s
        return {"cache_salt": tenant.salt,
                "salt_from_block": tenant.shared_prefix_tokens // state.block_size,
                "cache_write": cache_write, "priority": int(priority or 0),
                "pin_ttl_s": min(float(ttl or 0.0), P.MAX_TTL_S)}

    def sampling(body: P._SamplingFields, max_tokens: int | None) -> SamplingParams:
        temperature = 1.0 if body.temperature is None else body.temperature
        if temperature < GREEDY_EPS:
            temperature = 0.0
        try:
            return SamplingParams(
                temperature=temperature, max_tokens=max_tokens if max_tokens is not None else 16,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=-1 if body.top_k is None else body.top_k, seed=body.seed,
                stop=body.stop if body.stop else None, stop_token_ids=body.stop_token_ids,
                ignore_eos=bool(body.ignore_eos))
        except SamplingError as e:
            raise P.APIError(400, str(e), param=e.param) from None

    async def submit(prompt: list[int], params: SamplingParams, rid: str, tenant: Tenant,
                     ctl: P.CacheControl | None, prompt_param: str) -> RequestStream:
        try:
            stream = await state.aengine.add_request(prompt, params, rid, user_data=tenant.tag,
                                                     **engine_options(tenant, ctl))
        except QueueFull as e:
            raise P.APIError(503, f"The server is overloaded: {e}. Retry later.", type="server_error",
                             code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineStopped as e:
            raise P.APIError(503, str(e), type="server_error", code="engine_stopped",
                             headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except RequestRejected as e:
            code = "context_length_exceeded" if "max_model_len" in str(e) or "KV pool" in str(e) else None
            raise P.APIError(400, str(e), param=prompt_param, code=code) from None
        except SamplingError as e:
            raise P.APIError(400, str(e), param=e.param) from None
        except ValueError as e:
            raise P.APIError(400, str(e), param=prompt_param) from None
        return stream

    async def completion_prompt(body: P.CompletionRequest) -> list[int]:
        prompt: Any = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise P.APIError(400, "Only one prompt per request is supported.", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise P.APIError(400, "The prompt is empty.", param="prompt")
            ids = await state.encode(state.tokenizer.encode, prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise P.APIError(400, "The prompt is empty.", param="prompt")
        return ids

    async def chat_prompt(messages: list[P.ChatMessage], param: str = "messages") -> list[int]:
        if not messages:
            raise P.APIError(400, "messages must contain at least one message.", param=param)
        try:
            ids = await state.encode(state.tokenizer.encode_chat, P.message_dicts(messages))
        except TokenizerError as e:
            raise P.APIError(400, str(e), param=param) from None
        if not ids:
            raise P.APIError(400, "The conversation renders to an empty prompt.", param=param)
        return ids

    def check_unsupported(body) -> None:
        bad = P.unsupported(body)
        if bad:
            raise P.APIError(400, bad[1], param=bad[0], code="unsupported_parameter")

    # ------------------------------------------------------------------ finishing
    def finish(out: RequestOutput, route: str, tenant: Tenant) -> dict[str, Any]:
        """Metrics + structured log for a finished request; returns its cache report."""
        rep = _report(out)
        n_prompt, n_out = len(out.prompt_token_ids), len(out.token_ids)
        state.metrics.observe_finished(route, out.finish_reason, n_prompt, out.num_cached_tokens,
                                       n_out, out.ttft_s, out.e2e_s)
        request_log.info(json.dumps({
            "request_id": out.request_id, "route": route, "tenant": tenant.name,
            "prompt_tokens": n_prompt, "completion_tokens": n_out,
            "cached_tokens": out.num_cached_tokens, "miss_reason": rep.get("miss_reason"),
            "finish_reason": out.finish_reason, "ttft_s": out.ttft_s, "e2e_s": out.e2e_s}))
        return rep

    async def collect(stream: RequestStream, request: Request) -> RequestOutput | None:
        """The final output, or None if the client went away (the request is then aborted)."""
        async def last() -> RequestOutput:
            final = None
            async for out in stream:
                final = out
            assert final is not None
            return final

        task = asyncio.ensure_future(last())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    return None
        finally:
            if not task.done():
                task.cancel()
            stream.abort_nowait()

    def engine_error(out: RequestOutput) -> P.APIError:
        return P.APIError(500, f"The engine failed while running this request: {out.error}",
                          type="server_error", code="engine_error")

    def stream_response(stream: RequestStream, route: str, tenant: Tenant, rid: str, created: int,
                        include_usage: bool) -> StreamingResponse:
        chat = route == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta_text: str | None, finish_reason: str | None, **extra: Any) -> dict[str, Any]:
            if chat:
                delta = {} if delta_text is None else {"content": delta_text}
                choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                          "finish_reason": finish_reason}
            else:
                choice = {"index": 0, "text": delta_text or "", "logprobs": None,
                          "finish_reason": finish_reason}
            c = {"id": rid, "object": obj, "created": created, "model": state.served_name,
                 "choices": [choice], **extra}
            if include_usage and "usage" not in c:
                c["usage"] = None
            return c

        async def events() -> AsyncIterator[str]:
            try:
                if chat:
                    first = chunk(None, None)
                    first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                    yield _sse(first)
                async for out in stream:
                    if out.finish_reason == "error":
                        yield _sse(engine_error(out).body())
                        break
                    if not out.finished:
                        if out.new_text:
                            yield _sse(chunk(out.new_text, None))
                        continue
                    if out.new_text:
                        yield _sse(chunk(out.new_text, None))
                    rep = finish(out, route, tenant)
                    hp = {"hotprefix": {"cache": rep}}
                    yield _sse(chunk(None if chat else "", out.finish_reason, **hp))
                    if include_usage:
                        u = P.usage(len(out.prompt_token_ids), len(out.token_ids), out.num_cached_tokens)
                        yield _sse({"id": rid, "object": obj, "created": created,
                                    "model": state.served_name, "choices": [], "usage": u, **hp})
                yield "data: [DONE]\n\n"
            finally:
                if not stream.finished:
                    stream.abort_nowait()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def run(body, request: Request, tenant: Tenant, ids: list[int], params, rid: str,
                  created: int, kind: str, field: str):
        """Submit one request; (streaming or early response, None, None) or (None, output, report)."""
        stream = await submit(ids, params, rid, tenant, body.hotprefix, field)
        if body.stream:
            inc = bool(body.stream_options and body.stream_options.include_usage)
            return stream_response(stream, kind, tenant, rid, created, inc), None, None
        out = await collect(stream, request)
        if out is None:
            return Response(status_code=499), None, None
        if out.finish_reason == "error":
            raise engine_error(out)
        return None, out, finish(out, kind, tenant)

    # ------------------------------------------------------------------ routes
    @app.post("/v1/completions")
    async def completions(body: P.CompletionRequest, request: Request,
                          tenant: Tenant = Depends(tenant_dep)):
        check_model(body.model)
        check_unsupported(body)
        ids = await completion_prompt(body)
        params = sampling(body, body.max_tokens)
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        early, out, rep = await run(body, request, tenant, ids, params, rid, created,
                                    "completions", "prompt")
        if early is not None:
            return early
        return JSONResponse({
            "id": rid, "object": "text_completion", "created": created, "model": state.served_name,
            "choices": [{"index": 0, "text": out.text, "logprobs": None,
                         "finish_reason": out.finish_reason}],
            "usage": P.usage(len(out.prompt_token_ids), len(out.token_ids), out.num_cached_tokens),
            "hotprefix": {"cache": rep}}, headers={"x-hotprefix-cache": _cache_header(rep)})

    @app.post("/v1/chat/completions")
    async def chat_completions(body: P.ChatCompletionRequest, request: Request,
                               tenant: Tenant = Depends(tenant_dep)):
        check_model(body.model)
        check_unsupported(body)
        ids = await chat_prompt(body.messages)
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:
            max_tokens = max(1, state.max_model_len - len(ids))
        params = sampling(body, max_tokens)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        early, out, rep = await run(body, request, tenant, ids, params, rid, created, "chat", "messages")
        if early is not None:
            return early
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": state.served_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                         "logprobs": None, "finish_reason": out.finish_reason}],
            "usage": P.usage(len(out.prompt_token_ids), len(out.token_ids), out.num_cached_tokens),
            "hotprefix": {"cache": rep}}, headers={"x-hotprefix-cache": _cache_header(rep)})

    @app.get("/v1/models")
    async def models(tenant: Tenant = Depends(tenant_dep)):
        return {"object": "list", "data": [{
            "id": state.served_name, "object": "model", "created": state.created,
            "owned_by": "hotprefix", "max_model_len": state.max_model_len}]}

    @app.get("/health")
    async def health():
        if not state.aengine.is_alive:
            raise P.APIError(503, "the engine is not running", type="server_error", code="engine_stopped")
        try:
            await asyncio.wait_for(state.aengine.call(lambda e: None), timeout=30)
        except (asyncio.TimeoutError, EngineStopped):
            raise P.APIError(503, "the engine is not responding", type="server_error",
                             code="engine_unresponsive") from None
        st = await state.aengine.call(lambda e: e.state_health())
        if st["status"] != "ok" or state.log_failures:
            return {"status": "degraded", "state": st, "request_log_write_failures": state.log_failures}
        return {"status": "ok"}

    def metrics_dep(request: Request) -> None:
        if server_config.public_metrics or not state.tenants.enabled and state.tenants.admin_key is None:
            return
        admin_dep(tenant_dep(request))

    @app.get("/metrics", dependencies=[Depends(metrics_dep)])
    async def metrics():
        stats = await state.aengine.call(lambda e: e.cache_stats())
        if server_config.public_metrics:  # readable by tenants: no cross-tenant row to watch
            stats = fold_operator_reasons(stats)
        return Response(state.metrics.render(stats), media_type=CONTENT_TYPE)

    @app.get("/v1/cache/stats")
    async def cache_stats(tenant: Tenant = Depends(tenant_dep)):
        if not tenant.admin:
            return await state.aengine.call(lambda e: e.cache_stats(tenant.salt))

        def read(e: LLMEngine) -> dict[str, Any]:
            s = e.cache_stats()
            s["top_prefixes"] = e.top_prefixes(10)
            s["tenants"] = {state.tenants.name_of(salt): figures
                            for salt, figures in e.tenant_overview().items()}
            return s
        return await state.aengine.call(read)

    @app.post("/v1/cache/reset")
    async def cache_reset(tenant: Tenant = Depends(admin_dep)):
        return await state.aengine.call(lambda e: e.reset_prefix_cache())

    @app.post("/v1/cache/warm")
    async def cache_warm(body: P.WarmRequest, request: Request, tenant: Tenant = Depends(tenant_dep)):
        check_model(body.model)
        if (body.prompts is None) == (body.messages is None):
            raise P.APIError(400, "Send exactly one of 'prompts' or 'messages'.", param="prompts")
        prompts: list[list[int]] = []
        param = "prompts" if body.prompts is not None else "messages"
        for i, p in enumerate(body.prompts if body.prompts is not None else body.messages):  # type: ignore[arg-type]
            if body.prompts is not None:
                if isinstance(p, str):
                    if not p:
                        raise P.APIError(400, f"prompts[{i}] is empty.", param=f"prompts[{i}]")
                    ids = await state.encode(state.tokenizer.encode, p)
                else:
                    ids = list(p)
            else:
                ids = await chat_prompt(p, f"messages[{i}]")
            if not ids:
                raise P.APIError(400, f"{param}[{i}] is empty.", param=f"{param}[{i}]")
            prompts.append(ids)
        if not prompts:
            raise P.APIError(400, f"{param} is empty.", param=param)
        params = SamplingParams(temperature=0.0, max_tokens=1)
        streams: list[RequestStream] = []
        try:
            for i, ids in enumerate(prompts):
                streams.append(await submit(ids, params, f"warm-{uuid.uuid4().hex}", tenant, None,
                                            f"{param}[{i}]"))
            outs = []
            for s in streams:
                out = await collect(s, request)
                if out is None:
                    return Response(status_code=499)
                if out.finish_reason == "error":
                    raise engine_error(out)
                outs.append(out)
        finally:
            for s in streams:
                if not s.finished:
                    s.abort_nowait()
        data = []
        for i, out in enumerate(outs):
            rep = _report(out)
            data.append({"index": i, "prompt_tokens": len(out.prompt_token_ids),
                         "cached_tokens": out.num_cached_tokens,
                         "cached_blocks": out.num_cached_tokens // state.block_size,
                         "written_blocks": rep.get("written_blocks", 0),
                         "miss_reason": rep.get("miss_reason")})
        return {"object": "cache.warm", "data": data,
                "written_blocks": sum(d["written_blocks"] for d in data)}

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


__all__ = ["create_app", "serve", "tenant_tag"]
