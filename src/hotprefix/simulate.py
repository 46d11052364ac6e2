"""``hotprefix simulate``: replay a request trace through the real prefix cache.

Each request of the trace goes, one at a time, through the same ``KVCacheManager`` / ``BlockPool``
/ eviction policy the engine uses (lookup -> allocate -> commit -> free), at a given pool
capacity, and the replay reports block and token hit ratios, evictions and the requests that hit
nothing. Two bounds come with it: Belady's MIN (``--policy min``: an offline policy that is given
each key's next use; parents are always needed no later than their children, ties go to the
deepest block) and the infinite-cache ceiling. ``--sweep`` draws the miss-ratio curve (hit ratio vs
capacity, one line per policy plus MIN and the ceiling) and prints the smallest ``kv_cache_memory``
that reaches a share of the ceiling.

Trace formats (JSONL, detected per line):
  * Mooncake: ``{"timestamp": ms, "input_length": n, "hash_ids": [...]}``; every id stands for a
    512-token block (chained: equal ids mean equal prefixes). Each id expands into
    ``512 / block_size`` sub-block keys; a partial last block yields only its full sub-blocks.
  * hotprefix's request log (``serve --log-requests``): ``{"block_keys": [hex...], "block_size",
    "num_prompt_tokens", "num_output_tokens", ...}``: keys only, no text.
  * Token ids: ``{"token_ids": [...]}`` (or ``prompt_token_ids``); hashed by the manager itself.
  Optional per-line controls: ``"cache": "none"`` (read, never write), ``"priority"``,
  ``"pin_ttl_s"`` (or ``"ttl_s"``), ``"timestamp"`` (seconds for logs, ms for Mooncake; drives
  the pool clock, hence TTLs).

Knows nothing about models or tensors (bytes per token for the sizing advice are read from GGUF
metadata only, on demand).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

from hotprefix.cache.block_pool import BlockPool, KVBlock
from hotprefix.cache.eviction import POLICIES, EvictionPolicy, make_policy
from hotprefix.cache.hashing import BlockHasher, BlockKey, namespace_key
from hotprefix.cache.ledger import ContentLedger
from hotprefix.cache.manager import CacheRequest, KVCacheManager
from hotprefix.config import CacheConfig

MOONCAKE_BLOCK = 512
SIM_NAMESPACE = namespace_key("hotprefix-simulate", "tokens")
INF = 1 << 62


@dataclass
class TraceRequest:
    """One request of a trace, as the cache sees it."""

    num_prompt_tokens: int
    """Prompt length (hits never cover the last prompt token, as in the engine)."""
    num_tokens: int
    """Tokens whose full blocks are written (prompt, plus computed output for request logs)."""
    block_keys: list[BlockKey] | None = None
    """Keys of the full blocks of ``num_tokens`` (None: hash ``token_ids``)."""
    token_ids: list[int] | None = None
    """Token ids, for traces that come as tokens."""
    timestamp: float = 0.0
    """Seconds; the pool clock during this request (pins and TTLs)."""
    cache_write: bool = True
    """False = ``cache: "none"``: read from the cache but write nothing."""
    priority: int = 0
    """Retention priority of the blocks it writes."""
    pin_ttl_s: float = 0.0
    """Pin the blocks it writes for this many seconds."""


@dataclass
class SimResult:
    """What one replay measured."""

    policy: str
    capacity_tokens: int
    block_size: int
    num_requests: int = 0
    prompt_blocks: int = 0
    hit_blocks: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0
    written_blocks: int = 0
    zero_hit_requests: int = 0
    truncated_requests: int = 0
    seconds: float = 0.0
    per_request_hits: list[int] = field(default_factory=list)

    @property
    def block_hit_ratio(self) -> float:
        return self.hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    @property
    def token_hit_ratio(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def add_request(self, r: "TraceRequest", hit_blocks: int) -> None:
        """Count one replayed request that hit its first ``hit_blocks`` blocks."""
        self.num_requests += 1
        self.prompt_blocks += r.num_prompt_tokens // self.block_size
        self.hit_blocks += hit_blocks
        self.prompt_tokens += r.num_prompt_tokens
        self.hit_tokens += hit_blocks * self.block_size
        self.zero_hit_requests += hit_blocks == 0

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy, "capacity_tokens": self.capacity_tokens,
            "block_size": self.block_size, "num_blocks": self.capacity_tokens // self.block_size,
            "block_hit_ratio": round(self.block_hit_ratio, 6),
            "token_hit_ratio": round(self.token_hit_ratio, 6),
            "requests": self.num_requests, "zero_hit_requests": self.zero_hit_requests,
            "zero_hit_request_ratio": round(self.zero_hit_requests / max(1, self.num_requests), 6),
            "prompt_blocks": self.prompt_blocks, "hit_blocks": self.hit_blocks,
            "prompt_tokens": self.prompt_tokens, "hit_tokens": self.hit_tokens,
            "evictions": self.evictions, "written_blocks": self.written_blocks,
            "truncated_requests": self.truncated_requests, "seconds": round(self.seconds, 3),
        }


# ---------------------------------------------------------------------------- trace loading
def mooncake_keys(hash_ids: Sequence[int], input_length: int, block_size: int) -> list[BlockKey]:
    """Sub-block keys of a Mooncake request: ``512 / block_size`` per 512-token id, and only the
    full sub-blocks of a partial last block. Equal ids give equal keys (ids are already chained)."""
    if MOONCAKE_BLOCK % block_size:
        raise ValueError(f"block_size must divide {MOONCAKE_BLOCK} for Mooncake traces, got {block_size}")
    per = MOONCAKE_BLOCK // block_size
    n_sub = input_length // block_size
    keys: list[BlockKey] = []
    for i, h in enumerate(hash_ids):
        k = min(per, n_sub - i * per)
        if k <= 0:
            break
        if per == 1:
            keys.append(BlockKey(str(h).encode()))
        else:
            keys.extend(BlockKey(f"{h}:{j}".encode()) for j in range(k))
    return keys


def parse_request(obj: dict[str, Any], block_size: int) -> TraceRequest:
    """One trace line -> TraceRequest (see the module docstring for the formats)."""
    ctl = dict(cache_write=obj.get("cache", "auto") != "none",
               priority=int(obj.get("priority", 0)),
               pin_ttl_s=float(obj.get("pin_ttl_s", obj.get("ttl_s", 0.0)) or 0.0))
    if "hash_ids" in obj:
        n = int(obj["input_length"])
        return TraceRequest(n, n, mooncake_keys(obj["hash_ids"], n, block_size),
                            timestamp=float(obj.get("timestamp", 0)) / 1000.0, **ctl)
    if "block_keys" in obj:
        bs = int(obj.get("block_size", block_size))
        if bs != block_size:
            raise ValueError(f"the request log was written with block_size {bs}; "
                             f"replay it with --block-size {bs}")
        n = int(obj["num_prompt_tokens"])
        total = n + max(0, int(obj.get("num_output_tokens", 0)) - 1)  # last sampled token: not computed
        keys = [BlockKey(bytes.fromhex(k)) for k in obj["block_keys"]][:total // block_size]
        return TraceRequest(n, total, keys, timestamp=float(obj.get("timestamp", 0.0)), **ctl)
    toks = obj.get("token_ids", obj.get("prompt_token_ids"))
    if toks is None:
        raise ValueError(f"unrecognized trace line (no hash_ids, block_keys or token_ids): {sorted(obj)}")
    return TraceRequest(len(toks), len(toks), None, list(toks),
                        timestamp=float(obj.get("timestamp", 0.0)), **ctl)


def load_trace(path: str, block_size: int, limit: int | None = None) -> list[TraceRequest]:
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                out.append(parse_request(json.loads(line), block_size))
                if limit is not None and len(out) >= limit:
                    break
    return out


def request_keys(reqs: Sequence[TraceRequest], block_size: int) -> list[list[BlockKey]]:
    """Block keys of every request (token traces hashed as the manager hashes them)."""
    hasher = BlockHasher(SIM_NAMESPACE, block_size, "sha256")
    return [r.block_keys if r.block_keys is not None else hasher.keys(r.token_ids or [])
            for r in reqs]


def _lookup_limit(r: TraceRequest, n_keys: int, block_size: int) -> int:
    """Blocks a lookup may hit: never the last prompt token (same rule as the manager)."""
    return min(n_keys, max(0, (r.num_prompt_tokens - 1) // block_size))


# ---------------------------------------------------------------------------- Belady's MIN
class MinPolicy(EvictionPolicy):
    """Belady's MIN over the pool's events: evict the block whose next use is furthest (never
    used again first); ties go to the deepest block. A parent is used whenever its child is, so
    its next use is never later and MIN never strands a descendant.

    Offline: ``begin(i, keys, next_use)`` must be called before request ``i`` with the request's
    keys and, for each, the index of the next request that uses it. Not in the engine's registry.
    """

    name = "min"

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self._next: dict[BlockKey, int] = {}
        self._ver = [0] * num_blocks
        self._live: list[KVBlock | None] = [None] * num_blocks
        self._num_live = 0
        self._heap: list[tuple[int, int, int, int]] = []
        self._cur: dict[BlockKey, int] = {}
        self.index: dict[BlockKey, KVBlock] = {}

    def begin(self, keys: Sequence[BlockKey], next_use: Sequence[int]) -> None:
        self._cur = dict(zip(keys, next_use))
        nxt = self._next
        for k, nu in self._cur.items():  # cached blocks this request uses but may not hit
            b = self.index.get(k)
            if b is not None and nxt.get(k) != nu:
                nxt[k] = nu
                if self._live[b.block_id] is not None:
                    self._push(b)

    def _push(self, b: KVBlock) -> None:
        v = self._ver[b.block_id] + 1
        self._ver[b.block_id] = v
        heapq.heappush(self._heap, (-self._next.get(b.key, INF), -b.depth, b.block_id, v))

    def on_cached(self, block: KVBlock, info) -> None:
        self._next[block.key] = self._cur.get(block.key, INF)

    def on_hit(self, block: KVBlock) -> None:
        self._next[block.key] = self._cur.get(block.key, INF)

    def on_free(self, block: KVBlock) -> None:
        if self._live[block.block_id] is None:
            self._live[block.block_id] = block
            self._num_live += 1
        self._push(block)

    def on_use(self, block: KVBlock) -> None:
        self._ver[block.block_id] += 1
        if self._live[block.block_id] is not None:
            self._live[block.block_id] = None
            self._num_live -= 1

    def evict(self) -> KVBlock:
        while True:
            _, _, bid, v = heapq.heappop(self._heap)
            b = self._live[bid]
            if b is not None and self._ver[bid] == v:
                break
        self.on_use(b)
        self._next.pop(b.key, None)
        return b

    def on_removed(self, block: KVBlock) -> None:
        self.on_use(block)
        self._next.pop(block.key, None)

    def __len__(self) -> int:
        return self._num_live


def next_uses(all_keys: Sequence[Sequence[BlockKey]]) -> list[list[int]]:
    """For request i and its j-th key: the index of the next request that uses that key (INF)."""
    out: list[list[int]] = [[]] * len(all_keys)
    later: dict[BlockKey, int] = {}
    for i in range(len(all_keys) - 1, -1, -1):
        ks = all_keys[i]
        out[i] = [later.get(k, INF) for k in ks]
        for k in ks:
            later[k] = i
    return out


# ---------------------------------------------------------------------------- replay
class _Clock:
    """The pool's clock during a replay: the current request's timestamp."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def default_policy() -> str:
    return CacheConfig.eviction_policy


def replay(reqs: Sequence[TraceRequest], capacity_tokens: int, policy: str | None = None,
           block_size: int = 16, admission_tail_tokens: int | None = None,
           max_pinned_fraction: float = 0.5, keep_per_request: bool = False,
           keys: Sequence[Sequence[BlockKey]] | None = None) -> SimResult:
    """Replay ``reqs`` one at a time through a real ``KVCacheManager`` of ``capacity_tokens``.

    Args:
        policy: a name in the engine's ``POLICIES``, or ``min`` (Belady); None = the engine default.
        keys: precomputed ``request_keys`` (only needed by ``min``; computed if omitted).
    Returns:
        the measured ``SimResult`` (``per_request_hits`` filled when ``keep_per_request``).
    """
    policy = policy or default_policy()
    num_blocks = capacity_tokens // block_size
    if num_blocks < 1:
        raise ValueError(f"capacity {capacity_tokens} tokens is less than one block of {block_size}")
    nu: list[list[int]] | None = None
    if policy == "min":
        if keys is None:
            keys = request_keys(reqs, block_size)
        nu = next_uses(keys)
        pol: EvictionPolicy = MinPolicy(num_blocks)
    else:
        pol = make_policy(policy, num_blocks)
    clock = _Clock()
    pool = BlockPool(num_blocks, block_size, pol, ghost_size=0,
                     max_pinned_fraction=max_pinned_fraction, clock=clock)
    if isinstance(pol, MinPolicy):
        pol.index = pool.index
    mgr = KVCacheManager(pool, BlockHasher(SIM_NAMESPACE, block_size, "sha256"), True,
                         ledger=ContentLedger(max_entries=1), admission_tail_tokens=admission_tail_tokens)
    res = SimResult(policy, capacity_tokens, block_size)
    t0 = time.perf_counter()
    bs = block_size
    for i, r in enumerate(reqs):
        clock.t = r.timestamp
        given = r.block_keys is not None
        creq = CacheRequest(str(i), r.token_ids if not given else [], r.num_prompt_tokens,
                            cache_write=r.cache_write, priority=r.priority, pin_ttl_s=r.pin_ttl_s,
                            block_keys=list(r.block_keys) if given else [], keys_given=given)
        if nu is not None:
            pol.begin(keys[i], nu[i])  # type: ignore[attr-defined,index]
        hits = mgr.lookup(creq)
        h = len(hits)
        n_tokens = r.num_tokens
        free = mgr.num_free_after(hits)
        if math.ceil(n_tokens / bs) - h > free:  # larger than the pool: write what fits
            n_tokens = (h + free) * bs
            res.truncated_requests += 1
        if not mgr.allocate(creq, n_tokens - h * bs, h * bs, hits):
            raise RuntimeError(f"request {i}: the pool refused {n_tokens} tokens")
        mgr.commit(creq, n_tokens)
        mgr.free(creq)
        res.add_request(r, h)
        if keep_per_request:
            res.per_request_hits.append(h)
    res.evictions = pool.num_evictions
    res.written_blocks = mgr.stats.written_blocks
    res.seconds = time.perf_counter() - t0
    return res


def ceiling(reqs: Sequence[TraceRequest], block_size: int,
            keys: Sequence[Sequence[BlockKey]] | None = None) -> SimResult:
    """The infinite-cache ceiling: every written block stays forever (no pool needed)."""
    keys = keys if keys is not None else request_keys(reqs, block_size)
    seen: set[BlockKey] = set()
    res = SimResult("ceiling", 0, block_size)
    t0 = time.perf_counter()
    for r, ks in zip(reqs, keys):
        lim = _lookup_limit(r, len(ks), block_size)
        h = 0
        while h < lim and ks[h] in seen:
            h += 1
        if r.cache_write:
            new = ks[h:r.num_tokens // block_size]
            res.written_blocks += sum(1 for k in new if k not in seen)
            seen.update(new)
        res.add_request(r, h)
    res.capacity_tokens = len(seen) * block_size
    res.seconds = time.perf_counter() - t0
    return res


# ---------------------------------------------------------------------------- LRU stack distances
class _Fenwick:
    def __init__(self, n: int):
        self.n = n
        self.t = [0] * (n + 1)

    def add(self, i: int, d: int) -> None:
        i += 1
        t, n = self.t, self.n
        while i <= n:
            t[i] += d
            i += i & -i

    def prefix(self, i: int) -> int:
        """Sum of positions < i."""
        s, t = 0, self.t
        while i > 0:
            s += t[i]
            i -= i & -i
        return s


def lru_stack_hits(reqs: Sequence[TraceRequest], block_size: int,
                   keys: Sequence[Sequence[BlockKey]] | None = None) -> list[int]:
    """One pass of LRU stack distances: ``hist[d]`` = prompt blocks that hit at every capacity of
    at least ``d`` blocks (the engine's LRU frees a request tail first, so a parent is always more
    recent than its child and the cached set at capacity C is the top C of one recency stack).

    Exact for capacities no smaller than the largest request and for traces without retention
    controls; ``sweep`` checks it against a full replay."""
    keys = keys if keys is not None else request_keys(reqs, block_size)
    total = sum(math.ceil(r.num_tokens / block_size) for r in reqs) + sum(len(k) for k in keys)
    fw = _Fenwick(total + 1)
    stamp: dict[BlockKey, int] = {}
    hist: dict[int, int] = {}
    phantoms: deque[int] = deque()  # empty slots left by partial blocks, reused first
    t = 0
    live = 0
    for r, ks in zip(reqs, keys):
        lim = _lookup_limit(r, len(ks), block_size)
        run = 0
        h = 0
        for j in range(lim):
            s = stamp.get(ks[j])
            if s is None:
                break
            d = live - fw.prefix(s)  # slots at least as recent as this key's
            run = max(run, d)
            hist[run] = hist.get(run, 0) + 1
            h += 1
        n_alloc = math.ceil(r.num_tokens / block_size)
        for _ in range(min(len(phantoms), n_alloc - h)):  # new blocks take the empty slots first
            fw.add(phantoms.popleft(), -1)
            live -= 1
        m = min(len(ks), r.num_tokens // block_size)
        for _ in range(n_alloc - m):  # the partial block: its slot ends up empty, its victim gone
            fw.add(t, 1)
            phantoms.append(t)
            live += 1
            t += 1
        for j in range(m - 1, -1, -1):  # freed tail first: block 0 ends up the most recent
            k = ks[j]
            s = stamp.get(k)
            if s is not None:
                fw.add(s, -1)
            else:
                live += 1
            stamp[k] = t
            fw.add(t, 1)
            t += 1
    if not hist:
        return [0]
    out = [0] * (max(hist) + 1)
    for d, c in hist.items():
        out[d] += c
    return out


def hits_at(hist: Sequence[int], capacity_blocks: int) -> int:
    return sum(hist[:capacity_blocks + 1])


# ---------------------------------------------------------------------------- sweep
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
          admission_tail_tokens: int | None = None, log=print) -> dict[str, Any]:
    """Hit ratios at capacities from the largest request up to the ceiling, for each policy,
    MIN and the ceiling. LRU uses one pass of stack distances when the trace allows it."""
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
            tok = [x for x in ratios]  # hits are whole blocks; token ratio differs only by rounding
            check = replay(reqs, caps[len(caps) // 2], "lru", block_size)
            out["stack_check"] = {"capacity_tokens": caps[len(caps) // 2],
                                  "stack": round(ratios[len(caps) // 2], 6),
                                  "replay": round(check.block_hit_ratio, 6)}
            out["token_hit_ratio"][name] = [round(x * ceil.prompt_blocks * block_size
                                                  / max(1, ceil.prompt_tokens), 6) for x in tok]
        else:
            rs = [replay(reqs, c, name, block_size, admission_tail_tokens, keys=keys) for c in caps]
            ratios = [x.block_hit_ratio for x in rs]
            out["method"][name] = "replay"
            out["token_hit_ratio"][name] = [round(x.token_hit_ratio, 6) for x in rs]
        out["policies"][name] = [round(x, 6) for x in ratios]
        log(f"  {name:8s} " + " ".join(f"{x:.3f}" for x in ratios) + f"  ({time.perf_counter() - t0:.1f}s)")
    return out


def smallest_capacity(caps: Sequence[int], ratios: Sequence[float], target: float) -> int | None:
    """Smallest capacity (tokens) whose hit ratio reaches ``target``, interpolated between points."""
    for i, (c, r) in enumerate(zip(caps, ratios)):
        if r >= target:
            if i == 0:
                return c
            c0, r0 = caps[i - 1], ratios[i - 1]
            return int(c0 + (c - c0) * (target - r0) / max(1e-12, r - r0))
    return None


def plot_mrc(result: dict[str, Any], path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    caps = [c / 1e6 for c in result["capacities_tokens"]]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for name, ys in result["policies"].items():
        style = dict(color="black", linestyle="--") if name == "min" else {}
        label = "MIN (Belady, offline)" if name == "min" else name
        ax.plot(caps, ys, marker="o", markersize=3, label=label, **style)
    ax.axhline(result["ceiling"], color="gray", linestyle=":", label="ceiling (infinite cache)")
    ax.set_xscale("log")
    ax.set_xlabel("KV pool capacity (million tokens)")
    ax.set_ylabel("block hit ratio")
    ax.set_title(title or "Miss-ratio curve")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def model_bytes_per_token(model: str | None, dtype_bytes: int) -> int:
    """KV bytes per token of a model (2 x layers x kv heads x head dim x dtype bytes), read from
    GGUF metadata or a HF config.json only (no weights are loaded)."""
    import os

    from hotprefix.model.loader import resolve_model_path

    path = resolve_model_path(model)
    if os.path.isdir(path):
        with open(os.path.join(path, "config.json")) as f:
            c = json.load(f)
        heads = c["num_attention_heads"]
        kv = c.get("num_key_value_heads", heads)
        hd = c.get("head_dim") or c["hidden_size"] // heads
        return 2 * c["num_hidden_layers"] * kv * hd * dtype_bytes
    import gguf

    reader = gguf.GGUFReader(path)

    def f(key: str, default=None):
        x = reader.fields.get(key)
        return default if x is None else x.contents()

    a = f("general.architecture")
    heads = int(f(f"{a}.attention.head_count"))
    kv = int(f(f"{a}.attention.head_count_kv", heads))
    hd = int(f(f"{a}.attention.key_length", int(f(f"{a}.embedding_length")) // heads))
    return 2 * int(f(f"{a}.block_count")) * kv * hd * dtype_bytes


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return str(n)


# ---------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hotprefix simulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="JSONL trace: Mooncake hash_ids, hotprefix request log, or token_ids")
    p.add_argument("--capacity-tokens", type=int, default=None,
                   help="KV pool capacity in tokens (required unless --sweep)")
    p.add_argument("--policy", default=None,
                   help=f"eviction policy: {', '.join(sorted(POLICIES))}, min (Belady) or ceiling; "
                        f"default: the engine's ({default_policy()}); with --sweep a comma list")
    p.add_argument("--block-size", type=int, default=CacheConfig.block_size,
                   help="tokens per block (512 replays Mooncake ids whole: much faster)")
    p.add_argument("--admission-tail-tokens", type=int, default=None,
                   help="cache the tail past this many prompt tokens only for a prefix seen before")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--sweep", action="store_true", help="miss-ratio curve: capacities up to the ceiling")
    p.add_argument("--out", default=".", help="--sweep: directory for mrc.png and mrc.json")
    p.add_argument("--points", type=int, default=12, help="--sweep: number of capacities")
    p.add_argument("--target", type=float, default=0.9,
                   help="--sweep: sizing advice for this fraction of the ceiling")
    p.add_argument("--model", default=None, help="--sweep: model whose KV bytes/token size the pool")
    p.add_argument("--dtype-bytes", type=int, default=4, help="--sweep: bytes per KV element (4 = fp32)")
    p.add_argument("--bytes-per-token", type=int, default=None,
                   help="--sweep: KV bytes per token (skips reading the model's metadata)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        reqs = load_trace(args.trace, args.block_size, args.limit)
    except (OSError, ValueError, KeyError) as e:
        print(f"hotprefix simulate: error: {e}", file=sys.stderr)
        return 2
    if not args.sweep:
        if args.capacity_tokens is None:
            print("hotprefix simulate: error: --capacity-tokens is required (or use --sweep)",
                  file=sys.stderr)
            return 2
        name = args.policy or default_policy()
        if name in ("ceiling", "inf", "infinite"):
            res = ceiling(reqs, args.block_size)
            res.policy = "ceiling"
        else:
            if name != "min" and name not in POLICIES:
                print(f"hotprefix simulate: error: unknown policy {name!r}; known: "
                      f"{', '.join(sorted(POLICIES))}, min, ceiling", file=sys.stderr)
                return 2
            res = replay(reqs, args.capacity_tokens, name, args.block_size, args.admission_tail_tokens)
        out = res.to_json()
        if name in ("ceiling", "inf", "infinite"):
            out["capacity_tokens"] = args.capacity_tokens
            out["ceiling_capacity_tokens"] = res.capacity_tokens
        if args.json:
            print(json.dumps(out))
        else:
            print(f"{out['policy']} @ {args.capacity_tokens:,} tokens (block {args.block_size}): "
                  f"block hit ratio {out['block_hit_ratio']:.4f}, token hit ratio "
                  f"{out['token_hit_ratio']:.4f}, evictions {out['evictions']:,}, "
                  f"requests with zero hits {out['zero_hit_requests']:,}/{out['requests']:,}")
        return 0

    import os

    names = [x for x in (args.policy or "").split(",") if x] or sorted({"lru", default_policy()})
    names = [n for n in names if n not in ("min", "ceiling")]
    for n in names:
        if n not in POLICIES:
            print(f"hotprefix simulate: error: unknown policy {n!r}", file=sys.stderr)
            return 2
    os.makedirs(args.out, exist_ok=True)
    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    log(f"sweep over {len(reqs):,} requests, block size {args.block_size}")
    result = sweep(reqs, args.block_size, names, args.points,
                   admission_tail_tokens=args.admission_tail_tokens, log=log)
    bpt = args.bytes_per_token
    if bpt is None:
        try:
            bpt = model_bytes_per_token(args.model, args.dtype_bytes)
        except Exception as e:  # no model installed: advice in tokens only
            log(f"(could not read the model's KV size: {e}; pass --bytes-per-token)")
    target = args.target * result["ceiling"]
    advice = {}
    for name, ys in result["policies"].items():
        c = smallest_capacity(result["capacities_tokens"], ys, target)
        advice[name] = {"capacity_tokens": c,
                        "kv_cache_memory_bytes": c * bpt if (c is not None and bpt) else None}
    result.update(bytes_per_token=bpt, target_fraction=args.target, target_hit_ratio=round(target, 6),
                  advice=advice, trace=os.path.basename(args.trace))
    with open(os.path.join(args.out, "mrc.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot_mrc(result, os.path.join(args.out, "mrc.png"),
             f"{os.path.basename(args.trace)} (block {args.block_size})")
    log(f"ceiling {result['ceiling']:.4f}; target {args.target:.0%} of it = {target:.4f}")
    for name, a in advice.items():
        if a["capacity_tokens"] is None:
            log(f"  {name:8s} does not reach the target inside the sweep")
        elif a["kv_cache_memory_bytes"]:
            log(f"  {name:8s} needs {a['capacity_tokens']:,} tokens = --kv-cache-memory "
                f"{_fmt_bytes(a['kv_cache_memory_bytes'])} ({bpt:,} bytes/token)")
        else:
            log(f"  {name:8s} needs {a['capacity_tokens']:,} tokens")
    log(f"wrote {os.path.join(args.out, 'mrc.png')} and {os.path.join(args.out, 'mrc.json')}")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
