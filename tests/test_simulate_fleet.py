"""The fleet replay (hotprefix simulate --replicas): R copies of the real cache behind the real
routing core. One replica replays exactly like ``replay``; prefix routing keeps conversations on
their replica (far above round-robin, load still even), also with KV events dropped or off; the
command prints the JSON others rely on; none of it imports torch."""

from __future__ import annotations

import json
import random

import pytest

from hotprefix import simulate as sim
from hotprefix.router import RouterConfig
from hotprefix.simulate import TraceRequest
from hotprefix.simulate.fleet import replay_fleet
from sim_support import exit_2

BS = 16


def conversation_trace(convs: int = 41, turns: int = 4, seed: int = 0) -> list[TraceRequest]:
    """Conversations (a shared 2-block system prompt, then their own blocks), turns interleaved,
    one request a second."""
    rng = random.Random(seed)
    nid = 1000
    chains = []
    for _ in range(convs):
        chains.append([0, 1] + list(range(nid, nid + rng.randrange(2, 6))))
        nid += 10
    reqs = []
    for t in range(turns):
        for c in range(convs):
            if t:
                chains[c] = chains[c] + list(range(nid, nid + rng.randrange(1, 4)))
                nid += 10
            n = len(chains[c]) * BS + 1
            reqs.append(TraceRequest(n, n, list(chains[c]), timestamp=float(len(reqs))))
    return reqs


def test_one_replica_replays_exactly_like_replay():
    reqs = conversation_trace(seed=1)
    for cap in (40 * BS, 400 * BS):
        one = replay_fleet(reqs, 1, cap, "round_robin", "lru", BS)
        ref = sim.replay(reqs, cap, "lru", BS)
        assert (one.hit_blocks, one.prompt_blocks, one.evictions) == (ref.hit_blocks, ref.prompt_blocks,
                                                                      ref.evictions)
        assert one.per_replica[0].requests == len(reqs) and one.load_imbalance == 1.0


def test_prefix_routing_keeps_conversations_on_their_replica():
    reqs = conversation_trace()
    cap = 300 * BS  # each replica holds its share of the conversations
    rr = replay_fleet(reqs, 4, cap, "round_robin", block_size=BS)
    ll = replay_fleet(reqs, 4, cap, "least_loaded", block_size=BS)
    px = replay_fleet(reqs, 4, cap, "prefix", block_size=BS)
    ceiling = sim.ceiling(reqs, BS).block_hit_ratio
    assert px.block_hit_ratio >= 0.95 * ceiling
    assert px.block_hit_ratio >= 2 * rr.block_hit_ratio
    assert px.block_hit_ratio >= 1.3 * ll.block_hit_ratio
    # the modelled time to first token: the prefix router's cost model beats both blind ones
    assert px.ttft()["mean"] < min(rr.ttft()["mean"], ll.ttft()["mean"])
    assert px.ttft()["p90"] <= min(rr.ttft()["p90"], ll.ttft()["p90"])
    fixed = replay_fleet(reqs, 4, cap, "prefix", block_size=BS,
                         router_config=RouterConfig(prefill_weight=1.0))
    assert fixed.block_hit_ratio >= 0.95 * ceiling  # the request's own TTFT alone: as good here
    assert sum(p.requests for p in px.per_replica) == len(reqs)
    assert sum(p.hit_tokens for p in px.per_replica) == px.hit_tokens
    assert px.reasons.get("prefix", 0) >= 41 * 3  # every later turn followed its prefix
    assert px.events_sent > 0 and px.events_dropped == 0
    for drop in (0.1, 1.0):  # events dropped or off: the router's own decisions fill in
        d = replay_fleet(reqs, 4, cap, "prefix", block_size=BS, drop_events=drop)
        assert d.block_hit_ratio >= 0.95 * px.block_hit_ratio
        assert d.events_dropped > 0


def _write(path, reqs):
    with open(path, "w") as f:
        for r in reqs:
            f.write(json.dumps({"timestamp": r.timestamp * 1000, "input_length": r.num_prompt_tokens,
                                "hash_ids": r.block_ids}) + "\n")


def test_cli_json_per_replica_and_imbalance(tmp_path, capsys):
    p = tmp_path / "mc.jsonl"
    reqs = []
    for r in conversation_trace(20, 3, seed=2):  # as Mooncake ids (512 tokens each)
        n = len(r.block_ids) * 512 + 1
        reqs.append(TraceRequest(n, n, r.block_ids, timestamp=r.timestamp))
    _write(p, reqs)
    from hotprefix.cli import main as cli_main

    out = {}
    for router in ("prefix", "round_robin", "least_loaded"):
        assert cli_main(["simulate", str(p), "--replicas", "3", "--router", router, "--capacity-tokens",
                         "100000", "--block-size", "512", "--json"]) == 0
        out[router] = json.loads(capsys.readouterr().out)
    for router, o in out.items():
        assert o["router"] == router and o["replicas"] == 3 and o["capacity_tokens"] == 100000
        assert len(o["per_replica"]) == 3
        assert all(set(x) == {"requests", "computed_tokens", "hit_tokens", "prefill_tok_s",
                              "decode_tok_s"} for x in o["per_replica"])
        assert 0 < o["modelled_ttft_s"]["p50"] <= o["modelled_ttft_s"]["p90"]
        comp = [x["computed_tokens"] for x in o["per_replica"]]
        assert o["load_imbalance"] == pytest.approx(max(comp) / (sum(comp) / 3), abs=1e-4)
        assert 0 <= o["block_hit_ratio"] <= 1
    assert out["prefix"]["block_hit_ratio"] > out["round_robin"]["block_hit_ratio"]
    assert cli_main(["simulate", str(p), "--replicas", "2", "--capacity-tokens", "100000",
                     "--block-size", "512"]) == 0
    assert "replica 1:" in capsys.readouterr().out
    # per-replica prefill and decode rates: the faster replica does more of the work
    assert cli_main(["simulate", str(p), "--replicas", "2", "--capacity-tokens", "100000",
                     "--block-size", "512", "--tokens-per-second", "40000,10000",
                     "--decode-tokens-per-second", "50", "--json"]) == 0
    o = json.loads(capsys.readouterr().out)
    fast, slow = o["per_replica"]
    assert (fast["prefill_tok_s"], slow["prefill_tok_s"], fast["decode_tok_s"]) == (40000, 10000, 50)
    assert fast["computed_tokens"] > slow["computed_tokens"]
    for bad in (["--sweep"], ["--policy", "min"], ["--drop-events", "2"], ["--replicas", "0"],
                ["--tokens-per-second", "1,2,3"]):
        argv = ["simulate", str(p), "--replicas", "2", "--capacity-tokens", "100000",
                "--block-size", "512", *bad]
        assert cli_main(argv) == 2
    assert cli_main(["simulate", str(p), "--replicas", "2", "--block-size", "512"]) == 2


def test_an_empty_trace_gives_an_empty_fleet_result(tmp_path, capsys):
    p = tmp_path / "empty.jsonl"
    p.write_text("")
    assert sim.main([str(p), "--capacity-tokens", "1000", "--replicas", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 0 and out["block_hit_ratio"] == 0.0 and out["load_imbalance"] == 1.0
    assert [x["requests"] for x in out["per_replica"]] == [0, 0]


def test_admission_tail_applies_to_every_replica(tmp_path, capsys):
    """A 1-replica fleet with --admission-tail-tokens replays like the single cache with it."""
    p = tmp_path / "t.jsonl"
    with open(p, "w") as f:
        for i in range(20):
            for rep in range(2):
                f.write(json.dumps({"timestamp": (2 * i + rep) * 50, "input_length": 2048,
                                    "hash_ids": [100 + i, 200 + i, 300 + i, 400 + i]}) + "\n")
    ratio = {}
    for tail in ([], ["--admission-tail-tokens", "512"]):
        for fleet in ([], ["--replicas", "1"]):
            argv = [str(p), "--capacity-tokens", "100000", "--block-size", "512", "--json"]
            assert sim.main(argv + tail + fleet) == 0
            ratio[bool(tail), bool(fleet)] = json.loads(capsys.readouterr().out)["block_hit_ratio"]
    assert ratio[True, True] == ratio[True, False] == 0.125
    assert ratio[False, True] == ratio[False, False] == 0.375
    reqs = conversation_trace(seed=3)
    one = replay_fleet(reqs, 1, 400 * BS, "round_robin", "lru", BS, admission_tail_tokens=3 * BS)
    ref = sim.replay(reqs, 400 * BS, "lru", BS, admission_tail_tokens=3 * BS)
    assert (one.hit_blocks, one.prompt_blocks) == (ref.hit_blocks, ref.prompt_blocks)


@pytest.mark.parametrize("flag, value", [
    ("--tokens-per-second", "-100"), ("--tokens-per-second", "0"), ("--tokens-per-second", "nan"),
    ("--prefill-weight", "nan"), ("--prefill-weight", "inf"), ("--prefill-weight", "-1"),
    ("--drop-events", "nan"),
])
def test_nonsense_fleet_numbers_are_refused(tmp_path, capsys, flag, value):
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 1024, "hash_ids": [1, 2]}\n')
    err = exit_2([str(p), "--capacity-tokens", "4096", "--replicas", "2", flag, value], capsys)
    assert f"argument {flag}: must be a finite number" in err


def test_a_huge_pool_per_replica_replays_like_one_that_holds_everything():
    reqs = conversation_trace(seed=4)
    enough = sum(-(-r.num_tokens // BS) for r in reqs) * 2 * BS
    for router in ("prefix", "round_robin"):
        huge = replay_fleet(reqs, 3, 10**15, router, "freq", BS).to_json()
        ref = replay_fleet(reqs, 3, enough, router, "freq", BS).to_json()
        for k in ("block_hit_ratio", "per_replica", "evictions", "events_sent", "decisions"):
            assert huge[k] == ref[k], k
        assert huge["capacity_tokens"] == 10**15 and huge["hit_blocks"] > 0


def test_the_fleet_router_and_events_recorder_import_no_torch():
    import subprocess
    import sys

    code = ("import sys, hotprefix.simulate.fleet, hotprefix.simulate.fleet_cli, hotprefix.router, "
            "hotprefix.router.feed, hotprefix.events.recorder, hotprefix.events.publisher\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
