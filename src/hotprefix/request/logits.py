"""A request's own processing of its logits, before a token is drawn: the one place it happens.

``process(logits, row)`` applies, in this order (vLLM's):

  1. ``logit_bias``: the value of each listed token id is added to its logit;
  2. penalties: ``repetition_penalty`` over the prompt and output tokens (vLLM's and Hugging Face's
     definition: a positive logit is divided by it, a negative one multiplied), then
     ``frequency_penalty`` times each token's count in the output, then ``presence_penalty`` for
     each token present in the output (OpenAI's definitions; the prompt does not count);
  3. the row's ``mask`` hook (structured outputs: the tokens a grammar forbids become -inf).

Temperature comes after, in the sampler (``hotprefix.request.sampling.sample``). Everything here reads one
row's logits, parameters and tokens only, never another row's: a request's tokens do not depend on
what else is in its batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class RowInput:
    """What the sampler knows about one row: the sequence's parameters, stream and tokens."""

    params: Any
    """The sequence's ``hotprefix.request.sampling.SamplingParams`` (not imported: it imports this module)."""
    generator: torch.Generator | None
    token_ids: Sequence[int]
    """The prompt followed by the tokens generated so far."""
    num_prompt_tokens: int
    mask: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Structured outputs' hook: takes the row's logits (after bias and penalties) and returns them
    with the tokens it forbids set to -inf (in place or a new tensor)."""


def needs_processing(row: RowInput) -> bool:
    """Whether ``process`` would change the row (otherwise the raw logits are used as they are)."""
    p = row.params
    return bool(p.logit_bias) or p.presence_penalty != 0 or p.frequency_penalty != 0 \
        or p.repetition_penalty != 1 or row.mask is not None


def apply_logit_bias(logits: torch.Tensor, bias: dict[int, float]) -> torch.Tensor:
    """``logits[id] += value`` for each listed id (ids past the vocabulary are refused earlier)."""
    ids = torch.tensor(list(bias.keys()), dtype=torch.long)
    vals = torch.tensor(list(bias.values()), dtype=logits.dtype)
    return logits.index_add(0, ids, vals)


def apply_penalties(logits: torch.Tensor, token_ids: Sequence[int], num_prompt_tokens: int,
                    presence: float, frequency: float, repetition: float) -> torch.Tensor:
    """Repetition (prompt + output), then frequency and presence (output) penalties on one row."""
    vocab = logits.shape[0]
    out_ids = torch.tensor(list(token_ids[num_prompt_tokens:]), dtype=torch.long)
    counts = torch.bincount(out_ids, minlength=vocab)[:vocab].to(logits.dtype)
    if repetition != 1.0:
        seen = counts > 0
        if num_prompt_tokens:
            seen[torch.tensor(list(token_ids[:num_prompt_tokens]), dtype=torch.long)] = True
        penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, penalized, logits)
    if frequency != 0.0:
        logits = logits - frequency * counts
    if presence != 0.0:
        logits = logits - presence * (counts > 0).to(logits.dtype)
    return logits


def process(logits: torch.Tensor, row: RowInput) -> torch.Tensor:
    """The row's logits (float32, [vocab]) after its bias, penalties and mask; a new tensor."""
    p = row.params
    given = logits
    if p.logit_bias:
        logits = apply_logit_bias(logits, p.logit_bias)
    if p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1:
        logits = apply_penalties(logits, row.token_ids, row.num_prompt_tokens, p.presence_penalty,
                                 p.frequency_penalty, p.repetition_penalty)
    if row.mask is not None:
        logits = row.mask(logits.clone() if logits is given else logits)
    return logits
