"""The routing core's settings: one frozen dataclass, every default written once. Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("prefix", "round_robin", "least_loaded")


@dataclass(frozen=True)
class RouterConfig:
    """How the router picks a replica (``hotprefix.router.core.Router``)."""

    policy: str = "prefix"
    """``prefix`` (cost = prefill + load, below), ``round_robin`` or ``least_loaded``."""
    prefill_weight: float = 8.0
    """``w`` in cost = w x tokens to prefill on the replica + its load (running and waiting
    tokens). 1 would price a token to prefill like a token of queued work (the request's own time
    to first token); more values a cached prefix above that, because keeping a conversation on its
    replica also saves its later turns and keeps copies of it out of other pools (8: the best of
    1-32 on the Mooncake conversation trace, README "A fleet"). The overload threshold bounds it."""
    tier_weight: float = 0.25
    """A block the replica can load from a KV tier (its own, or a shared one) costs this fraction
    of prefilling it."""
    shared_prefix_fanout: int = 16
    """A block that this many different next blocks have followed (in prompts routed within
    ``decision_ttl_s``) ends a *shared* prefix, such as a system prompt: holding it tells no
    replica apart, since every replica soon holds it too. A request that matches nothing beyond
    such a prefix (and beyond what every replica holds) is a miss for routing: power of two choices
    on load, so the new conversations of a quiet fleet do not all pile onto the first replica."""
    overload_ratio: float = 1.5
    """A replica whose load exceeds ``overload_ratio`` x the fleet's mean load (plus
    ``overload_slack_tokens``) gets no request for its cached prefix or affinity key: affinity
    yields to load there."""
    overload_slack_tokens: int = 65536
    """Load any replica may carry before the overload ratio applies (a lightly loaded fleet keeps
    its affinity; a few long prompts' worth, so one arrival does not break it)."""
    decision_ttl_s: float = 600.0
    """How long the router trusts its own past decisions (block -> replica it sent the block to)
    where no KV event says otherwise; also the life of a ``prompt_cache_key`` affinity."""
    max_remembered_blocks: int = 4_000_000
    """Most (block key, replica) pairs remembered from past decisions (the oldest go first)."""
    max_affinity_keys: int = 100_000
    """Most ``prompt_cache_key`` values remembered."""
    seed: int = 0
    """Seed of the power-of-two-choices draws."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"router policy must be one of {POLICIES}, got {self.policy!r}")
        if self.overload_ratio < 1.0:
            raise ValueError(f"overload_ratio must be >= 1, got {self.overload_ratio}")
        if self.prefill_weight < 0 or not 0 <= self.tier_weight <= 1:
            raise ValueError("prefill_weight must be >= 0 and tier_weight in [0, 1]")
        if self.shared_prefix_fanout < 2:
            raise ValueError(f"shared_prefix_fanout must be >= 2, got {self.shared_prefix_fanout}")
