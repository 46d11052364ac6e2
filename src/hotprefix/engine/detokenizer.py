"""Incremental detokenization of one request's output, with stop strings.

Decoding the whole output again for every new token costs O(n) per token, O(n^2) per request.
``IncrementalDetokenizer`` decodes only a short window of recent tokens (the approach of vLLM's and
Hugging Face's ``detokenize_incrementally``): the text of the tokens after ``read_offset`` is
``decode(ids[prefix_offset:])`` minus ``decode(ids[prefix_offset:read_offset])``. The tokens before
``read_offset`` give the context a tokenizer needs (a SentencePiece ``▁`` is a space only after
another token; a byte-level token may be the end of a character). New text becomes final only when
it does not end in U+FFFD, i.e. not in the middle of a multi-byte character; until then the window
grows. Each token is decoded a bounded number of times, so a request costs O(n) decode work.

Stop strings are searched in the new text plus the last ``max(len(stop)) - 1`` characters before
it, so one spanning two tokens is found, and the text is cut before the first one exactly as a
search of the whole text would cut it. While streaming, a suffix that could still grow into a stop
string is held back, so a stream never shows part of a stop string.

The final text equals ``tokenizer.decode(output_ids, continuation=True)`` (without the stop token,
cut before a stop string), including a trailing incomplete character if generation ends inside one.
Output continues its prompt, so a SentencePiece vocabulary's first ``▁`` is a space here, as in
llama.cpp's and vLLM's output (``decode`` alone removes it as the prefix space of a text); for other
tokenizers the two decodes are the same. Byte-fallback pieces (``<0xE6><0x97><0xA5>``) are a
character split across tokens like any other: held back until whole.

This module knows nothing about scheduling, the KV cache or HTTP; the engine keeps one instance per
request id.
"""

from __future__ import annotations

import functools
from typing import Iterable

from hotprefix.text.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
"""What a decoder writes for bytes that are not (yet) a whole UTF-8 character."""


class IncrementalDetokenizer:
    """The text of one request's output tokens, decoded a few tokens at a time.

    Feed the output token ids with ``add`` (the stop token excluded), call ``finish`` when no more
    will come, and take what may be shown with ``take``. Not thread-safe: one engine thread owns it.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Iterable[str] = ()):
        """Args:
            tokenizer: decodes token windows; its ``skipped_token_ids`` never enter the window.
            stop: stop strings; the text ends before the first occurrence of any of them.
        """
        self._tokenizer = tokenizer
        self._skip = tokenizer.skipped_token_ids
        self._stop: list[str] = [s for s in stop if s]
        self._max_overlap = max((len(s) for s in self._stop), default=1) - 1
        """Characters of earlier text that a stop string completed by new text can start in."""
        self._ids: list[int] = []
        """Output ids that can carry text (special tokens that ``decode`` skips are left out)."""
        self._prefix_offset = 0
        """Start of the decode window: context for the tokens from ``_read_offset`` on."""
        self._read_offset = 0
        """Tokens before this one are in ``_text``; those after it are not final yet."""
        self._prefix_text: str | None = ""
        """``decode(_ids[_prefix_offset:_read_offset])``; None until needed after a move."""
        self._text = ""
        """Final text of ``_ids[:_read_offset]``: never ends inside a multi-byte character."""
        self._pending = ""
        """Text of ``_ids[_read_offset:]``, ending in U+FFFD (an unfinished character)."""
        self._num_shown = 0
        """Characters of ``_text`` already handed out by ``take``."""
        self.num_tokens = 0
        """Output tokens passed to ``add`` so far (skipped special tokens included)."""
        self.stopped = False
        """A stop string was found; the text is cut before it and final."""
        self.finished = False
        """No more tokens will come (``finish`` or a stop string); the whole text may be shown."""

    # ------------------------------------------------------------------ input
    def add(self, token_ids: Iterable[int]) -> bool:
        """Decode the next output tokens.

        Args:
            token_ids: the tokens after the ``num_tokens`` already added (usually one; may be none).
        Returns:
            True when a stop string appeared: the text is then cut before it and finished.
        """
        if self.finished:
            raise RuntimeError("tokens added to a finished detokenizer")
        for t in token_ids:
            self.num_tokens += 1
            if t not in self._skip:
                self._ids.append(t)
        if len(self._ids) == self._read_offset:
            return False
        decode = functools.partial(self._tokenizer.decode, continuation=True)
        if self._prefix_text is None:
            self._prefix_text = decode(self._ids[self._prefix_offset:self._read_offset])
        window = decode(self._ids[self._prefix_offset:])
        new = window[len(self._prefix_text):]
        checked = self._text  # stop strings were searched in all of it already
        if len(window) > len(self._prefix_text) and not new.endswith(REPLACEMENT_CHAR):
            self._text += new
            self._pending = ""
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._prefix_text = None
        else:  # inside a multi-byte character (or no text yet): keep widening the window
            self._pending = new
        return bool(self._stop) and self._find_stop(checked, new)

    def _find_stop(self, checked: str, new: str) -> bool:
        """Cut the text before the first stop string that ``new`` completes, if any.

        ``checked`` held no stop string, so any occurrence in ``checked + new`` ends in ``new`` and
        starts at most ``_max_overlap`` characters before it.
        """
        start = max(0, len(checked) - self._max_overlap)
        region = checked[start:] + new
        cut = min((i for i in (region.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut < 0:
            return False
        self._text = (checked + new)[:start + cut]
        self._pending = ""
        self.stopped = self.finished = True
        return True

    def finish(self) -> None:
        """No more tokens: an unfinished character stays as U+FFFD (as a one-shot decode has it)
        and held-back text may be shown."""
        if not self.finished:
            self._text += self._pending
            self._pending = ""
            self.finished = True

    # ------------------------------------------------------------------ output
    def take(self) -> tuple[str, str]:
        """What may be shown now, and the part of it not taken before.

        Returns:
            (text, new_text): ``text`` is all the output text a caller may see now (the final text
            once finished); ``new_text`` is its suffix since the previous call.
        """
        end = len(self._text) if self.finished else len(self._text) - self._held()
        end = max(end, self._num_shown)
        new = self._text[self._num_shown:end]
        self._num_shown = end
        return self._text[:end], new

    def _held(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        text = self._text
        for k in range(min(self._max_overlap, len(text) - self._num_shown), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0
