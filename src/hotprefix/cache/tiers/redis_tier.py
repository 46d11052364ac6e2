"""``redis://HOST:PORT/DB`` and ``rediss://USER:PASSWORD@HOST:PORT/DB`` — a Redis or Valkey server
shared by any number of replicas (redis-py, with hiredis when installed).

Entries live under ``hotprefix:kv:<storage key>`` and expire after the tier's TTL (a pin may
extend it). A fetch is one ``MGET``; a batch of writes is one pipeline of ``SET ... EX``. Sockets
time out after ``timeout_s`` and redis-py's own retries are off, so a dead or hung server costs
one timeout, after which the stack marks the tier degraded and stops asking until its retry time.
Memory limits and eviction are the server's (``maxmemory``, ``maxmemory-policy allkeys-lru``).

Passwords never leave this module: the tier's ``url`` and every error message are redacted.
Imports no torch.
"""

from __future__ import annotations

import math
from typing import Sequence
from urllib.parse import unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from hotprefix.cache.tiers.base import (PutItem, Tier, TierError, TierOptions, TierTimeout,
                                        register)

KEY_PREFIX = "hotprefix:kv:"
"""Namespace of this project's entries in the server's keyspace."""


@register("redis", "rediss")
class RedisTier(Tier):
    """A Redis/Valkey server. Thread-safe (redis-py's connection pool is)."""

    kind = "redis"

    def __init__(self, url: str, options: TierOptions):
        super().__init__(url)
        parts = urlsplit(url)
        self._secrets = [s for s in {parts.password, unquote(parts.password or "")} if s]
        """The password as written in the URL and percent-decoded: both are redacted."""
        self.ttl_s = options.ttl_s
        try:
            self._client = redis.Redis.from_url(
                url, socket_timeout=options.timeout_s, socket_connect_timeout=options.timeout_s,
                retry=Retry(NoBackoff(), 0), health_check_interval=0, decode_responses=False)
        except ValueError as e:
            raise ValueError(self._redact(f"redis tier {self.url!r}: {e}")) from None

    @classmethod
    def from_url(cls, url: str, options: TierOptions) -> "RedisTier":
        if options.timeout_s <= 0 or options.ttl_s <= 0:
            raise ValueError("redis tier: timeout_s and ttl_s must be positive")
        return cls(url, options)

    def _redact(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _fail(self, e: redis.RedisError) -> TierError:
        msg = self._redact(f"redis tier {self.url}: {e} ({type(e).__name__})")
        return TierTimeout(msg) if isinstance(e, redis.TimeoutError) else TierError(msg)

    def get_many(self, skeys: Sequence[str]) -> list[bytes | None]:
        if not skeys:
            return []
        try:
            return list(self._client.mget([KEY_PREFIX + k for k in skeys]))
        except redis.RedisError as e:
            raise self._fail(e) from None

    def put_many(self, items: Sequence[PutItem]) -> int:
        if not items:
            return 0
        try:
            with self._client.pipeline(transaction=False) as pipe:
                for it in items:
                    pipe.set(KEY_PREFIX + it.skey, it.blob, ex=max(1, math.ceil(max(it.ttl_s, self.ttl_s))))
                pipe.execute()
        except redis.RedisError as e:
            raise self._fail(e) from None
        return sum(len(it.blob) for it in items)

    def delete(self, skey: str) -> None:
        try:
            self._client.delete(KEY_PREFIX + skey)
        except redis.RedisError as e:
            raise self._fail(e) from None

    def close(self) -> None:
        try:
            self._client.close()
        except redis.RedisError:
            pass  # closing a pool whose server is gone; nothing left to release


__all__ = ["KEY_PREFIX", "RedisTier"]
