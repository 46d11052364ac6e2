"""The fused C kernels (``hotprefix.model.fused``): the same bits as the torch ops where they
promise it (RoPE, roundings, K/V write, widening), close to them where they do not (RMSNorm, SiLU),
every row's bits independent of the rows beside it and of the thread count, and a clean fallback
to torch ops where no compiler works."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from hotprefix.model import fused
from hotprefix.model.attention import AttentionMetadata, GatherScratch, write_kv
from hotprefix.model.llama import RotaryEmbedding, _apply_rope

NH, NKV, HD, DIM, INTER = 9, 3, 64, 576, 1536


@pytest.fixture(scope="module")
def ops():
    f = fused.fused_ops(True, torch.device("cpu"), torch.bfloat16, 1e-5, NH, NKV, HD)
    if f is None:
        pytest.skip("no C compiler on this machine: the torch path runs (tested elsewhere)")
    return f


def _rows(n: int, width: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed)) * 3


def _rowwise_invariant(fn, x: torch.Tensor) -> None:
    """fn on all rows at once (threaded), on each row alone, and on one thread: the same bits."""
    whole = fn(x.clone())
    for r in (0, 1, x.shape[0] // 2, x.shape[0] - 1):
        assert torch.equal(fn(x[r:r + 1].clone())[0], whole[r]), r
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(fn(x.clone()), whole)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32])
def test_rope_and_kv_write_give_the_torch_paths_bits(ops, pool_dtype):
    n, blocks, bs = 40, 8, 16
    qkv = _rows(n, (NH + 2 * NKV) * HD)
    rope = RotaryEmbedding(HD, 10000.0, 4096, torch.device("cpu"), torch.float32)
    pos = torch.randint(0, 4096, (n,), generator=torch.Generator().manual_seed(1))
    slots = torch.randperm(blocks * bs, generator=torch.Generator().manual_seed(2))[: n - 4]
    slots[3] = -1  # a padding row is not written; the last 4 rows have no slot at all
    caches = [torch.full((blocks, bs, NKV, HD), 7.0, dtype=pool_dtype) for _ in range(4)]

    q = ops.rope_write_kv(qkv, rope.cos, rope.sin, pos, caches[0], caches[1], slots)

    cos, sin = rope.tables(pos)
    qk = _apply_rope(qkv[:, : (NH + NKV) * HD].view(n, NH + NKV, HD), cos, sin)
    v = qkv[:, (NH + NKV) * HD:].view(n, NKV, HD)
    write_kv(caches[2], caches[3], qk[:, NH:].to(pool_dtype), v.to(pool_dtype),
             AttentionMetadata(slot_mapping=slots, has_padding=True))
    assert torch.equal(q, qk[:, :NH])
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    untouched = torch.ones(blocks * bs, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert (caches[0].view(-1, NKV, HD)[untouched] == 7).all()


def test_add_rms_norm_adds_exactly_and_normalizes_row_invariantly(ops):
    h, d, w = _rows(300, DIM), _rows(300, DIM, 1), _rows(1, DIM, 2)[0]
    ref = F.rms_norm((h + d).double(), (DIM,), w.double(), 1e-5)
    h2 = h.clone()
    out = ops.add_rms_norm(h2, d, w)
    assert torch.equal(h2, h + d)  # the residual add: one IEEE add, the same bits as torch's
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-6)
    assert torch.allclose(ops.add_rms_norm(h.clone(), None, w).double(),
                          F.rms_norm(h.double(), (DIM,), w.double(), 1e-5), rtol=1e-5, atol=1e-6)
    _rowwise_invariant(lambda x: ops.add_rms_norm(x, None, w), h)


def test_silu_mul_is_close_to_torch_and_row_invariant(ops):
    gu = _rows(100, 2 * INTER) * 4  # gates from about -40 to 40: both tails of the exp
    gu[0, :8] = torch.tensor([-200.0, -88.0, -87.0, 0.0, -0.0, 87.0, 89.0, 200.0])
    ref = (F.silu(gu[:, :INTER].double()) * gu[:, INTER:].double())
    out = ops.silu_mul(gu)
    assert out.shape == (100, INTER)
    assert torch.allclose(out.double(), ref, rtol=1e-6, atol=1e-30)
    _rowwise_invariant(ops.silu_mul, gu)


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32])
def test_gather_widen_equals_index_select_then_float(ops, pool_dtype):
    pools = [_rows(64, 16 * NKV * HD, s).to(pool_dtype).view(64, 16, NKV, HD) for s in (0, 1)]
    table = torch.tensor([[5, 0, 63, 5], [1, 2, 3, 4]])
    fast = GatherScratch(ops.gather_widen_kv).gather_kv(*pools, table, torch.float32)
    for got, pool in zip(fast, pools):
        ref = pool[table.reshape(-1)].float().view(2, -1, NKV, HD).transpose(1, 2)
        assert torch.equal(got, ref)
    plain = GatherScratch().gather_kv(*pools, table, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(fast, plain))


@pytest.mark.parametrize("nkv", [1, 5])
def test_large_gather_splits_over_threads_with_any_head_count(ops, nkv):
    """Above the threshold the gather splits KV heads over threads (5 heads on 4 threads leaves
    one thread nothing to do); the result is index_select's, widened."""
    pools = [_rows(400, 16 * nkv * HD, s).to(torch.bfloat16).view(400, 16, nkv, HD) for s in (2, 3)]
    table = torch.randperm(400, generator=torch.Generator().manual_seed(4)).view(1, 400)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        got = GatherScratch(ops.gather_widen_kv).gather_kv(*pools, table, torch.float32)
    finally:
        torch.set_num_threads(threads)
    for g, pool in zip(got, pools):
        assert torch.equal(g, pool[table[0]].float().view(1, -1, nkv, HD).transpose(1, 2))


def test_off_or_without_a_compiler_the_torch_path_runs(monkeypatch, tmp_path, caplog):
    cpu = torch.device("cpu")
    assert fused.fused_ops(False, cpu, torch.bfloat16, 1e-5, NH, NKV, HD) is None
    assert fused.fused_ops(True, cpu, torch.float16, 1e-5, NH, NKV, HD) is None  # pool it cannot write
    monkeypatch.setenv("HOTPREFIX_CACHE_DIR", str(tmp_path))
    for cc in (str(tmp_path / "no-such-compiler"), "false"):
        monkeypatch.setenv("CC", cc)
        fused.library.cache_clear()
        try:
            with caplog.at_level(logging.WARNING, logger="hotprefix.model.fused"):
                assert fused.fused_ops(True, cpu, torch.bfloat16, 1e-5, NH, NKV, HD) is None
            assert "torch ops" in caplog.text
        finally:
            fused.library.cache_clear()
    assert not list(tmp_path.rglob("*.so"))  # a failed build leaves nothing behind


def test_builds_into_the_cache_dir_once(monkeypatch, tmp_path):
    monkeypatch.setenv("HOTPREFIX_CACHE_DIR", str(tmp_path))
    fused.library.cache_clear()
    try:
        if fused.library() is None:
            pytest.skip("no C compiler on this machine")
        built = list(tmp_path.rglob("*.so"))
        assert len(built) == 1
        stamp = built[0].stat().st_mtime_ns
        fused.library.cache_clear()
        assert fused.library() is not None
        assert [p.stat().st_mtime_ns for p in tmp_path.rglob("*.so")] == [stamp]  # reused, not rebuilt
    finally:
        fused.library.cache_clear()


def test_decode_attention_skips_padding_blocks_with_the_same_bits(ops):
    """Padding entries of a decode block table (``PAD_BLOCK``, keys masked) are not gathered by the
    fused kernel: whatever finite K/V an earlier gather left there, the output is the torch path's."""
    from hotprefix.model.attention import PAD_BLOCK, paged_attention, padded_len

    g = torch.Generator().manual_seed(5)
    k_cache, v_cache = (torch.randn(300, 16, NKV, HD, generator=g).to(torch.bfloat16) for _ in range(2))
    ctxs = [37, 600, 5]  # one step of three decodes, in two attention calls (by key count)
    keys = padded_len(max(ctxs))
    tables = [torch.randperm(300, generator=g)[: -(-c // 16)].tolist() for c in ctxs]
    table = torch.tensor([t + [PAD_BLOCK] * (keys // 16 - len(t)) for t in tables])
    meta = AttentionMetadata(slot_mapping=torch.tensor([0, 1, 2]), num_decode=3,
                             decode_block_tables=table, decode_context_lens=ctxs)
    q = torch.randn(3, NH, HD, generator=g)
    plain = paged_attention(q, k_cache, v_cache, meta, HD ** -0.5, GatherScratch())
    scratch = GatherScratch(ops.gather_widen_kv)
    full = torch.randint(0, 300, table.shape, generator=g)  # fills every row of the buffers
    scratch.gather_kv(k_cache * 50, v_cache * -50, full, torch.float32)
    assert torch.equal(paged_attention(q, k_cache, v_cache, meta, HD ** -0.5, scratch), plain)
    assert torch.equal(paged_attention(q, k_cache, v_cache, meta, HD ** -0.5, GatherScratch(ops.gather_widen_kv)), plain)


def test_a_max_model_len_past_the_models_positions_is_refused(tiny_model_dir):
    """The fused RoPE reads its tables unchecked: a context longer than the model's RoPE table is
    refused when the engine starts, not met as an out-of-range read."""
    from hotprefix import LLM
    from hotprefix.config.sections import ConfigError

    with pytest.raises(ConfigError, match="max_model_len 4096 exceeds the model's 2048"):
        LLM(tiny_model_dir, num_blocks=16, max_model_len=4096)


def test_rope_kernel_refuses_positions_outside_its_tables(ops):
    rope = RotaryEmbedding(HD, 10000.0, 64, torch.device("cpu"), torch.float32)
    cache = torch.zeros(2, 16, NKV, HD, dtype=torch.bfloat16)
    qkv = _rows(3, (NH + 2 * NKV) * HD)
    with pytest.raises(IndexError, match="1 positions outside the model's 64"):
        ops.rope_write_kv(qkv, rope.cos, rope.sin, torch.tensor([3, 64, 5]), cache, cache.clone(),
                          torch.tensor([0, 1, 2]))
    assert not cache.view(-1, NKV, HD)[1].any()  # the out-of-range row wrote nothing


def _ranked(row: list[float]) -> list[int]:
    """Indices of a row, best first: a NaN above every number, then larger values, ties to the
    lower index (``select.c``'s ranking)."""
    return sorted(range(len(row)), key=lambda i: (row[i] == row[i], -row[i] if row[i] == row[i] else 0, i))


def test_top_k_and_argmax_rank_like_torch_on_hostile_rows(ops):
    """The logits' selections against a ranking in Python and torch.argmax: equal values, NaN,
    infinities, signed zeros, rows shorter than a vector and k = n; each row's answer is the same
    alone and batched (the refine and greedy sampling take them)."""
    g = torch.Generator().manual_seed(11)
    for trial in range(120):
        rows, n = 1 + trial % 7, [1, 5, 16, 31, 33, 64, 250, 1000][trial % 8]
        x = (torch.randint(-3, 4, (rows, n), generator=g).float() if trial % 2
             else torch.randn(rows, n, generator=g))
        if trial % 3 == 0:
            x[torch.rand(rows, n, generator=g) < 0.05] = float("nan")
        if trial % 5 == 0:
            x[torch.rand(rows, n, generator=g) < 0.1] = float("inf")
        if trial % 4 == 0:
            x[torch.rand(rows, n, generator=g) < 0.3] = -0.0
        assert ops.argmax(x) == x.argmax(dim=-1).tolist(), trial
        k = min(32, n)
        top = ops.top_k(x, k)
        for r in range(rows):
            assert top[r].tolist() == _ranked(x[r].tolist())[:k], (trial, r)
            assert torch.equal(ops.top_k(x[r:r + 1].clone(), k)[0], top[r])
        if not torch.isnan(x).any():  # torch's topk picks the same values
            assert torch.equal(torch.gather(x, 1, top), x.topk(k, dim=-1).values)
    with pytest.raises(ValueError, match="top-k"):
        ops.top_k(torch.zeros(2, 10), 11)
