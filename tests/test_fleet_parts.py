"""The fleet's Ray-free parts: routing hints (block keys as the replicas compute them), the merged
stats and metrics, the in-process ASGI call, the fleet config. The fleet itself, on Ray Serve, is
tested in test_fleet_serve.py."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from hotprefix.config.sections import ConfigError
from hotprefix.fleet.asgi import call_asgi
from hotprefix.fleet.config import FleetConfig
from hotprefix.fleet.hints import PromptKeys, RouteHint
from hotprefix.fleet.merge import merge_metrics, merge_stats
from hotprefix.server.tenants import TenantRegistry
from server_support import LONG_SYSTEM, tiny_config


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from hotprefix.engine.engine import LLMEngine

    return LLMEngine(tiny_config(tiny_model_dir, block_size=16))


@pytest.fixture(scope="module")
def keys(engine, tmp_path_factory):
    f = tmp_path_factory.mktemp("k") / "keys.json"
    f.write_text(json.dumps({"sk-a": "alice", "sk-b": {"tenant": "bob", "shared_prefix_tokens": 32}}))
    tenants = TenantRegistry.from_file(str(f))
    return PromptKeys(engine.tokenizer, engine.namespace, engine.block_size, "sha256", tenants,
                      engine.max_model_len)


def engine_keys(engine, ids, salt, salt_from_block) -> list[bytes]:
    """The keys the engine itself gives a request of these tokens and salt."""
    from hotprefix.request.sampling import SamplingParams

    req = engine.add_request(ids, SamplingParams(max_tokens=1), cache_salt=salt,
                             salt_from_block=salt_from_block)
    keys = [bytes.fromhex(k) for k in engine.request_block_keys(req)]
    engine.abort(req.request_id)
    return keys


MESSAGES = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "Hi there"}]


@pytest.mark.parametrize("key", ["sk-a", "sk-b"])
def test_chat_hint_keys_are_the_engines_keys(engine, keys, key):
    body = json.dumps({"model": "m", "messages": MESSAGES, "prompt_cache_key": "conv-1"}).encode()
    hint = keys.hint("/v1/chat/completions", {"authorization": f"Bearer {key}"}, body)
    ids = engine.tokenizer.encode_chat(MESSAGES)
    tenant = keys.tenants.authenticate(key)
    want = engine_keys(engine, ids, tenant.salt, tenant.shared_prefix_tokens // 16)
    assert hint.num_tokens == len(ids) and len(hint.keys) == len(ids) // 16 > 10
    assert list(hint.keys) == want[:len(hint.keys)]
    assert hint.prompt_cache_key == f"{tenant.name}\0conv-1"  # scoped to the tenant


def test_tenants_get_different_keys_and_a_shared_prefix_is_shared(keys):
    body = json.dumps({"model": "m", "messages": MESSAGES}).encode()
    a = keys.hint("/v1/chat/completions", {"authorization": "Bearer sk-a"}, body)
    b = keys.hint("/v1/chat/completions", {"x-api-key": "sk-b"}, body)
    assert a.keys[0] != b.keys[0] and a.num_tokens == b.num_tokens


def test_completion_and_messages_hints(engine, keys):
    h = {"authorization": "Bearer sk-a"}
    text = keys.hint("/v1/completions", h, json.dumps({"model": "m", "prompt": LONG_SYSTEM}).encode())
    assert text.num_tokens == len(engine.tokenizer.encode(LONG_SYSTEM))
    ids = keys.hint("/v1/completions", h, json.dumps({"model": "m", "prompt": list(range(40))}).encode())
    assert ids.num_tokens == 40 and len(ids.keys) == 2
    msg = {"model": "m", "max_tokens": 4, "system": LONG_SYSTEM,
           "messages": [{"role": "user", "content": "Hi there"}]}
    anth = keys.hint("/v1/messages", h, json.dumps(msg).encode())
    assert anth.num_tokens > 300 and anth.keys


@pytest.mark.parametrize("path,headers,body", [
    ("/v1/chat/completions", {"authorization": "Bearer sk-a"}, b"{not json"),
    ("/v1/chat/completions", {"authorization": "Bearer sk-nobody"}, b'{"messages": []}'),
    ("/v1/chat/completions", {"authorization": "Bearer sk-a"}, b'{"messages": 3}'),
    ("/v1/completions", {"authorization": "Bearer sk-a"}, b'{"prompt": ""}'),
    ("/v1/models", {"authorization": "Bearer sk-a"}, b""),
])
def test_unreadable_requests_get_an_empty_hint(keys, path, headers, body):
    assert keys.hint(path, headers, body) == RouteHint()


def test_merged_stats_add_counters_and_recompute_ratios():
    a = {"view": "operator", "requests": 3, "hit_tokens": 30, "queries_tokens": 40, "hit_rate": 0.75,
         "blocks_total": 10, "kv_usage": 1.0, "miss_tokens_by_reason": {"cold": 10},
         "eviction_policy": "freq", "eviction_policy_state": {"x": "a"}}
    b = {"view": "operator", "requests": 1, "hit_tokens": 0, "queries_tokens": 60, "hit_rate": 0.0,
         "blocks_total": 30, "kv_usage": 0.0, "miss_tokens_by_reason": {"cold": 20, "evicted": 40},
         "eviction_policy": "freq", "eviction_policy_state": {"x": "b"}}
    m = merge_stats({"r1": a, "r2": b})
    assert m["requests"] == 4 and m["hit_tokens"] == 30 and m["queries_tokens"] == 100
    assert m["hit_rate"] == pytest.approx(0.3) and m["kv_usage"] == pytest.approx(0.25)
    assert m["miss_tokens_by_reason"] == {"cold": 30, "evicted": 40}
    assert m["miss_share_by_reason"] == pytest.approx({"cold": 30 / 70, "evicted": 40 / 70})
    assert m["eviction_policy"] == "freq" and "eviction_policy_state" not in m  # per replica only
    assert m["view"] == "operator" and m["num_replicas"] == 2


def test_merged_stats_keep_settings_and_merge_the_top_miss_causes():
    """Per-replica settings are the fleet's when they agree, never their sum (a block size of 32
    from two of 16), and policy state that does not add up is left out; the replicas' largest
    miss causes become one list, the same cause's tokens added and shares of the fleet's misses."""
    from hotprefix.cache.stats import cause_entry

    a = {"view": "tenant", "block_size": 16, "bytes_per_token": 23040,
         "eviction_policy_state": {"credit_requests": 1000}, "miss_tokens_by_reason": {"cold": 60},
         "top_miss_causes": [cause_entry("cold", None, 0, 60, 60)]}
    b = {"view": "tenant", "block_size": 16, "bytes_per_token": 23040,
         "eviction_policy_state": {"credit_requests": 1000},
         "miss_tokens_by_reason": {"cold": 20, "extended": 20},
         "top_miss_causes": [cause_entry("extended", "turn", 3, 20, 40),
                             cause_entry("cold", None, 0, 20, 40)]}
    m = merge_stats({"r1": a, "r2": b})
    assert m["block_size"] == 16 and m["bytes_per_token"] == 23040
    assert "eviction_policy_state" not in m
    assert m["top_miss_causes"] == [cause_entry("cold", None, 0, 80, 100),
                                    cause_entry("extended", "turn", 3, 20, 100)]
    assert m["top_miss_causes"][0]["summary"] == "80% of missed tokens: cold in block 0"
    assert "block_size" not in merge_stats({"r1": a, "r2": {**b, "block_size": 32}})


def test_merged_metrics_label_every_sample_with_its_replica():
    text = ("# HELP hp_requests_total Requests.\n# TYPE hp_requests_total counter\n"
            'hp_requests_total{route="chat"} 3.0\n'
            "# HELP hp_usage KV usage.\n# TYPE hp_usage gauge\nhp_usage 0.5\n")
    out = merge_metrics({"r1": text, "r2": text.replace("3.0", "4.0")}).decode()
    assert 'hp_requests_total{replica="r1",route="chat"} 3.0' in out
    assert 'hp_requests_total{replica="r2",route="chat"} 4.0' in out
    assert out.count("# TYPE hp_requests_total counter") == 1
    assert 'hp_usage{replica="r2"} 0.5' in out
    with pytest.raises(ValueError):
        merge_metrics({"r1": "not { a metric"})


def test_call_asgi_streams_the_apps_answer_and_adds_headers():
    app = FastAPI()

    @app.post("/echo")
    async def echo(body: dict):
        async def gen():
            for i in range(3):
                yield f"data: {body['x']}{i}\n\n"
        return StreamingResponse(gen(), media_type="text/event-stream")

    async def run():
        return [item async for item in call_asgi(app, "POST", "/echo", "", [("content-type", "application/json")],
                                                 b'{"x": "a"}', extra_headers=[("X-Replica", "r9")])]
    items = asyncio.run(run())
    status, headers = items[0]
    assert status == 200 and ("x-replica", "r9") in headers
    assert b"".join(items[1:]) == b"data: a0\n\ndata: a1\n\ndata: a2\n\n"


def test_fleet_config_refuses_bad_values():
    with pytest.raises(ConfigError):
        FleetConfig(replicas=0)
    with pytest.raises(ConfigError):
        FleetConfig(router="smallest_tree")
    assert FleetConfig().replicas == 1 and FleetConfig(router="ray_default").router == "ray_default"


def test_a_fleet_refuses_the_in_process_hash(tiny_model_dir):
    pytest.importorskip("ray")
    from hotprefix.config.sections import ServerConfig
    from hotprefix.fleet.app import fleet_app

    with pytest.raises(ConfigError, match="sha256"):
        fleet_app(tiny_config(tiny_model_dir, hash_algo="fast"), ServerConfig(), FleetConfig(replicas=2))


def test_build_app_reads_serves_flags_and_the_routers_settings(tiny_model_dir):
    """``serve run hotprefix.fleet.app:build_app k=v ...`` (strings) and Serve config files."""
    pytest.importorskip("ray")
    from hotprefix.fleet.app import build_app

    app = build_app({"replicas": "3", "router": "least_loaded", "model": tiny_model_dir,
                     "num_threads": "1", "enable_prefix_caching": "true",
                     "prefill_weight": "2.5", "kv_store": ["disk:/tmp/hp-x"]})
    engine = app._bound_deployment.init_args[0]  # the EngineReplica deployment, bound
    assert engine._bound_deployment.num_replicas == 3
    kwargs = engine._bound_deployment._deployment_config.request_router_config.request_router_kwargs
    assert kwargs["policy"] == "least_loaded"
    assert kwargs["router_options"]["prefill_weight"] == 2.5
    assert engine._bound_deployment.init_args[0].cache.kv_store == ("disk:/tmp/hp-x",)
    for bad in ({"replicas": "x"}, {"no_such_option": 1}, {"router": "smallest_tree"}):
        with pytest.raises(ConfigError):
            build_app({"model": tiny_model_dir, **bad})


def test_the_documented_cluster_config_builds():
    """deploy/ray/hotprefix_fleet.yaml's application args are valid ``build_app`` options."""
    yaml = pytest.importorskip("yaml")
    pytest.importorskip("ray")
    from pathlib import Path

    from hotprefix.fleet.app import build_app

    cfg = yaml.safe_load((Path(__file__).parents[1] / "deploy" / "ray" / "hotprefix_fleet.yaml").read_text())
    (app_cfg,) = cfg["applications"]
    assert app_cfg["import_path"] == "hotprefix.fleet.app:build_app"
    app = build_app(app_cfg["args"])
    engine = app._bound_deployment.init_args[0]
    assert engine._bound_deployment.num_replicas == app_cfg["args"]["replicas"]
    assert engine._bound_deployment.init_args[0].cache.kv_store == tuple(app_cfg["args"]["kv_store"])
