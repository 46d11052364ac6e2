"""What the cache knows about a request: its tokens, its tenant's salt, its cache controls, its
block keys and its report. The engine's ``Request`` extends it. A leaf module; imports no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from hotprefix.cache.hashing import BlockKey
from hotprefix.cache.report import CacheReport, MissReason


@dataclass(eq=False)
class CacheRequest:
    """What the cache needs to know about a request. The engine's Request extends it."""

    request_id: str
    token_ids: list[int]
    """Prompt + output tokens so far (grows during decode)."""
    num_prompt_tokens: int
    salt: str | None = None
    """Tenant salt; enters the key chain at block ``salt_from_block``."""
    salt_from_block: int = 0
    """Blocks before this one are shared across tenants (a common system prompt)."""
    cache_write: bool = True
    """False = read from the cache but add nothing to it (``cache: "none"``)."""
    priority: int = 0
    """Retention priority of the blocks this request writes."""
    pin_ttl_s: float = 0.0
    """Pin the blocks this request writes for this many seconds (0 = no pin)."""
    block_keys: list[BlockKey] = field(default_factory=list)
    """Keys of the full blocks of token_ids, filled lazily (or given by a trace replay)."""
    keys_given: bool = False
    """block_keys come from outside (trace replay): never recompute them from tokens."""
    cache_report: CacheReport | None = None
    """The miss report of this request's first admission."""
    content_keys: list[BlockKey] = field(default_factory=list)
    """Key chain of the tokens alone (no namespace, no salt), filled lazily for diagnosis."""
    operator_reason: MissReason | None = None
    """A miss reason only the operator may see (``salt``); never part of ``cache_report``."""
