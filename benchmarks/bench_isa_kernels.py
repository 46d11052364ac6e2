"""The logits' selections (``select.c``) and the elementwise kernels (``fused.c``) per ISA level:
best-of-N wall time of one call through ``FusedOps``, the levels' calls interleaved (so a noisy,
shared CPU slows each level alike), at the default model's shapes (dim 576, 9/3 heads of 64,
intermediate 1536, a 49,152-token vocabulary).

    .venv/bin/python benchmarks/bench_isa_kernels.py [--levels portable,avx2] [--threads 2]
        [--reps 400] [--only select|fused]

Levels are those this CPU runs (``isa.runnable_levels``) unless ``--levels`` names some.
"""

from __future__ import annotations

import argparse
import time

import torch

from hotprefix.model import fused, isa

NH, NKV, HD, DIM, INTER, VOCAB, BS = 9, 3, 64, 576, 1536, 49152, 16


def cases(g: torch.Generator, which: str) -> list[tuple[str, object]]:
    """(label, fn(ops) -> None) for each call timed."""
    out: list[tuple[str, object]] = []
    if which in ("all", "select"):
        for rows in (1, 16):
            x = torch.randn(rows, VOCAB, generator=g)
            out += [(f"argmax [{rows}, {VOCAB}]", lambda o, x=x: o.argmax(x)),
                    (f"top-32 [{rows}, {VOCAB}]", lambda o, x=x: o.top_k(x, 32)),
                    (f"top-64 [{rows}, {VOCAB}]", lambda o, x=x: o.top_k(x, 64))]
    if which in ("all", "fused"):
        w = torch.randn(DIM, generator=g)
        cos, sin = torch.randn(4096, HD, generator=g), torch.randn(4096, HD, generator=g)
        kc = torch.zeros(512, BS, NKV, HD, dtype=torch.bfloat16)
        vc = torch.zeros_like(kc)
        for rows in (1, 16, 256):
            h, d = torch.randn(rows, DIM, generator=g), torch.randn(rows, DIM, generator=g)
            qkv = torch.randn(rows, (NH + 2 * NKV) * HD, generator=g)
            pos = torch.randint(0, 4096, (rows,), generator=g)
            slots = torch.randperm(512 * BS, generator=g)[:rows]
            gu = torch.randn(rows, 2 * INTER, generator=g) * 3
            out += [(f"add_rms_norm [{rows}, {DIM}]", lambda o, h=h, d=d: o.add_rms_norm(h, d, w)),
                    (f"rope_write_kv {rows} rows",
                     lambda o, q=qkv, p=pos, s=slots: o.rope_write_kv(q, cos, sin, p, kc, vc, s)),
                    (f"silu_mul [{rows}, {INTER}]", lambda o, gu=gu: o.silu_mul(gu))]
        for blocks in (64, 512):  # 1,024 and 8,192 keys of one sequence
            idx = torch.randperm(512, generator=g)[:blocks]
            ko = torch.empty(blocks, BS * NKV * HD)
            vo = torch.empty_like(ko)
            out.append((f"gather_widen_kv {blocks * BS} keys",
                        lambda o, i=idx, ko=ko, vo=vo: o.gather_widen_kv(kc, vc, i, ko, vo)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--levels", default=",".join(lv.name for lv in isa.runnable_levels()))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=400)
    p.add_argument("--only", choices=("all", "select", "fused"), default="all")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    levels = a.levels.split(",")
    ops = {lv: fused.FusedOps(fused.library(lv), 1e-5, NH, NKV, HD) for lv in levels}
    print(f"threads {a.threads}, best of {a.reps}, microseconds per call (levels interleaved)")
    print(f"{'call':32s}" + "".join(f"{lv:>11s}" for lv in levels)
          + ("   " + f"{levels[0]}/{levels[-1]}" if len(levels) > 1 else ""))
    for label, fn in cases(torch.Generator().manual_seed(0), a.only):
        best = {lv: float("inf") for lv in levels}
        for lv in levels:
            fn(ops[lv])  # warm
        for _ in range(a.reps):
            for lv in levels:
                t = time.perf_counter()
                fn(ops[lv])
                best[lv] = min(best[lv], time.perf_counter() - t)
        row = "".join(f"{best[lv] * 1e6:11.1f}" for lv in levels)
        ratio = f"   {best[levels[0]] / best[levels[-1]]:8.1f}x" if len(levels) > 1 else ""
        print(f"{label:32s}{row}{ratio}", flush=True)


if __name__ == "__main__":
    main()
