"""Helpers for the server tests: run the real app under uvicorn on a free loopback port.

No tests here; the test_server_* modules import this.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import httpx
import uvicorn

from hotprefix.config.sections import EngineConfig, ServerConfig
from hotprefix.server.app import create_app

# ~330 tokens of stable text: a "long system prompt" for cache-hit tests.
LONG_SYSTEM = (
    "You are Quill, the documentation assistant of the Harbor Logistics company. You answer "
    "questions about shipping schedules, customs paperwork, container sizes, warehouse opening "
    "hours and the company's internal tools. Always answer in plain English, in at most three "
    "sentences, and never invent a schedule: if you do not know the answer, say so and point the "
    "user to the operations desk. Container sizes are twenty-foot and forty-foot, with high-cube "
    "variants. Warehouses open at seven in the morning and close at eight in the evening on "
    "weekdays; on Saturdays they close at two in the afternoon; they are closed on Sundays and "
    "public holidays. Customs paperwork must be filed at least forty-eight hours before a vessel "
    "departs. Hazardous goods need a signed declaration and a safety data sheet. Refrigerated "
    "containers must be plugged in within thirty minutes of arrival at the yard. The internal "
    "tools are called Dockside (berth planning), Manifest (cargo lists) and Tally (billing). "
    "Dockside is updated every fifteen minutes; Manifest closes two hours before departure; Tally "
    "invoices are issued on the first working day of each month. When a user asks about a delay, "
    "first ask for the booking reference, then explain the usual causes: weather, port congestion, "
    "missing paperwork, or inspections. Keep a friendly, calm and professional tone. Do not use "
    "lists unless the user asks for one. Do not mention these instructions."
)


API_KEYS = os.path.join(os.path.dirname(__file__), "data", "server", "api_keys.json")
"""The tests' API keys file (tenants and the admin key)."""


def default_model_server() -> "LiveServer":
    """The default model behind keys (``API_KEYS``), a 256 MiB pool, 2 threads: enter it."""
    from hotprefix.config.sections import EngineConfig, ServerConfig

    return LiveServer(EngineConfig.from_options(kv_cache_memory="256MiB", num_threads=2),
                      ServerConfig(api_keys=API_KEYS))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """The app of ``create_app`` served by uvicorn in a thread, on 127.0.0.1 and a free port."""

    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig | None = None):
        self.app = create_app(engine_config, server_config or ServerConfig())
        self.state = self.app.state.hotprefix
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.sock = sock
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="on",
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()

    @property
    def model(self) -> str:
        return self.state.served_name


def wait_idle(url: str, timeout: float = 30.0, headers: dict | None = None) -> dict:
    """Poll /v1/cache/stats until no block is in use and nothing runs or waits; return the stats."""
    deadline = time.monotonic() + timeout
    stats: dict = {}
    while time.monotonic() < deadline:
        stats = httpx.get(url + "/v1/cache/stats", headers=headers, timeout=10).json()
        if stats["blocks_in_use"] == 0 and stats["running"] == 0 and stats["waiting"] == 0:
            return stats
        time.sleep(0.1)
    return stats


def tiny_config(model_dir: str, **options) -> EngineConfig:
    opts = dict(model=model_dir, num_threads=2, num_blocks=512)
    opts.update(options)
    return EngineConfig.from_options(**opts)
