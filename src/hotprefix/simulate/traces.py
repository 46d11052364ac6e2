"""Trace files -> ``TraceRequest`` records and their block keys (the formats: ``TRACE_FORMATS``).

Knows nothing about pools, policies or replay.
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
"""Namespace of the keys of token traces (the simulator has no model or tokenizer fingerprint)."""
TRACE_FORMATS = """\
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
"""
"""The formats ``parse_request`` reads (shown by ``hotprefix simulate --help``)."""


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
    """One trace line -> TraceRequest (formats: ``TRACE_FORMATS``).

    Raises:
        ValueError: the line is in no known format, or a request log's block size differs.
    """
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
    """The requests of a JSONL trace file, in order (the first ``limit`` when given)."""
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


def lookup_limit(r: TraceRequest, n_keys: int, block_size: int) -> int:
    """Blocks a lookup may hit: never the last prompt token (same rule as the manager)."""
    return min(n_keys, cacheable_blocks(r.num_prompt_tokens, block_size))
