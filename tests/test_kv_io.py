"""The runner's block mover for the KV tiers: pool blocks -> bytes -> other pool blocks, exactly."""

from __future__ import annotations

import pytest
import torch

from hotprefix.engine.kv_io import STAGING_BLOCKS, KVBlockIO


def make_pool(num_blocks: int, dtype: torch.dtype, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, 4, 2, 8)  # blocks, block size, KV heads, head dim
    return [(torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
            for _ in range(3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_move_bit_exactly_through_more_than_one_staging_chunk(dtype):
    n = 2 * STAGING_BLOCKS + 5  # three chunks, the last one partial
    src = make_pool(n + 3, dtype, seed=1)
    dst = make_pool(2 * n, dtype, seed=2)
    io_src, io_dst = KVBlockIO(src), KVBlockIO(dst)
    assert io_src.layout == io_dst.layout and "B4" in io_src.layout
    ids = list(range(3, n + 3))
    payloads = io_src.read_blocks(ids)
    assert len(payloads) == n and all(len(p) == io_src.payload_len for p in payloads)
    targets = list(range(2 * n - 1, 0, -2))[:n]  # other ids, in another order
    untouched = [(k.clone(), v.clone()) for k, v in dst]
    io_dst.write_blocks(targets, [memoryview(p).toreadonly() for p in payloads])  # as tiers hand them
    moved = set(targets)
    for (ks, vs), (kd, vd), (k0, v0) in zip(src, dst, untouched):
        for s, t in zip(ids, targets):
            assert torch.equal(kd[t].view(torch.uint8), ks[s].view(torch.uint8))
            assert torch.equal(vd[t].view(torch.uint8), vs[s].view(torch.uint8))
        rest = [b for b in range(2 * n) if b not in moved]
        assert torch.equal(kd[rest], k0[rest]) and torch.equal(vd[rest], v0[rest])


def test_a_payload_of_the_wrong_size_is_refused_before_any_copy():
    pool = make_pool(4, torch.float32, seed=3)
    io = KVBlockIO(pool)
    before = [k.clone() for k, _ in pool]
    good = io.read_blocks([0])[0]
    with pytest.raises(ValueError):
        io.write_blocks([1, 2], [good, good[:-1]])
    assert all(torch.equal(k, b) for (k, _), b in zip(pool, before))
