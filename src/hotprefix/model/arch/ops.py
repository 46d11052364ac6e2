"""The shared operators a family's decoder layer is written with (``base.Family.layer``), in two
implementations with one interface: torch ops (``TorchOps``), and the fused C kernels where they
build (``FusedOps``: ``fused.c``'s RMSNorm, QK-norm, RoPE + K/V write, SiLU and GELU-tanh, ``attn.c``'s
attention).

One object per forward pass: it holds the step's positions, slot mapping and attention metadata,
so a layer only passes tensors. Each operator's arithmetic is row-local (or, for attention,
depends only on a row's own position and keys), so cold == warm and batched == alone hold for every
family; the two implementations' bits differ (fused RMSNorm, SiLU and GELU round differently), which the
numerics tag says. The torch implementation keeps the Llama path's exact operations and order.

- ``add_norm(h, delta, w)``: ``h += delta`` in place (skipped when None), then RMSNorm(h) * w;
- ``norm(x, w)``: RMSNorm(x) * w (gemma's norms on a sublayer's output);
- ``mm(x, w, b, op)``: the model's GEMM (weight modes, padding to batch-invariant row counts);
- ``qkv_rope_write(qkv, w, rope, kv)``: QK-norm (per head, when the layer has ``q_norm``), RoPE
  with this layer's tables, K/V rounded into the pool: the queries [rows, heads, head_dim];
- ``attend(q, kv, window)``: attention over the pool; ``window`` > 0 limits a query at position p
  to keys ``[p - window + 1, p]`` (torch's kernel with a window mask: ``attn.c`` takes none);
- ``act_mul(gate_up, kind)``: ``act(gate) * up`` for ``silu`` or ``gelu_tanh``.

This module knows nothing about weight names, files or families.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hotprefix.model.attention import paged_attention, write_kv


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (Hugging Face layout)."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


class _Ops:
    def __init__(self, model, positions: torch.Tensor, meta, n_real: int):
        self.m, self.positions, self.meta, self.n_real = model, positions, meta, n_real
        a = model.arch
        self.eps, self.nh, self.nkv, self.hd = a.rms_norm_eps, a.num_heads, a.num_kv_heads, a.head_dim

    def use(self, meta) -> None:
        """The next layers read and write the pool through ``meta`` (a hybrid pool's KV group:
        its slot mapping and block tables)."""
        self.meta = meta

    def mm(self, x: torch.Tensor, w, b: torch.Tensor | None, op: str) -> torch.Tensor:
        return self.m._mm(x, w, b, op)

    def heads_flat(self, o: torch.Tensor) -> torch.Tensor:
        return o.reshape(o.shape[0], self.nh * self.hd)


class TorchOps(_Ops):
    """The operators as torch calls (no C compiler, the fused kernels off, or not on CPU)."""

    def __init__(self, model, positions, meta, n_real):
        super().__init__(model, positions, meta, n_real)
        self._tables: dict[int, tuple] = {}

    def add_norm(self, h, delta, w):
        if delta is not None:
            h.add_(delta.float())
        return rms_norm(h, w, self.eps)

    def norm(self, x, w):
        return rms_norm(x.float(), w, self.eps)

    def qkv_rope_write(self, qkv, w, rope, kv):
        m, n, nh, nkv, hd = self.m, qkv.shape[0], self.nh, self.nkv, self.hd
        tables = self._tables.get(id(rope))
        if tables is None:
            tables = self._tables[id(rope)] = rope.tables(self.positions)
        qk, v = qkv.split([(nh + nkv) * hd, nkv * hd], dim=-1)
        qk = qk.view(n, nh + nkv, hd).float()
        if "q_norm" in w:
            q, k = qk.split([nh, nkv], dim=1)
            qk = torch.cat([rms_norm(q, w["q_norm"], self.eps), rms_norm(k, w["k_norm"], self.eps)], 1)
        # RoPE on queries and keys together: one set of ops instead of two
        qk = apply_rope(qk, *tables)
        q, k = qk.split([nh, nkv], dim=1)
        q = q.to(m.attn_dtype)  # attention may widen K/V from the pool
        v = v.reshape(n, nkv, hd)
        if kv[0].dtype.is_floating_point:  # a 16/32-bit pool: K/V rounded to it here, once
            k, v = k.to(kv[0].dtype), v.to(kv[0].dtype)
        write_kv(kv[0], kv[1], k, v, self.meta)  # (an int8 pool's write quantizes them)
        return q

    def attend(self, q, kv, window):
        o = paged_attention(q, kv[0], kv[1], self.meta, self.m.scale, self.m.scratch, window)
        if q.shape[0] > self.n_real:
            o[self.n_real:] = 0  # padding rows attend to nothing
        return o

    def act_mul(self, gate_up, kind):
        gate, up = gate_up.chunk(2, dim=-1)
        return (F.silu(gate) if kind == "silu" else F.gelu(gate, approximate="tanh")) * up


class FusedOps(_Ops):
    """The operators in the fused C kernels (``fused.FusedOps``), fp32 activations on CPU."""

    def __init__(self, model, positions, meta, n_real):
        super().__init__(model, positions.contiguous(), meta, n_real)
        self.f = model.fused
        self.slots = meta.slot_mapping.contiguous()

    def use(self, meta) -> None:
        if meta is not self.meta:
            self.meta, self.slots = meta, meta.slot_mapping.contiguous()

    def add_norm(self, h, delta, w):
        return self.f.add_rms_norm(h, None if delta is None else delta.float().contiguous(), w)

    def norm(self, x, w):
        return self.f.add_rms_norm(x.float().contiguous(), None, w)

    def qkv_rope_write(self, qkv, w, rope, kv):
        qkv = qkv.float().contiguous()
        if "q_norm" in w:
            self.f.head_rms_norm(qkv, 0, self.nh, w["q_norm"])
            self.f.head_rms_norm(qkv, self.nh * self.hd, self.nkv, w["k_norm"])
        return self.f.rope_write_kv(qkv, rope.cos, rope.sin, self.positions, kv[0], kv[1],
                                    self.slots)

    def attend(self, q, kv, window):
        return self.m._attend(q, kv[0], kv[1], self.meta, self.n_real, window)

    def act_mul(self, gate_up, kind):
        return self.f.act_mul(gate_up.float().contiguous(), kind)
