"""Trace files -> ``TraceRequest`` records, their tokens and block keys (the formats:
``TRACE_FORMATS``).

Traces that carry no tokens (Mooncake hash ids, hotprefix's request log of block keys) get
deterministic *synthetic* token ids, one distinct id per block at the head of the block: the block
of id ``x`` is ``[x, 0, 0, ...]``. The replay's real ``KVCacheManager`` then hashes them exactly as
it hashes a live request, so equal id chains give equal tokens, hence equal keys, and different
ones differ; no trace-only path runs through the cache. Knows nothing about pools, policies or
replay.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

from hotprefix.cache.hashing import BlockHasher, BlockKey, namespace_key
from hotprefix.cache.rules import cacheable_blocks

MOONCAKE_BLOCK = 512
"""Tokens behind one Mooncake hash id."""
SIM_NAMESPACE = namespace_key("hotprefix-simulate", "tokens")
"""Namespace of the simulator's keys (it has no model or tokenizer fingerprint)."""
SIM_HASH_ALGO = "fast"
"""The simulator's block hash (``hotprefix.cache.hashing``): one process, no tenants, so the
cheap 64-bit hash serves (a collision would be a miss: the pool compares tokens on every hit)."""
LOG_ID_BYTES = 7
"""Leading bytes of a logged block key that make its synthetic block id."""
TRACE_FORMATS = """\
Trace formats (JSONL, detected per line):

  * Mooncake: ``{"timestamp": ms, "input_length": n, "hash_ids": [...]}``; every id stands for a
    512-token block (chained: equal ids mean equal prefixes). Each id expands into
    ``512 / block_size`` sub-blocks; a partial last block yields only its full sub-blocks.
  * hotprefix's request log (``serve --log-requests``): ``{"block_keys": [hex...], "block_size",
    "num_prompt_tokens", "num_output_tokens", ...}``: keys only, no text.
  * Token ids: ``{"token_ids": [...]}`` (or ``prompt_token_ids``).
  Mooncake ids and logged keys become synthetic token ids (one distinct id per block); the
  replay's cache manager hashes every request's tokens as the engine does.
  Optional per-line controls: ``"cache": "none"`` (read, never write), ``"priority"``,
  ``"pin_ttl_s"`` (or ``"ttl_s"``), ``"timestamp"`` (seconds for logs, ms for Mooncake; drives
  the pool clock, hence TTLs).
"""
"""The formats ``parse_request`` reads (shown by ``hotprefix simulate --help``)."""


@dataclass
class TraceRequest:
    """One request of a trace, as the cache sees it."""

    num_prompt_tokens: int
    """Prompt length (hits never cover the last prompt token, as in the engine)."""
    num_tokens: int
    """Tokens whose full blocks are written (prompt, plus computed output for request logs)."""
    block_ids: list[int] | None = None
    """Traces without tokens: one id per ``id_tokens`` tokens, covering every full block of
    ``num_tokens`` (chained: equal ids at a position mean equal prefixes). None: ``token_ids``."""
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
    id_tokens: int = 0
    """Tokens behind one entry of ``block_ids`` (512 for Mooncake); 0 = the replay's block size."""

    def tokens(self, block_size: int) -> list[int]:
        """The request's ``num_tokens`` token ids: its own, or synthetic ones (``synthetic_tokens``)."""
        if self.token_ids is not None:
            return self.token_ids
        return synthetic_tokens(self.block_ids or [], self.id_tokens or block_size, block_size,
                                self.num_tokens)


def synthetic_tokens(block_ids: Sequence[int], id_tokens: int, block_size: int,
                     num_tokens: int) -> list[int]:
    """Deterministic token ids for a trace that has block ids instead of tokens.

    Id ``h`` stands for ``id_tokens`` tokens, i.e. ``per = id_tokens / block_size`` blocks; its
    ``j``-th block is ``[h * per + j, 0, 0, ...]``: one distinct id at the head of each block (the
    zeros are Python's shared small int, so cached blocks cost no token objects of their own).
    Equal id chains give equal tokens and different ones differ; the real hasher chains them into
    keys as for a live request. Tokens past the last id (a partial last block) are zeros.

    Raises:
        ValueError: ``block_size`` does not divide ``id_tokens``, or the ids do not cover every full
            block of ``num_tokens``.
    """
    if id_tokens % block_size:
        raise ValueError(f"block_size must divide {id_tokens} for this trace, got {block_size}")
    per = id_tokens // block_size
    if num_tokens // block_size > len(block_ids) * per:
        raise ValueError(f"{len(block_ids)} block ids of {id_tokens} tokens do not cover the "
                         f"{num_tokens // block_size} full blocks of {num_tokens} tokens")
    n = min(-(-num_tokens // block_size), len(block_ids) * per)  # blocks that get a head id
    if per == 1:
        heads = list(block_ids[:n])
    else:
        heads = [block_ids[b // per] * per + b % per for b in range(n)]
    out = [0] * num_tokens
    out[0:n * block_size:block_size] = heads
    return out


def log_block_id(key: bytes) -> int:
    """The synthetic block id of a logged block key: its first ``LOG_ID_BYTES`` bytes. Logged keys
    are chained hashes, so only siblings (same parent) must differ there to keep keys apart."""
    return int.from_bytes(key[:LOG_ID_BYTES], "big")


def mooncake_keys(hash_ids: Sequence[int], input_length: int, block_size: int) -> list[BlockKey]:
    """Keys of the full blocks of a Mooncake request: ``512 / block_size`` per 512-token id, and
    only the full blocks of a partial last id. Equal id chains give equal keys."""
    r = TraceRequest(input_length, input_length, list(hash_ids), id_tokens=MOONCAKE_BLOCK)
    return sim_hasher(block_size).keys(r.tokens(block_size))


def parse_request(obj: dict[str, Any], block_size: int) -> TraceRequest:
    """One trace line -> TraceRequest (formats: ``TRACE_FORMATS``).

    Raises:
        ValueError: the line is in no known format, its ids do not cover its tokens, or a request
            log's block size differs.
    """
    ctl = dict(cache_write=obj.get("cache", "auto") != "none",
               priority=int(obj.get("priority", 0)),
               pin_ttl_s=float(obj.get("pin_ttl_s", obj.get("ttl_s", 0.0)) or 0.0))
    if "hash_ids" in obj:
        if MOONCAKE_BLOCK % block_size:
            raise ValueError(f"block_size must divide {MOONCAKE_BLOCK} for Mooncake traces, got {block_size}")
        n = int(obj["input_length"])
        r = TraceRequest(n, n, [int(h) for h in obj["hash_ids"]],
                         timestamp=float(obj.get("timestamp", 0)) / 1000.0, id_tokens=MOONCAKE_BLOCK, **ctl)
    elif "block_keys" in obj:
        bs = int(obj.get("block_size", block_size))
        if bs != block_size:
            raise ValueError(f"the request log was written with block_size {bs}; "
                             f"replay it with --block-size {bs}")
        n = int(obj["num_prompt_tokens"])
        total = n + max(0, int(obj.get("num_output_tokens", 0)) - 1)  # last sampled token: not computed
        ids = [log_block_id(bytes.fromhex(k)) for k in obj["block_keys"][:total // block_size]]
        r = TraceRequest(n, total, ids, timestamp=float(obj.get("timestamp", 0.0)), **ctl)
    else:
        toks = obj.get("token_ids", obj.get("prompt_token_ids"))
        if toks is None:
            raise ValueError(f"unrecognized trace line (no hash_ids, block_keys or token_ids): {sorted(obj)}")
        return TraceRequest(len(toks), len(toks), None, list(toks),
                            timestamp=float(obj.get("timestamp", 0.0)), **ctl)
    covered = len(r.block_ids or ()) * (r.id_tokens or block_size)
    if r.num_tokens // block_size > covered // block_size:
        raise ValueError(f"the line's block ids cover {covered} tokens, fewer than the full blocks "
                         f"of its {r.num_tokens} tokens")
    return r


def load_trace(path: str, block_size: int, limit: int | None = None) -> list[TraceRequest]:
    """The requests of a JSONL trace file, in order (the first ``limit`` when given)."""
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                out.append(parse_request(json.loads(line), block_size))
                if limit is not None and len(out) >= limit:
                    break
    return out


def sim_hasher(block_size: int) -> BlockHasher:
    """The hasher of every replay (the manager's) and of ``request_keys``: one namespace, one algo."""
    return BlockHasher(SIM_NAMESPACE, block_size, SIM_HASH_ALGO)


def request_keys(reqs: Sequence[TraceRequest], block_size: int) -> list[list[BlockKey]]:
    """Keys of the full blocks of every request's ``num_tokens``, hashed as the replay's manager
    hashes them (a replay given these keys skips hashing the prompts again)."""
    hasher = sim_hasher(block_size)
    return [hasher.keys(r.tokens(block_size)) for r in reqs]


def lookup_limit(r: TraceRequest, n_keys: int, block_size: int) -> int:
    """Blocks a lookup may hit: never the last prompt token (same rule as the manager)."""
    return min(n_keys, cacheable_blocks(r.num_prompt_tokens, block_size))
