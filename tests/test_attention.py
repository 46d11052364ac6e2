"""Batch-invariant paged attention: a query's output has the same bits however its sequence was
chunked, whatever else shares the call, decode or prefill, in every dtype we serve."""

from __future__ import annotations

import pytest
import torch

from hotprefix.model.attention import (KV_TILE, PAD_BLOCK, AttentionMetadata, GatherScratch, PrefillSeq,
                                       paged_attention, padded_len)

BS, NKV, HD, H = 16, 3, 64, 9


def _pool(dtype, nblocks=400, seed=0):  # the pool's dtype; queries may be wider
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(nblocks, BS, NKV, HD, generator=g).to(dtype)
    v = torch.randn(nblocks, BS, NKV, HD, generator=g).to(dtype)
    return k, v


def _prefill(q_all, k, v, table, start, n, scratch=None):
    """Attend the chunk [start, start + n) of one sequence (its queries are rows of q_all)."""
    nb = -(-(start + n) // BS)
    meta = AttentionMetadata(slot_mapping=torch.zeros(n, dtype=torch.long),
                             prefills=[PrefillSeq(0, n, start + n, torch.tensor(table[:nb]))])
    return paged_attention(q_all[start:start + n], k, v, meta, HD ** -0.5, scratch)


def _decode(qs, k, v, tables, ctxs, scratch=None):
    nd = len(qs)
    nb = padded_len(max(ctxs)) // BS
    table = torch.tensor([t[:nb] + [PAD_BLOCK] * (nb - min(len(t), nb)) for t in tables])
    meta = AttentionMetadata(slot_mapping=torch.zeros(nd, dtype=torch.long), num_decode=nd,
                             decode_block_tables=table, decode_context_lens=list(ctxs))
    return paged_attention(torch.stack(qs), k, v, meta, HD ** -0.5, scratch)


@pytest.mark.parametrize("pool_dtype,dtype", [(torch.float32, torch.float32),
                                              (torch.bfloat16, torch.bfloat16),
                                              (torch.bfloat16, torch.float32)])  # a CPU bf16 engine
def test_query_output_independent_of_chunking_batch_and_phase(pool_dtype, dtype):
    k, v = _pool(pool_dtype)
    g = torch.Generator().manual_seed(1)
    seq_len = 1300  # spans three key tiles
    table = torch.randperm(400, generator=g)[: -(-seq_len // BS)].tolist()
    q_all = torch.randn(seq_len, H, HD, generator=g).to(dtype)
    probe = [0, 5, 15, 16, 511, 512, 700, 1023, 1024, 1299]
    ref = _prefill(q_all, k, v, table, 0, seq_len)  # the whole sequence in one chunk
    for start, n in [(0, 1), (0, 17), (500, 300), (1000, 299), (1299, 1), (2, 1298), (512, 512)]:
        out = _prefill(q_all, k, v, table, start, n)
        for p in probe:
            if start <= p < start + n:
                assert torch.equal(out[p - start], ref[p]), (start, n, p)
    # the same query as a decode token, alone and batched with longer and shorter sequences
    others = [torch.randperm(400, generator=g)[:150].tolist() for _ in range(3)]
    for p in probe:
        alone = _decode([q_all[p]], k, v, [table], [p + 1])
        assert torch.equal(alone[0], ref[p]), p
        batch = _decode([q_all[7], q_all[p], q_all[9]], k, v, [others[0], table, others[1]],
                        [2400, p + 1, 40])
        assert torch.equal(batch[1], ref[p]), p


def test_padding_never_leaks_into_a_row():
    """Keys beyond a query's position (other tokens or padding blocks) do not change it at all,
    and changing one visible key does."""
    k, v = _pool(torch.float32)
    g = torch.Generator().manual_seed(2)
    table = list(range(10, 10 + padded_len(300) // BS))
    q = torch.randn(300, H, HD, generator=g)
    a = _prefill(q, k, v, table, 0, 300)
    k2 = k.clone()
    k2[table[-1]] += 100.0  # keys of positions 496..511: beyond every query here
    assert torch.equal(_prefill(q, k2, v, table, 0, 300), a)
    k2[table[0], 0] += 1.0  # key of position 0: seen by every query
    assert not torch.equal(_prefill(q, k2, v, table, 0, 300)[299], a[299])


def test_matches_reference_softmax_attention():
    k, v = _pool(torch.float32)
    g = torch.Generator().manual_seed(3)
    n = 600
    table = torch.randperm(400, generator=g)[: padded_len(n) // BS].tolist()
    q = torch.randn(n, H, HD, generator=g)
    out = _prefill(q, k, v, table, 0, n)
    kk = k[table].flatten(0, 1)[:n].repeat_interleave(H // NKV, 1)  # [n, H, HD]
    vv = v[table].flatten(0, 1)[:n].repeat_interleave(H // NKV, 1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * HD ** -0.5
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4)
    assert KV_TILE % BS == 0


@pytest.mark.parametrize("pool_dtype,dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32)])
def test_gathers_into_reused_buffers_give_the_same_bits(pool_dtype, dtype, monkeypatch):
    monkeypatch.setattr(GatherScratch, "STAGE_BLOCKS", 7)  # widen through several staging chunks
    k, v = _pool(pool_dtype)
    g = torch.Generator().manual_seed(4)
    table = torch.randperm(400, generator=g)[:80].tolist()
    q = torch.randn(1200, H, HD, generator=g).to(dtype)
    others = [torch.randperm(400, generator=g)[:60].tolist() for _ in range(2)]
    scratch = GatherScratch()
    held = []
    for _ in range(2):  # the second round reuses the first round's buffers
        for start, n in [(0, 1200), (700, 3)]:
            assert torch.equal(_prefill(q, k, v, table, start, n, scratch), _prefill(q, k, v, table, start, n))
        qs, ctxs = [q[5], q[900], q[30]], [700, 901, 31]
        tables = [others[0], table, others[1]]
        assert torch.equal(_decode(qs, k, v, tables, ctxs, scratch), _decode(qs, k, v, tables, ctxs))
        held.append(scratch.nbytes())
    assert held[0] == held[1] > 0  # no growth once the largest gather was seen
