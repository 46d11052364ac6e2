"""Where a decode step's time goes: torch.profiler over the engine's batch-1 decode steps, the
operators grouped into GEMMs, attention, KV pool reads and writes, and the rest (elementwise work
and small ops), plus the fused C kernels (timed around their ctypes calls: the profiler does not
see them), next to the step's wall time with and without the profiler (the difference is the
profiler's own cost per operator call; what lies outside both is Python).

    .venv/bin/python benchmarks/profile_decode.py [--weights auto|dense|int4|...] [--context 128]

Not a benchmark: one run, and the profiler adds overhead to every operator call.
"""

from __future__ import annotations

import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

GROUPS = [  # (group, substrings of operator names), first match wins
    ("GEMM", ("linear", "mm")),
    ("attention", ("scaled_dot_product",)),
    ("KV pool gather / write", ("index",)),
]


def group_of(name: str) -> str:
    for group, keys in GROUPS:
        if any(k in name for k in keys):
            return group
    return "elementwise and small ops"


def time_fused_kernels(model) -> tuple[list[float], list[int]]:
    """Wrap the model's fused-kernel methods with a timer: ([seconds], [calls]) accumulate."""
    seconds, count, fused = [0.0], [0], model.fused
    if fused is None:
        return seconds, count
    for name in ("add_rms_norm", "rope_write_kv", "silu_mul", "gather_widen_kv"):
        fn = getattr(fused, name)

        def timed(*a, _fn=fn, **k):
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                seconds[0] += time.perf_counter() - t
                count[0] += 1
        setattr(fused, name, timed)
    model.scratch.widen = fused.gather_widen_kv  # the attention's gathers hold the method itself
    return seconds, count


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
    kernel_s, kernel_calls = time_fused_kernels(eng.runner.model)

    def decode_steps(profiler=None) -> tuple[float, int]:
        """(wall ms a decode step, steps) of one request, its prefill left out."""
        eng.add_request(list(ids), params)
        eng.step()  # the prefill
        if profiler is not None:
            profiler.start()
        t0, steps = time.perf_counter(), 0
        while eng.has_unfinished():
            eng.step()
            steps += 1
        wall = 1000 * (time.perf_counter() - t0) / steps
        if profiler is not None:
            profiler.stop()
        return wall, steps

    plain_ms, _ = decode_steps()
    prof = profile(activities=[ProfilerActivity.CPU])
    kernel_s[0], kernel_calls[0] = 0.0, 0
    wall_ms, steps = decode_steps(prof)
    totals: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.defaultdict(int)
    for ev in prof.key_averages():
        totals[group_of(ev.key)] += ev.self_cpu_time_total / 1000  # ms
        calls[group_of(ev.key)] += ev.count
    if kernel_calls[0]:
        totals["fused C kernels (ctypes calls included)"] = kernel_s[0] * 1000
        calls["fused C kernels (ctypes calls included)"] = kernel_calls[0]
    op_ms = sum(totals.values()) / steps
    print(f"{eng.runner.numerics}, {args.context}-token context, batch 1, {steps} decode steps, "
          f"torch {torch.__version__}: {plain_ms:.1f} ms a step ({wall_ms:.1f} under the profiler, "
          f"of which {op_ms:.1f} inside operators)")
    rows = [[g, f"{ms / steps:.2f}", f"{ms / steps / op_ms:.0%}", calls[g] // steps]
            for g, ms in sorted(totals.items(), key=lambda kv: -kv[1])]
    print(common.md_table(["operators", "ms a step (profiled)", "share of operator time",
                           "calls a step"], rows))

if __name__ == "__main__":
    main()
