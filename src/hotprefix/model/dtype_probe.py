"""The default compute dtype on CPU, chosen by probing the machine.

bfloat16 where the CPU multiplies bf16 natively (AMX tiles or AVX-512 BF16) *and* a timed matmul of
the model's shape confirms it beats float32; float32 anywhere else (older CPUs emulate bf16 and run
it slower than fp32). ``--dtype`` overrides the probe.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

MIN_SPEEDUP = 1.0
"""bf16 must run the probe matmul faster than fp32 to become the default. Native bf16 runs it 2x
(AVX512-BF16) to 8x (AMX) faster; the bar only catches a CPU that advertises bf16 but runs it
slowly, and leaves room for a busy machine's noise (the choice must not flip between two engines
started on the same machine)."""


@dataclass(frozen=True)
class DtypeChoice:
    """What the probe found and chose."""

    dtype: torch.dtype
    """The chosen compute dtype."""
    native_bf16: bool
    """The CPU advertises AMX-BF16 or AVX512-BF16."""
    speedup: float
    """fp32 time / bf16 time of the probe matmul (0 when not measured)."""
    reason: str
    """One line for the log."""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _best_time(a: torch.Tensor, b: torch.Tensor, reps: int = 7) -> float:
    a @ b  # warm-up: kernel selection, weight packing
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return best


def measure_bf16_speedup(rows: int = 512, inner: int = 576, cols: int = 1536) -> float:
    """fp32 time / bf16 time of one [rows, inner] @ [inner, cols] matmul, best of a few."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(rows, inner, generator=g)
    b = torch.randn(inner, cols, generator=g)
    t32 = _best_time(a, b)
    t16 = _best_time(a.bfloat16(), b.bfloat16())
    return t32 / max(t16, 1e-9)


@functools.cache
def probed_cpu_dtype() -> DtypeChoice:
    """This machine's choice, probed once per process."""
    return choose_cpu_dtype()


def choose_cpu_dtype(flags: set[str] | None = None, speedup: float | None = None) -> DtypeChoice:
    """Pick the CPU default dtype. ``flags`` and ``speedup`` replace the probes (for tests)."""
    flags = cpu_flags() if flags is None else flags
    native = bool({"amx_bf16", "avx512_bf16"} & flags)
    if not native:
        return DtypeChoice(torch.float32, False, 0.0, "float32: the CPU has no native bf16 (AMX or AVX512-BF16)")
    s = measure_bf16_speedup() if speedup is None else speedup
    if s < MIN_SPEEDUP:
        return DtypeChoice(torch.float32, True, s,
                           f"float32: bf16 matmuls only {s:.1f}x faster than fp32 here (< {MIN_SPEEDUP}x)")
    kind = "+".join(sorted({"amx_bf16", "avx512_bf16"} & flags))
    return DtypeChoice(torch.bfloat16, True, s, f"bfloat16: CPU has {kind}, bf16 matmuls {s:.1f}x faster than fp32")
