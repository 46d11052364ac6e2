"""The routing core: which replica should serve a request.

For the ``prefix`` policy, each replica is scored

    cost = w x tokens to prefill there + its load (running and waiting tokens)

where the tokens to prefill are the prompt's tokens minus its leading run of blocks cached in that
replica's pool, with blocks it can load from a KV tier (its own, or one shared by every replica)
counted at ``tier_weight`` of a prefill. What a replica holds comes from its KV events
(``index.BlockIndex``), and, where no event says otherwise, from the router's own past decisions
(every block of a prompt is remembered as going to the replica it was sent to, for
``decision_ttl_s``): with events off, late or dropped, a conversation's next turn still finds its
replica.

  * A replica loaded past ``overload_ratio`` x the mean load (+ slack) is not chosen for its
    prefix: affinity yields to load there (``reason="overloaded"`` when it would have won).
  * When no replica holds more of the prompt than the others, beyond a *shared* prefix (one that
    ``shared_prefix_fanout`` different prompts continued, e.g. a system prompt), the request is a
    miss for routing: the less loaded of two replicas drawn at random (power of two choices).
    Never "the smallest tree", never the same replica for every miss.
  * OpenAI's ``prompt_cache_key``: the same key goes to the same replica while it is not overloaded.

The router computes a request's block keys as the replicas do (``BlockHasher`` with the model +
tokenizer namespace, the tenant's salt at its block), so event hashes match byte for byte. Knows
nothing about HTTP, Ray or sockets. Imports no torch.
"""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from hotprefix.cache.hashing import BlockHasher, BlockKey
from hotprefix.cache.rules import cacheable_blocks
from hotprefix.router.config import RouterConfig
from hotprefix.router.index import BlockIndex
from hotprefix.router.memory import TtlMap


@dataclass
class Decision:
    """Where a request goes, and why."""

    replica: str
    reason: str
    """``prefix`` (best cost), ``prompt_cache_key``, ``least_loaded`` (nothing told replicas apart:
    power of two choices), ``overloaded`` (the best prefix holder was overloaded), ``round_robin``."""
    hit_blocks: int = 0
    """Leading blocks the chosen replica is expected to hold in its pool."""
    tier_blocks: int = 0
    """Blocks after those it is expected to load from a tier."""
    prefill_tokens: int = 0
    """Tokens it is expected to compute; added to its load until ``finished``."""
    cost: float = 0.0


class Router:
    """Routes requests over named replicas (see the module docstring).

    Args:
        replicas: replica names, in a fixed order.
        block_size: tokens per block (the replicas').
        hasher: computes block keys as the replicas do (needed by ``route_tokens`` only).
        clock: seconds, for the decision memory's TTL (the simulator passes trace time).
    """

    def __init__(self, replicas: Sequence[str], block_size: int, config: RouterConfig | None = None,
                 hasher: BlockHasher | None = None, clock: Callable[[], float] = time.monotonic):
        self.config = config or RouterConfig()
        self.block_size = block_size
        self.hasher = hasher
        self.clock = clock
        self.replicas: list[str] = []
        self.load: dict[str, float] = {}
        """Replica -> running and waiting tokens (``set_load``, plus what ``route`` assigns)."""
        self.index = BlockIndex()
        self.memory: TtlMap[tuple[BlockKey, str], bool] = TtlMap(self.config.decision_ttl_s,
                                                                  self.config.max_remembered_blocks)
        """(block key, replica) for every block the router sent to a replica, until ``decision_ttl_s``."""
        self.affinity: TtlMap[str, str] = TtlMap(self.config.decision_ttl_s,
                                                 self.config.max_affinity_keys)
        self.fanout: TtlMap[BlockKey, tuple[BlockKey, int]] = TtlMap(
            self.config.decision_ttl_s, self.config.max_remembered_blocks)
        """Block key -> (the last next block seen after it, how often that next block changed)."""
        self.index.listeners.append(lambda r, k: self.memory.discard((k, r)))  # events win
        self._rng = random.Random(self.config.seed)
        self._rr = itertools.count()
        for r in replicas:
            self.add_replica(r)

    # ------------------------------------------------------------------ the fleet
    def add_replica(self, name: str) -> None:
        if name not in self.load:
            self.replicas.append(name)
            self.load[name] = 0.0

    def remove_replica(self, name: str) -> None:
        """``name`` left (killed, scaled down): forget its blocks, decisions and load."""
        if name in self.load:
            self.replicas.remove(name)
            del self.load[name]
            self.index.forget(name)
            self.memory.discard_if(lambda key, _: key[1] == name)
            self.affinity.discard_if(lambda _, r: r == name)

    def apply_events(self, replica: str, events: Sequence[Any]) -> None:
        """One decoded ``KVEventBatch``'s events from ``replica``."""
        if replica in self.load:
            self.index.apply(replica, events)

    def set_load(self, replica: str, tokens: float) -> None:
        """A replica's reported load: running + waiting tokens."""
        if replica in self.load:
            self.load[replica] = float(tokens)

    def finished(self, decision: Decision) -> None:
        """The routed request ended: its prefill tokens leave the replica's load."""
        if decision.replica in self.load:
            self.load[decision.replica] = max(0.0, self.load[decision.replica] - decision.prefill_tokens)

    # ------------------------------------------------------------------ routing
    def route_tokens(self, token_ids: Sequence[int], salt: str | None = None,
                     salt_from_block: int = 0, prompt_cache_key: str | None = None) -> Decision:
        """Route a prompt given as token ids (keys computed as the replicas compute them)."""
        if self.hasher is None:
            raise ValueError("route_tokens needs the router's BlockHasher (the replicas' namespace)")
        n = len(token_ids) // self.block_size
        keys = self.hasher.keys(token_ids[:n * self.block_size], salt, salt_from_block)
        return self.route(keys, len(token_ids), prompt_cache_key)

    def route(self, keys: Sequence[BlockKey], num_tokens: int,
              prompt_cache_key: str | None = None) -> Decision:
        """Pick a replica for a prompt of ``num_tokens`` tokens whose full blocks have ``keys``,
        remember the decision (the replica will cache every one of those blocks), and add its
        prefill tokens to that replica's load. Only blocks a replica may serve from cache count
        (never the last prompt token's).

        Raises:
            RuntimeError: no replica.
        """
        if not self.replicas:
            raise RuntimeError("no replica to route to")
        cfg = self.config
        if cfg.policy == "round_robin":
            d = Decision(self.replicas[next(self._rr) % len(self.replicas)], "round_robin",
                         prefill_tokens=num_tokens)
        elif cfg.policy == "least_loaded":
            d = Decision(min(self.replicas, key=self.load.__getitem__), "least_loaded",
                         prefill_tokens=num_tokens)
        else:
            shared = self._shared_depth(keys)
            d = self._route_prefix(keys[:cacheable_blocks(num_tokens, self.block_size)], num_tokens,
                                   prompt_cache_key, shared)
        self.load[d.replica] += d.prefill_tokens
        now = self.clock()
        for k in keys:
            self.memory.set((k, d.replica), True, now)
        if prompt_cache_key is not None:
            self.affinity.set(prompt_cache_key, d.replica, now)
        return d

    def overloaded(self) -> set[str]:
        """Replicas past the overload threshold (no affinity for them)."""
        cfg = self.config
        mean = sum(self.load.values()) / len(self.load)
        limit = cfg.overload_ratio * mean + cfg.overload_slack_tokens
        return {r for r, x in self.load.items() if x > limit}

    def _shared_depth(self, keys: Sequence[BlockKey]) -> int:
        """Record which block follows which in this prompt; return how many leading blocks end at
        the deepest shared-prefix block (one followed by ``shared_prefix_fanout`` different ones)."""
        now = self.clock()
        fan = self.fanout
        limit = self.config.shared_prefix_fanout - 1
        depth = 0
        for i in range(len(keys) - 1):
            k, nxt = keys[i], keys[i + 1]
            seen = fan.get(k, now)
            changes = 0 if seen is None else seen[1] + (seen[0] != nxt)
            fan.set(k, (nxt, changes), now)
            if changes >= limit:
                depth = i + 1
        return depth

    def _route_prefix(self, keys: Sequence[BlockKey], num_tokens: int,
                      prompt_cache_key: str | None, shared: int = 0) -> Decision:
        cfg = self.config
        bs = self.block_size
        now = self.clock()
        over = self.overloaded()
        memory = self.memory
        runs = self.index.runs(keys, self.replicas, lambda r, k: memory.get((k, r), now) is not None)

        def decision(r: str, reason: str) -> Decision:
            pool, tier = runs[r]
            prefill = max(1, num_tokens - (pool + tier) * bs)
            cost = cfg.prefill_weight * (prefill + cfg.tier_weight * tier * bs) + self.load[r]
            return Decision(r, reason, pool, tier, prefill, cost)

        if prompt_cache_key is not None:
            r = self.affinity.get(prompt_cache_key, now)
            if r is not None and r in self.load and r not in over:
                return decision(r, "prompt_cache_key")
        ok = [r for r in self.replicas if r not in over] or list(self.replicas)
        saved = [pool + (1 - cfg.tier_weight) * tier for pool, tier in runs.values()]
        if max(saved) <= max(min(saved), shared):  # nothing tells the replicas apart
            return decision(self._two_choices(ok), "least_loaded")
        scored = {r: decision(r, "prefix") for r in self.replicas}
        best = min(self.replicas, key=lambda r: scored[r].cost)
        if best in over:
            d = scored[min(ok, key=lambda r: scored[r].cost)]
            d.reason = "overloaded"
            return d
        return scored[best]

    def _two_choices(self, candidates: list[str]) -> str:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(candidates, 2)
        return a if self.load[a] <= self.load[b] else b
