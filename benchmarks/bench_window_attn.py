"""Sliding-window attention at Gemma 3 270M's shape (4 query heads, 1 KV head of 256, window 512,
a bf16 pool of 16-key blocks, random block tables): the C kernel with its window (``attn.c``,
what the windowed layers run now) against torch's kernel with a window mask over every key (what
they ran before: ``attention.paged_attention``, the fused gather into scratch), and the C kernel
over every key (a global layer, for scale). Best wall time of one call (of up to --reps within
--budget seconds a contender), the contenders interleaved in one process, so a noisy CPU slows
each alike; the ratio is torch's time over the C window's.

    .venv/bin/python benchmarks/bench_window_attn.py [--level avx2] [--threads 2] [--reps 100] [--budget 2]
    .venv/bin/python benchmarks/bench_window_attn.py --engine [--threads 2]

``--level``: the kernels built for that ISA level (default: this CPU's best). ``--engine``: the
real model instead (``gemma3-270m``, the default configuration), a prompt of n tokens prefilled
cold and 48 tokens decoded after it, with the windowed layers on the C kernel and on torch's (the
previous path, routed to by wrapping ``LlamaModel._attend``), alternating, best of ``--repeats``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attn  # noqa: E402

from hotprefix.model import fused  # noqa: E402
from hotprefix.model.attention import AttentionMetadata, GatherScratch, PrefillSeq, paged_attention  # noqa: E402

NH, NKV, HD, WINDOW = 4, 1, 256, 512
BS = bench_attn.BS


def shapes() -> list[tuple[str, list[int], list[int]]]:
    """(label, the sequences' key counts, rows per sequence: its last positions)."""
    out = [(f"decode 1 x {n} keys", [n], [1]) for n in (1024, 2048, 4096, 8192)]
    out += [(f"decode 4 x {n} keys", [n] * 4, [1] * 4) for n in (2048, 4096)]
    out += [(f"prefill 256 rows at {n}", [n], [256]) for n in (1024, 4096)]
    return out


def inputs(keys: list[int], rows: list[int], g: torch.Generator):
    """``bench_attn.inputs`` at this shape, and the torch path's metadata for the same call."""
    q, k, v, tables, seq, pos = bench_attn.inputs(keys, rows, g, NH, NKV, HD)
    if rows[0] == 1:
        meta = AttentionMetadata(slot_mapping=torch.zeros(len(keys), dtype=torch.long),
                                 num_decode=len(keys), decode_block_tables=tables,
                                 decode_context_lens=list(keys))
    else:
        meta = AttentionMetadata(slot_mapping=torch.zeros(rows[0], dtype=torch.long), prefills=[
            PrefillSeq(0, rows[0], keys[0], tables[0, :-(-keys[0] // BS)])])
    return q, k, v, tables, seq, pos, meta


def engine(a) -> None:
    """The real model's cold prefill and decode, windowed layers on C vs torch, interleaved."""
    from hotprefix import LLM, SamplingParams

    llm = LLM("gemma3-270m", num_threads=a.threads)
    model = llm.engine.runner.model
    if not model.c_attention:
        raise SystemExit("the C attention does not run here (no vector path at this level)")
    c_attend = model._attend

    def torch_attend(q, k, v, meta, n_real, window=0):
        if not window:
            return c_attend(q, k, v, meta, n_real)
        o = paged_attention(q, k, v, meta, model.scale, model.scratch, window)
        o[n_real:] = 0
        return o

    print(f"{model.numerics}, threads {a.threads}; best of {a.repeats}, the two paths alternating")
    print(f"{'prompt':>8s}{'prefill s C':>13s}{'torch':>8s}{'ratio':>8s}"
          f"{'decode tok/s C':>16s}{'torch':>8s}{'ratio':>8s}")
    g = torch.Generator().manual_seed(0)
    for n in (512, 2048, 4096):
        p = torch.randint(10, 20000, (n,), generator=g).tolist()
        best = {}
        for _ in range(a.repeats):
            for name, fn in (("c", c_attend), ("torch", torch_attend)):
                model._attend = fn
                llm.reset_prefix_cache()
                t = time.perf_counter()
                llm.generate([p], SamplingParams(max_tokens=1))
                pre = time.perf_counter() - t
                t = time.perf_counter()  # the prompt is cached now: the time is the 48 decodes'
                llm.generate([p], SamplingParams(max_tokens=48, ignore_eos=True))
                dec = 48 / (time.perf_counter() - t)
                b = best.setdefault(name, [float("inf"), 0.0])
                b[0], b[1] = min(b[0], pre), max(b[1], dec)
        (cp, cd), (tp, td) = best["c"], best["torch"]
        print(f"{n:8d}{cp:13.2f}{tp:8.2f}{tp / cp:7.2f}x{cd:16.1f}{td:8.1f}{cd / td:7.2f}x",
              flush=True)
    model._attend = c_attend


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--level", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=100)
    p.add_argument("--budget", type=float, default=2.0)
    p.add_argument("--engine", action="store_true")
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.engine:
        return engine(a)
    lib = fused.library(a.level)
    if lib is None:
        raise SystemExit("the C kernels do not build here")
    ops = fused.FusedOps(lib, 1e-5, NH, NKV, HD)
    scratch = GatherScratch(ops.gather_widen_kv)
    scale = HD ** -0.5
    print(f"kernels at {lib.isa}, threads {a.threads}, window {WINDOW}; ms per call, best of up to "
          f"{a.reps} within {a.budget:g} s, contenders interleaved")
    print(f"{'shape':26s}{'C window':>11s}{'torch mask':>12s}{'C all keys':>12s}{'torch / C window':>18s}")
    g = torch.Generator().manual_seed(0)
    for label, keys, rows in shapes():
        q, k, v, tables, seq, pos, meta = inputs(keys, rows, g)
        runs = {
            "c_window": lambda: ops.attention(q, k, v, tables, seq, pos, scale, window=WINDOW),
            "torch": lambda: paged_attention(q, k, v, meta, scale, scratch, WINDOW),
            "c_all": lambda: ops.attention(q, k, v, tables, seq, pos, scale),
        }
        a_c, a_t = runs["c_window"](), runs["torch"]()
        err = (a_c - a_t).abs().max().item()
        assert err < 1e-4, (label, err)  # the same attention, within float rounding
        best, spent = dict.fromkeys(runs, float("inf")), dict.fromkeys(runs, 0.0)
        for rep in range(a.reps):
            for n, fn in runs.items():
                if rep >= 3 and spent[n] > a.budget:
                    continue
                t = time.perf_counter()
                fn()
                dt = time.perf_counter() - t
                best[n], spent[n] = min(best[n], dt), spent[n] + dt
        print(f"{label:26s}{best['c_window'] * 1e3:11.3f}{best['torch'] * 1e3:12.3f}"
              f"{best['c_all'] * 1e3:12.3f}{best['torch'] / best['c_window']:17.1f}x", flush=True)


if __name__ == "__main__":
    main()
