"""Attention over a paged KV pool, batch-invariant.

The pool of one layer is two tensors ``[num_blocks, block_size, num_kv_heads, head_dim]`` (K and
V). New K/V are written through ``slot_mapping`` (slot = block_id * block_size + offset); attention
reads each sequence's K/V through its block table.

A query's result never depends on what else is in the step: not on how many other queries share
the call, how the prompt was cut into chunks, whether its prefix came from the cache, nor whether
the token is a prefill row or a decode row. torch's fused CPU attention (flash, online softmax) is
row-invariant only under two conditions, which every call here meets:

- the keys of a call are padded (masked) to a multiple of ``KV_TILE``: the kernel walks keys in
  tiles of that size from position 0, so a query sees the same tiles in the same order whatever its
  context length or chunk, and fully masked tail tiles add exact zeros;
- a call has at least ``MIN_Q_ROWS`` query rows (below that a different inner kernel runs): short
  chunks and single decode tokens are padded with copies of their last row.

``tests/test_attention.py`` checks these properties on random tensors in every dtype we serve, and
``tests/test_batch_invariance.py`` checks them end to end. This module knows nothing about
requests, hashing or scheduling: only tensors and indices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

KV_TILE = 512
"""Keys per tile of the fused kernel; every call's key count is a multiple of it."""
MIN_Q_ROWS = 16
"""Fewest query rows per call for the row-invariant kernel path."""
Q_TILE = 512
"""Prefill query rows per call: a long chunk is attended in slices that each read only the keys up
to their own last position (causal work, not the full square)."""


@dataclass(frozen=True)
class PrefillSeq:
    """One sequence's chunk in a step: tokens ``q_start:q_end`` of the flat batch."""

    q_start: int
    q_end: int
    context_len: int  # tokens of this sequence in the pool after this step (prefix + chunk)
    block_table: torch.Tensor  # [num_blocks_of_seq] long


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each token's K/V go and what each query attends to.

    Decode tokens (one per sequence) come first in the flat batch, then prefill chunks. Built complete
    by the runner for one forward pass, then read-only.
    """

    slot_mapping: torch.Tensor  # [num_tokens] long; -1 = padding, not written
    num_decode: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decode, L / block_size] long, L a multiple of KV_TILE
    decode_mask: torch.Tensor | None = None  # [num_decode, 1, 1, L] bool, broadcast over heads and rows
    prefills: list[PrefillSeq] = field(default_factory=list)
    has_padding: bool = False
    _tiles: dict[int, list["PrefillTile"]] = field(default_factory=dict, compare=False, repr=False)

    def prefill_tiles(self, block_size: int) -> list["PrefillTile"]:
        """The prefill chunks' attention calls, planned once per forward pass: every layer makes
        the same calls, only the tensors differ."""
        tiles = self._tiles.get(block_size)
        if tiles is None:
            tiles = self._tiles[block_size] = [t for p in self.prefills for t in _plan_tiles(p, block_size)]
        return tiles


@dataclass(frozen=True)
class PrefillTile:
    """One attention call of a prefill chunk: query rows ``r0:r1`` of the flat batch (padded to
    ``rows`` with copies of the last), the blocks holding its keys (a whole number of KV tiles) and
    its causal mask ``[rows, keys]``."""

    r0: int
    r1: int
    rows: int
    table: torch.Tensor
    mask: torch.Tensor


def padded_len(n: int) -> int:
    """Key count of a call that must see ``n`` keys: the next multiple of KV_TILE."""
    return -(-n // KV_TILE) * KV_TILE


def _plan_tiles(p: PrefillSeq, bs: int) -> list[PrefillTile]:
    """A chunk's calls: slices of ``Q_TILE`` query rows, each reading the keys up to its own last
    position, padded to whole KV tiles."""
    tiles = []
    dev = p.block_table.device
    past = p.context_len - (p.q_end - p.q_start)  # position of the chunk's first token
    for r0 in range(p.q_start, p.q_end, Q_TILE):
        r1 = min(r0 + Q_TILE, p.q_end)
        n = r1 - r0
        first = past + r0 - p.q_start
        keys = padded_len(first + n)
        table = p.block_table[: keys // bs]
        if table.shape[0] * bs < keys:  # pad with any block: its keys are masked out
            table = torch.cat([table, table.new_zeros(keys // bs - table.shape[0])])
        rows = max(n, MIN_Q_ROWS)
        pos = torch.arange(first, first + rows, device=dev).clamp_(max=first + n - 1)
        mask = torch.arange(keys, device=dev).unsqueeze(0) <= pos.unsqueeze(1)
        tiles.append(PrefillTile(r0, r1, rows, table, mask))
    return tiles


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             meta: AttentionMetadata) -> None:
    nh, hd = k_cache.shape[-2], k_cache.shape[-1]
    slots = meta.slot_mapping
    k, v = k[: slots.shape[0]], v[: slots.shape[0]]  # rows past the mapping pad the GEMMs only
    if meta.has_padding:
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    k_cache.view(-1, nh, hd).index_copy_(0, slots, k)
    v_cache.view(-1, nh, hd).index_copy_(0, slots, v)


def _gather(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """[..., nblocks] block ids -> [..., nkv, nblocks * block_size, hd]."""
    kv = cache[table]  # [..., nblocks, bs, nkv, hd]
    return kv.flatten(-4, -3).transpose(-3, -2)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim].

    K/V of the current step must already be written to the pool.
    """
    out = torch.empty_like(q)
    gqa = q.shape[1] != k_cache.shape[-2]
    nd = meta.num_decode
    if nd:
        # a decode token's query heads that share a KV head are the rows of one call (padded with
        # copies to MIN_Q_ROWS): the same per-row arithmetic as a prefill, at 1/g of the padding
        nkv, hd = k_cache.shape[-2], k_cache.shape[-1]
        g = q.shape[1] // nkv
        rows = max(g, MIN_Q_ROWS)
        qd = q[:nd].view(nd, nkv, g, hd)
        if rows > g:
            qd = torch.cat([qd, qd[:, :, -1:].expand(-1, -1, rows - g, -1)], 2)
        k = _gather(k_cache, meta.decode_block_tables)
        v = _gather(v_cache, meta.decode_block_tables)
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=meta.decode_mask, scale=scale)
        out[:nd] = o[:, :, :g].reshape(nd, nkv * g, hd)
    for t in meta.prefill_tiles(k_cache.shape[1]):
        n = t.r1 - t.r0
        qp = q[t.r0:t.r1]
        if t.rows > n:
            qp = torch.cat([qp, qp[-1:].expand(t.rows - n, -1, -1)])
        o = F.scaled_dot_product_attention(qp.transpose(0, 1).unsqueeze(0),
                                           _gather(k_cache, t.table).unsqueeze(0),
                                           _gather(v_cache, t.table).unsqueeze(0),
                                           attn_mask=t.mask, scale=scale, enable_gqa=gqa)
        out[t.r0:t.r1] = o[0, :, :n].transpose(0, 1)
    return out
