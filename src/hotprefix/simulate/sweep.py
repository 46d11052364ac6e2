"""The miss-ratio curve: hit ratio against pool capacity, one line per policy plus MIN and the
ceiling.

Capacities run geometrically from the largest request up to the ceiling's footprint. LRU takes one
pass of stack distances when the trace has no retention controls (checked against one replay at
the middle capacity); every other policy is replayed at each capacity. Knows nothing about
plotting, model sizes or the command line.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from hotprefix.simulate.replay import ceiling, replay
from hotprefix.simulate.stack_distance import hits_at, lru_stack_hits
from hotprefix.simulate.traces import TraceRequest, request_keys


def _capacities(reqs: Sequence[TraceRequest], block_size: int, ceiling_tokens: int,
                points: int) -> list[int]:
    biggest = max((r.num_tokens for r in reqs), default=block_size)
    lo = max(biggest, 64 * block_size)
    hi = max(ceiling_tokens, lo * 2)
    out = []
    for i in range(points):
        c = lo * (hi / lo) ** (i / (points - 1))
        out.append(max(block_size, int(c) // block_size * block_size))
    return sorted(set(out))


def sweep(reqs: Sequence[TraceRequest], block_size: int, policies: Sequence[str],
          points: int = 12, capacities: Sequence[int] | None = None,
          admission_tail_tokens: int | None = None,
          log: Callable[..., Any] = print) -> dict[str, Any]:
    """Hit ratios at capacities from the largest request up to the ceiling, for each policy,
    MIN and the ceiling. LRU uses one pass of stack distances when the trace allows it.

    Returns:
        a JSON-safe dict: ``capacities_tokens``, ``policies`` (block hit ratios per policy, ``min``
        included), ``token_hit_ratio``, ``ceiling``, ``method`` and, for LRU, ``stack_check``.
    """
    keys = request_keys(reqs, block_size)
    ceil = ceiling(reqs, block_size, keys)
    caps = list(capacities) if capacities else _capacities(reqs, block_size, ceil.capacity_tokens, points)
    simple = admission_tail_tokens is None and all(
        r.cache_write and not r.priority and not r.pin_ttl_s for r in reqs)
    out: dict[str, Any] = {"block_size": block_size, "capacities_tokens": caps,
                           "ceiling": round(ceil.block_hit_ratio, 6),
                           "ceiling_capacity_tokens": ceil.capacity_tokens, "policies": {},
                           "token_hit_ratio": {}, "method": {}}
    for name in list(policies) + ["min"]:
        t0 = time.perf_counter()
        if name == "lru" and simple:
            hist = lru_stack_hits(reqs, block_size, keys)
            ratios = [hits_at(hist, c // block_size) / max(1, ceil.prompt_blocks) for c in caps]
            out["method"][name] = "stack-distance (one pass)"
            mid = len(caps) // 2
            check = replay(reqs, caps[mid], "lru", block_size, keys=keys)
            out["stack_check"] = {"capacity_tokens": caps[mid], "stack": round(ratios[mid], 6),
                                  "replay": round(check.block_hit_ratio, 6)}
            # hits are whole blocks: the token ratio differs from the block ratio only by rounding
            out["token_hit_ratio"][name] = [round(x * ceil.prompt_blocks * block_size
                                                  / max(1, ceil.prompt_tokens), 6) for x in ratios]
        else:
            rs = [replay(reqs, c, name, block_size, admission_tail_tokens, keys=keys) for c in caps]
            ratios = [x.block_hit_ratio for x in rs]
            out["method"][name] = "replay"
            out["token_hit_ratio"][name] = [round(x.token_hit_ratio, 6) for x in rs]
        out["policies"][name] = [round(x, 6) for x in ratios]
        log(f"  {name:8s} " + " ".join(f"{x:.3f}" for x in ratios) + f"  ({time.perf_counter() - t0:.1f}s)")
    return out
