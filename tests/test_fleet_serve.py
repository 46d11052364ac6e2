"""The fleet on real Ray Serve (``hotprefix.fleet``): 2 replicas of the tiny test model behind the
prefix-aware request router, started once for the module (loopback only) and stopped after it.

Marked ``ray`` (deselect with ``-m "not ray"``); they run in the default ``make test``.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from hotprefix.config.sections import ServerConfig
from hotprefix.fleet.config import FleetConfig
from server_support import LONG_SYSTEM, free_port, tiny_config

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

ALICE, BOB, ADMIN = "sk-alice", "sk-bob", "sk-root"
H_ALICE = {"Authorization": f"Bearer {ALICE}"}
H_BOB = {"Authorization": f"Bearer {BOB}"}
H_ADMIN = {"Authorization": f"Bearer {ADMIN}"}
MODEL: list[str] = []


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, tmp_path_factory):
    from hotprefix.fleet.app import APP_NAME, fleet_app

    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps({ALICE: "alice", BOB: "bob"}))
    port = free_port()
    engine = tiny_config(tiny_model_dir, num_threads=1, block_size=16,
                         kv_events=f"tcp://127.0.0.1:{free_port()}")
    server = ServerConfig(api_keys=str(keys), admin_key=ADMIN)
    app = fleet_app(engine, server, FleetConfig(replicas=2, router="prefix", stats_period_s=0.5))
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR",
             log_to_driver=False, configure_logging=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(app, name=APP_NAME, route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        MODEL.append(httpx.get(url + "/v1/models", headers=H_ALICE, timeout=60).json()["data"][0]["id"])
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


def chat(url: str, messages: list[dict], headers=H_ALICE, **extra) -> httpx.Response:
    body = {"model": MODEL[0], "messages": messages, "max_tokens": 4, "temperature": 0, **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=120)


def conversation(i: int) -> list[dict]:
    return [{"role": "system", "content": f"Conversation {i}. {LONG_SYSTEM}"},
            {"role": "user", "content": f"Hello number {i}, what are the opening hours?"}]


def admin_stats(url: str) -> dict:
    r = httpx.get(url + "/v1/cache/stats", headers=H_ADMIN, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_responses_name_the_replica_that_served_them(fleet):
    r = chat(fleet, conversation(100))
    assert r.status_code == 200, r.text
    name = r.headers["x-hotprefix-replica"]
    assert r.json()["hotprefix"]["cache"]["replica"] == name
    assert name in admin_stats(fleet)["replicas"]


def test_a_conversations_turns_go_to_the_replica_holding_its_prefix(fleet):
    seen: dict[int, str] = {}
    for turn in range(3):
        for i in range(4):
            msgs = conversation(i) + [m for t in range(turn) for m in
                                      ({"role": "assistant", "content": f"Answer {t}."},
                                       {"role": "user", "content": f"And question {t}?"})]
            r = chat(fleet, msgs)
            assert r.status_code == 200, r.text
            name = r.headers["x-hotprefix-replica"]
            if turn == 0:
                seen[i] = name
            else:
                assert name == seen[i], f"conversation {i} turn {turn} left its replica"
                assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 300


def test_streaming_passes_through_and_reports_the_replica(fleet):
    body = {"model": MODEL[0], "messages": conversation(7), "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", fleet + "/v1/chat/completions", json=body, headers=H_ALICE,
                      timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        name = r.headers["x-hotprefix-replica"]
    assert events[-1] == "[DONE]"
    reports = [json.loads(e)["hotprefix"]["cache"] for e in events[:-1] if "hotprefix" in e]
    assert reports and reports[-1]["replica"] == name


def test_bad_input_and_bad_keys_get_the_single_servers_errors(fleet):
    r = httpx.post(fleet + "/v1/chat/completions", content=b"{not json", headers=H_ALICE, timeout=60)
    assert r.status_code == 400 and "error" in r.json()
    r = chat(fleet, conversation(1), headers={"Authorization": "Bearer sk-nobody"})
    assert r.status_code == 401
    assert httpx.get(fleet + "/v1/cache/stats", headers={"Authorization": "Bearer x"},
                     timeout=60).status_code == 401
    assert httpx.get(fleet + "/metrics", headers=H_ALICE, timeout=60).status_code == 403
    r = httpx.post(fleet + "/v1/chat/completions", content=b"x" * 2_000_000, headers=H_ALICE, timeout=60)
    assert r.status_code == 413

    for method, route in [("GET", "/health"), ("GET", "/v1/cache/stats"), ("POST", "/v1/cache/reset")]:
        # the fleet's own routes too, before reading a byte (they had buffered any body whole,
        # keyless, and sent it to every replica)
        r = httpx.request(method, fleet + route, content=b"y" * 4_000_000, timeout=60)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", route
    r = httpx.post(fleet + "/v1/messages", content=b"x" * 2_000_000, headers=H_ALICE, timeout=60)
    assert r.status_code == 413 and r.json()["type"] == "error"  # Anthropic's shape
    for route, status in [("/v1/chat/completions", 405), ("/v1/nope", 404)]:
        r = httpx.options(fleet + route, headers=H_ALICE, timeout=60)  # the single server's answer
        assert r.status_code == status and r.json()["error"]["code"] in ("method_not_allowed",
                                                                          "not_found"), r.text


def test_fleet_stats_cover_both_replicas_and_tenants_see_only_their_own(fleet):
    for i in range(2):
        assert chat(fleet, conversation(50 + i), headers=H_BOB).status_code == 200
    s = admin_stats(fleet)
    assert s["num_replicas"] == 2 and len(s["replicas"]) == 2
    per = s["replicas"].values()
    assert s["requests"] == sum(v["requests"] for v in per) > 0
    assert s["hit_tokens"] == sum(v["hit_tokens"] for v in per)
    assert set(s["router"]["replicas"]) == set(s["replicas"])
    assert len(s["router"]["kv_events"]) == 2  # the router follows both replicas' KV events
    assert sum(s["router"]["indexed_blocks"].values()) > 0
    # each replica reports its work and the prefill rate its engine measured (every 0.25 s)
    deadline = time.monotonic() + 30
    while not any(w["measured"] for w in s["router"]["work"].values()) and time.monotonic() < deadline:
        time.sleep(0.5)
        s = admin_stats(fleet)
    assert set(s["router"]["work"]) == set(s["replicas"])
    assert any(w["measured"] and w["prefill_tok_s"] > 0 for w in s["router"]["work"].values())
    # and its pool's size and fill (new prompts go where the fleet's pools have room)
    assert all(w["pool_blocks"] and 0 < w["filled_blocks"] <= w["pool_blocks"]
               for w in s["router"]["work"].values() if w["measured"])
    assert s["block_size"] == 16 and "eviction_policy_state" not in s  # settings: never summed
    bob = httpx.get(fleet + "/v1/cache/stats", headers=H_BOB, timeout=60).json()
    assert bob["view"] == "tenant" and "replicas" not in bob and "router" not in bob
    assert bob["block_size"] == 16
    assert bob["requests"] == 2 and bob["num_replicas"] == 2
    text = httpx.get(fleet + "/metrics", headers=H_ADMIN, timeout=60).text
    for name in s["replicas"]:
        assert f'replica="{name}"' in text
    assert "hotprefix_fleet_replicas 2" in text


def test_a_killed_replica_loses_no_request_and_the_router_forgets_it(fleet):
    before = set(admin_stats(fleet)["replicas"])
    victim = chat(fleet, conversation(0)).headers["x-hotprefix-replica"]
    actor = next(a for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].endswith("#" + victim))
    handle = ray.get_actor(actor["name"], namespace=actor["namespace"])

    def one(i: int) -> httpx.Response:
        return chat(fleet, conversation(i % 6), max_tokens=48)

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(32)]
        while sum(f.done() for f in futures) < 4:
            time.sleep(0.02)
        ray.kill(handle, no_restart=True)
        pending_at_kill = sum(not f.done() for f in futures)
        replies = [f.result() for f in futures]
    assert pending_at_kill >= 8  # killed mid-run
    assert [r.status_code for r in replies] == [200] * 32
    assert all(r.headers["x-hotprefix-replica"] != victim for r in replies[-4:])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        s = admin_stats(fleet)
        if victim not in s["router"]["replicas"] and victim not in s["router"]["indexed_blocks"]:
            break
        time.sleep(0.5)
    assert victim not in s["router"]["replicas"] and victim not in s["router"]["indexed_blocks"]
    assert victim in before
    h = httpx.get(fleet + "/health", timeout=60).json()  # one of 2 down until Serve replaces it
    assert h["replicas"] == 2 and h["status"] == ("ok" if h["replicas_ok"] == 2 else "degraded"), h
    r = chat(fleet, conversation(0))  # its conversation goes on elsewhere
    assert r.status_code == 200 and r.headers["x-hotprefix-replica"] != victim
