"""API keys -> tenants, and each tenant's cache salt.

The key file is a JSON object mapping an API key to a tenant name, or to an object with per-key
settings::

    {"sk-alice": "alice",
     "sk-bob": {"tenant": "bob", "shared_prefix_tokens": 512, "cache": "default",
                "priority": 0, "ttl_s": 0, "admin": false}}

Each entry is validated by ``KeyEntry``, a strict pydantic model (exact JSON types, no unknown settings).

The salt that enters the block hash is derived by the server from the tenant name (never from a
request field), so a client cannot claim another tenant's blocks. Two keys with the same tenant name
share a salt, hence a cache. Without a key file the server is single-tenant: no salt, no auth.
``hotprefix serve --api-key KEY`` (vLLM's flag) is a key file of one key: one tenant, also admin
(``single_key_file``).

Knows nothing about HTTP or the engine.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Mapping

from pydantic import (BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator,
                      model_validator)

from hotprefix.config.sections import ConfigError

ADMIN_TENANT = "__admin__"
"""The tenant name of requests sent with the admin key."""
SINGLE_KEY_TENANT = "default"
"""The tenant of ``--api-key KEY``."""
MAX_SINGLE_KEY = 1024
"""Longest ``--api-key`` (characters)."""


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


def token_scope(tenant: Tenant | None) -> str | None:
    """The tokenizer's prefix-cache scope for a caller (``Tokenizer.encode``): its tenant's salt, so
    one tenant's prompts never make another's tokenization faster; ``""`` on a single-tenant server
    (and for the admin key, a scope of its own); None (no cache) where no caller is known."""
    if tenant is None:
        return None
    return tenant.salt or ""


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


class KeyEntry(BaseModel):
    """One API key's settings in the key file (strict: exact JSON types, no unknown settings)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    tenant: str = Field(min_length=1)
    """Tenant name; keys with the same name share a salt, hence a cache."""
    shared_prefix_tokens: int = Field(0, ge=0)
    """Tokens shared with other tenants; when absent, the server's ``shared_prefix_tokens``."""
    cache: Literal["none", "default"] = "default"
    """``none``: this key's requests never write to the prefix cache."""
    priority: int | None = None
    """Default retention priority of this key's requests."""
    ttl_s: float | None = Field(None, ge=0)
    """Default retention pin (seconds) of this key's requests."""
    admin: bool = False
    """May call admin routes."""

    @model_validator(mode="before")
    @classmethod
    def _name_only(cls, data: Any) -> Any:
        """``"sk-alice": "alice"`` is short for ``{"tenant": "alice"}``."""
        return {"tenant": data} if isinstance(data, str) else data

    @field_validator("tenant")
    @classmethod
    def _not_reserved(cls, name: str) -> str:
        """The admin key's tenant name would share its salt, hence its cached prompts."""
        if name == ADMIN_TENANT:
            raise ValueError(f"{ADMIN_TENANT!r} is reserved for the --admin-key's requests; "
                             "give this key another tenant name (and \"admin\": true to make it an admin)")
        return name

    def to_tenant(self, default_shared: int) -> Tenant:
        given = "shared_prefix_tokens" in self.model_fields_set
        shared = self.shared_prefix_tokens if given else default_shared
        return Tenant(self.tenant, shared, self.cache == "default", self.priority,
                      None if self.ttl_s is None else float(self.ttl_s), self.admin)


_KEY_FILE = TypeAdapter(Annotated[dict[Annotated[str, Field(min_length=1)], KeyEntry], Field(min_length=1)],
                        config=ConfigDict(strict=True))


def parse_keys(raw: Any, default_shared: int = 0, source: str = "the key file") -> dict[str, Tenant]:
    """The tenants of a parsed key file. Raises ConfigError naming the entry and the bad setting.

    Args:
        raw: The JSON object of the key file.
        default_shared: ``shared_prefix_tokens`` of entries that do not set it.
        source: Where ``raw`` came from, for messages.
    """
    try:
        entries = _KEY_FILE.validate_python(raw)
    except ValidationError as e:
        raise ConfigError("; ".join(_describe(err, raw, source) for err in e.errors())) from None
    return {key: entry.to_tenant(default_shared) for key, entry in entries.items()}


def _describe(err: Any, raw: Any, source: str) -> str:
    """One validation error as a message naming the key's entry (its first 4 characters only:
    the key is a secret) and the setting."""
    loc = err["loc"]
    if not loc:
        return f"{source}: expected a non-empty JSON object mapping API key -> tenant"
    if loc[1:2] == ("[key]",):
        return f"{source}: an API key is empty" if loc[0] == "" else f"{source}: an API key must be a string"
    where = f"{source}: key {str(loc[0])[:4]}...:"
    if len(loc) == 1:
        return f"{where} expected a tenant name or an object, got {type(raw[loc[0]]).__name__}"
    setting = str(loc[1])
    if err["type"] == "extra_forbidden":
        return f"{where} unknown setting {setting!r}; known: {sorted(KeyEntry.model_fields)}"
    return f"{where} {setting}: {err['msg']}"


def bearer_key(headers: Mapping[str, str]) -> str | None:
    """The API key of a request's headers (lower-case names): ``Authorization: Bearer KEY`` (or a
    bare value), else ``x-api-key``."""
    auth = headers.get("authorization")
    if auth:
        scheme, _, value = auth.partition(" ")
        return value.strip() if scheme.lower() == "bearer" else auth.strip()
    return headers.get("x-api-key")


def single_key_file(key: str) -> str:
    """The path of a key file holding one key, for ``hotprefix serve --api-key KEY`` (vLLM's flag,
    where one key guards every route): one tenant, ``SINGLE_KEY_TENANT``, whose key is also the admin
    key. The file is never on disk: it is a pipe of this process (``/dev/fd/N``), readable once, by
    ``TenantRegistry.from_file`` when the server starts.

    Raises:
        ConfigError: the key is empty or longer than ``MAX_SINGLE_KEY`` characters, or the system
            has no ``/dev/fd`` (use a key file, ``--api-keys``).
    """
    if not key.strip() or len(key) > MAX_SINGLE_KEY:
        raise ConfigError(f"--api-key must be 1 to {MAX_SINGLE_KEY} characters")
    if not os.path.isdir("/dev/fd"):
        raise ConfigError("--api-key needs /dev/fd on this system; write a key file and pass --api-keys FILE")
    read_fd, write_fd = os.pipe()
    with os.fdopen(write_fd, "w") as f:  # far below the pipe's capacity: never blocks
        json.dump({key: {"tenant": SINGLE_KEY_TENANT, "admin": True}}, f)
    return f"/dev/fd/{read_fd}"
