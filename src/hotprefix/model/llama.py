"""The decoder forward pass every architecture family shares, over a paged KV pool.

Embeddings (times the family's scale) -> N x the family's layer (``arch.base.Family.layer``,
written over the shared operators of ``arch.ops``: the Llama layer, or gemma3's or qwen3's) ->
RMSNorm -> LM head (a final logit softcap where the model has one). Here live what every family
shares: the weights as held for compute (weight modes, Q/K/V and gate/up fused into one matrix
each, so a layer is four GEMMs), padding to batch-invariant row counts, each layer's RoPE tables
and attention window (``ModelArch.local_layers``), which attention runs (the C kernel, with a
layer's window where it has one, or torch's), the fp32 refinement of the top logits, and
the gguf mode's C layer calls for families whose layer is the plain Llama one. Takes a flat batch of
tokens (prefill chunks and decodes of many sequences together) and returns logits only for the rows
asked for.

This module knows nothing about requests, the prefix cache or weight names in files.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from hotprefix.model.arch import family
from hotprefix.model.arch.base import MATRICES
from hotprefix.model.arch.ops import FusedOps, TorchOps, apply_rope, rms_norm
from hotprefix.model.attention import (KV_TILE, AttentionMetadata, GatherScratch, attention_dtype,
                                       paged_attention)
from hotprefix.model.isa import BY_NAME
from hotprefix.model.kv_dtype import KVDtype, resolve_kv_dtype
from hotprefix.model.fused import C_ATTN_CHUNK, C_ATTN_SEGMENT, fused_ops, library
from hotprefix.model.linear import (high_linear, invariant_min_rows,
                                    pick_weight_linear, resolve_weights, weight_bytes)
from hotprefix.model.loader import ModelArch
from hotprefix.model.qlinear import (GGUF_TYPES, NARROW_GEMMS, QUANT_NUMERICS, QUANT_NUMERICS_NARROW,
                                     BlockRows, QuantLayers, QuantLinear, QuantWeight, block_columns)
from hotprefix.model.gguf_blocks import PackError
from hotprefix.model.rope import inverse_frequencies

log = logging.getLogger(__name__)

REFINE_TOP_K = 32
"""Logits recomputed in fp32 per row when the LM head runs in bf16 or quantized (the rest keep
their low-precision value): greedy picks and near-tie probabilities are those of an fp32 head."""
MIXED_FP32_GEMMS = frozenset({"qkv", "o", "gate_up", "down", "head"})
"""The GEMMs that the ``mixed`` weight mode runs on fp32 inputs (weights held in fp16 or fp32, see
``linear.high_linear``): all of them. Rounding their inputs to bf16 costs about a point of top-1
agreement with an fp32 reference (gate/up most, then Q/K/V and down). Q/K/V, gate/up and down
alone reach 99.7% on the quality benchmark's 2,048 positions; the output projection and the LM head
too, 99.95% (mean KL 2.6e-5), and with fp16-held weights the LM head streams faster at decode than
in bf16 (measured with ``hotprefix.tools.quality``)."""

QUANT_LAYER_MAX_ROWS = 8192
"""Most rows a forward pass runs through the gguf mode's layer calls (``qlinear.QuantLayers``);
longer steps call the same kernels one by one (the same bits). The calls keep their scratch between
steps (``scratch.h``) and run the MLP 512 rows at a time, so a 2,048-row prefill no longer pays
fresh pages every call (it once did: 513 against 620 tok/s, which set this at 512): 1B Q4_K_M
prefill 2,048 went from 165 to 186 tok/s, 512 from 192 to 210-220."""

HEAD_FP32_GEMMS = frozenset({"head"})
"""The GEMMs that the other 16-bit CPU modes (dense, int8, int4) run on fp32 inputs: only the LM
head, with fp16-held weights where torch's kernel for them is row-invariant, else fp32 ones
(``linear.high_linear``: FBGEMM's AVX2 kernels are not). It runs on a few rows a step (the logits
rows), where an fp16 head streams faster than a bf16 or int4 one, and its logits are those of fp32
inputs (an int4 head cost the int4 mode most of its KL divergence)."""


class RotaryEmbedding:
    """cos/sin tables (Hugging Face rotate-half layout) computed once up to max_position, in
    float64 and then rounded to ``dtype``; ``freq_factors`` divide the frequencies (llama3 RoPE
    scaling, ``ModelArch.rope_freq_factors``).

    The float64 cos and sin are numpy's, each row on one thread: torch's, on two threads, gave the
    positions its intra-op worker computed values about 1e-9 off in about one process in five
    (that worker's first call), a float32 ULP apart in a few entries, so one start's K/V differed
    from another's. numpy's round to the same float32 tables as torch's on one thread (checked on
    55 M entries, head sizes 64-256, bases 1e4-1e6)."""

    def __init__(self, head_dim: int, theta: float, max_position: int, device, dtype,
                 freq_factors: tuple[float, ...] | None = None):
        inv = inverse_frequencies(head_dim, theta, freq_factors).numpy()
        half = inv.shape[0]
        cos = np.empty((max_position, 2 * half), np.float32)
        sin = np.empty((max_position, 2 * half), np.float32)

        def rows(lo: int, hi: int) -> None:  # numpy's ufuncs let go of the GIL: rows on threads
            freqs = np.outer(np.arange(lo, hi, dtype=np.float64), inv)
            for fn, out in ((np.cos, cos), (np.sin, sin)):
                fn(freqs, out=out[lo:hi, :half], casting="same_kind")  # float64, then rounded
                out[lo:hi, half:] = out[lo:hi, :half]

        threads = max(1, torch.get_num_threads())
        step = -(-max_position // threads)
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(rows, range(0, max_position, step), range(step, max_position + step, step)))
        self.cos = torch.from_numpy(cos).to(device=device, dtype=dtype)
        self.sin = torch.from_numpy(sin).to(device=device, dtype=dtype)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


_apply_rope = apply_rope  # the names the tests import
_rms_norm = rms_norm


def c_attention_fast(lib) -> bool:
    """Whether ``attn.c`` has a vector path at the level ``lib`` was built for (the default
    attention there); the portable path gives the same bits, slower than torch's kernel."""
    return BY_NAME[lib.isa].fast_gemm


@dataclass
class _Packer:
    """Puts one GEMM's weight (a file tensor, or several concatenated: Q/K/V, gate/up) in the form
    the weight mode computes with: the gguf mode's blocks where they pack, else a dense matrix for
    the compute dtype's GEMM or the fp32-input one (``fp32_ops``)."""

    weights: dict[str, torch.Tensor]
    blocks: dict[str, tuple]
    qlib: Any
    """The block kernel's library (gguf mode), else None."""
    pack: Callable
    pack32: Callable
    fp32_ops: frozenset
    gguf: bool
    narrow_ops: frozenset
    """The GEMMs whose blocks round their activations to 8 bits (``NARROW_GEMMS`` or none)."""
    kept: Any = None
    """Packed weights from an earlier start (``packed_store.PackedStore``), or None."""

    def blocks_of(self, op: str, names: list[str]) -> QuantWeight:
        """The named tensors' blocks packed (or taken from ``kept``). Raises PackError."""
        narrow = op in self.narrow_ops
        return QuantWeight([self.blocks[n] for n in names], block_columns(*self.blocks[names[0]]),
                           self.qlib, narrow=narrow, kept=self.kept,
                           key=f"{op}:{','.join(names)}")  # the width: the store's name

    def __call__(self, op: str, names: list[str]):
        if self.gguf and all(n in self.blocks for n in names):
            try:
                return self.blocks_of(op, names)
            except PackError as e:  # dequantized: the mixed mode's GEMM, fp16 or fp32 weights
                log.warning("%s: %s; dequantized for the fp32-input GEMM", ", ".join(names), e)
        w = self.weights
        t = w[names[0]] if len(names) == 1 else torch.cat([w[n] for n in names], 0)
        return self.pack32(t) if op in self.fp32_ops else self.pack(t)


class LlamaModel:
    """Weights + forward. Not an nn.Module: no autograd, no hooks, just tensors."""

    def __init__(self, arch: ModelArch, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype, weight_mode: str = "auto", fused_kernels: bool = True,
                 blocks: dict[str, tuple] | None = None, kv_dtype: KVDtype | None = None,
                 activations: str = "int16", kept=None, positions: int | None = None):
        """``kept``: packed weights from an earlier start (``packed_store.PackedStore``): the gguf
        mode takes its buffers from there where they match, and hands it those it packs.
        ``positions``: how many positions the RoPE tables cover (None: the model's
        ``max_position``); a position past them is refused (IndexError), never read."""
        self.positions = positions or arch.max_position
        self.arch = arch
        self.family = family(arch.arch)
        self.device, self.dtype = device, dtype
        self.kv_dtype = kv_dtype or resolve_kv_dtype("auto", dtype, device, explicit_dtype=True)
        """The pool's element type (``kv_dtype.py``; None: the compute dtype's), which the K/V
        writes round to."""
        blocks = blocks or {}
        qlib = self._resolve_weight_mode(weight_mode, blocks)
        pack, pack32, high_tag = self._pick_kernels(fused_kernels, qlib)
        self.all_layers_call = True
        """With the gguf mode's layer calls and the C attention, a forward pass's layers run in
        one C call (``qlinear.QuantLayers.all_layers``); off, one Python loop iteration a layer
        makes the same calls (tests compare the two)."""
        self.narrow = activations == "int8" and self.weight_mode == "gguf"
        """The gguf mode's layer GEMMs round their inputs to 8 bits (``ModelConfig.activations``)."""
        if activations == "int8" and not self.narrow:
            log.warning("activations='int8' is the gguf mode's: running %s", self.weight_mode)
        self._hold_weights(weights, _Packer(weights, blocks, qlib, pack, pack32, self.fp32_ops,
                                            self.weight_mode == "gguf",
                                            NARROW_GEMMS if self.narrow else frozenset(), kept))
        self.numerics = self._numerics_tag(high_tag, qlib)
        """What the K/V values depend on besides the weights: compute dtype, weight mode (and how
        its fp32-input GEMMs hold weights), which attention ran (the C kernel with its key chunk and
        segment, or torch's in a dtype and key tile, ``KV_TILE``: a row's key count), whether
        the fused kernels ran the elementwise work (their RMSNorm, SiLU and GELU round
        differently; ``fused-gelu``), whether the embedding's rows come in fp32 from the gguf
        mode's blocks (``emb32``) rather than in the compute dtype, the ISA level the C kernels
        were built for (``isa``: every level gives the portable path's bits, tested, but the torch
        operators around them may not, so levels do not share), and the KV pool's element type
        where it is not the compute dtype's (``kv-bf16``, ``kv-int8``)."""
        self._layer_tables()
        self.quant_layers = self._quant_layers(qlib)
        """The gguf mode's two-call layers (``qlinear.QuantLayers``), or None."""
        self.min_rows = self._min_rows()
        """Rows every GEMM's input is padded to, so each row takes the same (row-invariant) kernel."""

    def _resolve_weight_mode(self, weight_mode: str, blocks: dict[str, tuple]):
        """Sets ``weight_mode`` (gguf falls back to mixed without the kernels or the blocks) and the
        GEMMs that run on fp32 inputs (``fp32_ops``); returns the block kernel's library where
        gguf was resolved to and it builds, else None (used only in the gguf mode)."""
        self.weight_mode = resolve_weights(weight_mode, self.device, self.dtype)
        # the gguf mode: the file's own weight blocks through the block kernel (qlinear.py), where
        # the kernels build and the model has blocks
        qlib = library() if self.weight_mode == "gguf" else None
        if self.weight_mode == "gguf" and (qlib is None or not blocks):
            if weight_mode != "auto":
                log.warning("weights='gguf' needs %s: running weights='mixed'",
                            "the compiled kernels" if qlib is None else
                            f"a GGUF model with {'/'.join(GGUF_TYPES)} tensors")
            self.weight_mode = "mixed"
        if self.weight_mode in ("mixed", "gguf"):
            self.fp32_ops = MIXED_FP32_GEMMS
        elif self.dtype != torch.float32 and self.device.type == "cpu":
            self.fp32_ops = HEAD_FP32_GEMMS
        else:
            self.fp32_ops = frozenset()
        return qlib

    def _pick_kernels(self, fused_kernels: bool, qlib) -> tuple:
        """Sets the GEMMs (``linear``, ``linear32``), the attention (``attn_dtype``, ``fused``,
        ``c_attention``, ``scratch``); returns the two weight packers and the fp32 GEMMs' tag."""
        arch, device, dtype = self.arch, self.device, self.dtype
        pack, self.linear = pick_weight_linear(self.weight_mode, device, dtype)
        pack32, self.linear32, high_tag = (high_linear(device) if self.fp32_ops
                                           else (pack, self.linear, ""))
        if self.weight_mode == "gguf":
            self.linear32 = QuantLinear(qlib, self.linear32)
        self.attn_dtype = attention_dtype(device, dtype)
        # the elementwise work in fused C kernels where they build (fp32 attention: CPU only)
        self.fused = (fused_ops(fused_kernels, device, self.kv_dtype.torch_dtype, arch.rms_norm_eps,
                                arch.num_heads,
                                arch.num_kv_heads, arch.head_dim)
                      if self.attn_dtype == torch.float32 else None)
        # attention read straight from the pool in C (attn.c) where the kernels' level has its
        # vector path; else torch's kernel on K/V gathered into scratch reused across layers and steps
        self.c_attention = self.fused is not None and c_attention_fast(self.fused.lib)
        self.scratch = GatherScratch(self.fused.gather_widen_kv if self.fused else None)
        return pack, pack32, high_tag

    def _numerics_tag(self, high_tag: str, qlib) -> str:
        """The ``numerics`` tag (see there) of the modes and kernels chosen."""
        dtype, device = self.dtype, self.device
        high = ((f"-{QUANT_NUMERICS_NARROW if self.narrow else QUANT_NUMERICS}"
                 if self.weight_mode == "gguf" else "")
                + ("-emb32" if isinstance(self.embed, BlockRows) else "")  # rows from the blocks
                + (f"-{high_tag}" if high_tag else ""))
        attn = (f"/attn-c-k{C_ATTN_CHUNK}-s{C_ATTN_SEGMENT}" if self.c_attention
                else f"/attn-{str(self.attn_dtype).removeprefix('torch.')}-t{KV_TILE}")
        if self.c_attention and self.arch.local_layers:  # the windowed layers too, keys lo..p
            attn += "-window"
        clib = qlib if self.weight_mode == "gguf" else self.fused.lib if self.fused else None
        kv_tag = ("" if self.kv_dtype == resolve_kv_dtype("auto", dtype, device, True)
                  else f"/kv-{self.kv_dtype.name}")
        fused = ("/fused" + ("-gelu" if self.family.activation == "gelu_tanh" else "")
                 if self.fused else "")  # fused.c's GELU-tanh, not torch's
        return (f"{str(dtype).removeprefix('torch.')}/{self.weight_mode}{high}{attn}{fused}"
                + (f"/isa-{clib.isa}" if clib else "")
                + kv_tag)

    def _take(self, weights: dict[str, torch.Tensor], name: str,
              as_dtype: torch.dtype | None = None) -> torch.Tensor:
        return weights[name].to(device=self.device, dtype=as_dtype or self.dtype).contiguous()

    def _hold_weights(self, weights: dict[str, torch.Tensor], pk: _Packer) -> None:
        """Sets the weights as held for compute: the LM head (and its fp32 rows), the embedding,
        the final norm and each layer's norms, matrices and Q/K/V bias."""
        arch, device, dtype = self.arch, self.device, self.dtype
        head = "model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"
        self.lm_head = pk("head", [head])
        # the LM head's rows in fp32 when the GEMMs are not fp32: the top logits are refined with
        # them (an fp32 copy, or rows of the gguf mode's blocks dequantized when asked)
        self.head32 = (None if dtype == torch.float32 and self.weight_mode == "dense" else
                       BlockRows(pk.qlib, self.lm_head) if isinstance(self.lm_head, QuantWeight) else
                       weights[head].to(device=device, dtype=torch.float32).contiguous())
        # a tied embedding is read from those rows: exact inputs to the fp32 residual stream
        self.embed = (self.head32 if arch.tie_word_embeddings and self.head32 is not None
                      else self._embedding(weights, pk))
        self.norm = self._take(weights, "model.norm.weight", torch.float32)
        self.layers = []
        for i in range(arch.num_layers):
            p = f"model.layers.{i}."
            layer = {key: self._take(weights, p + name + ".weight", torch.float32)
                     for key, name in self.family.norms.items()}
            for op, names in MATRICES.items():
                layer[op] = pk(op, [p + n + ".weight" for n in names])
            layer["qkv_bias"] = None
            if arch.attention_bias:
                layer["qkv_bias"] = torch.cat(
                    [weights[p + f"self_attn.{n}_proj.bias"] for n in "qkv"], 0
                ).to(device=device, dtype=torch.float32 if "qkv" in self.fp32_ops else dtype)
            self.layers.append(layer)

    def _embedding(self, weights: dict[str, torch.Tensor], pk: _Packer):
        """An untied embedding: in the gguf mode its blocks, whose rows are dequantized to fp32
        when read (``BlockRows``: the file's values, no fp32 or bf16 copy of the table: 768 MiB
        of fp32 and 3 s of dequantizing for an 8B model's 128k x 4,096 at load); else the table
        in the compute dtype."""
        name = "model.embed_tokens.weight"
        if pk.gguf and name in pk.blocks:
            try:
                return BlockRows(pk.qlib, pk.blocks_of("embed", [name]))
            except PackError as e:
                log.warning("%s: %s; dequantized", name, e)
        return self._take(weights, name)

    def _layer_tables(self) -> None:
        """Sets each layer's RoPE tables and window, the embedding scale and the attention sizes."""
        arch, device = self.arch, self.device
        self.rope = RotaryEmbedding(arch.head_dim, arch.rope_theta, self.positions, device,
                                    torch.float32, arch.rope_freq_factors)
        local = set(arch.local_layers)
        local_rope = (RotaryEmbedding(arch.head_dim, arch.rope_theta_local or arch.rope_theta,
                                      self.positions, device, torch.float32)
                      if local else None)
        self.layer_rope = [local_rope if i in local else self.rope for i in range(arch.num_layers)]
        """Each layer's RoPE tables: the local layers' base (no scaling) or the global ones'."""
        self.layer_window = [arch.sliding_window if i in local else 0
                             for i in range(arch.num_layers)]
        """Each layer's sliding window in keys (0: every key up to the query's position)."""
        emb = self.family.embed_scale(arch)
        self.embed_scale = None if emb is None else torch.tensor(emb, dtype=torch.float32)
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.scale = arch.attn_scale if arch.attn_scale is not None else arch.head_dim ** -0.5

    def _quant_layers(self, qlib) -> QuantLayers | None:
        """The gguf mode with every layer matrix in blocks: a layer's work around attention in two
        calls (the family's layer, where it is one qlayer.c computes: ``Family.c_layers``)."""
        arch = self.arch
        if (self.weight_mode == "gguf" and self.fused is not None and self.family.c_layers) and all(
                isinstance(layer[op], QuantWeight) for layer in self.layers
                for op in ("qkv", "o", "gate_up", "down")):
            return QuantLayers(qlib, arch.rms_norm_eps, arch.num_heads, arch.num_kv_heads,
                               arch.head_dim, arch.intermediate_size, self.family.activation)
        return None

    def _min_rows(self) -> int:
        """Rows are padded to the larger of the two GEMM kinds' floors (a kind no GEMM uses has
        none); the block kernel is row-invariant by construction (exact integer sums, one float
        order: tested), so its weights need no probe."""
        arch = self.arch
        l0 = self.layers[0]
        probes = [("qkv", l0["qkv"], arch.hidden_size), ("down", l0["down"], arch.intermediate_size),
                  ("head", self.lm_head, arch.hidden_size)]
        min_rows = 1
        for kind, lin, dt_ in ((False, self.linear, self.dtype), (True, self.linear32, torch.float32)):
            mats = [(w, k) for op, w, k in probes
                    if (op in self.fp32_ops) == kind and not isinstance(w, QuantWeight)]
            if mats:
                min_rows = max(min_rows, invariant_min_rows(
                    lin, [w for w, _ in mats], [k for _, k in mats], self.device, dt_))
        return min_rows

    def weight_bytes(self) -> int:
        """Bytes of the weights as held for compute (the embedding table included)."""
        mats = [self.lm_head] if self.lm_head is not self.embed else []
        if isinstance(self.embed, BlockRows) and self.embed.weight is not self.lm_head:
            mats.append(self.embed.weight)  # an untied embedding's blocks
        if self.head32 is not None and self.head32 is not self.embed:
            mats.append(self.head32)
        for layer in self.layers:
            mats += [v for v in layer.values() if v is not None]
        return weight_bytes(self.embed) + weight_bytes(self.norm) + sum(weight_bytes(m) for m in mats)

    def _mm(self, x: torch.Tensor, w, b: torch.Tensor | None, op: str = "") -> torch.Tensor:
        """x @ w.T (+ b), padded to ``min_rows`` rows so every row takes the same GEMM kernel; an
        op of ``fp32_ops`` runs in fp32, the others in the compute dtype (the input cast whole)."""
        high = op in self.fp32_ops
        lin = self.linear32 if high else self.linear
        x = x.to(torch.float32 if high else self.dtype)
        n = x.shape[0]
        if n >= self.min_rows:
            return lin(x, w, b)
        return lin(torch.cat([x, x.new_zeros(self.min_rows - n, x.shape[1])]), w, b)[:n]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple],
                meta: AttentionMetadata, logits_rows: torch.Tensor | None) -> torch.Tensor:
        """Run the decoder over a flat batch.

        Args:
            input_ids: [num_tokens] token ids.
            positions: [num_tokens] absolute positions in their sequences.
            kv_caches: per layer (k_cache, v_cache), each [num_blocks, block_size, nkv, hd].
            meta: slot mapping and per-sequence block tables (see attention.py); a hybrid
                pool (``cache/kv_groups.py``) gives one per layer, the layers of a KV group
                sharing theirs.
            logits_rows: rows whose logits are wanted (None = all).

        Returns:
            [len(logits_rows), vocab_size] float32 logits.
        """
        a = self.arch
        # the residual stream, norms and RoPE stay in fp32 whatever the compute dtype: only GEMM
        # and attention inputs are rounded to it (a bf16 residual loses ~2 points of top-1)
        n_real = input_ids.shape[0]
        if n_real < self.min_rows:  # pad once here rather than at each GEMM
            pad = input_ids.new_zeros(self.min_rows - n_real)
            input_ids, positions = torch.cat([input_ids, pad]), torch.cat([positions, pad])
        h = self.embed[input_ids].float()
        if self.embed_scale is not None:
            h = h * self.embed_scale
        n = input_ids.shape[0]
        if self.quant_layers is not None and n <= QUANT_LAYER_MAX_ROWS:
            h = self._layers_quant(h, positions, kv_caches, meta, n_real)
        else:
            h = self._layers(h, positions, kv_caches, meta, n_real)
        h = h[logits_rows] if logits_rows is not None else h[:n_real]
        if self.fused is not None:
            h = self.fused.add_rms_norm(h.contiguous(), None, self.norm)
        else:
            h = _rms_norm(h, self.norm, a.rms_norm_eps)
        logits = self._mm(h, self.lm_head, None, "head").float()
        if self.head32 is not None:
            # a bf16 logit is rounded to 8 bits (1/16 at 10): near-ties flip the argmax. The top
            # candidates are recomputed in fp32 (row-local products and fixed-length sums)
            k = min(REFINE_TOP_K, logits.shape[-1])
            top = (self.fused.top_k(logits.contiguous(), k) if self.fused is not None
                   else logits.topk(k, dim=-1).indices)
            exact = (self.head32[top] * h.unsqueeze(1)).sum(-1)
            logits.scatter_(1, top, exact)
        if a.final_logit_softcap:
            cap = a.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

    def argmax(self, logits: torch.Tensor) -> list[int]:
        """Each row's argmax (greedy sampling): the C kernel where it runs, else torch's, with the
        same answer (the first index of the largest value, or of the first NaN)."""
        if self.fused is not None and logits.dtype == torch.float32 and logits.device.type == "cpu":
            return self.fused.argmax(logits.contiguous())
        return logits.argmax(dim=-1).tolist()

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, n_real: int, window: int = 0) -> torch.Tensor:
        """Attention for the fused layer loops; rows past ``n_real`` (padding) get zeros. A
        sliding-window layer (``window`` > 0): keys ``[p - window + 1, p]`` (the C kernel reads
        only those; torch's masks the others)."""
        if self.c_attention:
            plan = meta.row_plan(q.shape[0])
            return self.fused.attention(q, k_cache, v_cache, plan.tables, plan.seq, plan.pos,
                                        self.scale, window=window)
        o = paged_attention(q, k_cache, v_cache, meta, self.scale, self.scratch, window)
        if q.shape[0] > n_real:
            o[n_real:] = 0  # padding rows attend to nothing
        return o

    def _layers(self, h: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple],
                meta: AttentionMetadata | list[AttentionMetadata], n_real: int) -> torch.Tensor:
        """The decoder layers, the family's ``layer`` over the shared operators: the fused
        kernels' (``arch.ops.FusedOps``) where they build, else torch's (``TorchOps``)."""
        metas = meta if isinstance(meta, list) else None
        ops = (FusedOps if self.fused is not None else TorchOps)(
            self, positions, metas[0] if metas else meta, n_real)
        layer_fn, pending = self.family.layer, None
        for i, (layer, kv, rope, window) in enumerate(
                zip(self.layers, kv_caches, self.layer_rope, self.layer_window)):
            if metas is not None:
                ops.use(metas[i])
            pending = layer_fn(ops, layer, h, pending, kv, rope, window)
        return h.add_(pending.float())

    def _layers_quant(self, h: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple],
                      meta: AttentionMetadata | list[AttentionMetadata], n_real: int) -> torch.Tensor:
        """``_layers`` (the family's layer, fused kernels) with each layer's work before and after
        attention in one C call, or with the C attention, every layer in one call
        (``all_layers_call``; the same bits)."""
        ql = self.quant_layers
        positions = positions.contiguous()
        metas = meta if isinstance(meta, list) else [meta] * len(self.layers)
        if self.c_attention and self.all_layers_call:
            return ql.all_layers(h, self.layers, kv_caches, self.layer_rope, self.layer_window,
                                 positions, metas, self.scale)
        pending, slots = None, {}
        for layer, (k_cache, v_cache), rope, window, m in zip(
                self.layers, kv_caches, self.layer_rope, self.layer_window, metas):
            if id(m) not in slots:
                slots[id(m)] = m.slot_mapping.contiguous()
            q = ql.pre(h, pending, layer, rope, positions, k_cache, v_cache, slots[id(m)])
            o = self._attend(q, k_cache, v_cache, m, n_real, window)
            pending = ql.post(o, h, layer)
        return h.add_(pending)
