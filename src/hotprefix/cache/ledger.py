"""A bounded ledger of the token content each tenant has cached, per model namespace.

It lets a miss report tell a tenant "you cached these tokens before, under another model or
tokenizer fingerprint" (``namespace``) or "you cached them here before and they are gone"
(``evicted``, also after a restart) instead of ``cold``.

Privacy: an entry is an HMAC, under a server secret, of the *scope* (the requesting tenant's salt,
or none inside the shared window) and the block's *content key* (its tokens and its ancestors'
tokens, hashed with no namespace and no salt). A lookup therefore only ever finds what the same
scope recorded: one tenant can never learn that another tenant holds some content. Without the
secret the file confirms no prompt guess offline. Cross-tenant duplication is counted for the
operator only, from a second in-memory map (content HMAC -> scope tags) that is never persisted
and never reaches a tenant's report.

On disk (``StateDir``): one record a line, ``hp2 <key> <namespace tag> <crc32>``, appended as
whole records through ``O_APPEND``. A torn or garbled record is skipped at start-up with a warning
naming the file and the line, and the file is rewritten without it (temporary file + rename).
A write that fails is logged, counted and retried later; it never fails a request.

Imports no torch.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
import zlib
from collections import OrderedDict

from hotprefix.cache.hashing import BlockKey
from hotprefix.cache.state_dir import StateDir, append_whole, open_regular, read_state_file
from hotprefix.files.atomic import write_atomic

log = logging.getLogger(__name__)

RECORD_TAG = "hp2"
RETRY_INTERVAL_S = 1.0
MAX_BUFFERED = 100_000
"""Records kept for retry while the state directory cannot be written (oldest dropped first)."""


def _crc(body: str) -> str:
    return f"{zlib.crc32(body.encode()):08x}"


def format_record(key: bytes, namespace_tag: str) -> str:
    body = f"{RECORD_TAG} {key.hex()} {namespace_tag}"
    return f"{body} {_crc(body)}\n"


def parse_record(line: str) -> tuple[bytes, str] | None:
    """(key, namespace tag) of one well-formed record line, or None."""
    parts = line.split()
    if len(parts) != 4 or parts[0] != RECORD_TAG:
        return None
    body = " ".join(parts[:3])
    if _crc(body) != parts[3]:
        return None
    try:
        key = bytes.fromhex(parts[1])
    except ValueError:
        return None
    return (key, parts[2]) if len(key) == 16 and parts[2] else None


def _ends_a_line(path: str) -> bool:
    """Whether the file is empty, missing or ends with a newline.

    Raises:
        OSError: it cannot be read, or is not a regular file.
    """
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        return True
    try:
        size = os.fstat(fd).st_size
        return size == 0 or os.pread(fd, 1, size - 1) == b"\n"
    finally:
        os.close(fd)


class ContentLedger:
    """scoped content key -> {namespace tag}; least recently recorded entries drop first."""

    FILE_NAME = "ledger.txt"

    def __init__(self, state: StateDir | None = None, max_entries: int = 200_000,
                 max_depth: int = 512, secret: bytes | None = None):
        self.max_entries = max_entries
        self.max_depth = max_depth
        self.state = state
        self.path = state.file(self.FILE_NAME) if state is not None else None
        self._secret = state.secret if state is not None else (secret or os.urandom(32))
        self._entries: OrderedDict[bytes, set[str]] = OrderedDict()
        self._scopes: OrderedDict[bytes, set[bytes]] = OrderedDict()  # operator-only, in memory
        self._buffer: list[str] = []
        self._tags: dict[str | None, bytes] = {}
        self._next_try = 0.0
        self._maybe_torn = False
        self.write_failures = 0
        """Failed attempts to persist records (a metric; requests never fail because of them)."""
        self.last_error: str | None = None
        """The last persistence error, cleared by the next successful write."""
        self.skipped_records = 0
        if self.path and os.path.lexists(self.path):
            self._load()

    # ------------------------------------------------------------------ keys
    def _scoped(self, content: BlockKey, scope: str | None) -> bytes:
        msg = b"scope\0" + (scope or "").encode("utf-8", "surrogatepass") + b"\0" + content
        return hmac.new(self._secret, msg, hashlib.sha256).digest()[:16]

    def _content_only(self, content: BlockKey) -> bytes:
        return hmac.new(self._secret, b"content\0" + content, hashlib.sha256).digest()[:16]

    def _scope_tag(self, scope: str | None) -> bytes:
        tag = self._tags.get(scope)  # the same for every block of a tenant: computed once
        if tag is None:
            if len(self._tags) >= self.max_entries:
                self._tags.clear()
            tag = self._tags[scope] = hmac.new(
                self._secret, b"tag\0" + (scope or "").encode("utf-8", "surrogatepass"),
                hashlib.sha256).digest()[:8]
        return tag

    # ------------------------------------------------------------------ record / lookup
    @staticmethod
    def _bump(table: OrderedDict, key: bytes, limit: int) -> set:
        owners = table.get(key)
        if owners is None:
            owners = table[key] = set()
            if len(table) > limit:
                table.popitem(last=False)
        else:
            table.move_to_end(key)
        return owners

    def record(self, content: BlockKey, namespace_tag: str, scope: str | None) -> None:
        """``scope`` (a tenant's salt, None for shared blocks) cached ``content`` here."""
        key = self._scoped(content, scope)
        owners = self._bump(self._entries, key, self.max_entries)
        if namespace_tag not in owners:
            owners.add(namespace_tag)
            if self.path:
                self._buffer.append(format_record(key, namespace_tag))
                if len(self._buffer) > MAX_BUFFERED:
                    del self._buffer[:len(self._buffer) - MAX_BUFFERED]
        self._bump(self._scopes, self._content_only(content) + namespace_tag.encode(),
                   self.max_entries).add(self._scope_tag(scope))

    def lookup(self, content: BlockKey, scope: str | None) -> set[str]:
        """Namespace tags under which this same scope cached ``content`` (never another's)."""
        return set(self._entries.get(self._scoped(content, scope), ()))

    def held_by_other_scope(self, content: BlockKey, namespace_tag: str, scope: str | None) -> bool:
        """Whether another scope cached ``content`` in this namespace (operator aggregate only)."""
        tags = self._scopes.get(self._content_only(content) + namespace_tag.encode())
        return bool(tags) and bool(tags - {self._scope_tag(scope)})

    def __len__(self) -> int:
        return len(self._entries)

    # ------------------------------------------------------------------ persistence
    def _load(self) -> None:
        assert self.path is not None
        good: list[str] = []
        bad = 0
        raw = read_state_file(self.path) or b""
        lines = raw.split(b"\n")
        for lineno, chunk in enumerate(lines, 1):
            if not chunk:
                continue  # the end of the file, or a line ended after a failed write
            try:
                line = chunk.decode("ascii")
            except UnicodeDecodeError:
                line = ""
            rec = parse_record(line)
            torn = lineno == len(lines)  # no newline after it: a write cut short
            if rec is None or torn:
                bad += 1
                if bad <= 5:
                    log.warning("%s:%d: skipped a %s ledger record", self.path, lineno,
                                "torn" if torn else "damaged or old-format")
                continue
            key, ns = rec
            self._bump(self._entries, key, self.max_entries).add(ns)
            good.append(format_record(key, ns))
        self.skipped_records = bad
        if bad:
            log.warning("%s: %d record(s) skipped; rewriting the file without them", self.path, bad)
            try:
                write_atomic(self.path, "".join(good).encode())
            except OSError as e:
                self._failed(e)

    def flush(self) -> bool:
        """Append buffered records; on failure keep them for a later retry. True when all written."""
        if not self.path or not self._buffer:
            return True
        now = time.monotonic()
        if now < self._next_try:
            return False
        # after a failed write the file may end inside a record: end that line first, so the torn
        # record stays a line of its own (skipped at the next start) and the next one is whole
        data = "".join(self._buffer)
        try:
            if self._maybe_torn and not _ends_a_line(self.path):
                data = "\n" + data
            append_whole(self.path, data.encode())
        except OSError as e:
            self._maybe_torn = True
            self._failed(e)
            self._next_try = now + RETRY_INTERVAL_S
            return False
        self._buffer.clear()
        self._maybe_torn = False
        if self.last_error is not None:
            log.info("%s: ledger writes work again", self.path)
        self.last_error = None
        return True

    def _failed(self, e: OSError) -> None:
        self.write_failures += 1
        if self.last_error is None:
            log.error("cannot write the ledger %s: %s (requests go on; retrying)", self.path, e)
        self.last_error = f"{self.path}: {e}"

    def clear(self) -> None:
        """Forget every record, in memory and on disk (an admin cache reset)."""
        self._entries.clear()
        self._scopes.clear()
        self._buffer.clear()
        if self.path:
            try:
                write_atomic(self.path, b"")
            except OSError as e:
                self._failed(e)
