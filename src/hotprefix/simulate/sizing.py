"""Sizing advice: the smallest pool that reaches a hit ratio, and how to write it as a size.

Bytes per token come from ``hotprefix.model.metadata.kv_bytes_per_token`` (torch-free, no weights
loaded). Knows nothing about replay or plotting.
"""

from __future__ import annotations

from typing import Sequence


def smallest_capacity(caps: Sequence[int], ratios: Sequence[float], target: float) -> int | None:
    """Smallest capacity (tokens) whose hit ratio reaches ``target``, interpolated between points."""
    for i, (c, r) in enumerate(zip(caps, ratios)):
        if r >= target:
            if i == 0:
                return c
            c0, r0 = caps[i - 1], ratios[i - 1]
            return int(c0 + (c - c0) * (target - r0) / max(1e-12, r - r0))
    return None


def format_bytes(n: float) -> str:
    """``1536`` -> ``1.5KiB`` (as ``--kv-cache-memory`` accepts it)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return str(n)
