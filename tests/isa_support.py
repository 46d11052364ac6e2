"""The kernels built for one ISA level, for tests that compare levels: a level this CPU cannot run
(or cannot build) skips, naming what is missing."""

from __future__ import annotations

import pytest

from hotprefix.model import fused, isa


def level_lib(level: str):
    """``fused.library(level)``, checked to report ``level``; skips where it cannot run here."""
    runnable = [lv.name for lv in isa.runnable_levels()]
    if level not in runnable:
        missing = sorted(isa.BY_NAME[level].needs - set(isa.cpu_flags()))
        pytest.skip(f"this CPU cannot run the {level} level (it lacks {', '.join(missing)}; "
                    f"it runs {', '.join(runnable)})")
    lib = fused.library(level)
    if lib is None:
        pytest.skip(f"no C compiler: the {level} level cannot be built")
    assert lib.isa == level
    return lib
