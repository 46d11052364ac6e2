"""A fleet end to end on this machine (issue 14): 2 replicas of the default model on Ray Serve,
chat sessions sharing a long system prompt, prefix-aware routing vs Ray Serve's default router.

Both fleets run in this one process, one after the other, on the same Ray instance, with the same
sessions (temperature 0: the same answers, hence the same prompts): ``hotprefix.fleet.fleet_app``
with ``router=prefix`` (the routing core as a Ray Serve ``RequestRouter``, KV events on) and with
``router=ray_default`` (no custom router: Ray Serve's ``PowerOfTwoChoicesRequestRouter``). Each
fleet starts cold. Sessions start ``--stagger-s`` apart and run their turns back to back, each
turn carrying the whole conversation so far; every request streams through the front end's HTTP
port and the client measures its time to first token (first content chunk).

With ``--router-option NAME=VALUE`` a third fleet runs between them: the prefix router with those
``RouterConfig`` settings. Reported per router: the token hit ratio (cached prompt tokens / prompt tokens, from each
response's usage), the mean and median client TTFT, how often a session's turn went to the
replica of its previous turn, and the share of requests each replica served; then the ratios
prefix / ray_default. Writes results/fleet_serve.json. Run from the repository root:
``.venv/bin/python benchmarks/bench_fleet_serve.py`` (``--quick``: 4 sessions x 3 turns).
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
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def system_prompt(tokenizer, n_tokens: int) -> str:
    """About ``n_tokens`` tokens of policy-handbook text (stable across runs)."""
    rng = random.Random(14)
    gen = common.policy_sentences(rng)
    text = "You are the assistant of the Harbor Logistics help desk. The handbook follows."
    while len(tokenizer.encode(text, add_special_tokens=False)) < n_tokens:
        text += "".join(next(gen) for _ in range(20))
    return text


def question(rng: random.Random) -> str:
    return " ".join(rng.choice(common._QUESTIONS).format(
        s=rng.choice(common._SUBJECTS).lower(), o=rng.choice(common._OBJECTS),
        w=rng.choice(common._WHEN)) for _ in range(3))


async def session(client, url: str, model: str, system: str, sid: int, turns: int,
                  max_tokens: int, delay: float, out: list[dict[str, Any]]) -> None:
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
        out.append({"session": sid, "turn": turn, "replica": replica, "ttft_s": ttft,
                    "e2e_s": time.perf_counter() - t0, "prompt_tokens": usage["prompt_tokens"],
                    "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                    "same_replica": None if prev is None else replica == prev})
        prev = replica


async def workload(url: str, model: str, system: str, args) -> list[dict[str, Any]]:
    import httpx

    out: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(session(client, url, model, system, s, args.turns, args.max_tokens,
                                       s * args.stagger_s, out) for s in range(args.sessions)))
    return out


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ttfts = [r["ttft_s"] for r in rows if r["ttft_s"] is not None]
    later = [r for r in rows if r["same_replica"] is not None]
    counts = Counter(r["replica"] for r in rows)
    return {"requests": len(rows),
            "hit_ratio": sum(r["cached_tokens"] for r in rows) / sum(r["prompt_tokens"] for r in rows),
            "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
            "cached_tokens": sum(r["cached_tokens"] for r in rows),
            "mean_ttft_s": statistics.fmean(ttfts), "median_ttft_s": statistics.median(ttfts),
            "p90_ttft_s": sorted(ttfts)[int(0.9 * (len(ttfts) - 1))],
            "same_replica_share": sum(r["same_replica"] for r in later) / max(1, len(later)),
            "replica_shares": sorted((n / len(rows) for n in counts.values()), reverse=True),
            "wall_s": None}


def main(argv: list[str] | None = None) -> int:
    ap = common.base_parser(__doc__)
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=24, help="answer length per turn")
    ap.add_argument("--stagger-s", type=float, default=0.5, help="seconds between session starts")
    ap.add_argument("--kv-cache-memory", default="512MiB", help="KV pool per replica")
    ap.add_argument("--router-option", action="append", default=[], metavar="NAME=VALUE",
                    help="a RouterConfig setting (e.g. shared_prefix_fanout=4): adds a third contender, "
                         "the prefix router with these settings (the first keeps the core's defaults)")
    args = ap.parse_args(argv)
    if args.quick:
        args.sessions, args.turns, args.system_tokens = 4, 3, 400
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import httpx
    import ray
    from ray import serve

    from hotprefix.config import EngineConfig, ServerConfig
    from hotprefix.fleet.app import APP_NAME, fleet_app
    from hotprefix.fleet.config import FleetConfig
    from hotprefix.model.loader import default_model_path
    from hotprefix.router.config import RouterConfig
    from hotprefix.tokenizer import Tokenizer

    opts = {k: float(v) if "." in v else int(v)
            for k, v in (o.split("=", 1) for o in args.router_option)}
    contenders = [("prefix", "prefix", RouterConfig())]
    if opts:
        label = "prefix, " + ", ".join(f"{k}={v}" for k, v in opts.items())
        contenders.append((label, "prefix", RouterConfig(**opts)))
    contenders.append(("ray_default", "ray_default", RouterConfig()))
    tok = Tokenizer.load(default_model_path())
    system = system_prompt(tok, args.system_tokens)
    common.log(f"{args.sessions} sessions x {args.turns} turns, system prompt "
               f"{len(tok.encode(system, add_special_tokens=False))} tokens, 2 replicas x "
               f"{args.threads // 2 or 1} thread(s)")
    port = 18700 + os.getpid() % 200
    url = f"http://127.0.0.1:{port}"
    results: dict[str, Any] = {"environment": common.environment(args.threads, args.quick),
                               "sessions": args.sessions, "turns": args.turns,
                               "system_tokens": args.system_tokens, "max_tokens": args.max_tokens,
                               "stagger_s": args.stagger_s, "router_options": opts, "routers": {}}
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for name, router, router_config in contenders:
            engine = EngineConfig.from_options(num_threads=max(1, args.threads // 2),
                                               kv_cache_memory=args.kv_cache_memory,
                                               kv_events=f"tcp://127.0.0.1:{port + 100}")
            t = time.perf_counter()
            serve.run(fleet_app(engine, ServerConfig(), FleetConfig(replicas=2, router=router),
                                router_config), name=APP_NAME, route_prefix="/")
            common.log(f"{name}: fleet up in {time.perf_counter() - t:.1f}s")
            model = httpx.get(url + "/v1/models", timeout=60).json()["data"][0]["id"]
            t = time.perf_counter()
            rows = asyncio.run(workload(url, model, system, args))
            summary = summarize(rows)
            summary["wall_s"] = time.perf_counter() - t
            stats = httpx.get(url + "/v1/cache/stats", timeout=60).json()
            summary["fleet_hit_rate"] = stats["hit_rate"]
            summary["router_view"] = stats.get("router")
            results["routers"][name] = {"summary": summary, "requests": rows}
            common.log(f"{name}: hit ratio {summary['hit_ratio']:.3f}, mean TTFT "
                       f"{summary['mean_ttft_s']:.3f}s, {summary['wall_s']:.0f}s")
            serve.delete(APP_NAME)
    finally:
        serve.shutdown()
        ray.shutdown()
    names = [c[0] for c in contenders]
    rows = [[r, f"{s['hit_ratio']:.3f}", f"{s['mean_ttft_s']:.3f}", f"{s['median_ttft_s']:.3f}",
             f"{s['p90_ttft_s']:.3f}", f"{s['same_replica_share']:.2f}",
             " / ".join(f"{x:.2f}" for x in s["replica_shares"]), f"{s['wall_s']:.0f}"]
            for r, s in ((r, results["routers"][r]["summary"]) for r in names)]
    print(common.md_table(["router", "hit ratio", "mean TTFT s", "median TTFT s", "p90 TTFT s",
                           "turn on its previous replica", "requests per replica", "wall s"], rows))
    d = results["routers"]["ray_default"]["summary"]
    results["ratios_over_ray_default"] = {}
    for r in names[:-1]:
        p = results["routers"][r]["summary"]
        ratios = {"hit_ratio": p["hit_ratio"] / d["hit_ratio"] if d["hit_ratio"] else float("inf"),
                  "mean_ttft": p["mean_ttft_s"] / d["mean_ttft_s"]}
        results["ratios_over_ray_default"][r] = ratios
        print(f"{r} / ray_default: hit ratio x{ratios['hit_ratio']:.3f}, mean TTFT "
              f"x{ratios['mean_ttft']:.3f} ({1 / ratios['mean_ttft']:.2f}x as fast)")
    common.write_json(args.out or os.path.join(common.RESULTS_DIR, "fleet_serve.json"), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
