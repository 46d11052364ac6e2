"""Build a KV tier from its URL: the scheme names the backend (``TIER_KINDS``).

Importing this module registers the built-in backends: ``host:SIZE``, ``disk:DIR``,
``redis://HOST:PORT/DB`` and ``rediss://USER:PASSWORD@HOST:PORT/DB``. Imports no torch.
"""

from __future__ import annotations

from hotprefix.cache.tiers import disk, host, redis_tier  # noqa: F401  (they register themselves)
from hotprefix.cache.tiers.base import TIER_KINDS, Tier, TierOptions, redact_url


def make_tier(url: str, options: TierOptions | None = None) -> Tier:
    """The backend for ``url``, built with ``options`` (defaults when None).

    Raises:
        ValueError: an unknown scheme or a malformed URL (the message never holds a password).
    """
    scheme, sep, _ = url.partition(":")
    cls = TIER_KINDS.get(scheme.lower()) if sep else None
    if cls is None:
        raise ValueError(f"unknown KV tier {redact_url(url)!r}; use one of: "
                         "host:SIZE, disk:DIR, redis://HOST:PORT/DB, rediss://USER:PASSWORD@HOST:PORT/DB")
    return cls.from_url(url, options or TierOptions())


__all__ = ["TIER_KINDS", "make_tier"]
