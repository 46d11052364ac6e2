"""Architecture families: one small file each (``llama``, ``qwen3``, ``gemma3``) of what it
differs in over the shared layer and forward pass (``base.Family``, ``ops``, ``model/llama.py``),
and the registry the loader and the model look families up in.

Adding a family: subclass ``base.Family`` in a new file (its GGUF/HF names, norms, extra metadata,
and ``layer`` if the layer differs), add it to ``FAMILIES`` below, and a random-weight reference
test against transformers (``tests/test_archs.py``).
"""

from __future__ import annotations

from hotprefix.model.arch.base import Family
from hotprefix.model.arch.gemma3 import Gemma3
from hotprefix.model.arch.llama import Llama, Qwen2
from hotprefix.model.arch.qwen3 import Qwen3

FAMILIES: tuple[Family, ...] = (Llama(), Qwen2(), Qwen3(), Gemma3())
"""Every family, in the order their names are listed to users."""

_BY_ARCH = {a: f for f in FAMILIES for a in f.archs}

SUPPORTED_ARCHS: tuple[str, ...] = tuple(_BY_ARCH)
"""GGUF ``general.architecture`` / Hugging Face ``model_type`` values that load."""


def family(arch: str) -> Family | None:
    """The family that runs ``arch`` (a GGUF architecture or HF model_type), or None."""
    return _BY_ARCH.get(arch)
