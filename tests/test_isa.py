"""The kernels' ISA layer (``model/isa.py``): which level a CPU's flags choose, how
``$HOTPREFIX_ISA`` forces one, that each level's build reports the path it compiled, and that the
default weight mode and attention follow the level."""

from __future__ import annotations

import os

import pytest

from hotprefix.model import fused, isa

AVX2 = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"}
ZEN3 = AVX2 | {"vaes", "vpclmulqdq", "sha_ni"}  # an AMD EPYC of this project: AVX2 only
ALDER = AVX2 | {"avx_vnni"}  # Intel client cores: AVX-VNNI without AVX-512
SKX = AVX2 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}  # AVX-512, no VNNI
SPR = SKX | {"avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_bf16"}


@pytest.mark.parametrize("flags, best", [
    (set(), "portable"), ({"sse4_2", "avx"}, "portable"), ({"avx2", "f16c"}, "portable"),
    (ZEN3, "avx2"), (ALDER, "avxvnni"), (SKX, "avx2"), (SPR, "avx512"),
    (SPR - {"avx512bw"}, "avxvnni"), (SPR | {"amx_int8"}, "amx"), (SKX | {"amx_tile", "amx_int8"}, "avx2"),
])
def test_flags_choose_the_best_level(flags, best):
    assert isa.best_level(frozenset(flags)).name == best
    names = [lv.name for lv in isa.runnable_levels(frozenset(flags))]
    assert names[0] == "portable" and names[-1] == best
    assert isa.BY_NAME[best].fast_gemm == (best != "portable")


def test_environment_forces_a_level_the_cpu_runs(monkeypatch):
    runnable = [lv.name for lv in isa.runnable_levels()]
    for name in runnable:
        monkeypatch.setenv(isa.ISA_ENV, name.upper())
        assert isa.requested_level().name == name
    monkeypatch.setenv(isa.ISA_ENV, "auto")
    assert isa.requested_level() == isa.best_level()
    monkeypatch.setenv(isa.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="not a kernel level"):
        isa.requested_level()
    missing = [lv.name for lv in isa.LEVELS if lv.name not in runnable]
    if missing:
        monkeypatch.setenv(isa.ISA_ENV, missing[-1])
        with pytest.raises(ValueError, match="cannot run"):
            isa.requested_level()


def test_the_kernels_build_wherever_a_compiler_exists():
    """A compile error must fail here, not turn every kernel test into a skip ("no C compiler"):
    where cc exists and the kernels are on, every level the CPU runs builds."""
    import shutil

    if (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")) is None:
        pytest.skip("no C compiler on this machine")
    for lv in isa.runnable_levels():
        assert fused.library(lv.name) is not None, f"the {lv.name} kernels did not build (see the log)"


def test_each_level_builds_what_it_names():
    """A build per level the CPU runs; each reports the vector path isa.h compiled for it, and the
    best level is built with -march=native (as before levels existed), the others with their own
    flags."""
    if fused.library() is None:
        pytest.skip("no C compiler on this machine")
    for lv in isa.runnable_levels():
        lib = fused.library(lv.name)
        assert lib is not None and lib.isa == lv.name
        flags = isa.compile_flags(lv)
        if isa.is_x86():
            assert flags == (["-march=native"] if lv == isa.best_level() else list(lv.march))
    assert fused.library().isa == isa.requested_level().name


def test_a_forced_level_runs_the_portable_default(monkeypatch):
    """With $HOTPREFIX_ISA=portable the block GEMM and the C attention are not defaults (too slow
    there): the weight mode follows, and the numerics tag names the level."""
    import torch

    from hotprefix.model import linear, qlinear

    monkeypatch.setenv(isa.ISA_ENV, "portable")
    assert not qlinear.fast_block_kernels()
    assert linear.resolve_weights("auto", torch.device("cpu"), torch.bfloat16) == "mixed"
    monkeypatch.setenv(isa.ISA_ENV, isa.best_level().name)
    assert qlinear.fast_block_kernels() == isa.best_level().fast_gemm
