"""Prometheus metrics (``hotprefix_*``), in a registry owned by one app (no global state).

Request-level metrics (latency histograms, token counters) are updated by the server as requests
finish. Cache and queue metrics are read from the engine's ``cache_stats()`` snapshot, taken in the
engine thread just before each scrape, and exposed by a custom collector.

The signals vLLM also has are exported under vLLM's names too (``vllm:num_requests_running``...,
mapped in ``hotprefix.compat.vllm.METRICS``): each such family is a renamed copy of its hotprefix
twin made at scrape time, so the two always carry the same values.
"""

from __future__ import annotations

from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from hotprefix.compat.vllm import METRICS as VLLM_METRICS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


def public_reasons(stats: dict[str, Any]) -> dict[str, Any]:
    """``stats`` with each request's miss counted under the reason that request was told, for a
    view tenants may read: an operator-only reason (``salt``: another tenant holds these tokens)
    is not folded into one fixed reason, which would differ from what the tenant saw whenever it
    was told ``extended`` or ``diverged``, and so confirm a guessed prompt."""
    out = {k: v for k, v in stats.items() if not k.startswith("public_")}
    out["miss_tokens_by_reason"] = dict(stats.get("public_miss_tokens_by_reason") or {})
    out["requests_by_reason"] = dict(stats.get("public_requests_by_reason") or {})
    return out


TIER_COUNTERS = (
    ("hit_tokens", "Prompt tokens loaded from the KV tier into the pool (verified)."),
    ("misses", "Block lookups the KV tier could not answer."),
    ("bytes_read", "Bytes read from the KV tier."),
    ("bytes_written", "Bytes written to the KV tier."),
    ("dropped_writes", "Writes dropped because the tier's write queue was full."),
    ("corrupt", "Entries that failed verification (checksum, key, parent, tokens, layout); deleted."),
    ("bad_signature", "Entries not signed with this server's --kv-store-secret; deleted."),
    ("timeouts", "Tier calls that ran past --kv-store-timeout."),
    ("errors", "Tier calls that failed (server down, disk full, permission denied)."),
)


class _CacheCollector:
    def __init__(self) -> None:
        self.stats: dict[str, Any] = {}

    def collect(self):
        s = self.stats
        if not s:
            return
        counters = [
            ("hotprefix_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "queries_tokens"),
            ("hotprefix_prefix_cache_hits", "Prompt tokens served from the prefix cache.", "hit_tokens"),
            ("hotprefix_prefix_cache_evictions", "Cached blocks evicted to make room.", "evictions"),
            ("hotprefix_prefix_cache_written_blocks", "Blocks added to the prefix cache.", "written_blocks"),
        ]
        for name, doc, key in counters:
            yield CounterMetricFamily(name, doc, value=float(s[key]))  # a renamed key fails loudly
        miss = CounterMetricFamily("hotprefix_prefix_cache_miss_tokens",
                                   "Uncached prompt tokens, by the miss reason of their request.",
                                   labels=["reason"])
        for reason, n in sorted(s["miss_tokens_by_reason"].items()):
            miss.add_metric([reason], float(n))
        yield miss
        gauges = [
            ("hotprefix_prefix_cache_hit_rate", "Lifetime share of prompt tokens served from cache.", "hit_rate"),
            ("hotprefix_prefix_cache_hit_rate_recent", "Hit rate over the recent request window.", "hit_rate_recent"),
            ("hotprefix_kv_cache_usage_ratio", "Share of KV blocks in use by requests.", "kv_usage"),
            ("hotprefix_blocks_total", "KV blocks in the pool.", "blocks_total"),
            ("hotprefix_blocks_in_use", "KV blocks referenced by running requests.", "blocks_in_use"),
            ("hotprefix_blocks_cached", "KV blocks holding cached prefixes (findable by hash).", "blocks_cached"),
            ("hotprefix_blocks_pinned", "Cached blocks under a retention pin.", "blocks_pinned"),
            ("hotprefix_prefix_cache_evictions_per_second", "Evictions per second over the last minute.",
             "evictions_per_second"),
            ("hotprefix_num_requests_running", "Requests in the running batch.", "running"),
            ("hotprefix_num_requests_waiting", "Requests waiting for admission.", "waiting"),
        ]
        for name, doc, key in gauges:
            yield GaugeMetricFamily(name, doc, value=float(s[key]))
        for key, doc in (("bytes_cached", "Bytes of cached KV pages, by KV group."),
                         ("bytes_in_use", "Bytes of KV pages referenced by running requests, by KV group.")):
            fam = GaugeMetricFamily(f"hotprefix_kv_group_{key}", doc, labels=["group", "kind"])
            for g in s.get("kv_groups", []):
                fam.add_metric([str(g["group"]), g["kind"]], float(g[key]))
            yield fam
        hits = CounterMetricFamily("hotprefix_window_hits",
                                   "Hybrid pool: hits resumed, by the kind of hit point whose window served them.",
                                   labels=["kind"])
        for kind, n in sorted(s.get("window_hits_by_kind", {}).items()):
            hits.add_metric([kind], float(n))
        yield hits
        tiers = s["tiers"]
        for key, doc in TIER_COUNTERS:
            fam = CounterMetricFamily(f"hotprefix_kv_tier_{key}", doc, labels=["tier"])
            for name, t in sorted(tiers.items()):
                fam.add_metric([name], float(t.get(key, 0)))
            yield fam
        up = GaugeMetricFamily("hotprefix_kv_tier_up", "1 while a KV tier works, 0 while degraded.",
                               labels=["tier"])
        for name, t in sorted(tiers.items()):
            up.add_metric([name], 0.0 if t.get("status") == "degraded" else 1.0)
        yield up
        state = s["state"]
        yield CounterMetricFamily("hotprefix_state_write_failures",
                                  "Failed attempts to persist cache state (requests never fail on them).",
                                  value=float(state["write_failures"]))
        yield GaugeMetricFamily("hotprefix_state_degraded",
                                "1 while the state directory cannot be written, else 0.",
                                value=1.0 if state["status"] == "degraded" else 0.0)


class _VllmTwins:
    """vLLM's names for the families both have: at each scrape, a copy of each hotprefix twin (read
    from ``sources``) under every vLLM name of it, with vLLM's labels (``labels()``) added."""

    def __init__(self, sources: list[Any], labels: Callable[[], dict[str, str]]) -> None:
        self.sources = sources
        self.labels = labels
        self.names: dict[str, list[str]] = {}
        for vllm_name, ours in VLLM_METRICS.items():
            self.names.setdefault(ours, []).append(vllm_name)

    def collect(self):
        labels = self.labels()
        for source in self.sources:
            for fam in source.collect():
                for name in self.names.get(fam.name, ()):
                    twin = Metric(name, f"{fam.documentation} (= {fam.name})", fam.type)
                    twin.samples = [s._replace(name=name + s.name[len(fam.name):],
                                               labels={**labels, **s.labels}) for s in fam.samples]
                    yield twin


class ServerMetrics:
    """All of one server's metrics.

    Args:
        model_name: the served model's name, vLLM's ``model_name`` label on the ``vllm:*`` families
            (settable later as ``model_name``); None = no such label.
    """

    def __init__(self, model_name: str | None = None) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.ttft = Histogram("hotprefix_time_to_first_token_seconds",
                              "Seconds from arrival to the first generated token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("hotprefix_e2e_request_latency_seconds",
                             "Seconds from arrival to the last generated token.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("hotprefix_prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=r)
        self.cached_prompt_tokens = Counter("hotprefix_cached_prompt_tokens",
                                            "Prompt tokens of finished requests served from cache.",
                                            registry=r)
        self.generation_tokens = Counter("hotprefix_generation_tokens", "Generated tokens.", registry=r)
        self.requests = Counter("hotprefix_requests", "Finished requests by route and finish reason.",
                                ["route", "finish_reason"], registry=r)
        self.rejected = Counter("hotprefix_requests_rejected",
                                "Requests refused before running, by HTTP status.", ["status"], registry=r)
        self._cache = _CacheCollector()
        r.register(self._cache)
        twins = [self._cache, self.prompt_tokens, self.generation_tokens, self.ttft, self.e2e]
        r.register(_VllmTwins(twins, self._vllm_labels))

    def _vllm_labels(self) -> dict[str, str]:
        """vLLM's labels: ``model_name`` (when known) and ``engine`` (one engine: ``0``)."""
        return {"model_name": self.model_name, "engine": "0"} if self.model_name else {"engine": "0"}

    def observe_finished(self, route: str, finish_reason: str | None, num_prompt: int,
                         num_cached: int, num_generated: int, ttft_s: float | None,
                         e2e_s: float | None) -> None:
        self.requests.labels(route, finish_reason or "unknown").inc()
        self.prompt_tokens.inc(num_prompt)
        self.cached_prompt_tokens.inc(num_cached)
        self.generation_tokens.inc(num_generated)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if e2e_s is not None:
            self.e2e.observe(e2e_s)

    def render(self, cache_stats: dict[str, Any]) -> bytes:
        self._cache.stats = cache_stats
        return generate_latest(self.registry)
