"""One engine replica of the fleet, as a Ray Serve deployment class.

Inside is the single server, unchanged: ``create_app`` builds the engine and its FastAPI app, and
every request the front end forwards runs through that app in-process (``asgi.call_asgi``), so
validation, tenants, errors, streaming and cache reports are the single server's. The replica adds
its name: the ``x-hotprefix-replica`` header and ``replica`` in every cache report; and, with
``FleetConfig.fleet_clock``, its server reads the front end's request number
(``x-hotprefix-fleet-seq``, ``hotprefix.server.fleet_seq``) for the eviction policy's clock.

It reports its work and rates (``work``: prompt tokens still to prefill, decode tokens left, its
measured prefill tok/s and seconds per decoded token, the mean output of its requests, and when it
sampled them) and its KV events address to the request router through Ray Serve's routing stats. With ``--kv-events tcp://HOST:PORT``, each replica binds the first
free pair of ports (events, replay) from PORT on, so replicas on one machine do not collide.

Knows nothing about routing.
"""

from __future__ import annotations

import itertools
import logging
import socket
import time
import zlib
from typing import Any, AsyncIterator, Sequence
from urllib.parse import urlsplit

import ray
from ray import serve

from hotprefix.config.sections import ConfigError, EngineConfig, ServerConfig
from hotprefix.fleet.asgi import Header, call_asgi
from hotprefix.fleet.config import FleetConfig
from hotprefix.fleet.hints import RouteHint
from hotprefix.fleet.work import StepMeter
from hotprefix.server.app import create_app

log = logging.getLogger(__name__)

REPLICA_HEADER = "x-hotprefix-replica"
"""Response header naming the replica that served the request."""
MAX_PORT_TRIES = 64
BIND_TRIES = 3


def _free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0" if host in ("*", "") else host, port))
        except OSError:
            return False
    return True


def bind_events(endpoint: str, start: int = 0) -> tuple[str, str, str]:
    """The first ``tcp://HOST:PORT`` from ``endpoint``'s port on (in steps of 2, from the
    ``start``-th pair round) whose port and port + 1 (the replay socket) are free: (events bind
    address, replay bind address, address others connect to).

    Raises:
        ConfigError: not a ``tcp://HOST:PORT`` address, or no free pair of ports.
    """
    u = urlsplit(endpoint)
    if u.scheme != "tcp" or u.port is None:
        raise ConfigError(f"a fleet's --kv-events must be tcp://HOST:PORT, got {endpoint!r}")
    host = u.hostname or "*"
    for i in range(MAX_PORT_TRIES):
        port = u.port + 2 * ((start + i) % MAX_PORT_TRIES)
        if _free(host, port) and _free(host, port + 1):
            reach = ray.util.get_node_ip_address() if host in ("*", "0.0.0.0") else host
            return f"tcp://{host}:{port}", f"tcp://{host}:{port + 1}", f"tcp://{reach}:{port}"
    raise ConfigError(f"no free pair of ports for KV events from {endpoint}")


class EngineReplica:
    """One engine and the single server's app (see the module docstring)."""

    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig,
                 fleet_config: FleetConfig | None = None):
        fleet_config = fleet_config or FleetConfig()
        self.name = serve.get_replica_context().replica_id.unique_id
        self.events: tuple[str, str] | None = None
        wanted = engine_config.cache.kv_events
        # replicas starting together on one machine start from different ports, and move on when
        # another took the pair between the check and the bind
        start = zlib.crc32(self.name.encode()) % MAX_PORT_TRIES
        for attempt in range(BIND_TRIES):
            if wanted:
                bind, replay, reach = bind_events(wanted, start + attempt)
                engine_config = engine_config.replace(kv_events=bind, kv_events_replay=replay)
                self.events = (reach, reach.rsplit(":", 1)[0] + ":" + replay.rsplit(":", 1)[1])
            try:
                # every request comes through the front end, which sets (or removes) the
                # fleet's request number: only a replica reads it
                self.app = create_app(engine_config, server_config,
                                      fleet_clock=fleet_config.fleet_clock)
                break
            except ConfigError as e:
                if not wanted or "cannot bind" not in str(e) or attempt == BIND_TRIES - 1:
                    raise
        self.state = self.app.state.hotprefix
        self.state.replica = self.name
        self.meter = StepMeter().attach(self.state.engine)
        self.engine_config = engine_config
        self._seq = itertools.count()
        log.info("replica %s ready (KV events %s)", self.name, self.events[0] if self.events else "off")

    async def info(self) -> dict[str, Any]:
        """What the front end needs to compute block keys as this replica does."""
        e = self.state.engine
        return {"replica": self.name, "namespace": e.namespace.hex(), "block_size": e.block_size,
                "hash_algo": self.engine_config.cache.hash_algo,
                "tokenizer": self.engine_config.model.tokenizer or e.model_path,
                "chat_template": self.engine_config.model.chat_template,
                "max_model_len": e.max_model_len, "served_name": self.state.served_name}

    async def forward(self, method: str, path: str, query: str, headers: Sequence[Header],
                      body: bytes, hotprefix_route: RouteHint | None = None) -> AsyncIterator[Any]:
        """Serve one HTTP request: yields ``(status, headers)``, then the body's chunks.
        ``hotprefix_route`` is for the request router only."""
        async for item in call_asgi(self.app, method, path, query, headers, body,
                                    extra_headers=[(REPLICA_HEADER, self.name)]):
            yield item

    async def call(self, method: str, path: str, query: str, headers: Sequence[Header],
                   body: bytes) -> tuple[int, list[Header], bytes]:
        """Serve one HTTP request whole: (status, headers, body); the front end's fan-out."""
        status, hdrs, chunks = 500, [], []
        async for item in self.forward(method, path, query, headers, body):
            if isinstance(item, tuple):
                status, hdrs = item
            else:
                chunks.append(item)
        return status, hdrs, b"".join(chunks)

    async def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve's routing stats: this replica's work, rates and KV events addresses."""
        sampled_at = time.time()
        work = await self.state.aengine.call(self.meter.report)
        stats: dict[str, Any] = {"replica": self.name, "seq": next(self._seq),
                                 "sampled_at": sampled_at, **work}
        if self.events:
            stats["kv_events"], stats["kv_events_replay"] = self.events
        return stats

    def __del__(self) -> None:
        state = getattr(self, "state", None)
        if state is not None:
            state.close()
