"""The C attention (``attn.c``) per ISA level: the best wall time of one call through
``FusedOps.attention`` (of up to --reps calls within --budget seconds), the levels' calls
interleaved (so a noisy, shared CPU slows each level alike), at the default model's attention
shape (9 query heads, 3 KV heads of 64, a bf16 pool of 16-key blocks, random block tables):
decodes of one and 16 sequences, and prefill chunks (a sequence's first n rows). Each level runs
its default path; ``--so`` adds a build of the kernels by path (an earlier build, say),
``--cpu-time`` times the calling thread's CPU instead of the wall (with ``--threads 1``: steadier
where other work shares the cores).

    .venv/bin/python benchmarks/bench_attn.py [--levels portable,avx2] [--threads 2]
        [--reps 200] [--budget 2] [--so LABEL=PATH] [--cpu-time] [--quick]

Levels are those this CPU runs (``isa.runnable_levels``) unless ``--levels`` names some.
"""

from __future__ import annotations

import argparse
import ctypes
import time

import torch

from hotprefix.model import fused, isa

NH, NKV, HD, BS = 9, 3, 64, 16


def shapes(quick: bool) -> list[tuple[str, list[int], list[int]]]:
    """(label, the sequences' key counts, rows per sequence: its last positions)."""
    out = [(f"decode 1 x {n} keys", [n], [1])
           for n in ((512, 4096) if quick else (128, 512, 1024, 2048, 4096))]
    out += [(f"decode 16 x {n} keys", [n] * 16, [1] * 16)
            for n in ((1024,) if quick else (128, 1024, 4096))]
    out += [(f"prefill {n} rows", [n], [n]) for n in ((512,) if quick else (512, 1024, 2048))]
    return out


def inputs(keys: list[int], rows: list[int], g: torch.Generator, nh: int = NH, nkv: int = NKV,
           hd: int = HD):
    """q, the pools and the row plan (tables, seq, pos) for one call (default: the default
    model's heads)."""
    width = max(-(-n // BS) for n in keys)
    blocks = width * len(keys)
    k = torch.randn(blocks, BS, nkv, hd, generator=g).to(torch.bfloat16)
    v = torch.randn(blocks, BS, nkv, hd, generator=g).to(torch.bfloat16)
    tables = torch.randperm(blocks, generator=g).reshape(len(keys), width)
    seq = torch.cat([torch.full((r,), i) for i, r in enumerate(rows)])
    pos = torch.cat([torch.arange(n - r, n) for n, r in zip(keys, rows)])
    return torch.randn(len(seq), nh, hd, generator=g), k, v, tables, seq, pos


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--levels", default=",".join(lv.name for lv in isa.runnable_levels()))
    p.add_argument("--so", action="append", default=[], metavar="LABEL=PATH")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=200, help="most calls per level and shape")
    p.add_argument("--budget", type=float, default=2.0,
                   help="seconds of calls per level and shape (at least 3 calls, at most --reps)")
    p.add_argument("--cpu-time", action="store_true")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    clock = time.thread_time if a.cpu_time else time.perf_counter
    libs = [(lv, fused.library(lv)) for lv in a.levels.split(",")]
    libs += [(label, fused.bind(ctypes.CDLL(path)))
             for label, path in (s.split("=", 1) for s in a.so)]
    ops = {label: fused.FusedOps(lib, 1e-5, NH, NKV, HD) for label, lib in libs}
    names = list(ops)
    ref = a.levels.split(",")[-1]  # the ratios' denominator: the last level named
    print(f"threads {a.threads}, ms per call, best of up to {a.reps} within {a.budget:g} s "
          f"({'thread CPU' if a.cpu_time else 'wall'} time, levels interleaved)")
    print(f"{'shape':24s}" + "".join(f"{n:>11s}" for n in names)
          + "".join(f"{n + '/' + ref:>16s}" for n in names if n != ref))
    g = torch.Generator().manual_seed(0)
    for label, keys, rows in shapes(a.quick):
        q, k, v, tables, seq, pos = inputs(keys, rows, g)
        best, spent = dict.fromkeys(names, float("inf")), dict.fromkeys(names, 0.0)
        for n in names:
            ops[n].attention(q, k, v, tables, seq, pos, HD ** -0.5)  # warm
        for rep in range(a.reps):
            for n in names:
                if rep >= 3 and spent[n] > a.budget:
                    continue
                t = clock()
                ops[n].attention(q, k, v, tables, seq, pos, HD ** -0.5)
                dt = clock() - t
                best[n], spent[n] = min(best[n], dt), spent[n] + dt
        print(f"{label:24s}" + "".join(f"{best[n] * 1e3:11.3f}" for n in names)
              + "".join(f"{best[n] / best[ref]:15.1f}x" for n in names if n != ref), flush=True)


if __name__ == "__main__":
    main()
