"""The engine in its own thread, with an asyncio front for the server.

``LLMEngine`` is not thread-safe, so one dedicated thread owns it. Everything else talks to that
thread through a command queue (add, abort, stats, reset: any ``fn(engine)``), and gets each
request's outputs on an ``asyncio.Queue`` fed with ``loop.call_soon_threadsafe``. The thread steps
while there is work and sleeps on a ``threading.Event`` when idle, so HTTP handlers never block a
step and a step never waits for a handler.

An exception in ``engine.step`` does not end the thread: the requests in flight are aborted (their
blocks released), their streams get a final output with ``finish_reason="error"``, and the loop goes
on. Knows nothing about HTTP.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from hotprefix.engine.engine import LLMEngine, RequestOutput
from hotprefix.engine.request import Request
from hotprefix.model.fused import release_thread
from hotprefix.request.sampling import SamplingParams

log = logging.getLogger(__name__)

T = TypeVar("T")


class QueueFull(RuntimeError):
    """The waiting queue already holds ``max_waiting`` requests; try again later."""


class EngineStopped(RuntimeError):
    """The engine thread is not running."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    request: Request


class RequestStream:
    """Async iterator over one request's outputs; ends after the finished output."""

    def __init__(self, owner: "AsyncEngine", request_id: str, q: asyncio.Queue, request: Request):
        self.owner = owner
        self.request_id = request_id
        self.request = request
        self._queue = q
        self.finished = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        out: RequestOutput = await self._queue.get()
        if out.finished:
            self.finished = True
        return out

    async def abort(self) -> None:
        """Abort the request (if it is still running) and release its blocks."""
        if not self.finished:
            self.finished = True
            await self.owner.abort(self.request_id)

    def abort_nowait(self) -> None:
        """Abort without awaiting (for finally blocks of cancelled tasks)."""
        if not self.finished:
            self.finished = True
            try:
                self.owner.abort_nowait(self.request_id)
            except EngineStopped:
                pass


class AsyncEngine:
    """Owns an ``LLMEngine`` in a thread; safe to call from any asyncio loop.

    Args:
        engine: the engine; after ``start`` only the engine thread may touch it.
        max_waiting: refuse new requests (``QueueFull``) while this many are waiting; None = no limit.
        on_finish: called in the engine thread as ``on_finish(request, output)`` when a request
            finishes (``output`` is None for an abort); may read ``engine.cache`` safely.
    """

    def __init__(self, engine: LLMEngine, max_waiting: int | None = None,
                 on_finish: Callable[[Request, RequestOutput | None], None] | None = None):
        self.engine = engine
        self.max_waiting = max_waiting
        self.on_finish = on_finish
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stop = False
        self._thread: threading.Thread | None = None
        self.num_step_errors = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "AsyncEngine":
        """Start the engine thread; from here on it alone runs the model, so the calling thread
        (which loaded it) gives up its kernel scratch and idle OpenMP workers
        (``fused.release_thread``: they made the engine thread's workers sleep at every barrier)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hotprefix-engine", daemon=True)
            self._thread.start()
            release_thread()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop

    # ------------------------------------------------------------------ commands
    def submit(self, fn: Callable[[LLMEngine], T]) -> "concurrent.futures.Future[T]":
        """Run ``fn(engine)`` in the engine thread, between steps."""
        if not self.is_alive:
            raise EngineStopped("the engine is not running")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put((fn, fut))
        self._wake.set()
        return fut

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        return await asyncio.wrap_future(self.submit(fn))

    async def add_request(self, prompt: list[int], params: SamplingParams, request_id: str,
                          user_data: Any = None, **options: Any) -> RequestStream:
        """Queue a request; its outputs arrive on the returned stream.

        ``options`` go to ``LLMEngine.add_request`` (cache_salt, salt_from_block, cache_write,
        priority, pin_ttl_s, pin_breakpoints, expect_reuse, hit_point_tokens, turn_end_tokens,
        fleet_seq);
        ``user_data`` is stored on the Request before it can run.
        Raises QueueFull, or what ``add_request`` raises (RequestRejected, SamplingError, ValueError).
        """
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def add(engine: LLMEngine) -> Request:
            if self.max_waiting is not None and engine.num_waiting >= self.max_waiting:
                raise QueueFull(f"{engine.num_waiting} requests are waiting "
                                f"(max_waiting={self.max_waiting})")
            req = engine.add_request(prompt, params, request_id=request_id, **options)
            req.user_data = user_data
            self._streams[req.request_id] = _Stream(loop, q, req)
            return req

        req = await self.call(add)
        return RequestStream(self, req.request_id, q, req)

    async def abort(self, request_id: str) -> bool:
        """Abort a request (blocks released); False if it had already finished."""
        try:
            return await asyncio.wrap_future(self.abort_nowait(request_id))
        except EngineStopped:
            return False

    def abort_nowait(self, request_id: str) -> "concurrent.futures.Future[bool]":
        """Queue an abort without awaiting it (safe in a cancelled task or a finally block)."""
        return self.submit(lambda engine: self._abort_in_thread(request_id))

    def _abort_in_thread(self, request_id: str) -> bool:
        st = self._streams.pop(request_id, None)
        found = self.engine.abort(request_id)
        if found and st is not None:
            self._finished(st.request, None)
        return found

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        engine = self.engine
        while not self._stop:
            self._drain()
            if engine.has_unfinished():
                try:
                    outputs = engine.step()
                except Exception:  # noqa: BLE001 - the thread must outlive any one bad step
                    log.exception("engine step failed; aborting the requests in flight")
                    self.num_step_errors += 1
                    self._fail_all()
                    continue
                for out in outputs:
                    self._deliver(out)
            else:
                self._wake.wait(0.5)
                self._wake.clear()
        self._drain()
        self._fail_all()

    def _drain(self) -> None:
        while True:
            try:
                fn, fut = self._cmds.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(self.engine))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)

    def _deliver(self, out: RequestOutput) -> None:
        st = self._streams.get(out.request_id)
        if st is None:
            return
        if out.finished:
            del self._streams[out.request_id]
            self._finished(st.request, out)
        self._put(st, out)

    def _put(self, st: _Stream, out: RequestOutput) -> None:
        try:
            st.loop.call_soon_threadsafe(st.queue.put_nowait, out)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _finished(self, req: Request, out: RequestOutput | None) -> None:
        if self.on_finish is None:
            return
        try:
            self.on_finish(req, out)
        except Exception:  # noqa: BLE001 - a logging hook must not stop the engine
            log.exception("on_finish hook failed for %s", req.request_id)

    def _fail_all(self) -> None:
        """Abort everything in flight and end each stream with an error output."""
        for rid in list(self.engine.requests):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001
                log.exception("abort of %s failed", rid)
        for rid, st in list(self._streams.items()):
            del self._streams[rid]
            req = st.request
            self._finished(req, None)
            self._put(st, RequestOutput(
                request_id=rid, prompt_token_ids=req.token_ids[:req.num_prompt_tokens],
                token_ids=req.output_token_ids, text="", finished=True, finish_reason="error",
                num_cached_tokens=max(0, req.num_cached_tokens), cache_report=req.cache_report,
                ttft_s=req.ttft_s(), error="internal engine error"))
