"""``qpack.c`` (the GGUF blocks' packing in C, what the gguf mode loads with) writes the very bytes
of ``gguf_blocks``' numpy reference: for every block type, stacks whose groups mix types, a
partial last group, rows read through a strided view (the loader's un-permuted Q/K), any thread
count; and the pages of a read-only file map are dropped after packing, never an array's own."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hotprefix.model.fused import library
from hotprefix.model.gguf_blocks import (BLOCK_BYTES, BLOCK_INPUTS, GGUF_TYPES, PackError,
                                         pack_weight, release_pages)
from hotprefix.model.qlinear import QuantWeight, _packer

LIB = library()
pytestmark = [pytest.mark.skipif(LIB is None, reason="no C compiler: only the numpy packer runs"),
              pytest.mark.filterwarnings("ignore:.*encountered:RuntimeWarning")]  # random fp16 scales


def random_blocks(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    """Raw blocks [n, bytes a row] of random bytes: every value, bit plane and 6-bit scale
    pattern; fp16 scales random too (inf and NaN among them), a few zero."""
    rng = np.random.default_rng(seed)
    nblk = k // BLOCK_INPUTS[kind]
    b = rng.integers(0, 256, (n, nblk, BLOCK_BYTES[kind]), dtype=np.uint8)
    at = {"Q6_K": [208]}.get(kind, [0, 2] if kind in ("Q4_1", "Q4_K", "Q5_K") else [0])
    for off in at:
        b[rng.random((n, nblk)) < 0.05, off:off + 2] = 0
    return b.reshape(n, -1)


def both(parts, k, threads=2):
    """(C buffer, numpy buffer), formats checked equal."""
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fast, f1 = pack_weight(parts, k, _packer(LIB))
    finally:
        torch.set_num_threads(torch_threads)
    ref, f2 = pack_weight(parts, k)
    assert f1 == f2
    return fast, ref


@pytest.mark.parametrize("kind", GGUF_TYPES)
@pytest.mark.parametrize("n", [16, 40, 7])
def test_c_packer_writes_the_reference_bytes_for_every_type(kind, n):
    k = 512
    fast, ref = both([(kind, random_blocks(kind, n, k, seed=n))], k)
    assert fast.dtype == ref.dtype == np.uint8 and fast.shape == ref.shape
    assert np.array_equal(fast, ref)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_mixed_stacks_and_partial_groups_whatever_the_threads(threads):
    k = 256
    local = [("Q4_1", 24), ("Q8_0", 8), ("Q4_0", 13), ("Q5_0", 19), ("Q4_0", 16), ("Q5_0", 16),
             ("Q4_1", 5)]  # groups: Q4, Q8 (Q4_0 + Q5_0), Q8, Q5, Q8 (Q5_0 + Q4_1 + padding)
    parts = [(kind, random_blocks(kind, n, k, seed=i)) for i, (kind, n) in enumerate(local)]
    fast, ref = both(parts, k, threads)
    assert np.array_equal(fast, ref)
    kq = [("Q4_K", 32), ("Q6_K", 16), ("Q5_0", 16), ("Q5_K", 9)]
    parts = [(kind, random_blocks(kind, n, k, seed=10 + i)) for i, (kind, n) in enumerate(kq)]
    fast, ref = both(parts, k, threads)
    assert np.array_equal(fast, ref)


def test_strided_rows_pack_as_their_copy():
    """The loader's un-permuted Q/K: a [heads, 2, rows / heads / 2, bytes] view of the file."""
    raw = random_blocks("Q4_K", 64, 512, seed=3)
    view = raw.reshape(4, 8, 2, raw.shape[1]).swapaxes(1, 2)
    copy = np.ascontiguousarray(view).reshape(64, -1)
    a, fa = pack_weight([("Q4_K", view), ("Q6_K", random_blocks("Q6_K", 16, 512, 4))], 512, _packer(LIB))
    b, fb = pack_weight([("Q4_K", copy), ("Q6_K", random_blocks("Q6_K", 16, 512, 4))], 512)
    assert fa == fb and np.array_equal(a, b)
    c, _ = pack_weight([("Q4_K", view), ("Q6_K", random_blocks("Q6_K", 16, 512, 4))], 512)
    assert np.array_equal(c, b)  # the numpy path (no compiler) takes the view too
    w = QuantWeight([("Q4_K", view)], 512, LIB)
    assert w.n == 64 and torch.equal(w.packed, QuantWeight([("Q4_K", copy)], 512).packed)


def test_c_packer_refuses_what_the_reference_refuses():
    parts = [("Q4_K", random_blocks("Q4_K", 24, 256, 1)), ("Q6_K", random_blocks("Q6_K", 8, 256, 2))]
    with pytest.raises(PackError, match="share a group"):
        pack_weight(parts, 256, _packer(LIB))
    with pytest.raises(ValueError, match="do not hold"):
        pack_weight([("Q4_0", random_blocks("Q4_0", 16, 64, 1))], 96, _packer(LIB))


def test_pages_are_dropped_only_from_a_read_only_file_map(tmp_path):
    raw = random_blocks("Q8_0", 64, 1024, seed=5)
    path = tmp_path / "blocks.bin"
    raw.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r").reshape(raw.shape)
    before = pack_weight([("Q8_0", mapped)], 1024, _packer(LIB))[0]
    assert np.array_equal(mapped, raw)  # read again after its pages were dropped: the same bytes
    assert np.array_equal(before, pack_weight([("Q8_0", raw)], 1024)[0])
    own = raw.copy()
    own.flags.writeable = False
    release_pages(own)  # not a file map: left alone (MADV_DONTNEED would zero it)
    assert np.array_equal(own, raw)
    writable = np.memmap(path, dtype=np.uint8, mode="r+")
    writable[0] ^= 1
    release_pages(writable)  # writable maps are left alone
    assert writable[0] == raw.reshape(-1)[0] ^ 1
