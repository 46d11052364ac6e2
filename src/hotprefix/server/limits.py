"""Request body size limit, as a plain ASGI middleware in front of every route.

A body larger than ``max_bytes`` is answered 413 before the route parses it: at once when the
``Content-Length`` header says so, otherwise as soon as the streamed body passes the limit (an
``HTTPException`` raised from ``receive``, which the app's error handler answers). No parsing or
tokenizing happens for it. Knows nothing about the engine.
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from fastapi import HTTPException

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


CODE = "request_too_large"


def _message(max_bytes: int) -> str:
    return (f"The request body is larger than this server accepts ({max_bytes} bytes; "
            "see --max-request-bytes).")


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` when a streamed body passes the limit (the app answers 413)."""

    def __init__(self, max_bytes: int):
        super().__init__(413, _message(max_bytes))


class BodyLimit:
    """ASGI middleware: 413 for bodies over ``max_bytes``; ``on_reject()`` is called for each.
    ``shape(path, message)``: the error's JSON for the route at ``path`` (each API its own shape:
    ``errors.too_large_body``)."""

    def __init__(self, app: Any, max_bytes: int, *, shape: Callable[[str, str], dict[str, Any]],
                 on_reject: Callable[[], None] | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.on_reject = on_reject
        self.shape = shape

    async def _reject(self, scope: Scope, send: Send) -> None:
        if self.on_reject is not None:
            self.on_reject()
        body = json.dumps(self.shape(scope.get("path", ""), _message(self.max_bytes))).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.max_bytes:
                    await self._reject(scope, send)
                    return
        seen = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return msg

        async def tracking_send(msg: Message) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._reject(scope, send)
