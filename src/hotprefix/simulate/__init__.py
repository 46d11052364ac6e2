"""The trace-replay simulator behind ``hotprefix simulate``: how a prefix cache of a given size and
eviction policy would have done on a recorded workload, measured with the engine's own cache code.

What it holds, one concern a module:
  * ``traces``          trace formats (Mooncake, hotprefix request logs, token ids) -> ``TraceRequest``;
                        synthetic token ids for traces of ids, so the real cache hashes every request
  * ``replay``          one request at a time through the real ``KVCacheManager`` / ``BlockPool``;
                        ``SimResult``; the infinite-cache ``ceiling``
  * ``pool``            the replay's ``BlockPool``, never larger than the trace can fill
  * ``tier``            a simulated LRU store below the pool (``--kv-store-capacity-tokens``)
  * ``min_policy``      Belady's MIN (offline, given each key's next use) as a pool eviction policy
  * ``stack_distance``  LRU hits at every capacity in one pass (Mattson stack distances)
  * ``sweep``           the miss-ratio curve over capacities, per policy, MIN and the ceiling
  * ``sizing``/``plot`` the smallest pool that reaches a target, and the curve as a PNG
  * ``cli``             the command's arguments and output (``argtypes``: its numeric flags)

What it does not know: tensors, models and tokenizers. Every request's tokens are hashed by the
manager under a fixed simulator namespace, with the cheap ``fast`` hash; bytes per token for the
sizing advice come from ``hotprefix.model.metadata`` (GGUF or ``config.json`` metadata, no
weights, no torch). Policies other than MIN come from the engine's registry
(``hotprefix.cache.eviction.POLICIES``); the engine's real KV tiers (``hotprefix.cache.tiers``)
are not used: ``tier`` models only which blocks a store would hold.
"""

from hotprefix.cache.eviction import POLICIES
from hotprefix.model.metadata import kv_bytes_per_token as model_bytes_per_token
from hotprefix.simulate.cli import build_parser, main
from hotprefix.simulate.min_policy import INF, MinPolicy, next_uses
from hotprefix.simulate.plot import plot_mrc
from hotprefix.simulate.replay import SimResult, ceiling, default_policy, replay
from hotprefix.simulate.sizing import smallest_capacity
from hotprefix.simulate.stack_distance import hits_at, lru_stack_hits
from hotprefix.simulate.sweep import sweep
from hotprefix.simulate.tier import StoreTier
from hotprefix.simulate.traces import (MOONCAKE_BLOCK, SIM_HASH_ALGO, SIM_NAMESPACE, TraceRequest,
                                       load_trace, mooncake_keys, parse_request, request_keys,
                                       sim_hasher, synthetic_tokens)

__all__ = [
    "INF", "MOONCAKE_BLOCK", "POLICIES", "SIM_HASH_ALGO", "SIM_NAMESPACE", "MinPolicy", "SimResult",
    "StoreTier", "TraceRequest", "build_parser", "ceiling", "default_policy", "hits_at", "load_trace",
    "lru_stack_hits", "main", "model_bytes_per_token", "mooncake_keys", "next_uses", "parse_request",
    "plot_mrc", "replay", "request_keys", "sim_hasher", "smallest_capacity", "sweep",
    "synthetic_tokens",
]
