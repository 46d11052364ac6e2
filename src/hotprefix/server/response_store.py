"""Stored Responses API answers (``store: true``): what ``GET /v1/responses/{id}`` returns and what
``previous_response_id`` continues from, per tenant, bounded, and kept across restarts.

- **Per tenant.** A record's owner is an HMAC of the tenant's name under a server secret (the
  state directory's ``secret.key``, else a random one for this process); ``get`` answers None for
  an id that does not exist and for another tenant's id alike, through the same path (a dict
  lookup and a constant-time comparison), so a caller cannot tell them apart.
- **Bounded.** At most ``max_count`` records and ``max_bytes`` bytes (their JSON) over every
  tenant; past either, the least recently stored or used go first, each counted (``evicted``,
  the ``hotprefix_responses_evicted_total`` metric). A record larger than ``max_bytes`` alone is
  not kept (and counted).
- **Persisted** (with ``--state-dir``): one file a record in ``responses/`` (mode 0700), each
  written whole through a temporary name and a rename, mode 0600, read back at start (a damaged
  file is skipped and logged); ``delete`` removes the file. Without a state directory the store
  lives in memory. A record holds the conversation's text and token ids (that is what it is for):
  ``store: false`` keeps nothing, and the files are as private as the directory.

Knows nothing about HTTP or the engine. Thread-safe.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from hotprefix.cache.state_dir import StateDir, StateDirError, read_state_file
from hotprefix.files.atomic import write_atomic

log = logging.getLogger(__name__)

SUBDIR = "responses"
_ID_RE = re.compile(r"^resp_[0-9a-f]{32}$")
"""What a stored id looks like (anything else is not looked up, nor a file name)."""


@dataclass
class StoredResponse:
    """One stored answer and what continues it."""

    id: str
    owner: str
    """HMAC of the tenant's name (``ResponseStore.owner_key``)."""
    created_at: int
    response: dict[str, Any]
    """The response object as the API returns it."""
    instructions: str | None = None
    """The request's instructions (its system turn)."""
    tools: list[dict[str, Any]] | None = None
    """The request's tools in chat's shape (rendered into its prompt)."""
    conversation: list[dict[str, Any]] = field(default_factory=list)
    """Every turn so far as chat messages (no instructions): the inputs, then this answer."""
    token_ids: list[int] = field(default_factory=list)
    """The prompt's token ids, then the generated ones: what a continuation starts with."""
    ended_with_eos: bool = False
    """The generated ids end with an end-of-turn token."""
    background: bool = False
    """Created with ``background: true`` (may be cancelled while it runs)."""

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), ensure_ascii=False, separators=(",", ":")).encode("utf-8")


class ResponseStore:
    """The stored responses of every tenant (see the module docstring)."""

    def __init__(self, max_count: int, max_bytes: int, state_dir: str | None = None):
        self.max_count = max(0, int(max_count))
        self.max_bytes = max(0, int(max_bytes))
        self._lock = threading.Lock()
        self._items: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()
        self._bytes = 0
        self._by_item: dict[str, str] = {}
        """Output item id (``msg_...``, ``fc_...``) -> the stored response that produced it: a
        client that resends the history with those items continues from that response's tokens."""
        self.evicted = 0
        """Records dropped to keep within the bounds (not deletions)."""
        self.write_failures = 0
        """Records that could not be written to the state directory (they stay in memory)."""
        self._dir: str | None = None
        if state_dir:
            sd = StateDir(state_dir)
            self._secret = sd.secret
            self._dir = sd.file(SUBDIR)
            try:
                os.makedirs(self._dir, mode=0o700, exist_ok=True)
                os.chmod(self._dir, 0o700)
            except OSError as e:
                raise StateDirError(f"cannot use {self._dir}: {e.strerror or e}") from e
            self._load()
        else:
            self._secret = os.urandom(32)

    def owner_key(self, tenant_name: str | None) -> str:
        """The owner of a tenant's records (the single tenant of a server without keys: ``""``)."""
        return hmac.new(self._secret, (tenant_name or "").encode("utf-8"), hashlib.sha256).hexdigest()

    # ------------------------------------------------------------------ reads
    def get(self, owner: str, rid: str) -> StoredResponse | None:
        """The record ``rid`` of ``owner``; None when there is none, or it is another's."""
        with self._lock:
            hit = self._items.get(rid) if _ID_RE.match(rid) else None
            mine = hit is not None and hmac.compare_digest(hit[0].owner, owner)
            if not mine:
                return None
            self._items.move_to_end(rid)
            return hit[0]  # type: ignore[index]

    def by_item(self, owner: str, item_id: str) -> StoredResponse | None:
        """``owner``'s stored response whose output holds the item ``item_id``, or None."""
        with self._lock:
            rid = self._by_item.get(item_id)
        return self.get(owner, rid) if rid is not None else None

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"stored": len(self._items), "bytes": self._bytes, "evicted": self.evicted,
                    "write_failures": self.write_failures}

    # ------------------------------------------------------------------ writes
    def put(self, rec: StoredResponse) -> bool:
        """Keep ``rec`` (replacing an earlier version of it), evicting the oldest past the bounds;
        False when it was not kept (larger than the byte bound, or a bound of 0). Writes its file
        (call from a worker thread)."""
        data = rec.to_bytes()
        with self._lock:
            old = self._items.pop(rec.id, None)
            if old is not None:
                self._bytes -= old[1]
                self._unindex(old[0])
            if len(data) > self.max_bytes or self.max_count == 0:
                self.evicted += 1
                dropped = [rec.id]
            else:
                self._items[rec.id] = (rec, len(data))
                self._bytes += len(data)
                self._index(rec)
                dropped = self._evict()
        for rid in dropped:
            self._unlink(rid)
        if rec.id in dropped:
            return False
        self._write(rec.id, data)
        return True

    def delete(self, owner: str, rid: str) -> bool:
        """Remove ``owner``'s record ``rid``; False when there is none (or it is another's)."""
        with self._lock:
            hit = self._items.get(rid) if _ID_RE.match(rid) else None
            if hit is None or not hmac.compare_digest(hit[0].owner, owner):
                return False
            del self._items[rid]
            self._bytes -= hit[1]
            self._unindex(hit[0])
        self._unlink(rid)
        return True

    def _index(self, rec: StoredResponse) -> None:
        for item in rec.response.get("output") or []:
            if isinstance(item, dict) and isinstance(item.get("id"), str):
                self._by_item[item["id"]] = rec.id

    def _unindex(self, rec: StoredResponse) -> None:
        for item in rec.response.get("output") or []:
            if isinstance(item, dict) and self._by_item.get(item.get("id")) == rec.id:
                del self._by_item[item["id"]]

    def _evict(self) -> list[str]:
        dropped = []
        while self._items and (len(self._items) > self.max_count or self._bytes > self.max_bytes):
            rid, (rec, n) = self._items.popitem(last=False)
            self._bytes -= n
            self._unindex(rec)
            self.evicted += 1
            dropped.append(rid)
        return dropped

    # ------------------------------------------------------------------ files
    def _path(self, rid: str) -> str | None:
        return os.path.join(self._dir, rid + ".json") if self._dir and _ID_RE.match(rid) else None

    def _write(self, rid: str, data: bytes) -> None:
        path = self._path(rid)
        if path is None:
            return
        try:
            write_atomic(path, data)
        except OSError as e:
            with self._lock:
                self.write_failures += 1
            log.error("cannot store response %s in %s: %s (kept in memory)", rid, self._dir, e)

    def _unlink(self, rid: str) -> None:
        path = self._path(rid)
        if path is None:
            return
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.error("cannot remove %s: %s", path, e)

    def _load(self) -> None:
        assert self._dir is not None
        recs = []
        for name in os.listdir(self._dir):
            rid = name.removesuffix(".json")
            if not name.endswith(".json") or not _ID_RE.match(rid):
                continue
            path = os.path.join(self._dir, name)
            try:
                data = read_state_file(path)
                rec = StoredResponse(**json.loads(data or b""))
                if rec.id != rid:
                    raise ValueError("id does not match the file name")
            except (StateDirError, ValueError, TypeError) as e:
                log.warning("skipping the damaged stored response %s: %s", path, e)
                continue
            recs.append((rec, len(data or b"")))
        for rec, _ in recs:  # a background response the last process did not finish
            if rec.response.get("status") in ("queued", "in_progress"):
                rec.response = {**rec.response, "status": "failed", "error": {
                    "code": "server_error", "message": "the server restarted before it finished"}}
        recs.sort(key=lambda r: r[0].created_at)
        with self._lock:
            for rec, n in recs:
                self._items[rec.id] = (rec, n)
                self._bytes += n
                self._index(rec)
            dropped = self._evict()
        for rid in dropped:
            self._unlink(rid)

    # ------------------------------------------------------------------ metrics
    def collect(self):
        """Prometheus families (registered in the server's registry)."""
        s = self.stats()
        yield GaugeMetricFamily("hotprefix_responses_stored", "Stored Responses API answers.",
                                value=s["stored"])
        yield GaugeMetricFamily("hotprefix_responses_stored_bytes",
                                "Bytes of stored Responses API answers.", value=s["bytes"])
        yield CounterMetricFamily("hotprefix_responses_evicted",
                                  "Stored Responses API answers dropped to keep within the bounds.",
                                  value=s["evicted"])
