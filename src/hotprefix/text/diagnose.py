"""Turns a cache report's token ids into words: excerpts of what was sent vs what the cache holds
at the point of divergence, and a guess at the cause (timestamp, date, UUID, id, counter...).

Uses the volatile-content detectors of ``hotprefix.text.volatile`` (shared with ``hotprefix lint``, which
the runtime never imports), so the runtime report and the linter name causes the same way.
Knows the tokenizer; knows nothing about blocks or tensors.
"""

from __future__ import annotations

from typing import Any

from hotprefix.text.common import common_prefix_len
from hotprefix.cache.report import CacheReport, MissReason
from hotprefix.text.volatile import find_volatile
from hotprefix.text.tokenizer import Tokenizer, TokenizerError


TOOL_BLOCK_MARKERS = ('{"function": {', '"parameters": {', '"description": "', "<tools>", "</tools>")
"""Text of the server's tool block (``server/tools.py``: each function's JSON on one line, keys
sorted): a divergence beside one of these is in the tool definitions."""


def explain(report: CacheReport, tokenizer: Tokenizer) -> CacheReport:
    """Add human-readable excerpts (and a cause guess) to a ``diverged`` report, in place.

    Token ids are dropped from the detail once decoded: the report carries text only.
    """
    detail = report.detail or {}
    if report.miss_reason != MissReason.DIVERGED or "sent_token_ids" not in detail:
        return report
    ctx = detail.pop("context_token_ids", [])
    sent_ids = detail.pop("sent_token_ids", [])
    cached_ids = detail.pop("cached_token_ids", [])
    ctx_text = tokenizer.decode(ctx, skip_special_tokens=False)
    sent = tokenizer.decode(ctx + sent_ids, skip_special_tokens=False)
    cached = tokenizer.decode(ctx + cached_ids, skip_special_tokens=False)
    detail["sent_excerpt"] = sent
    detail["cached_excerpt"] = cached
    at = len(ctx_text)
    guess = None
    for text in (sent, cached):
        for m in find_volatile(text):
            if m.start <= at + 1 and m.end >= at:
                guess = m.kind
                break
        if guess:
            break
    if guess is None:
        # the differing run of characters itself: digits-only looks like a counter or random number
        i = common_prefix_len(sent, cached)
        a, b = sent[i:i + 8], cached[i:i + 8]
        if a[:1].isdigit() and b[:1].isdigit():
            guess = "number"
    if guess is None and any(m in sent or m in cached for m in TOOL_BLOCK_MARKERS):
        guess = "tools_changed"
    detail["likely_cause"] = guess
    if guess == "tools_changed":
        detail["hint"] = ("the prompt differs from the cached one in the tool definitions (their "
                          "order, a description or a schema): send the same tools in the same order")
    elif guess:
        detail["hint"] = (f"the prompt differs from the cached one at a {guess.replace('_', ' ')}; "
                          "move volatile values after the stable part of the prompt")
    return report


def chat_fixed_prefix(tokenizer: Tokenizer) -> list[int]:
    """Token ids every chat prompt starts with, whatever its first message says (the template's
    fixed opening, such as ``<|im_start|>system``); empty when the tokenizer has no chat template."""
    out: list[int] | None = None
    for role in ("system", "user"):
        try:
            a = tokenizer.encode_chat([{"role": role, "content": "x1"}])
            b = tokenizer.encode_chat([{"role": role, "content": "Q2"}])
        except TokenizerError:  # no template, or one that refuses these messages
            return []
        common = a[:common_prefix_len(a, b)]
        out = common if out is None or len(common) < len(out) else out
    return out or []
