"""The README's dashboard screenshot, taken against the real default model.

Starts a server (the embedded default model, a small KV pool so that evictions show, a disk KV
tier below it in a temporary directory, an API key file with three tenants and an admin key), signs a headless Chromium in through
``GET /dashboard?key=ADMIN``, then sends chat traffic for ``--seconds``: each tenant's requests
share its system prompt, some conversations go on for a second turn, and one tenant's system prompt
starts with the current time (the article's first trap: its requests miss as ``diverged``). Then
it saves a full-page screenshot.

Run (from the repository root; needs Debian's ``chromium`` and the ``playwright`` package of the
dev extra, nothing is downloaded):

    .venv/bin/python benchmarks/screenshot_dashboard.py [--out docs/dashboard.png] [--seconds 90]
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import httpx
import uvicorn

from hotprefix.config.sections import EngineConfig, ServerConfig
from hotprefix.server.app import create_app

ADMIN = "sk-admin-screenshot"
KEYS = {"sk-support": "support", "sk-docs": "docs", "sk-sales": "sales"}
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]

SYSTEMS = {
    "support": (
        "You are the support assistant of Northwind Outfitters, a shop for hiking and camping gear. "
        "Answer politely and briefly. Orders ship within two working days; returns are accepted for "
        "thirty days with the receipt; tents and sleeping bags carry a two-year warranty; boots can be "
        "exchanged once for another size. Never promise a delivery date. If a customer is upset, "
        "apologise once and offer to open a ticket. Do not discuss competitors or prices of other shops."),
    "docs": (
        "You are Quill, the documentation assistant of Harbor Logistics. You answer questions about "
        "shipping schedules, customs paperwork, container sizes and warehouse hours in at most three "
        "sentences. Warehouses open at seven and close at eight on weekdays. Customs paperwork must be "
        "filed forty-eight hours before departure. Refrigerated containers must be plugged in within "
        "thirty minutes of arrival. The internal tools are Dockside, Manifest and Tally."),
    "sales": (
        "You are a sales assistant for a software company that sells a project tracker. Plans: Free "
        "(three users), Team (per user, monthly or yearly) and Enterprise (single sign-on, audit log). "
        "Suggest a plan from the team size the user gives; offer a demo for more than fifty users."),
}
QUESTIONS = ["Where is my order?", "Can I return boots I wore once?", "What sizes do you have?",
             "When does the warehouse open on Saturday?", "How early must I file customs papers?",
             "Which plan for a team of twelve?", "Do you have single sign-on?", "Is there a free trial?",
             "My tent has a hole, what now?", "What is Tally used for?", "Can I pay yearly?",
             "How long is the warranty on sleeping bags?"]


def serve(app) -> tuple[uvicorn.Server, threading.Thread, str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


def chat(url: str, model: str, key: str, messages: list[dict]) -> str:
    r = httpx.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=300,
                   json={"model": model, "messages": messages, "max_tokens": 12, "temperature": 0})
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def conversation(url: str, model: str, rng: random.Random) -> None:
    key, tenant = rng.choice(list(KEYS.items()))
    system = SYSTEMS[tenant]
    if tenant == "support" and rng.random() < 0.3:  # the trap: a timestamp before the stable part
        system = f"Current time: {datetime.now(timezone.utc).isoformat(timespec='seconds')}. " + system
    messages = [{"role": "system", "content": system}, {"role": "user", "content": rng.choice(QUESTIONS)}]
    answer = chat(url, model, key, messages)
    if rng.random() < 0.5:  # a second turn reuses the first turn's prompt and answer
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": rng.choice(QUESTIONS)}]
        chat(url, model, key, messages)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/dashboard.png")
    ap.add_argument("--seconds", type=float, default=90.0, help="seconds of traffic before the screenshot")
    ap.add_argument("--kv-cache-memory", default="40MiB", help="small, so that the pool evicts")
    ap.add_argument("--no-tier", action="store_true", help="no disk KV tier below the pool")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=3)
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys.json"
        keys.write_text(json.dumps(KEYS))
        tiers = [] if args.no_tier else [f"disk:{Path(tmp) / 'kv'}"]
        cfg = EngineConfig.from_options(kv_cache_memory=args.kv_cache_memory, num_threads=args.threads,
                                        kv_store=tiers)
        app = create_app(cfg, ServerConfig(api_keys=str(keys), admin_key=ADMIN))
        model = app.state.hotprefix.served_name
        server, thread, url = serve(app)
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
                page = browser.new_page(viewport={"width": 1440, "height": 900})
                page.goto(f"{url}/dashboard?key={ADMIN}")  # signs in, lands on /dashboard
                rng = random.Random(7)
                deadline = time.monotonic() + args.seconds
                with ThreadPoolExecutor(args.concurrency) as pool:
                    def worker(seed: int) -> int:
                        r, n = random.Random(seed), 0
                        while time.monotonic() < deadline:
                            conversation(url, model, r)
                            n += 1
                        return n
                    done = sum(pool.map(worker, [rng.randrange(1 << 30) for _ in range(args.concurrency)]))
                page.wait_for_timeout(4500)  # two more polls after the last request
                poll = httpx.get(url + "/dashboard/data", headers={"Authorization": f"Bearer {ADMIN}"})
                print(f"one poll of /dashboard/data: {len(poll.content)} bytes (every 2 s)")
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=args.out, full_page=True)
                browser.close()
            print(f"{done} conversations in {args.seconds:.0f} s; screenshot: {args.out}")
        finally:
            server.should_exit = True
            thread.join(15)  # the app's shutdown closes the engine


if __name__ == "__main__":
    main()
