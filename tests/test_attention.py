"""Paged attention paths agree: cascade decode (shared prefix read once) vs per-sequence gather."""

from __future__ import annotations

import torch

from hotprefix.model.attention import AttentionMetadata, paged_attention


def test_cascade_decode_matches_gathered_decode():
    g = torch.Generator().manual_seed(0)
    nb, bs, nkv, hd, h = 64, 16, 2, 32, 6
    k_cache = torch.randn(nb, bs, nkv, hd, generator=g)
    v_cache = torch.randn(nb, bs, nkv, hd, generator=g)
    shared = [3, 7, 1, 9, 12, 20, 21, 22, 30, 31, 40, 41, 42, 43, 44, 45, 46]  # 17 blocks = 272 tokens
    own = [[50, 51], [52], [53, 54], [55]]
    ctx = [len(shared) * bs + 20, len(shared) * bs + 5, len(shared) * bs + 31, len(shared) * bs + 16]
    tables = [shared + o for o in own]
    b = len(tables)
    maxb = max(len(t) for t in tables)
    table = torch.zeros(b, maxb, dtype=torch.long)
    for i, t in enumerate(tables):
        table[i, :len(t)] = torch.tensor(t)
    mask = (torch.arange(maxb * bs)[None] < torch.tensor(ctx)[:, None]).view(b, 1, 1, -1)
    q = torch.randn(b, h, hd, generator=g)
    plain = AttentionMetadata(slot_mapping=torch.zeros(b, dtype=torch.long), num_decode=b,
                              decode_block_tables=table, decode_mask=mask, prefills=[])
    ref = paged_attention(q, k_cache, v_cache, plain, hd ** -0.5)
    cascade = AttentionMetadata(slot_mapping=torch.zeros(b, dtype=torch.long), num_decode=b,
                                decode_block_tables=table, decode_mask=mask, prefills=[],
                                decode_shared_blocks=torch.tensor(shared),
                                decode_suffix_tables=table[:, len(shared):],
                                decode_suffix_mask=mask.view(b, -1)[:, len(shared) * bs:])
    out = paged_attention(q, k_cache, v_cache, cascade, hd ** -0.5)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5), (out - ref).abs().max()
    # a sequence that attends differently changes only its own row
    assert not torch.allclose(out[0], out[1])


def test_runner_finds_shared_prefix_only_when_long_enough(tiny_model_dir):
    from hotprefix import LLM

    llm = LLM(tiny_model_dir, num_blocks=64, block_size=16)
    r = llm.engine.runner
    long = list(range(20))
    assert r._shared_decode_blocks([long + [30], long + [31, 32]]) == long
    assert r._shared_decode_blocks([long[:10] + [30], long[:10] + [31]]) == []  # 160 tokens: too short
    assert r._shared_decode_blocks([long + [30]]) == []  # a single sequence
    assert r._shared_decode_blocks([[1] + long, [2] + long]) == []  # differs at block 0
