"""What the route handlers share: the engine front, tenants, metrics, model names, the request log.

One ``ServerState`` per app, stored on ``app.state.hotprefix`` and handed to routes through
``hotprefix.server.deps``. Tokenization happens here, off the event loop and the engine thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from typing import Any, Callable

from hotprefix.config.sections import ServerConfig
from hotprefix.engine.async_engine import AsyncEngine
from hotprefix.engine.engine import LLMEngine, RequestOutput
from hotprefix.engine.request import Request as EngineRequest
from hotprefix.server import tool_formats
from hotprefix.server.metrics import ServerMetrics
from hotprefix.server.tenants import TenantRegistry

log = logging.getLogger(__name__)

MODEL_SUFFIXES = (".gguf", ".safetensors")


def open_private(path: str):
    """Open a file for appending, readable by this user only (mode 0600)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.chmod(path, 0o600)
    return os.fdopen(fd, "a")


class ServerState:
    """The engine (behind its thread), the tenants, the metrics and the names the server answers to."""

    def __init__(self, engine: LLMEngine, config: ServerConfig, tenants: TenantRegistry):
        self.engine = engine
        self.config = config
        self.tenants = tenants
        self.metrics = ServerMetrics()
        self.block_size = engine.block_size
        self.max_model_len = engine.max_model_len
        base = os.path.basename(engine.model_path or "") or engine.model_name
        for ext in MODEL_SUFFIXES:
            base = base[:-len(ext)] if base.endswith(ext) else base
        self.served_name = config.served_model_name or base
        self.metrics.model_name = self.served_name  # the vllm:* metrics' model_name label
        self.model_names = {self.served_name, engine.model_name, base}
        if engine.model_path:
            self.model_names.add(engine.model_path)
        self.created = int(time.time())
        self.tokenizer = engine.tokenizer
        self.tool_format = tool_formats.for_template(self.tokenizer.chat_template,
                                                     self.tokenizer.renders_tools)
        """How the model writes tool calls (``server/tool_formats.py``), from its chat template."""
        self.marks_message_ends = engine.has_window_groups
        """Chat routes mark where messages end as hit points (``server/message_ends.py``): only on
        a hybrid pool, where they change what stays cached; nothing is tokenized for them else."""
        self.replica: str | None = None
        """This server's replica name in a fleet (``hotprefix.fleet``): set, every cache report
        carries it; None for the single server."""
        self.reads_fleet_seq = False
        """Generation routes read the fleet front end's request number (``server/fleet_seq.py``)
        and pass it to the engine as ``fleet_seq``: set by ``create_app(fleet_clock=True)``, for a
        fleet replica only; a standalone server ignores the header."""
        self.responses: Any = None
        """The Responses API's stored answers (``server/response_store.py``), opened by
        ``server/responses.py``'s ``install``."""
        self.background_responses: dict[str, Any] = {}
        """Response id -> (task, request stream) of a background response still running."""
        self._tok_lock = threading.Lock()
        self._log_file = open_private(config.log_requests) if config.log_requests else None
        self.log_failures = 0
        """Request-log lines that could not be written (a full disk); requests never fail on them."""
        self.aengine = AsyncEngine(engine, engine.config.scheduler.max_waiting,
                                   on_finish=self._on_finish if self._log_file else None)

    async def encode(self, fn: Callable[..., list[int]], *args: Any) -> list[int]:
        """Run a tokenizer call in a worker thread (one at a time: the tokenizer is shared)."""
        def run() -> list[int]:
            with self._tok_lock:
                return fn(*args)
        return await asyncio.to_thread(run)

    def _on_finish(self, req: EngineRequest, out: RequestOutput | None) -> None:
        """``--log-requests``: one JSON line per finished request (engine thread)."""
        tenant = req.user_data if isinstance(req.user_data, str) else "-"
        line = {"timestamp": time.time(), "request_id": req.request_id, "tenant": tenant,
                "num_prompt_tokens": req.num_prompt_tokens,
                "num_output_tokens": req.num_output_tokens, "block_size": self.block_size,
                "block_keys": self.engine.request_block_keys(req),
                "cached_tokens": max(0, req.num_cached_tokens),
                "finish_reason": out.finish_reason if out is not None else "abort"}
        assert self._log_file is not None
        try:
            self._log_file.write(json.dumps(line) + "\n")
            self._log_file.flush()
        except OSError as e:
            if not self.log_failures:
                log.error("cannot write the request log %s: %s (requests go on)",
                          self.config.log_requests, e)
            self.log_failures += 1

    def close(self) -> None:
        self.aengine.shutdown()
        self.engine.close()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
