"""The KV pool's element type (``kv_cache_dtype``): int8 rows with a scale per token and KV head,
checked against a reference on hostile values; the C writer, gather and attention over int8 at every
level this CPU runs, against the portable level's bits and against fp32 attention; and the engine's
exactness (cold == warm == batched == chunked, bit for bit) in every KV type, its namespace, its
tier layout and its sizing."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from hotprefix import LLM, SamplingParams
from hotprefix.config.sections import ConfigError
from hotprefix.model import fused
from hotprefix.model.attention import AttentionMetadata, GatherScratch, PrefillSeq, paged_attention
from hotprefix.model.kv_dtype import (INT8_SCALE_BYTES, KV_DTYPES, dequantize_int8, quantize_int8,
                                      resolve_kv_dtype)
from isa_support import level_lib

NAN, INF = float("nan"), float("inf")


def _reference_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row by row in numpy float32: scale = absmax / 127, q = clip(rint(x / scale)); zeros (or a
    scale of 0) -> zeros and scale 0; any NaN/inf -> zeros and a NaN scale."""
    x = x.astype(np.float32).reshape(-1, x.shape[-1])
    qs, ss = [], []
    for row in x:
        if not np.isfinite(row).all():
            qs.append(np.zeros(row.shape, np.int8)), ss.append(np.float32(np.nan))
            continue
        s = np.float32(np.abs(row).max()) / np.float32(127)
        if s == 0:
            qs.append(np.zeros(row.shape, np.int8)), ss.append(np.float32(0))
            continue
        qs.append(np.clip(np.rint(row / s), -127, 127).astype(np.int8)), ss.append(s)
    return np.stack(qs), np.array(ss, np.float32)


def _hostile_rows(g: torch.Generator, n: int = 40, hd: int = 64) -> torch.Tensor:
    x = torch.randn(n, hd, generator=g)
    x[0] = 0.0  # all zeros
    x[1] *= 3e37  # huge: the scale's own range
    x[2, 5] = 1e4  # one outlier in one row (head): the others of that row round to 0
    x[3] *= 1e-42  # subnormal values: a subnormal scale
    x[4] = 1e-45  # the scale underflows to 0: stored as zeros
    x[5, 0] = 127.5  # halfway cases: x / scale lands on .5
    x[5, 1:] = torch.arange(1, hd) + 0.5
    x[6] = -x[6].abs()  # all negative
    x[7] = 3.0  # constant
    return x


def test_int8_rows_match_the_reference_on_hostile_values():
    g = torch.Generator().manual_seed(0)
    x = _hostile_rows(g)
    rows = quantize_int8(x)
    assert rows.dtype == torch.int8 and rows.shape == (40, 64 + INT8_SCALE_BYTES)
    q_ref, s_ref = _reference_int8(x.numpy())
    assert np.array_equal(rows[:, :64].numpy(), q_ref)
    assert np.array_equal(rows[:, 64:].contiguous().view(torch.float32).numpy()[:, 0], s_ref)
    assert (rows[:, :64] != -128).all()
    back = dequantize_int8(rows)
    scale = torch.from_numpy(s_ref)[:, None]
    normal = torch.ones(40, dtype=torch.bool)
    normal[[3, 4]] = False  # subnormal scales round coarsely; one that underflows gives zeros
    err = (back - x).abs()
    assert (err[normal] <= scale[normal] / 2 * (1 + 1e-6)).all()  # within half a step, per row
    assert (err[3] <= x[3].abs().max() / 100).all()
    assert torch.equal(back[0], torch.zeros(64)) and torch.equal(back[4], torch.zeros(64))
    assert back[2, 5] == pytest.approx(1e4, rel=1e-6) and (back[2, torch.arange(64) != 5] == 0).all()
    assert torch.isfinite(back).all() and back[1].abs().max() > 1e37


def test_int8_rows_depend_on_their_own_values_alone():
    """A (token, head) row's bytes are the same quantized alone or among others, in any order,
    whatever the other heads of its token hold (an outlier in head 0 leaves head 1 alone)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 3, 64, generator=g)
    x[2, 0, 9] = 5e3
    together = quantize_int8(x)
    for t in range(7):
        for h in range(3):
            assert torch.equal(quantize_int8(x[t, h]), together[t, h])
    assert torch.equal(quantize_int8(x.flip(0)), together.flip(0))
    assert torch.equal(together[2, 1], quantize_int8(x[2, 1]))
    assert dequantize_int8(together[2, 1]).abs().max() < 10


def test_non_finite_rows_are_refused_cleanly():
    x = torch.randn(4, 16)
    x[1, 3], x[2, 0], x[3, 7] = NAN, INF, -INF
    with pytest.raises(ValueError, match="NaN or infinite"):
        quantize_int8(x, check_finite=True)
    rows = quantize_int8(x)  # the write path: the row reads back as NaN, others untouched
    back = dequantize_int8(rows)
    assert torch.isnan(back[1:]).all() and (rows[1:, :16] == 0).all()
    assert torch.equal(rows[0], quantize_int8(x[0]))


def test_kv_dtype_names_sizes_and_refusals():
    cpu = torch.device("cpu")
    assert resolve_kv_dtype("auto", torch.float32, cpu, explicit_dtype=False).name == "bf16"
    assert resolve_kv_dtype("auto", torch.float32, cpu, explicit_dtype=True).name == "fp32"
    assert resolve_kv_dtype("auto", torch.bfloat16, cpu, explicit_dtype=False).name == "bf16"
    assert resolve_kv_dtype("bfloat16", torch.float32, cpu, False).name == "bf16"
    with pytest.raises(ConfigError, match="fp8 K/V are not supported on CPU.*int8"):
        resolve_kv_dtype("fp8", torch.float32, cpu, False)
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        LLM(kv_cache_dtype="int4")
    # SmolLM2-135M's shape: 30 layers, 3 KV heads of 64
    assert KV_DTYPES["bf16"].bytes_per_token(30, 3, 64) == 23040  # llama.cpp's f16 figure
    assert KV_DTYPES["int8"].bytes_per_token(30, 3, 64) == 12240  # llama.cpp's q8_0 figure
    assert KV_DTYPES["fp32"].bytes_per_token(30, 3, 64) == 46080
    from hotprefix.model.metadata import KV_ELEMENT_BYTES

    assert set(KV_ELEMENT_BYTES) == set(KV_DTYPES)


@pytest.mark.parametrize("name", sorted(KV_DTYPES))
@pytest.mark.parametrize("layers,heads,head_dim", [(30, 3, 64), (2, 1, 8), (26, 1, 256)])
def test_bytes_per_token_is_what_a_tokens_rows_occupy(name, layers, heads, head_dim):
    """The one KV-size formula (``KVShape.bytes_per_token``, which the pool and the simulator
    call) against the bytes of one token's rows as the pool stores them: a K and a V row of
    ``row(head_dim)`` elements per layer and KV head, int8's scale included."""
    from hotprefix.model.metadata import KVShape

    kv = KV_DTYPES[name]
    one_row = torch.empty(kv.row(head_dim), dtype=kv.torch_dtype)
    expected = 2 * layers * heads * one_row.numel() * one_row.element_size()
    assert KVShape(layers, heads, head_dim).bytes_per_token(name) == expected
    assert kv.bytes_per_token(layers, heads, head_dim) == expected
    if name != "int8":  # bytes per element: the simulator's --dtype-bytes
        assert KVShape(layers, heads, head_dim).bytes_per_token(one_row.element_size()) == expected


# ---------------------------------------------------------------- the C kernels over int8 pools

needs_cc = pytest.mark.skipif(fused.library() is None, reason="no C compiler")
LEVELS = ["portable", "avx2", "avxvnni", "avx512", "amx"]


@needs_cc
@pytest.mark.parametrize("level", LEVELS)
def test_c_writer_and_gather_give_the_reference_rows(level):
    """``rope_write_kv`` into an int8 pool (RoPE with cos 1, sin 0: K as given) writes the
    reference's bytes, and ``gather_widen_kv`` reads them back as ``float(q) * scale``."""
    lib = level_lib(level)
    nh, nkv, hd, bs, blocks = 2, 2, 64, 8, 6
    ops = fused.FusedOps(lib, 1e-5, nh, nkv, hd)
    g = torch.Generator().manual_seed(3)
    n = 20
    kv = _hostile_rows(g, n * 2 * nkv, hd).view(n, 2 * nkv * hd)
    kv[9, :hd] = NAN  # a non-finite K row and V row
    kv[11, -1] = INF
    qkv = torch.cat([torch.randn(n, nh * hd, generator=g), kv], 1).contiguous()
    cos, sin = torch.ones(4, hd), torch.zeros(4, hd)
    pos = torch.zeros(n, dtype=torch.long)
    slots = torch.randperm(blocks * bs, generator=g)[:n]
    kc, vc = (torch.full((blocks, bs, nkv, hd + 4), 7, dtype=torch.int8) for _ in range(2))
    ops.rope_write_kv(qkv, cos, sin, pos, kc, vc, slots)
    k_in = kv[:, : nkv * hd].reshape(n, nkv, hd)
    v_in = kv[:, nkv * hd:].reshape(n, nkv, hd)
    for cache, x in ((kc, k_in), (vc, v_in)):
        got = cache.view(-1, nkv, hd + 4)[slots]
        q_ref, s_ref = _reference_int8(x.numpy())
        assert np.array_equal(got[..., :hd].reshape(-1, hd).numpy(), q_ref)
        s = got[..., hd:].contiguous().view(torch.float32).reshape(-1).numpy()
        assert np.array_equal(s, s_ref, equal_nan=True)
    idx = torch.tensor([0, 3, 5, -1, 2])
    outs = [torch.zeros(len(idx), bs * nkv * hd) for _ in range(2)]
    ops.gather_widen_kv(kc, vc, idx, *outs)
    for cache, out in zip((kc, vc), outs):
        want = dequantize_int8(cache[idx.clamp(min=0)]).reshape(len(idx), -1)
        keep = idx >= 0
        assert torch.equal(out[keep].view(torch.int32), want[keep].view(torch.int32))
        assert (out[~keep] == 0).all()  # a PAD_BLOCK entry is skipped


def _int8_pool(nb, bs, nkv, hd, g):
    k = torch.randn(nb, bs, nkv, hd, generator=g)
    v = torch.randn(nb, bs, nkv, hd, generator=g)
    k[..., -1, :] *= 20  # one KV head with larger keys
    v[:, ::3, 0, 5] = 300.0  # an outlier in one head of some tokens
    k[:, 1::5] = 0.0  # tokens of zeros
    return (k, v), (quantize_int8(k), quantize_int8(v))


@needs_cc
@pytest.mark.parametrize("hd", [64, 128, 48])  # the vector paths' head sizes; 48: their fallback
def test_c_attention_over_int8_gives_the_portable_bits_at_every_level(hd):
    """Every level this CPU runs (default and portable paths) gives the portable level's bits over
    an int8 pool: decodes (the path reading K and V from the pool), shared-prefix decodes split in
    segments, and prefill chunks; the result is fp32 attention over the dequantized K/V (float64
    reference), and near attention over the unquantized values."""
    from hotprefix.model.isa import runnable_levels

    nb, bs, nkv, nh = 120, 16, 2, 6
    g = torch.Generator().manual_seed(hd)
    (k32, v32), (kq, vq) = _int8_pool(nb, bs, nkv, hd, g)
    perm = torch.randperm(nb, generator=g).tolist()
    shared, free = perm[:16], iter(perm[16:])
    keys = [1, 17, 256, 300, 513, 40]
    rows = [1, 1, 1, 1, 1, 23]
    tables = []
    for n in keys:
        share = n > 256
        tables.append((shared if share else []) + [next(free) for _ in range(-(-n // bs) - 16 * share)])
    width = max(map(len, tables))
    tab = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    seq = torch.cat([torch.full((r,), i) for i, r in enumerate(rows)])
    pos = torch.cat([torch.arange(n - r, n) for n, r in zip(keys, rows)])
    q = torch.randn(len(seq), nh, hd, generator=g)
    levels = [lv.name for lv in runnable_levels()]
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        outs = {(lv, p): fused.FusedOps(level_lib(lv), 1e-5, nh, nkv, hd).attention(
                    q, kq, vq, tab, seq, pos, hd ** -0.5, p)
                for lv in levels for p in (False, True)}
        deq = [dequantize_int8(t) for t in (kq, vq)]
        plain = fused.FusedOps(level_lib("portable"), 1e-5, nh, nkv, hd)
        fp32_same = plain.attention(q, *deq, tab, seq, pos, hd ** -0.5, True)
    finally:
        torch.set_num_threads(old)
    ref = outs[("portable", True)]
    for key, out in outs.items():
        assert torch.equal(out.view(torch.int32), ref.view(torch.int32)), (hd, key)
    assert torch.equal(fp32_same.view(torch.int32), ref.view(torch.int32))  # same as an fp32 pool
    exact = _float64_attention(q, *deq, tab, seq, pos)
    assert (ref.double() - exact).abs().max() < 1e-6 * exact.abs().max()  # V holds 300s
    unquantized = _float64_attention(q, k32, v32, tab, seq, pos)
    assert (ref.double() - unquantized).abs().max() < 0.1 * unquantized.abs().max()


def _float64_attention(q, k, v, tab, seq, pos):
    nh, nkv, hd = q.shape[1], k.shape[2], q.shape[2]
    bs = k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(q.shape[0]):
        t = torch.arange(pos[i] + 1)
        slots = tab[seq[i]][t // bs] * bs + t % bs
        kk = k.reshape(-1, nkv, hd)[slots].double()
        vv = v.reshape(-1, nkv, hd)[slots].double()
        for h in range(nh):
            s = kk[:, h // (nh // nkv)] @ q[i, h].double() * hd ** -0.5
            out[i, h] = torch.softmax(s, 0) @ vv[:, h // (nh // nkv)]
    return out


def test_torch_attention_dequantizes_an_int8_pool_exactly():
    """The torch attention (the fallback without the C kernels) over an int8 pool gives the bits
    of the same attention over an fp32 pool holding the dequantized values."""
    nb, bs, nkv, nh, hd = 40, 16, 2, 4, 32
    g = torch.Generator().manual_seed(7)
    _, (kq, vq) = _int8_pool(nb, bs, nkv, hd, g)
    k32, v32 = dequantize_int8(kq), dequantize_int8(vq)
    table = torch.randperm(nb, generator=g)[:20]
    n = 300
    meta = AttentionMetadata(slot_mapping=torch.zeros(n, dtype=torch.long),
                             prefills=[PrefillSeq(0, n, n, table[: -(-n // bs)])])
    q = torch.randn(n, nh, hd, generator=g)
    a = paged_attention(q, kq, vq, meta, hd ** -0.5, GatherScratch())
    b = paged_attention(q, k32, v32, meta, hd ** -0.5, GatherScratch())
    assert torch.equal(a, b)


# ---------------------------------------------------------------- the engine, in every KV type

KV_KINDS = ["bf16", "fp32", "int8", "fp16"]


def _logits_of(llm, ids, others=()):
    """Logits of the last prompt token of ``ids``, with ``others`` in the same step."""
    eng = llm.engine
    reqs = [eng.add_request(list(o), SamplingParams(max_tokens=1)) for o in others]
    req = eng.add_request(list(ids), SamplingParams(max_tokens=1))
    out = None
    while out is None:
        sched = eng.scheduler.schedule()
        tables = {c.request.request_id: eng.cache.block_table(c.request.request_id)
                  for c in sched.chunks}
        logits, owners = eng.runner.forward_logits(sched.chunks, tables)
        mine = [o.request for o in owners]
        if req in mine:
            out = logits[mine.index(req)].clone()
        eng.scheduler.update(sched, {})
    for r in reqs + [req]:
        eng.abort(r.request_id)
    return out


@pytest.mark.parametrize("kv,fused_kernels", [
    ("bf16", True), ("fp32", True), ("int8", True),  # the C writer and attention
    ("fp16", True),  # no C path reads fp16: torch's attention, the fused kernels' elementwise work
    ("int8", False), ("bf16", False),  # the torch writer (kv_dtype.to_pool) and attention
])
def test_cold_warm_batched_and_chunked_are_bit_identical(tiny_model_dir, kv, fused_kernels):
    llm = LLM(tiny_model_dir, num_blocks=96, block_size=16, kv_cache_dtype=kv,
              fused_kernels=fused_kernels, max_num_batched_tokens=512)
    runner = llm.engine.runner
    assert runner.kv_dtype.name == kv
    assert runner.kv_caches[0][0].dtype == KV_DTYPES[kv].torch_dtype
    ids = [(7 * i + 3) % 1000 + 10 for i in range(120)]
    cold = _logits_of(llm, ids)
    llm.generate([ids[:70] + [5] * 9], SamplingParams(max_tokens=1))  # a sibling caches 64 tokens
    warm = _logits_of(llm, ids)
    assert torch.equal(warm, cold)
    llm.reset_prefix_cache()
    others = [[11 + j for j in range(n)] for n in (37, 90)]
    assert torch.equal(_logits_of(llm, ids, others), cold)
    # the same engine with a step budget of 40 tokens: the prompt prefilled in 3 chunks
    sched = llm.engine.scheduler
    whole = sched.config
    sched.config = dataclasses.replace(whole, max_num_batched_tokens=40)
    llm.reset_prefix_cache()
    assert torch.equal(_logits_of(llm, ids), cold)
    sched.config = whole
    # greedy tokens: decode-written K/V read back by the next turn == recomputed
    out = llm.generate([ids], SamplingParams(max_tokens=14, ignore_eos=True))[0]
    turn2 = ids + out.token_ids + [42, 43]
    warm2 = llm.generate([turn2], SamplingParams(max_tokens=4))[0]
    assert warm2.num_cached_tokens > len(ids)
    llm.reset_prefix_cache()
    assert llm.generate([turn2], SamplingParams(max_tokens=4))[0].token_ids == warm2.token_ids
    assert llm.engine.cache.pool.num_in_use == 0


def test_namespace_layout_and_pool_bytes_follow_the_kv_dtype(tiny_model_dir):
    llms = {kv: LLM(tiny_model_dir, kv_cache_memory="4MiB", kv_cache_dtype=kv)
            for kv in ("bf16", "int8", "fp32")}
    spaces = {llms[k].engine.namespace for k in ("bf16", "int8", "fp32")}
    assert len(spaces) == 3
    assert "/kv-int8" in llms["int8"].engine.runner.numerics
    from hotprefix.engine.kv_io import KVBlockIO

    layouts = {k: KVBlockIO(llms[k].engine.runner.kv_caches).layout for k in ("bf16", "int8", "fp32")}
    assert len(set(layouts.values())) == 3 and "/int8-s4/" in layouts["int8"]
    assert "/D16/" in layouts["int8"]  # the head dim, not the row's bytes
    for kv, llm in llms.items():
        r = llm.engine.runner
        pool = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in r.kv_caches)
        assert pool == r.num_blocks * r.block_size * r.bytes_per_token  # every byte counted
        assert 4 * 2**20 - r.block_size * r.bytes_per_token < pool <= 4 * 2**20
    b16, b8 = (llms[k].engine.runner.bytes_per_token for k in ("bf16", "int8"))
    assert b8 == b16 // 2 + 2 * 2 * 2 * INT8_SCALE_BYTES  # 2 layers x K/V x 2 heads x the scale
    # 16-value heads here: (16 + 4) bytes a row against 32
    assert llms["int8"].engine.runner.capacity_tokens > 1.55 * llms["bf16"].engine.runner.capacity_tokens
    stats = llms["int8"].cache_stats()
    assert stats["bytes_per_token"] == b8 and stats["kv_cache_dtype"] == "int8"


def test_a_tier_entry_of_another_kv_dtype_is_never_loaded(tiny_model_dir, tmp_path):
    store = [f"disk:{tmp_path / 'kv'}"]
    ids = [(5 * i + 1) % 900 + 20 for i in range(70)]
    greedy = SamplingParams(max_tokens=4)
    with_int8 = LLM(tiny_model_dir, num_blocks=64, kv_cache_dtype="int8", kv_store=store)
    first = with_int8.generate([ids], greedy)[0]
    with_int8.engine.cache.tiers.tiers.flush()
    bf16 = LLM(tiny_model_dir, num_blocks=64, kv_cache_dtype="bf16", kv_store=store)
    o = bf16.generate([ids], greedy)[0]
    assert o.num_cached_tokens == 0
    with_int8.reset_prefix_cache()  # its own entries are still read back
    o2 = with_int8.generate([ids], greedy)[0]
    assert o2.num_cached_tokens == 64 and o2.token_ids == first.token_ids


def test_simulator_sizing_takes_the_kv_dtype(tmp_path, capsys):
    """``hotprefix simulate --sweep``'s advice in bytes follows ``--kv-cache-dtype`` (the default
    model's metadata: 23,040 bytes a token in bf16, 12,240 in int8)."""
    import json

    from hotprefix import simulate as sim
    from hotprefix.model.metadata import kv_bytes_per_token
    from test_simulate import _write_mooncake

    # the default model is a dependency (make setup installs it): missing, it is a failure
    assert kv_bytes_per_token(None, "int8") == 12240
    p = tmp_path / "mc.jsonl"
    _write_mooncake(p)
    per = {}
    for kv in ("bf16", "int8"):
        d = tmp_path / kv
        assert sim.main([str(p), "--sweep", "--out", str(d), "--block-size", "512", "--points", "3",
                         "--policy", "lru", "--kv-cache-dtype", kv]) == 0
        res = json.loads((d / "mrc.json").read_text())
        a = res["advice"]["lru"]
        per[kv] = res["bytes_per_token"]
        assert a["kv_cache_memory_bytes"] == a["capacity_tokens"] * per[kv]
    assert per == {"bf16": 23040, "int8": 12240}
    capsys.readouterr()
