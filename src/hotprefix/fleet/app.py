"""The fleet as a Ray Serve application: ``fleet_app`` (from configs), ``build_app`` (for
``serve run`` and Serve config files on a Ray cluster) and ``serve_fleet`` (``hotprefix serve
--replicas N``: a local Ray, or ``--ray-address``, serving until interrupted).

Two deployments: ``EngineReplica`` (N replicas, each ``replica_num_cpus`` CPUs, routed by
``HotprefixRequestRouter``, or by Ray Serve's default router with ``router='ray_default'``) and ``Frontend`` (the HTTP ingress, no CPU reserved). On a cluster every
node that may host a replica needs the model file (and the key file) at the same path.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import logging
import os
import tempfile
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from hotprefix.config.flags import add_serve_flags, serve_argv, serve_configs
from hotprefix.config.sections import ConfigError, EngineConfig, ServerConfig
from hotprefix.fleet.config import FleetConfig
from hotprefix.fleet.frontend import ENGINE_DEPLOYMENT, Frontend
from hotprefix.fleet.replica import EngineReplica
from hotprefix.router.config import RouterConfig

log = logging.getLogger(__name__)

APP_NAME = "hotprefix"
HEALTH_CHECK_PERIOD_S = 5.0


def check(engine_config: EngineConfig) -> None:
    """Refuse what cannot work across processes.

    Raises:
        ConfigError: ``hash_algo='fast'`` (its keys are valid inside one process only).
    """
    if engine_config.cache.hash_algo != "sha256":
        raise ConfigError("a fleet needs hash_algo='sha256': the router computes block keys in "
                          "another process than the replicas")


def fleet_app(engine_config: EngineConfig, server_config: ServerConfig,
              fleet_config: FleetConfig, router_config: RouterConfig | None = None) -> Any:
    """The bound Ray Serve application (see the module docstring); ``router_config``: the routing
    core's settings (its ``policy`` is ``fleet_config.router``'s)."""
    check(engine_config)
    options = dataclasses.asdict(router_config or RouterConfig())
    options.pop("policy")
    routing_config = RequestRouterConfig(
        request_router_class="hotprefix.fleet.request_router.HotprefixRequestRouter",
        request_router_kwargs={"policy": fleet_config.router,
                               "block_size": engine_config.cache.block_size,
                               "router_options": options},
        request_routing_stats_period_s=fleet_config.stats_period_s,
        request_routing_stats_timeout_s=max(1.0, 3 * fleet_config.stats_period_s))
    routing: dict[str, Any] = {} if fleet_config.router == "ray_default" else {
        "request_router_config": routing_config}
    engine = serve.deployment(EngineReplica).options(
        name=ENGINE_DEPLOYMENT, num_replicas=fleet_config.replicas,
        ray_actor_options={"num_cpus": fleet_config.replica_num_cpus,
                           "num_gpus": fleet_config.replica_num_gpus},
        max_ongoing_requests=fleet_config.max_ongoing_requests,
        health_check_period_s=HEALTH_CHECK_PERIOD_S, **routing)
    front = serve.deployment(Frontend).options(name="Frontend", num_replicas=1,
                                               ray_actor_options={"num_cpus": 0},
                                               max_ongoing_requests=4096)
    return front.bind(engine.bind(engine_config, server_config, fleet_config), server_config,
                      fleet_config)


def build_app(args: dict[str, Any]) -> Any:
    """``serve run hotprefix.fleet.app:build_app replicas=2 model=/models/x.gguf ...`` or a Serve
    config file's ``args``: ``hotprefix serve``'s options, named as its flags without the dashes
    (``replicas``, ``router``, ``api_keys``, ``kv_store``, ``block_size``...), read by the same
    parser, so types, defaults and checks are the CLI's (``true``/``false`` for switches, a list
    or a comma-free string for repeatable flags).

    Raises:
        ConfigError: an unknown option or an invalid value.
    """
    parser = argparse.ArgumentParser(prog="hotprefix serve")
    actions = add_serve_flags(parser)
    try:
        argv = serve_argv(args, actions)
    except ConfigError as e:
        raise ConfigError(f"fleet options: {e}") from None
    try:
        ns = parser.parse_args(argv)
    except SystemExit:
        raise ConfigError(f"invalid fleet options: {args}") from None
    cfg = serve_configs(ns)
    return fleet_app(cfg.engine, cfg.server, cfg.fleet, cfg.router)


def shareable_keys(server_config: ServerConfig) -> ServerConfig:
    """A key file every process can read: ``--api-key``'s one-read pipe (``/dev/fd/N``) copied to a
    private temporary file (mode 0600, removed at exit)."""
    path = server_config.api_keys
    if not path or not path.startswith("/dev/fd/"):
        return server_config
    with open(path) as f:
        data = json.load(f)
    fd, tmp = tempfile.mkstemp(prefix="hotprefix-keys-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.chmod(tmp, 0o600)
    atexit.register(lambda: os.path.exists(tmp) and os.unlink(tmp))
    return dataclasses.replace(server_config, api_keys=tmp)


def serve_fleet(engine_config: EngineConfig, server_config: ServerConfig,
                fleet_config: FleetConfig, router_config: RouterConfig | None = None) -> None:
    """Start (or join) Ray, run the fleet on ``host:port`` until interrupted, then stop it."""
    server_config = shareable_keys(server_config)
    app = fleet_app(engine_config, server_config, fleet_config, router_config)
    ray.init(address=fleet_config.ray_address, include_dashboard=False, logging_level="WARNING")
    try:
        serve.start(http_options={"host": server_config.host, "port": server_config.port})
        serve.run(app, name=APP_NAME, route_prefix="/")
        log.info("hotprefix fleet: %d replicas, router %s, on http://%s:%d/v1", fleet_config.replicas,
                 fleet_config.router, server_config.host, server_config.port)
        import signal
        import threading

        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
