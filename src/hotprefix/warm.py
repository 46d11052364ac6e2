"""``hotprefix warm FILE... [--url URL] [--api-key KEY]``: prefill system prompts on a running
server (``POST /v1/cache/warm``) so the first user does not pay for them.

A FILE is a text file (one prompt: the whole file is a system prompt, sent through the chat
template as ``[{"role": "system", ...}]``), a JSON file (a list of message lists, a list of strings, or
``{"messages": [...]}`` / ``{"prompts": [...]}``) or a JSONL file (one conversation or prompt per line).
Exit status: 0 warmed, 1 the server refused, 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from hotprefix.config import ServerConfig


def _items(path: str) -> tuple[list[str], list[list[dict[str, Any]]]]:
    prompts: list[str] = []
    convs: list[list[dict[str, Any]]] = []

    def take(obj: Any) -> None:
        if isinstance(obj, str):
            prompts.append(obj)
        elif isinstance(obj, list) and obj and all(isinstance(m, dict) for m in obj):
            convs.append(obj)
        elif isinstance(obj, dict) and "messages" in obj:
            take(obj["messages"])
        elif isinstance(obj, dict) and "prompt" in obj:
            take(obj["prompt"])
        elif isinstance(obj, dict) and "system" in obj:
            convs.append([{"role": "system", "content": obj["system"]}])
        elif isinstance(obj, dict) and "prompts" in obj:
            for p in obj["prompts"]:
                take(p)
        elif isinstance(obj, list):
            for o in obj:
                take(o)
        else:
            raise ValueError(f"{path}: cannot read a prompt from {str(obj)[:60]!r}")

    with open(path) as f:
        text = f.read()
    if path.endswith(".jsonl"):
        for i, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    take(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}: invalid JSON: {e.msg}") from None
    elif path.endswith(".json"):
        try:
            take(json.loads(text))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
    else:
        convs.append([{"role": "system", "content": text}])
    return prompts, convs


def main(argv: list[str]) -> int:
    d = ServerConfig()
    p = argparse.ArgumentParser(prog="hotprefix warm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("--url", default=f"http://{d.host}:{d.port}", help="the server (default: %(default)s)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="API key (default: $OPENAI_API_KEY); warms that key's tenant")
    p.add_argument("--timeout", type=float, default=600.0)
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return 2 if e.code else 0
    import httpx

    prompts: list[str] = []
    convs: list[list[dict[str, Any]]] = []
    try:
        for f in args.files:
            a, b = _items(f)
            prompts += a
            convs += b
    except (OSError, ValueError) as e:
        print(f"hotprefix warm: error: {e}", file=sys.stderr)
        return 2
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    status = 0
    for body in ([{"prompts": prompts}] if prompts else []) + ([{"messages": convs}] if convs else []):
        try:
            r = httpx.post(args.url.rstrip("/") + "/v1/cache/warm", json=body, headers=headers,
                           timeout=args.timeout)
        except httpx.HTTPError as e:
            print(f"hotprefix warm: error: cannot reach {args.url}: {e}", file=sys.stderr)
            return 1
        if r.status_code != 200:
            msg = r.json().get("error", {}).get("message", r.text) if r.headers.get(
                "content-type", "").startswith("application/json") else r.text
            print(f"hotprefix warm: server refused ({r.status_code}): {msg}", file=sys.stderr)
            status = 1
            continue
        for item in r.json().get("data", []):
            print(json.dumps(item))
    return status
