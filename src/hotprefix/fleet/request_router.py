"""The routing core (``hotprefix.router.Router``) as a Ray Serve ``RequestRouter``.

Ray Serve builds one ``HotprefixRequestRouter`` in each process that holds a handle to the engine
deployment (the front end) and asks ``choose_replicas`` where each request goes. The front end
passes the request's ``RouteHint`` (block keys computed as the replicas compute them, see
``hints``) as the ``hotprefix_route`` keyword; the router scores the live replicas with the core
and answers ranks: the chosen replica first, the others after it (Ray Serve falls back to them only
when the first one's queue is full, ``max_ongoing_requests``).

What the core knows of each replica comes from:
  * its KV events, when the replicas publish them (``--kv-events``): the addresses arrive in the
    replicas' routing stats, and the feed is polled before every decision;
  * its own decisions (the core's TTL memory), always;
  * the replicas' work and rates (prompt tokens to prefill, decode tokens left, measured prefill
    tok/s and seconds per decoded token; ``hotprefix.fleet.work``), reported every
    ``stats_period_s`` through Ray Serve's routing stats, plus every request the router has routed
    since the report was sampled (counted at once, so a burst between reports spreads).
A replica that leaves (killed, scaled down, died) is forgotten by the index, the memory and the
load table at once (``update_replicas``, ``on_replica_actor_died``).

Policies: ``prefix``, ``round_robin``, ``least_loaded`` (the core's). (``--router ray_default``
deploys without this class: Ray Serve's own ``PowerOfTwoChoicesRequestRouter``.)

Each router enters itself in ``live.routers`` (Ray Serve pickles this module by value, so shared
state lives in a module it does not copy): the front end reads the router's view (for the
admin's ``/v1/cache/stats``) and the decision counts (for ``/metrics``) there.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from hotprefix.fleet import live
from hotprefix.fleet.hints import RouteHint
from hotprefix.router.config import RouterConfig
from hotprefix.router.core import Decision, Router

log = logging.getLogger(__name__)
MAX_OPEN_DECISIONS = 100_000
"""Decisions kept for requests not yet completed (each gives its load back on completion)."""

class HotprefixRequestRouter(RequestRouter):
    """See the module docstring."""

    def initialize_state(self, policy: str = "prefix", block_size: int = 16,
                         router_options: dict[str, Any] | None = None, **_: Any) -> None:
        self.policy = policy
        # wall-clock time: the replicas' reports carry when they were sampled (time.time())
        self.core = Router([], block_size, RouterConfig(policy=policy, **(router_options or {})),
                           clock=time.time)
        self.feed: Any = None
        self.decisions: dict[str, Decision] = {}
        """Internal request id -> its decision, until the request completes."""
        self.num_decisions: collections.Counter[str] = collections.Counter()
        """Decisions by reason (``prefix``, ``least_loaded``, ``overloaded``...), for ``/metrics``."""
        self._stats_seq: dict[str, int] = {}
        self._events_at: dict[str, str] = {}
        live.routers[self._deployment_id.name] = self

    # ------------------------------------------------------------------ the fleet
    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        for name in list(self.core.replicas):
            if name not in live:
                self._forget(name)
        for name in sorted(live):
            self.core.add_replica(name)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id)

    def _forget(self, name: str) -> None:
        log.info("replica %s left: the router forgets its blocks, decisions and load", name)
        self.core.remove_replica(name)
        self._stats_seq.pop(name, None)
        self._events_at.pop(name, None)
        if self.feed is not None:
            self.feed.disconnect(name)

    def _sync(self, candidates: List[RunningReplica]) -> None:
        """Work, rates and event addresses from the routing stats; apply the events received."""
        for r in candidates:
            name = r.replica_id.unique_id
            self.core.add_replica(name)
            stats = r.routing_stats or {}
            seq = stats.get("seq")
            if seq is not None and seq != self._stats_seq.get(name):
                self._stats_seq[name] = seq
                self.core.report(name, float(stats.get("prefill_tokens", 0)),
                                 float(stats.get("decode_tokens", 0)), stats.get("prefill_tok_s"),
                                 stats.get("decode_token_s"), stats.get("output_tokens"),
                                 stats.get("sampled_at"), stats.get("empty_blocks"),
                                 stats.get("hit_ratio"), stats.get("pool_blocks"),
                                 stats.get("fleet_seqs"))
            endpoint = stats.get("kv_events")
            if endpoint and self._events_at.get(name) != endpoint and self.policy == "prefix":
                if self.feed is None:
                    from hotprefix.router.feed import EventFeed  # pyzmq, only with events

                    self.feed = EventFeed(self.core)
                self.feed.connect(name, endpoint, stats.get("kv_events_replay"))
                self._events_at[name] = endpoint
        if self.feed is not None:
            self.feed.poll(0.0)

    # ------------------------------------------------------------------ routing
    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None,
                              ) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        self._sync(candidate_replicas)
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        hint = pending_request.kwargs.get("hotprefix_route") if pending_request is not None else None
        if not isinstance(hint, RouteHint):
            hint = RouteHint()
        rid = pending_request.metadata.internal_request_id if pending_request is not None else None
        d = self.decisions.get(rid) if rid is not None else None
        if d is None or d.replica not in by_name:
            d = self.core.route(list(hint.keys), max(1, hint.num_tokens), hint.prompt_cache_key,
                                tag=hint.fleet_seq)
            self.num_decisions[d.reason] += 1
            if rid is not None:
                if len(self.decisions) >= MAX_OPEN_DECISIONS:  # completions lost: drop the oldest
                    self.decisions.pop(next(iter(self.decisions)))
                self.decisions[rid] = d
        first = by_name.get(d.replica)
        rest = sorted((r for r in candidate_replicas if r is not first),
                      key=lambda r: self._work(r.replica_id.unique_id))
        return [[first], rest] if first is not None else [rest]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        d = self.decisions.get(pending_request.metadata.internal_request_id)
        name = replica_id.unique_id
        if d is not None and d.replica != name:
            # Ray Serve took a later rank (the chosen replica's queue was full): move the work
            self.core.moved(d, name)

    def _work(self, name: str) -> float:
        return self.core.work_s(name) if name in self.core.loads else 0.0

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        d = self.decisions.pop(internal_request_id, None)
        if d is not None:
            self.core.finished(d)
