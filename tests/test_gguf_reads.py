"""``files/gguf_reads.fast_gguf_reads``: inside it, gguf's reader (as transformers calls it) reads
the same fields, parts, types and tensors as gguf's own, once a file; outside it, gguf is as it
was, also after an exception."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from hotprefix.files.gguf_reads import fast_gguf_reads


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory) -> str:
    """A GGUF with every kind of metadata value (scalars, strings, numeric and string arrays) and
    tensors of two types."""
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(3)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_token_list([f"tok{i}" for i in range(500)] + ["naïve", "東京", ""])
    w.add_token_scores([float(i) / 7 for i in range(503)])
    w.add_token_types([1] * 503)
    w.add_array("test.ints", [5, -6, 7])
    g = np.random.default_rng(0)
    w.add_tensor("a.weight", g.standard_normal((4, 32)).astype(np.float32))
    w.add_tensor("b.weight", g.standard_normal((8,)).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _described(r) -> tuple:
    fields = [(k, f.offset, f.name, f.types, f.data, [p.tobytes() for p in f.parts], f.contents())
              for k, f in r.fields.items()]
    tensors = [(t.name, t.tensor_type, list(t.shape), t.n_elements, t.n_bytes, t.data_offset,
                np.asarray(t.data).tobytes(), [p.tobytes() for p in t.field.parts]) for t in r.tensors]
    return fields, tensors, r.alignment, r.data_offset


def test_the_same_reading_once_a_file_and_gguf_restored(small_gguf):
    stock_reader, stock_map = gguf.GGUFReader, gguf.get_tensor_name_map
    want = _described(stock_reader(small_gguf))
    with fast_gguf_reads():
        assert gguf.GGUFReader is not stock_reader
        first = gguf.GGUFReader(small_gguf)
        assert gguf.GGUFReader(small_gguf) is first  # read once a file
        assert type(first.data) is np.ndarray  # not a memmap: its slices are the slow part
        assert _described(first) == want
        name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is name_map
        assert name_map.get_name("model.layers.1.mlp.down_proj") == "blk.1.ffn_down"
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (stock_reader, stock_map)
    with pytest.raises(RuntimeError, match="inside"), fast_gguf_reads():
        raise RuntimeError("inside")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (stock_reader, stock_map)


def test_a_bad_file_still_raises_gguf_s_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 8)
    with fast_gguf_reads(), pytest.raises(Exception):
        gguf.GGUFReader(str(bad))
    assert gguf.GGUFReader.__module__ == "gguf.gguf_reader"
