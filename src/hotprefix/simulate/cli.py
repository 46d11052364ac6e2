"""``hotprefix simulate``: replay a request trace through the real prefix cache.

Each request of the trace goes, one at a time, through the same ``KVCacheManager`` / ``BlockPool``
/ eviction policy the engine uses (lookup -> allocate -> commit -> free), at a given pool
capacity, and the replay reports block and token hit ratios, evictions and the requests that hit
nothing. Two bounds come with it: Belady's MIN (``--policy min``: an offline policy that is given
each key's next use; parents are always needed no later than their children, ties go to the
deepest block) and the infinite-cache ceiling. ``--sweep`` draws the miss-ratio curve (hit ratio vs
capacity, one line per policy plus MIN and the ceiling) and prints the smallest ``kv_cache_memory``
that reaches a share of the ceiling. ``--kv-store-capacity-tokens`` adds a simulated store tier
below the pool (written through, serves the pool's misses it holds) and reports hits by tier.
``--replicas R --router P`` replays through R caches behind the routing core (``fleet_cli``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from hotprefix.cache.eviction import POLICIES
from hotprefix.cache.kv_groups import parse_layer_mix
from hotprefix.config.sections import CacheConfig
from hotprefix.model.metadata import KV_ELEMENT_BYTES, ModelLoadError, kv_bytes_per_token
from hotprefix.simulate import fleet_cli, traces
from hotprefix.simulate.argtypes import int_at_least, non_negative_int, positive_int
from hotprefix.simulate.plot import plot_mrc
from hotprefix.simulate.replay import ceiling, default_policy, replay
from hotprefix.simulate.sizing import format_bytes, smallest_capacity
from hotprefix.simulate.sweep import sweep

DESCRIPTION = f"{(__doc__ or '').strip()}\n\n{traces.TRACE_FORMATS}"
"""``--help`` text: what the command does and the trace formats it reads."""
CEILING_NAMES = ("ceiling", "inf", "infinite")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's arguments, on ``p`` (its own parser or a ``hotprefix`` subcommand)."""
    p.add_argument("trace", help="JSONL trace: Mooncake hash_ids, hotprefix request log, or token_ids")
    p.add_argument("--capacity-tokens", type=positive_int, default=None,
                   help="KV pool capacity in tokens (required unless --sweep)")
    p.add_argument("--policy", default=None,
                   help=f"eviction policy: {', '.join(sorted(POLICIES))}, min (Belady) or ceiling; "
                        f"default: the engine's ({default_policy()}); with --sweep a comma list")
    p.add_argument("--block-size", type=positive_int, default=CacheConfig.block_size,
                   help="tokens per block (512 replays Mooncake ids whole: much faster)")
    p.add_argument("--admission-tail-tokens", type=non_negative_int, default=None,
                   help="cache the tail past this many prompt tokens only for a prefix seen before")
    p.add_argument("--kv-store-capacity-tokens", type=positive_int, default=None,
                   help="add a simulated LRU store tier of this many tokens below the pool: every "
                        "block the pool caches is written to it, a pool miss it holds is loaded "
                        "from it; the output gives hits by tier")
    p.add_argument("--limit", type=positive_int, default=None, metavar="N",
                   help="replay only the first N requests (N >= 1)")
    p.add_argument("--sliding-window", type=positive_int, default=None, metavar="W",
                   help="a model with sliding-window layers of W keys: replay through the hybrid "
                        "pool (the engine's KV groups) and through the full-KV pool at the same "
                        "bytes, side by side (with --local-layers)")
    p.add_argument("--local-layers", default=None, metavar="LOCAL/TOTAL",
                   help="with --sliding-window: how many of the model's layers are window layers, "
                        "e.g. 15/18 (Gemma 3 270M)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--sweep", action="store_true", help="miss-ratio curve: capacities up to the ceiling")
    p.add_argument("--out", default=".", help="--sweep: directory for mrc.png and mrc.json")
    p.add_argument("--points", type=int_at_least(2), default=12,
                   help="--sweep: number of capacities (>= 2)")
    p.add_argument("--target", type=float, default=0.9,
                   help="--sweep: sizing advice for this fraction of the ceiling")
    p.add_argument("--model", default=None, help="--sweep: model whose KV bytes/token size the pool")
    p.add_argument("--kv-cache-dtype", default="bf16", choices=sorted(KV_ELEMENT_BYTES),
                   help="--sweep: the pool's KV element type, as serve's --kv-cache-dtype "
                        "(bf16: what auto gives on CPU; int8: half the bytes, plus a scale per "
                        "token and KV head)")
    p.add_argument("--dtype-bytes", type=positive_int, default=None,
                   help="--sweep: bytes per KV element, instead of --kv-cache-dtype")
    p.add_argument("--bytes-per-token", type=positive_int, default=None,
                   help="--sweep: KV bytes per token (skips reading the model's metadata)")
    fleet_cli.add_arguments(p)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hotprefix simulate", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p


def _error(msg: str) -> int:
    print(f"hotprefix simulate: error: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    """Run the command on parsed arguments. Returns the exit status (2: bad usage or trace)."""
    if args.replicas is None and (flags := fleet_cli.flags_given(args)):
        return _error(f"{', '.join(flags)} {'needs' if len(flags) == 1 else 'need'} --replicas "
                      f"(they set up a fleet replay)")
    if args.capacity_tokens is not None and args.capacity_tokens < args.block_size:
        return _error(f"--capacity-tokens must hold at least one block ({args.block_size} tokens)")
    try:
        reqs = traces.load_trace(args.trace, args.block_size, args.limit)
    except OSError as e:
        return _error(f"{args.trace}: {e.strerror or e}")
    except ValueError as e:
        return _error(str(e))
    if args.replicas is not None:
        return fleet_cli.run(args, reqs)
    if (args.sliding_window is None) != (args.local_layers is None):
        return _error("--sliding-window and --local-layers go together")
    if args.sliding_window is not None:
        if args.sweep:
            return _error("--sliding-window replays one capacity (not with --sweep)")
        return _run_hybrid(args, reqs)
    return _run_sweep(args, reqs) if args.sweep else _run_one(args, reqs)


def _run_hybrid(args: argparse.Namespace, reqs: list[traces.TraceRequest]) -> int:
    """The hybrid pool against the full-KV pool of the same bytes, one trace, one capacity."""
    if args.capacity_tokens is None:
        return _error("--capacity-tokens is required (the full-KV pool's tokens: both get its bytes)")
    try:
        layout = parse_layer_mix(args.local_layers, args.sliding_window)
    except ValueError as e:
        return _error(str(e))
    name = args.policy or default_policy()
    if name not in POLICIES:
        return _error(f"--sliding-window replays an engine policy ({', '.join(sorted(POLICIES))})")
    out = {}
    for label, lay in (("full_kv", None), ("hybrid", layout)):
        res = replay(reqs, args.capacity_tokens, name, args.block_size, args.admission_tail_tokens,
                     layout=lay)
        out[label] = res.to_json()
    out["layout"] = {"sliding_window": args.sliding_window, "local_layers": args.local_layers,
                     "page_layers": layout.page_layers, "groups": layout.describe()}
    full, hyb = out["full_kv"]["token_hit_ratio"], out["hybrid"]["token_hit_ratio"]
    out["hybrid_over_full_kv"] = round(hyb / full, 4) if full else None
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{name} @ {args.capacity_tokens:,} tokens of full K/V (block {args.block_size}), "
              f"window {args.sliding_window}, {args.local_layers} window layers:")
        for label in ("full_kv", "hybrid"):
            o = out[label]
            print(f"  {label:8s} token hit ratio {o['token_hit_ratio']:.4f}, block hit ratio "
                  f"{o['block_hit_ratio']:.4f}, requests with zero hits "
                  f"{o['zero_hit_requests']:,}/{o['requests']:,}, evictions {o['evictions']:,}")
        ratio = out["hybrid_over_full_kv"]
        print(f"  hybrid / full-KV token hit ratio: {ratio:.3f}x" if ratio else "  (full-KV hit nothing)")
    return 0


def _run_one(args: argparse.Namespace, reqs: list[traces.TraceRequest]) -> int:
    if args.capacity_tokens is None:
        return _error("--capacity-tokens is required (or use --sweep)")
    name = args.policy or default_policy()
    store = args.kv_store_capacity_tokens
    if store is not None and store < args.block_size:
        return _error(f"--kv-store-capacity-tokens must hold at least one block ({args.block_size} tokens)")
    if store is not None and name in CEILING_NAMES:
        return _error("the ceiling is an infinite pool: a store tier adds nothing to it")
    if name in CEILING_NAMES:
        res = ceiling(reqs, args.block_size)
        res.policy = "ceiling"
    elif name != "min" and name not in POLICIES:
        return _error(f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}, min, ceiling")
    else:
        res = replay(reqs, args.capacity_tokens, name, args.block_size, args.admission_tail_tokens,
                     kv_store_capacity_tokens=store)
    out = res.to_json()
    if name in CEILING_NAMES:
        out["capacity_tokens"] = args.capacity_tokens
        out["ceiling_capacity_tokens"] = res.capacity_tokens
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{out['policy']} @ {args.capacity_tokens:,} tokens (block {args.block_size}): "
              f"block hit ratio {out['block_hit_ratio']:.4f}, token hit ratio "
              f"{out['token_hit_ratio']:.4f}, evictions {out['evictions']:,}, "
              f"requests with zero hits {out['zero_hit_requests']:,}/{out['requests']:,}")
        if store is not None:
            by = out["block_hit_ratio_by_tier"]
            print(f"  + store of {store:,} tokens: block hit ratio pool {by['pool']:.4f}, "
                  f"store {by['store']:.4f}; store evictions {out['kv_store']['evictions']:,}")
    return 0


def _run_sweep(args: argparse.Namespace, reqs: list[traces.TraceRequest]) -> int:
    if args.kv_store_capacity_tokens is not None:
        return _error("--kv-store-capacity-tokens replays one capacity; it does not combine with --sweep")
    names = [x for x in (args.policy or "").split(",") if x] or sorted({"lru", default_policy()})
    names = [n for n in names if n not in ("min", "ceiling")]
    for n in names:
        if n not in POLICIES:
            return _error(f"unknown policy {n!r}")
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        return _error(f"--out {args.out}: cannot make the output directory: {e.strerror or e}")
    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    log(f"sweep over {len(reqs):,} requests, block size {args.block_size}")
    result = sweep(reqs, args.block_size, names, args.points,
                   admission_tail_tokens=args.admission_tail_tokens, log=log)
    bpt = args.bytes_per_token
    if bpt is None:
        try:
            bpt = kv_bytes_per_token(args.model, args.dtype_bytes or args.kv_cache_dtype)
        except (ModelLoadError, ImportError) as e:  # no model installed: advice in tokens only
            log(f"(could not read the model's KV size: {e}; pass --bytes-per-token)")
    target = args.target * result["ceiling"]
    advice: dict[str, dict[str, Any]] = {}
    for name, ys in result["policies"].items():
        c = smallest_capacity(result["capacities_tokens"], ys, target)
        advice[name] = {"capacity_tokens": c,
                        "kv_cache_memory_bytes": c * bpt if (c is not None and bpt) else None}
    result.update(bytes_per_token=bpt, target_fraction=args.target, target_hit_ratio=round(target, 6),
                  advice=advice, trace=os.path.basename(args.trace))
    try:
        with open(os.path.join(args.out, "mrc.json"), "w") as f:
            json.dump(result, f, indent=1)
        plot_mrc(result, os.path.join(args.out, "mrc.png"),
                 f"{os.path.basename(args.trace)} (block {args.block_size})")
    except OSError as e:
        return _error(f"--out {args.out}: cannot write the results: {e}")
    log(f"ceiling {result['ceiling']:.4f}; target {args.target:.0%} of it = {target:.4f}")
    for name, a in advice.items():
        if a["capacity_tokens"] is None:
            log(f"  {name:8s} does not reach the target inside the sweep")
        elif a["kv_cache_memory_bytes"]:
            log(f"  {name:8s} needs {a['capacity_tokens']:,} tokens = --kv-cache-memory "
                f"{format_bytes(a['kv_cache_memory_bytes'])} ({bpt:,} bytes/token)")
        else:
            log(f"  {name:8s} needs {a['capacity_tokens']:,} tokens")
    log(f"wrote {os.path.join(args.out, 'mrc.png')} and {os.path.join(args.out, 'mrc.json')}")
    if args.json:
        print(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``hotprefix simulate TRACE ...``; returns the exit status."""
    return run(build_parser().parse_args(argv))
