"""Sampling parameters (validated) and the sampler.

Each row's logits first go through the request's own processing (``hotprefix.request.logits``: logit_bias,
penalties, the constraint mask, in that order). Then greedy when temperature is below
``MIN_TEMPERATURE`` (0 included); otherwise temperature, top-k and top-p, drawn from a per-sequence
``torch.Generator`` so a seeded request gives the same tokens whatever else is in the batch. Log
probabilities are the log-softmax of the distribution the token was drawn from (after penalties and
temperature, before top-k/top-p truncation). This module holds the greedy threshold and the default
``max_tokens`` (``DEFAULT_MAX_TOKENS``), so no caller keeps a copy of either.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import functools
import hashlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hotprefix.request.logits import RowInput, needs_processing, process
from hotprefix.request.sampling_limits import MAX_ABS_BIAS, MAX_ABS_PENALTY, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N
from hotprefix.request.structured import GrammarError, StructuredOutputsParams, structured_from_vllm
from hotprefix.compat.vllm import SAMPLING_UNSUPPORTED, drop_accepted

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
    n: int = 1
    """Sequences returned for the prompt, computed once: the sequences fork from its blocks.
    Sequence ``i`` draws from ``choice_seed(seed, i)``, so its tokens do not depend on ``n``."""
    best_of: int | None = None
    """Sequences generated (>= n; None = n); the ``n`` with the highest cumulative log
    probability are returned, best first."""
    logprobs: int | None = None
    """Log probabilities of each generated token plus this many most likely alternatives
    (0..MAX_LOGPROBS); None = none."""
    prompt_logprobs: int | None = None
    """Log probabilities of each prompt token (after the first) plus this many alternatives. The
    logits of every prompt position are needed, so the request does not read the prefix cache."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already generated (OpenAI's definition), in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was generated (OpenAI's), in [-2, 2]."""
    repetition_penalty: float = 1.0
    """vLLM's and Hugging Face's: the logit of a token in the prompt or the output is divided by
    it when positive, multiplied by it when not; > 0, 1 = off."""
    logit_bias: dict[int, float] | None = None
    """Token id -> value added to its logit, in [-100, 100] (-100 bans a token, +100 forces it)."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar (``hotprefix.request.structured``;
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
        self._validate_extras(num)

    def _validate_extras(self, num: Callable[[str, Any], None]) -> None:
        """n, best_of, log probabilities, penalties and logit_bias."""
        def integer(name: str, v: Any, lo: int, hi: int) -> None:
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise SamplingError(f"{name} must be an integer in [{lo}, {hi}], got {v!r}", name)

        integer("n", self.n, 1, MAX_N)
        if self.best_of is not None:
            integer("best_of", self.best_of, 1, MAX_N)
            if self.best_of < self.n:
                raise SamplingError(f"best_of ({self.best_of}) must be >= n ({self.n})", "best_of")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                integer(name, getattr(self, name), 0, MAX_LOGPROBS)
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            num(name, v)
            if not -MAX_ABS_PENALTY <= v <= MAX_ABS_PENALTY:  # NaN fails too
                raise SamplingError(f"{name} must be in [-2, 2], got {v}", name)
        num("repetition_penalty", self.repetition_penalty)
        if not 0 < self.repetition_penalty < math.inf:
            raise SamplingError(f"repetition_penalty must be a finite number > 0, got "
                                f"{self.repetition_penalty}", "repetition_penalty")
        if self.logit_bias is not None:
            bias = self.logit_bias
            if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
                raise SamplingError(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to "
                                    "numbers", "logit_bias")
            for tok, v in bias.items():
                if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
                    raise SamplingError(f"logit_bias keys must be token ids (integers >= 0), got "
                                        f"{tok!r}", "logit_bias")
                num("logit_bias", v)
                if not -MAX_ABS_BIAS <= v <= MAX_ABS_BIAS:
                    raise SamplingError(f"logit_bias values must be in [-100, 100], got {v} for "
                                        f"token {tok}", "logit_bias")

    @property
    def num_sequences(self) -> int:
        """Sequences to generate: ``best_of`` if set, else ``n``."""
        return self.best_of or self.n

    @property
    def needs_logprob(self) -> bool:
        """Whether each drawn token's log probability is needed (asked for, or to pick best_of)."""
        return self.logprobs is not None or self.num_sequences > self.n

    @property
    def greedy(self) -> bool:
        """Temperatures this small are greedy: dividing logits by them overflows."""
        return self.temperature < MIN_TEMPERATURE


_FIELDS = frozenset(f.name for f in fields(SamplingParams))


def _with_vllm_fields(init):
    """``SamplingParams(...)`` also takes vLLM's fields that hotprefix lacks (``n``,
    ``presence_penalty``...) when their value asks for nothing more (``n=1``); any other value is a
    SamplingError naming the field and what to use instead (``hotprefix.compat.vllm``)."""
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


def choice_seed(seed: int, index: int) -> int:
    """The seed of sequence ``index`` of a request seeded ``seed``: the seed itself for sequence
    0 (so ``n=1`` and the first of ``n=4`` agree), a hash of both for the others."""
    if index == 0:
        return seed % 2**64
    digest = hashlib.sha256(f"hotprefix/choice-seed\0{seed}\0{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def make_generator(params: SamplingParams, index: int = 0) -> torch.Generator | None:
    """The random stream of sequence ``index`` of a request (None when greedy)."""
    if params.greedy:
        return None
    g = torch.Generator()
    if params.seed is not None:
        g.manual_seed(choice_seed(params.seed, index))
    else:
        g.seed()
    return g


@dataclass
class Sampled:
    """One drawn token and, when the request needs them, its log probabilities."""

    token: int
    logprob: float | None = None
    """log-softmax of the token under the distribution it was drawn from."""
    rank: int | None = None
    """1 + the number of tokens more likely than it."""
    top: list[tuple[int, float]] | None = None
    """The ``logprobs`` most likely tokens with their log probabilities, most likely first."""


def log_probs(dist: torch.Tensor, token: int, k: int | None) -> tuple[float, int, list[tuple[int, float]]]:
    """(logprob of ``token``, its rank, the ``k`` most likely (id, logprob)) under ``dist`` (logits)."""
    lsm = torch.log_softmax(dist.to(torch.float32), dim=-1)
    lp = lsm[token]
    rank = int((lsm > lp).sum()) + 1
    top: list[tuple[int, float]] = []
    if k:
        vals, ids = torch.topk(lsm, k)
        top = [(int(i), float(v)) for i, v in zip(ids.tolist(), vals.tolist())]
    return float(lp), rank, top


def _draw(row: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    """A token from temperature-scaled logits ``row`` under top-k and top-p."""
    if p.top_k > 0 and p.top_k < row.shape[0]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_p, idx = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < p.top_p
        keep[0] = True
        probs = torch.zeros_like(probs).scatter_(0, idx[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=generator).item())


def sample(logits: torch.Tensor, rows: Sequence[RowInput],
           argmax: Callable[[torch.Tensor], list[int]] | None = None) -> list[Sampled]:
    """One token per row of ``logits`` ([rows, vocab], float32), each row processed with its own
    request's parameters and tokens only (``hotprefix.request.logits.process``: never another row's).

    Args:
        rows: per row, the sequence's parameters, random stream and tokens so far.
        argmax: each row's argmax (the model's kernel; by default torch's), taken when greedy.
    """
    argmax = argmax or (lambda t: t.argmax(dim=-1).tolist())
    plain = [i for i, r in enumerate(rows) if r.params.greedy and not needs_processing(r)]
    greedy = dict(zip(plain, argmax(logits[plain]))) if plain else {}
    out = []
    for i, r in enumerate(rows):
        p = r.params
        if i in greedy and not p.needs_logprob:
            out.append(Sampled(int(greedy[i])))
            continue
        dist = logits[i].to("cpu", torch.float32)
        if needs_processing(r):
            dist = process(dist, r)
        if p.greedy:
            tok = int(greedy[i]) if i in greedy else int(argmax(dist.unsqueeze(0).contiguous())[0])
        else:
            dist = dist / p.temperature
            tok = _draw(dist, p, r.generator)
        if not p.needs_logprob:
            out.append(Sampled(tok))
            continue
        lp, rank, top = log_probs(dist, tok, p.logprobs)
        out.append(Sampled(tok, lp, rank, top))
    return out
