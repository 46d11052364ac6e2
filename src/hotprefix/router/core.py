"""The routing core: which replica should serve a request.

For the ``prefix`` policy, each replica is priced in seconds:

    cost = its work + w x prefill time of what it has not cached
           + W x prefill time of what it strands elsewhere + what the write evicts there

work + prefill time is the request's expected time to first token there. w (``prefill_weight``;
derived by default) is 1 + the requests expected to queue behind it *there*: the rate at which
the router has been sending requests to that replica x the time until its queue empties, (its
work + this prefill) / (1 - its utilization), both measured over the router's last decisions for
it (from the first of them, or of the fleet's last decisions if earlier, to now); a second of
prefill added to its queue delays each of them too. A replica the router has not
been sending to has w = 1 (its prefill delays nobody): so when every request queues on the one
holder of a shared prefix, an idle replica copies it. W prices what the *fleet* loses (stranded
blocks are computed again wherever the conversation goes next): the same formula over all the
fleet's recent decisions, per replica (its mean arrival rate, mean work and utilization). A quiet
fleet has w = W = 1. Every block is priced at its own prefill time:

  * stranded: sending a request away from the replica that holds its prefix leaves that
    replica's copy of the prompt's *private* blocks (those no other continuation reads:
    ``branches``) dead in its pool: blocks the fleet computed and will compute again (x W). A
    shared prefix is not stranded (its copy keeps serving the others): copying it elsewhere
    replicates it.
  * evicted: the blocks the prompt writes beyond the replica's empty ones, or beyond its share of
    the fleet's filled blocks (its pool's share of the fleet's pool), whichever is more (when the
    replicas report their pools): the fleet is one cache when its pools fill at the same pace, so
    new prompts go where there is room for them and for the turns that follow them.

No token counts or ratios tuned on a trace.

The replica's work is the time its queued and running work takes at its own measured rates
(``load``: prefill tokens left / prefill tok/s + decode tokens left x s per decoded token), plus
every request routed there since its last report (optimistic accounting: a burst of decisions
between reports spreads instead of landing on one replica). The tokens cached there are the
prompt's leading run of blocks in that replica's pool, with blocks it can load from a KV tier (its
own, or one shared by every replica) at ``tier_weight`` of a prefill. What a replica holds comes
from its KV events (``index.BlockIndex``), and, where no event says otherwise, from the router's
own past decisions (every block of a prompt is remembered as going to the replica it was sent to,
for ``decision_ttl_s``): with events off, late or dropped, a conversation's next turn still finds
its replica.

  * Affinity yields by time, not by a token count: a holder is passed over when its queue is longer
    than w x the prefill time it saves (and the private blocks it would strand), and the replica
    that then computes the prompt becomes a holder too: a hot shared prefix is replicated by
    routing when its one holder is the bottleneck, and from then on spreads by work.
  * A prefix every replica holds, or can load from a shared KV tier (a Redis/Valkey tier the
    holder wrote it to: its ``BlockStored`` events name that medium), saves the same time
    everywhere (tier blocks at ``tier_weight`` of a prefill), so it is no reason to pile up: the
    choice is by work; the replicas that load it become holders in their pools.
  * Equal costs (a quiet fleet, a prompt nobody holds) go to a random one of them.
  * OpenAI's ``prompt_cache_key``: the same key goes to the same replica while that replica is
    dearer than the cheapest by no more than the whole prompt's prefill time.

The router computes a request's block keys as the replicas do (``BlockHasher`` with the model +
tokenizer namespace, the tenant's salt at its block), so event hashes match byte for byte. Knows
nothing about HTTP, Ray or sockets. Imports no torch.
"""

from __future__ import annotations

import collections
import itertools
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from hotprefix.cache.hashing import BlockHasher, BlockKey
from hotprefix.cache.rules import cacheable_blocks
from hotprefix.router.branches import BranchMap
from hotprefix.router.config import RouterConfig
from hotprefix.router.index import BlockIndex
from hotprefix.router.load import Pending, ReplicaLoad
from hotprefix.router.memory import TtlMap

EPS_S = 1e-9
"""Costs closer than this are equal (ties are drawn at random)."""
RECENT = 64
"""Decisions whose arrival times and work give the fleet's arrival rate and utilization, and (as
many again per replica) each replica's."""
MAX_UTILIZATION = 0.99
"""Utilization estimates are capped here (a fleet measured at 100% would price work infinitely)."""


@dataclass
class Decision:
    """Where a request goes, and why."""

    replica: str
    reason: str
    """``prefix`` (a holder of more of the prompt than others had the least cost),
    ``prompt_cache_key``, ``least_loaded`` (no replica held more than another: chosen by work),
    ``overloaded`` (a holder of more of the prompt was passed over for its queue),
    ``round_robin``."""
    hit_blocks: int = 0
    """Leading blocks the chosen replica is expected to hold in its pool."""
    tier_blocks: int = 0
    """Blocks after those it is expected to load from a tier."""
    prefill_tokens: int = 0
    """Tokens it is expected to compute; counted in its work until its next report."""
    decode_tokens: float = 0.0
    """Tokens it is expected to decode; counted likewise."""
    cost: float = 0.0
    """The chosen replica's cost (seconds)."""
    ttft_s: float = 0.0
    """Expected time to first token there: its work + this prompt's prefill time."""
    pending: Pending | None = None


class Router:
    """Routes requests over named replicas (see the module docstring).

    Args:
        replicas: replica names, in a fixed order.
        block_size: tokens per block (the replicas').
        hasher: computes block keys as the replicas do (needed by ``route_tokens`` only).
        clock: seconds, for the decision memory's TTL and the reports (the simulator passes
            trace time).
    """

    def __init__(self, replicas: Sequence[str], block_size: int, config: RouterConfig | None = None,
                 hasher: BlockHasher | None = None, clock: Callable[[], float] = time.monotonic):
        self.config = config or RouterConfig()
        self.block_size = block_size
        self.hasher = hasher
        self.clock = clock
        self.replicas: list[str] = []
        self.loads: dict[str, ReplicaLoad] = {}
        """Replica -> its reported work and rates, plus what ``route`` sent since."""
        self.index = BlockIndex()
        self.memory: TtlMap[tuple[BlockKey, str], bool] = TtlMap(self.config.decision_ttl_s,
                                                                  self.config.max_remembered_blocks)
        """(block key, replica) for every block the router sent to a replica, until ``decision_ttl_s``."""
        self.affinity: TtlMap[str, str] = TtlMap(self.config.decision_ttl_s,
                                                 self.config.max_affinity_keys)
        self.branches = BranchMap(self.config.decision_ttl_s, self.config.max_remembered_blocks)
        """Which blocks more than one continuation reads (shared prefixes), from the routed prompts."""
        self.index.listeners.append(lambda r, k: self.memory.discard((k, r)))  # events win
        self._recent: collections.deque[tuple[float, float]] = collections.deque(maxlen=RECENT)
        """(arrival time, seconds of work) of the last decisions."""
        self._recent_at: dict[str, collections.deque[tuple[float, float]]] = {}
        """Replica -> the same, of its last decisions."""
        self._rng = random.Random(self.config.seed)
        self._rr = itertools.count()
        for r in replicas:
            self.add_replica(r)

    # ------------------------------------------------------------------ the fleet
    def add_replica(self, name: str) -> None:
        if name not in self.loads:
            self.replicas.append(name)
            self.loads[name] = ReplicaLoad()

    def remove_replica(self, name: str) -> None:
        """``name`` left (killed, scaled down): forget its blocks, decisions and load."""
        if name in self.loads:
            self.replicas.remove(name)
            del self.loads[name]
            self._recent_at.pop(name, None)
            self.index.forget(name, groups=True)
            self.memory.discard_if(lambda key, _: key[1] == name)
            self.affinity.discard_if(lambda _, r: r == name)

    def apply_events(self, replica: str, events: Sequence[Any]) -> None:
        """One decoded ``KVEventBatch``'s events from ``replica``."""
        if replica in self.loads:
            self.index.apply(replica, events)

    def report(self, replica: str, prefill_tokens: float, decode_tokens: float = 0.0,
               prefill_tok_s: float | None = None, decode_token_s: float | None = None,
               output_tokens: float | None = None, sampled_at: float | None = None,
               empty_blocks: float | None = None, hit_ratio: float | None = None,
               pool_blocks: float | None = None, fleet_seqs: Sequence[int] | None = None) -> None:
        """A replica's report: prompt tokens still to prefill and decode tokens left over its
        running and waiting requests, its measured rates (None: unchanged), the mean output of
        its requests; ``sampled_at`` (router clock, default now): when the replica measured it
        (what was routed there before is in it); ``empty_blocks``, ``hit_ratio``, ``pool_blocks``:
        its pool's empty blocks, the share of its prompt tokens it served from cache, and its pool's
        size in blocks; ``fleet_seqs``: the tags (fleet numbers) of the requests its scheduler holds
        (then a tagged request routed there before ``sampled_at`` but not named is still on its
        way, and stays counted)."""
        if replica in self.loads:
            self.loads[replica].report(prefill_tokens, decode_tokens,
                                       self.clock() if sampled_at is None else sampled_at,
                                       prefill_tok_s, decode_token_s, output_tokens,
                                       empty_blocks, hit_ratio, pool_blocks, fleet_seqs)

    def set_load(self, replica: str, tokens: float) -> None:
        """A report of ``tokens`` still to prefill and nothing to decode (rates unchanged)."""
        self.report(replica, tokens)

    def finished(self, decision: Decision) -> None:
        """The routed request ended: if no report has counted it yet, take it back."""
        load = self.loads.get(decision.replica)
        if load is not None and decision.pending is not None:
            load.take_back(decision.pending)
        decision.pending = None

    def moved(self, decision: Decision, replica: str) -> None:
        """The request went to ``replica`` instead (a later rank): move its counted work."""
        if replica not in self.loads or replica == decision.replica:
            return
        tag = decision.pending.tag if decision.pending is not None else None
        self.finished(decision)
        decision.replica = replica
        decision.pending = Pending(self.clock(), decision.prefill_tokens, decision.decode_tokens,
                                   decision.prefill_tokens / self.block_size, tag)
        self.loads[replica].add(decision.pending)

    # ------------------------------------------------------------------ time
    def rates(self, replica: str) -> tuple[float, float]:
        """(prefill tok/s, s per decoded token) of ``replica``: its own measurement, else the
        fleet's mean of those measured, else the config's priors."""
        cfg = self.config
        own = self.loads[replica]
        pre = own.prefill_tok_s
        dec = own.decode_token_s
        if pre is None:
            known = [x.prefill_tok_s for x in self.loads.values() if x.prefill_tok_s]
            pre = sum(known) / len(known) if known else cfg.default_prefill_tok_s
        if dec is None:
            known = [x.decode_token_s for x in self.loads.values() if x.decode_token_s]
            dec = sum(known) / len(known) if known else cfg.default_decode_token_s
        return pre, dec

    def work_s(self, replica: str) -> float:
        """Seconds of queued and running work on ``replica`` (reported + routed since)."""
        return self.loads[replica].work_s(*self.rates(replica))

    def expected_output(self, replica: str) -> float:
        """Tokens a new request is expected to decode there (the replicas' reported mean)."""
        own = self.loads[replica].output_tokens
        if own is not None:
            return own
        known = [x.output_tokens for x in self.loads.values() if x.output_tokens is not None]
        return sum(known) / len(known) if known else 0.0

    def eviction_s(self, replica: str, compute: int) -> float:
        """What writing ``compute`` new tokens' blocks on ``replica`` evicts, in prefill seconds,
        each block at its own prefill time (the pool kept it because its policy expects it back; a
        replica's measured hit ratio would undervalue exactly the pool that thrashes). The blocks
        evicted are the larger of

          * those beyond its empty ones (evicted now), and
          * those beyond its share of the fleet's filled blocks (its pool's share of the fleet's
            pool): the fleet acts as one cache only when every pool fills at the same pace; a
            replica filled ahead of the others evicts the prompts that return to it (and grow)
            while their pools still have room. Where pool sizes are reported;

        and never more than the write's own blocks (the marginal cost of this write).

        0 where the replica does not report its empty blocks."""
        load = self.loads[replica]
        empty = load.empty_left()
        if empty is None:
            return 0.0
        blocks = compute / self.block_size
        over = blocks - empty
        filled = load.filled()
        if filled is not None:
            fleet = [self.loads[r] for r in self.replicas]
            fills = [x.filled() for x in fleet]
            if all(f is not None for f in fills):
                total = sum(x.pool_blocks for x in fleet)  # type: ignore[misc]
                share = load.pool_blocks / total  # type: ignore[operator]
                over = max(over, filled + blocks - share * (sum(fills) + blocks))  # type: ignore[arg-type]
        # this write's blocks at most: a replica already past its share is charged for the blocks
        # it adds, not again for the excess earlier writes made (or a conversation's every turn
        # pays its holder's whole lead, and leaves it once the lead outgrows its cached prefix)
        return min(blocks, max(0.0, over)) * self.block_size / self.rates(replica)[0]

    def view(self) -> dict[str, dict[str, float]]:
        """Per replica: work seconds, tokens (prefill, decode) counted, rates, pool blocks filled
        and in all (None: not reported); for stats pages."""
        out = {}
        for r in self.replicas:
            load = self.loads[r]
            pre, dec = load.tokens()
            p, d = self.rates(r)
            filled = load.filled()
            out[r] = {"work_s": round(self.work_s(r), 4), "prefill_tokens": round(pre),
                      "decode_tokens": round(dec), "prefill_tok_s": round(p, 1),
                      "decode_token_s": round(d, 6), "pending": len(load.pending),
                      "measured": load.prefill_tok_s is not None,
                      "filled_blocks": None if filled is None else round(filled),
                      "pool_blocks": None if load.pool_blocks is None else round(load.pool_blocks)}
        return out

    # ------------------------------------------------------------------ routing
    def route_tokens(self, token_ids: Sequence[int], salt: str | None = None,
                     salt_from_block: int = 0, prompt_cache_key: str | None = None,
                     decode_tokens: float | None = None, tag: int | None = None) -> Decision:
        """Route a prompt given as token ids (keys computed as the replicas compute them)."""
        if self.hasher is None:
            raise ValueError("route_tokens needs the router's BlockHasher (the replicas' namespace)")
        n = len(token_ids) // self.block_size
        keys = self.hasher.keys(token_ids[:n * self.block_size], salt, salt_from_block)
        return self.route(keys, len(token_ids), prompt_cache_key, decode_tokens, tag)

    def route(self, keys: Sequence[BlockKey], num_tokens: int,
              prompt_cache_key: str | None = None, decode_tokens: float | None = None,
              tag: int | None = None) -> Decision:
        """Pick a replica for a prompt of ``num_tokens`` tokens whose full blocks have ``keys``,
        remember the decision (the replica will cache every one of those blocks), and count its
        work on that replica at once. Only blocks a replica may serve from cache count (never the
        last prompt token's). ``decode_tokens``: the output expected (None: the replicas' mean);
        ``tag``: the request's fleet number, which the replica's reports name once it holds it.

        Raises:
            RuntimeError: no replica.
        """
        if not self.replicas:
            raise RuntimeError("no replica to route to")
        cfg = self.config
        if cfg.policy == "round_robin":
            d = self._plain(self.replicas[next(self._rr) % len(self.replicas)], "round_robin",
                            num_tokens)
        elif cfg.policy == "least_loaded":
            d = self._plain(self._least(self.replicas, self.work_s), "least_loaded", num_tokens)
        else:
            d = self._route_prefix(keys[:cacheable_blocks(num_tokens, self.block_size)], num_tokens,
                                   prompt_cache_key, keys)
        d.decode_tokens = self.expected_output(d.replica) if decode_tokens is None else decode_tokens
        now = self.clock()
        pre, dec = self.rates(d.replica)
        job = (now, d.prefill_tokens / pre + d.decode_tokens * dec)
        self._recent.append(job)
        self._recent_at.setdefault(d.replica, collections.deque(maxlen=RECENT)).append(job)
        d.pending = Pending(now, d.prefill_tokens, d.decode_tokens, d.prefill_tokens / self.block_size,
                            tag)
        self.loads[d.replica].add(d.pending)
        for k in keys:
            self.memory.set((k, d.replica), True, now)
        self.branches.add(keys, now)
        if prompt_cache_key is not None:
            self.affinity.set(prompt_cache_key, d.replica, now)
        return d

    def _plain(self, r: str, reason: str, num_tokens: int) -> Decision:
        pre, _ = self.rates(r)
        wait = self.work_s(r)
        return Decision(r, reason, prefill_tokens=num_tokens, cost=wait,
                        ttft_s=wait + num_tokens / pre)

    def _least(self, candidates: Sequence[str], cost: Callable[[str], float]) -> str:
        """The cheapest candidate; a random one of those that tie."""
        costs = {r: cost(r) for r in candidates}
        low = min(costs.values())
        tied = [r for r in candidates if costs[r] <= low + EPS_S]
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)

    def traffic(self, replica: str | None = None) -> tuple[float, float]:
        """(arrivals per second, utilization) per replica over the fleet's recent decisions (their
        mean); of ``replica``: over the router's last decisions for it, from the first of them to
        now. (0, 0) before two fleet decisions at different times, or before any for ``replica``."""
        if replica is None:
            jobs = list(self._recent)
            span = jobs[-1][0] - jobs[0][0] if len(jobs) > 1 else 0.0
            jobs, n = jobs[1:], len(self.replicas)
        else:
            jobs, n = list(self._recent_at.get(replica, ())), 1
            # from the first of its last decisions, or of the fleet's if that is earlier: a replica
            # that has just begun to be sent requests has not a rate of one per few milliseconds
            span = self.clock() - min(jobs[0][0], self._recent[0][0]) if jobs else 0.0
        if span <= 0:
            return 0.0, 0.0
        return len(jobs) / span / n, min(MAX_UTILIZATION, sum(w for _, w in jobs) / span / n)

    def _route_prefix(self, keys: Sequence[BlockKey], num_tokens: int,
                      prompt_cache_key: str | None, all_keys: Sequence[BlockKey]) -> Decision:
        cfg = self.config
        bs = self.block_size
        now = self.clock()
        memory = self.memory
        runs = self.index.runs(keys, self.replicas, lambda r, k: memory.get((k, r), now) is not None)
        scored: dict[str, Decision] = {}
        derive = cfg.prefill_weight is None
        lam, rho = self.traffic() if derive else (0.0, 0.0)
        waits = {r: self.work_s(r) for r in self.replicas}
        mean_wait = sum(waits.values()) / len(waits)
        holder = max(self.replicas, key=lambda r: runs[r][0])
        held = runs[holder][0]
        # the holder's copy of the prompt's private blocks (no other continuation reads them) is
        # stranded there if the request goes elsewhere: dead blocks the fleet computed for nothing
        private = self.branches.private_from(all_keys, 0, held, now)
        strand_block_s = bs / self.rates(holder)[0]
        for r in self.replicas:
            pool, tier = runs[r]
            pre, _ = self.rates(r)
            strand_s = max(0, held - max(pool, private)) * strand_block_s
            compute = max(1, num_tokens - (pool + tier) * bs)
            prefill_s = (compute + cfg.tier_weight * tier * bs) / pre
            wait = waits[r]
            # a second of prefill added here also delays the requests that queue behind it: those
            # the router goes on sending here until this replica's queue empties; a block
            # stranded is computed again by the fleet, behind the fleet's mean queue
            if derive:
                lam_r, rho_r = self.traffic(r)
                w = 1 + lam_r * (wait + prefill_s) / (1 - rho_r)
                w_fleet = 1 + lam * (mean_wait + prefill_s) / (1 - rho)
            else:
                w = w_fleet = cfg.prefill_weight  # type: ignore[assignment]
            scored[r] = Decision(r, "prefix", pool, tier, compute,
                                 cost=(wait + w * prefill_s + w_fleet * strand_s
                                       + self.eviction_s(r, compute)),
                                 ttft_s=wait + prefill_s)
        best = self._least(self.replicas, lambda r: scored[r].cost)
        if prompt_cache_key is not None:
            r = self.affinity.get(prompt_cache_key, now)
            if r is not None and r in scored:
                pre, _ = self.rates(r)
                # its replica may be dearer by no more than the whole prompt's prefill time
                w = 1.0 if cfg.prefill_weight is None else cfg.prefill_weight
                if scored[r].ttft_s - scored[best].ttft_s <= w * num_tokens / pre:
                    d = scored[r]
                    d.reason = "prompt_cache_key"
                    return d
        saved = {r: pool + (1 - cfg.tier_weight) * tier for r, (pool, tier) in runs.items()}
        d = scored[best]
        if max(saved.values()) <= min(saved.values()):  # nothing tells the replicas apart
            d.reason = "least_loaded"
        elif saved[best] <= min(saved.values()):
            d.reason = "overloaded"  # a holder of more of it was passed over for its queue
        return d
