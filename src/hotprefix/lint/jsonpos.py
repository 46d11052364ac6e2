"""A JSON parser that remembers where each object, array and string value starts in the file, so a
finding inside a JSON string can be reported at its file line and column (escapes walked).

The input must already be valid JSON (``json.loads`` checks it first and reports syntax errors).
Knows nothing about requests or prompts.
"""

from __future__ import annotations

import json
import json.decoder
import json.scanner
import re
from typing import Any


class JStr(str):
    """A JSON string value that remembers where its body starts in the file text."""

    raw_start: int


class JDict(dict):
    """A JSON object that remembers where it starts in the file text."""

    raw_start: int


class JList(list):
    """A JSON array that remembers where it starts in the file text."""

    raw_start: int


_WS = re.compile(r"[ \t\n\r]*")
_LITERALS = (("true", True), ("false", False), ("null", None), ("NaN", float("nan")),
             ("Infinity", float("inf")), ("-Infinity", float("-inf")))


def parse_at(raw: str, i: int) -> tuple[Any, int]:
    """Parse the JSON value starting at offset ``i`` of ``raw``; returns it and the offset past it."""
    i = _WS.match(raw, i).end()
    c = raw[i]
    if c == '"':
        s, end = json.decoder.scanstring(raw, i + 1)
        js = JStr(s)
        js.raw_start = i + 1
        return js, end
    if c == "{":
        obj = JDict()
        obj.raw_start = i
        i = _WS.match(raw, i + 1).end()
        if raw[i] == "}":
            return obj, i + 1
        while True:
            i = _WS.match(raw, i).end()
            key, i = json.decoder.scanstring(raw, i + 1)
            i = _WS.match(raw, i).end() + 1  # ':'
            obj[key], i = parse_at(raw, i)
            i = _WS.match(raw, i).end()
            if raw[i] == "}":
                return obj, i + 1
            i += 1  # ','
    if c == "[":
        arr = JList()
        arr.raw_start = i
        i = _WS.match(raw, i + 1).end()
        if raw[i] == "]":
            return arr, i + 1
        while True:
            val, i = parse_at(raw, i)
            arr.append(val)
            i = _WS.match(raw, i).end()
            if raw[i] == "]":
                return arr, i + 1
            i += 1
    for lit, val in _LITERALS:
        if raw.startswith(lit, i):
            return val, i + len(lit)
    m = json.scanner.NUMBER_RE.match(raw, i)
    assert m is not None, f"unparsable JSON at offset {i}"
    return json.loads(m.group(0)), m.end()


def raw_offset(raw: str, start: int, n: int) -> int:
    """File offset of decoded character ``n`` of the JSON string whose body starts at ``start``."""
    j = start
    for _ in range(n):
        if raw[j] != "\\":
            j += 1
        elif raw[j + 1] != "u":
            j += 2
        else:
            cp = int(raw[j + 2:j + 6], 16)
            pair = 0xD800 <= cp < 0xDC00 and raw.startswith("\\u", j + 6)
            j += 12 if pair and 0xDC00 <= int(raw[j + 8:j + 12], 16) < 0xE000 else 6
    return j
