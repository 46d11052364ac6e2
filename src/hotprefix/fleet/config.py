"""The fleet's settings: one frozen dataclass, every default written once. Imports no torch, no Ray."""

from __future__ import annotations

from dataclasses import dataclass

from hotprefix.config.sections import ConfigError
from hotprefix.router.config import POLICIES

FLEET_POLICIES = POLICIES + ("ray_default",)
"""The routing core's policies, plus ``ray_default``: Ray Serve's own default request router
(``PowerOfTwoChoicesRequestRouter``: two replicas drawn at random, the one with the shorter queue),
for comparison."""


@dataclass(frozen=True)
class FleetConfig:
    """``hotprefix serve --replicas N``: engine replicas on Ray Serve behind one HTTP front end."""

    replicas: int = 1
    """Engine replicas; 1 = the single-process server (no Ray)."""
    router: str = "prefix"
    """How requests pick a replica: ``prefix`` (least expected time to first token: queued work +
    prefill of what is not cached there, the routing core), ``round_robin``, ``least_loaded``, or ``ray_default`` (Ray Serve's own default router,
    power of two choices on queue length, blind to prefixes)."""
    ray_address: str | None = None
    """Ray cluster to join (``auto``, ``ray://HOST:10001``); None = start a local Ray."""
    replica_num_cpus: float = 0.5
    """CPUs Ray reserves for each engine replica (its scheduling unit, not a thread limit)."""
    replica_num_gpus: float = 0.0
    """GPUs Ray reserves for each engine replica."""
    max_ongoing_requests: int = 64
    """Requests Ray Serve sends one replica at a time (the rest queue in the front end)."""
    stats_period_s: float = 0.25
    """How often each replica reports its work and rates to the router (a CPU replica's prefill
    takes seconds, so a report a few times a second is current; between reports the router counts
    its own decisions)."""
    max_retries: int = 3
    """Times the front end resends a request whose replica died before it answered."""
    fleet_clock: bool = True
    """The eviction policy's clock counts the fleet's requests: the front end numbers the
    generation requests it routes (``x-hotprefix-fleet-seq``; one count per front end) and each
    replica's policy advances by the fleet's requests since its previous one
    (``CacheRequest.fleet_seq``), so a replica that sees 1/N of them ages its blocks as one cache of
    the fleet's size would. False: each replica counts its own requests (the header a client sent
    is removed either way)."""

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ConfigError(f"replicas must be >= 1, got {self.replicas}")
        if self.router not in FLEET_POLICIES:
            raise ConfigError(f"router must be one of {FLEET_POLICIES}, got {self.router!r}")
        if self.replica_num_cpus < 0 or self.replica_num_gpus < 0:
            raise ConfigError("replica_num_cpus and replica_num_gpus must be >= 0")
        if self.max_ongoing_requests < 1 or self.stats_period_s <= 0 or self.max_retries < 0:
            raise ConfigError("max_ongoing_requests must be >= 1, stats_period_s > 0, max_retries >= 0")
