"""Multi-session chat on a sliding-window model in a pool too small for every layer's K/V (issue 28):
hotprefix's hybrid KV groups against ``--disable-hybrid-kv-cache-manager`` (every layer's K/V, the
baseline) and against llama.cpp's server with and without ``--swa-full``, on the same GGUF.

Workload: Gemma 3 270M Q4_K_M (``--model gemma3-270m``), ``--sessions`` (16) chat sessions x
``--turns`` (6), each session with its own ~``--system-tokens`` (1,500) token system prompt (a
policy handbook generated from the session's seed: real words, a different company and text for
every session). Turns go round-robin over the sessions, ``--concurrency`` (4) in flight at once
(as llama-server's ``-np 4``); a session's next turn waits for its previous one. Each turn's user
message is one short question; the reply is capped at ``--max-tokens`` (32) at temperature 0, and the
next turn's messages are the previous messages + the reply + a new question. The GGUF is a base
model without a chat template: both servers get ``benchmarks/gemma_chat_template.jinja`` (Gemma's
``<start_of_turn>`` turns), so both see the same prompt tokens (the script checks turn 1's counts).

Memory: the same KV bytes for every contender. hotprefix's pool is ``--num-blocks N``, sized to hold
``--pool-sessions`` (6) sessions' K/V at full length at the baseline (every layer, bf16: the sizing
is printed). llama-server gets ``-np 4 --no-repack``, a ``-c`` of 4 slots of one whole session
each, and ``--cache-ram`` (its prompt cache in host RAM, where idle slots' states go) of the rest of
that byte budget: the budget minus its slots' KV buffers, as its log reports them (a first start
reads them). So with ``--swa-full`` its slots take most of the budget; without, its window layers
hold only the window and more of the budget is prompt cache: that is llama.cpp's own SWA saving.
``--llama-cache-ram MIB`` sets it instead (8192 is llama-server's default; -1 no limit).

Measured, per contender, in one run: the hit ratio (cached prompt tokens / prompt tokens, from each
response's ``usage.prompt_tokens_details.cached_tokens``; llama-server's ``timings.cache_n`` is
recorded too), mean and p90 TTFT (streaming, the first content chunk; the official ``openai``
client), mean TTFT per turn index (is it flat?), and the turns that fell back to a full re-prefill:
a turn after the first whose cached tokens do not cover its system prompt (less its last partial
block), for every contender; for llama-server also its log's "forcing full prompt re-processing"
lines (``-lv 4``). Then each figure over the baseline's. Writes ``results/swa_chat.json``.

Run from the repository root: ``.venv/bin/python benchmarks/bench_swa_chat.py`` (``--quick``: 4
sessions x 3 turns, 600-token prompts, 2 in flight, a pool of 3 sessions, to check the script;
``--configs full,llama,llama-swa-full`` picks contenders; ``--merge EARLIER.json`` adds the
contenders of an earlier run of the same workload and sizing to the table, marked as such). The hybrid contender needs a hotprefix whose ``serve`` has
``--disable-hybrid-kv-cache-manager`` (before it, only the baseline runs, and the script says so).
llama-server is found through ``$LLAMA_SERVER`` (the binary), else ``$LLAMA_CPP_BIN`` (its
folder), else ``../shared/tools/llamacpp-peer.sh bin`` (as bench_engine.py); without it the llama
contenders are skipped. TTFTs need a quiet machine; hit ratios and re-prefill counts do not.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TEMPLATE = os.path.join(HERE, "gemma_chat_template.jinja")
PEER_SCRIPT = os.path.join(HERE, "..", "..", "shared", "tools", "llamacpp-peer.sh")
HYBRID_FLAG = "--disable-hybrid-kv-cache-manager"
REPROCESS_LINE = "forcing full prompt re-processing"
LLAMA_LOG_EVENTS = {  # llama-server -lv 4 lines counted (tools/server/server-context.cpp, server-task.cpp)
    "full_reprocess": REPROCESS_LINE,
    "checkpoint_restored": "restored context checkpoint",
    "prompt_cache_load": "found better prompt",
    "prompt_cache_evict": "removing oldest entry",
}
CONFIGS = {  # label -> (kind, extra server args)
    "hybrid": ("hotprefix", []),
    "full": ("hotprefix", [HYBRID_FLAG]),
    "llama": ("llama", []),
    "llama-swa-full": ("llama", ["--swa-full"]),
    # not in the default set: the hybrid pool with a KV tier in host RAM below it (more memory than
    # the others: the pool's bytes plus the tier's, labelled as such)
    "hybrid-host": ("hotprefix", ["--kv-store", "host:{host_tier}"]),
}
LABELS = {"hybrid": "hotprefix hybrid", "full": "hotprefix full KV (baseline)",
          "llama": "llama-server", "llama-swa-full": "llama-server --swa-full",
          "hybrid-host": "hotprefix hybrid + a host-RAM KV tier (--host-tier)"}
BASELINE = "full"

_COMPANIES = ["Harbor Logistics", "Northwind Clinic", "Bluefin Insurance", "Atlas Robotics",
              "Cedar Law Partners", "Orion Telecom", "Maple Grocery Cooperative", "Quartz Energy",
              "Saffron Hotels", "Tidewater Shipping", "Juniper Schools", "Helix Biotech",
              "Granite Construction", "Lumen Media", "Pioneer Credit Union", "Willow Care Homes",
              "Copperline Rail", "Nimbus Cloud Hosting", "Redwood Forestry", "Summit Outdoor Gear"]
_ROLES = ["help desk", "HR assistant", "compliance desk", "IT service desk", "travel office",
          "procurement helpline", "onboarding guide", "finance desk"]
_STYLES = ["Answer briefly and cite the section number.", "Be polite and precise; say when a rule is unclear.",
           "Keep answers under three sentences.", "Quote the rule, then explain it in plain words.",
           "If the handbook is silent, say so and suggest whom to ask."]


# --------------------------------------------------------------------------- workload
def system_prompt(tok, n_tokens: int, session: int) -> str:
    """About ``n_tokens`` tokens of one session's own policy handbook (deterministic per session)."""
    rng = random.Random(2800 + session)
    company = _COMPANIES[session % len(_COMPANIES)] + ("" if session < len(_COMPANIES) else f" {session}")
    text = (f"You are the {rng.choice(_ROLES)} of {company}. {rng.choice(_STYLES)} "
            f"The {company} handbook follows.")
    gen = common.policy_sentences(rng)
    n = len(tok.encode(text, add_special_tokens=False))
    while n < n_tokens:
        more = "".join(next(gen) for _ in range(8))
        if n + len(tok.encode(more, add_special_tokens=False)) > n_tokens:  # near the end: a sentence at a time
            more = next(gen)
        text += more
        n = len(tok.encode(text, add_special_tokens=False))
    return text


def question(rng: random.Random) -> str:
    return rng.choice(common._QUESTIONS).format(s=rng.choice(common._SUBJECTS).lower(),
                                                o=rng.choice(common._OBJECTS), w=rng.choice(common._WHEN))


@dataclass
class Session:
    sid: int
    system: str
    questions: list[str]
    system_tokens: int
    """Prompt tokens up to the end of the system text (the template's head included)."""


def make_sessions(tok, args) -> list[Session]:
    out = []
    for s in range(args.sessions):
        system = system_prompt(tok, args.system_tokens, s)
        rng = random.Random(9100 + s)
        qs = [question(rng) for _ in range(args.turns)]
        rendered = tok.render_chat([{"role": "system", "content": system}, {"role": "user", "content": qs[0]}])
        head = rendered[:rendered.index(system.strip()) + len(system.strip())]
        out.append(Session(s, system, qs, len(tok.encode(head, add_special_tokens=False))))
    return out


def full_session_tokens(tok, sess: Session, max_tokens: int) -> int:
    """Tokens of the session's K/V after its last turn: the last prompt (earlier replies as
    ``max_tokens`` tokens of text each) plus the last reply."""
    filler = tok.decode(tok.encode(" ".join(sess.questions * 4), add_special_tokens=False)[:max_tokens])
    msgs: list[dict[str, str]] = [{"role": "system", "content": sess.system}]
    for t, q in enumerate(sess.questions):
        msgs.append({"role": "user", "content": q})
        if t < len(sess.questions) - 1:
            msgs.append({"role": "assistant", "content": filler})
    return len(tok.encode_chat(msgs)) + max_tokens


# --------------------------------------------------------------------------- servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, log_path: str, timeout: float = 900.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            with open(log_path, errors="replace") as f:
                tail = f.read()[-3000:]
            raise RuntimeError(f"server exited with {proc.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server at {url} not ready after {timeout:.0f}s (log: {log_path})")


LIVE: list["Server"] = []
"""Servers started by this process: a SIGTERM stops them before the process ends."""


def _on_sigterm(*_: Any) -> None:
    for srv in LIVE:
        srv.stop()
    os._exit(143)


@dataclass
class Server:
    label: str
    cmd: list[str]
    log_path: str
    url: str = ""
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    startup_s: float = 0.0

    def start(self) -> None:
        LIVE.append(self)
        t0 = time.perf_counter()
        log_f = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=log_f, stderr=subprocess.STDOUT,
                                     env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **self.env})
        log_f.close()
        wait_ready(self.url, self.proc, self.log_path)
        self.startup_s = time.perf_counter() - t0
        common.log(f"  {self.label}: up in {self.startup_s:.1f}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log_text(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


SERVE = [sys.executable, "-c", "import sys; from hotprefix.cli import main; sys.exit(main())", "serve"]


def hotprefix_env(src: str | None) -> dict[str, str]:
    """The hotprefix server's environment: ``--hotprefix-src`` first on its PYTHONPATH."""
    if not src:
        return {}
    return {"PYTHONPATH": os.pathsep.join(p for p in (os.path.abspath(src), os.environ.get("PYTHONPATH")) if p)}


def hotprefix_has_hybrid_flag(src: str | None) -> bool:
    r = subprocess.run(SERVE + ["--help"], capture_output=True, text=True,
                       env={**os.environ, **hotprefix_env(src)})
    return HYBRID_FLAG in r.stdout


def hotprefix_server(label: str, extra: list[str], args, num_blocks: int, logdir: str) -> Server:
    port = free_port()
    cmd = [*SERVE, "--model", args.model, "--chat-template", TEMPLATE, "--num-threads", str(args.threads),
           "--block-size", str(args.block_size), "--num-blocks", str(num_blocks),
           "--host", "127.0.0.1", "--port", str(port), *extra]
    return Server(label, cmd, os.path.join(logdir, f"{label}.log"), f"http://127.0.0.1:{port}",
                  hotprefix_env(args.hotprefix_src))


def locate_llama_server() -> str | None:
    if os.environ.get("LLAMA_SERVER"):
        return os.environ["LLAMA_SERVER"]
    d = os.environ.get("LLAMA_CPP_BIN")
    if not d and os.path.exists(PEER_SCRIPT):
        r = subprocess.run(["bash", PEER_SCRIPT, "bin"], capture_output=True, text=True)
        d = r.stdout.strip() if r.returncode == 0 else None
    exe = os.path.join(d, "llama-server") if d else None
    return exe if exe and os.access(exe, os.X_OK) else None


def llama_server(label: str, exe: str, gguf: str, extra: list[str], args, ctx: int, cache_ram: int,
                 logdir: str) -> Server:
    port = free_port()
    cmd = [exe, "-m", gguf, "-t", str(args.threads), "-np", str(args.concurrency), "--no-repack",
           "-c", str(ctx), "--jinja", "--chat-template-file", TEMPLATE, "--cache-ram", str(cache_ram),
           "-lv", "4", "--log-colors", "off", "--host", "127.0.0.1", "--port", str(port), *extra]
    return Server(label, cmd, os.path.join(logdir, f"{label}.log"), f"http://127.0.0.1:{port}")


_KV_SIZE = re.compile(r"llama_kv_cache: size =\s*([\d.]+) MiB")


def llama_kv_mib(log: str) -> float:
    """KV buffers llama-server allocated for its slots (the non-SWA and SWA caches), in MiB."""
    sizes = [float(m.group(1)) for m in _KV_SIZE.finditer(log)]
    if not sizes:
        raise RuntimeError("llama-server's log has no 'llama_kv_cache: size =' line")
    return sum(sizes)


# --------------------------------------------------------------------------- client
async def run_workload(url: str, sessions: list[Session], args) -> list[dict[str, Any]]:
    """Every session's turns, round-robin over sessions per turn, ``concurrency`` in flight."""
    from openai import AsyncOpenAI

    # retries: llama-server closes an idle keep-alive connection after a few seconds, and a request
    # sent on it fails before the server reads it ("Server disconnected"); a retry then is safe
    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=3600, max_retries=3)
    model = (await client.models.list()).data[0].id
    history = {s.sid: [{"role": "system", "content": s.system}] for s in sessions}
    done = {(s.sid, t): asyncio.Event() for s in sessions for t in range(args.turns)}
    jobs: asyncio.Queue = asyncio.Queue()
    for t in range(args.turns):
        for s in sessions:
            jobs.put_nowait((s, t))
    rows: list[dict[str, Any]] = []
    t_start = time.perf_counter()

    async def one(s: Session, t: int) -> None:
        if t:
            await done[(s.sid, t - 1)].wait()
        msgs = history[s.sid] + [{"role": "user", "content": s.questions[t]}]
        t0 = time.perf_counter()
        ttft = None
        text = ""
        usage = None
        timings = None
        stream = await client.chat.completions.create(
            model=model, messages=msgs, max_tokens=args.max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True})
        async for chunk in stream:
            for ch in chunk.choices:
                if ch.delta and ch.delta.content:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text += ch.delta.content
            if chunk.usage is not None:
                usage = chunk.usage
            extra = chunk.model_extra or {}
            if extra.get("timings"):
                timings = extra["timings"]
        e2e = time.perf_counter() - t0
        details = usage.prompt_tokens_details if usage is not None else None
        rows.append({"session": s.sid, "turn": t, "start_s": t0 - t_start,
                     "ttft_s": ttft if ttft is not None else e2e, "ttft_is_e2e": ttft is None,
                     "e2e_s": e2e, "prompt_tokens": usage.prompt_tokens,
                     "cached_tokens": (details.cached_tokens or 0) if details else 0,
                     "completion_tokens": usage.completion_tokens, "system_tokens": s.system_tokens,
                     "llama_cache_n": timings.get("cache_n") if timings else None,
                     "llama_prompt_n": timings.get("prompt_n") if timings else None})
        history[s.sid] = msgs + [{"role": "assistant", "content": text}]
        done[(s.sid, t)].set()

    async def worker() -> None:
        while not jobs.empty():
            s, t = jobs.get_nowait()
            await one(s, t)

    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    await client.close()
    return sorted(rows, key=lambda r: (r["turn"], r["session"]))


# --------------------------------------------------------------------------- figures
def is_reprefill(r: dict[str, Any], block_size: int) -> bool:
    """A turn after the first whose cache hit does not cover its system prompt (less the last
    partial block, which a block cache cannot hold)."""
    return r["turn"] > 0 and r["cached_tokens"] < r["system_tokens"] - block_size


def p90(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, math.ceil(0.9 * len(xs)) - 1)]


def summarize(rows: list[dict[str, Any]], turns: int, block_size: int) -> dict[str, Any]:
    ttfts = [r["ttft_s"] for r in rows]
    later = [r for r in rows if r["turn"] > 0]
    per_turn = {t: [r for r in rows if r["turn"] == t] for t in range(turns)}
    return {
        "requests": len(rows),
        "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
        "cached_tokens": sum(r["cached_tokens"] for r in rows),
        "hit_ratio": sum(r["cached_tokens"] for r in rows) / sum(r["prompt_tokens"] for r in rows),
        "hit_ratio_after_turn_1": (sum(r["cached_tokens"] for r in later)
                                   / max(1, sum(r["prompt_tokens"] for r in later))),
        "mean_ttft_s": statistics.fmean(ttfts), "p90_ttft_s": p90(ttfts),
        "mean_ttft_by_turn_s": [statistics.fmean(r["ttft_s"] for r in per_turn[t]) for t in range(turns)],
        "hit_ratio_by_turn": [sum(r["cached_tokens"] for r in per_turn[t])
                              / sum(r["prompt_tokens"] for r in per_turn[t]) for t in range(turns)],
        "reprefill_turns": sum(is_reprefill(r, block_size) for r in rows),
        "turns_after_first": len(later),
        "replies_without_content": sum(r["ttft_is_e2e"] for r in rows),
        "mean_completion_tokens": statistics.fmean(r["completion_tokens"] for r in rows),
    }


def ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def report(res: dict[str, Any], turns: int) -> None:
    cfgs = res["configs"]
    base = cfgs.get(BASELINE, {}).get("summary")
    rows = []
    for name, c in cfgs.items():
        s = c["summary"]
        log_n = c.get("llama_log", {}).get("full_reprocess")
        rows.append([LABELS[name] + (" (other run)" if "earlier_run" in c else ""), f"{s['hit_ratio']:.3f}",
                     fmt_ratio(ratio(s["hit_ratio"], base["hit_ratio"])) if base else "-",
                     f"{s['mean_ttft_s']:.3f}", fmt_ratio(ratio(s["mean_ttft_s"], base["mean_ttft_s"])) if base else "-",
                     f"{s['p90_ttft_s']:.3f}", fmt_ratio(ratio(s["p90_ttft_s"], base["p90_ttft_s"])) if base else "-",
                     f"{s['reprefill_turns']} / {s['turns_after_first']}",
                     "-" if log_n is None else str(log_n), f"{c['wall_s']:.0f}"])
    print(common.md_table(["contender", "hit ratio", "vs baseline", "mean TTFT s", "vs baseline",
                           "p90 TTFT s", "vs baseline", "re-prefill turns (cache < system prompt)",
                           f"llama log '{REPROCESS_LINE}'", "wall s"], rows))
    print("\nmean TTFT (s) by turn index; hit ratio by turn in brackets")
    print(common.md_table(["contender"] + [f"turn {t + 1}" for t in range(turns)],
                          [[LABELS[n]] + [f"{x:.3f} [{h:.2f}]" for x, h in
                                          zip(c["summary"]["mean_ttft_by_turn_s"], c["summary"]["hit_ratio_by_turn"])]
                           for n, c in cfgs.items()]))


# --------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None):
    ap = common.base_parser(__doc__)
    ap.add_argument("--model", default="gemma3-270m", help="hotprefix --model (default gemma3-270m)")
    ap.add_argument("--configs", default="hybrid,full,llama,llama-swa-full",
                    help="comma-separated contenders: " + ", ".join(CONFIGS))
    ap.add_argument("--sessions", type=int, default=None, help="chat sessions (16; --quick 4)")
    ap.add_argument("--turns", type=int, default=None, help="turns per session (6; --quick 3)")
    ap.add_argument("--system-tokens", type=int, default=None,
                    help="tokens of each session's system prompt (1500; --quick 600)")
    ap.add_argument("--pool-sessions", type=float, default=None,
                    help="sessions' full K/V the pool holds at the baseline (6; --quick 3)")
    ap.add_argument("--max-tokens", type=int, default=32, help="reply cap per turn")
    ap.add_argument("--host-tier", default="128MiB",
                    help="the hybrid-host contender's host-RAM KV tier size (beyond the pool's bytes)")
    ap.add_argument("--concurrency", type=int, default=None,
                    help="turns in flight, llama-server's -np (4; --quick 2)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--llama-cache-ram", type=int, default=None,
                    help="llama-server --cache-ram MiB (default: the byte budget left after its slots)")
    ap.add_argument("--hotprefix-src", default=None,
                    help="a hotprefix src/ folder the servers import first (e.g. a `git archive` of a "
                         "commit), instead of the installed one")
    ap.add_argument("--merge", action="append", default=[], metavar="EARLIER.json",
                    help="add the contenders of an earlier run of the same workload and sizing "
                         "(repeatable; with --configs none: only merge and report)")
    ap.add_argument("--keep-logs", default=None, help="folder to keep the servers' logs in")
    args = ap.parse_args(argv)
    q = args.quick
    for name, full, quick in (("sessions", 16, 4), ("turns", 6, 3), ("system_tokens", 1500, 600),
                              ("pool_sessions", 6, 3), ("concurrency", 4, 2)):
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    if args.pool_sessions <= args.concurrency:
        ap.error(f"--pool-sessions {args.pool_sessions:g} must exceed --concurrency {args.concurrency}: "
                 "the baseline's pool must hold the running sessions and some cache")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    if args.hotprefix_src:  # this process's tokenizer from the same source as the servers
        sys.path.insert(0, os.path.abspath(args.hotprefix_src))
    from hotprefix.model.metadata import resolve_model_path

    gguf = os.path.abspath(resolve_model_path(args.model))
    return run(args, gguf)


def kv_bytes_per_token(gguf: str) -> int:
    """Every layer's K and V of one token at 16 bits (hotprefix's bf16 pool = llama.cpp's f16)."""
    from hotprefix.model.metadata import kv_bytes_per_token as model_kv_bytes_per_token

    return model_kv_bytes_per_token(gguf, "bf16")


def merge_earlier(results: dict[str, Any], path: str) -> None:
    """Adds the contenders of an earlier run (``--merge``) that this run did not measure, when its
    workload and sizing are this run's; each keeps ``earlier_run`` (its time, load and commit)."""
    with open(path) as f:
        old = json.load(f)
    for key in ("workload", "sizing"):
        if old.get(key) != results[key]:
            raise SystemExit(f"--merge {path}: its {key} differs from this run's:\n{old.get(key)}\n{results[key]}")
    env = old["environment"]
    for name, c in old["configs"].items():
        if name not in results["configs"]:
            c.setdefault("earlier_run", {"time": env.get("time"), "load_avg_at_start": env.get("load_avg_at_start"),
                                         "hotprefix": old.get("hotprefix")})
            results["configs"][name] = c
            results["notes"].append(f"{LABELS[name]}: from another run ({env.get('time')}, load "
                                    f"{env.get('load_avg_at_start')}): its hit ratios and re-prefills "
                                    "compare; its TTFTs were taken in another process, under other load")


def git_head() -> str | None:
    r = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def run(args, gguf: str) -> int:
    from hotprefix.text.tokenizer import Tokenizer

    configs = [c.strip() for c in args.configs.split(",") if c.strip() not in ("", "none")]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown --configs {unknown}; choose from {list(CONFIGS)}")
    notes: list[str] = []
    if any(CONFIGS[c][0] == "hotprefix" for c in configs) and not hotprefix_has_hybrid_flag(args.hotprefix_src):
        msg = (f"this hotprefix's serve has no {HYBRID_FLAG} yet (issue 28 not landed): its pool keeps "
               "every layer's K/V, so only the baseline runs (as 'full', without the flag)")
        common.log("NOTE: " + msg)
        notes.append(msg)
        configs = [c for c in configs if c != "hybrid"]
        CONFIGS["full"] = ("hotprefix", [])
    exe = locate_llama_server()
    if exe is None and any(CONFIGS[c][0] == "llama" for c in configs):
        msg = "llama-server not found ($LLAMA_SERVER, $LLAMA_CPP_BIN, llamacpp-peer.sh bin): llama contenders skipped"
        common.log("NOTE: " + msg)
        notes.append(msg)
        configs = [c for c in configs if CONFIGS[c][0] != "llama"]

    tok = Tokenizer.load(gguf, chat_template=TEMPLATE)
    sessions = make_sessions(tok, args)
    full_tokens = [full_session_tokens(tok, s, args.max_tokens) for s in sessions]
    bpt = kv_bytes_per_token(gguf)
    blocks_per_session = math.ceil(statistics.fmean(full_tokens) / args.block_size)
    num_blocks = math.ceil(args.pool_sessions * blocks_per_session)
    budget = num_blocks * args.block_size * bpt
    slot_ctx = 256 * math.ceil((max(full_tokens) + 64) / 256)  # one whole session a slot
    llama_ctx = args.concurrency * slot_ctx
    sizing = {"system_tokens_mean": statistics.fmean(s.system_tokens for s in sessions),
              "session_tokens_at_last_turn_mean": statistics.fmean(full_tokens),
              "session_tokens_at_last_turn_max": max(full_tokens),
              "kv_bytes_per_token_full": bpt, "block_size": args.block_size,
              "blocks_per_session": blocks_per_session, "pool_sessions": args.pool_sessions,
              "num_blocks": num_blocks, "pool_tokens": num_blocks * args.block_size,
              "kv_budget_bytes": budget, "all_sessions_tokens": sum(full_tokens),
              "llama_ctx": llama_ctx, "llama_slot_ctx": slot_ctx}
    print(f"sizing: {args.sessions} sessions x {args.turns} turns; system prompt ~{sizing['system_tokens_mean']:.0f} "
          f"tokens; a session at its last turn ~{sizing['session_tokens_at_last_turn_mean']:.0f} tokens "
          f"= {blocks_per_session} blocks of {args.block_size}; pool {args.pool_sessions:g} sessions = "
          f"--num-blocks {num_blocks} ({num_blocks * args.block_size} tokens x {bpt} B/token full KV = "
          f"{budget / 2**20:.1f} MiB) against {sum(full_tokens)} tokens for all sessions; llama-server "
          f"-np {args.concurrency} -c {llama_ctx} ({slot_ctx} a slot)")

    out_path = args.out or os.path.join(common.RESULTS_DIR, "swa_chat_quick.json" if args.quick else "swa_chat.json")
    logdir = args.keep_logs or tempfile.mkdtemp(prefix="bench_swa_chat_")
    os.makedirs(logdir, exist_ok=True)
    results: dict[str, Any] = {"environment": common.environment(args.threads, args.quick),
                               "workload": {k: getattr(args, k) for k in
                                            ("sessions", "turns", "system_tokens", "max_tokens",
                                             "concurrency", "pool_sessions", "block_size", "model")},
                               "sizing": sizing, "notes": notes,
                               "hotprefix": {"repo_head": git_head(),
                                             "source": "--hotprefix-src" if args.hotprefix_src else "installed"},
                               "configs": {}}
    for name in configs:
        kind, extra = CONFIGS[name]
        label = LABELS[name]
        info: dict[str, Any] = {"label": label}
        if kind == "hotprefix":
            extra = [x.format(host_tier=args.host_tier) for x in extra]
            srv = hotprefix_server(name, extra, args, num_blocks, logdir)
        else:
            cache_ram = args.llama_cache_ram
            if cache_ram is None:  # a first start reads the slots' KV buffers off its log
                probe = llama_server(name + "-probe", exe, gguf, extra, args, llama_ctx, 0, logdir)
                probe.start()
                probe.stop()
                slot_mib = llama_kv_mib(probe.log_text())
                cache_ram = max(0, int((budget / 2**20) - slot_mib))
                info["slot_kv_mib"] = slot_mib
                common.log(f"  {label}: slots' KV {slot_mib:.1f} MiB of the {budget / 2**20:.1f} MiB "
                           f"budget -> --cache-ram {cache_ram}")
            info["cache_ram_mib"] = cache_ram
            srv = llama_server(name, exe, gguf, extra, args, llama_ctx, cache_ram, logdir)
        info["command"] = " ".join(os.path.basename(a) if os.path.isabs(a) else a for a in srv.cmd)
        srv.start()
        try:
            t0 = time.perf_counter()
            rows = asyncio.run(run_workload(srv.url, sessions, args))
            info["wall_s"] = time.perf_counter() - t0
            if kind == "hotprefix":
                with urllib.request.urlopen(srv.url + "/v1/cache/stats", timeout=60) as r:
                    info["cache_stats"] = json.load(r)
        finally:
            srv.stop()
        log_text = srv.log_text()
        if kind == "llama":
            info["llama_log"] = {k: log_text.count(v) for k, v in LLAMA_LOG_EVENTS.items()}
            info["slot_kv_mib_reported"] = llama_kv_mib(log_text)
        else:
            pool = [ln.split("KV pool:", 1)[1].strip() for ln in log_text.splitlines() if "KV pool:" in ln]
            info["pool_log"] = pool
        info["summary"] = summarize(rows, args.turns, args.block_size)
        info["requests"] = rows
        s = info["summary"]
        common.log(f"  {label}: hit ratio {s['hit_ratio']:.3f}, mean TTFT {s['mean_ttft_s']:.3f}s, p90 "
                   f"{s['p90_ttft_s']:.3f}s, re-prefills {s['reprefill_turns']}/{s['turns_after_first']}"
                   + (f", log '{REPROCESS_LINE}' x{info['llama_log']['full_reprocess']}" if kind == "llama" else "")
                   + f", {info['wall_s']:.0f}s")
        results["configs"][name] = info
        common.write_json(out_path + ".partial", results)  # what is done so far, should a run be cut short

    for path in args.merge:
        merge_earlier(results, path)
    # the same prompts on both sides: turn 1's prompt tokens per session
    firsts = {n: {r["session"]: r["prompt_tokens"] for r in c["requests"] if r["turn"] == 0}
              for n, c in results["configs"].items()}
    if len({tuple(sorted(v.items())) for v in firsts.values()}) > 1:
        msg = f"turn 1 prompt tokens differ between contenders: {firsts}"
        common.log("WARNING: " + msg)
        notes.append(msg)
    base = results["configs"].get(BASELINE, {}).get("summary")
    if base:
        for n, c in results["configs"].items():
            s = c["summary"]
            c["over_baseline"] = {"hit_ratio": ratio(s["hit_ratio"], base["hit_ratio"]),
                                  "mean_ttft": ratio(s["mean_ttft_s"], base["mean_ttft_s"]),
                                  "p90_ttft": ratio(s["p90_ttft_s"], base["p90_ttft_s"])}
    print()
    report(results, args.turns)
    for n in notes:
        print(f"\nnote: {n}")
    common.write_json(out_path, results)
    if os.path.exists(out_path + ".partial"):
        os.unlink(out_path + ".partial")
    return 0


if __name__ == "__main__":
    sys.exit(main())
