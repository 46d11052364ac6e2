"""Where a decode step's time goes: torch.profiler over the engine's decode steps (batch 1, or
``--batch N`` sequences of their own prompts decoding together; their prefills left out), the
operators grouped into GEMMs, attention, KV pool reads and writes, and the rest (elementwise work
and small ops), plus the C kernels (the fused elementwise ones, the C attention, the ``gguf``
mode's block GEMMs, its two calls a layer and its one call for every layer, timed around their
ctypes calls: the profiler does not see them), next to the step's wall time with and without the
profiler (the difference is the profiler's own cost per operator call; what lies outside both is
Python). The small operators are listed too. ``--per-layer`` makes a call a layer, so that the
layer calls and the attention are timed apart.

    .venv/bin/python benchmarks/profile_decode.py [--weights auto|dense|int4|...] [--context 128]
        [--batch 16] [--per-layer]

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


FUSED = "fused C kernels (ctypes calls included)"
QGEMM = "gguf block GEMMs (C, ctypes calls and buffers included)"
CATTN = "C attention (attn.c: read from the pool, ctypes call included)"
ALL_LAYERS = "every layer in one C call (the gguf layer calls and the C attention)"
QLAYER = "gguf layer calls (C: norms, the four GEMMs, RoPE and K/V write, SiLU)"


def _timed(fn, seconds: dict, calls: dict, group: str, when=lambda *a: True):
    def timed(*a, **k):
        if not when(*a):
            return fn(*a, **k)
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            seconds[group] += time.perf_counter() - t
            calls[group] += 1
    return timed


def time_c_kernels(model) -> tuple[dict, dict]:
    """Wrap the model's C-kernel calls (fused elementwise kernels, the gguf mode's block GEMMs)
    with timers: ({group: seconds}, {group: calls}) accumulate."""
    from hotprefix.model.qlinear import QuantLinear, QuantWeight

    seconds: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.defaultdict(int)
    fused = model.fused
    if fused is not None:
        for name in ("add_rms_norm", "head_rms_norm", "rope_write_kv", "act_mul", "gather_widen_kv"):
            setattr(fused, name, _timed(getattr(fused, name), seconds, calls, FUSED))
        model.scratch.widen = fused.gather_widen_kv  # the attention's gathers hold the method
        fused.attention = _timed(fused.attention, seconds, calls, CATTN)
    if model.quant_layers is not None:
        for name in ("pre", "post"):
            setattr(model.quant_layers, name,
                    _timed(getattr(model.quant_layers, name), seconds, calls, QLAYER))
        model.quant_layers.all_layers = _timed(model.quant_layers.all_layers, seconds, calls,
                                               ALL_LAYERS)
    if isinstance(model.linear32, QuantLinear):
        model.linear32 = _timed(model.linear32, seconds, calls, QGEMM,
                                lambda x, w, b: isinstance(w, QuantWeight))
    return seconds, calls


def main() -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from hotprefix.request.sampling import SamplingParams

    ap = common.base_parser(__doc__)
    ap.add_argument("--weights", default=None, help="LLM(weights=...) (default: the default mode)")
    ap.add_argument("--dtype", default=None, help="LLM(dtype=...)")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens before decoding (default 128)")
    ap.add_argument("--steps", type=int, default=64, help="decode steps profiled (default 64)")
    ap.add_argument("--batch", type=int, default=1,
                    help="sequences decoding together, each its own prompt (default 1)")
    ap.add_argument("--top", type=int, default=12, help="small operators listed (default 12)")
    ap.add_argument("--per-layer", action="store_true",
                    help="a Python call a layer instead of one for all (LlamaModel.all_layers_call)")
    args = ap.parse_args()
    common.setup_threads(args.threads)
    opts = {k: v for k, v in (("weights", args.weights), ("dtype", args.dtype)) if v}
    llm = common.load_hotprefix(args.threads, enable_prefix_caching=False, **opts)
    prompts = [common.text_tokens(llm.tokenizer, args.context, seed=1 + i) for i in range(args.batch)]
    params = SamplingParams(max_tokens=args.steps + 1, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    eng = llm.engine
    eng.runner.model.all_layers_call = not args.per_layer
    kernel_s, kernel_calls = time_c_kernels(eng.runner.model)

    def decode_steps(profiler=None) -> tuple[float, int]:
        """(wall ms a decode step, steps) of the batch, its prefills left out."""
        reqs = [eng.add_request(list(ids), params) for ids in prompts]
        while any(not r.output_token_ids for r in reqs):
            eng.step()  # the prefills
        if profiler is not None:
            kernel_s.clear()  # the prefills' kernel calls are not a decode step's
            kernel_calls.clear()
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
    wall_ms, steps = decode_steps(prof)
    totals: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.defaultdict(int)
    for ev in prof.key_averages():
        totals[group_of(ev.key)] += ev.self_cpu_time_total / 1000  # ms
        calls[group_of(ev.key)] += ev.count
    for group, secs in kernel_s.items():
        totals[group] = secs * 1000
        calls[group] = kernel_calls[group]
    op_ms = sum(totals.values()) / steps
    print(f"{eng.runner.numerics}, {args.context}-token context, batch {args.batch}, {steps} decode steps, "
          f"torch {torch.__version__}: {plain_ms:.1f} ms a step ({wall_ms:.1f} under the profiler, "
          f"of which {op_ms:.1f} inside operators)")
    rows = [[g, f"{ms / steps:.2f}", f"{ms / steps / op_ms:.0%}", calls[g] // steps]
            for g, ms in sorted(totals.items(), key=lambda kv: -kv[1])]
    print(common.md_table(["operators", "ms a step (profiled)", "share of operator time",
                           "calls a step"], rows))
    small = sorted((ev for ev in prof.key_averages() if group_of(ev.key) == "elementwise and small ops"),
                   key=lambda ev: -ev.self_cpu_time_total)[:args.top]
    print(common.md_table(["elementwise and small ops", "ms a step", "calls a step"],
                          [[ev.key, f"{ev.self_cpu_time_total / 1000 / steps:.3f}", ev.count // steps]
                           for ev in small]))

if __name__ == "__main__":
    main()
