"""The C attention's sliding window (``attn.c`` with ``window`` > 0: a row at position p reads keys
p - window + 1 .. p): close to float64 windowed attention; the keys before a row's window never
reach it (a block table may hold PAD there, or blocks of NaN and inf: the same bits); and a row's
bits do not depend on how its prompt was chunked, what shares the call, the thread count, the
path or the ISA level, for windows around the chunk (16) and segment (256) grids."""

from __future__ import annotations

import pytest
import torch

from hotprefix.model import fused
from hotprefix.model.attention import PAD_BLOCK, AttentionMetadata, PrefillSeq
from hotprefix.model.kv_dtype import quantize_int8
from isa_support import level_lib

pytestmark = pytest.mark.skipif(fused.library() is None, reason="no C compiler")

NB = 320
WINDOWS = [1, 5, 16, 17, 40, 256, 300, 512]


def _first(p: int, window: int) -> int:
    return max(0, p - window + 1)


def _pool(nkv, hd, bs, dtype, g):
    k = torch.randn(NB, bs, nkv, hd, generator=g)
    v = torch.randn(NB, bs, nkv, hd, generator=g)
    if dtype == torch.int8:  # rows of int8 values and their scale (kv_dtype.py)
        return quantize_int8(k), quantize_int8(v)
    return k.to(dtype), v.to(dtype)


def _attend(lib, k, v, q, tables, seq, pos, window, threads=2, portable=False):
    nh, hd, nkv = q.shape[1], q.shape[2], k.shape[2]
    ops = fused.FusedOps(lib, 1e-5, nh, nkv, hd)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return ops.attention(q, k, v, tables, seq, pos, hd ** -0.5, portable, window=window)
    finally:
        torch.set_num_threads(old)


def _reference(q, k, v, table, bs, positions, window):
    """float64 attention of rows at ``positions`` of one sequence over keys first..p."""
    nh, nkv = q.shape[1], k.shape[2]
    t = torch.arange(max(positions) + 1)
    tab = torch.tensor(table)
    slots = tab[t // bs].clamp(min=0) * bs + t % bs
    kk = k.reshape(-1, nkv, k.shape[-1])[slots].double()
    vv = v.reshape(-1, nkv, v.shape[-1])[slots].double()
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, p in enumerate(positions):
        lo = _first(p, window)
        for h in range(nh):
            s = kk[lo:p + 1, h // (nh // nkv)] @ q[i, h].double() * q.shape[-1] ** -0.5
            out[i, h] = torch.softmax(s, 0) @ vv[lo:p + 1, h // (nh // nkv)]
    return out


def _padded(table, lo, bs):
    """``table`` with PAD_BLOCK for the blocks wholly before key ``lo``."""
    return [PAD_BLOCK if (b + 1) * bs <= lo else t for b, t in enumerate(table)]


@pytest.mark.parametrize("nh,nkv,hd,bs,dtype,window", [
    (4, 1, 64, 16, torch.bfloat16, 40),     # Gemma 3 270M's heads (window scaled down)
    (9, 3, 64, 16, torch.float32, 300),
    (4, 4, 128, 32, torch.bfloat16, 512),
    (6, 2, 32, 8, torch.bfloat16, 5),       # a window shorter than a chunk, small blocks
    (2, 1, 48, 24, torch.float32, 57),      # blocks that do not hold whole chunks
])
def test_close_to_float64_and_blind_before_the_window(nh, nkv, hd, bs, dtype, window):
    """A prefill chunk of the last 40 rows and a decode of the last key, with the table's blocks
    before the chunk's first window as PAD, or pointing at blocks of NaN keys and inf values, and
    the keys before each window in its first block poisoned too: finite, within 2e-5 of float64,
    and the same bits either way."""
    g = torch.Generator().manual_seed(window + bs)
    k, v = _pool(nkv, hd, bs, dtype, g)
    n = 700
    perm = torch.randperm(NB - 1, generator=g).tolist()
    table = perm[: -(-n // bs)]
    poison = NB - 1  # a block of garbage
    k[poison], v[poison] = float("nan"), float("inf")
    first_row = n - 40
    lo = _first(first_row, window)
    kp, vp = k.clone(), v.clone()
    for p in range(lo // bs * bs, lo):  # the keys before the first window in its first block
        kp[table[p // bs], p % bs], vp[table[p // bs], p % bs] = float("nan"), float("inf")
    q = torch.randn(40, nh, hd, generator=g)
    seq = torch.zeros(40, dtype=torch.long)
    pos = torch.arange(first_row, n)
    ref = _reference(q, k, v, table, bs, pos.tolist(), window)
    lib = fused.library()
    outs = []
    for tab, (kk, vv) in ((table, (k, v)), (_padded(table, lo, bs), (kp, vp)),
                          ([poison if t == PAD_BLOCK else t for t in _padded(table, lo, bs)], (kp, vp))):
        out = _attend(lib, kk, vv, q, torch.tensor([tab]), seq, pos, window)
        assert torch.isfinite(out).all()
        assert (out.double() - ref).abs().max().item() < 2e-5
        outs.append(out)
        dec = _attend(lib, kk, vv, q[-1:].contiguous(), torch.tensor([tab]), seq[:1], pos[-1:], window)
        assert torch.equal(dec[0], out[-1])
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_a_table_must_cover_only_the_window():
    """The window's blocks must be in the table and the pool; the blocks before it need not."""
    g = torch.Generator().manual_seed(1)
    k, v = _pool(1, 64, 16, torch.bfloat16, g)
    q = torch.randn(1, 4, 64, generator=g)
    seq, lib = torch.zeros(1, dtype=torch.long), fused.library()
    ok = _attend(lib, k, v, q, torch.tensor([[-1, -1, 5, 6]]), seq, torch.tensor([63]), 30)
    assert torch.isfinite(ok).all()
    for table, window in (([-1, -1, 5, 6], 40), ([-1, -1, 5, 6], 0), ([3, NB, 5, 6], 40)):
        with pytest.raises(ValueError, match="past its block table or outside the KV pool"):
            _attend(lib, k, v, q, torch.tensor([table]), seq, torch.tensor([63]), window)


def _calls(n, bs):
    """(start, rows) prefill chunks of a sequence of ``n`` keys, cut in other places (the short
    ones over two segments: too few items for 2 threads, split per segment)."""
    return [(0, n), (0, 17), (5, 300), (16, 16), (n - 100, 100), (n - 1, 1), (1, n - 1), (250, 280),
            (240, 30), (500, 20), (n - 20, 20)]


@pytest.mark.parametrize("window,dtype", [(w, torch.bfloat16) for w in WINDOWS]
                         + [(w, torch.int8) for w in (5, 40, 300)])
def test_row_bits_independent_of_chunking_batch_threads_path_and_level(window, dtype):
    """Every row of a 700-key sequence, attended in one call, in chunks cut elsewhere, as a
    decode alone, beside two other decodes (one sharing its blocks), on 1 and 2 threads, on the
    portable path, and at the portable and AVX2 levels: the same bits (bf16 and int8 pools)."""
    bs, nh, nkv, hd = 16, 8, 2, 64
    g = torch.Generator().manual_seed(window)
    k, v = _pool(nkv, hd, bs, dtype, g)
    n = 700
    table = torch.randperm(NB, generator=g)[: -(-n // bs)].tolist()
    q = torch.randn(n, nh, hd, generator=g)
    lib = fused.library()
    whole = _attend(lib, k, v, q, torch.tensor([table]), torch.zeros(n, dtype=torch.long),
                    torch.arange(n), window)
    for start, rows in _calls(n, bs):
        out = _attend(lib, k, v, q[start:start + rows].contiguous(), torch.tensor([table]),
                      torch.zeros(rows, dtype=torch.long), torch.arange(start, start + rows), window)
        assert torch.equal(out, whole[start:start + rows]), (start, rows)
    other = torch.randperm(NB, generator=g)[:44].tolist()
    probe = [0, 1, 15, 16, 17, 255, 256, 257, 511, 512, 513, 699]
    for p in probe:
        tab = torch.tensor([_padded(table, _first(p, window), bs)])
        for threads in (1, 2):
            alone = _attend(lib, k, v, q[p:p + 1].contiguous(), tab, torch.zeros(1, dtype=torch.long),
                            torch.tensor([p]), window, threads)
            assert torch.equal(alone[0], whole[p]), (p, threads)
        tabs = torch.tensor([other, table[:44], _padded(table, _first(p, window), bs)[:44]])
        batch = torch.stack([q[3], q[min(p + 3, n - 1)], q[p]])
        out = _attend(lib, k, v, batch, tabs, torch.arange(3),
                      torch.tensor([600, min(p + 3, n - 1), p]), window)
        assert torch.equal(out[2], whole[p]), p
    assert torch.equal(_attend(lib, k, v, q, torch.tensor([table]), torch.zeros(n, dtype=torch.long),
                               torch.arange(n), window, portable=True), whole)
    for level in ("portable", "avx2"):
        try:
            other_lib = level_lib(level)
        except pytest.skip.Exception:
            continue
        got = _attend(other_lib, k, v, q, torch.tensor([table]), torch.zeros(n, dtype=torch.long),
                      torch.arange(n), window)
        assert torch.equal(got, whole), level
