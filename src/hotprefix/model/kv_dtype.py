"""The KV pool's element type (``CacheConfig.kv_cache_dtype``): what a cached token costs in bytes.

A pool holds K and V per layer as ``[num_blocks, block_size, num_kv_heads, row]`` tensors:

- ``bf16`` / ``fp16`` / ``fp32``: ``row = head_dim`` values of that dtype;
- ``int8``: ``row = head_dim + 4`` bytes: the head's values as int8, then the row's scale as a
  float32 (native byte order) in the row's last 4 bytes. The scale is ``absmax / 127`` over that one
  (token, KV head) row and ``q = clamp(round_half_even(x / scale), -127, 127)``; it reads back as
  ``float(q) * scale`` (one IEEE multiply, the same in torch and in every ISA path of ``attn.c``).
  A row's bytes depend on its own values alone, never on the batch, the chunk or other heads. A row
  of zeros (or whose scale underflows to 0) is stored as zeros with scale 0; a row holding a NaN or
  an infinity is stored as zeros with a NaN scale (it reads back as NaN, as a 16-bit pool would
  hold the non-finite value; ``quantize_int8`` refuses such input when asked to check).

Values are rounded once, when they are written (by a prefill, a decode step or a tier load, which
copies the bytes), and every reader widens the same bytes the same way, so a cached prefix gives
the bits of a recomputed one. Scales live inside the rows, so every byte of the pool is counted in
``bytes_per_token``, tier payloads carry them, and blocks move as plain bytes.

This module knows nothing about the model: only dtypes, shapes and the rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hotprefix.config.sections import ConfigError
from hotprefix.model.metadata import KV_ELEMENT_BYTES, KVShape

INT8_SCALE_BYTES = KV_ELEMENT_BYTES["int8"][1]
"""Bytes of an int8 row's scale (float32), after its ``head_dim`` values."""
INT8_MAX = 127.0
"""Largest magnitude a quantized value takes (symmetric: -127..127, -128 unused)."""

KIND_FP32, KIND_BF16, KIND_INT8 = 0, 1, 2
"""The C kernels' code for a pool's element type (their ``kv`` argument)."""


@dataclass(frozen=True)
class KVDtype:
    """One KV pool element type."""

    name: str
    """Canonical name: ``bf16``, ``fp16``, ``fp32`` or ``int8`` (in the numerics tag and the tier
    layout tag)."""
    torch_dtype: torch.dtype
    """The pool tensors' dtype."""
    row_extra: int = 0
    """Elements of a row past its ``head_dim`` values (the int8 scale's bytes)."""

    def row(self, head_dim: int) -> int:
        """Elements of one (token, KV head) row of the pool."""
        return head_dim + self.row_extra

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """Pool bytes one token costs, K and V of every layer, scales included (the one formula:
        ``hotprefix.model.metadata.KVShape.bytes_per_token``)."""
        return KVShape(num_layers, num_kv_heads, head_dim).bytes_per_token(self.name)

    @property
    def kind(self) -> int | None:
        """The C kernels' code for this type, None where they do not read it (fp16)."""
        return {"fp32": KIND_FP32, "bf16": KIND_BF16, "int8": KIND_INT8}.get(self.name)

    @property
    def quantized(self) -> bool:
        return self.name == "int8"


KV_DTYPES = {
    "bf16": KVDtype("bf16", torch.bfloat16),
    "fp16": KVDtype("fp16", torch.float16),
    "fp32": KVDtype("fp32", torch.float32),
    "int8": KVDtype("int8", torch.int8, INT8_SCALE_BYTES),
}
ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
           "float": "fp32"}
_BY_TORCH = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def resolve_kv_dtype(name: str, compute_dtype: torch.dtype, device: torch.device,
                     explicit_dtype: bool) -> KVDtype:
    """The pool's element type for ``kv_cache_dtype`` ``name``.

    ``auto``: the compute dtype where it is 16-bit; bf16 where the compute dtype is fp32 because
    ``dtype`` was ``auto`` (a CPU without fast bf16 matmuls: attention widens K/V to fp32 as it
    reads them, so bf16 costs the arithmetic nothing and halves the bytes); fp32 only where
    ``dtype="float32"`` was asked for explicitly (fp32 numerics end to end, the reference mode).

    Raises:
        ConfigError: an unknown name, or fp8 (no fp8 KV path on CPU: use int8).
    """
    key = ALIASES.get(name, name)
    if key == "auto":
        if compute_dtype == torch.float32 and not explicit_dtype:
            return KV_DTYPES["bf16"]
        return KV_DTYPES[_BY_TORCH[compute_dtype]]
    if key.startswith("fp8"):
        raise ConfigError(f"kv_cache_dtype={name!r}: fp8 K/V are not supported on "
                          f"{'CPU' if device.type == 'cpu' else device.type} by hotprefix; "
                          "int8 (a scale per token and KV head) halves the bytes the same way")
    if key not in KV_DTYPES:
        raise ConfigError(f"kv_cache_dtype must be auto, bf16, fp16, fp32, int8 or fp8, got {name!r}")
    return KV_DTYPES[key]


def kv_dtype_of(cache: torch.Tensor) -> KVDtype:
    """The element type of a pool tensor."""
    return KV_DTYPES["int8" if cache.dtype == torch.int8 else _BY_TORCH[cache.dtype]]


def head_dim_of(cache: torch.Tensor) -> int:
    """``head_dim`` of a pool tensor (its rows less the int8 scale)."""
    return cache.shape[-1] - kv_dtype_of(cache).row_extra


def quantize_int8(x: torch.Tensor, check_finite: bool = False) -> torch.Tensor:
    """``x [..., head_dim]`` (any float dtype, read as fp32) -> int8 rows ``[..., head_dim + 4]``
    (module docstring), each from its own values.

    Raises:
        ValueError: ``check_finite`` and a value is NaN or infinite.
    """
    x = x.float()
    if check_finite and not bool(torch.isfinite(x).all()):
        raise ValueError("int8 K/V: a value is NaN or infinite")
    amax = x.abs().amax(-1, keepdim=True)
    finite = torch.isfinite(x).all(-1, keepdim=True)
    scale = amax / INT8_MAX
    ok = finite & (scale > 0)
    q = torch.where(ok, x / torch.where(ok, scale, 1.0), 0.0)
    q = torch.round(q).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    scale = torch.where(finite, scale, torch.nan).masked_fill_(finite & ~ok, 0.0)
    return torch.cat([q, scale.contiguous().view(torch.int8)], -1)


def dequantize_int8(rows: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 rows ``[..., head_dim + 4]`` -> values ``[..., head_dim]``: ``float(q) * scale``."""
    hd = rows.shape[-1] - INT8_SCALE_BYTES
    scale = rows[..., hd:].contiguous().view(torch.float32)
    return (rows[..., :hd].float() * scale).to(out_dtype)


def to_pool(x: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
    """Values ``[..., head_dim]`` rounded to ``pool``'s element type (its row layout)."""
    if pool.dtype == torch.int8:
        return quantize_int8(x)
    return x.to(pool.dtype)


def from_pool(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Pool rows read back as ``dtype`` values ``[..., head_dim]``."""
    if rows.dtype == torch.int8:
        return dequantize_int8(rows, dtype)
    return rows.to(dtype)
