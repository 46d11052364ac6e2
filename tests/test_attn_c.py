"""The C attention kernel (``attn.c``), read straight from the paged pool: close to float64
attention, and every query row's bits the same however its sequence was chunked, whatever else
shares the call, prefill or decode, on any thread count and on the portable C path."""

from __future__ import annotations

import pytest
import torch

from hotprefix.model import fused
from isa_support import level_lib
from hotprefix.model.attention import AttentionMetadata, PrefillSeq

pytestmark = pytest.mark.skipif(fused.library() is None, reason="no C compiler")

NB = 300


def _setup(nh, nkv, hd, bs, pool_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(NB, bs, nkv, hd, generator=g).to(pool_dtype)
    v = torch.randn(NB, bs, nkv, hd, generator=g).to(pool_dtype)
    ops = fused.FusedOps(fused.library(), 1e-5, nh, nkv, hd)
    return ops, k, v, g


def _run(ops, k, v, q, meta, threads=None, portable=False):
    plan = meta.row_plan(q.shape[0])
    if threads is None:
        return ops.attention(q, k, v, plan.tables, plan.seq, plan.pos, ops.hd ** -0.5, portable)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return ops.attention(q, k, v, plan.tables, plan.seq, plan.pos, ops.hd ** -0.5, portable)
    finally:
        torch.set_num_threads(old)


def _prefill_meta(table, start, n, bs):
    nb = -(-(start + n) // bs)
    return AttentionMetadata(slot_mapping=torch.zeros(n, dtype=torch.long),
                             prefills=[PrefillSeq(0, n, start + n, torch.tensor(table[:nb]))])


def _decode_meta(tables, ctxs, bs):
    width = max(-(-c // bs) for c in ctxs)
    t = torch.tensor([tb[:width] + [0] * (width - len(tb[:width])) for tb in tables])
    return AttentionMetadata(slot_mapping=torch.zeros(len(ctxs), dtype=torch.long),
                             num_decode=len(ctxs), decode_block_tables=t, decode_context_lens=list(ctxs))


def _reference(q, k, v, table, bs, positions):
    """float64 causal attention of rows at ``positions`` of one sequence."""
    nh, nkv = q.shape[1], k.shape[2]
    n = max(positions) + 1
    t = torch.arange(n)
    slots = torch.tensor(table)[t // bs] * bs + t % bs
    kk = k.reshape(-1, nkv, k.shape[-1])[slots].double()
    vv = v.reshape(-1, nkv, v.shape[-1])[slots].double()
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, p in enumerate(positions):
        for h in range(nh):
            s = kk[: p + 1, h // (nh // nkv)] @ q[i, h].double() * q.shape[-1] ** -0.5
            out[i, h] = torch.softmax(s, 0) @ vv[: p + 1, h // (nh // nkv)]
    return out


@pytest.mark.parametrize("nh,nkv,hd,bs,pool_dtype", [
    (9, 3, 64, 16, torch.bfloat16),   # the default model's shape and pool
    (9, 3, 64, 16, torch.float32),    # an fp32 engine's pool
    (4, 4, 128, 32, torch.bfloat16),  # no GQA, a wider head, larger blocks
    (6, 2, 32, 8, torch.bfloat16),    # a head the vector path only partly covers, small blocks
    (2, 1, 48, 24, torch.float32),    # a head size that is not a multiple of 16, odd blocks
])
def test_close_to_float64(nh, nkv, hd, bs, pool_dtype):
    ops, k, v, g = _setup(nh, nkv, hd, bs, pool_dtype)
    seq_len = 200
    table = torch.randperm(NB, generator=g)[: -(-seq_len // bs)].tolist()
    q = torch.randn(seq_len, nh, hd, generator=g)
    out = _run(ops, k, v, q, _prefill_meta(table, 0, seq_len, bs))
    ref = _reference(q, k, v, table, bs, list(range(seq_len)))
    err = (out.double() - ref).abs().max().item()
    assert err < 2e-5, err


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32])
def test_row_bits_independent_of_chunking_batch_phase_threads_and_path(pool_dtype):
    bs = 16
    ops, k, v, g = _setup(9, 3, 64, bs, pool_dtype)
    seq_len = 700
    table = torch.randperm(NB, generator=g)[: -(-seq_len // bs)].tolist()
    q = torch.randn(seq_len, 9, 64, generator=g)
    ref = _run(ops, k, v, q, _prefill_meta(table, 0, seq_len, bs))
    probe = [0, 1, 15, 16, 17, 31, 32, 255, 256, 511, 512, 699]
    for start, n in [(0, 1), (0, 17), (5, 300), (16, 16), (600, 100), (699, 1), (1, 699)]:
        out = _run(ops, k, v, q[start:start + n].contiguous(), _prefill_meta(table, start, n, bs))
        for p in probe:
            if start <= p < start + n:
                assert torch.equal(out[p - start], ref[p]), (start, n, p)
    one = _run(ops, k, v, q, _prefill_meta(table, 0, seq_len, bs), threads=1)
    assert torch.equal(one, ref)
    portable = _run(ops, k, v, q, _prefill_meta(table, 0, seq_len, bs), portable=True)
    assert torch.equal(portable, ref)
    others = [torch.randperm(NB, generator=g)[:40].tolist() for _ in range(2)]
    for p in probe:  # a decode's segments split over threads, or one item on one thread
        alone = _run(ops, k, v, q[p:p + 1].contiguous(), _decode_meta([table], [p + 1], bs))
        assert torch.equal(alone[0], ref[p]), p
        one = _run(ops, k, v, q[p:p + 1].contiguous(), _decode_meta([table], [p + 1], bs), threads=1)
        assert torch.equal(one[0], ref[p]), p
        batch = torch.stack([q[3], q[p], q[9]])
        out = _run(ops, k, v, batch, _decode_meta([others[0], table, others[1]], [600, p + 1, 7], bs))
        assert torch.equal(out[1], ref[p]), p


@pytest.mark.parametrize("nh,nkv", [(9, 3), (4, 1)])
def test_a_short_tail_over_a_long_context_split_by_segment_keeps_each_rows_bits(nh, nkv):
    """A few prefill rows over many cached keys make too few work items for the threads (one per
    KV head and 32 rows): their rows are then split into an item per segment of keys and the
    segments' states merged after, as a decode's are. Each row keeps the bits it has in the whole
    prefill, alone on one thread, and on the portable path."""
    bs = 16
    ops, k, v, g = _setup(nh, nkv, 64, bs, torch.bfloat16, seed=4)
    seq_len = 900
    table = torch.randperm(NB, generator=g)[: -(-seq_len // bs)].tolist()
    q = torch.randn(seq_len, nh, 64, generator=g)
    ref = _run(ops, k, v, q, _prefill_meta(table, 0, seq_len, bs), threads=1)
    for start, n in [(880, 20), (500, 40), (250, 12), (700, 64)]:  # within, across, at segments
        meta = _prefill_meta(table, start, n, bs)
        part = q[start:start + n].contiguous()
        split = _run(ops, k, v, part, meta, threads=2)
        assert torch.equal(split, ref[start:start + n]), (start, n)
        assert torch.equal(_run(ops, k, v, part, meta, threads=1), split)
        assert torch.equal(_run(ops, k, v, part, meta, threads=2, portable=True), split)


def test_a_table_that_does_not_cover_its_row_is_refused():
    ops, k, v, g = _setup(9, 3, 64, 16, torch.bfloat16)
    q = torch.randn(1, 9, 64, generator=g)
    seq, scale = torch.zeros(1, dtype=torch.long), 64 ** -0.5
    for table, keys in (([1, 2], 33), ([1, NB], 20), ([1, -1], 20)):  # 33 keys need 3 blocks
        with pytest.raises(ValueError, match="past its block table or outside the KV pool"):
            ops.attention(q, k, v, torch.tensor([table]), seq, torch.tensor([keys - 1]), scale)
    ok = ops.attention(q, k, v, torch.tensor([[1, 2, 3]]), seq, torch.tensor([32]), scale)
    assert torch.isfinite(ok).all()


def test_mixed_step_padding_rows_and_garbage_past_the_context():
    """Decodes and two prefill chunks in one call, padding rows after them; pool slots past each
    sequence hold NaN and inf, which must not reach any output."""
    bs = 16
    ops, k, v, g = _setup(9, 3, 64, bs, torch.bfloat16)
    lens = [37, 64, 100]
    tables = [torch.randperm(NB, generator=g)[: -(-n // bs)].tolist() for n in lens]
    for t, n in zip(tables, lens):  # poison the tail of each sequence's last block
        last, used = t[-1], n - (len(t) - 1) * bs
        k[last, used:] = float("nan")
        v[last, used:] = float("inf")
    qs = [torch.randn(n, 9, 64, generator=g) for n in lens]
    # decode row: the first sequence's last token; prefill: the second sequence's last 30, the
    # third's tokens 50..99; then 3 padding rows
    rows = torch.cat([qs[0][-1:], qs[1][-30:], qs[2][50:], torch.randn(3, 9, 64, generator=g)])
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(81, dtype=torch.long), num_decode=1,
        decode_block_tables=torch.tensor([tables[0]]), decode_context_lens=[37],
        prefills=[PrefillSeq(1, 31, 64, torch.tensor(tables[1])),
                  PrefillSeq(31, 81, 100, torch.tensor(tables[2]))])
    out = _run(ops, k, v, rows.contiguous(), meta)
    assert torch.isfinite(out).all()
    assert torch.equal(out[-3:], torch.zeros(3, 9, 64))
    for i, (tab, n) in enumerate(zip(tables, lens)):
        full = _run(ops, k, v, qs[i], _prefill_meta(tab, 0, n, bs))
        assert torch.isfinite(full).all()
        got = {0: out[:1], 1: out[1:31], 2: out[31:81]}[i]
        want = {0: full[-1:], 1: full[-30:], 2: full[50:]}[i]
        assert torch.equal(got, want), i


def test_decodes_sharing_a_prefix_are_attended_together_with_each_rows_bits():
    """Decodes whose first segments lie in the same blocks (a cached system prompt) share those
    segments' work (cascade attention), and each row still gets its bits alone, on one thread and
    as the last row of its own prefill: rows that share two segments, one, a part of one, or none."""
    bs = 16
    ops, k, v, g = _setup(9, 3, 64, bs, torch.bfloat16, seed=3)
    perm = torch.randperm(NB, generator=g).tolist()
    shared, rest = perm[:40], perm[40:]  # 640 keys: segments 0 and 1 whole, 2 partly
    tables, lens = [], []
    for i, (share, n) in enumerate([(40, 700), (40, 640), (32, 600), (16, 530), (8, 300), (0, 470),
                                    (40, 513), (20, 777)]):
        own = rest[i * 30:(i + 1) * 30]
        tables.append(shared[:share] + own[: -(-n // bs) - share])
        lens.append(n)
    qs = torch.randn(len(lens), 9, 64, generator=g)
    out = _run(ops, k, v, qs, _decode_meta(tables, lens, bs))
    one = _run(ops, k, v, qs, _decode_meta(tables, lens, bs), threads=1)
    assert torch.equal(out, one)
    for i, (tab, n) in enumerate(zip(tables, lens)):
        alone = _run(ops, k, v, qs[i:i + 1].contiguous(), _decode_meta([tab], [n], bs))
        assert torch.equal(out[i], alone[0]), i
        q_all = torch.randn(n, 9, 64, generator=g)
        q_all[-1] = qs[i]
        assert torch.equal(_run(ops, k, v, q_all, _prefill_meta(tab, 0, n, bs))[-1], out[i]), i
    ref = _reference(qs[:1], k, v, tables[0], bs, [lens[0] - 1])
    assert (out[:1].double() - ref).abs().max().item() < 2e-5


@pytest.fixture(scope="module")
def plain_lib():
    """The portable level's build (``-march=x86-64-v2`` on x86-64): its portable paths as the
    default ones."""
    lib = fused.library("portable")
    if lib is None:
        pytest.skip("no C compiler: the portable level cannot be built")
    return lib


def test_a_build_without_avx512_gives_the_same_bits(plain_lib):
    """The portable level's build (``-march=x86-64-v2``) against this build, both on their default
    (non-portable) path: decodes (whose vector path reads K and V from the pool
    itself) and a prefill, in bf16 and fp32 pools. Guards the paths' split: a build without the
    vector path must still load each chunk for the scalar one."""
    for pool_dtype in (torch.bfloat16, torch.float32):
        ops, k, v, g = _setup(9, 3, 64, 16, pool_dtype, seed=3)
        plain_ops = fused.FusedOps(plain_lib, 1e-5, 9, 3, 64)
        tables = [torch.randperm(NB, generator=g)[:24].tolist() for _ in range(4)]
        ctxs = [1, 17, 256, 381]
        q = torch.randn(4, 9, 64, generator=g)
        meta = _decode_meta(tables, ctxs, 16)
        assert torch.equal(_run(plain_ops, k, v, q, meta), _run(ops, k, v, q, meta))
        qp = torch.randn(40, 9, 64, generator=g)
        meta = _prefill_meta(tables[0], 300, 40, 16)
        assert torch.equal(_run(plain_ops, k, v, qp, meta), _run(ops, k, v, qp, meta))


def test_a_build_without_avx512_selects_the_same_logits(plain_lib):
    """The logits' top-k and argmax (``select.c``) of the plain build against this build's vector
    paths, on rows with ties, NaN, infinities and lengths around the vector width."""
    ops = fused.FusedOps(fused.library(), 1e-5, 9, 3, 64)
    plain = fused.FusedOps(plain_lib, 1e-5, 9, 3, 64)
    g = torch.Generator().manual_seed(5)
    for n in (1, 15, 16, 17, 100, 4099):
        x = torch.randint(-4, 5, (6, n), generator=g).float()  # many equal values
        x[1] = torch.randn(n, generator=g)
        x[2, ::7] = float("nan")
        x[3, ::5] = float("inf")
        x[4, -1] = float("nan")
        assert ops.argmax(x) == plain.argmax(x) == x.argmax(dim=-1).tolist(), n
        k = min(32, n)
        assert torch.equal(ops.top_k(x, k), plain.top_k(x, k)), n


KEY_COUNTS = [1, 15, 16, 17, 255, 256, 257, 1000]  # around the chunk (16) and segment (256) grids


def _hostile_pool(nkv, hd, bs, pool_dtype, g):
    """K and V pools whose blocks mix ordinary, large and tiny (subnormal products) magnitudes;
    large keys only in the last KV head (they decide its softmax alone)."""
    def scaled(scales):
        pick = torch.tensor(scales)[torch.randint(0, len(scales), (NB, 1, nkv, 1), generator=g)]
        return (torch.randn(NB, bs, nkv, hd, generator=g) * pick).to(pool_dtype)
    k, v = scaled([1.0, 1.0, 1e-20]), scaled([1.0, 1.0, 30.0, 1e-20, 1e3])
    k[:, :, -1] = scaled([1.0, 30.0, 1e3, 1e-20])[:, :, -1]
    return k, v


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hd", [64, 128, 48, 80])  # the vector path's; 48, 80: its fallback
def test_the_avx2_level_gives_the_portable_bits(hd, pool_dtype):
    """The AVX2+FMA level's attention (two 8-key halves a chunk) against the portable level and
    its own portable path, bit for bit: GQA ratios 1, 3 and 4, key counts around the chunk and
    segment grids, 1 to 6 decodes at once (the decode path that reads K from the pool; those past
    the first segment share its blocks, attended together), prefill chunks of 9 to 40 rows, query rows
    of zeros, large and tiny values, and NaN/inf in the pool slots past every sequence's end."""
    avx2, portable = level_lib("avx2"), level_lib("portable")
    bs, nkv = 16, 2
    for ratio in (1, 3, 4):
        nh = nkv * ratio
        g = torch.Generator().manual_seed(hd * 10 + ratio)
        clean = _hostile_pool(nkv, hd, bs, pool_dtype, g)
        calls = [([KEY_COUNTS[(n + i) % 8] for i in range(n)], [1] * n) for n in range(1, 7)]
        calls.append(([9, 257, 256, 1000, 40], [9, 17, 40, 23, 31]))
        for keys, rows in calls:  # (key counts, rows per sequence: its last positions)
            k, v = (t.clone() for t in clean)
            perm = torch.randperm(NB, generator=g).tolist()
            shared, free = perm[:16], iter(perm[16:])  # 256 keys: a first segment to share
            tables = []
            for n in keys:
                share = n > 256
                own = [next(free) for _ in range(-(-n // bs) - 16 * share)]
                t = (shared if share else []) + own
                last, used = t[-1], n - (len(t) - 1) * bs  # poison the slots past the sequence
                k[last, used:], v[last, used:] = float("nan"), float("inf")
                tables.append(t)
            width = max(map(len, tables))
            tab = torch.tensor([t + [0] * (width - len(t)) for t in tables])
            seq = torch.cat([torch.full((r,), i) for i, r in enumerate(rows)])
            pos = torch.cat([torch.arange(n - r, n) for n, r in zip(keys, rows)])
            q = torch.randn(len(seq), nh, hd, generator=g)
            mix = (torch.arange(len(seq))[:, None] + torch.arange(nh)) % 6  # every row some 1s
            q *= torch.tensor([1.0, 30.0, 1.0, 1e-20, 1.0, 0.0])[mix][..., None]
            old = torch.get_num_threads()
            torch.set_num_threads(2)  # decodes split into segments, shared ones attended together
            try:
                outs = [fused.FusedOps(lib, 1e-5, nh, nkv, hd).attention(q, k, v, tab, seq, pos,
                                                                          hd ** -0.5, p)
                        for lib, p in ((avx2, False), (avx2, True), (portable, False))]
            finally:
                torch.set_num_threads(old)
            what = (hd, pool_dtype, ratio, keys, rows)
            assert torch.isfinite(outs[0]).all(), what
            for other in outs[1:]:
                assert torch.equal(outs[0].view(torch.int32), other.view(torch.int32)), what
