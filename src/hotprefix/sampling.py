"""Sampling parameters (validated) and the sampler.

Greedy when temperature is below ``MIN_TEMPERATURE`` (0 included); otherwise temperature, top-k and
top-p, drawn from a per-request ``torch.Generator`` so a seeded request gives the same tokens whatever
else is in the batch. This module holds the greedy threshold and the default ``max_tokens``
(``DEFAULT_MAX_TOKENS``), so no caller keeps a copy of either.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from hotprefix.structured import GrammarError, StructuredOutputsParams, structured_from_vllm
from hotprefix.vllm_compat import SAMPLING_UNSUPPORTED, drop_accepted

MIN_TEMPERATURE = 1e-5
"""Temperatures below this are greedy (dividing logits by ~0 would overflow); SamplingParams stores
them as 0.0."""
DEFAULT_MAX_TOKENS = 16
"""Most tokens generated when a request does not say (OpenAI's completions default)."""


MAX_STOP_SEQUENCES = 64
"""Most stop strings (and stop token ids) a request may give: every one is searched after each
token, in the engine thread that serves every request (OpenAI takes 4)."""
MAX_STOP_CHARS = 1000
"""Longest stop string (characters)."""


class SamplingError(ValueError):
    """A sampling parameter is out of range; the message names it."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop."""

    temperature: float = 0.0
    """0 = greedy; higher = more random. Values below ``MIN_TEMPERATURE`` are stored as 0.0 (greedy)."""
    max_tokens: int = DEFAULT_MAX_TOKENS
    """Most tokens to generate."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to top_p, in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 = all."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens."""
    stop: str | list[str] | None = None
    """Stop strings; the text ends before the first one."""
    stop_token_ids: list[int] | None = None
    """Extra token ids that end generation (EOS always does unless ignore_eos)."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks)."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar (``hotprefix.structured``;
    vLLM's field; a dict of its fields or vLLM's ``guided_decoding`` is read as one)."""

    def __post_init__(self) -> None:
        self.validate()
        if self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0

    def __setattr__(self, name: str, value: Any) -> None:
        """Fields may be changed after construction, as vLLM's can (``validate`` runs again when
        a request is added); a vLLM field hotprefix lacks is refused unless its value asks for
        nothing (``n = 1``), and any other name is an AttributeError, never silently kept."""
        if name in SAMPLING_UNSUPPORTED:
            drop_accepted({name: value}, SAMPLING_UNSUPPORTED, SamplingError)
            return
        if name in ("structured_outputs", "guided_decoding"):  # vLLM's new and old names
            name = "structured_outputs"
            try:
                value = structured_from_vllm(value)
            except GrammarError as e:
                raise SamplingError(str(e), "structured_outputs") from None
        if name not in _FIELDS:
            raise AttributeError(f"SamplingParams has no field {name!r}; its fields: {sorted(_FIELDS)}")
        object.__setattr__(self, name, value)

    @property
    def stop_list(self) -> list[str]:
        """``stop`` as a list (read when a request is added, so a later change counts)."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def validate(self) -> None:
        def num(name: str, v) -> None:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise SamplingError(f"{name} must be a number, got {v!r}", name)

        num("temperature", self.temperature)
        num("top_p", self.top_p)
        if math.isnan(self.temperature) or math.isinf(self.temperature):
            raise SamplingError(f"temperature must be a finite number, got {self.temperature}", "temperature")
        if math.isnan(self.top_p):
            raise SamplingError("top_p must be a number in (0, 1], got nan", "top_p")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
            raise SamplingError(f"max_tokens must be an integer, got {self.max_tokens!r}", "max_tokens")
        if self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be >= 1, got {self.max_tokens}", "max_tokens")
        if self.temperature < 0:
            raise SamplingError(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if not (0 < self.top_p <= 1):
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k == 0 or self.top_k < -1:
            raise SamplingError(f"top_k must be -1 (all) or >= 1, got {self.top_k!r}", "top_k")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not -(2**63) <= self.seed < 2**64):
            raise SamplingError(f"seed must be a 64-bit integer, got {self.seed!r}", "seed")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise SamplingError("stop must be a non-empty string or a list of them", "stop")
        if len(stops) > MAX_STOP_SEQUENCES or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise SamplingError(f"stop takes at most {MAX_STOP_SEQUENCES} strings of at most "
                                f"{MAX_STOP_CHARS} characters each", "stop")
        if self.stop_token_ids is not None and not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise SamplingError("stop_token_ids must be a list of non-negative integers", "stop_token_ids")
        if self.stop_token_ids is not None and len(self.stop_token_ids) > MAX_STOP_SEQUENCES:
            raise SamplingError(f"stop_token_ids takes at most {MAX_STOP_SEQUENCES} ids", "stop_token_ids")

    @property
    def greedy(self) -> bool:
        """Temperatures this small are greedy: dividing logits by them overflows."""
        return self.temperature < MIN_TEMPERATURE


_FIELDS = frozenset(f.name for f in fields(SamplingParams))


def _with_vllm_fields(init):
    """``SamplingParams(...)`` also takes vLLM's fields that hotprefix lacks (``n``,
    ``presence_penalty``...) when their value asks for nothing more (``n=1``); any other value is a
    SamplingError naming the field and what to use instead (``hotprefix.vllm_compat``)."""
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        if "guided_decoding" in kwargs:  # vLLM's name before structured_outputs
            if kwargs.get("structured_outputs") is not None:
                raise SamplingError("give structured_outputs or guided_decoding, not both",
                                    "structured_outputs")
            kwargs["structured_outputs"] = kwargs.pop("guided_decoding")
        drop_accepted(kwargs, SAMPLING_UNSUPPORTED, SamplingError)
        init(self, *args, **kwargs)
    return __init__


SamplingParams.__init__ = _with_vllm_fields(SamplingParams.__init__)  # type: ignore[method-assign]


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.greedy:
        return None
    g = torch.Generator()
    if params.seed is not None:
        g.manual_seed(params.seed % 2**64)
    else:
        g.seed()
    return g


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None],
           argmax: Callable[[torch.Tensor], list[int]] | None = None) -> list[int]:
    """One token per row of ``logits`` ([rows, vocab], float32); ``argmax``: each row's argmax
    (the model's kernel; by default torch's), taken only when a row is greedy."""
    greedy = None
    if any(p.greedy for p in params):
        greedy = argmax(logits) if argmax is not None else logits.argmax(dim=-1).tolist()
    out = []
    for i, p in enumerate(params):
        if p.greedy:
            out.append(int(greedy[i]))
            continue
        row = logits[i].to("cpu", torch.float32) / p.temperature
        if p.top_k > 0 and p.top_k < row.shape[0]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_p, idx = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < p.top_p
            keep[0] = True
            probs = torch.zeros_like(probs).scatter_(0, idx[keep], sorted_p[keep])
        out.append(int(torch.multinomial(probs, 1, generator=generators[i]).item()))
    return out
