"""The kernels' ISA levels: which vector path a CPU runs, and how each level is built.

The C kernels (``fused.c``, ``qgemm.c``, ``qlayer.c``, ``attn.c``, ``select.c``) have a portable
C reference and vector paths per level, chosen at compile time by ``isa.h``. ``fused.library``
builds one shared object per level and loads the one this CPU runs best (``best_level``), or the
one ``$HOTPREFIX_ISA`` names (to measure a lower path on a faster CPU). Every level gives the
portable path's bits; tests build each level the machine can run and compare them.

This module knows nothing about the kernels' functions: only levels, CPU flags and compiler flags.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

from hotprefix.model.dtype_probe import cpu_flags

ISA_ENV = "HOTPREFIX_ISA"
"""Environment variable naming the level to run (``portable``, ``avx2``, ``avxvnni``,
``avx512``, ``amx``: AVX-512 with the prefill GEMM on AMX tiles); unset or ``auto``: the best level
the CPU has."""


@dataclass(frozen=True)
class IsaLevel:
    """One level of the kernels' vector paths."""

    name: str
    """The name the library reports (``hp_isa_level``) and the numerics tag carries."""
    needs: frozenset[str]
    """CPU flags (``/proc/cpuinfo``) the level's code executes."""
    march: tuple[str, ...]
    """Compiler flags selecting the level (x86-64); the best level of the build machine is built
    with ``-march=native`` instead, as before levels existed."""
    fast_gemm: bool
    """Whether the GGUF-block GEMM and the C attention run vector code at this level (the
    default weight mode and attention need it; the portable path is a reference, not a default)."""


LEVELS = (  # lowest first
    IsaLevel("portable", frozenset(), ("-march=x86-64-v2",), False),
    IsaLevel("avx2", frozenset({"avx2", "fma", "f16c"}), ("-march=x86-64-v3",), True),
    IsaLevel("avxvnni", frozenset({"avx2", "fma", "f16c", "avx_vnni"}),
             ("-march=x86-64-v3", "-mavxvnni"), True),
    IsaLevel("avx512", frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni"}),
             ("-march=x86-64-v4", "-mavx512vnni"), True),
    IsaLevel("amx", frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "amx_tile",
                               "amx_int8"}),
             ("-march=x86-64-v4", "-mavx512vnni", "-mamx-tile", "-mamx-int8"), True),
)
BY_NAME = {lv.name: lv for lv in LEVELS}


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def runnable_levels(flags: frozenset[str] | set[str] | None = None) -> list[IsaLevel]:
    """The levels a CPU with ``flags`` executes, lowest first (only ``portable`` off x86-64)."""
    flags = cpu_flags() if flags is None else flags
    if flags is cpu_flags() and not is_x86():
        return [LEVELS[0]]
    return [lv for lv in LEVELS if lv.needs <= flags]


def best_level(flags: frozenset[str] | set[str] | None = None) -> IsaLevel:
    """The highest level a CPU with ``flags`` executes."""
    return runnable_levels(flags)[-1]


def requested_level() -> IsaLevel:
    """The level to run: ``$HOTPREFIX_ISA`` if set (it must be one this CPU executes), else the
    best. Raises ValueError naming the choices for an unknown or unrunnable level."""
    name = os.environ.get(ISA_ENV, "auto").strip().lower() or "auto"
    if name == "auto":
        return best_level()
    ok = [lv.name for lv in runnable_levels()]
    if name not in BY_NAME:
        raise ValueError(f"{ISA_ENV}={name!r} is not a kernel level; choose auto or one of "
                         f"{', '.join(BY_NAME)}")
    if name not in ok:
        raise ValueError(f"{ISA_ENV}={name!r}: this CPU cannot run that level (it runs "
                         f"{', '.join(ok)})")
    return BY_NAME[name]


def compile_flags(level: IsaLevel) -> list[str]:
    """The -march flags for ``level`` on this machine: ``-march=native`` for its best level,
    the level's own flags otherwise (none off x86-64, where only the portable level exists)."""
    if not is_x86():
        return []
    if level == best_level():
        return ["-march=native"]
    return list(level.march)
