"""What a built wheel carries: every C source and header the kernels compile from, and the
dashboard's assets (``pyproject.toml``'s package data), so a non-editable install builds the same
kernels as a checkout."""

from __future__ import annotations

import fnmatch
import os
import tomllib

import hotprefix
from hotprefix.model import fused

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _package_data() -> dict[str, list[str]]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["package-data"]


def _shipped(package: str, rel: str) -> bool:
    return any(fnmatch.fnmatch(rel, pat) for pat in _package_data().get(package, []))


def test_every_kernel_source_and_header_is_package_data():
    files = [p.name for p in (*fused.SOURCES, *fused.HEADERS)]
    assert "attn.c" in files and "isa.h" in files
    missing = [f for f in files if not _shipped("hotprefix.model", f)]
    assert not missing, f"not in the wheel: {missing}"


def test_every_non_python_file_of_the_package_is_package_data():
    base = os.path.dirname(hotprefix.__file__)
    missing = []
    for d, _, names in os.walk(base):
        for n in names:
            if n.endswith((".py", ".pyc")) or "__pycache__" in d:
                continue
            rel = os.path.relpath(os.path.join(d, n), base).split(os.sep)
            # the deepest package that holds it: hotprefix.<dirs...> with the rest as its path
            for cut in range(len(rel) - 1, -1, -1):
                pkg = ".".join(["hotprefix", *rel[:cut]])
                if os.path.exists(os.path.join(base, *rel[:cut], "__init__.py")):
                    break
            if not _shipped(pkg, "/".join(rel[cut:])):
                missing.append("/".join(rel))
    assert not missing, f"not in the wheel: {missing}"
