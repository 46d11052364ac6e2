"""A request's life in the engine: tokens, progress, timings, and how it ended.

Knows nothing about HTTP or tensors beyond its own sampling generator.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from hotprefix.cache.manager import CacheRequest
from hotprefix.request.sampling import SamplingParams
from hotprefix.compat.vllm import TokenLogprobs


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False)
class Request(CacheRequest):
    """One generated sequence. ``token_ids`` holds the prompt followed by the output so far.

    A request for ``n`` sequences is a group: its first sequence (index 0, the group's id) is
    scheduled and computes the prompt; the others wait in its ``forks`` and start, sharing its
    blocks, when it draws its first token."""

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
    index: int = 0
    """The sequence's position in its group (``n`` / ``best_of``)."""
    group_id: str = ""
    """The id of the request this sequence belongs to (the caller's id; its first sequence's)."""
    forks: list["Request"] = field(default_factory=list)
    """On a group's first sequence: the other sequences, until they fork from it."""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    """Each generated token's log probabilities, when ``params.logprobs`` asks for them."""
    cumulative_logprob: float = 0.0
    """Sum of the generated tokens' log probabilities (when ``params.needs_logprob``)."""
    prompt_logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)
    """Prompt position -> its token's log probabilities (``params.prompt_logprobs``; from 1)."""
    logits_mask: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Structured outputs: the hook the sampler applies after bias and penalties
    (``hotprefix.request.logits.RowInput.mask``)."""

    def __post_init__(self) -> None:
        if not self.group_id:
            self.group_id = self.request_id

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
