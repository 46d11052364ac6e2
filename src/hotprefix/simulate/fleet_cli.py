"""``hotprefix simulate TRACE --replicas R``: the fleet part of the command line.

``--replicas R --router prefix|round_robin|least_loaded --capacity-tokens N`` (N per replica)
replays the trace through ``fleet.replay_fleet`` and prints the block hit ratio, each replica's
requests, computed and hit tokens, and the load imbalance (max / mean computed tokens); ``--json``
prints them as one object with ``block_hit_ratio``, ``per_replica`` and ``load_imbalance``.
"""

from __future__ import annotations

import argparse
import json
import sys

from hotprefix.cache.eviction import POLICIES as EVICTION_POLICIES
from hotprefix.router import POLICIES, RouterConfig
from hotprefix.simulate.argtypes import non_negative_float, positive_float
from hotprefix.simulate.fleet import TARGET_UTILIZATION, replay_fleet
from hotprefix.simulate.traces import TraceRequest


def rates(text: str) -> list[float]:
    """``A`` or ``A,B,...``: positive rates (one for every replica, or one per replica)."""
    return [positive_float(x) for x in text.split(",")]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The fleet's arguments, on the ``simulate`` parser."""
    g = p.add_argument_group("fleet", "replay through R replicas behind the routing core")
    g.add_argument("--replicas", type=int, default=None,
                   help="number of replicas, each with a pool of --capacity-tokens")
    g.add_argument("--router", choices=POLICIES, default=None,
                   help=f"routing policy (default: {RouterConfig.policy})")
    g.add_argument("--drop-events", type=non_negative_float, default=None,
                   help="share of KV events lost on their way to the prefix router (0..1; "
                        "default: 0)")
    g.add_argument("--tokens-per-second", type=rates, default=None, metavar="TOK_S[,TOK_S...]",
                   help="prefill tokens per second of a replica, or one per replica; default: the "
                        f"fleet would be {TARGET_UTILIZATION * 100:.0f}%% busy if nothing hit")
    g.add_argument("--decode-tokens-per-second", type=rates, default=None, metavar="TOK_S[,TOK_S...]",
                   help="decode tokens per second of one sequence on a replica, or one per replica "
                        "(the trace's output lengths become work); default: decode not modelled")
    g.add_argument("--prefill-weight", type=non_negative_float, default=None,
                   help=f"the prefix router's w in w x tokens to prefill + load "
                        "(default: derived from the fleet's traffic at each decision)")


FLEET_FLAGS = ("router", "drop_events", "tokens_per_second", "decode_tokens_per_second",
               "prefill_weight")
"""The fleet's own flags (default None: given or not); they need ``--replicas``."""


def flags_given(args: argparse.Namespace) -> list[str]:
    """The fleet's own flags given on the line (``--router`` ...), for an error without
    ``--replicas``."""
    return ["--" + f.replace("_", "-") for f in FLEET_FLAGS if getattr(args, f, None) is not None]


def _error(msg: str) -> int:
    print(f"hotprefix simulate: error: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace, reqs: list[TraceRequest]) -> int:
    """Run the fleet replay on parsed arguments. Returns the exit status (2: bad usage)."""
    if args.replicas < 1:
        return _error("--replicas must be >= 1")
    if args.capacity_tokens is None:
        return _error("--capacity-tokens (per replica) is required with --replicas")
    if args.sweep or getattr(args, "kv_store_capacity_tokens", None) is not None:
        return _error("--replicas does not combine with --sweep or --kv-store-capacity-tokens")
    if args.policy is not None and args.policy not in EVICTION_POLICIES:
        return _error(f"--replicas replays an engine eviction policy: one of "
                      f"{', '.join(sorted(EVICTION_POLICIES))}")
    router = args.router or RouterConfig.policy
    drop = args.drop_events or 0.0
    weight = args.prefill_weight
    if not 0.0 <= drop <= 1.0:
        return _error("--drop-events must be in [0, 1]")
    cfg = RouterConfig(policy=router, prefill_weight=weight)
    for flag, value in (("--tokens-per-second", args.tokens_per_second),
                        ("--decode-tokens-per-second", args.decode_tokens_per_second)):
        if value is not None and len(value) not in (1, args.replicas):
            return _error(f"{flag}: one rate, or one per replica ({args.replicas})")
    try:
        res = replay_fleet(reqs, args.replicas, args.capacity_tokens, router, args.policy,
                           args.block_size, drop, args.tokens_per_second, cfg,
                           admission_tail_tokens=args.admission_tail_tokens,
                           decode_tokens_per_s=args.decode_tokens_per_second)
    except ValueError as e:
        return _error(str(e))
    out = res.to_json()
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{router} over {args.replicas} replicas of {args.capacity_tokens:,} tokens "
          f"({out['policy']}, block {args.block_size}): block hit ratio {out['block_hit_ratio']:.4f}, "
          f"load imbalance {out['load_imbalance']:.3f}")
    t = out["modelled_ttft_s"]
    print(f"  modelled TTFT: mean {t['mean']:.3f} s, p50 {t['p50']:.3f} s, p90 {t['p90']:.3f} s, "
          f"p99 {t['p99']:.3f} s (prefill {out['tokens_per_s']:,.0f} tok/s a replica)")
    for i, p in enumerate(out["per_replica"]):
        print(f"  replica {i}: {p['requests']:,} requests, {p['computed_tokens']:,} computed tokens, "
              f"{p['hit_tokens']:,} hit tokens")
    if drop:
        print(f"  KV events dropped: {out['events_dropped']:,} of {out['events_sent']:,}")
    return 0
