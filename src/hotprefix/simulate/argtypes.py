"""argparse types of ``hotprefix simulate``'s numeric flags: a bad value is refused while the line
is parsed (``hotprefix simulate: error: argument --block-size: ...``, exit 2), before any trace is
read. Knows nothing else.
"""

from __future__ import annotations

import argparse
import math
from typing import Callable


def int_at_least(lo: int) -> Callable[[str], int]:
    """An integer >= ``lo``."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = None
        if n is None or n < lo:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {text!r}")
        return n
    return parse


def finite_float(lo: float, *, above: bool) -> Callable[[str], float]:
    """A finite number > ``lo`` (``above``) or >= ``lo``."""
    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            x = math.nan
        if not math.isfinite(x) or (x <= lo if above else x < lo):
            raise argparse.ArgumentTypeError(
                f"must be a finite number {'>' if above else '>='} {lo:g}, got {text!r}")
        return x
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)
positive_float = finite_float(0.0, above=True)
non_negative_float = finite_float(0.0, above=False)
