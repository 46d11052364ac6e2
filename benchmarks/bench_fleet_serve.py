"""A fleet end to end on this machine (issue 31): 2 replicas of the default model on Ray Serve,
the workloads a user runs, prefix-aware routing against Ray Serve's default router and round-robin.

Workloads (each turn carries the whole conversation so far; sessions run their turns back to back):

  (a) ``chat``: 16 chat sessions x 6 turns sharing one ~1,500-token system prompt, starting
      ``--stagger-s`` apart;
  (b) ``tenants``: 12 tenants, each with its own ~1,500-token system prompt, 4 sessions x 4 turns
      each, sessions arriving interleaved over the tenants; each replica's pool holds about
      ``--tenants-per-pool`` (5) tenants' prompts plus their sessions (``num_blocks`` sized from
      the prompts), and a single replica given both pools' blocks runs it too (the ideal: one
      cache as big as the fleet's);
  (c) ``burst``: 24 new sessions at once on one shared system prompt, 2 turns each.

Every router runs every workload in this one process, one fleet after the other, on the same Ray
instance, with the same sessions (temperature 0: the same answers, hence the same prompts); each
fleet starts cold. ``prefix`` is the routing core as a Ray Serve ``RequestRouter`` (KV events on),
``ray_default`` Ray Serve's ``PowerOfTwoChoicesRequestRouter``, ``round_robin`` the core's
round-robin. The client streams every request through the front end's HTTP port and measures its
time to first token (first content chunk). Reported per workload and router: the token hit ratio
(cached prompt tokens / prompt tokens, from each response's usage), mean, p50 and p90 TTFT, the
share of turns served by the replica of the session's previous turn, and requests per replica;
then prefix / ray_default. Writes results/fleet_serve.json.

Run from the repository root: ``.venv/bin/python benchmarks/bench_fleet_serve.py`` (``--quick``:
a few sessions and turns of each workload, to check the script end to end; ``--workloads
chat,burst`` runs some of them; ``--routers prefix,ray_default``). TTFTs need a quiet machine: two
replicas share its cores with the client.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def system_prompt(tokenizer, n_tokens: int, seed: int = 14, company: str = "Harbor Logistics") -> str:
    """About ``n_tokens`` tokens of policy-handbook text (stable across runs; one per seed)."""
    rng = random.Random(seed)
    gen = common.policy_sentences(rng)
    text = f"You are the assistant of the {company} help desk. The handbook follows."
    while len(tokenizer.encode(text, add_special_tokens=False)) < n_tokens:
        text += "".join(next(gen) for _ in range(20))
    return text


def question(rng: random.Random) -> str:
    return " ".join(rng.choice(common._QUESTIONS).format(
        s=rng.choice(common._SUBJECTS).lower(), o=rng.choice(common._OBJECTS),
        w=rng.choice(common._WHEN)) for _ in range(3))


async def session(client, url: str, model: str, system: str, sid: int, turns: int,
                  max_tokens: int, delay: float, out: list[dict[str, Any]], tenant: int = 0) -> None:
    await asyncio.sleep(delay)
    rng = random.Random(1000 + sid)
    messages = [{"role": "system", "content": system}]
    prev = None
    for turn in range(turns):
        messages.append({"role": "user", "content": f"(session {sid}) {question(rng)}"})
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        ttft = None
        text = ""
        usage: dict[str, Any] = {}
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            replica = r.headers["x-hotprefix-replica"]
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for ch in chunk.get("choices", []):
                    piece = ch.get("delta", {}).get("content")
                    if piece:
                        ttft = ttft if ttft is not None else time.perf_counter() - t0
                        text += piece
                if chunk.get("usage"):
                    usage = chunk["usage"]
        messages.append({"role": "assistant", "content": text})
        out.append({"session": sid, "tenant": tenant, "turn": turn, "replica": replica,
                    "ttft_s": ttft, "e2e_s": time.perf_counter() - t0,
                    "prompt_tokens": usage["prompt_tokens"],
                    "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                    "same_replica": None if prev is None else replica == prev})
        prev = replica


@dataclass
class Workload:
    """Sessions: (system prompt, session id, tenant, start delay), each of ``turns`` turns."""

    name: str
    sessions: list[tuple[str, int, int, float]]
    turns: int
    num_blocks: int | None = None
    """Each replica's pool (None: ``--kv-cache-memory``)."""
    ideal: bool = False
    """Also run one replica with both pools' blocks."""


def workloads(tok, args) -> list[Workload]:
    q = args.quick
    out = []
    if "chat" in args.workloads:
        system = system_prompt(tok, 300 if q else args.system_tokens)
        n, turns = (3, 2) if q else (16, 6)
        out.append(Workload("chat", [(system, s, 0, s * args.stagger_s) for s in range(n)], turns))
    if "tenants" in args.workloads:
        tenants, per, turns = (4, 2, 2) if q else (12, 4, 4)
        n_sys = 300 if q else args.system_tokens
        systems = [system_prompt(tok, n_sys, seed=100 + t, company=f"tenant {t}") for t in range(tenants)]
        sys_tokens = statistics.fmean(len(tok.encode(x, add_special_tokens=False)) for x in systems)
        # a session grows by a question (~60 tokens) and an answer each turn
        per_tenant = sys_tokens + per * turns * (60 + args.max_tokens)
        keep = min(tenants, 2 if q else args.tenants_per_pool)
        blocks = int(keep * per_tenant / BLOCK_SIZE) + 1
        order = [(t, k) for k in range(per) for t in range(tenants)]  # interleaved over tenants
        out.append(Workload("tenants", [(systems[t], t * per + k, t, i * args.stagger_s)
                                        for i, (t, k) in enumerate(order)], turns, blocks, True))
    if "burst" in args.workloads:
        system = system_prompt(tok, 300 if q else args.system_tokens, seed=7)
        n = 6 if q else 24
        out.append(Workload("burst", [(system, s, 0, 0.0) for s in range(n)], 2))
    return out


async def run_workload(url: str, model: str, w: Workload, args) -> list[dict[str, Any]]:
    import httpx

    out: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=900) as client:
        await asyncio.gather(*(session(client, url, model, system, sid, w.turns, args.max_tokens,
                                       delay, out, tenant)
                               for system, sid, tenant, delay in w.sessions))
    return out


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ttfts = sorted(r["ttft_s"] for r in rows if r["ttft_s"] is not None)
    later = [r for r in rows if r["same_replica"] is not None]
    counts = Counter(r["replica"] for r in rows)
    return {"requests": len(rows),
            "hit_ratio": sum(r["cached_tokens"] for r in rows) / sum(r["prompt_tokens"] for r in rows),
            "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
            "cached_tokens": sum(r["cached_tokens"] for r in rows),
            "mean_ttft_s": statistics.fmean(ttfts), "p50_ttft_s": statistics.median(ttfts),
            "p90_ttft_s": ttfts[int(0.9 * (len(ttfts) - 1))],
            "same_replica_share": sum(r["same_replica"] for r in later) / max(1, len(later)),
            "requests_per_replica": sorted((n / len(rows) for n in counts.values()), reverse=True),
            "wall_s": None}


def report(results: dict[str, Any]) -> None:
    """Print each workload's table and ratios (adds the ratios to ``results``)."""
    for name, res in results["workloads"].items():
        print(f"\n({name}) {res['sessions']} sessions x {res['turns']} turns"
              + (f", {res['num_blocks']} blocks a replica" if res["num_blocks"] else ""))
        rows = [[r, f"{s['hit_ratio']:.3f}", f"{s['mean_ttft_s']:.3f}", f"{s['p50_ttft_s']:.3f}",
                 f"{s['p90_ttft_s']:.3f}", f"{s['same_replica_share']:.2f}",
                 " / ".join(f"{x:.2f}" for x in s["requests_per_replica"]), f"{s['wall_s']:.0f}"]
                for r, s in ((r, v["summary"]) for r, v in res["routers"].items())]
        print(common.md_table(["router", "hit ratio", "mean TTFT s", "p50 TTFT s", "p90 TTFT s",
                               "turn on its previous replica", "requests per replica", "wall s"], rows))
        ref = res["routers"].get("ray_default")
        px = res["routers"].get("prefix")
        if ref and px:
            d, p = ref["summary"], px["summary"]
            ratios = {"hit_ratio": p["hit_ratio"] / d["hit_ratio"] if d["hit_ratio"] else float("inf"),
                      "mean_ttft": p["mean_ttft_s"] / d["mean_ttft_s"],
                      "p90_ttft": p["p90_ttft_s"] / d["p90_ttft_s"]}
            res["prefix_over_ray_default"] = ratios
            print(f"prefix / ray_default: hit ratio x{ratios['hit_ratio']:.3f}, mean TTFT "
                  f"x{ratios['mean_ttft']:.3f}, p90 TTFT x{ratios['p90_ttft']:.3f}")
        ideal = res["routers"].get("ideal (1 replica, both pools)")
        if ideal and px:
            res["prefix_over_ideal_hit_ratio"] = px["summary"]["hit_ratio"] / ideal["summary"]["hit_ratio"]
            print(f"prefix / ideal: hit ratio x{res['prefix_over_ideal_hit_ratio']:.3f}")


BLOCK_SIZE = 16


def main(argv: list[str] | None = None) -> int:
    ap = common.base_parser(__doc__)
    ap.add_argument("--workloads", default="chat,tenants,burst",
                    help="comma-separated: chat (a), tenants (b), burst (c)")
    ap.add_argument("--routers", default="prefix,ray_default,round_robin",
                    help="comma-separated: prefix, ray_default, round_robin, least_loaded")
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=24, help="answer length per turn")
    ap.add_argument("--stagger-s", type=float, default=0.5, help="seconds between session starts")
    ap.add_argument("--tenants-per-pool", type=int, default=5,
                    help="(b): tenants' prompts and sessions one replica's pool holds")
    ap.add_argument("--kv-cache-memory", default="512MiB", help="KV pool per replica for (a), (c)")
    ap.add_argument("--model", default=None, help="model path (default: the default model)")
    ap.add_argument("--router-option", action="append", default=[], metavar="NAME=VALUE",
                    help="a RouterConfig setting for the prefix router (e.g. prefill_weight=2)")
    args = ap.parse_args(argv)
    args.workloads = args.workloads.split(",")
    routers = args.routers.split(",")
    if args.quick:
        args.max_tokens = min(args.max_tokens, 8)
        args.stagger_s = min(args.stagger_s, 0.2)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import httpx
    import ray
    from ray import serve

    from hotprefix.config.sections import EngineConfig, ServerConfig
    from hotprefix.fleet.app import APP_NAME, fleet_app
    from hotprefix.fleet.config import FleetConfig
    from hotprefix.model.loader import default_model_path
    from hotprefix.router.config import RouterConfig
    from hotprefix.text.tokenizer import Tokenizer

    opts = {k: float(v) if "." in v else int(v)
            for k, v in (o.split("=", 1) for o in args.router_option)}
    model_path = args.model or default_model_path()
    tok = Tokenizer.load(model_path)
    loads = workloads(tok, args)
    threads = max(1, args.threads // 2)
    port = 18700 + os.getpid() % 200
    url = f"http://127.0.0.1:{port}"
    results: dict[str, Any] = {"environment": common.environment(args.threads, args.quick),
                               "max_tokens": args.max_tokens, "stagger_s": args.stagger_s,
                               "router_options": opts, "workloads": {}}
    out_path = args.out or os.path.join(common.RESULTS_DIR, "fleet_serve.json")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)

    def fleet(w: Workload, router: str, replicas: int, blocks: int | None) -> dict[str, Any]:
        sizing = {"num_blocks": blocks} if blocks else {"kv_cache_memory": args.kv_cache_memory}
        engine = EngineConfig.from_options(model=model_path, num_threads=threads,
                                           block_size=BLOCK_SIZE, **sizing,
                                           kv_events=f"tcp://127.0.0.1:{port + 100}")
        t = time.perf_counter()
        serve.run(fleet_app(engine, ServerConfig(),
                            FleetConfig(replicas=replicas,
                                        router="round_robin" if replicas == 1 else router),
                            RouterConfig(**opts) if router == "prefix" else RouterConfig()),
                  name=APP_NAME, route_prefix="/")
        common.log(f"{w.name} / {router}: fleet of {replicas} up in {time.perf_counter() - t:.1f}s")
        try:
            model = httpx.get(url + "/v1/models", timeout=60).json()["data"][0]["id"]
            t = time.perf_counter()
            rows = asyncio.run(run_workload(url, model, w, args))
            summary = summarize(rows)
            summary["wall_s"] = time.perf_counter() - t
            stats = httpx.get(url + "/v1/cache/stats", timeout=60).json()
            summary["router_view"] = stats.get("router")
        finally:
            serve.delete(APP_NAME)
        common.log(f"{w.name} / {router}: hit ratio {summary['hit_ratio']:.3f}, mean TTFT "
                   f"{summary['mean_ttft_s']:.3f}s, p50 {summary['p50_ttft_s']:.3f}s, p90 "
                   f"{summary['p90_ttft_s']:.3f}s, requests per replica "
                   f"{summary['requests_per_replica']}, {summary['wall_s']:.0f}s")
        return {"summary": summary, "requests": rows}

    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for w in loads:
            res: dict[str, Any] = {"sessions": len(w.sessions), "turns": w.turns,
                                   "num_blocks": w.num_blocks, "routers": {}}
            for router in routers:
                res["routers"][router] = fleet(w, router, 2, w.num_blocks)
            if w.ideal:
                res["routers"]["ideal (1 replica, both pools)"] = fleet(w, "ideal", 1, 2 * w.num_blocks)
            results["workloads"][w.name] = res
            common.write_json(out_path, results)  # what has run so far, if a later fleet fails
    finally:
        serve.shutdown()
        ray.shutdown()
    report(results)
    common.write_json(out_path, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
