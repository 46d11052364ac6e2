"""Attention over a paged KV pool, batch-invariant.

The pool of one layer is two tensors ``[num_blocks, block_size, num_kv_heads, head_dim]`` (K and
V). New K/V are written through ``slot_mapping`` (slot = block_id * block_size + offset); attention
reads each sequence's K/V through its block table.

A query's result never depends on what else is in the step: not on how many other queries share
the call, how the prompt was cut into chunks, whether its prefix came from the cache, nor whether
the token is a prefill row or a decode row. torch's fused CPU attention (flash, online softmax) is
row-invariant only under two conditions, which every call here meets:

- a query at position ``p`` always attends exactly ``padded_len(p + 1)`` keys (the next multiple
  of ``KV_TILE``; keys past ``p`` masked): the kernel's bits for a row depend on the key count (it
  walks keys in splits of 512 with a partial last one), so the count is a function of the position
  alone. A prefill chunk is cut at multiples of ``KV_TILE`` in position, so all rows of a call share
  it, and decodes are grouped by it;
- a call has at least ``min_q_rows(dtype)`` query rows (below that a different inner kernel runs):
  short chunks and single decode tokens are padded with copies of their last row. It is
  ``MIN_Q_ROWS`` in a 16-bit dtype and probed in fp32 (4 on this project's CPU).

The arithmetic runs in the queries' dtype: K/V are read from the pool (bf16 by default, or int8 rows
with a scale, dequantized as they are gathered: ``kv_dtype.py``) and widened when the queries are fp32, which a CPU engine always passes (``attention_dtype``): on CPUs
without AMX, torch's fp32 kernel is as fast as its bf16 one on prefill tiles and faster on the few
rows of a decode step, and the probabilities are not rounded to bf16 before they weight V.

``tests/test_attention.py`` checks these properties on random tensors in every dtype we serve, and
``tests/test_batch_invariance.py`` checks them end to end. This module knows nothing about
requests, hashing or scheduling: only tensors and indices.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hotprefix.model.kv_dtype import from_pool, head_dim_of, to_pool

KV_TILE = 256
"""Key-count granularity: a query at position p attends ``padded_len(p + 1)`` keys, and a prefill
call covers positions within one such tile. 256 measured fastest for prefill on this project's CPU
(a 2,048-token chunk's attention: 41 ms a layer against 49 with 512 and 44 with 128) and halves a
short-context decode's keys against 512."""
MIN_Q_ROWS = 16
"""Fewest query rows per call for the row-invariant kernel path in bf16/fp16, and the most that the
fp32 probe (``min_q_rows``) may ask for."""
PAD_BLOCK = -1
"""Block-table entry past a sequence's blocks, where its keys are padded to a whole KV tile: those
keys are masked. The fused gather skips such entries and leaves its buffer's earlier contents there
(zeros or other K/V: finite, so a masked key adds an exact zero); the torch gather reads block 0."""


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
    decode_block_tables: torch.Tensor | None = None  # [num_decode, >= L / block_size] long, PAD_BLOCK past a sequence
    decode_context_lens: list[int] = field(default_factory=list)  # keys each decode sees (itself included)
    prefills: list[PrefillSeq] = field(default_factory=list)
    has_padding: bool = False
    _tiles: dict[tuple[int, torch.dtype, int], list["PrefillTile"]] = field(
        default_factory=dict, compare=False, repr=False)
    _groups: dict[tuple[int, torch.dtype, int], list["DecodeGroup"]] = field(
        default_factory=dict, compare=False, repr=False)
    _rows: dict[int, "RowPlan"] = field(default_factory=dict, compare=False, repr=False)
    masks: dict = field(default_factory=dict, compare=False, repr=False)
    """Prefill masks by (first position, rows, keys, window, dtype): they depend on positions only,
    so a hybrid pool's KV groups (one metadata each, ``engine/runner.py``) share one dict."""

    def row_plan(self, num_rows: int) -> "RowPlan":
        """Every row's sequence and position, for a kernel that reads the pool itself
        (``fused.FusedOps.attention``); planned once per forward pass."""
        plan = self._rows.get(num_rows)
        if plan is None:
            plan = self._rows[num_rows] = _plan_rows(self, num_rows)
        return plan

    def decode_groups(self, block_size: int, dtype: torch.dtype,
                      window: int = 0) -> list["DecodeGroup"]:
        """The decodes' attention calls, planned once per forward pass (and window): runs of
        consecutive decode rows whose key counts (``padded_len`` of their context) are equal."""
        key = (block_size, dtype, window)
        groups = self._groups.get(key)
        if groups is None:
            groups = self._groups[key] = _plan_decode_groups(self, *key)
        return groups

    def prefill_tiles(self, block_size: int, dtype: torch.dtype,
                      window: int = 0) -> list["PrefillTile"]:
        """The prefill chunks' attention calls, planned once per forward pass (and window): every
        layer makes the same calls, only the tensors differ."""
        key = (block_size, dtype, window)
        tiles = self._tiles.get(key)
        if tiles is None:
            tiles = self._tiles[key] = [t for p in self.prefills
                                        for t in _plan_tiles(p, *key, masks=self.masks)]
        return tiles


@dataclass(frozen=True)
class RowPlan:
    """Row ``i`` of a step attends keys ``0..pos[i]`` of sequence ``seq[i]`` (-1: a padding row,
    zeros), whose block table is ``tables[seq[i]]`` (entries past its blocks are never read)."""

    tables: torch.Tensor  # [num_seqs, max_blocks] long
    seq: torch.Tensor  # [num_rows] long
    pos: torch.Tensor  # [num_rows] long


def _plan_rows(meta: AttentionMetadata, n: int) -> RowPlan:
    nd = meta.num_decode
    dev = meta.slot_mapping.device
    dec = meta.decode_block_tables[:nd] if nd else None
    width = max([1, *(p.block_table.shape[0] for p in meta.prefills)]
                + ([dec.shape[1]] if nd else []))
    packed = torch.zeros(max(nd + len(meta.prefills), 1), width, dtype=torch.long, device=dev)
    if nd:
        packed[:nd, : dec.shape[1]] = dec  # the decodes' tables in one copy
    for i, p in enumerate(meta.prefills):
        packed[nd + i, : p.block_table.shape[0]] = p.block_table
    seq = torch.full((n,), -1, dtype=torch.long, device=dev)
    pos = torch.zeros(n, dtype=torch.long, device=dev)
    if nd:
        seq[:nd] = torch.arange(nd, device=dev)
        pos[:nd] = torch.tensor(meta.decode_context_lens[:nd], device=dev) - 1
    for i, p in enumerate(meta.prefills):
        past = p.context_len - (p.q_end - p.q_start)
        seq[p.q_start:p.q_end] = nd + i
        pos[p.q_start:p.q_end] = torch.arange(past, p.context_len, device=dev)
    if meta.has_padding:  # rows whose K/V is not written (a tile's rows outside its chunk) are
        slots = meta.slot_mapping[:n]  # padding: their keys, or their window's, may be gone
        seq[:slots.shape[0]][slots < 0] = -1
    return RowPlan(packed, seq, pos)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True = attend) as 0 / -inf in ``dtype``: what torch's attention converts a bool
    mask to on every call."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


@dataclass(frozen=True)
class DecodeGroup:
    """One attention call of decode rows ``r0:r1`` sharing a key count: their block tables
    ``[rows, keys / block_size]`` and additive masks ``[rows, 1, 1, keys]``."""

    r0: int
    r1: int
    table: torch.Tensor
    mask: torch.Tensor


@dataclass(frozen=True)
class PrefillTile:
    """One attention call of a prefill chunk: query rows ``r0:r1`` of the flat batch (padded to
    ``rows`` with copies of the last), the blocks holding its keys (a whole number of KV tiles) and
    its causal mask ``[rows, keys]`` (additive, in the attention dtype)."""

    r0: int
    r1: int
    rows: int
    table: torch.Tensor
    mask: torch.Tensor


@functools.cache
def min_q_rows(dtype: torch.dtype) -> int:
    """Fewest query rows of a call computed in ``dtype``: ``MIN_Q_ROWS`` in 16-bit dtypes; in
    fp32, probed once per process: the fewest rows from which a query's output is the same as in a
    call of 64 rows over three key tiles with a causal mask (the GEMM library may take another path
    for one to three rows, and which rows it does so for depends on the CPU)."""
    if dtype != torch.float32:
        return MIN_Q_ROWS
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 3, n, 64, generator=g) for n in (64, 3 * KV_TILE, 3 * KV_TILE))
    last = 3 * KV_TILE - 1  # every query is the last position: it sees every key tile

    def row0(m: int) -> torch.Tensor:
        mask = torch.arange(3 * KV_TILE).unsqueeze(0) <= torch.full((m, 1), last)
        return F.scaled_dot_product_attention(q[:, :, :m], k, v, attn_mask=mask)[:, :, 0]

    ref = row0(64)
    if not all(torch.equal(row0(m), ref) for m in (MIN_Q_ROWS, 17, 31, 33)):
        return MIN_Q_ROWS  # nothing better is known to hold; 16 rows is what 16-bit dtypes use
    need = MIN_Q_ROWS
    for m in range(MIN_Q_ROWS - 1, 0, -1):
        if not torch.equal(row0(m), ref):
            break
        need = m
    return need


def attention_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype attention computes in for an engine of ``dtype``: fp32 on CPU (see the module
    docstring), the engine's dtype elsewhere (a GPU's fused kernels want 16-bit)."""
    return torch.float32 if device.type == "cpu" else dtype


def padded_len(n: int) -> int:
    """Key count of a call that must see ``n`` keys: the next multiple of KV_TILE."""
    return -(-n // KV_TILE) * KV_TILE


def _padded_table(table: torch.Tensor, nblocks: int) -> torch.Tensor:
    """The first ``nblocks`` entries of a block table, PAD_BLOCK past its end."""
    table = table[..., :nblocks]
    if table.shape[-1] < nblocks:  # padding entries: their keys are masked out
        pad = table.new_full((*table.shape[:-1], nblocks - table.shape[-1]), PAD_BLOCK)
        table = torch.cat([table, pad], -1)
    return table


def _plan_decode_groups(meta: AttentionMetadata, bs: int, dtype: torch.dtype,
                        window: int = 0) -> list[DecodeGroup]:
    groups: list[DecodeGroup] = []
    r0 = 0
    for keys, run in itertools.groupby(meta.decode_context_lens[: meta.num_decode], key=padded_len):
        lens = torch.tensor(list(run), device=meta.decode_block_tables.device)
        r1 = r0 + len(lens)
        ks = torch.arange(keys, device=lens.device)
        mask = ks < lens.unsqueeze(1)
        if window:  # a decode at position p = len - 1 sees keys [p - window + 1, p]
            mask &= ks >= (lens - window).unsqueeze(1)
        mask = mask.view(len(lens), 1, 1, keys)
        table = _padded_table(meta.decode_block_tables[r0:r1], keys // bs)
        groups.append(DecodeGroup(r0, r1, table, additive_mask(mask, dtype)))
        r0 = r1
    return groups


def _plan_tiles(p: PrefillSeq, bs: int, dtype: torch.dtype, window: int = 0,
                masks: dict | None = None) -> list[PrefillTile]:
    """A chunk's calls: its rows cut at multiples of ``KV_TILE`` in position, each call reading
    the keys up to the end of its tile (every row of it has that key count). ``window`` > 0: a
    row at p sees keys ``[p - window + 1, p]`` only (the others masked, the key count the same)."""
    min_rows = min_q_rows(dtype)
    tiles = []
    dev = p.block_table.device
    past = p.context_len - (p.q_end - p.q_start)  # position of the chunk's first token
    r0 = p.q_start
    while r0 < p.q_end:
        first = past + r0 - p.q_start
        keys = padded_len(first + 1)
        r1 = min(p.q_end, r0 + keys - first)
        n = r1 - r0
        table = _padded_table(p.block_table, keys // bs)
        rows = max(n, min_rows)
        mkey = (first, n, rows, keys, window, dtype, dev)
        add = masks.get(mkey) if masks is not None else None
        if add is None:
            pos = torch.arange(first, first + rows, device=dev).clamp_(max=first + n - 1)
            ks = torch.arange(keys, device=dev).unsqueeze(0)
            mask = ks <= pos.unsqueeze(1)
            if window:
                mask &= ks > (pos - window).unsqueeze(1)
            add = additive_mask(mask, dtype)
            if masks is not None:
                masks[mkey] = add
        tiles.append(PrefillTile(r0, r1, rows, table, add))
        r0 = r1
    return tiles


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """K and V ``[num_tokens, nkv, hd]`` rounded to the pool's element type (``kv_dtype.to_pool``:
    once, here) and written at the slot mapping's slots."""
    nh, row = k_cache.shape[-2], k_cache.shape[-1]
    slots = meta.slot_mapping
    k, v = k[: slots.shape[0]], v[: slots.shape[0]]  # rows past the mapping pad the GEMMs only
    if meta.has_padding:
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    k_cache.view(-1, nh, row).index_copy_(0, slots, to_pool(k, k_cache))
    v_cache.view(-1, nh, row).index_copy_(0, slots, to_pool(v, v_cache))


class GatherScratch:
    """Grow-only buffers that attention gathers K and V into, reused by every layer of every step.

    A gather into new memory costs several times the copy itself in page faults once it is large:
    the K/V of a 64-row decode step at 2,560 keys took 49 ms a layer into new memory and 9 ms into
    a reused buffer (bf16, this project's CPU). The buffers grow to the largest step seen and stay
    held. Widening to another dtype goes through a staging buffer of ``STAGE_BLOCKS`` blocks, or
    in one pass for K and V together through ``widen`` (``fused.FusedOps.gather_widen_kv``: the
    same bits) to fp32.
    """

    STAGE_BLOCKS = 1024

    def __init__(self, widen=None):
        self._bufs: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self.widen = widen

    def _take(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = self._bufs.get((name, dtype))
        if buf is None or buf.numel() < numel or buf.device != device:
            # zeros: the rows of PAD_BLOCK entries are never written and must hold finite values
            buf = self._bufs[(name, dtype)] = torch.zeros(numel, dtype=dtype, device=device)
        return buf[:numel]

    def nbytes(self) -> int:
        """Bytes held."""
        return sum(b.numel() * b.element_size() for b in self._bufs.values())

    def gather_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, nblocks] block ids -> K and V, each [B, nkv, nblocks * block_size, hd] in ``dtype``,
        in this scratch's buffers (valid until its next gather)."""
        nkv, hd = k_cache.shape[-2], head_dim_of(k_cache)
        idx = table.reshape(-1)
        n, per = idx.numel(), k_cache.shape[1] * nkv * hd
        outs = [self._take(name, n * per, dtype, k_cache.device).view(n, per) for name in "kv"]
        if self.widen is not None and dtype == torch.float32 and dtype != k_cache.dtype:
            self.widen(k_cache, v_cache, idx.contiguous(), *outs)  # skips PAD_BLOCK entries
        else:
            self._gather_torch(k_cache, v_cache, idx.clamp(min=0), outs)  # PAD_BLOCK reads block 0
        k, v = (out.view(table.shape[0], -1, nkv, hd).transpose(1, 2) for out in outs)
        return k, v

    def _gather_torch(self, k_cache: torch.Tensor, v_cache: torch.Tensor, idx: torch.Tensor,
                      outs: list[torch.Tensor]) -> None:
        """index_select into ``outs``; widened (int8: dequantized) through the staging buffer when
        the dtypes differ."""
        n, per = outs[0].shape
        pin = k_cache[0].numel()  # a block's elements in the pool (int8: the scales too)
        flats = [c.view(c.shape[0], pin) for c in (k_cache, v_cache)]
        if outs[0].dtype == k_cache.dtype:
            for flat, out in zip(flats, outs):
                torch.index_select(flat, 0, idx, out=out)
            return
        stage = self._take("stage", min(n, self.STAGE_BLOCKS) * pin, k_cache.dtype, k_cache.device)
        stage = stage.view(-1, pin)
        rows = k_cache.shape[1:]
        for flat, out in zip(flats, outs):
            for s in range(0, n, self.STAGE_BLOCKS):
                e = min(s + self.STAGE_BLOCKS, n)
                torch.index_select(flat, 0, idx[s:e], out=stage[: e - s])
                out[s:e].copy_(from_pool(stage[: e - s].view(e - s, *rows), out.dtype).view(e - s, per))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float,
                    scratch: GatherScratch | None = None, window: int = 0) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim].

    K/V of the current step must already be written to the pool. The arithmetic runs in q's dtype.
    K/V are gathered into ``scratch``'s buffers (a new one, and new memory, when none is given).
    ``window`` > 0: a query at position p attends keys ``[p - window + 1, p]`` (a sliding-window
    layer), through the same calls with the keys before the window masked: the same key counts,
    so the same row-invariance.
    """
    out = torch.empty_like(q)
    dt = q.dtype
    scratch = scratch or GatherScratch()

    gqa = q.shape[1] != k_cache.shape[-2]
    nkv, hd = k_cache.shape[-2], q.shape[-1]
    g = q.shape[1] // nkv
    rows = max(g, min_q_rows(dt))
    for grp in meta.decode_groups(k_cache.shape[1], dt, window):
        # a decode token's query heads that share a KV head are the rows of one call (padded with
        # copies to min_q_rows): the same per-row arithmetic as a prefill, at 1/g of the padding
        nd = grp.r1 - grp.r0
        qd = q[grp.r0:grp.r1].view(nd, nkv, g, hd)
        if rows > g:
            qd = torch.cat([qd, qd[:, :, -1:].expand(-1, -1, rows - g, -1)], 2)
        k, v = scratch.gather_kv(k_cache, v_cache, grp.table, dt)
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=grp.mask, scale=scale)
        out[grp.r0:grp.r1] = o[:, :, :g].reshape(nd, nkv * g, hd)
    for t in meta.prefill_tiles(k_cache.shape[1], dt, window):
        n = t.r1 - t.r0
        qp = q[t.r0:t.r1]
        if t.rows > n:
            qp = torch.cat([qp, qp[-1:].expand(t.rows - n, -1, -1)])
        k, v = scratch.gather_kv(k_cache, v_cache, t.table.unsqueeze(0), dt)
        o = F.scaled_dot_product_attention(qp.transpose(0, 1).unsqueeze(0), k, v,
                                           attn_mask=t.mask, scale=scale, enable_gqa=gqa)
        out[t.r0:t.r1] = o[0, :, :n].transpose(0, 1)
    return out
