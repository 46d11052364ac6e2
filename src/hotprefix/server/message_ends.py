"""Where a chat prompt's messages end, as hit points of a hybrid pool (``hit_point_tokens``).

A hybrid pool (sliding-window layers) keeps a window layer's K/V only before the points where a
later request is expected to resume (``cache/window_groups.py``). Besides the prompt's end, the
likely ones in a chat are where the system prompt ends (the next conversation with the same
instructions) and where an earlier turn ended (the same history with another last message). Each
is found as cache breakpoints are: the conversation cut after that message is rendered and
tokenized, and its common prefix with the whole prompt's ids is the message's end token.

The two kinds are kept apart (``MessageEnds``): a system end serves other conversations and stays
a hit point (``hit_point_tokens``); a turn end serves only this conversation's regenerated or
edited last message, and its window gives way once a later turn of the conversation ends
(``turn_end_tokens``, ``cache/window_keep.py``): in a pool near its capacity, a turn end's window
kept beside the latest turn's can cost another session its only one.

Only a hybrid pool gains from them (a full-attention pool keeps every block it caches), so only
there are the cuts tokenized; at most ``1 + MAX_TURN_ENDS`` cuts a request, through the server's
tokenizer executor (``ServerState.encode``). Knows nothing about HTTP routing or the engine's
internals.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from hotprefix.server.state import ServerState
from hotprefix.text.common import common_prefix_len
from hotprefix.text.tokenizer import TokenizerError

MAX_TURN_ENDS = 2
"""Earlier turns' ends marked per request, the latest ones (the previous turn's end is where a
regenerated or edited last message resumes)."""

USER_SIDE = ("user", "tool")
"""Roles that answer an assistant message: an assistant message followed by one ends a turn."""


class MessageEnds(NamedTuple):
    """Token offsets where a chat prompt's messages end, by kind."""

    system: tuple[int, ...] = ()
    """Where the leading system messages end (at most one offset)."""
    turns: tuple[int, ...] = ()
    """Where the last ``MAX_TURN_ENDS`` earlier turns end, ascending."""


NO_ENDS = MessageEnds()


def cut_points(messages: Sequence[dict[str, Any]]) -> list[int]:
    """Message counts to cut the conversation after: the leading system messages (when a message
    follows them) and the last ``MAX_TURN_ENDS`` assistant messages that the user side answers.
    Never the whole conversation (its end is the prompt's end, a hit point already)."""
    system, turns = _cuts(messages)
    return system + turns


def _cuts(messages: Sequence[dict[str, Any]]) -> tuple[list[int], list[int]]:
    n = len(messages)
    system = 0
    while system < n and messages[system]["role"] == "system":
        system += 1
    turns = [k + 1 for k in range(system, n - 1)
             if messages[k]["role"] == "assistant" and messages[k + 1]["role"] in USER_SIDE]
    return ([system] if 0 < system < n else []), turns[-MAX_TURN_ENDS:]


async def message_ends(state: ServerState, messages: list[dict[str, Any]], ids: Sequence[int],
                       tools: list[dict[str, Any]] | None = None) -> MessageEnds:
    """The token offsets in ``ids`` (the rendered prompt of ``messages``) where the messages of
    ``cut_points`` end; none unless the engine has window groups. A turn end that falls where
    the system end does is the system end.

    Args:
        messages: the chat template's messages, as rendered for ``ids`` (tools already in them).
        tools: the template's ``tools`` argument, as ``ids`` were rendered with.
    """
    if not state.marks_message_ends:
        return NO_ENDS
    found: list[set[int]] = [set(), set()]
    for kind, cuts in enumerate(_cuts(messages)):
        for cut in cuts:
            try:
                cut_ids = await state.encode(state.tokenizer.encode_chat, messages[:cut], False, tools)
            except TokenizerError:
                continue  # a template that will not render this cut (one that wants a user turn
                # last): that message's end is not marked, the request is served as it is
            end = common_prefix_len(ids, cut_ids)
            if 0 < end < len(ids):
                found[kind].add(end)
    system, turns = found
    return MessageEnds(tuple(sorted(system)), tuple(sorted(turns - system)))
