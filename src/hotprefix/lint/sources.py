"""Readers of the files ``hotprefix lint`` and ``hotprefix warm`` take, into ``Sample``s.

- plain text (.txt, .j2, .md, anything else): the whole file is one prompt template;
- JSON (.json): one OpenAI-style request (``messages``, optionally an Anthropic-style top-level
  ``system``; ``prompt``; ``system`` alone), a list of them, a bare message list, a string, or a
  warm request body (``{"prompts": [...]}``, ``{"messages": [[...], ...]}``, lists of either);
- JSONL (.jsonl, .ndjson): one of those per line;
- source code: Python (.py) and JavaScript/TypeScript, whose prompt templates are found in the code
  (``python_source``, ``js_source``).

Every string keeps its file position, so findings point at a line and column. Knows nothing about
tokenizers or findings.
"""

from __future__ import annotations

import json
import os
from typing import Any

from hotprefix.lint.js_source import JS_SUFFIXES, js_samples
from hotprefix.lint.jsonpos import parse_at
from hotprefix.lint.python_source import PYTHON_SUFFIXES, python_samples
from hotprefix.lint.samples import Field, LintUsageError, Sample, SourceFile

JSON_SUFFIXES = (".json",)
JSONL_SUFFIXES = (".jsonl", ".ndjson")
CODE_SUFFIXES = PYTHON_SUFFIXES + JS_SUFFIXES


def _field_of(value: Any, path: str, role: str | None, src: SourceFile) -> Field:
    return Field(path, role, str(value), src, getattr(value, "raw_start", None), True)


def _line(obj: Any, src: SourceFile) -> int:
    return src.line_col(getattr(obj, "raw_start", 0))[0]


def _is_conversation(value: Any) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(m, dict) and "role" in m for m in value))


def _chat_sample(msgs: list[Any], system: Any, src: SourceFile, line: int, where: str,
                 prefix: str) -> Sample:
    messages: list[dict[str, Any]] = []
    fields: list[Field] = []
    owners: list[int] = []
    if isinstance(system, str):  # Anthropic-style top-level system prompt
        messages.append({"role": "system", "content": str(system)})
        fields.append(_field_of(system, "system", "system", src))
        owners.append(0)
    for i, msg in enumerate(msgs):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise LintUsageError(f"{where}: {prefix}[{i}] must be an object with a `role`")
        role, content = str(msg["role"]), msg.get("content")
        role = "system" if role == "developer" else role  # as the server reads it
        parts: list[tuple[Any, str]] = []
        if isinstance(content, str):
            parts = [(content, f"{prefix}[{i}].content")]
        elif isinstance(content, list):
            parts = [(p["text"], f"{prefix}[{i}].content[{j}].text") for j, p in enumerate(content)
                     if isinstance(p, dict) and isinstance(p.get("text"), str)]
        elif content is not None:
            raise LintUsageError(f"{where}: {prefix}[{i}].content must be a string or a list")
        for value, path in parts:
            fields.append(_field_of(value, path, role, src))
            owners.append(len(messages))
        message = {"role": role, "content": "".join(str(v) for v, _ in parts)}  # as the server joins
        if isinstance(msg.get("name"), str) and msg["name"]:
            message["name"] = str(msg["name"])
        messages.append(message)
    if not messages:
        raise LintUsageError(f"{where}: `messages` is empty")
    return Sample(src, line, "chat", fields, messages, owners)


def samples_from_value(obj: Any, src: SourceFile, where: str, prefix: str = "") -> list[Sample]:
    """The samples one parsed JSON value holds (a request, a message list, a string, a list of
    those); ``prefix`` is its JSON path, used for strings and message lists.

    Raises:
        LintUsageError: the value is not a request.
    """
    line = _line(obj, src)
    if isinstance(obj, str):
        return [Sample(src, line, "completion", [_field_of(obj, prefix or "prompt", None, src)])]
    if _is_conversation(obj):
        return [_chat_sample(obj, None, src, line, where, prefix)]
    if isinstance(obj, list):
        return [s for j, item in enumerate(obj)
                for s in samples_from_value(item, src, where, f"{prefix}[{j}]")]
    if not isinstance(obj, dict):
        raise LintUsageError(f"{where}: expected a request object, got {type(obj).__name__}")
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list):
            raise LintUsageError(f"{where}: `messages` must be a list")
        if msgs and all(isinstance(m, list) for m in msgs):  # a warm request: several conversations
            return [_chat_sample(m, None, src, _line(m, src), where, f"messages[{i}]")
                    for i, m in enumerate(msgs)]
        return [_chat_sample(msgs, obj.get("system"), src, line, where, "messages")]
    for key in ("prompt", "prompts"):
        if key in obj:
            prompt = obj[key]
            if isinstance(prompt, str):
                return [Sample(src, line, "completion", [_field_of(prompt, key, None, src)])]
            if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
                return [Sample(src, line, "completion", [_field_of(p, f"{key}[{j}]", None, src)])
                        for j, p in enumerate(prompt)]
            raise LintUsageError(f"{where}: `{key}` must be a string or a list of strings")
    if isinstance(obj.get("system"), str):
        f = _field_of(obj["system"], "system", "system", src)
        return [Sample(src, line, "system", [f], [{"role": "system", "content": f.text}], [0])]
    raise LintUsageError(f"{where}: not a request: expected an object with `messages`, `prompt` "
                         "or `system`")


def check_input_file(path: str) -> None:
    """Raise LintUsageError unless ``path`` is a file (a directory says so)."""
    if os.path.isdir(path):
        raise LintUsageError(f"{path}: a directory; name the files (e.g. {path.rstrip('/')}/*.json)")
    if not os.path.isfile(path):
        raise LintUsageError(f"{path}: no such file")


def read_source(path: str) -> SourceFile:
    """The file's text.

    Raises:
        LintUsageError: it is missing, unreadable or not UTF-8.
    """
    check_input_file(path)
    try:
        with open(path, encoding="utf-8") as f:
            return SourceFile(path, f.read())
    except (OSError, UnicodeDecodeError) as e:
        raise LintUsageError(f"{path}: cannot read: {e}") from e


def is_code(path: str) -> bool:
    """Whether ``path`` is read as source code (its templates) rather than as a prompt or requests."""
    return path.lower().endswith(CODE_SUFFIXES)


def load_samples(path: str) -> list[Sample]:
    """Read one input file into samples.

    Raises:
        LintUsageError: the file is missing or unreadable, its JSON (or Python) is invalid or
            nested too deeply to read, or a JSON value is not a request.
    """
    try:
        return _load_samples(path)
    except RecursionError:
        raise LintUsageError(f"{path}: nested too deeply to read (JSON arrays or objects, or "
                             "source code, thousands of levels deep)") from None


def _load_samples(path: str) -> list[Sample]:
    src = read_source(path)
    raw, lower = src.raw, path.lower()
    if lower.endswith(JSONL_SUFFIXES):
        samples: list[Sample] = []
        for lineno, start in enumerate(src.line_starts, start=1):
            end = raw.find("\n", start)
            text = raw[start:end if end >= 0 else len(raw)]
            if not text.strip():
                continue
            try:
                json.loads(text)
            except json.JSONDecodeError as e:
                raise LintUsageError(f"{path}:{lineno}:{e.colno}: invalid JSON: {e.msg}") from e
            samples += samples_from_value(parse_at(raw, start)[0], src, f"{path}:{lineno}")
        if not samples:
            raise LintUsageError(f"{path}: no requests in this JSONL file")
        return samples
    if lower.endswith(JSON_SUFFIXES):
        try:
            json.loads(raw)
        except json.JSONDecodeError as e:
            raise LintUsageError(f"{path}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from e
        value = parse_at(raw, 0)[0]
        if isinstance(value, list) and not _is_conversation(value):  # a list of requests
            return [s for j, item in enumerate(value)
                    for s in samples_from_value(item, src, f"{path}:{_line(item, src)}", f"[{j}]")]
        return samples_from_value(value, src, path)
    if lower.endswith(PYTHON_SUFFIXES):
        return python_samples(src)
    if lower.endswith(JS_SUFFIXES):
        return js_samples(src)
    # anything else is a plain-text template: the whole file is one prompt
    return [Sample(src, 1, "template", [Field("template", None, raw, src, 0, False)])]
