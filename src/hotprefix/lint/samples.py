"""What the readers make of an input file: ``Sample``s (one prompt-to-be each) made of ``Field``s (the
strings that end up in the prompt), each able to say where a character of it sits in the file.

Knows nothing about tokenizers, rendering or findings.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field
from typing import Any

from hotprefix.lint.jsonpos import raw_offset
from hotprefix.text.volatile import Placeholder


class LintUsageError(Exception):
    """Bad input or flags: the message says what is wrong; the CLI turns it into exit status 2."""


class SourceFile:
    """A file's text and the offset -> (line, column) mapping, both 1-based."""

    def __init__(self, path: str, raw: str):
        self.path = path
        self.raw = raw
        self.line_starts = [0] + [m.end() for m in re.finditer(r"\n", raw)]
        """File offset where each line starts."""

    def line_col(self, offset: int) -> tuple[int, int]:
        idx = bisect.bisect_right(self.line_starts, offset) - 1
        return idx + 1, offset - self.line_starts[idx] + 1


@dataclass
class Field:
    """One string of the input that ends up in the prompt."""

    path: str
    """Where it sits: ``messages[0].content``, ``prompt``, ``system``, ``template``; for a template
    found in source code, the name it is bound to and its syntax (``SYSTEM (f-string)``)."""
    role: str | None
    """Chat role of the message it belongs to; None outside chat."""
    text: str
    """The string itself (for code: the template text with its placeholders as written)."""
    source: SourceFile
    """The file it came from."""
    raw_start: int | None
    """File offset of its first character; None when it cannot be located exactly."""
    is_json: bool
    """Whether ``raw_start`` points into a JSON string (so escapes must be walked)."""
    anchors: list[tuple[int, int]] | None = None
    """For text rebuilt from code: sorted ``(offset in text, file offset)`` pairs; an offset maps
    through the last anchor at or before it. None: ``raw_start`` alone maps the text."""
    placeholders: list[Placeholder] | None = None
    """Its placeholders when a code reader judged them (by the values bound to them); None: found
    by scanning ``text``, which is then checked for volatile literal values too."""

    def line_col(self, offset: int) -> tuple[int | None, int | None]:
        """1-based file line and column of character ``offset`` of this field."""
        if self.raw_start is None:
            return None, None
        if self.anchors:
            i = max(0, bisect.bisect_right([a for a, _ in self.anchors], offset) - 1)
            text_at, file_at = self.anchors[i]
            return self.source.line_col(file_at + max(0, offset - text_at))
        pos = (raw_offset(self.source.raw, self.raw_start, offset) if self.is_json
               else self.raw_start + offset)
        return self.source.line_col(pos)


@dataclass
class Sample:
    """One prompt-to-be read from a file: a template, or one request of a JSON/JSONL file."""

    source: SourceFile
    line: int
    """1-based line where the template/request starts."""
    kind: str
    """template | chat | completion | system."""
    fields: list[Field]
    """Its strings in prompt order (for chat: one per message content part)."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    """Chat messages as the server hands them to the chat template: content parts joined, role
    ``developer`` read as ``system`` (chat and system kinds)."""
    field_message: list[int] = field(default_factory=list)
    """For each field, the index of its chat message (chat and system kinds)."""
