"""Small helpers on sequences of text or token ids, shared by modules that must not import each other
(the linter, the runtime's miss diagnosis). Knows nothing about tokenizers, caches or files."""

from __future__ import annotations

from typing import Sequence


def common_prefix_len(a: Sequence, b: Sequence) -> int:
    """Length of the longest common prefix of two sequences (token ids, characters)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
