"""The hybrid pool against the full-KV pool at the same bytes, through the real cache code (no
model): issue 28's chat workload and the bytes a cached long prompt costs.

  * bytes: one prompt of ``--long-tokens`` cached, then every interior window block evicted: the
    pages left against the full-KV pool's for the same tokens;
  * chat: ``--sessions`` sessions x ``--turns`` turns, each session with its own
    ``--system-tokens`` system prompt, ``--user-tokens`` per user message and ``--reply-tokens``
    per reply, sessions round-robin per turn, in a pool holding ``--pool-sessions`` sessions'
    full K/V at their last turn. Each request runs as the scheduler runs it (chunks of
    ``max_num_batched_tokens``, then one decode step per reply token). Reports the hit ratio of
    turns after the first, the turns that recomputed their whole prompt, and the hits by kind.

The layer mix defaults to Gemma 3 270M's (15 of 18 layers on a 512-token window). The TTFT that
follows from these hits is in ``bench_swa_chat.py`` (real servers, the real model).

    .venv/bin/python benchmarks/bench_hybrid_pool.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import random
import time

from hotprefix.cache.block_pool import BlockPool
from hotprefix.cache.hashing import BlockHasher, namespace_key
from hotprefix.cache.kv_groups import parse_layer_mix
from hotprefix.cache.manager import CacheRequest, KVCacheManager
from hotprefix.cache.window_groups import WindowGroups
from hotprefix.config.sections import CacheConfig, SchedulerConfig


def manager(pages: int, bs: int, layout) -> KVCacheManager:
    pool = BlockPool(pages, bs, CacheConfig.eviction_policy)
    m = KVCacheManager(pool, BlockHasher(namespace_key("bench", "hybrid"), bs))
    if layout is not None and layout.hybrid:
        m.windows = WindowGroups(pool, bs, {g: grp.window for g, grp in enumerate(layout.groups) if g})
    return m


def serve(m: KVCacheManager, rid: str, prompt: list[int], reply: list[int]) -> CacheRequest:
    """A request as the scheduler runs it: prompt chunks, then one decode a token."""
    r = CacheRequest(rid, list(prompt), len(prompt))
    hits = m.lookup(r)
    done, first = len(hits) * m.block_size, True
    chunk = SchedulerConfig.max_num_batched_tokens
    while done < len(prompt):
        n = min(chunk, len(prompt) - done)
        if not m.allocate(r, n, done, hits if first else []):
            raise RuntimeError("the pool cannot hold one request")
        if first:
            m.report(r, hits)
            first = False
        done += n
        m.commit(r, done)
    for t in reply[:-1]:  # the last reply token is sampled, never fed back
        r.token_ids.append(t)
        if not m.allocate(r, 1, done):
            raise RuntimeError("the pool cannot hold one request")
        done += 1
        m.commit(r, done)
    m.free(r)
    return r


def chat(layout, args, pages: int) -> dict:
    rng = random.Random(0)
    m = manager(pages, args.block_size, layout)
    words = lambda n: [rng.randrange(1, 50000) for _ in range(n)]  # noqa: E731
    convo = [words(args.system_tokens) for _ in range(args.sessions)]
    cached = prompt = refills = 0
    per_turn = []
    for turn in range(args.turns):
        hit_turn = 0
        for s in range(args.sessions):
            convo[s] += words(args.user_tokens)
            r = serve(m, f"s{s}t{turn}", convo[s], reply := words(args.reply_tokens))
            convo[s] += reply
            if turn:
                cached += r.cache_report.cached_tokens
                prompt += r.num_prompt_tokens
                refills += r.cache_report.cached_tokens == 0
                hit_turn += r.cache_report.cached_tokens
        per_turn.append(hit_turn)
    m.pool.check_invariants()
    assert m.pool.num_in_use == 0
    out = {"hit_ratio": round(cached / max(1, prompt), 4), "full_reprefills": refills,
           "cached_tokens_per_turn": per_turn, "evictions": m.pool.num_evictions}
    if m.windows is not None:
        out["hits_by_kind"] = dict(m.windows.hits_by_kind)
        out["resumed_earlier"] = m.windows.resumed_earlier
    return out


def long_prompt(layout, args) -> dict:
    bs, n = args.block_size, args.long_tokens
    per_block = layout.num_layers // layout.page_layers
    m = manager(per_block * (n // bs + 8), bs, layout)
    serve(m, "long", [i % 50000 + 1 for i in range(n + 1)], [])
    m.pool.free(m.pool.allocate(len(m.pool.empty) + len(m.pool.low)))  # interior blocks evicted
    base = n // bs * per_block
    cached = len(m.pool.index)
    return {"tokens": n, "pages_cached": cached, "full_kv_pages": base,
            "bytes_ratio": round(cached / base, 4)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sliding-window", type=int, default=512)
    p.add_argument("--local-layers", default="15/18")
    p.add_argument("--block-size", type=int, default=CacheConfig.block_size)
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=1500)
    p.add_argument("--user-tokens", type=int, default=60)
    p.add_argument("--reply-tokens", type=int, default=32)
    p.add_argument("--pool-sessions", type=float, default=6.0)
    p.add_argument("--long-tokens", type=int, default=4096)
    p.add_argument("--json", default=None, metavar="OUT")
    args = p.parse_args()
    layout = parse_layer_mix(args.local_layers, args.sliding_window)
    full_layout = parse_layer_mix("0/1", 0)
    last = args.system_tokens + args.turns * (args.user_tokens + args.reply_tokens)
    blocks = int(args.pool_sessions * -(-last // args.block_size))
    t0 = time.perf_counter()
    res = {"layout": layout.describe(), "pool_blocks_full_kv": blocks,
           "bytes": long_prompt(layout, args),
           "full_kv": chat(full_layout, args, blocks),
           "hybrid": chat(layout, args, layout.pages_for_blocks(blocks))}
    full_hits = res["full_kv"]["hit_ratio"]
    res["hit_ratio_hybrid_over_full_kv"] = round(res["hybrid"]["hit_ratio"] / full_hits, 3) if full_hits else None
    res["seconds"] = round(time.perf_counter() - t0, 1)
    b = res["bytes"]
    print(f"window {args.sliding_window}, {args.local_layers} window layers, block {args.block_size}")
    print(f"bytes: a cached {b['tokens']}-token prompt keeps {b['pages_cached']} pages against "
          f"{b['full_kv_pages']} full-KV: {b['bytes_ratio']:.3f}x")
    print(f"chat: {args.sessions} sessions x {args.turns} turns, {args.system_tokens}-token system "
          f"prompts, pool = {args.pool_sessions} sessions' full K/V ({blocks} blocks)")
    for name in ("full_kv", "hybrid"):
        r = res[name]
        print(f"  {name:8s} hit ratio {r['hit_ratio']:.4f}, full re-prefills {r['full_reprefills']}, "
              f"cached tokens per turn {r['cached_tokens_per_turn']}")
    ratio = res["hit_ratio_hybrid_over_full_kv"]
    print(f"  hybrid / full-KV: {f'{ratio}x' if ratio else 'the full-KV pool hit nothing'}; hybrid hits by kind "
          f"{res['hybrid'].get('hits_by_kind')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
