"""The ``gguf`` weight mode: GEMMs on the GGUF file's own 4- and 8-bit weight blocks (``qgemm.c``).

A decode step at batch 1 reads every weight once, so its speed is the bytes held per weight: fp16
is 2 bytes, a Q4_1 block 0.625. This mode keeps the GGUF's Q4_0 / Q4_1 / Q8_0 / Q5_0 blocks and
its k-quants (Q4_K, Q5_K, Q6_K) in memory (repacked by ``gguf_blocks.py``, not re-quantized: the
same values and scales) and multiplies with them directly.

The activations are rounded to 16-bit integers with one scale per block of 32 inputs. The 32
products of a block are then summed exactly in integers (AVX-512 VNNI ``vpdpwssd``), and each
block adds ``scale_a * (d * S + m * sum(qa))`` to its output with two FMAs, blocks in order. That
order is the same for every row count, tile and thread count, and the integer sums are exact, so a
row's bits never depend on what shares its step (cold == warm), and the portable C path gives the
vector path's bits. The 16-bit activations keep quality: an activation keeps 15 bits against its
block's largest, where an 8-bit one (llama.cpp's width) costs 3 points of top-1 on the quality
benchmark (96.83% against 99.85%). 8 bits are an option (``ModelConfig.activations``, tag ``a8``):
a ``QuantWeight`` built ``narrow`` carries the flag in its table, its activations are rounded to
+-127 (still held as int16, so every int16 kernel computes the same bits), and the AMX tiles
(``qgemm_amx.c``: one tile product a block) and AVX-512 VNNI (``qgemm_a8.c``: ``vpdpbusd``)
run it faster.

Tensors stored in another type (F16, F32, Q5_1, Q2_K, Q3_K ...) run through the ``mixed`` mode's
fp32 GEMM (the loader logs which, and their fp32 size).
"""

from __future__ import annotations

import numpy as np
import torch

from hotprefix.model.isa import requested_level
from hotprefix.model.fused import ACTIVATIONS, check_attention, kv_kind
from hotprefix.model.gguf_blocks import (BLOCK, BLOCK_BYTES, GGUF_TYPES, LANES,  # noqa: F401
                                         block_columns, block_rows, pack_weight, unpack_weight)

QUANT_NUMERICS = "a16"
"""The kernel's numerics in the cache namespace (activations as 16-bit integers per 32-block)."""
QUANT_NUMERICS_NARROW = "a8"
"""The same with the layer GEMMs' activations as 8-bit integers (``ModelConfig.activations``)."""
NARROW_GEMMS = frozenset({"qkv", "o", "gate_up", "down"})
"""The GEMMs that ``activations='int8'`` rounds to 8 bits: a layer's four. The LM head keeps 16
(its few rows a step gain nothing from the tiles; 8 bits there moved KL, not top-1)."""


class QuantWeight:
    """A weight held in the kernel's block layout (``gguf_blocks.pack_weight``)."""

    __slots__ = ("packed", "formats", "n", "k", "nbytes", "narrow")

    def __init__(self, blocks: list[tuple[str, np.ndarray]], k: int, lib=None, narrow: bool = False,
                 kept=None, key: str = ""):
        """``blocks``: (GGUF type, raw bytes [..., bytes a row]) of tensors stacked along the
        output dimension (Q/K/V, gate/up); each group of 16 outputs keeps its type's format.
        ``lib``: the compiled kernels, whose ``qg_pack`` (``qpack.c``) writes the groups on
        ``torch.get_num_threads()`` threads; None: the numpy reference (the same bytes, slower).
        ``narrow``: its products round their activations to 8 bits (+-127) instead of 16 (the
        flag in every entry of the buffer's table, which the kernels read).
        ``kept``: packed weights from an earlier start (``packed_store.PackedStore``), which give
        the buffer kept under ``key`` instead of packing it, or keep the one packed.
        Raises ``gguf_blocks.PackError`` for a stack the layout cannot hold."""
        buf, self.formats = pack_weight(blocks, k, None if lib is None else _packer(lib), narrow,
                                        kept, key)
        self.narrow = bool(narrow)
        self.n, self.k = sum(block_rows(raw) for _, raw in blocks), k
        self.packed = torch.from_numpy(buf)
        self.nbytes = self.packed.numel()

    def dequantize(self) -> torch.Tensor:
        """The fp32 [n, k] weight the blocks hold (``D * q + M`` in fp32), read back from the
        packed bytes in numpy: the packing's inverse, an oracle for the C kernels' reading of it."""
        return torch.from_numpy(unpack_weight(self.packed.numpy(), self.n, self.k))


def _packer(lib):
    """``gguf_blocks.pack_weight``'s ``fill`` through ``qpack.c``."""
    def fill(buf: np.ndarray, groups: int, k: int, addresses: np.ndarray, kinds: np.ndarray) -> None:
        if lib.qg_pack(buf.ctypes.data, groups, k, addresses.shape[0], addresses.ctypes.data,
                       kinds.ctypes.data, torch.get_num_threads()):
            raise ValueError("qg_pack: a group's rows do not fit its format")
    return fill


class BlockRows:
    """Rows of a ``QuantWeight`` as fp32, dequantized when asked (``rows[idx]``), with GGUF's own
    values: the LM head's rows that refine the top logits and a tied embedding's rows, without an
    fp32 copy of the matrix (113 MiB for the default model's 49,152 x 576)."""

    nbytes = 0  # the weight's bytes are counted once, with the weight

    def __init__(self, lib, weight: QuantWeight):
        self.lib, self.weight = lib, weight

    def __getitem__(self, idx: torch.Tensor) -> torch.Tensor:
        flat = idx.reshape(-1).to(torch.int64).contiguous()
        w = self.weight
        out = torch.empty(flat.numel(), w.k, dtype=torch.float32)
        bad = self.lib.qg_dequant_rows(w.packed.data_ptr(), w.n, w.k, flat.data_ptr(), flat.numel(),
                                       out.data_ptr())
        if bad:
            raise IndexError(f"{bad} row ids outside [0, {w.n})")
        return out.view(*idx.shape, w.k)


def quantize_rows(lib, x: torch.Tensor, threads: int, portable: bool = False,
                  narrow: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [rows, k] fp32 -> (int16 activations, a scale and a sum per 32-block); ``narrow``: the
    activations rounded to +-127; ``portable``: the C reference (tests: the same bits as the
    vector path)."""
    rows, k = x.shape
    qa = torch.empty(rows, k, dtype=torch.int16)
    sa = torch.empty(rows, k // BLOCK, dtype=torch.float32)
    sq = torch.empty(rows, k // BLOCK, dtype=torch.float32)
    if portable:
        lib.qg_quantize_rows_reference(x.data_ptr(), qa.data_ptr(), sa.data_ptr(), sq.data_ptr(),
                                       rows, k, int(narrow))
    else:
        lib.qg_quantize_rows(x.data_ptr(), qa.data_ptr(), sa.data_ptr(), sq.data_ptr(), rows, k,
                             int(narrow), threads)
    return qa, sa, sq


class QuantLinear:
    """``linear(x, weight, bias)`` for the ``gguf`` mode: a ``QuantWeight`` through the block
    kernel, any other weight through ``fallback`` (the ``mixed`` mode's fp32-input GEMM)."""

    def __init__(self, lib, fallback):
        self.lib, self.fallback = lib, fallback

    def __call__(self, x: torch.Tensor, w, b: torch.Tensor | None) -> torch.Tensor:
        if not isinstance(w, QuantWeight):
            return self.fallback(x, w, b)
        x = x.float().contiguous()
        y = torch.empty(x.shape[0], w.n, dtype=torch.float32)
        if self.lib.qg_linear(w.packed.data_ptr(), w.n, w.k, x.data_ptr(), x.shape[0], y.data_ptr(),
                              torch.get_num_threads()):
            raise MemoryError(f"no memory for the activations of a {tuple(x.shape)} GEMM")
        return y if b is None else y + b

    def reference(self, x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
        """The portable C path on the same inputs (tests: it must give ``__call__``'s bits)."""
        x = x.float().contiguous()
        qa, sa, sq = quantize_rows(self.lib, x, 1, portable=True, narrow=w.narrow)
        y = torch.empty(x.shape[0], w.n, dtype=torch.float32)
        self.lib.qg_gemm_reference(w.packed.data_ptr(), w.n, w.k, qa.data_ptr(),
                                   sa.data_ptr(), sq.data_ptr(), x.shape[0], y.data_ptr())
        return y


def fast_block_kernels() -> bool:
    """Whether the kernels' ISA level (``isa.requested_level``: AVX2+FMA, AVX-VNNI or AVX-512
    VNNI) runs the block GEMM's vector path; elsewhere the portable C path gives the same bits,
    too slowly to be a default."""
    return requested_level().fast_gemm


class QuantLayers:
    """A decoder layer's work around attention in two C calls (``qlayer.c``), or every layer in
    one, when all four of its matrices are block-quantized: the kernels the family's layer over
    ``arch.ops.FusedOps`` calls one by one, in the same order on the same values (the same bits),
    without the calls' cost between them. The layer is the base one with what the families add:
    Q/K/V bias, QK-norm, norms on the sublayers' outputs (``attn_out_norm``, ``mlp_out_norm``),
    GELU-tanh, per-layer RoPE tables and windows."""

    STATIC = ("in_norm", "post_norm", "qkv", "qkv_bias", "o", "gate_up", "down", "q_norm",
              "k_norm", "attn_out_norm", "mlp_out_norm")
    """A layer's weights, in ``qlayer.c``'s field order (``QL_IN_NORM`` ...); its RoPE tables,
    window and pools follow, then ``STEP_FIELDS``."""
    STEP_FIELDS = 6
    """The last fields of a layer's row, its KV group's per-step ones: slot mapping and its length,
    block tables and their stride, the rows' sequences and positions (``QL_SLOTS`` ...)."""

    def __init__(self, lib, eps: float, num_heads: int, num_kv_heads: int, head_dim: int,
                 intermediate: int, activation: str = "silu"):
        self.lib, self.eps = lib, eps
        self.nh, self.nkv, self.hd, self.inter = num_heads, num_kv_heads, head_dim, intermediate
        self.act = ACTIVATIONS.index(activation)
        self._base: np.ndarray | None = None  # qg_layers' table but the per-step fields
        self._base_key: tuple = ()

    @staticmethod
    def _ptr(v) -> int:
        if v is None:
            return 0
        return (v.packed if isinstance(v, QuantWeight) else v).data_ptr()

    def _layer_table(self, layers: list[dict], kv_caches: list[tuple], ropes: list,
                     windows: list[int], metas: list, rows: int) -> tuple[np.ndarray, list]:
        """``qg_layers``' table: each layer's weights, RoPE tables, window and pools (built once per
        set of pools: the tensors they point at live as long as the model), then its KV group's
        slot mapping and attention rows for this step; with the step's tensors it points at (kept
        alive by the caller)."""
        # every pool value the base holds: new pools may reuse some old addresses (freed pools'
        # memory handed out again) and not others, and a kept pointer would write into freed memory
        key = tuple((kc.data_ptr(), vc.data_ptr(), kc.shape[0]) for kc, vc in kv_caches)
        if self._base is None or key != self._base_key:
            base = [[self._ptr(layer.get(n)) for n in self.STATIC]
                    + [rope.cos.data_ptr(), rope.sin.data_ptr(), rope.cos.shape[0], window,
                       kc.data_ptr(), vc.data_ptr(), kc.shape[0]] + [0] * self.STEP_FIELDS
                    for layer, (kc, vc), rope, window in zip(layers, kv_caches, ropes, windows)]
            assert len(base[0]) == self.lib.qg_layer_fields()
            self._base, self._base_key = np.array(base, dtype=np.int64), key
        table, keep = self._base.copy(), []  # numpy: a step's few small writes cost microseconds
        groups: dict[int, list[int]] = {}  # a hybrid pool's KV groups: the layers of each metadata
        for i, meta in enumerate(metas):
            groups.setdefault(id(meta), []).append(i)
        for idx in groups.values():
            meta = metas[idx[0]]
            plan, slots = meta.row_plan(rows), meta.slot_mapping.contiguous()
            keep += [plan, slots]
            table[idx, -self.STEP_FIELDS:] = (slots.data_ptr(), slots.shape[0], plan.tables.data_ptr(),
                                              plan.tables.shape[1], plan.seq.data_ptr(),
                                              plan.pos.data_ptr())
        return table, keep

    def all_layers(self, h: torch.Tensor, layers: list[dict], kv_caches: list[tuple],
                   ropes: list, windows: list[int], positions: torch.Tensor, metas: list,
                   scale: float) -> torch.Tensor:
        """Every layer in one call (``qg_layers``: ``pre``, the C attention on the layer's KV
        group's rows (``attention.RowPlan``) and window, ``post``, as the per-layer loop calls
        them): ``h`` updated in place and returned. ``metas``: each layer's attention metadata."""
        rows, dim = h.shape
        kc = kv_caches[0][0]
        table, keep = self._layer_table(layers, kv_caches, ropes, windows, metas, rows)
        bad = self.lib.qg_layers(
            h.data_ptr(), rows, dim, len(layers), table.ctypes.data, self.eps, self.nh, self.nkv,
            self.hd, self.inter, self.act, positions.data_ptr(), kv_kind(kc), kc.shape[1], scale,
            torch.get_num_threads())
        del keep
        check_attention(bad, f"{rows}-row layers' activations")
        if bad:
            raise IndexError(f"{bad} positions outside the model's RoPE positions")
        return h

    def pre(self, h: torch.Tensor, pending: torch.Tensor | None, layer: dict, rope,
            positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            slots: torch.Tensor) -> torch.Tensor:
        """``h += pending``; RMSNorm, Q/K/V, QK-norm, RoPE, the K/V write: the queries
        [rows, nh, hd]."""
        rows, dim = h.shape
        q = torch.empty(rows, self.nh, self.hd, dtype=torch.float32)
        p = self._ptr
        bad = self.lib.qg_layer_pre(
            h.data_ptr(), p(pending), layer["in_norm"].data_ptr(), self.eps, rows, dim,
            p(layer["qkv"]), p(layer["qkv_bias"]), p(layer.get("q_norm")), p(layer.get("k_norm")),
            self.nh, self.nkv, self.hd, rope.cos.data_ptr(), rope.sin.data_ptr(),
            rope.cos.shape[0], positions.data_ptr(), q.data_ptr(), k_cache.data_ptr(),
            v_cache.data_ptr(), kv_kind(k_cache), slots.data_ptr(), slots.shape[0],
            torch.get_num_threads())
        if bad < 0:
            raise MemoryError(f"no memory for a {rows}-row layer's activations")
        if bad:
            raise IndexError(f"{bad} positions outside the model's {rope.cos.shape[0]} RoPE positions")
        return q

    def post(self, o: torch.Tensor, h: torch.Tensor, layer: dict) -> torch.Tensor:
        """Output projection (and its norm), ``h += attn``, RMSNorm and the MLP (and its norm):
        the MLP's output [rows, dim] (added to ``h`` by the next ``pre``)."""
        rows, dim = h.shape
        out = torch.empty(rows, dim, dtype=torch.float32)
        p = self._ptr
        if self.lib.qg_layer_post(o.data_ptr(), o.numel() // rows, h.data_ptr(),
                                  layer["post_norm"].data_ptr(), p(layer.get("attn_out_norm")),
                                  p(layer.get("mlp_out_norm")), self.act, self.eps, rows, dim,
                                  p(layer["o"]), p(layer["gate_up"]), self.inter, p(layer["down"]),
                                  out.data_ptr(), torch.get_num_threads()):
            raise MemoryError(f"no memory for a {rows}-row layer's activations")
        return out
