"""Detectors of volatile values: text that differs between requests and so ends prefix-cache reuse.

Two families, both over plain text:

- literal values: timestamps, dates, clock times, UUIDs, hex/trace ids, request ids, random numbers,
  counters (``find_volatile`` without placeholders);
- template placeholders, judged by what they evaluate to: Python f-string/``str.format`` fields
  (``{datetime.now().isoformat()}``, ``{documents}``), Jinja/Handlebars/Go (``{{ now() }}``),
  JavaScript template literals and ``string.Template`` (``${Date.now()}``), ``%``-style
  (``%(ts)s``). A placeholder whose expression yields the time, a random value, a UUID, a counter or
  a request id is volatile; one naming plain data (``{{ question }}``) is not, and marks where the
  per-request part of a template starts.

Shared by ``hotprefix lint`` and the runtime's miss diagnosis, so both name causes the same way.
Knows nothing about tokenizers, files, requests or the cache; imports only the standard library.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from typing import Sequence

_MONTH = (r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?|"
          r"Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)")
_WEEKDAY = r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)[a-z]*"
_WEEKDAY_FULL = r"(?:Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday)"

# (kind, pattern) in priority order: where two matches overlap, the earlier detector wins. The
# volatile text is the named group ``v`` when the pattern has one, else the whole match.
_DETECTORS: tuple[tuple[str, re.Pattern[str]], ...] = tuple((k, re.compile(p)) for k, p in (
    ("uuid", r"(?<![0-9A-Za-z])[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-"
             r"[0-9A-Fa-f]{12}(?![0-9A-Za-z])"),
    # ISO-8601 date-time, RFC-2822-ish and long-form date-times
    ("timestamp", r"(?<![\w.-])\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?"
                  r"(?:Z|[+-]\d{2}:?\d{2}|\s?UTC|\s?GMT)?(?!\w)"),
    ("timestamp", rf"\b(?:{_WEEKDAY},?\s+)?\d{{1,2}}\s+{_MONTH}\s+\d{{4}},?\s+\d{{1,2}}:\d{{2}}"
                  r"(?::\d{2})?(?:\s*(?:[+-]\d{4}|GMT|UTC|Z))?(?!\w)"),
    ("timestamp", rf"\b(?:{_WEEKDAY},?\s+)?{_MONTH}\.?\s+\d{{1,2}}(?:st|nd|rd|th)?,?\s+\d{{4}},?"
                  r"\s+(?:at\s+)?\d{1,2}:\d{2}(?::\d{2})?(?:\s*[AaPp]\.?[Mm]\.?)?(?:\s*(?:UTC|GMT))?(?!\w)"),
    # dates
    ("date", r"(?<![\w.-])(?:\d{4}-\d{2}-\d{2}|\d{4}/\d{2}/\d{2}|\d{1,2}/\d{1,2}/\d{4}|"
             r"\d{1,2}\.\d{1,2}\.\d{4})(?![\w-])"),
    ("date", rf"\b(?:{_WEEKDAY},?\s+)?{_MONTH}\.?\s+\d{{1,2}}(?:st|nd|rd|th)?,?\s+\d{{4}}\b"),
    ("date", rf"\b(?:{_WEEKDAY},?\s+)?\d{{1,2}}(?:st|nd|rd|th)?\s+{_MONTH}\.?,?\s+\d{{4}}\b"),
    ("date", rf"\b(?:[Tt]oday is|[Ii]t is)\s+(?P<v>{_WEEKDAY_FULL})\b"),
    # CJK dates (2026年11月29日, 2026년 11월 29일) and times (13時47分, 13시 47분)
    ("timestamp", r"(?<!\d)\d{4}\s*[年년]\s*\d{1,2}\s*[月월]\s*\d{1,2}\s*[日일]\s*\d{1,2}\s*"
                  r"[時时시:]\s*\d{1,2}(?:\s*[分분])?(?:\s*\d{1,2}\s*[秒초])?"),
    ("date", r"(?<!\d)\d{4}\s*[年년]\s*\d{1,2}\s*[月월]\s*\d{1,2}\s*[日일]"),
    ("timestamp", r"(?<!\d)\d{1,2}\s*[時时시]\s*\d{1,2}\s*[分분](?:\s*\d{1,2}\s*[秒초])?"),
    # clock times
    ("timestamp", r"(?<![\d:])\d{1,2}:\d{2}:\d{2}(?:[.,]\d+)?(?![\d:])"),
    ("timestamp", r"(?<![\d:])\d{1,2}:\d{2}\s*[AaPp]\.?[Mm]\b\.?"),
    # ids
    ("hex_id", r"(?<![0-9A-Za-z_])0[xX][0-9a-fA-F]{8,}(?![0-9A-Za-z_])"),  # a pointer, an id
    ("hex_id", r"(?<![0-9A-Za-z_])(?=[0-9a-fA-F]*[a-fA-F])(?=[0-9a-fA-F]*\d)[0-9a-fA-F]{16,}"
               r"(?![0-9A-Za-z_])"),
    ("request_id", r"\b(?:req|request|trace|span|sess|session|msg|chatcmpl|cmpl|run|conv|txn|evt|"
                   r"job|corr|correlation)[-_](?=[A-Za-z0-9]*\d)[A-Za-z0-9]{6,}\b"),
    ("request_id", r"(?i:\b(?:(?:x-)?(?:request|req|trace|span|session|correlation|conversation|"
                   r"message|msg|run|call|client|user)[-_ ]?)?id\b)\s*[:=#]\s*[\"']?"
                   r"(?P<v>(?=[\w.:-]*\d)[A-Za-z0-9][\w.:-]{3,})"),
    # epoch seconds / milliseconds (2001..2033)
    ("timestamp", r"(?<![\w.,])1\d{9}(?:\d{3}|\.\d+)?(?![\w]|[.,]\d)"),
    ("random_number", r"(?i:\b(?:seed|nonce|random(?:[-_ ]?(?:number|value|seed))?|salt|"
                      r"cache[-_ ]?buster)\b)\s*(?:[:=]|is)\s*(?P<v>\d+|[0-9a-fA-F]{6,})\b"),
    ("counter", r"(?i:\b(?:request|turn|attempt|retry|call|iteration|round|visit|query|"
                r"conversation|session|interaction|message)s?\s*(?:#\s*|no\.\s*|number\s+)?)\d+\b"),
    ("counter", r"(?i:\b\d+(?:st|nd|rd|th)\s+(?:request|attempt|turn|call|try|time|visit|message|"
                r"question)\b)"),
    ("counter", r"(?i:\b(?:request[-_ ]?)?count\b)\s*[:=]\s*\d+\b"),
    ("random_number", r"(?<![\w.,-])\d{6,}(?![\w-]|[.,]\d)"),
))

# ------------------------------------------------------------------------------- placeholders
_PAREN = r"\((?:[^(){}]|\((?:[^(){}]|\([^(){}]*\))*\))*\)"  # a call's arguments, 3 levels deep
_PY_EXPR = rf"[A-Za-z_]\w*(?:\s*(?:\.\s*[A-Za-z_]\w*|{_PAREN}|\[[^\[\]{{}}]*\]))*"
# (syntax, pattern) in priority order; the expression is the group ``expr``
_PLACEHOLDER_RES: tuple[tuple[str, re.Pattern[str]], ...] = tuple((s, re.compile(p)) for s, p in (
    # Jinja, Handlebars/Mustache, Go templates; not comments, block tags or partials
    # (words separated by whitespace, so that no text can be split two ways: linear time)
    ("jinja", r"\{\{-?\s*(?![!#/>^]|else\b)(?P<expr>(?:[^{}\s-]|-(?!\}\})|\{[^{}]*\})+"
              r"(?:\s+(?:[^{}\s-]|-(?!\}\})|\{[^{}]*\})+)*)\s*-?\}\}"),
    # JavaScript template literals, string.Template, shell
    ("js", r"\$\{(?P<expr>(?:[^{}]|\{(?:[^{}]|\{[^{}]*\})*\})*)\}"),
    # %-style with a mapping key
    ("percent", r"%\((?P<expr>[A-Za-z_]\w*)\)[#0 +\-]*\d*(?:\.\d+)?[diouxXeEfFgGcrsa]"),
    # f-strings and str.format: an expression (names, attributes, calls, subscripts), an optional
    # ``=``, conversion and format spec (``{now:%Y-%m-%d %H:%M}``), never JSON such as {"id": 1}
    ("format", rf"(?<![{{$])\{{\s*(?P<expr>{_PY_EXPR})\s*(?:=\s*)?(?:![rsa])?"
               r"(?::(?:[^{}\s]|\s(?=%)|\{[^{}]*\})*)?\}(?!\})"),
))

# what a placeholder's words say it evaluates to, in priority order
_CAUSE_WORDS: tuple[tuple[str, frozenset[str]], ...] = (
    ("uuid", frozenset({"uuid", "guid", "ulid", "nanoid", "cuid"})),
    ("time", frozenset({"now", "today", "time", "times", "date", "datetime", "timestamp", "ts",
                        "utcnow", "strftime", "clock", "epoch", "hour", "minute", "day", "weekday",
                        "ctime", "localtime", "gmtime", "monotonic", "tomorrow", "yesterday"})),
    ("random", frozenset({"random", "rand", "randint", "randrange", "randbelow", "getrandbits",
                          "urandom", "seed", "nonce", "secrets"})),
    ("counter", frozenset({"counter", "count", "seq", "turn", "attempt", "retry", "iteration",
                           "incr", "increment"})),
    ("id", frozenset({"id", "ids", "requestid", "traceid", "trace", "span", "spanid"})),
)
_UUID_WORD = re.compile(r"uuid(?:v?\d+)?")
_STRING_LITERAL = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|`(?:[^`\\]|\\.)*`", re.S)
_COUNTER_SYNTAX = re.compile(r"\+\+|--|\+=\s*1\b|\bnext\s*\(")


def _words(name: str) -> set[str]:
    words = {w.lower() for w in re.findall(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|\d+", name)}
    words.add(re.sub(r"[^a-z0-9]", "", name.lower()))
    return words


def _cause_of_words(words: set[str]) -> str | None:
    if any(_UUID_WORD.fullmatch(w) for w in words):
        return "uuid"
    for cause, vocab in _CAUSE_WORDS:
        if words & vocab:
            return cause
    return None


def is_volatile_name(name: str) -> bool:
    """Whether a placeholder's name suggests a per-request value (``now``, ``request_id``...)."""
    return _cause_of_words(_words(name)) is not None


def expression_cause(expr: str) -> str | None:
    """What a placeholder expression evaluates to when that differs per request, else None.

    Judged by its identifiers (string literals inside it are ignored): ``time`` (``now``,
    ``datetime.now().isoformat()``, ``Date.now()``, ``new Date()``, ``time.time()``), ``uuid``
    (``uuid4()``, ``crypto.randomUUID()``), ``random`` (``random()``, ``Math.random()``,
    ``secrets.token_hex(8)``), ``counter`` (``counter``, ``next(it)``, ``n++``) or ``id``
    (``request_id``). A plain name such as ``documents`` or ``user_question`` gives None.
    """
    code = _STRING_LITERAL.sub("''", expr)
    words: set[str] = set()
    for ident in re.findall(r"[A-Za-z_$][\w$]*", code):
        words |= _words(ident.strip("$"))
    cause = _cause_of_words(words)
    if cause is None and _COUNTER_SYNTAX.search(code):
        return "counter"
    return cause


@dataclass(frozen=True)
class Placeholder:
    """One template placeholder (``{{ now }}``, ``{documents}``, ``${Date.now()}``, ``%(ts)s``)."""

    start: int
    """Offset of its first character (the opening brace or ``%``) in the scanned text."""
    end: int
    """Offset one past its end."""
    text: str
    """The placeholder as written."""
    expr: str
    """The expression or name inside it."""
    cause: str | None
    """What it evaluates to when that varies per request (time, random, uuid, counter, id);
    None for stable data such as ``{{ question }}``."""


class _Spans:
    """Non-overlapping ``[start, end)`` spans, sorted, for claiming text in O(log n)."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []

    def claim(self, start: int, end: int) -> bool:
        """Take ``[start, end)`` unless it overlaps a span already taken; whether it was taken."""
        i = bisect.bisect_right(self.starts, start)
        if (i and self.ends[i - 1] > start) or (i < len(self.starts) and self.starts[i] < end):
            return False
        self.starts.insert(i, start)
        self.ends.insert(i, end)
        return True


def find_placeholders(text: str) -> list[Placeholder]:
    """All template placeholders in ``text`` (any of the syntaxes above), non-overlapping, in order."""
    found: list[Placeholder] = []
    taken = _Spans()
    for _, pattern in _PLACEHOLDER_RES:
        for m in pattern.finditer(text):
            if taken.claim(m.start(), m.end()):
                expr = m.group("expr").strip()
                found.append(Placeholder(m.start(), m.end(), m.group(0), expr,
                                         expression_cause(expr)))
    found.sort(key=lambda p: p.start)
    return found


def first_stable_placeholder(text: str, placeholders: Sequence[Placeholder] | None = None) -> int | None:
    """Offset of the first placeholder of stable data (e.g. ``{{ question }}``), if any.

    Args:
        text: the template.
        placeholders: its placeholders when already known (from a code reader); default: scan.
    """
    found = find_placeholders(text) if placeholders is None else placeholders
    starts = [p.start for p in found if p.cause is None]
    return min(starts) if starts else None


# ------------------------------------------------------------------------------- matches
@dataclass(frozen=True)
class Match:
    """One volatile span in a piece of text."""

    kind: str
    """Detector that matched (timestamp, date, uuid, ..., template_placeholder)."""
    start: int
    """Offset of the volatile text in the scanned text."""
    end: int
    """Offset one past its end."""
    text: str
    """The volatile text itself."""
    cause: str | None = None
    """For a template placeholder: what it evaluates to (time, random, uuid, counter, id)."""


def placeholder_matches(placeholders: Sequence[Placeholder]) -> list[Match]:
    """The volatile ones among ``placeholders``, as matches of kind ``template_placeholder``."""
    return [Match("template_placeholder", p.start, p.end, p.text, p.cause)
            for p in placeholders if p.cause is not None]


def find_volatile(text: str) -> list[Match]:
    """All volatile spans in ``text`` (placeholders and literal values), non-overlapping, in order."""
    placeholders = find_placeholders(text)
    found = placeholder_matches(placeholders)
    # a stable placeholder is no volatile content, but nothing else may match inside it
    taken = _Spans()
    for p in placeholders:
        taken.claim(p.start, p.end)
    for kind, pattern in _DETECTORS:
        for m in pattern.finditer(text):
            group = "v" if "v" in pattern.groupindex else 0
            start, end = m.start(group), m.end(group)
            if start < end and taken.claim(start, end):
                found.append(Match(kind, start, end, text[start:end]))
    found.sort(key=lambda x: x.start)
    return found
