"""``model/gguf_file.py`` reads what ``gguf.GGUFReader`` reads: every metadata value (as
``ReaderField.contents()`` gives it) and every tensor's name, shape, type and bytes, its data a view
of one read-only memory map."""

from __future__ import annotations

import mmap

import gguf
import numpy as np
import pytest
from gguf.quants import quantize

from hotprefix.model.gguf_file import GgufFile, GgufFormatError


def test_fields_and_tensors_are_gguf_readers(tmp_path):
    path = str(tmp_path / "m.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(2)
    w.add_float32("llama.rope.freq_base", 5e5)
    w.add_string("general.name", "tiny ünïcode")
    w.add_token_list(["<s>", "a", "bc", "ü"])
    w.add_token_scores([0.0, -1.5, -2.0, -3.0])
    w.add_array("llama.attention.sliding_window_pattern", [True, False, True])
    rng = np.random.default_rng(0)
    w.add_tensor("a.weight", rng.standard_normal((3, 8)).astype(np.float32))
    w.add_tensor("b.weight", rng.standard_normal((4, 64)).astype(np.float16))
    q = quantize(rng.standard_normal((16, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("c.weight", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    k = rng.integers(0, 256, (8, 2 * 144), dtype=np.uint8)  # Q4_K blocks: their bytes only matter
    w.add_tensor("d.weight", k, raw_shape=k.shape, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, theirs = GgufFile(path), gguf.GGUFReader(path)
    header = [k for k in theirs.fields if not k.startswith("GGUF.")]  # the reader's own entries
    assert list(ours.fields) == header
    for key in header:
        field = theirs.fields[key]
        got = ours.fields[key]
        assert (list(got) if not isinstance(got, (str, int, float)) else got) == field.contents(), key
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 4
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, a.n_bytes) == (b.name, b.tensor_type, b.n_bytes)
        assert a.shape == tuple(int(x) for x in b.shape)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data, b.data) and not a.data.flags.writeable
        base = a.data
        while base is not None and not isinstance(base, mmap.mmap):
            base = getattr(base, "base", None)
        assert isinstance(base, mmap.mmap)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(GgufFormatError, match="not a GGUF"):
        GgufFile(str(bad))
