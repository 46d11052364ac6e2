"""Replay a trace through a fleet: R copies of the real prefix cache behind the real routing core.

Every replica is the engine's own ``KVCacheManager`` / ``BlockPool`` / eviction policy, as in
``replay``; every request is routed by ``hotprefix.router.Router`` (``prefix``, ``round_robin`` or
``least_loaded``) and then served by its replica: lookup -> allocate -> commit -> free. With the
``prefix`` router each replica's pool has the KV events recorder (``hotprefix.events.recorder``)
attached, and its events reach the router right after the request, minus a random
``drop_events`` share of them (each event dropped on its own): the router then relies on what it
remembers of its own decisions.

Load is a fluid first-come-first-served queue of work in seconds per replica, under the routing
core's own cost model: a request adds its prefill (the tokens the replica computes for it, prompt
minus hit, at that replica's prefill rate) and its decode (its output tokens at that replica's
seconds per decoded token, when decode rates are given), and each replica works its queue off in
trace time between arrivals. At every arrival each replica reports its prefill and decode tokens
left, its rates, its pool's empty blocks and size to the router (a report as the replicas send it,
never stale here), and the
request's modelled time to first token is the work ahead of it on its replica plus its own
prefill: the same quantity the router minimizes.

Knows nothing about trace files or the command line. Imports no torch.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

from hotprefix.cache.ledger import ContentLedger
from hotprefix.cache.manager import CacheRequest, KVCacheManager
from hotprefix.config.sections import CacheConfig
from hotprefix.events.recorder import PoolEventRecorder
from hotprefix.router import Router, RouterConfig
from hotprefix.simulate.pool import pool_blocks, sim_pool
from hotprefix.simulate.traces import TraceRequest, sim_hasher

TARGET_UTILIZATION = 0.8
"""Default prefill speed of a replica: the fleet would be this busy if nothing hit the cache."""


@dataclass
class ReplicaFigures:
    """One replica's share of the replay."""

    requests: int = 0
    computed_tokens: int = 0
    """Prompt tokens it computed (not served from its cache)."""
    hit_tokens: int = 0
    """Prompt tokens served from its cache."""
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0
    """Decode tokens per second of one sequence (0: decode not modelled)."""


@dataclass
class FleetResult:
    """What one fleet replay measured."""

    router: str
    replicas: int
    capacity_tokens: int
    """Pool capacity of each replica."""
    block_size: int
    policy: str
    drop_events: float = 0.0
    tokens_per_s: float = 0.0
    """Mean prefill speed of a replica."""
    num_requests: int = 0
    prompt_blocks: int = 0
    hit_blocks: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0
    events_sent: int = 0
    events_dropped: int = 0
    seconds: float = 0.0
    per_replica: list[ReplicaFigures] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)
    """Router decisions by reason (``prefix``, ``least_loaded``, ``overloaded``...)."""
    max_load_tokens: float = 0.0
    """Largest outstanding prefill work (tokens) any replica had at an arrival."""
    ttfts: list[float] = field(default_factory=list, repr=False)
    """Modelled time to first token of every request (seconds, in order)."""
    router_ttfts: list[float] = field(default_factory=list, repr=False)
    """The router's expected time to first token of every request, where it sent it."""

    @property
    def block_hit_ratio(self) -> float:
        return self.hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    @property
    def load_imbalance(self) -> float:
        """Max / mean computed tokens over the replicas (1.0 = perfectly even)."""
        comp = [p.computed_tokens for p in self.per_replica]
        mean = sum(comp) / len(comp) if comp else 0.0
        return max(comp) / mean if mean else 1.0

    def ttft(self) -> dict[str, float]:
        """Mean, p50, p90 and p99 of the modelled TTFT (seconds)."""
        xs = sorted(self.ttfts)
        if not xs:
            return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
        q = lambda f: xs[min(len(xs) - 1, int(f * (len(xs) - 1)))]  # noqa: E731
        return {"mean": round(sum(xs) / len(xs), 4), "p50": round(q(0.5), 4),
                "p90": round(q(0.9), 4), "p99": round(q(0.99), 4)}

    def to_json(self) -> dict[str, Any]:
        return {
            "router": self.router, "replicas": self.replicas, "policy": self.policy,
            "capacity_tokens": self.capacity_tokens, "block_size": self.block_size,
            "block_hit_ratio": round(self.block_hit_ratio, 6),
            "token_hit_ratio": round(self.hit_tokens / max(1, self.prompt_tokens), 6),
            "modelled_ttft_s": self.ttft(),
            "load_imbalance": round(self.load_imbalance, 4),
            "per_replica": [vars(p).copy() for p in self.per_replica],
            "requests": self.num_requests, "prompt_blocks": self.prompt_blocks,
            "hit_blocks": self.hit_blocks, "prompt_tokens": self.prompt_tokens,
            "hit_tokens": self.hit_tokens, "evictions": self.evictions,
            "drop_events": self.drop_events, "events_sent": self.events_sent,
            "events_dropped": self.events_dropped, "decisions": dict(sorted(self.reasons.items())),
            "tokens_per_s": round(self.tokens_per_s, 1), "max_load_tokens": round(self.max_load_tokens),
            "seconds": round(self.seconds, 3),
        }


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@dataclass
class _Replica:
    mgr: KVCacheManager
    recorder: PoolEventRecorder | None
    prefill_tok_s: float
    decode_token_s: float
    """Seconds per decoded token (0: decode not modelled)."""
    jobs: deque = field(default_factory=deque)
    """FIFO of [prefill tokens left, decode tokens left]."""
    figures: ReplicaFigures = field(default_factory=ReplicaFigures)

    def work_off(self, dt: float) -> None:
        """``dt`` seconds of work, first come first served."""
        jobs, p, d = self.jobs, self.prefill_tok_s, self.decode_token_s
        while jobs and dt > 0:
            job = jobs[0]
            if job[0] > 0:
                if job[0] > dt * p:
                    job[0] -= dt * p
                    return
                dt -= job[0] / p
                job[0] = 0.0
            if job[1] * d > dt:
                job[1] -= dt / d
                return
            dt -= job[1] * d
            jobs.popleft()

    def left(self) -> tuple[float, float]:
        return sum(j[0] for j in self.jobs), sum(j[1] for j in self.jobs)

    def work_s(self) -> float:
        pre, dec = self.left()
        return pre / self.prefill_tok_s + dec * self.decode_token_s


def _per_replica(value: float | Sequence[float] | None, replicas: int, name: str) -> list[float] | None:
    if value is None:
        return None
    xs = [float(value)] * replicas if isinstance(value, (int, float)) else [float(x) for x in value]
    if len(xs) == 1:
        xs = xs * replicas
    if len(xs) != replicas or any(x <= 0 for x in xs):
        raise ValueError(f"{name}: one positive rate, or one per replica ({replicas})")
    return xs


def default_tokens_per_s(reqs: Sequence[TraceRequest], replicas: int,
                         decode_tokens_per_s: Sequence[float] | None = None) -> float:
    """A replica's prefill speed at which the fleet would be ``TARGET_UTILIZATION`` busy with no
    hits, decode work included when decode rates are given (requests one second apart when the
    trace has no time span).

    Raises:
        ValueError: the decode work alone would keep the fleet busier than that.
    """
    if not reqs:
        return 1.0
    span = reqs[-1].timestamp - reqs[0].timestamp
    if span <= 0:
        span = float(len(reqs))
    total = sum(r.num_prompt_tokens for r in reqs)
    budget = span * replicas * TARGET_UTILIZATION
    if decode_tokens_per_s:
        mean_s = sum(1 / x for x in decode_tokens_per_s) / len(decode_tokens_per_s)
        budget -= sum(r.num_output_tokens for r in reqs) * mean_s
        if budget <= 0:
            raise ValueError("at these decode rates the decode work alone keeps the fleet more than "
                             f"{TARGET_UTILIZATION:.0%} busy: give faster decode rates")
    return max(1.0, total / budget)


def replay_fleet(reqs: Sequence[TraceRequest], replicas: int, capacity_tokens: int,
                 router: str = "prefix", policy: str | None = None,
                 block_size: int = CacheConfig.block_size, drop_events: float = 0.0,
                 tokens_per_s: float | Sequence[float] | None = None,
                 router_config: RouterConfig | None = None,
                 seed: int = 0, admission_tail_tokens: int | None = None,
                 decode_tokens_per_s: float | Sequence[float] | None = None) -> FleetResult:
    """Replay ``reqs`` through ``replicas`` caches of ``capacity_tokens`` each, routed by ``router``.

    Args:
        policy: the replicas' eviction policy; None = the engine's default.
        drop_events: share of KV events lost on their way to the router (``prefix`` only).
        tokens_per_s: prefill speed, one for every replica or one per replica; None =
            ``default_tokens_per_s``.
        decode_tokens_per_s: decode tokens per second of one sequence, one or one per replica;
            None = decode work not modelled (output tokens cost nothing).
        router_config: the router's settings (its ``policy`` is replaced by ``router``).
        admission_tail_tokens: each replica's admission rule, as in ``replay``.
    Raises:
        ValueError: fewer than one replica, a capacity below one block, bad rates.
    """
    if replicas < 1:
        raise ValueError("replicas must be >= 1")
    policy = policy or CacheConfig.eviction_policy
    bs = block_size
    num_blocks = pool_blocks(reqs, capacity_tokens, bs)
    dec_rates = _per_replica(decode_tokens_per_s, replicas, "decode_tokens_per_s")
    pre_rates = (_per_replica(tokens_per_s, replicas, "tokens_per_s")
                 or [default_tokens_per_s(reqs, replicas, dec_rates)] * replicas)
    clock = _Clock()
    names = [f"replica-{i}" for i in range(replicas)]
    cfg = RouterConfig(**{**vars(router_config or RouterConfig()), "policy": router})
    rt = Router(names, bs, cfg, clock=clock)
    hasher = sim_hasher(bs)
    fleet: dict[str, _Replica] = {}
    for i, name in enumerate(names):
        pool = sim_pool(num_blocks, capacity_tokens, bs, policy, clock)
        mgr = KVCacheManager(pool, hasher, True, ledger=ContentLedger(max_entries=1, max_depth=0),
                             admission_tail_tokens=admission_tail_tokens)
        rec = PoolEventRecorder(pool) if router == "prefix" else None
        dec_s = 1.0 / dec_rates[i] if dec_rates else 0.0
        fleet[name] = _Replica(mgr, rec, pre_rates[i], dec_s,
                               figures=ReplicaFigures(prefill_tok_s=pre_rates[i],
                                                      decode_tok_s=dec_rates[i] if dec_rates else 0.0))
    res = FleetResult(router, replicas, capacity_tokens, bs, policy, drop_events,
                      sum(pre_rates) / replicas)
    rng = random.Random(seed)
    reasons: dict[str, int] = {}
    t0 = time.perf_counter()
    last_t = reqs[0].timestamp if reqs else 0.0
    out_total = 0
    for i, r in enumerate(reqs):
        t = r.timestamp if r.timestamp > last_t else last_t
        dt, last_t, clock.t = t - last_t, t, t
        mean_out = out_total / i if i and dec_rates else 0.0
        for name, rep in fleet.items():  # work done since the previous arrival, then a report
            rep.work_off(dt)
            pre, dec = rep.left()
            f = rep.figures
            seen = f.hit_tokens + f.computed_tokens
            rt.report(name, pre, dec, rep.prefill_tok_s, rep.decode_token_s or None, mean_out, t,
                      empty_blocks=len(rep.mgr.pool.empty), pool_blocks=num_blocks,
                      hit_ratio=f.hit_tokens / seen if seen else None)
            res.max_load_tokens = max(res.max_load_tokens, pre)
        tokens = r.tokens(bs)
        n_prompt = r.num_prompt_tokens
        keys = hasher.keys(tokens[:(n_prompt // bs) * bs])
        d = rt.route(keys, n_prompt)
        reasons[d.reason] = reasons.get(d.reason, 0) + 1
        rep = fleet[d.replica]
        h = _serve(rep.mgr, str(i), r, tokens, keys, bs, fleet_seq=i)
        computed = n_prompt - h * bs
        n_out = r.num_output_tokens if dec_rates else 0
        out_total += r.num_output_tokens
        res.ttfts.append(rep.work_s() + computed / rep.prefill_tok_s)
        res.router_ttfts.append(d.ttft_s)
        rep.jobs.append([float(computed), float(n_out)])
        f = rep.figures
        f.requests += 1
        f.computed_tokens += computed
        f.hit_tokens += h * bs
        res.num_requests += 1
        res.prompt_blocks += n_prompt // bs
        res.hit_blocks += h
        res.prompt_tokens += n_prompt
        res.hit_tokens += h * bs
        if rep.recorder is not None:
            events = rep.recorder.drain()
            res.events_sent += len(events)
            if drop_events > 0:
                kept = [e for e in events if rng.random() >= drop_events]
                res.events_dropped += len(events) - len(kept)
                events = kept
            rt.apply_events(d.replica, events)
    res.per_replica = [fleet[n].figures for n in names]
    res.evictions = sum(rep.mgr.pool.num_evictions for rep in fleet.values())
    res.reasons = reasons
    res.seconds = time.perf_counter() - t0
    return res


def _serve(mgr: KVCacheManager, rid: str, r: TraceRequest, tokens: list[int], keys: list,
           bs: int, fleet_seq: int | None = None) -> int:
    """One request through one replica's cache, as ``replay`` does it; returns its hit blocks.
    ``fleet_seq``: the fleet's request count (the replica's eviction clock: ``CacheRequest``)."""
    n_prompt = r.num_prompt_tokens
    creq = CacheRequest(rid, tokens[:n_prompt] if len(tokens) > n_prompt else tokens, n_prompt,
                        cache_write=r.cache_write, priority=r.priority, pin_ttl_s=r.pin_ttl_s,
                        block_keys=list(keys), fleet_seq=fleet_seq)
    hits = mgr.lookup(creq)
    h = len(hits)
    n_tokens = r.num_tokens
    free = mgr.num_free_after(hits)
    if math.ceil(n_tokens / bs) - h > free:  # larger than the pool: write what fits
        n_tokens = (h + free) * bs
    if not mgr.allocate(creq, n_tokens - h * bs, h * bs, hits):
        raise RuntimeError(f"request {rid}: the pool refused {n_tokens} tokens")
    if len(creq.token_ids) < len(tokens):
        creq.token_ids.extend(tokens[len(creq.token_ids):])
    mgr.commit(creq, n_tokens)
    mgr.free(creq)
    return h
