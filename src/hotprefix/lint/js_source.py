"""Prompt templates in JavaScript/TypeScript source: each template literal with a ``${...}``
placeholder (``\\`Today is ${new Date().toISOString()}. ...\\```) is one template sample, its body
kept verbatim so positions are exact. Comments and quoted strings are skipped; literals that are
logged or thrown (``console.log(...)``, ``throw new Error(...)``) are not prompts.

A small scanner, not a parser: string concatenation (``"Today is " + Date.now()``) is not followed.
Knows nothing about tokenizers or findings.
"""

from __future__ import annotations

import re

from hotprefix.lint.samples import Field, Sample, SourceFile
from hotprefix.text.volatile import find_placeholders

JS_SUFFIXES = (".js", ".mjs", ".cjs", ".jsx", ".ts", ".mts", ".cts", ".tsx")

_BOUND_TO = re.compile(r"(?:([A-Za-z_$][\w$]*)\s*[:=]\s*|([A-Za-z_$][\w$.]*)\s*\(\s*)$")
_SINK = re.compile(r"(?:console\.\w+\s*\(|\bthrow\b[^;`]*|Error\s*\()\s*$")


def _skip_quoted(raw: str, i: int) -> int:
    quote, j = raw[i], i + 1
    while j < len(raw) and raw[j] not in (quote, "\n"):
        j += 2 if raw[j] == "\\" else 1
    return j + 1


def _skip_template(raw: str, i: int) -> int:
    """Offset just past the template literal whose opening backtick is at ``i``."""
    j = i + 1
    while j < len(raw):
        if raw[j] == "\\":
            j += 2
        elif raw[j] == "`":
            return j + 1
        elif raw.startswith("${", j):
            j = _skip_expression(raw, j + 2)
        else:
            j += 1
    return len(raw)


def _skip_expression(raw: str, j: int) -> int:
    depth = 1
    while j < len(raw) and depth:
        c = raw[j]
        if c in "'\"":
            j = _skip_quoted(raw, j)
            continue
        if c == "`":
            j = _skip_template(raw, j)
            continue
        depth += {"{": 1, "}": -1}.get(c, 0)
        j += 1
    return j


def template_literals(raw: str) -> list[tuple[int, int]]:
    """``(body start, body end)`` of every top-level template literal in ``raw``."""
    spans, i = [], 0
    while i < len(raw):
        if raw.startswith("//", i):
            nl = raw.find("\n", i)
            i = len(raw) if nl < 0 else nl
        elif raw.startswith("/*", i):
            end = raw.find("*/", i + 2)
            i = len(raw) if end < 0 else end + 2
        elif raw[i] in "'\"":
            i = _skip_quoted(raw, i)
        elif raw[i] == "`":
            end = _skip_template(raw, i)
            spans.append((i + 1, max(i + 1, end - 1)))
            i = end
        else:
            i += 1
    return spans


def js_samples(src: SourceFile) -> list[Sample]:
    """The prompt templates of one JavaScript/TypeScript file, one sample each, in file order."""
    samples = []
    for start, end in template_literals(src.raw):
        body = src.raw[start:end]
        placeholders = [p for p in find_placeholders(body) if p.text.startswith("${")]
        before = src.raw[max(0, start - 200):start - 1]
        if not placeholders or _SINK.search(before):
            continue
        m = _BOUND_TO.search(before)
        name = (m.group(1) or m.group(2) + "()") if m else None
        path = f"{name} (template literal)" if name else "template literal"
        samples.append(Sample(src, src.line_col(start)[0], "template",
                              [Field(path, None, body, src, start, False, None, placeholders)]))
    return samples
