"""Prefix cache statistics: lifetime and windowed hit rates, miss reasons, evictions per second.

Imports no torch.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

@dataclass
class CacheStats:
    """Counters the manager updates once per admitted request."""

    window: int = 1000
    queries_tokens: int = 0
    """Prompt tokens looked up (lifetime)."""
    hit_tokens: int = 0
    """Prompt tokens served from cache (lifetime)."""
    num_requests: int = 0
    written_blocks: int = 0
    """Blocks added to the cache by requests (cache writes)."""
    miss_tokens_by_reason: Counter = field(default_factory=Counter)
    """Uncached prompt tokens, by the miss reason of their request."""
    requests_by_reason: Counter = field(default_factory=Counter)
    public_miss_tokens_by_reason: Counter = field(default_factory=Counter)
    """``miss_tokens_by_reason`` under the reason each request was told: no operator-only reason
    (``salt``) in it, for views tenants may read (``--public-metrics``)."""
    public_requests_by_reason: Counter = field(default_factory=Counter)
    """``requests_by_reason`` under the reason each request was told."""
    miss_causes: Counter = field(default_factory=Counter)
    """Uncached prompt tokens by (reason, likely cause, block index) — what an operator acts on."""
    recent: deque = field(init=False, repr=False)
    """(queried, hit) prompt tokens of the last ``window`` requests (a deque bounded by ``window``)."""
    recent_queried_tokens: int = field(default=0, init=False)
    """Prompt tokens looked up by the requests in ``recent`` (a running sum)."""
    recent_hit_tokens: int = field(default=0, init=False)
    """Prompt tokens served from cache to the requests in ``recent`` (a running sum)."""

    def __post_init__(self) -> None:
        self.recent = deque(maxlen=self.window)

    def record(self, queried: int, hit: int, reason: str, missed_tokens: int,
               operator_reason: str | None = None) -> None:
        """One admitted request; ``reason``: the one it was told, ``operator_reason``: what only
        the operator may see instead (cross-tenant duplication), counted in the operator's view."""
        told = str(reason)  # a MissReason counts under its value
        reason = str(operator_reason or reason)
        self.queries_tokens += queried
        self.hit_tokens += hit
        self.num_requests += 1
        self.requests_by_reason[reason] += 1
        self.public_requests_by_reason[told] += 1
        if missed_tokens and told != "hit":  # after a full hit the rest was never cacheable
            self.miss_tokens_by_reason[reason] += missed_tokens
            self.public_miss_tokens_by_reason[told] += missed_tokens
        if self.recent.maxlen:
            if len(self.recent) == self.recent.maxlen:  # the oldest falls out on append
                old_queried, old_hit = self.recent[0]
                self.recent_queried_tokens -= old_queried
                self.recent_hit_tokens -= old_hit
            self.recent.append((queried, hit))
            self.recent_queried_tokens += queried
            self.recent_hit_tokens += hit

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queries_tokens if self.queries_tokens else 0.0

    @property
    def recent_hit_rate(self) -> float:
        q = self.recent_queried_tokens
        return self.recent_hit_tokens / q if q else 0.0

    def miss_breakdown(self) -> dict[str, float]:
        """Share of uncached prompt tokens by reason."""
        total = sum(self.miss_tokens_by_reason.values())
        return {k: v / total for k, v in self.miss_tokens_by_reason.most_common()} if total else {}

    def record_cause(self, reason: str, cause: str | None, block_index: int | None, tokens: int) -> None:
        reason = str(reason)
        if reason != "hit" and tokens:
            self.miss_causes[(reason, cause or "", -1 if block_index is None else block_index)] += tokens

    def top_causes(self, n: int = 5) -> list[dict]:
        """The largest causes of uncached tokens, with a one-line summary each."""
        total = sum(self.miss_tokens_by_reason.values())
        out = []
        for (reason, cause, block), tokens in self.miss_causes.most_common(n):
            out.append(cause_entry(reason, cause or None, block if block >= 0 else None, tokens,
                                   total))
        return out

    def reset(self) -> None:
        self.queries_tokens = self.hit_tokens = self.num_requests = self.written_blocks = 0
        self.miss_tokens_by_reason.clear()
        self.requests_by_reason.clear()
        self.public_miss_tokens_by_reason.clear()
        self.public_requests_by_reason.clear()
        self.miss_causes.clear()
        self.recent.clear()
        self.recent_queried_tokens = self.recent_hit_tokens = 0


def cause_entry(reason: str, cause: str | None, block: int | None, tokens: int,
                total: int) -> dict:
    """One ``top_miss_causes`` entry: ``tokens`` of ``total`` missed tokens, with its summary."""
    share = tokens / total if total else 0.0
    where = f" in block {block}" if block is not None else ""
    what = f" at a {cause.replace('_', ' ')}" if cause else ""
    return {"reason": reason, "cause": cause, "block_index": block, "tokens": tokens,
            "share": share, "summary": f"{share:.0%} of missed tokens: {reason}{what}{where}"}


def request_figures(s: CacheStats) -> dict:
    """The request-side figures of one ``CacheStats`` (lifetime, window, miss reasons and causes)."""
    return {
        "queries_tokens": s.queries_tokens,
        "hit_tokens": s.hit_tokens,
        "hit_rate": s.hit_rate,
        "hit_rate_recent": s.recent_hit_rate,
        "recent_window_requests": len(s.recent),
        "requests": s.num_requests,
        "written_blocks": s.written_blocks,
        "miss_tokens_by_reason": dict(s.miss_tokens_by_reason),
        "miss_share_by_reason": s.miss_breakdown(),
        "requests_by_reason": dict(s.requests_by_reason),
        "public_miss_tokens_by_reason": dict(s.public_miss_tokens_by_reason),
        "public_requests_by_reason": dict(s.public_requests_by_reason),
        "top_miss_causes": s.top_causes(),
    }
