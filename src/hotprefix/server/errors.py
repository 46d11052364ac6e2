"""Every error as OpenAI-style JSON ``{"error": {message, type, param, code}}`` (Anthropic's shape
under ``/v1/messages``: its route answers its own errors, and ``shaped_body`` those raised before it).

``install(app)`` registers the handlers: ``APIError`` as raised, pydantic validation errors as 400s
naming the parameter, 404/405/413 from routing and the body limit, anything else a logged 500.
``rejection(exc, param)`` turns what the engine refuses at submit time into an ``APIError`` by the
exception's type and its own ``code``, never by its message text.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hotprefix.engine.async_engine import EngineStopped, QueueFull
from hotprefix.engine.engine import RequestOutput
from hotprefix.engine.scheduler import RequestRejected
from hotprefix.request.sampling import SamplingError
from hotprefix.server import anthropic_protocol as A
from hotprefix.server.limits import CODE as TOO_LARGE_CODE
from hotprefix.server.protocol import APIError, error_body

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1
"""Seconds a client is asked to wait (``Retry-After``) when the queue is full or the engine stopped."""

_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|function-.*|json-or-python\[.*\]"
                       r"|nullable\[.*\]|union\[.*\]|literal\[.*\]|tagged-union\[.*\]|[A-Z]\w*)$")


def param_from_loc(loc: tuple) -> str | None:
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


def validation_message(err: dict[str, Any], param: str | None) -> str:
    typ = err.get("type", "")
    if typ == "json_invalid":
        return f"We could not parse the JSON body of your request: {err.get('ctx', {}).get('error', 'invalid JSON')}."
    if typ == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}"
    if typ == "missing":
        return f"Missing required parameter: '{param}'." if param else "The request body is missing."
    msg = err.get("msg", "invalid value")
    return f"Invalid value for '{param}': {msg}." if param else f"Invalid request: {msg}."


def describe_validation(exc: RequestValidationError) -> tuple[str, str | None, str | None]:
    """``(message, param, code)`` for a request that failed validation (a route's API shapes it)."""
    errors = exc.errors()
    # a value error (a lone surrogate, say) names its field more precisely than a union's tags;
    # else the error deepest in the body: a list given for ``str | list[...]`` fails both
    # branches, and the list's (``stop[1]``, ``messages[0].content[0].type``) says where
    depth = [len((param_from_loc(tuple(e.get("loc", ()))) or "").replace("[", ".").split("."))
             for e in errors]
    err = next((e for e in errors if e.get("type") == "value_error"),
               errors[depth.index(max(depth))] if errors else {})
    invalid_json = err.get("type") == "json_invalid"
    param = None if invalid_json else param_from_loc(tuple(err.get("loc", ())))
    return validation_message(err, param), param, "invalid_json" if invalid_json else None


def rejection(exc: Exception, param: str) -> APIError:
    """The API error for an exception raised while submitting a request (``param``: the prompt's)."""
    retry = {"Retry-After": str(RETRY_AFTER_S)}
    if isinstance(exc, QueueFull):
        return APIError(503, f"The server is overloaded: {exc}. Retry later.", type="server_error",
                        code="queue_full", headers=retry)
    if isinstance(exc, EngineStopped):
        return APIError(503, str(exc), type="server_error", code="engine_stopped", headers=retry)
    if isinstance(exc, RequestRejected):
        return APIError(400, str(exc), param=param, code=exc.code)
    if isinstance(exc, SamplingError):
        return APIError(400, str(exc), param=exc.param)
    return APIError(400, str(exc), param=param)


SUBMIT_ERRORS = (QueueFull, EngineStopped, RequestRejected, SamplingError, ValueError)
"""What submitting a request may raise; ``rejection`` maps each to its API error."""


def engine_error(out: RequestOutput) -> APIError:
    return APIError(500, f"The engine failed while running this request: {out.error}",
                    type="server_error", code="engine_error")


def shaped_body(path: str, status: int, message: str, code: str | None = None) -> dict[str, Any]:
    """An error raised before a route runs (no such route or method, a body over the limit), or by
    the fleet's front end, in the shape of the API at ``path``: Anthropic's under ``/v1/messages``,
    else OpenAI's (the one builder of each: ``anthropic_protocol.error_body``, ``protocol.error_body``)."""
    if A.is_messages_path(path):
        return A.error_body(status, message)
    return error_body(message, "server_error" if status >= 500 else "invalid_request_error", code=code)


def too_large_body(path: str, message: str) -> dict[str, Any]:
    """The body limit's 413 (``limits.BodyLimit``) in the shape of the API at ``path``."""
    return shaped_body(path, 413, message, TOO_LARGE_CODE)


def install(app: FastAPI, count_rejected) -> None:
    """Register the error handlers; ``count_rejected(status)`` is called for each refused request."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        count_rejected(exc.status)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        count_rejected(400)
        message, param, code = describe_validation(exc)
        return JSONResponse(error_body(message, param=param, code=code), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            msg, code = f"Unknown route: {request.method} {request.url.path}", "not_found"
        elif exc.status_code == 405:
            msg = f"Method {request.method} is not allowed on {request.url.path}"
            code = "method_not_allowed"
        elif exc.status_code == 413:
            count_rejected(413)
            msg, code = str(exc.detail), TOO_LARGE_CODE
        else:
            msg, code = str(exc.detail), None
        return JSONResponse(shaped_body(request.url.path, exc.status_code, msg, code),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body("internal server error", type="server_error"), status_code=500)
