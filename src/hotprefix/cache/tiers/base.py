"""What every KV tier backend is: a byte store of blobs under storage keys, and its registry.

A backend only stores and returns bytes under the names ``blob.storage_key`` gives it; it never
decodes or verifies a blob (the ``TierStack`` does), never counts hits and never decides whether it
is healthy. It reports every failure of its medium (server down, timeout, disk full, permission
denied) as ``TierError`` (``TierTimeout`` for timeouts) and nothing else: the stack counts it,
marks the tier degraded and retries later. Backends must be thread-safe: the engine's fetch
threads and the background writer call them at the same time.

Backends register under their URL scheme in ``TIER_KINDS`` (``@register``); ``registry.make_tier``
builds one from a URL. Imports no torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Sequence
from urllib.parse import urlsplit, urlunsplit

TIER_KINDS: dict[str, type["Tier"]] = {}
"""URL scheme (``host``, ``disk``, ``redis``, ``rediss``) -> backend class."""


def register(*schemes: str):
    """Class decorator: make a backend buildable from URLs with these schemes."""
    def deco(cls: type["Tier"]) -> type["Tier"]:
        for scheme in schemes:
            TIER_KINDS[scheme] = cls
        return cls
    return deco


class TierError(Exception):
    """The tier's medium failed (connection, I/O, permission, space). Its message never holds a
    password."""


class TierTimeout(TierError):
    """The tier did not answer within its timeout."""


@dataclass(frozen=True)
class TierOptions:
    """Settings shared by all backends (each uses the ones that apply to it)."""

    max_bytes: int | None = None
    """Byte budget of a disk tier (None = unbounded); the host tier's size comes from its URL."""
    timeout_s: float = 2.0
    """Socket connect and read timeout of a network tier, seconds."""
    ttl_s: float = 86400.0
    """Default expiry of a network tier's entries, seconds (a pin may extend it)."""


@dataclass(frozen=True)
class PutItem:
    """One blob to write."""

    skey: str
    """Storage key (``blob.storage_key``)."""
    blob: bytes
    """The encoded, checksummed (maybe signed) blob."""
    ttl_s: float
    """Expiry for tiers that expire entries, seconds."""
    priority: int = 0
    """Retention priority for tiers that evict (lower goes first)."""


def redact_url(url: str) -> str:
    """The URL with any password replaced by ``***`` (safe for stats, logs and errors)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable url>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:
        port = None
    netloc = f"{user}:***@{host}" + (f":{port}" if port is not None else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


class Tier(ABC):
    """A store of blobs under storage keys. Thread-safe."""

    kind: ClassVar[str]
    """Short kind used to name the tier (``host``, ``disk``, ``redis``)."""

    def __init__(self, url: str):
        self.url = redact_url(url)
        """The tier's URL without its password."""
        self.evictions = 0
        """Entries removed to make room, or refused because they could not fit (budgeted tiers)."""

    @classmethod
    @abstractmethod
    def from_url(cls, url: str, options: TierOptions) -> "Tier":
        """Build from a URL of one of the registered schemes.

        Raises:
            ValueError: the URL is malformed (a configuration error, not a tier failure).
        """

    @abstractmethod
    def get_many(self, skeys: Sequence[str]) -> list[bytes | None]:
        """One round trip: the blob stored under each key, or None.

        Raises:
            TierError: the medium failed (nothing is returned then).
        """

    @abstractmethod
    def put_many(self, items: Sequence[PutItem]) -> int:
        """Store blobs (one round trip where the medium allows); returns bytes written.

        Raises:
            TierError: the medium failed; some items may have been written.
        """

    @abstractmethod
    def delete(self, skey: str) -> None:
        """Remove an entry if present.

        Raises:
            TierError: the medium failed.
        """

    def usage(self) -> tuple[int | None, int | None]:
        """``(entries, bytes)`` held by this tier, or None where it cannot tell cheaply."""
        return None, None

    def close(self) -> None:
        """Release connections and files."""


__all__ = ["PutItem", "TIER_KINDS", "Tier", "TierError", "TierOptions", "TierTimeout", "redact_url",
           "register"]
