"""Load time and memory of ``hotprefix serve`` against ``llama-server`` on the same GGUF file.

First hotprefix starts the model once and waits until its packed weights are kept on disk
(``model/packed_store.py``), as a server's first start does in the background. Then, for each
server, ``--runs`` times, alternating (ours, theirs, ours, ...): start the server, time
until ``GET /health`` answers 200 ("ready") and until a first completion of 8 tokens returns
("first completion"), and read its peak resident memory (``VmHWM`` from ``/proc/PID/status``) at
both points; then stop it. The file is read once before the runs, so both start from a warm page
cache. Prints a table with the CPU and writes ``results/load_<folder>_<file stem>.json``.

  python benchmarks/bench_load.py --model FILE.gguf [--runs 3] [--threads 2] [--kv-cache-memory 1GiB]

llama-server comes from ``--llama-server`` or ``../shared/tools/llamacpp-peer.sh bin`` and runs with
``--no-repack`` (its repacked CPU buffers are another copy of the weights in memory) and its default
context (the model's; for the Llama 3.2 shapes 32k tokens of f16 K/V: 1 GiB for the 1B shape, 3.5
GiB for the 3B), so hotprefix's pool is given the same bytes by default (``--kv-cache-memory``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from common import log, md_table, median  # noqa: E402

PEER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "tools",
                           "llamacpp-peer.sh")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) / 1024
    return float("nan")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads) so far: less sensitive than wall
    time to other work on the machine."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def get(url: str, body: dict | None = None, timeout: float = 2.0) -> int:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        log(f"{url}: {e.code} {e.read()[:300]!r}")
        return e.code
    except OSError:
        return 0


def measure(cmd: list[str], port: int, deadline_s: float, env: dict | None = None) -> dict:
    """One start of a server: seconds to /health 200 and to a first completion, peak RSS at each."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        while get(base + "/health", timeout=0.5) != 200:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}")
            if time.perf_counter() - t0 > deadline_s:
                raise RuntimeError(f"{cmd[0]} not ready in {deadline_s} s")
            time.sleep(0.02)
        ready = time.perf_counter() - t0
        rss_ready, cpu_ready = peak_rss_mib(proc.pid), cpu_seconds(proc.pid)
        with urllib.request.urlopen(base + "/v1/models", timeout=deadline_s) as r:
            model = json.load(r)["data"][0]["id"]
        status = get(base + "/v1/completions", {"model": model, "prompt": "The capital of France is",
                                                 "max_tokens": 8, "temperature": 0}, timeout=deadline_s)
        if status != 200:
            raise RuntimeError(f"{cmd[0]}: completion answered {status}")
        first = time.perf_counter() - t0
        return {"ready_s": ready, "cpu_to_ready_s": cpu_ready, "first_completion_s": first,
                "peak_rss_ready_mib": rss_ready,
                "peak_rss_first_mib": peak_rss_mib(proc.pid)}
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


KEEP = """
import sys, time
t = time.perf_counter()
from hotprefix import LLM
llm = LLM(sys.argv[1], num_threads=int(sys.argv[2]), kv_cache_memory="64MiB")
keeping = llm.engine.runner.keeping
if keeping is not None:
    keeping.join()
print(time.perf_counter() - t)
"""


def keep_packed(model: str, threads: int) -> float:
    """Start the model once in a process that waits until its packed weights are kept
    (``model/packed_store.py``; nothing to do where they already are), so the timed starts map
    them, as every start after a server's first does: seconds to the kept store."""
    out = subprocess.run([sys.executable, "-c", KEEP, model, str(threads)], capture_output=True,
                         text=True, check=True, cwd=REPO)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a GGUF file")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-cache-memory", default=None,
                   help="hotprefix's pool (default: llama-server's f16 K/V at the model's context)")
    p.add_argument("--llama-server", default=None, help="the llama-server binary")
    p.add_argument("--deadline", type=float, default=600.0)
    p.add_argument("--also-packing", action="store_true",
                   help="also time hotprefix with --no-packed-cache (packing every start)")
    p.add_argument("--first-starts", action="store_true",
                   help="also time hotprefix's first starts: on a new machine (an empty cache directory: "
                        "the kernels compiled, the tokenizer built, the weights packed) and of a new model "
                        "(the kernels already compiled)")
    args = p.parse_args()

    from hotprefix.files.cachedir import cache_dir
    from hotprefix.model.metadata import read_kv_shape
    from hotprefix.files.gguf_header import read_file_metadata as read_metadata

    shape = read_kv_shape(args.model)
    arch = read_metadata(args.model, ("general.architecture",))["general.architecture"]
    ctx = int(read_metadata(args.model, (f"{arch}.context_length",))[f"{arch}.context_length"])
    kv_mem = args.kv_cache_memory or str(ctx * shape.bytes_per_token(2))
    server = args.llama_server
    if server is None and os.path.exists(PEER_SCRIPT):
        bin_dir = subprocess.run(["bash", PEER_SCRIPT, "bin"], capture_output=True, text=True).stdout.strip()
        server = os.path.join(bin_dir, "llama-server") if bin_dir else None
    # our modules' bytecode, as `make serve` compiles it (an installed package has it; an editable
    # install where PYTHONDONTWRITEBYTECODE is set would compile every module at every start)
    subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(REPO, "src")],
                   stdout=subprocess.DEVNULL, check=False)
    with open(args.model, "rb") as f:  # warm the page cache for both
        while f.read(1 << 24):
            pass
    cmds = {"hotprefix": lambda port: [sys.executable, "-m", "hotprefix.cli", "serve", "--model", args.model,
                                       "--port", str(port), "--num-threads", str(args.threads),
                                       "--kv-cache-memory", kv_mem]}
    if args.also_packing:
        cmds["hotprefix --no-packed-cache"] = lambda port: [*cmds["hotprefix"](port), "--no-packed-cache"]
    if server and os.path.exists(server):
        cmds["llama-server"] = lambda port: [server, "-m", args.model, "--no-repack", "-t", str(args.threads),
                                             "--port", str(port), "-c", str(ctx)]
    else:
        log("llama-server not found: only hotprefix is measured")
    first = keep_packed(args.model, args.threads)
    log(f"hotprefix's first start with this code (packs, then keeps the packed weights): {first:.1f} s")
    starts = {}  # name -> the cache directory's contents to start from (folder names), or None
    if args.first_starts:
        starts = {"hotprefix, first start on a new machine": (),
                  "hotprefix, first start of a new model": ("kernels", "probes")}
        cmds = {**{name: cmds["hotprefix"] for name in starts}, **cmds}
    runs: dict[str, list[dict]] = {name: [] for name in cmds}
    for i in range(args.runs):
        for name, cmd in cmds.items():
            port = free_port()
            with tempfile.TemporaryDirectory(prefix="hotprefix-first-start-") as fresh:
                env = None
                if name in starts:
                    for sub in starts[name]:
                        shutil.copytree(cache_dir(sub), os.path.join(fresh, sub))
                    env = {**os.environ, "HOTPREFIX_CACHE_DIR": fresh}
                r = measure(cmd(port), port, args.deadline, env)
            runs[name].append(r)
            log(f"run {i + 1} {name}: ready {r['ready_s']:.2f} s ({r['cpu_to_ready_s']:.1f} CPU s), first completion "
                f"{r['first_completion_s']:.2f} s, peak RSS {r['peak_rss_ready_mib']:.0f} / "
                f"{r['peak_rss_first_mib']:.0f} MiB")
    keys = ("ready_s", "cpu_to_ready_s", "first_completion_s", "peak_rss_ready_mib",
            "peak_rss_first_mib")
    summary = {name: {k: median([r[k] for r in rs]) for k in keys} for name, rs in runs.items()}
    rows = [[name, *(s[k] for k in keys), f"{min(r['ready_s'] for r in runs[name]):.2f}-"
             f"{max(r['ready_s'] for r in runs[name]):.2f}"] for name, s in summary.items()]
    cpu = common.cpu_description()
    print(f"\n{os.path.basename(args.model)} ({os.path.getsize(args.model) / 2**20:.0f} MiB), "
          f"{args.threads} threads, K/V {int(kv_mem) / 2**30:.2f} GiB, median of {args.runs}; CPU: {cpu}")
    print(md_table(["server", "ready (s)", "CPU s to ready", "first completion (s)", "peak RSS at ready (MiB)",
                    "peak RSS after first completion (MiB)", "ready range (s)"], rows))
    if "llama-server" in summary:
        ours, theirs = summary["hotprefix"], summary["llama-server"]
        print(f"ratios hotprefix / llama-server: ready {ours['ready_s'] / theirs['ready_s']:.2f}x, "
              f"peak RSS {ours['peak_rss_first_mib'] / theirs['peak_rss_first_mib']:.2f}x")
        for name in starts:
            print(f"{name} / llama-server: ready {summary[name]['ready_s'] / theirs['ready_s']:.2f}x")
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                       f"load_{os.path.basename(os.path.dirname(os.path.abspath(args.model)))}_"
                       f"{os.path.splitext(os.path.basename(args.model))[0]}.json")
    common.write_json(out, {"model": os.path.basename(args.model), "kv_cache_memory": int(kv_mem),
                            "keep_packed_s": first,
                            "context": ctx, "env": common.environment(args.threads, False),
                            "runs": runs, "median": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
