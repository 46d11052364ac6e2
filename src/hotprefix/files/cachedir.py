"""Where hotprefix keeps what it derives on this machine and can rebuild: compiled kernels and
tokenizers read out of GGUF files. ``$HOTPREFIX_CACHE_DIR``, else ``$XDG_CACHE_HOME/hotprefix``,
else ``~/.cache/hotprefix``. Everything under it may be deleted at any time."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(kind: str) -> Path:
    """The directory for one kind of derived file (not created here)."""
    root = os.environ.get("HOTPREFIX_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hotprefix")
    return Path(root) / kind
