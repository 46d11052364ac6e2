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
import math
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
    num_output_tokens: int = 0
    """Tokens it decodes (the fleet replay's decode work), where the trace says."""

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


def _field(obj: dict[str, Any], name: str) -> Any:
    """``obj[name]``; a missing field is an error that names it."""
    if name not in obj:
        raise ValueError(f"missing field {name!r}")
    return obj[name]


def _got(v: Any) -> str:
    """A wrong value, for an error message: ``null``, ``str '100'``."""
    return "null" if v is None else f"{type(v).__name__} {repr(v)[:40]}"


def _int(v: Any, name: str, minimum: int | None = None) -> int:
    """A JSON integer (``5.0`` counts; ``true``, ``"5"``, ``5.5`` do not), at least ``minimum``."""
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"field {name!r} must be an integer, got {_got(v)}")
    if minimum is not None and v < minimum:
        raise ValueError(f"field {name!r} must be >= {minimum}, got {v}")
    return v


def _number(v: Any, name: str, minimum: float | None = None) -> float:
    """A finite JSON number (no NaN or Infinity), at least ``minimum``."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"field {name!r} must be a number, got {_got(v)}")
    if not math.isfinite(v):
        raise ValueError(f"field {name!r} must be a finite number, got {v}")
    if minimum is not None and v < minimum:
        raise ValueError(f"field {name!r} must be >= {minimum}, got {v}")
    return float(v)


def _int_list(v: Any, name: str) -> list[int]:
    if not isinstance(v, list):
        raise ValueError(f"field {name!r} must be a list of integers, got {_got(v)}")
    return [_int(x, f"{name}[{i}]") for i, x in enumerate(v)]


def _block_key(v: Any, name: str) -> bytes:
    if isinstance(v, str):
        try:
            return bytes.fromhex(v)
        except ValueError:
            pass
    raise ValueError(f"field {name!r} must be a hex string, got {_got(v)}")


def parse_request(obj: Any, block_size: int) -> TraceRequest:
    """One trace line (parsed JSON) -> TraceRequest (formats: ``TRACE_FORMATS``).

    Raises:
        ValueError: the line is not an object, is in no known format, misses a field or has one of
            the wrong type (or negative, or not finite), its ids do not cover its tokens, or a
            request log's block size differs. The message names the field.
    """
    if not isinstance(obj, dict):
        raise ValueError(f"a trace line must be a JSON object, got {_got(obj)}")
    ttl_name = "pin_ttl_s" if "pin_ttl_s" in obj else "ttl_s"
    ttl = obj.get(ttl_name)  # null: no pin
    ctl = dict(cache_write=obj.get("cache", "auto") != "none",
               priority=_int(obj.get("priority", 0), "priority"),
               pin_ttl_s=0.0 if ttl is None else _number(ttl, ttl_name, minimum=0))
    if "hash_ids" in obj:
        if MOONCAKE_BLOCK % block_size:
            raise ValueError(f"block_size must divide {MOONCAKE_BLOCK} for Mooncake traces, got {block_size}")
        n = _int(_field(obj, "input_length"), "input_length", minimum=0)
        n_out = _int(obj.get("output_length", 0), "output_length", minimum=0)
        r = TraceRequest(n, n, _int_list(obj["hash_ids"], "hash_ids"),
                         timestamp=_number(obj.get("timestamp", 0), "timestamp") / 1000.0,
                         id_tokens=MOONCAKE_BLOCK, num_output_tokens=n_out, **ctl)
    elif "block_keys" in obj:
        bs = _int(obj.get("block_size", block_size), "block_size", minimum=1)
        if bs != block_size:
            raise ValueError(f"the request log was written with block_size {bs}; "
                             f"replay it with --block-size {bs}")
        n = _int(_field(obj, "num_prompt_tokens"), "num_prompt_tokens", minimum=0)
        n_out = _int(obj.get("num_output_tokens", 0), "num_output_tokens", minimum=0)
        total = n + max(0, n_out - 1)  # last sampled token: not computed
        keys = obj["block_keys"]
        if not isinstance(keys, list):
            raise ValueError(f"field 'block_keys' must be a list of hex strings, got {_got(keys)}")
        ids = [log_block_id(_block_key(k, f"block_keys[{i}]"))
               for i, k in enumerate(keys[:total // block_size])]
        r = TraceRequest(n, total, ids, timestamp=_number(obj.get("timestamp", 0), "timestamp"),
                         num_output_tokens=n_out, **ctl)
    else:
        name = "token_ids" if "token_ids" in obj else "prompt_token_ids"
        if name not in obj:
            raise ValueError(f"unrecognized trace line (no hash_ids, block_keys or token_ids): {sorted(obj)}")
        toks = _int_list(obj[name], name)
        return TraceRequest(len(toks), len(toks), None, toks,
                            timestamp=_number(obj.get("timestamp", 0), "timestamp"), **ctl)
    covered = len(r.block_ids or ()) * (r.id_tokens or block_size)
    if r.num_tokens // block_size > covered // block_size:
        raise ValueError(f"the line's block ids cover {covered} tokens, fewer than the full blocks "
                         f"of its {r.num_tokens} tokens")
    return r


NOT_JSONL = ("hotprefix simulate reads JSONL traces, one JSON object a line (Mooncake format; "
             "see --help): CSV and gzip files are not supported")
"""Said when a trace's first line is not JSON."""


def _json_line(raw: bytes, first: bool) -> Any:
    """One line of a trace file, parsed; ValueError (``not valid JSON (...)``, plus ``NOT_JSONL``
    on the ``first`` line) otherwise."""
    try:
        return json.loads(raw.decode("utf-8").rstrip())  # no newline: an error's column is on this line
    except UnicodeDecodeError as e:
        why = f"not UTF-8 text: byte 0x{raw[e.start]:02x} at column {e.start + 1}"
    except json.JSONDecodeError as e:
        why = f"{e.msg} at column {e.colno}"
    raise ValueError(f"not valid JSON ({why})" + (f"; {NOT_JSONL}" if first else ""))


def load_trace(path: str, block_size: int, limit: int | None = None) -> list[TraceRequest]:
    """The requests of a JSONL trace file, in order (the first ``limit`` when given; 0 = none).

    Raises:
        OSError: the file cannot be read.
        ValueError: a line is bad; the message starts ``PATH:LINE:`` (1-based, blank lines
            counted) and names the problem (when the first line is not JSON: that the simulator
            reads JSONL).
    """
    out: list[TraceRequest] = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if lineno == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark
            if not raw.strip():
                continue
            try:
                out.append(parse_request(_json_line(raw, first=not out), block_size))
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: {e}") from None
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
