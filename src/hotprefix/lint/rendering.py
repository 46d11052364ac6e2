"""Rendering a sample the way the server would (chat requests through the tokenizer's chat
template), tokenizing it, and finding where each of its fields and its per-request tail start.

Knows the tokenizer; knows nothing about findings or files beyond the samples it is given.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hotprefix.lint.samples import Sample
from hotprefix.text.common import common_prefix_len
from hotprefix.text.tokenizer import Tokenizer, TokenizerError
from hotprefix.text.volatile import first_stable_placeholder


@dataclass
class Prompt:
    """A sample rendered and tokenized with one tokenizer."""

    sample: Sample
    text: str
    """The prompt text the model sees."""
    token_ids: list[int]
    add_special_tokens: bool
    """Whether ``token_ids`` were encoded with the tokenizer's own special tokens (BOS)."""
    field_starts: list[int | None]
    """Offset of each of ``sample.fields`` in ``text`` (None: not found verbatim)."""
    stable_end: int
    """Text from here on is the per-request tail (final message, or after ``{{ question }}``)."""
    system_text: str | None
    """The system prompt (chat/system kinds; None: the chat template's default)."""
    warnings: list[str] = field(default_factory=list)


def render(sample: Sample, tok: Tokenizer) -> Prompt:
    """Render a sample with ``tok`` (chat template for chat requests) and tokenize it."""
    warnings: list[str] = []
    if sample.kind in ("template", "completion"):
        f = sample.fields[0]
        text = f.text
        ids = tok.encode(text, add_special_tokens=True)
        stable_end = len(text)
        if sample.kind == "template":
            stop = first_stable_placeholder(text, f.placeholders)
            stable_end = stop if stop is not None else len(text)
        return Prompt(sample, text, ids, True, [0], stable_end, None)

    gen = sample.kind == "chat" and sample.messages[-1]["role"] != "assistant"
    try:
        text = tok.render_chat(sample.messages, add_generation_prompt=gen)
    except TokenizerError as e:
        warnings.append(f"{sample.source.path}:{sample.line}: {e}; rendered as plain text instead")
        text = "\n\n".join(m["content"] for m in sample.messages)
    ids = tok.encode(text, add_special_tokens=False)
    # locate each message's content (and each field inside it) in the rendered text, in order
    msg_starts: list[int | None] = []
    cursor = 0
    for m in sample.messages:
        pos = text.find(m["content"], cursor)
        msg_starts.append(pos if pos >= 0 else None)
        if pos >= 0:
            cursor = pos + len(m["content"])
    field_starts: list[int | None] = []
    seen: dict[int, int] = {}
    for f, owner in zip(sample.fields, sample.field_message):
        base = msg_starts[owner]
        offset = seen.get(owner, 0)
        field_starts.append(None if base is None else base + offset)
        seen[owner] = offset + len(f.text)  # parts are joined with nothing, as the server does
    for f, start in zip(sample.fields, field_starts):
        if start is None:
            warnings.append(f"{sample.source.path}:{sample.line}: {f.path} is not in the rendered "
                            "prompt verbatim (the chat template changed it); not checked")
    last = sample.messages[-1]
    if sample.kind == "system" or last["role"] == "system" or msg_starts[-1] is None:
        stable_end = len(text)
    else:
        stable_end = msg_starts[-1]
    systems = [m["content"] for m in sample.messages if m["role"] == "system"]
    return Prompt(sample, text, ids, False, field_starts, stable_end,
                  "\n".join(systems) if systems else None, warnings)


def token_index(tok: Tokenizer, prompt: Prompt, char_offset: int) -> int:
    """Index of the first token of ``prompt`` that a change at ``char_offset`` can alter.

    That is the token holding the character (or the one a merge ties it to): the longest common
    prefix of the prompt's ids and the ids of its text up to that character.
    """
    head = tok.encode(prompt.text[:char_offset], add_special_tokens=prompt.add_special_tokens)
    return common_prefix_len(head, prompt.token_ids)
