"""One tier's counters and health: ok, or degraded until a retry time.

A tier that fails (``TierError``) is degraded: the stack stops using it, for reads and writes, until
``retry_after_s`` have passed; the next call after that is the retry, and its success makes the
tier ok again. The first failure logs a warning, the recovery an info line; every failure is
counted. Thread-safe (the fetch threads and the writer share it). Imports no torch.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass

log = logging.getLogger(__name__)

MAX_ERROR_CHARS = 300
"""Longest error message kept (``last_error``, the log line)."""


@dataclass
class TierCounters:
    """What happened at one tier since the stack started."""

    hit_blocks: int = 0
    """Blocks served from this tier (verified)."""
    misses: int = 0
    """Blocks asked of this tier, up to the end of the run, that it did not have."""
    bytes_read: int = 0
    """Bytes of verified blobs served."""
    bytes_written: int = 0
    """Bytes of blobs written."""
    dropped_writes: int = 0
    """Writes not done: the writer queue was full, or the tier was degraded or failed."""
    corrupt: int = 0
    """Entries that failed verification (checksum, structure, a field): deleted."""
    bad_signature: int = 0
    """Entries whose signature did not verify: deleted."""
    timeouts: int = 0
    """Round trips that timed out, and fetches stopped at their deadline here."""
    errors: int = 0
    """Failures of the medium (connection, I/O, permission, space)."""
    load_seconds: float = 0.0
    """Time spent in this tier's fetch round trips and verifying its blobs."""
    loads: int = 0
    """Fetch round trips made."""


class TierHealth:
    """Counters and ok/degraded state of one tier."""

    def __init__(self, name: str, retry_after_s: float):
        self.name = name
        self.retry_after_s = retry_after_s
        self.counters = TierCounters()
        self.last_error: str | None = None
        """Message of the most recent failure (no password), kept after recovery."""
        self._degraded_until: float | None = None
        self._lock = threading.Lock()

    @property
    def status(self) -> str:
        return "ok" if self._degraded_until is None else "degraded"

    def available(self) -> bool:
        """Whether the tier may be used now: ok, or degraded and its retry time has come."""
        until = self._degraded_until
        return until is None or time.monotonic() >= until

    def count(self, **deltas: int | float) -> None:
        """Add to counters by name."""
        with self._lock:
            c = self.counters
            for k, v in deltas.items():
                setattr(c, k, getattr(c, k) + v)

    def succeeded(self) -> None:
        """A call to the tier worked: it is ok (again)."""
        if self._degraded_until is None:
            return
        with self._lock:
            if self._degraded_until is None:
                return
            self._degraded_until = None
        log.info("KV tier %s recovered", self.name)

    def failed(self, message: str, *, timeout: bool = False) -> None:
        """A call to the tier failed: count it and degrade until the retry time. The message is
        kept printable and short (a server's error may quote the binary entry it refused)."""
        message = "".join(c if c.isprintable() else "?" for c in message[:MAX_ERROR_CHARS])
        with self._lock:
            if timeout:
                self.counters.timeouts += 1
            else:
                self.counters.errors += 1
            self.last_error = message
            first = self._degraded_until is None
            self._degraded_until = time.monotonic() + self.retry_after_s
        if first:
            log.warning("KV tier %s degraded (no requests fail; retrying in %.0f s): %s",
                        self.name, self.retry_after_s, message)

    def snapshot(self) -> dict:
        with self._lock:
            out = asdict(self.counters)
            out["status"] = self.status
            out["last_error"] = self.last_error
        return out


__all__ = ["TierCounters", "TierHealth"]
