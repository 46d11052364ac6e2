"""The integer multiply-add peak of the instruction the kernels' ISA level builds its GEMM on
(``isa_peak.c``), and a model's GEMM multiply-adds per token, so that a benchmark can print the
achieved multiply-adds per second beside the peak, measured in the same run.

    .venv/bin/python benchmarks/isa_peak.py [--threads 2] [--seconds 0.5]

prints every instruction this CPU runs, on 1 thread and on --threads.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import shutil
import subprocess
import tempfile

from hotprefix.model.isa import cpu_flags

KINDS = {  # kind: (isa_peak.c's number, the CPU flags it needs, what one multiply-add is)
    "vpmaddwd ymm": (0, {"avx2"}, "int16"),
    "vpdpwssd ymm": (1, {"avx_vnni"}, "int16"),
    "vpdpwssd zmm": (2, {"avx512f", "avx512bw", "avx512_vnni"}, "int16"),
    "tdpbssd (AMX)": (3, {"amx_tile", "amx_int8"}, "int8"),
    "vfmadd231ps ymm": (4, {"avx2", "fma"}, "fp32"),
    "vfmadd231ps zmm": (5, {"avx512f"}, "fp32"),
}
LEVEL_KIND = {"avx2": "vpmaddwd ymm", "avxvnni": "vpdpwssd ymm", "avx512": "vpdpwssd zmm",
              "amx": "tdpbssd (AMX)"}
"""The instruction each kernel level's block GEMM is built on."""


@functools.cache
def _lib() -> ctypes.CDLL | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    out = os.path.join(tempfile.mkdtemp(prefix="hotprefix-peak-"), "isa_peak.so")
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "isa_peak.c")
    r = subprocess.run([cc, "-O3", "-fopenmp", "-fPIC", "-shared", "-o", out, src],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return None
    lib = ctypes.CDLL(out)
    lib.isa_peak.restype = ctypes.c_double
    lib.isa_peak.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_double]
    return lib


def peak(kind: str, threads: int, seconds: float = 0.5) -> float | None:
    """Multiply-adds per second of ``kind`` on ``threads`` threads (int8 ones for AMX), or None
    where the CPU lacks it or nothing can be built."""
    num, needs, _ = KINDS[kind]
    lib = _lib()
    if lib is None or not needs <= set(cpu_flags()):
        return None
    r = lib.isa_peak(num, threads, seconds)
    return r if r > 0 else None


def int16_peak(level: str, threads: int, seconds: float = 0.5) -> tuple[str, float | None]:
    """The kernel level's instruction and its peak in the GEMM's own int16 multiply-adds per
    second (AMX: half its int8 rate, as an int16 product takes a tile product of each byte)."""
    kind = LEVEL_KIND.get(level)
    if kind is None:
        return "-", None
    p = peak(kind, threads, seconds)
    return kind, None if p is None else (p / 2 if KINDS[kind][2] == "int8" else p)


def gemm_macs_per_token(llm) -> int:
    """Multiply-adds of one token through the model's block-quantized decoder matrices (the
    prefill's GEMMs; the LM head runs for the last token only and is left out)."""
    model = llm.engine.runner.model
    total = 0
    for layer in model.layers:
        for w in layer.values():
            if hasattr(w, "n") and hasattr(w, "k") and hasattr(w, "packed"):
                total += w.n * w.k
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=0.5)
    a = ap.parse_args()
    print("| instruction | multiply-adds | 1 thread (G/s) | %d threads (G/s) |" % a.threads)
    print("|---|---|---|---|")
    for kind, (_, _, what) in KINDS.items():
        one, many = peak(kind, 1, a.seconds), peak(kind, a.threads, a.seconds)
        if one is None:
            continue
        print(f"| {kind} | {what} | {one / 1e9:.1f} | {many / 1e9:.1f} |")


if __name__ == "__main__":
    main()
