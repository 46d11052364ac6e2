"""Eviction policies on the Mooncake conversation trace, plus a scan test (issue 6).

Prints, in one run:
  * block hit ratio at 1M, 3M and 8M tokens of KV capacity for LRU, every other registered policy,
    Belady's MIN and the infinite-cache ceiling, all replayed through the real cache code
    (``hotprefix.simulate.replay``: KVCacheManager + BlockPool + the registered policy);
  * the default policy against LRU at 12 more capacities from 0.5M to 60M tokens (never below?);
  * a synthetic mix: a shared 2k-token system prompt, then a burst of single-use 30k-token
    documents, then the system prompt again: does it still hit?
  * (with ``--sweep``) the miss-ratio curve, written to benchmarks/results/eviction_mrc.{png,json}.

Default granularity is ``--block-size 512`` (one Mooncake hash id = one block; 30x faster than 16).
The engine's 16-token blocks give nearly the same ratios (LRU at 3M: 0.1420 at 16 vs 0.1470 at
512; a 16-token replay can evict the tail sub-blocks of a 512-token block alone, and a partial
last block contributes its full sub-blocks); ``--block-size 16`` runs the table at 16 (slow:
about 2 minutes per policy and capacity).

    .venv/bin/python benchmarks/bench_eviction.py [--sweep] [--block-size 512]
"""

from __future__ import annotations

import json
import os
import sys
import time

import common
from hotprefix import simulate as sim
from hotprefix.simulate import TraceRequest

CAPS = (1_000_000, 3_000_000, 8_000_000)
DENSE = (500_000, 2_000_000, 5_000_000, 11_000_000, 14_000_000, 17_000_000, 20_000_000, 23_000_000,
         26_000_000, 35_000_000, 48_000_000, 60_000_000)


def scan_mix(block_size: int = 16, warm: int = 20, docs: int = 40, doc_tokens: int = 30_000,
             sys_tokens: int = 2048) -> list[TraceRequest]:
    """A 2k-token system prompt (+ a short question) used ``warm`` times, then ``docs`` single-use
    30k-token documents, then the system prompt once more (token ids, hashed by the manager)."""
    sysp = list(range(1, sys_tokens + 1))
    nid = 100_000
    reqs = []

    def fresh(n: int) -> list[int]:
        nonlocal nid
        nid += n
        return list(range(nid - n, nid))

    for _ in range(warm):
        toks = sysp + fresh(40)
        reqs.append(TraceRequest(len(toks), len(toks), None, toks))
    for _ in range(docs):
        toks = fresh(doc_tokens)
        reqs.append(TraceRequest(len(toks), len(toks), None, toks))
    toks = sysp + fresh(40)
    reqs.append(TraceRequest(len(toks), len(toks), None, toks))
    return reqs


def main(argv: list[str] | None = None) -> int:
    ap = common.trace_parser(__doc__)
    ap.add_argument("--block-size", type=int, default=512)
    ap.add_argument("--sweep", action="store_true", help="also write the miss-ratio curve")
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    bs = args.block_size
    reqs = sim.load_trace(args.trace, bs)
    keys = sim.request_keys(reqs, bs)
    n_blocks = sum(r.num_prompt_tokens // bs for r in reqs)
    print(f"Mooncake conversation trace: {len(reqs):,} requests, {n_blocks:,} full {bs}-token blocks; "
          f"default policy: {sim.default_policy()}")
    policies = ["lru"] + sorted(p for p in sim.POLICIES if p != "lru") + ["min"]
    table: dict[str, list[float]] = {}
    secs: dict[str, float] = {}
    header = f"{'policy':10s}" + "".join(f"{c // 1_000_000:>9d}M" for c in CAPS)
    print("\nblock hit ratio by KV capacity (tokens)")
    print(header)
    for name in policies:
        t0 = time.perf_counter()
        table[name] = [sim.replay(reqs, c, name, bs, keys=keys).block_hit_ratio for c in CAPS]
        secs[name] = time.perf_counter() - t0
        print(f"{name:10s}" + "".join(f"{x:10.4f}" for x in table[name]) + f"   ({secs[name]:.1f}s)",
              flush=True)
    ceil = sim.ceiling(reqs, bs, keys)
    table["ceiling"] = [ceil.block_hit_ratio] * len(CAPS)
    print(f"{'ceiling':10s}" + "".join(f"{x:10.4f}" for x in table["ceiling"])
          + f"   (needs {ceil.capacity_tokens / 1e6:.1f}M tokens)")
    dflt = sim.default_policy()
    beats = all(d >= l for d, l in zip(table[dflt], table["lru"]))
    print(f"\ndefault ({dflt}) >= LRU at 1M/3M/8M: {beats}; at 3M: {table[dflt][1]:.4f} "
          f"(target 0.25; LRU {table['lru'][1]:.4f}, MIN {table['min'][1]:.4f})")
    print(f"default - LRU at {len(DENSE)} more capacities (M tokens):")
    dense = {}
    for c in DENSE:
        d, l = (sim.replay(reqs, c, p, bs, keys=keys).block_hit_ratio for p in (dflt, "lru"))
        dense[c] = (d, l)
        print(f"  {c / 1e6:5.1f}M  {dflt} {d:.5f}  lru {l:.5f}  margin {d - l:+.5f}", flush=True)
    beats_dense = beats and all(d >= l for d, l in dense.values())
    print(f"default >= LRU at all {len(CAPS) + len(DENSE)} capacities: {beats_dense}")

    print("\nscan mix (16-token blocks, 256k-token pool): 2k-token system prompt x20, then 40 "
          "single-use 30k-token documents, then the system prompt again")
    mix = scan_mix()
    scan: dict[str, dict[str, int]] = {}
    for name in ["lru"] + sorted(p for p in sim.POLICIES if p != "lru"):
        r = sim.replay(mix, 256 * 1024, name, 16, keep_per_request=True)
        last = r.per_request_hits[-1] * 16
        scan[name] = {"system_prompt_tokens_hit": last, "system_prompt_tokens": 2048}
        print(f"  {name:10s} system prompt tokens hit afterwards: {last:5d} / 2048 "
              f"({'kept' if last == 2048 else 'EVICTED'})")

    os.makedirs(args.out, exist_ok=True)
    out = {"trace": os.path.basename(args.trace), "block_size": bs, "capacities_tokens": list(CAPS),
           "block_hit_ratio": {k: [round(x, 6) for x in v] for k, v in table.items()},
           "seconds": {k: round(v, 1) for k, v in secs.items()}, "default_policy": dflt,
           "default_beats_lru_everywhere": beats_dense,
           "dense_default_vs_lru": {str(c): [round(d, 6), round(l, 6)] for c, (d, l) in dense.items()},
           "scan_mix": scan}
    if args.sweep:
        print("\nmiss-ratio curve (block hit ratio by capacity):")
        mrc = sim.sweep(reqs, bs, sorted({"lru", dflt}), points=12)
        mrc["bytes_per_token"] = 46080
        mrc["advice"] = {}
        target = 0.9 * mrc["ceiling"]
        for name, ys in mrc["policies"].items():
            c = sim.smallest_capacity(mrc["capacities_tokens"], ys, target)
            mrc["advice"][name] = {"capacity_tokens": c,
                                   "kv_cache_memory_bytes": c * 46080 if c else None}
            if c:
                print(f"  90% of the ceiling with {name}: {c / 1e6:.1f}M tokens = "
                      f"{c * 46080 / 2**30:.0f} GiB of fp32 KV for SmolLM2-135M")
        with open(os.path.join(args.out, "eviction_mrc.json"), "w") as f:
            json.dump(mrc, f, indent=1)
        sim.plot_mrc(mrc, os.path.join(args.out, "eviction_mrc.png"),
                     f"Mooncake conversation trace ({bs}-token blocks)")
        out["mrc"] = "eviction_mrc.json"
        print(f"  wrote {os.path.relpath(os.path.join(args.out, 'eviction_mrc.png'))}")
    with open(os.path.join(args.out, "eviction.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(f"\nwrote {os.path.relpath(os.path.join(args.out, 'eviction.json'))}; total {time.perf_counter() - t_start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
