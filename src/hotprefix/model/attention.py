"""Attention over a paged KV pool.

The pool of one layer is two tensors ``[num_blocks, block_size, num_kv_heads, head_dim]`` (K and
V). New K/V are written through ``slot_mapping`` (slot = block_id * block_size + offset); attention
reads each sequence's K/V through its ``block_table``. Plain torch (SDPA), so it runs on CPU and CUDA.

This module knows nothing about requests, hashing or scheduling: only tensors and indices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


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
    decode_block_tables: torch.Tensor | None = None  # [num_decode, max_blocks] long
    decode_mask: torch.Tensor | None = None  # [num_decode, 1, 1, max_blocks*block_size] bool
    prefills: list[PrefillSeq] = field(default_factory=list)
    has_padding: bool = False
    # Cascade decode: blocks every decoding sequence shares (a common cached prefix) are read once
    # for the whole batch; only each sequence's own tail goes through its block table.
    decode_shared_blocks: torch.Tensor | None = None  # [num_shared] long
    decode_suffix_tables: torch.Tensor | None = None  # [num_decode, max_blocks - num_shared] long
    decode_suffix_mask: torch.Tensor | None = None  # [num_decode, (max_blocks - num_shared) * block_size] bool


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             meta: AttentionMetadata) -> None:
    nh, hd = k_cache.shape[-2], k_cache.shape[-1]
    slots = meta.slot_mapping
    if meta.has_padding:
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    k_cache.view(-1, nh, hd).index_copy_(0, slots, k)
    v_cache.view(-1, nh, hd).index_copy_(0, slots, v)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim].

    K/V of the current step must already be written to the pool.
    """
    out = torch.empty_like(q)
    nkv = k_cache.shape[-2]
    gqa = q.shape[1] != nkv
    nd = meta.num_decode
    if nd and meta.decode_shared_blocks is not None:
        out[:nd] = _cascade_decode(q[:nd], k_cache, v_cache, meta, scale)
    elif nd:
        bt = meta.decode_block_tables
        k = k_cache[bt].flatten(1, 2).transpose(1, 2)  # [B, nkv, L, hd]
        v = v_cache[bt].flatten(1, 2).transpose(1, 2)
        qd = q[:nd].unsqueeze(2)  # [B, H, 1, hd]
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=meta.decode_mask, scale=scale,
                                           enable_gqa=gqa)
        out[:nd] = o.squeeze(2)
    for p in meta.prefills:
        n = p.q_end - p.q_start
        # 4-D [1, heads, len, dim] inputs take torch's fused CPU kernel (3-D ones do not)
        k = k_cache[p.block_table].flatten(0, 1)[: p.context_len].transpose(0, 1).unsqueeze(0)
        v = v_cache[p.block_table].flatten(0, 1)[: p.context_len].transpose(0, 1).unsqueeze(0)
        qp = q[p.q_start:p.q_end].transpose(0, 1).unsqueeze(0)
        if n == p.context_len:
            o = F.scaled_dot_product_attention(qp, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            offset = p.context_len - n
            rows = torch.arange(n, device=q.device).unsqueeze(1) + offset
            cols = torch.arange(p.context_len, device=q.device).unsqueeze(0)
            o = F.scaled_dot_product_attention(qp, k, v, attn_mask=cols <= rows, scale=scale,
                                               enable_gqa=gqa)
        out[p.q_start:p.q_end] = o[0].transpose(0, 1)
    return out


def _cascade_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Decode attention split into a shared prefix (one GEMM for all sequences) and per-sequence
    tails, merged exactly with a shared softmax maximum and denominator.

    Without it each sequence would gather its own copy of the shared prefix every layer and step.
    """
    b, h, hd = q.shape
    nkv = k_cache.shape[-2]
    g = h // nkv
    qb = q.view(b, nkv, g, hd)
    kp = k_cache[meta.decode_shared_blocks].flatten(0, 1)  # [Lp, nkv, hd]
    vp = v_cache[meta.decode_shared_blocks].flatten(0, 1)
    lp = kp.shape[0]
    qg = qb.permute(1, 0, 2, 3).reshape(nkv, b * g, hd)
    sp = torch.matmul(qg, kp.permute(1, 2, 0)).view(nkv, b, g, lp).permute(1, 0, 2, 3) * scale
    ks = k_cache[meta.decode_suffix_tables].flatten(1, 2)  # [B, Ls, nkv, hd]
    vs = v_cache[meta.decode_suffix_tables].flatten(1, 2)
    ss = torch.einsum("bkgd,blkd->bkgl", qb, ks) * scale
    ss = ss.masked_fill(~meta.decode_suffix_mask[:, None, None, :], float("-inf"))
    m = torch.maximum(sp.amax(-1, keepdim=True), ss.amax(-1, keepdim=True))
    pp = torch.exp(sp - m)
    ps = torch.exp(ss - m)
    denom = pp.sum(-1, keepdim=True) + ps.sum(-1, keepdim=True)
    op = torch.matmul(pp.permute(1, 0, 2, 3).reshape(nkv, b * g, lp), vp.permute(1, 0, 2))
    op = op.view(nkv, b, g, hd).permute(1, 0, 2, 3)
    o = (op + torch.einsum("bkgl,blkd->bkgd", ps, vs)) / denom
    return o.reshape(b, h, hd)
