"""Where a decode step's time goes: torch.profiler over the engine's batch-1 decode steps, the
operators grouped into GEMMs, attention, KV pool reads and writes, and the rest (elementwise work
and small ops), plus the wall time the profiler does not see (Python in the forward pass and the
engine around it).

    .venv/bin/python benchmarks/profile_decode.py [--weights auto|dense|int4|...] [--context 128]

Not a benchmark: the profiler adds overhead to every operator, so the shares matter, not the sum.
"""

from __future__ import annotations

import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

GROUPS = [  # (group, substrings of operator names), first match wins
    ("GEMM", ("linear", "mm", "_weight_int")),
    ("attention", ("scaled_dot_product",)),
    ("KV pool gather / write", ("index_select", "index_copy", "index")),
]


def group_of(name: str) -> str:
    for group, keys in GROUPS:
        if any(k in name for k in keys):
            return group
    return "elementwise and small ops"


def main() -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from hotprefix.sampling import SamplingParams

    ap = common.base_parser(__doc__)
    ap.add_argument("--weights", default=None, help="LLM(weights=...) (default: the default mode)")
    ap.add_argument("--dtype", default=None, help="LLM(dtype=...)")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens before decoding (default 128)")
    ap.add_argument("--steps", type=int, default=64, help="decode steps profiled (default 64)")
    args = ap.parse_args()
    common.setup_threads(args.threads)
    opts = {k: v for k, v in (("weights", args.weights), ("dtype", args.dtype)) if v}
    llm = common.load_hotprefix(args.threads, enable_prefix_caching=False, **opts)
    ids = common.text_tokens(llm.tokenizer, args.context, seed=1)
    params = SamplingParams(max_tokens=args.steps + 1, ignore_eos=True)
    llm.generate(ids, params, use_tqdm=False)  # warm-up
    eng = llm.engine
    eng.add_request(list(ids), params)
    eng.step()  # the prefill, outside the profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        steps = 0
        while eng.has_unfinished():
            eng.step()
            steps += 1
        wall_ms = 1000 * (time.perf_counter() - t0) / steps
    totals: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.defaultdict(int)
    for ev in prof.key_averages():
        totals[group_of(ev.key)] += ev.self_cpu_time_total / 1000  # ms
        calls[group_of(ev.key)] += ev.count
    op_ms = sum(totals.values()) / steps
    print(f"{eng.runner.numerics}, {args.context}-token context, batch 1, {steps} decode steps, "
          f"torch {torch.__version__}: {wall_ms:.1f} ms a step under the profiler")
    rows = [[g, f"{ms / steps:.2f}", f"{ms / steps / wall_ms:.0%}", calls[g] // steps]
            for g, ms in sorted(totals.items(), key=lambda kv: -kv[1])]
    rows.append(["outside operators (Python: forward, scheduler, sampling)",
                 f"{wall_ms - op_ms:.2f}", f"{(wall_ms - op_ms) / wall_ms:.0%}", "-"])
    print(common.md_table(["where", "ms a step", "share", "operator calls a step"], rows))

if __name__ == "__main__":
    main()
