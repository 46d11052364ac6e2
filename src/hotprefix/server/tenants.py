"""API keys -> tenants, and each tenant's cache salt.

The key file is a JSON object mapping an API key to a tenant name, or to an object with per-key
settings::

    {"sk-alice": "alice",
     "sk-bob": {"tenant": "bob", "shared_prefix_tokens": 512, "cache": "default",
                "priority": 0, "ttl_s": 0, "admin": false}}

The salt that enters the block hash is derived by the server from the tenant name (never from a
request field), so a client cannot claim another tenant's blocks. Two keys with the same tenant name
share a salt, hence a cache. Without a key file the server is single-tenant: no salt, no auth.

Knows nothing about HTTP or the engine.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from hotprefix.config import ConfigError

ADMIN_TENANT = "__admin__"
"""The tenant name of requests sent with the admin key."""
KEY_FIELDS = {"tenant", "shared_prefix_tokens", "cache", "priority", "ttl_s", "admin"}


class AuthError(Exception):
    """Missing or wrong API key (401), or a valid key without the right (403)."""

    def __init__(self, message: str, status: int = 401):
        super().__init__(message)
        self.status = status


def tenant_salt(name: str) -> str:
    """The salt for a tenant: a hash of its name under a fixed label (stable across restarts)."""
    return "tenant:" + hashlib.sha256(b"hotprefix/tenant-salt/v1\0" + name.encode()).hexdigest()


def tenant_tag(name: str | None) -> str:
    """A short hashed tag for logs (the tenant's name does not appear in them)."""
    return "-" if name is None else hashlib.sha256(b"hotprefix/tenant-tag\0" + name.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Tenant:
    """Who is calling, as decided from the API key."""

    name: str | None
    """None = single-tenant server (no key file)."""
    shared_prefix_tokens: int = 0
    """Blocks fully inside the first N prompt tokens are shared with other tenants."""
    cache_write: bool = True
    """False: this key's requests never write to the prefix cache (a request cannot override)."""
    priority: int | None = None
    """Default retention priority for this key's requests."""
    ttl_s: float | None = None
    """Default retention pin (seconds) for this key's requests."""
    admin: bool = False
    """May call admin routes (cache reset)."""

    @property
    def salt(self) -> str | None:
        return None if self.name is None else tenant_salt(self.name)

    @property
    def tag(self) -> str:
        return tenant_tag(self.name)


class TenantRegistry:
    """Resolves API keys. ``enabled`` is False when there is no key file (single tenant)."""

    def __init__(self, keys: dict[str, Tenant], admin_key: str | None = None,
                 shared_prefix_tokens: int = 0):
        self.keys = keys
        self.admin_key = admin_key
        self.shared_prefix_tokens = shared_prefix_tokens
        self.enabled = bool(keys)

    @classmethod
    def from_file(cls, path: str | None, admin_key: str | None = None,
                  shared_prefix_tokens: int = 0) -> "TenantRegistry":
        """Load the key file (or none). Raises ConfigError on an unreadable or invalid file."""
        if shared_prefix_tokens < 0:
            raise ConfigError(f"shared_prefix_tokens must be >= 0, got {shared_prefix_tokens}")
        if not path:
            return cls({}, admin_key, shared_prefix_tokens)
        try:
            with open(path) as f:
                raw = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read the API key file {path}: {e}") from e
        return cls(parse_keys(raw, shared_prefix_tokens, path), admin_key, shared_prefix_tokens)

    def authenticate(self, key: str | None) -> Tenant:
        """The tenant of this key. Raises AuthError (401) for a missing or unknown key."""
        if not self.enabled:
            return Tenant(None, self.shared_prefix_tokens, admin=self.admin_key is None or key == self.admin_key)
        if key is not None and self.admin_key is not None and key == self.admin_key:
            return Tenant(ADMIN_TENANT, self.shared_prefix_tokens, admin=True)
        if not key:
            raise AuthError("Missing API key: send 'Authorization: Bearer <key>'.")
        tenant = self.keys.get(key)
        if tenant is None:
            raise AuthError("Incorrect API key provided.")
        return tenant

    def name_of(self, salt: str | None) -> str:
        """A tenant's name from its salt, for the operator's view (``-`` = no tenant)."""
        if salt is None:
            return "-"
        for t in self.keys.values():
            if t.salt == salt:
                return t.name or "-"
        if self.admin_key is not None and salt == tenant_salt(ADMIN_TENANT):
            return ADMIN_TENANT
        return tenant_tag(salt)

    def require_admin(self, tenant: Tenant) -> None:
        if not tenant.admin:
            raise AuthError("This route needs an admin key.", status=403)


def parse_keys(raw: Any, default_shared: int = 0, source: str = "the key file") -> dict[str, Tenant]:
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"{source}: expected a non-empty JSON object mapping API key -> tenant")
    out: dict[str, Tenant] = {}
    for key, val in raw.items():
        where = f"{source}: key {key[:4]}...:"
        if not key:
            raise ConfigError(f"{source}: an API key is empty")
        if isinstance(val, str):
            val = {"tenant": val}
        if not isinstance(val, dict):
            raise ConfigError(f"{where} expected a tenant name or an object, got {type(val).__name__}")
        unknown = set(val) - KEY_FIELDS
        if unknown:
            raise ConfigError(f"{where} unknown settings {sorted(unknown)}; known: {sorted(KEY_FIELDS)}")
        name = val.get("tenant")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where} 'tenant' must be a non-empty string")
        shared = val.get("shared_prefix_tokens", default_shared)
        if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
            raise ConfigError(f"{where} shared_prefix_tokens must be an integer >= 0")
        cache = val.get("cache", "default")
        if cache not in ("none", "default"):
            raise ConfigError(f"{where} cache must be 'none' or 'default'")
        prio = val.get("priority")
        if prio is not None and (not isinstance(prio, int) or isinstance(prio, bool)):
            raise ConfigError(f"{where} priority must be an integer")
        ttl = val.get("ttl_s")
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or ttl < 0):
            raise ConfigError(f"{where} ttl_s must be a number >= 0")
        admin = val.get("admin", False)
        if not isinstance(admin, bool):
            raise ConfigError(f"{where} admin must be true or false")
        out[key] = Tenant(name, shared, cache == "default", prio,
                          float(ttl) if ttl is not None else None, admin)
    return out
