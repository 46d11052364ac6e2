"""A request's life in the engine: tokens, progress, timings, and how it ended.

Knows nothing about HTTP or tensors beyond its own sampling generator.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hotprefix.cache.manager import CacheRequest
from hotprefix.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False)
class Request(CacheRequest):
    """One generation request. ``token_ids`` holds the prompt followed by the output so far."""

    params: SamplingParams = field(default_factory=SamplingParams)
    generator: torch.Generator | None = None
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    """Tokens whose K/V are in the pool (from cache or computed)."""
    num_cached_tokens: int = -1
    """Prompt tokens served from the prefix cache at first admission (-1 = not admitted yet)."""
    num_preemptions: int = 0
    num_skips: int = 0
    """Times cache-aware ordering passed this request over (fairness bound)."""
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    """"stop" (EOS, stop token or string), "length" (max_tokens / model length), "abort"."""
    error: str | None = None
    user_data: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time
