"""`hotprefix lint`: static checks for the traps that silently disable prefix caching.

Reads prompt templates (.txt/.j2/.md...: the whole file is one prompt), JSON request files (one
OpenAI-style request or a list of them) and JSONL request logs (one request per line), renders each
request the way the server would (chat requests through the tokenizer's chat template), tokenizes
it, and reports:

- volatile content (timestamps, dates, UUIDs, hex/trace ids, request ids, random numbers, counters,
  volatile-named template placeholders such as ``{{ now }}``) that sits *before* stable content, with
  the token position where it starts and the prompt tokens it costs in lost reuse: everything from
  the start of the KV block holding it to the end of the prompt is recomputed whenever its value
  differs between requests (the article's trap 1);
- ``system_prompt_varies``: requests in one sample that look like the same template but whose system
  prompts differ, with the first differing token and an excerpt of both sides, and the prefix the
  whole sample still shares;
- with ``--tokenizers A B``: ``tokenizer_drift`` for every text whose token ids differ between two
  tokenizers (whether the leading full blocks still match), and ``tokenizer_fingerprint`` when the
  fingerprints differ, since hotprefix roots every block hash in the tokenizer fingerprint (trap 2).

Volatile text in the per-request tail (the final chat message, or template text after the first
non-volatile placeholder such as ``{{ question }}``) is not reported: it changes per request anyway.

Exit status: 0 clean, 1 findings, 2 bad usage (missing file, unreadable JSON, bad flags).

This module knows nothing about the model's weights, the KV pool or the engine; it only needs a
tokenizer, and imports no torch itself.
"""

from __future__ import annotations

import argparse
import bisect
import difflib
import json
import json.decoder
import json.scanner
import os
import re
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, NoReturn, Sequence

from hotprefix.cache.manager import common_prefix_len
from hotprefix.config import CacheConfig
from hotprefix.tokenizer import Tokenizer, TokenizerError

JSON_SUFFIXES = (".json",)
JSONL_SUFFIXES = (".jsonl", ".ndjson")

EXIT_CLEAN, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2


class LintUsageError(Exception):
    """Bad input or flags: the message says what is wrong; ``main`` turns it into exit status 2."""


# =============================================================================== detectors
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
    # clock times
    ("timestamp", r"(?<![\d:])\d{1,2}:\d{2}:\d{2}(?:[.,]\d+)?(?![\d:])"),
    ("timestamp", r"(?<![\d:])\d{1,2}:\d{2}\s*[AaPp]\.?[Mm]\b\.?"),
    # ids
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

_PLACEHOLDER_RES = (
    re.compile(r"\{\{-?\s*(?P<name>[A-Za-z_][\w.]*)\s*(?:\([^)]*\))?\s*(?:\|[^}]*)?-?\}\}"),
    re.compile(r"(?<![{$])\{(?P<name>[A-Za-z_]\w*)(?:![rsa])?(?::[^{}]*)?\}(?!\})"),
    re.compile(r"\$\{(?P<name>[A-Za-z_]\w*)\}"),
)
_VOLATILE_NAME_WORDS = frozenset({
    "now", "today", "time", "date", "datetime", "timestamp", "ts", "utcnow", "strftime", "uuid",
    "guid", "id", "ids", "requestid", "traceid", "trace", "span", "spanid", "nonce", "random",
    "rand", "seed", "counter", "count", "epoch", "clock", "turn", "attempt", "hour", "minute",
    "day", "weekday",
})


def is_volatile_name(name: str) -> bool:
    """Whether a placeholder's name suggests a per-request value (``now``, ``request_id``...)."""
    words = {w.lower() for w in re.findall(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|\d+", name)}
    words.add(re.sub(r"[^a-z0-9]", "", name.lower()))
    return bool(words & _VOLATILE_NAME_WORDS)


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


def find_volatile(text: str) -> list[Match]:
    """All volatile spans in ``text``, non-overlapping, in text order."""
    found: list[Match] = []
    taken: list[tuple[int, int]] = []

    def add(kind: str, start: int, end: int) -> None:
        if any(start < e and s < end for s, e in taken):
            return
        taken.append((start, end))
        found.append(Match(kind, start, end, text[start:end]))

    for pattern in _PLACEHOLDER_RES:
        for m in pattern.finditer(text):
            if is_volatile_name(m.group("name")):
                add("template_placeholder", m.start(), m.end())
            else:  # a non-volatile placeholder is no volatile content, but nothing else may match in it
                taken.append((m.start(), m.end()))
    for kind, pattern in _DETECTORS:
        for m in pattern.finditer(text):
            group = "v" if "v" in pattern.groupindex else 0
            add(kind, m.start(group), m.end(group))
    found.sort(key=lambda x: x.start)
    return found


def first_stable_placeholder(text: str) -> int | None:
    """Offset of the first placeholder with a non-volatile name (e.g. ``{{ question }}``), if any."""
    starts = [m.start() for p in _PLACEHOLDER_RES for m in p.finditer(text)
              if not is_volatile_name(m.group("name"))]
    return min(starts) if starts else None


# =============================================================================== input files
class _JStr(str):
    """A JSON string value that remembers where its body starts in the file text."""

    raw_start: int


class _JDict(dict):
    """A JSON object that remembers where it starts in the file text."""

    raw_start: int


class _PosParser:
    """A JSON parser that keeps the file offsets of objects and strings (input already validated)."""

    _WS = re.compile(r"[ \t\n\r]*")

    def __init__(self, raw: str):
        self.raw = raw

    def parse(self, i: int) -> tuple[Any, int]:
        raw = self.raw
        i = self._WS.match(raw, i).end()
        c = raw[i]
        if c == '"':
            s, end = json.decoder.scanstring(raw, i + 1)
            js = _JStr(s)
            js.raw_start = i + 1
            return js, end
        if c == "{":
            obj = _JDict()
            obj.raw_start = i
            i = self._WS.match(raw, i + 1).end()
            if raw[i] == "}":
                return obj, i + 1
            while True:
                i = self._WS.match(raw, i).end()
                key, i = json.decoder.scanstring(raw, i + 1)
                i = self._WS.match(raw, i).end() + 1  # ':'
                obj[key], i = self.parse(i)
                i = self._WS.match(raw, i).end()
                if raw[i] == "}":
                    return obj, i + 1
                i += 1  # ','
        if c == "[":
            arr: list[Any] = []
            i = self._WS.match(raw, i + 1).end()
            if raw[i] == "]":
                return arr, i + 1
            while True:
                val, i = self.parse(i)
                arr.append(val)
                i = self._WS.match(raw, i).end()
                if raw[i] == "]":
                    return arr, i + 1
                i += 1
        for lit, val in (("true", True), ("false", False), ("null", None), ("NaN", float("nan")),
                         ("Infinity", float("inf")), ("-Infinity", float("-inf"))):
            if raw.startswith(lit, i):
                return val, i + len(lit)
        m = json.scanner.NUMBER_RE.match(raw, i)
        assert m is not None, f"unparsable JSON at offset {i}"
        return json.loads(m.group(0)), m.end()


def _raw_offset(raw: str, start: int, n: int) -> int:
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


class SourceFile:
    """A file's text and the offset -> (line, column) mapping, both 1-based."""

    def __init__(self, path: str, raw: str):
        self.path = path
        self.raw = raw
        self._line_starts = [0] + [m.end() for m in re.finditer(r"\n", raw)]

    def line_col(self, offset: int) -> tuple[int, int]:
        idx = bisect.bisect_right(self._line_starts, offset) - 1
        return idx + 1, offset - self._line_starts[idx] + 1


@dataclass
class Field:
    """One string of the input that ends up in the prompt."""

    path: str
    """Where it sits in the request (``messages[0].content``, ``prompt``, ``system``, ``template``)."""
    role: str | None
    """Chat role of the message it belongs to; None outside chat."""
    text: str
    """The string itself."""
    source: SourceFile
    """The file it came from."""
    raw_start: int | None
    """File offset of its first character; None when it cannot be located exactly."""
    is_json: bool
    """Whether ``raw_start`` points into a JSON string (so escapes must be walked)."""

    def line_col(self, offset: int) -> tuple[int | None, int | None]:
        """1-based file line and column of character ``offset`` of this field."""
        if self.raw_start is None:
            return None, None
        pos = (_raw_offset(self.source.raw, self.raw_start, offset) if self.is_json
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
    """Chat messages with content flattened to text (chat and system kinds)."""
    field_message: list[int] = field(default_factory=list)
    """For each field, the index of its chat message (chat and system kinds)."""


def _field_of(value: Any, path: str, role: str | None, src: SourceFile) -> Field:
    start = getattr(value, "raw_start", None)
    return Field(path, role, str(value), src, start, True)


def _sample_from_request(obj: Any, src: SourceFile, where: str) -> list[Sample]:
    if not isinstance(obj, dict):
        raise LintUsageError(f"{where}: expected a request object, got {type(obj).__name__}")
    line = src.line_col(getattr(obj, "raw_start", 0))[0]
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list):
            raise LintUsageError(f"{where}: `messages` must be a list")
        messages: list[dict[str, Any]] = []
        fields: list[Field] = []
        owners: list[int] = []
        if isinstance(obj.get("system"), str):  # Anthropic-style top-level system prompt
            messages.append({"role": "system", "content": str(obj["system"])})
            fields.append(_field_of(obj["system"], "system", "system", src))
            owners.append(0)
        for i, msg in enumerate(msgs):
            if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
                raise LintUsageError(f"{where}: messages[{i}] must be an object with a `role`")
            role, content = str(msg["role"]), msg.get("content")
            parts: list[tuple[Any, str]] = []
            if isinstance(content, str):
                parts = [(content, f"messages[{i}].content")]
            elif isinstance(content, list):
                parts = [(p["text"], f"messages[{i}].content[{j}].text") for j, p in enumerate(content)
                         if isinstance(p, dict) and isinstance(p.get("text"), str)]
            elif content is not None:
                raise LintUsageError(f"{where}: messages[{i}].content must be a string or a list")
            for value, path in parts:
                fields.append(_field_of(value, path, role, src))
                owners.append(len(messages))
            messages.append({"role": role, "content": "\n".join(str(v) for v, _ in parts)})
        if not messages:
            raise LintUsageError(f"{where}: `messages` is empty")
        return [Sample(src, line, "chat", fields, messages, owners)]
    if "prompt" in obj:
        prompt = obj["prompt"]
        if isinstance(prompt, str):
            return [Sample(src, line, "completion", [_field_of(prompt, "prompt", None, src)])]
        if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            return [Sample(src, line, "completion", [_field_of(p, f"prompt[{j}]", None, src)])
                    for j, p in enumerate(prompt)]
        raise LintUsageError(f"{where}: `prompt` must be a string or a list of strings")
    if isinstance(obj.get("system"), str):
        f = _field_of(obj["system"], "system", "system", src)
        return [Sample(src, line, "system", [f], [{"role": "system", "content": f.text}], [0])]
    raise LintUsageError(f"{where}: not a request: expected an object with `messages`, `prompt` "
                         "or `system`")


def load_samples(path: str) -> list[Sample]:
    """Read one input file into samples.

    Raises:
        LintUsageError: the file is missing or unreadable, its JSON is invalid, or a JSON value is
            not a request.
    """
    if not os.path.isfile(path):
        raise LintUsageError(f"{path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            raw = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise LintUsageError(f"{path}: cannot read: {e}") from e
    src = SourceFile(path, raw)
    lower = path.lower()
    if lower.endswith(JSONL_SUFFIXES):
        samples: list[Sample] = []
        for lineno, start in enumerate(src._line_starts, start=1):
            end = raw.find("\n", start)
            text = raw[start:end if end >= 0 else len(raw)]
            if not text.strip():
                continue
            try:
                json.loads(text)
            except json.JSONDecodeError as e:
                raise LintUsageError(f"{path}:{lineno}:{e.colno}: invalid JSON: {e.msg}") from e
            value, _ = _PosParser(raw).parse(start)
            samples += _sample_from_request(value, src, f"{path}:{lineno}")
        if not samples:
            raise LintUsageError(f"{path}: no requests in this JSONL file")
        return samples
    if lower.endswith(JSON_SUFFIXES):
        try:
            json.loads(raw)
        except json.JSONDecodeError as e:
            raise LintUsageError(f"{path}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from e
        value, _ = _PosParser(raw).parse(0)
        items = value if isinstance(value, list) else [value]
        samples = []
        for i, item in enumerate(items):
            where = f"{path}:{src.line_col(getattr(item, 'raw_start', 0))[0]}"
            samples += _sample_from_request(item, src, where if isinstance(value, list) else path)
        return samples
    # anything else is a plain-text template: the whole file is one prompt
    return [Sample(src, 1, "template", [Field("template", None, raw, src, 0, False)])]


# =============================================================================== rendering
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
        text = sample.fields[0].text
        ids = tok.encode(text, add_special_tokens=True)
        stable_end = len(text)
        if sample.kind == "template":
            stop = first_stable_placeholder(text)
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
        seen[owner] = offset + len(f.text) + 1  # parts are joined with "\n"
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


# =============================================================================== findings
@dataclass
class Finding:
    """One reported trap."""

    kind: str
    """timestamp, date, uuid, hex_id, request_id, random_number, counter, template_placeholder,
    system_prompt_varies, tokenizer_drift or tokenizer_fingerprint."""
    file: str | None
    """Input file (None for findings about the tokenizers themselves)."""
    line: int | None
    """1-based line in the file."""
    column: int | None
    """1-based column in the file (None when the text is not in the file verbatim)."""
    field: str | None
    """Where in the request: ``messages[0].content``, ``prompt``, ``system``, ``template``,
    ``chat_template`` (text the chat template added)."""
    text: str
    """The volatile text (or a short excerpt)."""
    token: int | None
    """0-based index of the first prompt token it changes."""
    block: int | None
    """0-based KV block holding that token."""
    tokens_lost: int
    """Prompt tokens from the start of that block to the end of the prompt: recomputed on every
    request whose value differs."""
    blocks_lost: int
    """Full KV blocks from that block on that can no longer be reused."""
    message: str
    """One human-readable sentence."""
    details: dict[str, Any] = field(default_factory=dict)
    """Kind-specific extras (excerpts, variant counts, per-tokenizer ids...)."""


def _cost(num_tokens: int, token: int, block_size: int) -> tuple[int, int, int]:
    block = token // block_size
    return block, num_tokens - block * block_size, max(0, num_tokens // block_size - block)


def _blocks(n: int) -> str:
    return f"{n} block" if n == 1 else f"{n} blocks"


def _where(fld: Field | None, sample: Sample) -> str:
    if fld is None:
        return "text added by the chat template"
    if sample.kind == "template":
        return "template"
    if fld.role == "system":
        return f"system prompt ({fld.path})"
    if fld.role is None:
        return fld.path
    return f"{fld.role} message ({fld.path})"


def _short(text: str, limit: int = 60) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= limit else text[:limit - 1] + "…"


def volatile_findings(prompt: Prompt, tok: Tokenizer, block_size: int) -> list[Finding]:
    """Volatile spans of one prompt that sit before stable content, with their reuse cost."""
    sample = prompt.sample
    # scan every located field, and the gaps between them (text the chat template itself adds)
    pieces: list[tuple[int, str, Field | None]] = []
    covered: list[tuple[int, int]] = []
    for fld, start in zip(sample.fields, prompt.field_starts):
        if start is not None:
            pieces.append((start, fld.text, fld))
            covered.append((start, start + len(fld.text)))
    covered.sort()
    cursor = 0
    for s, e in covered + [(len(prompt.text), len(prompt.text))]:
        if s > cursor:
            pieces.append((cursor, prompt.text[cursor:s], None))
        cursor = max(cursor, e)
    hits: list[tuple[int, Match, Field | None]] = []
    for start, text, fld in pieces:
        for m in find_volatile(text):
            hits.append((start + m.start, m, fld))
    hits.sort(key=lambda h: h[0])
    spans = [(pos, pos + len(m.text)) for pos, m, _ in hits]

    findings: list[Finding] = []
    for pos, m, fld in hits:
        end = pos + len(m.text)
        if pos >= prompt.stable_end or not _stable_after(prompt.text, end, prompt.stable_end, spans):
            continue
        token = token_index(tok, prompt, pos)
        block, lost, blocks_lost = _cost(len(prompt.token_ids), token, block_size)
        if fld is not None:
            line, col = fld.line_col(m.start)
        else:
            line, col = sample.line, None
        where = _where(fld, sample)
        findings.append(Finding(
            kind=m.kind, file=sample.source.path, line=line, column=col,
            field=fld.path if fld is not None else "chat_template", text=m.text, token=token,
            block=block, tokens_lost=lost, blocks_lost=blocks_lost,
            message=(f'{m.kind} "{_short(m.text)}" in {where} at token {token} (block {block}): '
                     f"costs {lost:,} tokens of reuse per request"),
        ))
    return findings


def _stable_after(text: str, end: int, stable_end: int, spans: list[tuple[int, int]]) -> bool:
    """Whether stable words follow ``end`` before the per-request tail (other volatile spans and
    mere whitespace/punctuation do not count)."""
    i = end
    for s, e in spans:
        if e <= i or s >= stable_end:
            continue
        if any(c.isalnum() for c in text[i:min(s, stable_end)]):
            return True
        i = max(i, e)
    return any(c.isalnum() for c in text[i:stable_end])


def _mask(text: str) -> str:
    out, last = [], 0
    for m in find_volatile(text):
        out.append(text[last:m.start])
        out.append(f"<{m.kind}>")
        last = m.end
    return "".join(out) + text[last:]


def _same_template(a: str, b: str) -> bool:
    if _mask(a) == _mask(b):
        return True
    sm = difflib.SequenceMatcher(None, a, b, autojunk=False)
    return sm.real_quick_ratio() >= 0.5 and sm.quick_ratio() >= 0.5 and sm.ratio() >= 0.5


def _excerpt(text: str, at: int) -> str:
    lo, hi = max(0, at - 20), min(len(text), at + 30)
    return ("…" if lo else "") + text[lo:hi].replace("\n", "\\n") + ("…" if hi < len(text) else "")


def sample_findings(prompts: list[Prompt], block_size: int) -> tuple[list[Finding], dict[str, Any]]:
    """Cross-request checks over one file's prompts: ``system_prompt_varies`` and the shared prefix.

    Chat requests are grouped by template (system prompts equal once volatile spans are masked, or
    at least half similar); a group whose system prompts differ yields one finding at its first
    request that differs from the group's first.
    """
    stats: dict[str, Any] = {
        "file": prompts[0].sample.source.path, "requests": len(prompts),
        "shared_prefix_tokens": 0, "shared_prefix_blocks": 0,
    }
    shared = len(prompts[0].token_ids)
    for p in prompts[1:]:
        shared = min(shared, common_prefix_len(prompts[0].token_ids, p.token_ids))
    stats["shared_prefix_tokens"] = shared
    stats["shared_prefix_blocks"] = shared // block_size

    groups: list[list[Prompt]] = []
    for p in prompts:
        if p.sample.kind not in ("chat", "system"):
            continue
        sys_text = p.system_text or ""
        for g in groups:
            if _same_template(g[0].system_text or "", sys_text):
                g.append(p)
                break
        else:
            groups.append([p])
    findings: list[Finding] = []
    for g in groups:
        ref = g[0]
        variants = {p.system_text for p in g}
        if len(variants) < 2:
            continue
        other = next(p for p in g if p.system_text != ref.system_text)
        token = common_prefix_len(ref.token_ids, other.token_ids)
        group_shared = min(common_prefix_len(ref.token_ids, p.token_ids) for p in g)
        block, lost, blocks_lost = _cost(len(other.token_ids), token, block_size)
        a, b = ref.system_text or "", other.system_text or ""
        at = common_prefix_len(a, b)
        line, col, path = other.sample.line, None, None
        sys_fields = [f for f in other.sample.fields if f.role == "system"]
        if sys_fields and other.system_text is not None:
            # the first differing character, mapped into the system field that holds it
            off = at
            for f in sys_fields:
                if off <= len(f.text):
                    line, col = f.line_col(off)
                    path = f.path
                    break
                off -= len(f.text) + 1
        findings.append(Finding(
            kind="system_prompt_varies", file=other.sample.source.path, line=line, column=col,
            field=path, text=_excerpt(b, at), token=token, block=block, tokens_lost=lost,
            blocks_lost=blocks_lost,
            message=(f"system_prompt_varies: system prompt differs from line {ref.sample.line}'s at token {token} "
                     f"(block {block}): \"{_excerpt(a, at)}\" vs \"{_excerpt(b, at)}\"; "
                     f"{len(variants)} variants in {len(g)} requests share only {group_shared:,} "
                     f"tokens ({_blocks(group_shared // block_size)}); costs {lost:,} tokens of "
                     "reuse per request"),
            details={"reference_line": ref.sample.line, "reference_excerpt": _excerpt(a, at),
                     "variant_excerpt": _excerpt(b, at), "num_variants": len(variants),
                     "num_requests": len(g), "shared_prefix_tokens": group_shared,
                     "shared_prefix_blocks": group_shared // block_size},
        ))
    return findings, stats


# =============================================================================== runs
@dataclass
class Report:
    """What one lint run found."""

    findings: list[Finding]
    summary: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"findings": [asdict(f) for f in self.findings], "summary": self.summary}


def _by_kind(findings: list[Finding]) -> dict[str, int]:
    return dict(sorted(Counter(f.kind for f in findings).items()))


def lint_files(paths: Sequence[str], tok: Tokenizer, block_size: int) -> Report:
    """Volatile-content and cross-request checks over ``paths`` with one tokenizer.

    Raises:
        LintUsageError: an input file is missing or malformed.
    """
    per_file = [(p, load_samples(p)) for p in paths]
    findings: list[Finding] = []
    samples_stats: list[dict[str, Any]] = []
    warnings: list[str] = []
    num_prompts = 0
    for _, samples in per_file:
        prompts = [render(s, tok) for s in samples]
        num_prompts += len(prompts)
        for p in prompts:
            warnings += p.warnings
            findings += volatile_findings(p, tok, block_size)
        if len(prompts) > 1:
            more, stats = sample_findings(prompts, block_size)
            findings += more
            samples_stats.append(stats)
    findings.sort(key=lambda f: (paths.index(f.file) if f.file in paths else -1, f.line or 0,
                                 f.column or 0, f.kind))
    summary = {
        "files": len(paths), "prompts": num_prompts, "findings": len(findings),
        "by_kind": _by_kind(findings), "clean": not findings,
        "max_tokens_lost": max((f.tokens_lost for f in findings), default=0),
        "block_size": block_size, "tokenizer": tok.source,
        "tokenizer_fingerprint": tok.fingerprint, "samples": samples_stats, "warnings": warnings,
    }
    return Report(findings, summary)


def _render_ids(sample: Sample, tok: Tokenizer) -> tuple[list[int] | None, str | None]:
    if sample.kind in ("chat", "system") and not tok.chat_template:
        return None, f"{tok.source} has no chat template"
    p = render(sample, tok)
    return p.token_ids, None


def check_drift(paths: Sequence[str], tok_a: Tokenizer, tok_b: Tokenizer, block_size: int) -> Report:
    """Tokenize every input text with two tokenizers and report where their prefix blocks part.

    Chat requests are rendered with each tokenizer's own chat template, as each server would.

    Raises:
        LintUsageError: an input file is missing or malformed.
    """
    per_file = [(p, load_samples(p)) for p in paths]
    findings: list[Finding] = []
    texts: list[dict[str, Any]] = []
    if tok_a.fingerprint != tok_b.fingerprint:
        findings.append(Finding(
            kind="tokenizer_fingerprint", file=None, line=None, column=None, field=None,
            text=f"{tok_a.fingerprint} != {tok_b.fingerprint}", token=0, block=0, tokens_lost=0,
            blocks_lost=0,
            message=(f"tokenizer_fingerprint: fingerprints differ ({tok_a.fingerprint} vs {tok_b.fingerprint}): "
                     "hotprefix roots every block hash in the tokenizer fingerprint, so switching "
                     "reuses no cached block, even where the token ids agree"),
            details={"tokenizer_a": tok_a.source, "tokenizer_b": tok_b.source}))
    for _, samples in per_file:
        for s in samples:
            ids_a, err_a = _render_ids(s, tok_a)
            ids_b, err_b = _render_ids(s, tok_b)
            where = s.fields[0].path if s.kind != "chat" else "rendered chat prompt"
            entry: dict[str, Any] = {"file": s.source.path, "line": s.line, "field": where}
            if ids_a is None or ids_b is None:
                entry.update(error=err_a or err_b, blocks_match=False)
                texts.append(entry)
                findings.append(Finding(
                    kind="tokenizer_drift", file=s.source.path, line=s.line, column=None,
                    field=where, text="", token=0, block=0, tokens_lost=len(ids_a or ids_b or []),
                    blocks_lost=len(ids_a or ids_b or []) // block_size,
                    message=f"tokenizer_drift in {where}: {err_a or err_b}"))
                continue
            diff = common_prefix_len(ids_a, ids_b)
            full_a, full_b = len(ids_a) // block_size, len(ids_b) // block_size
            same_blocks = min(diff // block_size, full_a, full_b)
            identical = ids_a == ids_b
            entry.update(num_tokens_a=len(ids_a), num_tokens_b=len(ids_b),
                         first_diff=None if identical else diff, matching_blocks=same_blocks,
                         full_blocks=full_a, blocks_match=identical or same_blocks == full_a == full_b)
            texts.append(entry)
            if identical:
                continue
            block, lost, blocks_lost = _cost(len(ids_a), diff, block_size)
            ta = tok_a.decode(ids_a[diff:diff + 4], skip_special_tokens=False)
            tb = tok_b.decode(ids_b[diff:diff + 4], skip_special_tokens=False)
            findings.append(Finding(
                kind="tokenizer_drift", file=s.source.path, line=s.line, column=None, field=where,
                text=_short(ta, 40), token=diff, block=block, tokens_lost=lost,
                blocks_lost=blocks_lost,
                message=(f"tokenizer_drift in {where}: first differing token {diff} (block {block}): "
                         f"A {ids_a[diff:diff + 4]} \"{_short(ta, 30)}\" vs B {ids_b[diff:diff + 4]} "
                         f"\"{_short(tb, 30)}\"; {same_blocks} of {full_a} full blocks still match; "
                         f"costs {lost:,} tokens of reuse per request"),
                details={"num_tokens_a": len(ids_a), "num_tokens_b": len(ids_b),
                         "ids_a": ids_a[diff:diff + 8], "ids_b": ids_b[diff:diff + 8],
                         "matching_blocks": same_blocks, "full_blocks": full_a}))
    summary = {
        "files": len(paths), "prompts": len(texts), "findings": len(findings),
        "by_kind": _by_kind(findings), "clean": not findings,
        "max_tokens_lost": max((f.tokens_lost for f in findings), default=0),
        "block_size": block_size,
        "drift": {"tokenizer_a": tok_a.source, "tokenizer_b": tok_b.source,
                  "fingerprint_a": tok_a.fingerprint, "fingerprint_b": tok_b.fingerprint,
                  "fingerprints_match": tok_a.fingerprint == tok_b.fingerprint, "texts": texts},
    }
    return Report(findings, summary)


def format_human(report: Report) -> str:
    """The report as compiler-style lines plus a summary."""
    lines = []
    for f in report.findings:
        loc = ":".join(str(x) for x in (f.file or "<tokenizers>", f.line, f.column) if x is not None)
        lines.append(f"{loc}: {f.message}")
    s = report.summary
    for w in s.get("warnings", []):
        lines.append(f"warning: {w}")
    for st in s.get("samples", []):
        lines.append(f"{st['file']}: {st['requests']} requests share a {st['shared_prefix_tokens']:,}"
                     f"-token prefix ({_blocks(st['shared_prefix_blocks'])} of {s['block_size']} tokens)")
    drift = s.get("drift")
    if drift:
        ok = sum(1 for t in drift["texts"] if t.get("first_diff") is None and "error" not in t)
        lines.append(f"tokenizers: A={drift['tokenizer_a']} ({drift['fingerprint_a']}) "
                     f"B={drift['tokenizer_b']} ({drift['fingerprint_b']}); "
                     f"{ok} of {len(drift['texts'])} texts tokenize identically")
    if report.findings:
        kinds = ", ".join(f"{n} {k}" for k, n in s["by_kind"].items())
        lines.append(f"{s['findings']} finding{'s' if s['findings'] != 1 else ''} ({kinds}) in "
                     f"{s['prompts']} prompts from {s['files']} files; worst costs "
                     f"{s['max_tokens_lost']:,} tokens of reuse per request")
    else:
        lines.append(f"clean: {s['prompts']} prompts from {s['files']} files, no prefix-cache traps")
    return "\n".join(lines)


# =============================================================================== CLI
class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so ``main`` returns 2 rather than raising."""

    def error(self, message: str) -> NoReturn:
        raise LintUsageError(f"{message}\n{self.format_usage().rstrip()}")

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message:
            sys.stderr.write(message)
        raise _Exit(status)


class _Exit(Exception):
    def __init__(self, status: int):
        super().__init__(status)
        self.status = status


def _positive(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hotprefix lint",
                description="Static checks for prompt templates and request samples that would "
                            "defeat the prefix cache: volatile content before stable content, "
                            "system prompts that vary between requests, tokenizer drift. Exit "
                            "status: 0 clean, 1 findings, 2 bad usage.")
    p.add_argument("files", nargs="+", metavar="FILE",
                   help="prompt templates (.txt/.j2/.md...), JSON requests (.json) or JSONL "
                        "request logs (.jsonl)")
    p.add_argument("--json", action="store_true", help="print one JSON object {findings, summary}")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--tokenizer", metavar="PATH",
                       help="tokenizer (.gguf, HF directory or tokenizer.json); default: the "
                            "default model's")
    group.add_argument("--tokenizers", nargs=2, metavar=("A", "B"),
                       help="drift check: tokenize every text with A and with B and report where "
                            "their prefix blocks stop matching")
    p.add_argument("--block-size", type=_positive, default=CacheConfig.block_size, metavar="N",
                   help=f"tokens per KV block (default {CacheConfig.block_size})")
    return p


def _load_tokenizer(path: str | None) -> Tokenizer:
    if path is None:
        from hotprefix.model.loader import ModelLoadError, default_model_path  # needs torch: lazily
        try:
            path = default_model_path()
        except ModelLoadError as e:
            raise LintUsageError(f"{e}; or pass --tokenizer PATH") from e
    try:
        return Tokenizer.load(path)
    except TokenizerError as e:
        raise LintUsageError(str(e)) from e


def main(argv: list[str]) -> int:
    """``hotprefix lint FILE... [--json] [--tokenizer PATH | --tokenizers A B] [--block-size N]``.

    Returns:
        0 when clean, 1 on findings, 2 on bad usage (the message goes to stderr).
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        for path in args.files:  # fail on a missing input before spending seconds on a tokenizer
            if not os.path.isfile(path):
                raise LintUsageError(f"{path}: no such file")
        if args.tokenizers:
            tok_a, tok_b = (_load_tokenizer(p) for p in args.tokenizers)
            report = check_drift(args.files, tok_a, tok_b, args.block_size)
        else:
            report = lint_files(args.files, _load_tokenizer(args.tokenizer), args.block_size)
    except _Exit as e:
        return e.status
    except LintUsageError as e:
        sys.stderr.write(f"hotprefix lint: error: {e}\n")
        return EXIT_USAGE
    if args.json:
        print(json.dumps(report.to_json(), indent=2, ensure_ascii=False))
    else:
        print(format_human(report))
    return EXIT_FINDINGS if report.findings else EXIT_CLEAN


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
