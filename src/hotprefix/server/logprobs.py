"""The OpenAI API's sampling fields beyond one plain completion: ``n``, ``best_of``, log
probabilities, penalties and ``logit_bias``. Reads them off a request body as ``SamplingParams``
fields (range errors name the parameter) and writes the engine's log probabilities in OpenAI's
shapes:

  * chat: ``choices[i].logprobs = {"content": [{token, logprob, bytes, top_logprobs: [...]}],
    "refusal": None}`` (the same per chunk when streaming, for that chunk's tokens);
  * completions: ``choices[i].logprobs = {tokens, token_logprobs, top_logprobs, text_offset}``,
    with ``echo`` the prompt's tokens first (the first of them has no log probability).

Knows the protocol and the tokenizer, not the engine's internals.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

from hotprefix.request.sampling_limits import MAX_LOGPROBS, MAX_N
from hotprefix.server import protocol as P
from hotprefix.text.tokenizer import Tokenizer
from hotprefix.compat.vllm import TokenLogprobs

MAX_COMPLETION_LOGPROBS = 5
"""Most alternatives per token in ``/v1/completions`` (OpenAI's limit; chat takes MAX_LOGPROBS)."""


def sampling_fields(body: P.CompletionRequest | P.ChatCompletionRequest) -> dict[str, Any]:
    """``SamplingParams`` keyword arguments for n, best_of, logprobs, penalties and logit_bias.

    Raises:
        APIError: a value out of range or a combination the API refuses (400, naming the parameter).
    """
    n = 1 if body.n is None else body.n
    if not 1 <= n <= MAX_N:
        raise P.APIError(400, f"n must be in [1, {MAX_N}], got {n}.", param="n")
    out: dict[str, Any] = {"n": n}
    if body.presence_penalty is not None:
        out["presence_penalty"] = body.presence_penalty
    if body.frequency_penalty is not None:
        out["frequency_penalty"] = body.frequency_penalty
    if body.repetition_penalty is not None:
        out["repetition_penalty"] = body.repetition_penalty
    if body.logit_bias:
        bias: dict[int, float] = {}
        for key, value in body.logit_bias.items():
            if not key.isdigit():  # "-1" and "1.5" are not token ids either
                raise P.APIError(400, f"logit_bias keys must be token ids, got {key!r}.",
                                 param="logit_bias")
            if not -100 <= value <= 100:
                raise P.APIError(400, f"logit_bias values must be in [-100, 100], got {value} for "
                                      f"token {key}.", param="logit_bias")
            bias[int(key)] = float(value)
        out["logit_bias"] = bias
    if isinstance(body, P.CompletionRequest):
        if body.best_of is not None:
            if not n <= body.best_of <= MAX_N:
                raise P.APIError(400, f"best_of must be in [n, {MAX_N}] (n = {n}), got "
                                      f"{body.best_of}.", param="best_of")
            if body.stream and body.best_of > n:
                raise P.APIError(400, "best_of cannot be used with stream: the best sequences are "
                                      "known only at the end.", param="best_of")
            out["best_of"] = body.best_of
        if body.logprobs is not None:
            if not 0 <= body.logprobs <= MAX_COMPLETION_LOGPROBS:
                raise P.APIError(400, f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got "
                                      f"{body.logprobs}.", param="logprobs")
            out["logprobs"] = body.logprobs
            if body.echo:
                out["prompt_logprobs"] = body.logprobs
    else:
        k = body.top_logprobs
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise P.APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {k}.",
                             param="top_logprobs")
        if k and not body.logprobs:
            raise P.APIError(400, "top_logprobs needs logprobs set to true.", param="top_logprobs")
        if body.logprobs:
            out["logprobs"] = k or 0
    return out


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (the inverse of ``bytes_to_unicode``)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenText:
    """A token's text and bytes (byte-level BPE pieces read byte for byte, so a token holding part
    of a character gives its real bytes)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.byte_level = tokenizer.byte_level
        self._bytes: dict[int, list[int]] = {}

    def text(self, token_id: int, decoded: str | None = None) -> str:
        return decoded if decoded is not None else self.tokenizer.decode([token_id],
                                                                          skip_special_tokens=False)

    def bytes(self, token_id: int, decoded: str | None = None) -> list[int]:
        got = self._bytes.get(token_id)
        if got is None:
            got = None
            if self.byte_level:
                piece = self.tokenizer.convert_ids_to_tokens([token_id])[0]
                table = _byte_decoder()
                if isinstance(piece, str) and piece and all(ch in table for ch in piece) \
                        and token_id not in self.tokenizer.skipped_token_ids:
                    got = [table[ch] for ch in piece]
            if got is None:
                got = list(self.text(token_id, decoded).encode("utf-8"))
            if len(self._bytes) < 1 << 16:
                self._bytes[token_id] = got
        return got


def _ranked(position: TokenLogprobs, k: int) -> list[tuple[int, Any]]:
    """The ``k`` most likely entries of one position, by rank."""
    ranked = sorted(position.items(), key=lambda kv: (kv[1].rank or 0))
    return ranked[:k]


def chat_content(token_ids: Sequence[int], positions: Sequence[TokenLogprobs], k: int,
                 tt: TokenText) -> list[dict[str, Any]]:
    """Chat's ``logprobs.content`` entries for these generated tokens."""
    out = []
    for tok, pos in zip(token_ids, positions):
        chosen = pos[tok]
        top = [{"token": tt.text(t, lp.decoded_token), "logprob": lp.logprob,
                "bytes": tt.bytes(t, lp.decoded_token)} for t, lp in _ranked(pos, k)]
        out.append({"token": tt.text(tok, chosen.decoded_token), "logprob": chosen.logprob,
                    "bytes": tt.bytes(tok, chosen.decoded_token), "top_logprobs": top})
    return out


def chat_logprobs(token_ids: Sequence[int], positions: Sequence[TokenLogprobs] | None, k: int,
                  tt: TokenText) -> dict[str, Any] | None:
    if positions is None:
        return None
    return {"content": chat_content(token_ids, positions, k, tt), "refusal": None}


def completion_logprobs(token_ids: Sequence[int], positions: Sequence[TokenLogprobs | None],
                        k: int, tt: TokenText, text_offset: int = 0) -> dict[str, Any]:
    """Completions' ``logprobs`` object; a position without log probabilities (the prompt's first
    token under ``echo``) has None. ``text_offset``: where the first token's text starts."""
    tokens, lps, tops, offsets = [], [], [], []
    for tok, pos in zip(token_ids, positions):
        text = tt.text(tok, pos[tok].decoded_token if pos is not None and tok in pos else None)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if pos is None:
            lps.append(None)
            tops.append(None)
            continue
        lps.append(pos[tok].logprob)
        top = {tt.text(t, lp.decoded_token): lp.logprob for t, lp in _ranked(pos, k)}
        top.setdefault(text, pos[tok].logprob)  # the chosen token is always listed (vLLM's way)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
