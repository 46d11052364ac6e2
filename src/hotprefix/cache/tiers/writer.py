"""A bounded queue drained by one daemon thread, in batches: the tiers' background writer.

``offer`` never blocks: when ``capacity`` jobs are queued or being written it returns False and the
caller counts the drop. The writer knows nothing about tiers or blobs: it hands each batch to the
``handle`` function it was given (which must count its own failures). Imports no torch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, Generic, TypeVar

log = logging.getLogger(__name__)

Job = TypeVar("Job")

MAX_BATCH = 32
"""Most jobs handed to ``handle`` at once (one pipelined round trip for a network tier)."""


class BackgroundWriter(Generic[Job]):
    """One daemon thread that calls ``handle(batch)`` for queued jobs, oldest first."""

    def __init__(self, handle: Callable[[list[Job]], None], capacity: int,
                 name: str = "hotprefix-tier-writer"):
        if capacity < 1:
            raise ValueError(f"writer capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._handle = handle
        self._jobs: deque[Job] = deque()
        self._pending = 0  # queued + being handled
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def offer(self, job: Job) -> bool:
        """Queue a job; False (nothing queued) when the queue is full or the writer is closed."""
        with self._cond:
            if self._stopping or self._pending >= self.capacity:
                return False
            self._jobs.append(job)
            self._pending += 1
            self._cond.notify_all()
        return True

    def pending(self) -> int:
        """Jobs queued or being written."""
        with self._cond:
            return self._pending

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every queued job has been handled; False if ``timeout_s`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0, timeout=max(0.0, timeout_s))

    def close(self, drain_timeout_s: float) -> list[Job]:
        """Let the writer finish for up to ``drain_timeout_s``, then stop it; returns the jobs it
        never handled (the caller counts them as dropped)."""
        deadline = time.monotonic() + max(0.0, drain_timeout_s)
        self.wait_idle(drain_timeout_s)
        with self._cond:
            self._stopping = True
            left = list(self._jobs)
            self._jobs.clear()
            self._pending -= len(left)
            self._cond.notify_all()
        self._thread.join(max(0.1, deadline - time.monotonic()))
        return left

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                batch = [self._jobs.popleft() for _ in range(min(MAX_BATCH, len(self._jobs)))]
            try:
                self._handle(batch)
            except Exception:  # a bug in handle must not end the writer; it is logged, not hidden
                log.exception("KV tier writer: a batch of %d writes failed", len(batch))
            finally:
                with self._cond:
                    self._pending -= len(batch)
                    self._cond.notify_all()


__all__ = ["BackgroundWriter", "MAX_BATCH"]
