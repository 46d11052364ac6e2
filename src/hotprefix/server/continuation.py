"""Server-held conversations, token-exact: the prompt of a ``previous_response_id`` continuation is
the stored response's token ids (its prompt and the tokens it actually generated) followed by the
tokens of what comes after them, never a re-rendering of their text.

Re-tokenizing an answer's text can give other ids than those sampled (a BPE merges what the model
wrote in two pieces; a template trims or rewrites an earlier assistant turn), and the cache key is
the tokens: a re-rendered history misses from the first such token at every turn. Here the stored
ids are kept as they are; only the tail is rendered:

1. the chat template renders the stored conversation with a sentinel as the answer's text and
   the new messages after it, with the assistant turn's opening;
2. the text after the sentinel (the template's end of the assistant turn, the new turns, the
   opening) is tokenized and appended to the stored ids, without the end-of-turn token when the
   model already generated one.

A template that renders earlier turns differently once later ones exist (Mistral's puts the tools
before the *last* user turn; Qwen 3's drops earlier reasoning) does not change the earlier tokens
here: they stay what the model saw, and the new turns are rendered as the template renders them
at the end of the conversation (``Continued.rewrites_history`` says it happened). Only when the
sentinel does not survive the rendering (a template that drops or rewrites the answer's text)
does ``continue_ids`` answer None, and the caller re-renders the whole conversation, saying so
in its cache report.

Knows the tokenizer and ``server/tools.py``'s rendering; nothing of HTTP or the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hotprefix.server import tools as T
from hotprefix.text.tokenizer import Tokenizer, TokenizerError

SENTINEL = "\ue000hotprefix-answer\ue001"
"""Stands for the stored answer's text while the template renders (private-use characters, which
no template rewrites)."""


def template_messages(instructions: str | None, conversation: list[dict[str, Any]],
                      functions: list[T.Function], native: bool) -> list[dict[str, Any]]:
    """The chat template's messages for a conversation: the instructions as the system turn, the
    tools rendered as a chat request renders them (``tools.render_messages``)."""
    msgs = ([{"role": "system", "content": instructions}] if instructions else []) + \
        [dict(m) for m in conversation]
    if functions or any(m.get("tool_calls") or m["role"] == "tool" for m in msgs):
        msgs = T.render_messages(msgs, functions, native)
    return msgs


@dataclass(frozen=True)
class Continued:
    """A continuation's prompt."""

    ids: list[int]
    """The stored ids, then the tail's."""
    rewrites_history: bool
    """The template renders the turns before the new ones differently now that these exist (a
    re-rendered history would not match the stored tokens); the stored tokens were kept."""


def continue_ids(tokenizer: Tokenizer, head: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 stored_ids: list[int], ended_with_eos: bool,
                 new: list[dict[str, Any]]) -> Continued | None:
    """The continuation's prompt: ``stored_ids`` (the previous prompt and answer) then the tokens
    of the turn's end, the ``new`` messages and the assistant opening; None when the answer's
    text does not survive the template's rendering of the longer conversation.

    Args:
        head: the template messages of the stored conversation before its answer.
        tools: what the template was given as ``tools`` (None unless it renders them).
        new: the template messages that follow the answer.
    """
    answer = {"role": "assistant", "content": SENTINEL}
    try:
        before = tokenizer.render_chat(head + [answer], add_generation_prompt=False, tools=tools)
        after = tokenizer.render_chat(head + [answer] + new, add_generation_prompt=True, tools=tools)
    except TokenizerError:
        return None
    i = after.rfind(SENTINEL)
    if i < 0 or after.count(SENTINEL) != 1 or before.count(SENTINEL) != 1:
        return None
    tail = tokenizer.encode(after[i + len(SENTINEL):], add_special_tokens=False)
    if ended_with_eos and tail and tail[0] in tokenizer.eos_token_ids:
        tail = tail[1:]  # the model ended its turn itself; its token is in stored_ids
    return Continued(list(stored_ids) + tail, not after.startswith(before))
