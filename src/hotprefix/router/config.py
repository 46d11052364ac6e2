"""The routing core's settings: one frozen dataclass, every default written once. Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("prefix", "round_robin", "least_loaded")


@dataclass(frozen=True)
class RouterConfig:
    """How the router picks a replica (``hotprefix.router.core.Router``)."""

    policy: str = "prefix"
    """``prefix`` (least expected time to first token, below), ``round_robin`` or
    ``least_loaded`` (least queued and running work, in seconds)."""
    prefill_weight: float | None = None
    """``w`` in cost = the replica's work (s) + w x the seconds it needs to prefill this prompt
    (the part it has not cached). None (the default) derives it at each decision for each
    replica from the router's recent decisions: w = 1 + the requests expected to queue behind
    this one *there* (the rate the router sends requests to that replica x the time until its
    queue empties, (its work + this prefill) / (1 - its utilization)), since a second of prefill
    added to a queue delays each of them too; blocks stranded on another replica get the fleet's
    mean of the same. A quiet fleet gets w = 1 (the request's own time to first token); a busy
    replica values a cached prefix more, and one the router is not sending to copies a prefix its
    busy holder would serve late. A number fixes w (both weights)."""
    tier_weight: float = 0.25
    """A block the replica can load from a KV tier (its own, or a shared one) costs this fraction
    of prefilling it."""
    default_prefill_tok_s: float = 1000.0
    """Prefill tokens per second assumed for a replica until some replica has measured its own
    (then the fleet's mean of the measured rates). Identical replicas compare work in tokens, so
    only its ratio to ``default_decode_token_s`` matters before any report."""
    default_decode_token_s: float = 0.02
    """Seconds per decoded token assumed until some replica has measured its own."""
    decision_ttl_s: float = 600.0
    """How long the router trusts its own past decisions (block -> replica it sent the block to)
    where no KV event says otherwise; also the life of a ``prompt_cache_key`` affinity."""
    max_remembered_blocks: int = 4_000_000
    """Most (block key, replica) pairs remembered from past decisions (the oldest go first)."""
    max_affinity_keys: int = 100_000
    """Most ``prompt_cache_key`` values remembered."""
    seed: int = 0
    """Seed of the tie-breaking draws (equal costs: a random one of them, never always the first)."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"router policy must be one of {POLICIES}, got {self.policy!r}")
        if (self.prefill_weight is not None and self.prefill_weight < 0) or not 0 <= self.tier_weight <= 1:
            raise ValueError("prefill_weight must be >= 0 and tier_weight in [0, 1]")
        if self.default_prefill_tok_s <= 0 or self.default_decode_token_s < 0:
            raise ValueError("default_prefill_tok_s must be > 0 and default_decode_token_s >= 0")
