"""A fleet on the Mooncake conversation trace (issues 14, 31): 4 replicas of 3M tokens behind prefix
routing vs round-robin vs least-loaded, one 12M-token cache, and prefix routing with 10% of the
KV events dropped (and with none at all: the router's memory of its own decisions only), and
prefix routing over replicas that evict by LRU (against one LRU cache: how much of the gap to one
cache is the replicas' eviction policy rather than the routing).

Every replica is the engine's own cache code (``hotprefix simulate --replicas``: KVCacheManager,
BlockPool, the default eviction policy); every request is routed by ``hotprefix.router.Router``;
with prefix routing the replicas' pools publish KV events (``hotprefix.events.recorder``) that the
router's index reads after each request. Load is each replica's outstanding work in seconds
(the routing core's own cost model), worked off at a prefill speed at which the fleet would be 80%
busy with no cache hits; each request's modelled TTFT is the work ahead of it plus its own prefill.

Prints a markdown table and the targets, and writes results/fleet.json. Run from the repository
root: ``.venv/bin/python benchmarks/bench_fleet.py`` (about 18 minutes at 16-token blocks;
``--block-size 512`` replays Mooncake's ids whole in about a minute).
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from hotprefix.router import RouterConfig  # noqa: E402
from hotprefix.simulate.fleet import replay_fleet  # noqa: E402
from hotprefix.simulate.replay import default_policy, replay  # noqa: E402
from hotprefix.simulate.traces import load_trace  # noqa: E402

REPLICAS = 4
CAPACITY = 3_000_000
"""Tokens per replica."""


def main(argv: list[str] | None = None) -> int:
    ap = common.trace_parser(__doc__)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    args = ap.parse_args(argv)
    bs = args.block_size
    reqs = load_trace(args.trace, bs, args.limit)
    policy = default_policy()
    common.log(f"{len(reqs):,} requests, {bs}-token blocks, eviction policy {policy}")
    t_start = time.perf_counter()
    rows: dict[str, dict] = {}

    def fleet(name: str, router: str, drop: float = 0.0, config: RouterConfig | None = None,
              pol: str = policy) -> None:
        res = replay_fleet(reqs, REPLICAS, CAPACITY, router, pol, bs, drop_events=drop,
                           router_config=config)
        rows[name] = res.to_json()
        t = res.ttft()
        common.log(f"  {name}: {res.block_hit_ratio:.4f}, imbalance {res.load_imbalance:.3f}, "
                   f"modelled TTFT mean {t['mean']:.3f}s p90 {t['p90']:.3f}s ({res.seconds:.0f}s)")

    fleet("round_robin", "round_robin")
    fleet("least_loaded", "least_loaded")
    fleet("prefix", "prefix")
    fleet("prefix, 10% of events dropped", "prefix", 0.1)
    fleet("prefix, no events (own decisions only)", "prefix", 1.0)
    fleet("prefix, w = 1 (each request's own TTFT only)", "prefix", config=RouterConfig(prefill_weight=1.0))
    if policy != "lru":  # the replicas' eviction policy, same router
        fleet("prefix, lru replicas", "prefix", pol="lru")
    for pol in dict.fromkeys((policy, "lru")):
        one = replay(reqs, REPLICAS * CAPACITY, pol, bs)
        rows[f"one cache of {REPLICAS * CAPACITY // 10**6}M ({pol})"] = {
            "block_hit_ratio": round(one.block_hit_ratio, 6), "load_imbalance": None,
            "modelled_ttft_s": None,
            "policy": pol, "seconds": round(one.seconds, 3)}
        common.log(f"  one cache ({pol}): {one.block_hit_ratio:.4f} ({one.seconds:.0f}s)")

    single = rows[f"one cache of {REPLICAS * CAPACITY // 10**6}M ({policy})"]["block_hit_ratio"]
    rr, px = rows["round_robin"], rows["prefix"]
    drop = rows["prefix, 10% of events dropped"]
    print(f"| {REPLICAS} replicas x {CAPACITY // 10**6}M tokens ({policy}, {bs}-token blocks) "
          f"| block hit ratio | load imbalance (max/mean computed) | vs round-robin "
          f"| modelled TTFT mean / p90 s |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        imb = "" if r["load_imbalance"] is None else f"{r['load_imbalance']:.3f}"
        t = r["modelled_ttft_s"]
        ttft = "" if t is None else f"{t['mean']:.3f} / {t['p90']:.3f}"
        print(f"| {name} | {r['block_hit_ratio']:.4f} | {imb} | "
              f"{r['block_hit_ratio'] / rr['block_hit_ratio']:.2f}x | {ttft} |")
    targets = {
        "prefix >= 2x round_robin": px["block_hit_ratio"] >= 2 * rr["block_hit_ratio"],
        f"prefix >= 0.95x one cache ({policy})": px["block_hit_ratio"] >= 0.95 * single,
        "prefix load imbalance <= 1.2": px["load_imbalance"] <= 1.2,
        "10% dropped within 5% of prefix": drop["block_hit_ratio"] >= 0.95 * px["block_hit_ratio"],
        "prefix modelled mean TTFT <= round_robin's": (px["modelled_ttft_s"]["mean"]
                                                      <= rr["modelled_ttft_s"]["mean"]),
    }
    lru = rows.get("prefix, lru replicas")
    if lru is not None:
        one_lru = rows[f"one cache of {REPLICAS * CAPACITY // 10**6}M (lru)"]["block_hit_ratio"]
        targets["prefix, lru replicas >= 0.95x one cache (lru)"] = lru["block_hit_ratio"] >= 0.95 * one_lru
    print()
    print(f"prefix / one cache = {px['block_hit_ratio'] / single:.3f}; prefix / round-robin = "
          f"{px['block_hit_ratio'] / rr['block_hit_ratio']:.2f}; 10% dropped / prefix = "
          f"{drop['block_hit_ratio'] / px['block_hit_ratio']:.3f}")
    for k, ok in targets.items():
        print(f"  {'met' if ok else 'MISSED'}: {k}")
    os.makedirs(args.out, exist_ok=True)
    out = {"trace": os.path.basename(args.trace), "block_size": bs, "replicas": REPLICAS,
           "capacity_tokens": CAPACITY, "policy": policy, "requests": len(reqs), "rows": rows,
           "targets": targets, "seconds": round(time.perf_counter() - t_start, 1)}
    with open(os.path.join(args.out, "fleet.json"), "w") as f:
        json.dump(out, f, indent=1)
    common.log(f"wrote {os.path.join(args.out, 'fleet.json')} in {out['seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
