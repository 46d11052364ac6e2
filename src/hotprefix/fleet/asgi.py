"""Calling an ASGI app in-process, as an HTTP server would: how a replica serves a forwarded request.

The replica runs the single server's app unchanged (``hotprefix.server.app.create_app``); the front
end hands it the request's method, path, query, headers and body, and gets back the response's
start (status, headers) and its body chunks as they are sent, so server-sent events stream through.
Closing the generator early is the client going away: the app sees ``http.disconnect``.

Knows nothing about Ray or the engine. Imports no torch.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable, Sequence

Header = tuple[str, str]


async def call_asgi(app: Callable[..., Any], method: str, path: str, query: str,
                    headers: Sequence[Header], body: bytes,
                    extra_headers: Sequence[Header] = ()) -> AsyncIterator[Any]:
    """Run one HTTP request through ``app``.

    Yields first ``(status, headers)`` (``extra_headers`` appended), then each body chunk (bytes).

    Raises:
        Exception: whatever the app raised before it started the response.
    """
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": method.upper(), "scheme": "http", "path": path,
             "raw_path": path.encode("latin-1"), "query_string": query.encode("latin-1"),
             "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80), "root_path": "", "state": {}}
    body_sent = False
    gone = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await queue.put(message)

    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: queue.put_nowait(None))
    extra = [(k.lower(), v) for k, v in extra_headers]
    try:
        while True:
            msg = await queue.get()
            if msg is None:
                break
            if msg["type"] == "http.response.start":
                hdrs = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in msg.get("headers", [])]
                yield msg["status"], hdrs + extra
            elif msg["type"] == "http.response.body":
                chunk = msg.get("body", b"")
                if chunk:
                    yield chunk
                if not msg.get("more_body", False):
                    break
        if task.done() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
    finally:
        gone.set()
        if not task.done():
            try:
                await asyncio.wait_for(task, timeout=5.0)
            except (asyncio.TimeoutError, Exception):
                task.cancel()
