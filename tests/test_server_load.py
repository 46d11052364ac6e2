"""Load test on loopback: `hotprefix serve` (the CLI, in a subprocess, tiny random model) under 32
concurrent streaming clients, a third of which disconnect mid-stream, with malformed requests mixed
in. Every well-formed request completes, the server stays healthy, and once all requests are done
no KV block is in use (disconnects released theirs). Bounded: 32 clients, small max_tokens, 120 s.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time

import httpx
import pytest

from server_support import LONG_SYSTEM, free_port, wait_idle

NUM_CLIENTS = 32
MAX_TOKENS = 16
DISCONNECT_MAX_TOKENS = 400  # long enough that the disconnect surely lands mid-stream


@pytest.fixture(scope="module")
def cli_server(tiny_model_dir, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hotprefix.cli", "serve", tiny_model_dir, "--host", "127.0.0.1",
             "--port", str(port), "--num-threads", "2", "--num-blocks", "2048",
             "--max-num-seqs", "32", "--max-waiting", "256"],
            stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, open(log).read()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        yield url, log
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


def _model(url: str) -> str:
    return httpx.get(url + "/v1/models").json()["data"][0]["id"]


async def _stream_client(c: httpx.AsyncClient, model: str, i: int, disconnect: bool) -> dict:
    system = f"[load system {i % 4}] " + LONG_SYSTEM
    if i % 2:
        route, body = "/v1/chat/completions", {"messages": [
            {"role": "system", "content": system}, {"role": "user", "content": f"question {i}"}]}
    else:
        route, body = "/v1/completions", {"prompt": system + f"\nQuestion {i}:"}
    body.update(model=model, stream=True, temperature=0, ignore_eos=True,
                max_tokens=DISCONNECT_MAX_TOKENS if disconnect else MAX_TOKENS,
                stream_options={"include_usage": True})
    result = {"i": i, "disconnect": disconnect, "done": False, "usage": None, "finish": None, "events": 0}
    async with c.stream("POST", route, json=body) as r:
        result["status"] = r.status_code
        async for line in r.aiter_lines():
            if not line:
                continue
            result["events"] += 1
            if disconnect and result["events"] >= 3:
                break  # leaving the block closes the connection mid-stream
            if line == "data: [DONE]":
                result["done"] = True
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                result["usage"] = chunk["usage"]
            for ch in chunk.get("choices", []):
                result["finish"] = ch["finish_reason"] or result["finish"]
    return result


MALFORMED = [
    (b"{not json", "/v1/completions"),
    (b'{"model": 1, "prompt": "x"}', "/v1/completions"),
    (b'{"model": "MODEL", "prompt": "x", "max_tokens": 0}', "/v1/completions"),
    (b'{"model": "MODEL", "prompt": "x", "temperature": -1}', "/v1/completions"),
    (b'{"model": "MODEL", "prompt": "x", "top_p": 2}', "/v1/completions"),
    (b'{"model": "MODEL", "prompt": ""}', "/v1/completions"),
    (b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}', "/v1/chat/completions"),
    (b'{"model": "MODEL", "messages": []}', "/v1/chat/completions"),
    (b'{"model": "MODEL", "messages": [{"role": "user"}], "bogus": 1}', "/v1/chat/completions"),
    (b"[]", "/v1/chat/completions"),
]


async def _malformed(c: httpx.AsyncClient, model: str, raw: bytes, route: str) -> int:
    r = await c.post(route, content=raw.replace(b"MODEL", model.encode()),
                     headers={"content-type": "application/json"})
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    return r.status_code


def test_concurrent_streams_disconnects_and_garbage(cli_server):
    url, log = cli_server
    model = _model(url)

    async def scenario():
        limits = httpx.Limits(max_connections=NUM_CLIENTS + len(MALFORMED) + 4)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as c:
            tasks = [_stream_client(c, model, i, disconnect=(i % 3 == 0)) for i in range(NUM_CLIENTS)]
            bad = [_malformed(c, model, raw, route) for raw, route in MALFORMED]
            return await asyncio.gather(*tasks), await asyncio.gather(*bad)

    results, bad_statuses = asyncio.run(asyncio.wait_for(scenario(), 120))  # 120 s: a hang guard
    assert bad_statuses == [400] * len(MALFORMED)
    completed = [r for r in results if not r["disconnect"]]
    dropped = [r for r in results if r["disconnect"]]
    assert len(dropped) == 11 and len(completed) == 21
    for r in results:
        assert r["status"] == 200, r
    for r in completed:
        assert r["done"] and r["finish"] == "length", r
        assert r["usage"]["completion_tokens"] == MAX_TOKENS
        assert isinstance(r["usage"]["prompt_tokens_details"]["cached_tokens"], int)
    for r in dropped:
        assert not r["done"]
    # four distinct system prompts shared by 32 clients: most prompts hit the cache
    assert sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for r in completed) >= 10

    assert httpx.get(url + "/health", timeout=30).json() == {"status": "ok"}
    stats = wait_idle(url, timeout=60)
    assert stats["blocks_in_use"] == 0 and stats["running"] == 0 and stats["waiting"] == 0
    # disconnected requests were aborted, not run to their 400 tokens: only the 21 finished
    metrics = httpx.get(url + "/metrics").text
    finished = sum(float(v) for v in re.findall(r"^hotprefix_requests_total\{[^}]*\} (\S+)", metrics, re.M))
    assert finished == len(completed)
    gen = float(re.search(r"^hotprefix_generation_tokens_total (\S+)", metrics, re.M).group(1))
    assert gen == len(completed) * MAX_TOKENS
    # and the server still serves
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "after the storm",
                                                  "max_tokens": 2, "temperature": 0}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert "Traceback" not in open(log).read()
