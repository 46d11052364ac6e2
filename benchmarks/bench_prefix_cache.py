"""What the prefix cache buys (issue 3), on the default model, in ONE process.

a. TTFT for a 4,000-token system prompt + a 50-token question: **cold** (first request with that
   system prompt), **warm** (same system prompt, a different 50-token question), and the
   in-process **ideal**: transformers given the 4,000-token prefix's KV cache (computed
   beforehand, deep-copied per repetition, copy not timed) computing only the 50 new tokens and
   the first token. Targets: warm <= 1.0x ideal; warm >= 20x faster than cold.
b. N requests (``--requests``, default 64) sharing a 2,048-token prefix, 128 unique tokens each,
   32 output tokens (ignore_eos), all submitted at once with ``llm.generate``: total wall time with
   caching on vs off. Target >= 8x faster. If the off-run is estimated (from the measured prefill
   speed) to take longer than ``--max-off-s`` (default 480 s), it runs on a subset and the total is
   extrapolated linearly; the output then says "EXTRAPOLATED" wherever the figure appears.
c. A 10-turn chat (chat template; each turn appends the previous answer and a new ~60-token user
   message; greedy, 24 tokens): TTFT per turn with caching on (should stay flat) vs off (grows with
   the history). Both engines see exactly the same messages (the answers of the caching-on run).
d. All-unique 256-token prompts (32, max_tokens 8): total time caching on vs off, rounds
   interleaved (order alternates), every prompt unique in every round (a unique first block), median
   of rounds. Target: on <= 3% slower than off.

``--squeeze``: the eviction squeeze instead (issue 30): a pool of fixed bytes (``--pool-bytes``,
default 64MiB) and a workload whose working set is larger than the default pool holds: ``--docs``
documents of ``--doc-tokens`` tokens (default 8 x 448), each request one document and a unique
16-token question, one token out, one request at a time, the documents in a shuffled order each
round (``--rounds``, default 3; the same order for every contender). Per KV dtype
(``--kv-dtypes``, default ``auto,int8``): tokens the pool holds, bytes per token, token hit ratio
and median TTFT. The more tokens the bytes hold, the more documents stay cached.

Contenders: two hotprefix engines (``enable_prefix_caching`` True / False; same
``max_num_batched_tokens=4096`` and ``kv_cache_memory=4GiB`` so the off engine is not starved of KV
blocks) and transformers fp32 for the ideal in (a). Prompts are real tokenized text (a generated
policy handbook) as token-id lists, so lengths are exact. Same torch thread count everywhere.

Run (from the repository root):

    .venv/bin/python benchmarks/bench_prefix_cache.py [--quick] [--threads 2] [--requests 64]

Writes benchmarks/results/prefix_cache.json and prefix_cache.png (2x2 panels) and prints a
markdown table. The full run takes about 8-10 minutes on 2 cores (mostly part b, caching off);
``--quick`` about 2.
"""

from __future__ import annotations

import copy
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from common import log, median  # noqa: E402

TARGET_WARM_VS_IDEAL = 1.0
TARGET_WARM_SPEEDUP = 20.0
TARGET_SHARED_SPEEDUP = 8.0
TARGET_UNIQUE_OVERHEAD = 0.03


def unique_prompt(tok, n: int, tag: str, seed: int) -> list[int]:
    """``n`` tokens of policy text led by a unique ticket tag, so the first block never repeats."""
    head = tok.encode(f"Ticket {tag}: please check this excerpt.", add_special_tokens=False)
    return (head + common.text_tokens(tok, n, seed))[:n]


def gen(llm, prompts, max_tokens: int, ignore_eos: bool = True):
    from hotprefix.request.sampling import SamplingParams

    return llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
                        use_tqdm=False)


# --------------------------------------------------------------------------- a. TTFT
def part_a(llm_on, hf, tok, sys_len: int, q_len: int, repeats: int) -> dict:
    import torch

    log(f"[a] TTFT, {sys_len}-token system prompt + {q_len}-token question")
    cold, warm, ideal, warm_cached = [], [], [], []
    # transformers ideal: the KV of one system prompt, computed once, deep-copied per repetition
    sys0 = common.text_tokens(tok, sys_len, seed=1000)
    with torch.inference_mode():
        t, (_, prefix_cache) = common.timed(lambda: common.hf_forward(
            hf, input_ids=torch.tensor([sys0]), logits_to_keep=1))
    log(f"  transformers prefix KV computed in {t:.1f}s (not timed in the ideal)")
    qseed = 5000
    for rep in range(repeats):
        sys_ids = common.text_tokens(tok, sys_len, seed=1000 + rep)  # new system prompt per rep
        qseed += 1
        out = gen(llm_on, [sys_ids + common.question_tokens(tok, q_len, qseed)], 1)[0]
        assert out.num_cached_tokens == 0, f"cold request hit the cache ({out.num_cached_tokens})"
        cold.append(out.ttft_s)
        log(f"  rep {rep} cold  {out.ttft_s * 1000:9.1f} ms")
        for _ in range(2):  # two warm requests and two ideals per repetition, interleaved
            qseed += 1
            q = common.question_tokens(tok, q_len, qseed)
            out = gen(llm_on, [sys_ids + q], 1)[0]
            warm.append(out.ttft_s)
            warm_cached.append(out.num_cached_tokens)
            past = copy.deepcopy(prefix_cache)
            with torch.inference_mode():
                t0 = time.perf_counter()
                o, _ = common.hf_forward(hf, past, input_ids=torch.tensor([q]), logits_to_keep=1,
                                         position_ids=torch.arange(sys_len, sys_len + q_len)[None])
                int(o.logits[0, -1].argmax())
                ideal.append(time.perf_counter() - t0)
            log(f"  rep {rep} warm  {warm[-1] * 1000:9.1f} ms  (cached {out.num_cached_tokens} tok)"
                f"   ideal {ideal[-1] * 1000:7.1f} ms")
    r = {"system_tokens": sys_len, "question_tokens": q_len,
         "cold_s": median(cold), "warm_s": median(warm), "ideal_s": median(ideal),
         "cold_all_s": cold, "warm_all_s": warm, "ideal_all_s": ideal,
         "warm_num_cached_tokens": warm_cached}
    r["warm_vs_ideal"] = r["warm_s"] / r["ideal_s"]
    r["cold_over_warm"] = r["cold_s"] / r["warm_s"]
    r["cold_prefill_tps"] = (sys_len + q_len) / r["cold_s"]
    return r


# --------------------------------------------------------------------------- b. shared prefix
def part_b(llm_on, llm_off, tok, n_req: int, prefix_len: int, uniq_len: int, n_out: int,
           prefill_tps: float, max_off_s: float) -> dict:
    log(f"[b] {n_req} requests, {prefix_len}-token shared prefix + {uniq_len} unique, {n_out} out")

    def prompts(seed: int, n: int) -> list[list[int]]:
        prefix = common.text_tokens(tok, prefix_len, seed=seed)
        return [prefix + unique_prompt(tok, uniq_len, f"B{seed}-{i}", seed * 1000 + i)
                for i in range(n)]

    t_on, outs = common.timed(lambda: gen(llm_on, prompts(20_001, n_req), n_out))
    cached_on = sum(o.num_cached_tokens for o in outs)
    log(f"  caching on : {t_on:7.1f}s  ({cached_on} prompt tokens from cache)")
    # off-run: full if it fits the time budget, else a labelled linear extrapolation from a subset
    est = n_req * (prefix_len + uniq_len) / prefill_tps
    n_off = n_req
    if est > max_off_s:
        n_off = max(4, math.ceil(n_req * max_off_s / est))
        log(f"  caching off estimated at {est:.0f}s > {max_off_s:.0f}s: measuring {n_off} of "
            f"{n_req} requests and EXTRAPOLATING")
    t_off_meas, outs = common.timed(lambda: gen(llm_off, prompts(20_002, n_off), n_out))
    assert all(o.num_cached_tokens == 0 for o in outs)
    t_off = t_off_meas * n_req / n_off
    log(f"  caching off: {t_off_meas:7.1f}s for {n_off} requests"
        + (f" -> {t_off:.1f}s EXTRAPOLATED to {n_req}" if n_off < n_req else ""))
    return {"requests": n_req, "prefix_tokens": prefix_len, "unique_tokens": uniq_len,
            "output_tokens": n_out, "on_s": t_on, "off_s": t_off, "off_measured_s": t_off_meas,
            "off_requests_measured": n_off, "off_extrapolated": n_off < n_req,
            "off_estimate_before_run_s": est, "on_cached_prompt_tokens": cached_on,
            "speedup": t_off / t_on}


# --------------------------------------------------------------------------- c. conversation
def part_c(llm_on, llm_off, tok, turns: int, sys_len: int, user_tokens: int, n_out: int) -> dict:
    log(f"[c] {turns}-turn chat, ~{sys_len}-token system message, ~{user_tokens}-token user turns")
    system = "You answer questions about this company policy handbook.\n" + tok.decode(
        common.text_tokens(tok, sys_len, seed=30_000))
    msgs = [{"role": "system", "content": system}]
    rows = []
    for t in range(turns):
        q = tok.decode(common.question_tokens(tok, user_tokens, seed=31_000 + t)).strip()
        msgs.append({"role": "user", "content": q})
        order = [("on", llm_on), ("off", llm_off)] if t % 2 == 0 else [("off", llm_off), ("on", llm_on)]
        res = {}
        for name, llm in order:
            from hotprefix.request.sampling import SamplingParams

            res[name] = llm.chat(msgs, SamplingParams(max_tokens=n_out), use_tqdm=False)[0]
        on, off = res["on"], res["off"]
        rows.append({"turn": t + 1, "prompt_tokens": len(on.prompt_token_ids),
                     "on_ttft_s": on.ttft_s, "off_ttft_s": off.ttft_s,
                     "on_cached_tokens": on.num_cached_tokens,
                     "same_answer": on.token_ids == off.token_ids})
        log(f"  turn {t + 1:2d} prompt {len(on.prompt_token_ids):5d} tok  on {on.ttft_s * 1000:8.1f} ms "
            f"(cached {on.num_cached_tokens})  off {off.ttft_s * 1000:8.1f} ms")
        msgs.append({"role": "assistant", "content": on.text})  # both engines get the same history
    return {"turns": rows, "on_ttft_s": [r["on_ttft_s"] for r in rows],
            "off_ttft_s": [r["off_ttft_s"] for r in rows]}


# --------------------------------------------------------------------------- d. no-hit overhead
def part_d(llm_on, llm_off, tok, n_prompts: int, length: int, n_out: int, rounds: int) -> dict:
    log(f"[d] {n_prompts} unique {length}-token prompts, {n_out} out, {rounds} rounds")
    times = {"on": [], "off": []}
    hits = 0
    for r in range(rounds):
        order = [("on", llm_on), ("off", llm_off)] if r % 2 == 0 else [("off", llm_off), ("on", llm_on)]
        for name, llm in order:
            ps = [unique_prompt(tok, length, f"D{r}-{name}-{i}", 40_000 + r * 1000 + i + (500 if name == "on" else 0))
                  for i in range(n_prompts)]
            t, outs = common.timed(lambda: gen(llm, ps, n_out))
            hits += sum(o.num_cached_tokens for o in outs)
            times[name].append(t)
            log(f"  round {r} caching {name:3s}: {t:6.2f}s")
    on, off = median(times["on"]), median(times["off"])
    return {"prompts": n_prompts, "prompt_tokens": length, "output_tokens": n_out, "rounds": rounds,
            "on_s": on, "off_s": off, "on_all_s": times["on"], "off_all_s": times["off"],
            "overhead": on / off - 1, "cached_tokens_total": hits}


# --------------------------------------------------------------------------- plot + table
def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(11, 8))
    a = res["a"]
    bars = [a["cold_s"] * 1000, a["warm_s"] * 1000, a["ideal_s"] * 1000]
    ax[0, 0].bar(["cold", "warm (cached)", "transformers\n+ prefix KV (ideal)"], bars,
                 color=["#c44", "#2a7", "#888"])
    ax[0, 0].set_yscale("log")
    ax[0, 0].set_ylabel("TTFT (ms, log)")
    ax[0, 0].set_title(f"a. TTFT, {a['system_tokens']}-tok system + {a['question_tokens']}-tok question")
    for i, v in enumerate(bars):
        ax[0, 0].text(i, v, f"{v:,.0f}", ha="center", va="bottom")
    b = res["b"]
    ax[0, 1].bar(["caching on", "caching off" + (" (extrap.)" if b["off_extrapolated"] else "")],
                 [b["on_s"], b["off_s"]], color=["#2a7", "#c44"])
    ax[0, 1].set_ylabel("total wall time (s)")
    ax[0, 1].set_title(f"b. {b['requests']} requests, shared {b['prefix_tokens']}-tok prefix: "
                       f"{b['speedup']:.1f}x")
    c = res["c"]
    turns = [r["turn"] for r in c["turns"]]
    ax[1, 0].plot(turns, [x * 1000 for x in c["on_ttft_s"]], "o-", color="#2a7", label="caching on")
    ax[1, 0].plot(turns, [x * 1000 for x in c["off_ttft_s"]], "o-", color="#c44", label="caching off")
    ax[1, 0].set_xlabel("turn")
    ax[1, 0].set_xticks(turns)
    ax[1, 0].set_ylim(bottom=0)
    ax[1, 0].set_ylabel("TTFT (ms)")
    ax[1, 0].set_title("c. multi-turn chat: TTFT per turn")
    ax[1, 0].legend()
    d = res["d"]
    ax[1, 1].bar(["caching on", "caching off"], [d["on_s"], d["off_s"]], color=["#2a7", "#c44"])
    ax[1, 1].set_ylabel("total time (s), median of rounds")
    ax[1, 1].set_title(f"d. {d['prompts']} unique {d['prompt_tokens']}-tok prompts: "
                       f"overhead {d['overhead'] * 100:+.1f}%")
    mode = "quick run (noisy)" if res["environment"]["quick"] else "full run"
    fig.suptitle(f"hotprefix prefix cache, SmolLM2-135M Q4_1, {res['environment']['threads']} "
                 f"threads, {mode}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log(f"wrote {path}")


def tables(res: dict) -> str:
    a, b, c, d = res["a"], res["b"], res["c"], res["d"]
    ext = " (EXTRAPOLATED from %d requests)" % b["off_requests_measured"] if b["off_extrapolated"] else ""
    ok = lambda cond: "PASS" if cond else "FAIL"  # noqa: E731
    rows = [
        [f"a. TTFT {a['system_tokens']}+{a['question_tokens']} tok: cold",
         f"{a['cold_s'] * 1000:,.0f} ms", "", ""],
        ["a. TTFT warm (same system prompt)", f"{a['warm_s'] * 1000:,.0f} ms",
         f"{a['cold_over_warm']:.1f}x faster than cold", f">= {TARGET_WARM_SPEEDUP:.0f}x: "
         f"{ok(a['cold_over_warm'] >= TARGET_WARM_SPEEDUP)}"],
        ["a. TTFT ideal (transformers + prefix KV)", f"{a['ideal_s'] * 1000:,.0f} ms",
         f"warm = {a['warm_vs_ideal']:.2f}x ideal", f"<= {TARGET_WARM_VS_IDEAL:.1f}x: "
         f"{ok(a['warm_vs_ideal'] <= TARGET_WARM_VS_IDEAL)}"],
        [f"b. {b['requests']} req, shared {b['prefix_tokens']}-tok prefix: caching on",
         f"{b['on_s']:,.1f} s", "", ""],
        ["b. caching off" + ext, f"{b['off_s']:,.1f} s", f"on is {b['speedup']:.1f}x faster",
         f">= {TARGET_SHARED_SPEEDUP:.0f}x: {ok(b['speedup'] >= TARGET_SHARED_SPEEDUP)}"],
        [f"c. {len(c['turns'])}-turn chat TTFT, caching on (turn 1 / last / mean of 2..n)",
         "%.0f / %.0f / %.0f ms" % (c["on_ttft_s"][0] * 1000, c["on_ttft_s"][-1] * 1000,
                                    1000 * sum(c["on_ttft_s"][1:]) / max(1, len(c["on_ttft_s"]) - 1)),
         "", ""],
        ["c. caching off (turn 1 / last / mean of 2..n)",
         "%.0f / %.0f / %.0f ms" % (c["off_ttft_s"][0] * 1000, c["off_ttft_s"][-1] * 1000,
                                    1000 * sum(c["off_ttft_s"][1:]) / max(1, len(c["off_ttft_s"]) - 1)),
         f"last turn: on {c['off_ttft_s'][-1] / c['on_ttft_s'][-1]:.1f}x faster", ""],
        [f"d. {d['prompts']} unique {d['prompt_tokens']}-tok prompts: on / off",
         f"{d['on_s']:.2f} s / {d['off_s']:.2f} s", f"overhead {d['overhead'] * 100:+.1f}%",
         f"<= {TARGET_UNIQUE_OVERHEAD * 100:.0f}%: {ok(d['overhead'] <= TARGET_UNIQUE_OVERHEAD)}"],
    ]
    out = [common.md_table(["measurement", "time", "ratio (same run)", "target"], rows), ""]
    trows = [[r["turn"], r["prompt_tokens"], r["on_cached_tokens"], f"{r['on_ttft_s'] * 1000:,.0f}",
              f"{r['off_ttft_s'] * 1000:,.0f}", f"{r['off_ttft_s'] / r['on_ttft_s']:.1f}x"]
             for r in c["turns"]]
    out += [common.md_table(["turn", "prompt tokens", "cached tokens (on)", "TTFT on (ms)",
                             "TTFT off (ms)", "off / on"], trows), ""]
    env = res["environment"]
    mode = "quick run, noisy" if env["quick"] else "full run"
    out.append(f"_{mode}: {env['threads']} torch threads; a: median of {len(a['cold_all_s'])} cold "
               f"and {len(a['warm_all_s'])} warm/ideal; b: one run each{ext}; d: median of "
               f"{d['rounds']} interleaved rounds._")
    return "\n".join(out)


def squeeze(args) -> None:
    """``--squeeze``: the same workload through a pool of the same bytes in each KV dtype."""
    import random

    kinds = args.kv_dtypes.split(",")
    res: dict = {"benchmark": "prefix_cache_squeeze", "pool_bytes": args.pool_bytes, "docs": args.docs,
                 "doc_tokens": args.doc_tokens, "rounds": args.rounds, "runs": {}}
    rng = random.Random(0)
    order = [rng.sample(range(args.docs), args.docs) for _ in range(args.rounds)]
    for kind in kinds:
        llm = common.load_hotprefix(args.threads, kv_cache_memory=args.pool_bytes, kv_cache_dtype=kind,
                                    max_num_batched_tokens=4096)
        tok, r = llm.tokenizer, llm.engine.runner
        docs = [unique_prompt(tok, args.doc_tokens, f"doc-{d}", 100 + d) for d in range(args.docs)]
        gen(llm, [unique_prompt(tok, 96, "warmup", 999)], 1)
        llm.reset_prefix_cache()
        ttft, hit, total = [], 0, 0
        for rnd, ds in enumerate(order):
            for i, d in enumerate(ds):
                prompt = docs[d] + common.question_tokens(tok, 16, 1000 * rnd + i)
                out = gen(llm, [prompt], 1)[0]
                ttft.append(out.ttft_s)
                hit += out.num_cached_tokens
                total += len(prompt)
        run = {"kv_dtype": r.kv_dtype.name, "bytes_per_token": r.bytes_per_token,
               "capacity_tokens": r.capacity_tokens, "working_set_tokens": args.docs * args.doc_tokens,
               "token_hit_ratio": hit / total, "ttft_median_s": median(ttft),
               "ttft_median_after_round1_s": median(ttft[args.docs:])}
        res["runs"][kind] = run
        log(f"  {kind}: {run}")
        del llm
    rows = [[k, v["kv_dtype"], f"{v['bytes_per_token']:,}", f"{v['capacity_tokens']:,}",
             f"{v['working_set_tokens']:,}", f"{v['token_hit_ratio']:.1%}",
             f"{v['ttft_median_s'] * 1e3:.0f} ms", f"{v['ttft_median_after_round1_s'] * 1e3:.0f} ms"]
            for k, v in res["runs"].items()]
    table = common.md_table(["--kv-cache-dtype", "pool", "bytes/token", "tokens held", "working set",
                             "token hit ratio", "TTFT median", "TTFT median, rounds 2+"], rows)
    env = common.environment(args.threads, args.quick)
    res.update(environment=env, markdown=table)
    print(table + f"\n\n_pool {args.pool_bytes}; {args.docs} documents x {args.doc_tokens} tokens + "
          f"16 unique, {args.rounds} shuffled rounds, 1 output token; {env['cpu']}_")
    common.write_json(args.out or os.path.join(common.RESULTS_DIR, "prefix_cache_squeeze.json"), res)


def main() -> None:
    ap = common.base_parser(__doc__)
    ap.add_argument("--squeeze", action="store_true",
                    help="the eviction squeeze: a fixed-bytes pool per KV dtype (see above)")
    ap.add_argument("--pool-bytes", default="64MiB", help="--squeeze: the pool's bytes")
    ap.add_argument("--kv-dtypes", default="auto,int8", help="--squeeze: KV dtypes compared")
    ap.add_argument("--docs", type=int, default=8, help="--squeeze: documents")
    ap.add_argument("--doc-tokens", type=int, default=448, help="--squeeze: tokens per document")
    ap.add_argument("--rounds", type=int, default=3, help="--squeeze: rounds over the documents")
    ap.add_argument("--requests", type=int, default=None, help="part b requests (default 64; quick 8)")
    ap.add_argument("--max-off-s", type=float, default=480.0,
                    help="part b: above this estimated off-run time, measure a subset and "
                         "extrapolate (labelled)")
    ap.add_argument("--plot", default=None, help="PNG path (default benchmarks/results/prefix_cache.png)")
    args = ap.parse_args()
    common.setup_threads(args.threads)
    if args.squeeze:
        return squeeze(args)
    q = args.quick
    cfg = dict(
        a=dict(sys_len=1024 if q else 4000, q_len=50, repeats=args.repeats or (2 if q else 3)),
        b=dict(n_req=args.requests or (8 if q else 64), prefix_len=512 if q else 2048, uniq_len=128,
               n_out=8 if q else 32),
        c=dict(turns=4 if q else 10, sys_len=256 if q else 512, user_tokens=60, n_out=12 if q else 24),
        d=dict(n_prompts=8 if q else 32, length=256, n_out=8, rounds=args.repeats or (2 if q else 3)),
    )
    opts = dict(max_num_batched_tokens=4096, kv_cache_memory="4GiB")
    log("loading models ...")
    llm_on = common.load_hotprefix(args.threads, enable_prefix_caching=True, **opts)
    llm_off = common.load_hotprefix(args.threads, enable_prefix_caching=False, **opts)
    hf = common.load_transformers()
    tok = llm_on.tokenizer

    warm = unique_prompt(tok, 96, "warmup", 999)
    for llm in (llm_on, llm_off):
        gen(llm, [warm, warm[:64]], 4)
    import torch
    with torch.inference_mode():
        common.hf_forward(hf, input_ids=torch.tensor([warm]), logits_to_keep=1)

    t0 = time.perf_counter()
    res: dict = {"benchmark": "prefix_cache", "config": cfg}
    res["a"] = part_a(llm_on, hf, tok, **cfg["a"])
    del hf
    res["b"] = part_b(llm_on, llm_off, tok, prefill_tps=res["a"]["cold_prefill_tps"],
                      max_off_s=args.max_off_s, **cfg["b"])
    res["c"] = part_c(llm_on, llm_off, tok, **cfg["c"])
    res["d"] = part_d(llm_on, llm_off, tok, **cfg["d"])
    env = common.environment(args.threads, q)
    env["elapsed_s"] = time.perf_counter() - t0
    res["environment"] = env
    res["targets"] = {"warm_vs_ideal_max": TARGET_WARM_VS_IDEAL, "cold_over_warm_min": TARGET_WARM_SPEEDUP,
                      "shared_prefix_speedup_min": TARGET_SHARED_SPEEDUP,
                      "unique_overhead_max": TARGET_UNIQUE_OVERHEAD}
    res["cache_stats_on"] = {k: v for k, v in llm_on.cache_stats().items()
                             if isinstance(v, (int, float, str, bool))}
    table = tables(res)
    res["markdown"] = table
    print(table)
    common.write_json(args.out or os.path.join(common.RESULTS_DIR, "prefix_cache.json"), res)
    plot(res, args.plot or os.path.join(common.RESULTS_DIR, "prefix_cache.png"))


if __name__ == "__main__":
    main()
