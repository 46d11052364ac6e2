"""bench_swa_chat's workload replayed through the cache alone: the real scheduler, cache manager and
message-end marks, Gemma's tokenizer and chat template, no model and no HTTP (seconds, not an hour).

What the hybrid pool sees in ``bench_swa_chat.py`` (issue 28): ``--sessions`` (16) x ``--turns``
(6), each session with its own ~1,500-token system prompt (the same handbooks), ``--concurrency``
(4) turns in flight, a session's next turn after its previous one, a pool of ``--pool-sessions``
sessions' full K/V sized as bench_swa_chat sizes ``--num-blocks``. Each prompt is the session's
messages rendered through ``gemma_chat_template.jinja``; the server's message ends
(``server/message_ends.message_ends`` itself) are its ``hit_point_tokens`` (system end) and
``turn_end_tokens`` (earlier turns' ends); the
requests run through ``engine.Scheduler`` over a ``KVCacheManager`` built as the engine builds it
(``CacheConfig``'s policy and ghost list, ``SchedulerConfig``'s token budget), one step at a time,
a new turn sent as soon as a worker is free. The one thing not real: the replies. The model's
reply is replaced by ``--max-tokens`` (32) tokens of handbook text (deterministic per session and
turn) that re-tokenize to the same ids, as the model's do (bench_swa_chat's turns hit at their
previous sequence's end). Checked against the real runs (results/swa_chat_pool{6,8}.json): at a
pool of 8 sessions 0.828 hit ratio, 0/80 re-prefilled, hits by kind 72 sequence ends and 7 message
ends (real: 0.828, 0/80, 72 and 7); at 6, 0.000 and 80/80 with 56,718 evictions (real: 56,712).

Per pool size: the hit ratio, the turns re-prefilled (bench_swa_chat's rule: the hit does not
cover the system prompt), the hits by kind, the peak pages in use, and when the policy first took a
block of a session that had turns to come (what was in use then). ``--account`` also replays the
workload in a pool with room for everything and prints, after each round of turns, what one
session keeps (full pages, window pages kept, the one window its next turn reads) and what all
sessions need against the pool: where the hybrid pool's working set stops fitting.

    .venv/bin/python benchmarks/bench_swa_chat_replay.py [--pool-sessions 6,7,8] [--account] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import os
import random
import statistics
import sys
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_swa_chat as swa  # noqa: E402
import common  # noqa: E402

from hotprefix.cache.block_pool import BlockPool  # noqa: E402
from hotprefix.cache.hashing import BlockHasher, namespace_key  # noqa: E402
from hotprefix.cache.kv_groups import parse_layer_mix  # noqa: E402
from hotprefix.cache.manager import KVCacheManager  # noqa: E402
from hotprefix.cache.window_groups import WindowGroups  # noqa: E402
from hotprefix.config.sections import CacheConfig, SchedulerConfig  # noqa: E402
from hotprefix.engine.request import Request  # noqa: E402
from hotprefix.engine.scheduler import Scheduler  # noqa: E402
from hotprefix.request.sampling import SamplingParams  # noqa: E402
from hotprefix.server.message_ends import NO_ENDS, MessageEnds  # noqa: E402
from hotprefix.server.message_ends import message_ends as server_message_ends  # noqa: E402


def reply_ids(tok, session: int, turn: int, n: int) -> list[int]:
    """The stand-in for the model's reply: ``n`` tokens of handbook text."""
    gen = common.policy_sentences(random.Random(77000 + 100 * session + turn))
    return tok.encode("".join(next(gen) for _ in range(4)).strip(), add_special_tokens=False)[:n]


def message_ends(tok, msgs: list[dict[str, str]], ids: list[int]) -> MessageEnds:
    """``server/message_ends.message_ends`` itself, its tokenizer calls made here (no executor)."""
    async def encode(fn, *args):
        return fn(*args)

    state = SimpleNamespace(marks_message_ends=True, tokenizer=tok, encode=encode)
    return asyncio.run(server_message_ends(state, msgs, ids))


def manager(pages: int, layout, bs: int) -> KVCacheManager:
    pool = BlockPool(pages, bs, CacheConfig.eviction_policy, CacheConfig.ghost_size)
    m = KVCacheManager(pool, BlockHasher(namespace_key("replay", "gemma"), bs))
    if layout.hybrid:
        m.windows = WindowGroups(pool, bs, {g: grp.window for g, grp in enumerate(layout.groups) if g})
    return m


def window_pages(m: KVCacheManager, owner: dict, session: int) -> collections.Counter:
    """One session's cached pages: full, window kept, window interior (or dead)."""
    out: collections.Counter = collections.Counter()
    for b in m.pool.index.values():
        if owner.get(b.chain[0] if b.group else b.key) != session:
            continue
        out["full" if not b.group else ("window_kept" if b.kept and not b.dead else "window_interior")] += 1
    return out


def replay(tok, sessions, args, layout, pages: int, account: bool = False) -> dict[str, Any]:
    bs = args.block_size
    m = manager(pages, layout, bs)
    sched = Scheduler(SchedulerConfig(), m, 1 << 20)
    history = {s.sid: [{"role": "system", "content": s.system}] for s in sessions}
    jobs = collections.deque((s, t) for t in range(args.turns) for s in sessions)
    done: set[tuple[int, int]] = set()
    running: dict[str, tuple] = {}
    owner: dict[bytes, int] = {}  # block key -> session (for the accounting)
    rows, rounds = [], []
    free_workers, peak = args.concurrency, 0
    first: dict[str, Any] = {}  # the first policy eviction of a block of a session with turns to come
    if m.pool.on_policy_evict is not None:
        keep = m.pool.on_policy_evict

        def on_policy_evict(b, keep=keep):
            sid = owner.get(b.chain[0] if b.group else b.key)
            if sid is not None and not first and (sid, args.turns - 1) not in done:
                first.update(session=sid, turns_done=len(rows), pages_in_use=m.pool.num_in_use,
                             pages_cached_free=len(m.pool.policy) + len(m.pool.low),
                             running=sorted(running))
            keep(b)
        m.pool.on_policy_evict = on_policy_evict
    while jobs or running:
        while free_workers and jobs and (jobs[0][1] == 0 or (jobs[0][0].sid, jobs[0][1] - 1) in done):
            s, t = jobs.popleft()
            msgs = history[s.sid] + [{"role": "user", "content": s.questions[t]}]
            ids = tok.encode_chat(msgs)
            ends = message_ends(tok, msgs, ids) if layout.hybrid else NO_ENDS
            req = Request(f"s{s.sid}t{t}", list(ids), len(ids),
                          params=SamplingParams(max_tokens=args.max_tokens, temperature=0),
                          hit_point_tokens=ends.system, turn_end_tokens=ends.turns)
            sched.add(req)
            running[req.request_id] = (s, t, msgs, reply_ids(tok, s.sid, t, args.max_tokens))
            free_workers -= 1
        out = sched.schedule()
        peak = max(peak, m.pool.num_in_use)
        sampled = {c.request.request_id: running[c.request.request_id][3][c.request.num_output_tokens]
                   for c in out.chunks if c.wants_logits}
        for r in sched.update(out, sampled):
            if r.num_output_tokens < args.max_tokens:
                continue
            s, t, msgs, reply = running.pop(r.request_id)
            for k in m.keys(r):
                owner[k] = s.sid
            sched.finish(r, "length")
            history[s.sid] = msgs + [{"role": "assistant", "content": tok.decode(reply)}]
            done.add((s.sid, t))
            free_workers += 1
            rows.append({"session": s.sid, "turn": t, "prompt_tokens": r.num_prompt_tokens,
                         "cached_tokens": r.num_cached_tokens, "system_tokens": s.system_tokens,
                         "hit_point_tokens": list(r.hit_point_tokens),
                         "turn_end_tokens": list(r.turn_end_tokens)})
            if account and s.sid == sessions[-1].sid:  # a round of turns ended
                rounds.append(round_figures(m, owner, sessions, layout, bs, t))
    m.pool.check_invariants()
    assert m.pool.num_in_use == 0
    later = [r for r in rows if r["turn"]]
    res = {"pages": pages,
           "hit_ratio": round(sum(r["cached_tokens"] for r in rows) / sum(r["prompt_tokens"] for r in rows), 4),
           "reprefill_turns": sum(swa.is_reprefill(r, bs) for r in rows), "turns_after_first": len(later),
           "hit_ratio_by_turn": [round(sum(r["cached_tokens"] for r in rows if r["turn"] == t)
                                       / sum(r["prompt_tokens"] for r in rows if r["turn"] == t), 4)
                                 for t in range(args.turns)],
           "evictions": m.pool.num_evictions, "peak_pages_in_use": peak,
           "first_session_block_evicted": first or None}
    if m.windows is not None:
        res["hits_by_kind"] = dict(m.windows.hits_by_kind)
        res["resumed_earlier"] = m.windows.resumed_earlier
    if account:
        res["rounds"] = rounds
    return res


def round_figures(m: KVCacheManager, owner: dict, sessions, layout, bs: int, turn: int) -> dict[str, Any]:
    """After a round of turns: what each session keeps, and what one window a session would be."""
    per = [window_pages(m, owner, s.sid) for s in sessions]
    one_window = layout.num_window_groups * -(-(layout.window - 1) // bs)
    full = statistics.fmean(c["full"] for c in per)
    kept = statistics.fmean(c["window_kept"] for c in per)
    return {"turn": turn + 1, "full_pages_per_session": round(full, 1),
            "window_pages_kept_per_session": round(kept, 1), "one_window_pages": one_window,
            "all_sessions_kept_pages": round(len(sessions) * (full + kept)),
            "all_sessions_one_window_pages": round(len(sessions) * (full + one_window))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pool-sessions", default="6,6.5,7,8", help="comma-separated pool sizes")
    p.add_argument("--configs", default="hybrid,full", help="hybrid, full (every layer's K/V)")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=1500)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--sliding-window", type=int, default=512)
    p.add_argument("--local-layers", default="15/18", help="Gemma 3 270M's mix")
    p.add_argument("--account", action="store_true", help="also the page accounting (see above)")
    p.add_argument("--json", default=None, metavar="OUT")
    args = p.parse_args()
    from hotprefix.model.metadata import resolve_model_path
    from hotprefix.text.tokenizer import Tokenizer

    tok = Tokenizer.load(resolve_model_path("gemma3-270m"), chat_template=swa.TEMPLATE)
    sessions = swa.make_sessions(tok, args)
    full_tokens = [swa.full_session_tokens(tok, s, args.max_tokens) for s in sessions]
    blocks_per_session = math.ceil(statistics.fmean(full_tokens) / args.block_size)  # as bench_swa_chat
    layouts = {"hybrid": parse_layer_mix(args.local_layers, args.sliding_window),
               "full": parse_layer_mix("0/1", 0)}
    res: dict[str, Any] = {"workload": {k: getattr(args, k) for k in (
        "sessions", "turns", "system_tokens", "max_tokens", "concurrency", "block_size",
        "sliding_window", "local_layers")}, "blocks_per_session": blocks_per_session,
        "hotprefix_head": swa.git_head(), "pools": {}}
    print(f"{args.sessions} sessions x {args.turns} turns, {args.concurrency} in flight; a session at "
          f"its last turn ~{statistics.fmean(full_tokens):.0f} tokens = {blocks_per_session} blocks")
    for ps in [float(x) for x in args.pool_sessions.split(",")]:
        num_blocks = math.ceil(ps * blocks_per_session)
        out = res["pools"][f"{ps:g}"] = {"num_blocks": num_blocks}
        for name in [c.strip() for c in args.configs.split(",") if c.strip()]:
            lay = layouts[name]
            r = out[name] = replay(tok, sessions, args, lay, lay.pages_for_blocks(num_blocks))
            print(f"  pool {ps:g} sessions (--num-blocks {num_blocks}, {r['pages']} pages) {name:6s} "
                  f"hit ratio {r['hit_ratio']:.3f}, re-prefills {r['reprefill_turns']}/{r['turns_after_first']}, "
                  f"by turn {r['hit_ratio_by_turn']}, peak in use {r['peak_pages_in_use']} pages"
                  + (f", hits by kind {r['hits_by_kind']}" if "hits_by_kind" in r else ""))
            f = r.get("first_session_block_evicted")
            if f:
                print(f"      first eviction of a session's block: session {f['session']} after "
                      f"{f['turns_done']} turns, {f['pages_in_use']} pages in use by {f['running']}, "
                      f"{f['pages_cached_free']} cached")
    if args.account:
        lay = layouts["hybrid"]
        big = replay(tok, sessions, args, lay, lay.pages_for_blocks(args.sessions * 3 * blocks_per_session),
                     account=True)
        res["account"] = big
        print(f"accounting, a pool with room for everything (peak {big['peak_pages_in_use']} pages in use):")
        for rd in big["rounds"]:
            print(f"  after turn {rd['turn']}: a session keeps {rd['full_pages_per_session']} full + "
                  f"{rd['window_pages_kept_per_session']} window pages (one window: {rd['one_window_pages']}); "
                  f"all sessions {rd['all_sessions_kept_pages']} pages kept, "
                  f"{rd['all_sessions_one_window_pages']} with one window each")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
