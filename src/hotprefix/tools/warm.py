"""``hotprefix warm FILE... [--url URL] [--api-key KEY]``: prefill system prompts on a running
server (``POST /v1/cache/warm``) so the first user does not pay for them.

Files are read as ``hotprefix lint`` reads them (the same readers): a text file is one prompt
(the whole file is a system prompt, sent through the chat template as ``[{"role": "system", ...}]``);
a JSON file holds requests (``messages``, ``prompt``, ``system``), a list of them, message lists or
strings, or a warm body (``{"prompts": [...]}``, ``{"messages": [[...], ...]}``); a JSONL file one
of those per line. Source code is refused: its templates are not prompts until filled in.
Exit status: 0 warmed, 1 the server refused, 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from hotprefix.config.sections import ServerConfig
from hotprefix.lint.samples import LintUsageError
from hotprefix.lint.sources import is_code, load_samples


def read_prompts(path: str) -> tuple[list[str], list[list[dict[str, Any]]]]:
    """The completion prompts and conversations ``path`` holds.

    Raises:
        LintUsageError: the file is missing, malformed or source code.
    """
    if is_code(path):
        raise LintUsageError(f"{path}: source code holds templates, not prompts; warm a file with "
                             "the rendered system prompt instead")
    prompts: list[str] = []
    convs: list[list[dict[str, Any]]] = []
    for sample in load_samples(path):
        if sample.kind == "completion":
            prompts.append(sample.fields[0].text)
        elif sample.kind == "template":
            convs.append([{"role": "system", "content": sample.fields[0].text}])
        else:
            convs.append(sample.messages)
    return prompts, convs


def main(argv: list[str]) -> int:
    d = ServerConfig()
    p = argparse.ArgumentParser(prog="hotprefix warm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("--url", default=f"http://{d.host}:{d.port}", help="the server (default: %(default)s)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="API key (default: $OPENAI_API_KEY); warms that key's tenant")
    p.add_argument("--timeout", type=_seconds, default=600.0, help="seconds (default: %(default)s)")
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return 2 if e.code else 0
    import httpx

    try:
        url = httpx.URL(args.url.rstrip("/") + "/v1/cache/warm")
    except httpx.InvalidURL as e:
        print(f"hotprefix warm: error: --url {args.url!r}: {e}", file=sys.stderr)
        return 2

    prompts: list[str] = []
    convs: list[list[dict[str, Any]]] = []
    try:
        for f in args.files:
            a, b = read_prompts(f)
            prompts += a
            convs += b
    except LintUsageError as e:
        print(f"hotprefix warm: error: {e}", file=sys.stderr)
        return 2
    if not prompts and not convs:
        print(f"hotprefix warm: error: no prompts in {', '.join(args.files)}", file=sys.stderr)
        return 2
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    status = 0
    for body in ([{"prompts": prompts}] if prompts else []) + ([{"messages": convs}] if convs else []):
        try:
            r = httpx.post(url, json=body, headers=headers, timeout=args.timeout)
        except httpx.HTTPError as e:
            print(f"hotprefix warm: error: cannot reach {args.url}: {e}", file=sys.stderr)
            return 1
        answer = _json(r)
        data = answer.get("data") if isinstance(answer, dict) else None
        if r.status_code != 200 or not isinstance(data, list):
            what = "server refused" if r.status_code != 200 else "not a warm answer"
            print(f"hotprefix warm: {what} ({r.status_code}): {_error_text(r, answer)}",
                  file=sys.stderr)
            status = 1
            continue
        for item in data:
            print(json.dumps(item))
    return status


def _seconds(text: str) -> float:
    """A positive, finite number of seconds (argparse type)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return v


def _json(r: Any) -> Any:
    """The response's JSON, or None when it is not JSON."""
    try:
        return r.json()
    except ValueError:
        return None


def _error_text(r: Any, answer: Any) -> str:
    """What the server said: an OpenAI-style error's message, else the body's start."""
    err = answer.get("error") if isinstance(answer, dict) else None
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return err["message"]
    if isinstance(err, str):
        return err
    text = r.text.strip()
    return (text[:300] + "...") if len(text) > 300 else text or "(empty answer)"
