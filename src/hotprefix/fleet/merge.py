"""Fleet-wide views from the replicas' own: ``/v1/cache/stats`` and ``/metrics``.

``merge_stats`` adds up the replicas' counters (tokens, requests, blocks, misses by reason) and
recomputes the ratios from the sums (a hit rate is never averaged); a figure that differs between
replicas and cannot be added (an eviction policy's state) is left to the per-replica views.
``merge_metrics`` joins the replicas' Prometheus texts into one, each sample labelled with its
``replica`` (sum by everything but ``replica`` for the fleet). Knows nothing about Ray or HTTP.
Imports no torch.
"""

from __future__ import annotations

from typing import Any, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hotprefix.cache.stats import cause_entry

RATIOS = ("hit_rate", "hit_rate_recent", "kv_usage", "evictions_per_second", "miss_share_by_reason",
          "top_miss_causes")
"""Figures recomputed from the merged counters instead of added."""
CONSTANTS = ("block_size", "bytes_per_token")
"""Per-replica settings: the fleet's figure is theirs when they agree (never their sum)."""
PER_REPLICA = ("eviction_policy_state",)
"""State that neither adds up nor compares: left to the per-replica views."""
TOP_CAUSES = 5
"""Entries of the merged ``top_miss_causes``."""


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _merge(views: list[Mapping[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    keys: list[str] = []
    for v in views:
        keys.extend(k for k in v if k not in keys)
    for k in keys:
        if k in RATIOS or k in PER_REPLICA:
            continue
        vals = [v[k] for v in views if k in v]
        if k in CONSTANTS:
            if all(x == vals[0] for x in vals):
                out[k] = vals[0]
            continue
        if all(_is_number(x) for x in vals):
            out[k] = sum(vals)
        elif all(isinstance(x, Mapping) for x in vals):
            out[k] = _merge(vals)
        elif all(x == vals[0] for x in vals):
            out[k] = vals[0]
    return out


def merge_stats(views: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The fleet's cache stats from each replica's (replica name -> its ``/v1/cache/stats``)."""
    vs = list(views.values())
    out = _merge(vs)
    q = out.get("queries_tokens", 0)
    if "hit_tokens" in out:
        out["hit_rate"] = out["hit_tokens"] / q if q else 0.0
    n_recent = [v.get("recent_window_requests", 0) for v in vs]
    if sum(n_recent):
        out["hit_rate_recent"] = sum(v.get("hit_rate_recent", 0.0) * n
                                     for v, n in zip(vs, n_recent)) / sum(n_recent)
    if out.get("blocks_total"):
        out["kv_usage"] = sum(v.get("kv_usage", 0.0) * v.get("blocks_total", 0)
                              for v in vs) / out["blocks_total"]
    if any("evictions_per_second" in v for v in vs):
        out["evictions_per_second"] = sum(v.get("evictions_per_second", 0.0) for v in vs)
    miss = out.get("miss_tokens_by_reason")
    if isinstance(miss, dict):
        total = sum(x for x in miss.values() if _is_number(x))
        out["miss_share_by_reason"] = {r: (x / total if total else 0.0) for r, x in miss.items()}
    causes = [c for v in vs for c in v.get("top_miss_causes") or () if isinstance(c, Mapping)]
    if any("top_miss_causes" in v for v in vs):
        out["top_miss_causes"] = _merged_causes(causes, miss if isinstance(miss, dict) else {})
    out["num_replicas"] = len(vs)
    return out


def _merged_causes(causes: list[Mapping[str, Any]], miss: Mapping[str, Any]) -> list[dict]:
    """The replicas' largest miss causes as one list: the same cause's tokens added, the shares
    taken of the fleet's missed tokens (a cause below every replica's top 5 is not counted)."""
    tokens: dict[tuple, int] = {}
    for c in causes:
        key = (c.get("reason"), c.get("cause"), c.get("block_index"))
        tokens[key] = tokens.get(key, 0) + int(c.get("tokens") or 0)
    total = sum(x for x in miss.values() if _is_number(x))
    top = sorted(tokens.items(), key=lambda kv: -kv[1])[:TOP_CAUSES]
    return [cause_entry(str(r), cause, block, n, total) for (r, cause, block), n in top]


class _Families:
    def __init__(self, families: list[Any]):
        self.families = families

    def collect(self):
        return iter(self.families)


def merge_metrics(texts: Mapping[str, str]) -> bytes:
    """One Prometheus text from each replica's (replica name -> its ``/metrics``), every sample
    labelled ``replica="NAME"``.

    Raises:
        ValueError: a replica's text does not parse.
    """
    families: dict[str, Any] = {}
    for replica, text in texts.items():
        for fam in text_string_to_metric_families(text):
            samples = [s._replace(labels={**s.labels, "replica": replica}) for s in fam.samples]
            into = families.setdefault(fam.name, fam)
            into.samples = samples if into is fam else into.samples + samples
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))  # type: ignore[arg-type]
    return generate_latest(registry)
