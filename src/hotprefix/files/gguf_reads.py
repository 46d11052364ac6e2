"""transformers reading a GGUF file, without its avoidable costs: ``fast_gguf_reads()`` is the one
place that touches them, for the two callers that let transformers read a GGUF (the first build
of a byte-level BPE tokenizer in ``text/tokenizer.py``; the float32 reference model in
``tools/quality.py``).

transformers builds ``gguf.GGUFReader`` over the file, and that reader slices a ``numpy.memmap``
for every element of every metadata array: a memmap's slice costs several times a plain array's
(its ``__array_finalize__``), and a 49k-token vocabulary with its merges is about 250,000 slices
(2.8 s for the default model). Loading a model, transformers also reads the whole header twice
(config, then weights) and builds gguf's tensor-name map once for each of the model's modules.

Inside the context, ``gguf.GGUFReader`` is a subclass whose buffer is a plain ``ndarray`` view of
the same mapping (the same fields, parts and tensors: only the slicing is cheaper), made once per
file and arguments, and ``gguf.get_tensor_name_map`` is memoized: transformers imports both from
``gguf`` when it reads, so it sees them. Outside it, gguf is as it was.

This module knows nothing about tokenizers or models: only gguf's reader.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator

import numpy as np

_LOCK = threading.RLock()
"""One thread swaps gguf's names at a time (a nested context swaps and restores in turn)."""


@contextlib.contextmanager
def fast_gguf_reads() -> Iterator[None]:
    """gguf's reader over a plain array and once per file, and its name maps once, while the
    context is open (for transformers' GGUF loading inside it)."""
    import gguf

    class PlainArrayReader(gguf.GGUFReader):
        """gguf's reader with its ``data`` held as a plain ndarray view of the mapped file."""

        @property
        def data(self) -> np.ndarray:
            return self._data

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    readers: dict = {}

    def reader(path, *args, **kwargs):
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = PlainArrayReader(path, *args, **kwargs)
        return readers[key]

    with _LOCK:
        real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(real_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map
