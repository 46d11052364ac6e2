"""The per-request cache report: how much of the prompt came from cache and, if not all, why not.

This is the one place the miss reasons are defined and documented (the README's table repeats
them). The API returns ``CacheReport.to_json()``, whose field names are part of the API.
Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class MissReason(StrEnum):
    """Why a prompt stopped hitting (a ``str``: compares equal to, and prints as, its value)."""

    HIT = "hit"
    """Every cacheable block came from cache."""
    TOO_SHORT = "too_short"
    """The prompt is shorter than one block plus the token that is always computed."""
    COLD = "cold"
    """Nothing of this prompt (beyond the chat template's fixed opening) was cached."""
    EXTENDED = "extended"
    """A cached prefix was reused; the prompt goes on past everything cached (next chat turn)."""
    DIVERGED = "diverged"
    """A readable cached prompt shares a prefix with this one, then differs inside a block."""
    EVICTED = "evicted"
    """This tenant's blocks for these tokens were cached here and evicted (or reset)."""
    NAMESPACE = "namespace"
    """This tenant cached these tokens under another model or tokenizer fingerprint."""
    NOT_ADMITTED = "not_admitted"
    """The request ended before it was scheduled (aborted, or refused by the scheduler)."""
    READ_SKIPPED = "read_skipped"
    """The request did not read the cache: it asked for what a hit cannot give (prompt log
    probabilities need the logits of every prompt position). Says nothing about what is cached."""
    WINDOW_EVICTED = "window_evicted"
    """A hybrid pool: the full-attention layers held more of this prompt, but a sliding-window
    layer's K/V before that point were evicted; the hit resumed at an earlier kept hit point."""
    SALT = "salt"
    """Operator-only: another tenant holds the same tokens. A tenant sees ``cold``/``extended``."""


@dataclass
class CacheReport:
    """One request's cache report (built at its first admission)."""

    cached_tokens: int
    """Prompt tokens served from cache."""
    computed_tokens: int
    """Prompt tokens computed by this request."""
    written_blocks: int = 0
    """Blocks this request added to the cache (grows while it runs)."""
    miss_reason: MissReason = MissReason.HIT
    miss_position: int | None = None
    """Token index where the prompt stopped matching (None on a hit)."""
    sources: dict[str, int] = field(default_factory=dict)
    """Cached tokens by where they came from: ``pool``, and each KV tier (``host``, ``disk``, ``redis``)."""
    detail: dict[str, Any] | None = field(default=None)
    """Reason-specific facts: ``block_index``, a ``note``; for ``diverged`` the matched length and,
    once the engine has decoded them, ``sent_excerpt``/``cached_excerpt``/``likely_cause``/``hint``."""

    @classmethod
    def not_admitted(cls, num_prompt_tokens: int) -> "CacheReport":
        return cls(0, num_prompt_tokens, miss_reason=MissReason.NOT_ADMITTED)

    def to_json(self) -> dict[str, Any]:
        """The report as the API returns it (stable field names)."""
        return {"cached_tokens": self.cached_tokens, "computed_tokens": self.computed_tokens,
                "written_blocks": self.written_blocks, "sources": dict(self.sources),
                "miss_reason": self.miss_reason.value,
                "miss_position": self.miss_position,
                "detail": dict(self.detail) if self.detail is not None else None}
