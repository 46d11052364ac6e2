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
    """Pin the blocks this request writes or reads from cache for this many seconds (0 = no pin)."""
    pin_breakpoints: tuple[tuple[int, float], ...] = ()
    """Cache breakpoints ``(end token, ttl_s)``: a block that ends at or before a breakpoint's end
    token is pinned for that TTL (the longest breakpoint covering it wins; ``pin_ttl_s`` still
    applies to every block). The hosted APIs' retention hints (``prompt_cache_retention``,
    ``cache_control``) arrive here."""
    expect_reuse: bool = False
    """The client expects this prompt to recur (``prompt_cache_key``): its blocks are written even
    where ``admission_tail_tokens`` would hold the tail of a new long prompt back."""
    read_cache: bool = True
    """False = compute every prompt token, reading nothing from the cache (prompt log
    probabilities need each position's logits); the report's reason is ``read_skipped``. Its
    blocks are still written."""
    hit_point_tokens: tuple[int, ...] = ()
    """Token offsets where later requests are expected to resume (the end of the system prompt:
    other conversations): a hybrid pool keeps the sliding-window layers' K/V before them. With a
    tenant salt, only ends past the blocks that tenants share count (as for ``retains``). The
    server marks them on a hybrid pool (``hotprefix.server.message_ends``)."""
    turn_end_tokens: tuple[int, ...] = ()
    """Token offsets where earlier turns of this conversation end (a regenerated or edited last
    message resumes there): hit points as ``hit_point_tokens`` are, except that a later turn's end
    supersedes them (``cache/window_keep.py``)."""
    fleet_seq: int | None = None
    """In a fleet, the router's count of the requests it had routed when it routed this one
    (every replica's): the eviction policy's clock advances by the fleet's requests since this
    replica's previous one, so a replica ages its blocks as one cache of the fleet would. None
    (one server): one tick per request."""
    full_hit_blocks: int = 0
    """Set by the manager's lookup: the full groups' run of cached blocks, before a hybrid pool
    shortened it to where every window group also has its window."""
    block_keys: list[BlockKey] = field(default_factory=list)
    """Keys of the full blocks of token_ids, filled lazily by the manager. A caller may give some
    up front (a trace replay that hashed the trace once): they must be the manager's hasher's keys
    of these same tokens, since only the missing ones are computed."""
    cache_report: CacheReport | None = None
    """The miss report of this request's first admission."""
    content_keys: list[BlockKey] = field(default_factory=list)
    """Key chain of the tokens alone (no namespace, no salt), filled lazily for diagnosis."""
    operator_reason: MissReason | None = None
    """A miss reason only the operator may see (``salt``); never part of ``cache_report``."""

    def retains(self, block_index: int) -> bool:
        """Whether this request's retention (priority, pins) may act on its block ``block_index``:
        every block of a request without a tenant salt, else the tenant's own blocks only, never
        the blocks before ``salt_from_block`` that tenants share."""
        return self.salt is None or block_index >= self.salt_from_block

    def pin_ttl_for(self, block_end: int) -> float:
        """Seconds to pin a block that ends at token ``block_end`` (0 = no pin)."""
        ttl = self.pin_ttl_s
        for end, bp_ttl in self.pin_breakpoints:
            if block_end <= end:
                ttl = max(ttl, bp_ttl)
        return ttl
