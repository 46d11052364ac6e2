"""The model's matrix multiplies: how weights are held (dense in the compute dtype, or int8 / int4
weight-only quantized) and which kernel multiplies with them, plus the row count from which that
kernel is batch-invariant.

Weight modes (``--weights``):

- ``gguf`` (what ``auto`` means on a CPU with AVX2+FMA or better, for a GGUF model):
  the file's own Q4_0 / Q4_1 / Q8_0 blocks multiplied with activations rounded to 16-bit integers
  per block of 32 (``qlinear.py``); tensors of other types run as in ``mixed``.
- ``dense`` (alias ``bf16``): weights in the compute dtype. On CPU in fp32 they are prepacked for
  oneDNN; in bf16 they go through oneDNN's AMX/AVX512-BF16 GEMM.
- ``mixed`` (what ``auto`` means in a 16-bit dtype elsewhere): the GEMMs named by ``llama.MIXED_FP32_GEMMS``
  (all of them: Q/K/V, output, gate/up, down and the LM head) take fp32 activations and accumulate
  in fp32, while the KV pool stays in the compute dtype. On an x86 CPU their weights are held in
  fp16 and widened inside FBGEMM's GEMM (``torch.ops.quantized.linear_dynamic_fp16``): half the
  bytes of fp32 read per decode step, at about fp32's prefill speed. It is the activations' rounding
  to bf16 that costs quality, not the weights' (measured: the same top-1 with bf16-rounded weights
  and fp32 activations as with fp32 weights). Where that kernel is missing, the weights are held in
  fp32 (``high_linear``).
- ``int8``: per-output-channel symmetric int8 with a scale per row (``torch._weight_int8pack_mm``):
  half the bytes of bf16 read per decode step.
- ``int4``: asymmetric 4-bit in groups of 32 along the input dimension with a scale and an offset per
  group (``torch._weight_int4pack_mm_for_cpu``) -- the GGUF's own Q4_1 layout, so a Q4_1 checkpoint
  keeps its 4-bit values (its scales and offsets rounded to the compute dtype): about a quarter of
  the bytes of bf16. The kernel takes 16-bit activations only (fp32 runs ~50x slower).

Every mode uses one kernel for every row of every step (prefill and decode alike), so cold == warm
holds in each of them.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hotprefix.config.sections import WEIGHT_MODES  # noqa: F401  (re-exported)
from hotprefix.files.atomic import write_atomic
from hotprefix.files.cachedir import cache_dir
from hotprefix.model.dtype_probe import cpu_flags
from hotprefix.model.qlinear import fast_block_kernels

log = logging.getLogger(__name__)

INT4_GROUP = 32
"""Input-dimension group of the int4 mode: GGUF Q4_0/Q4_1 blocks hold 32 weights."""


def _onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def pick_linear(device: torch.device, dtype: torch.dtype):
    """(pack, linear): on CPU in fp32, weights prepacked for oneDNN, whose GEMV streams weights
    about twice as fast as the default BLAS path on this class of CPU; elsewhere plain F.linear.
    The oneDNN path is probed once and skipped if this torch build lacks it."""
    if device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available():
        try:
            w = torch.randn(8, 4)
            x = torch.randn(3, 4)
            if torch.allclose(_onednn_linear(x, w.to_mkldnn(), None), F.linear(x, w), atol=1e-5):
                return (lambda t: t.contiguous().to_mkldnn()), _onednn_linear
        except (AttributeError, RuntimeError):
            pass
    return (lambda t: t), F.linear


MIN_ROWS_AMX = 16
"""Fewest GEMM rows in bf16/fp16 on a CPU with AMX: one tile. With fewer rows oneDNN may run its
AVX-512 kernel instead, whose rounding differs from the tile unit's."""
MIN_ROWS_REDUCED = 2
"""Fewest GEMM rows in bf16/fp16 on other CPUs: one row takes a different path whose bits differ
from every other row count (seen inside one process with real activations, not with random
inputs, so no start-up probe can clear it)."""


def invariant_min_rows(linear, weights: list[torch.Tensor], in_dims: list[int], device, dtype) -> int:
    """Fewest rows from which ``linear`` gives every row the same bits whatever the row count.

    A GEMM library may switch kernels with the number of rows (a GEMV for one row, another
    blocking for two or three), and a row's reduction order switches with it. The forward pass pads
    smaller batches up to this many rows, so a token's arithmetic never depends on how many tokens
    share its step. Probed on the model's own weights, from a floor: for bf16 and fp16 on CPU,
    ``MIN_ROWS_AMX`` where the CPU has AMX and ``MIN_ROWS_REDUCED`` elsewhere; 1 otherwise.
    """
    floor = 1
    if device.type == "cpu" and dtype != torch.float32:
        floor = MIN_ROWS_AMX if "amx_bf16" in cpu_flags() else MIN_ROWS_REDUCED
    counts = [m for m in (1, 2, 3, 4, 5, 8, 16, 17, 64) if m >= floor]
    g = torch.Generator().manual_seed(0)
    need = floor
    for w, k in zip(weights, in_dims):
        x = torch.randn(64, k, generator=g).to(device=device, dtype=dtype)
        first = {m: linear(x[:m], w, None)[0] for m in counts}
        lo = counts[-1]
        for m in reversed(counts[:-1]):
            if not torch.equal(first[m], first[counts[-1]]):
                break
            lo = m
        need = max(need, lo)
    if need > MIN_ROWS_AMX:
        log.warning("no row count up to %d gives row-invariant GEMMs on this %s build; "
                    "cold and warm results may differ in the last bits", MIN_ROWS_AMX, dtype)
    return min(need, MIN_ROWS_AMX)


def _pack_int8(w: torch.Tensor, dtype: torch.dtype):
    w = w.float()
    scale = (w.abs().amax(1) / 127).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    return q, scale.to(dtype)


def _int8_linear(x: torch.Tensor, w, b: torch.Tensor | None) -> torch.Tensor:
    y = torch._weight_int8pack_mm(x, w[0], w[1])
    return y if b is None else y + b


def _pack_int4(w: torch.Tensor, dtype: torch.dtype):
    n, k = w.shape
    g = w.float().view(n, k // INT4_GROUP, INT4_GROUP)
    lo = g.amin(-1, keepdim=True)
    scale = ((g.amax(-1, keepdim=True) - lo) / 15).clamp(min=1e-12)
    q = torch.round((g - lo) / scale).clamp(0, 15).to(torch.int32).view(n, k)
    # the kernel dequantizes (q - 8) * scale + zero
    zero = lo + 8 * scale
    sz = torch.stack([scale.view(n, -1), zero.view(n, -1)], -1).transpose(0, 1).contiguous().to(dtype)
    return torch._convert_weight_to_int4pack_for_cpu(q, 1), sz


def _int4_linear(x: torch.Tensor, w, b: torch.Tensor | None) -> torch.Tensor:
    y = torch._weight_int4pack_mm_for_cpu(x, w[0], INT4_GROUP, w[1])
    return y if b is None else y + b


class Fp16Weight:
    """A weight held in fp16 and packed for FBGEMM's fp16 x fp32 GEMM."""

    __slots__ = ("packed", "nbytes")

    def __init__(self, w: torch.Tensor):
        self.packed = torch.ops.quantized.linear_prepack_fp16(w.float().contiguous(), None)
        self.nbytes = w.numel() * 2


def _fp16_linear(x: torch.Tensor, w: Fp16Weight, b: torch.Tensor | None) -> torch.Tensor:
    y = torch.ops.quantized.linear_dynamic_fp16(x, w.packed)
    return y if b is None else y + b


FP16_PROBE_ROWS = (1, 2, 3, 7, 8, 17, 32, 64, 200, 300)
"""Row counts at which the fp16-weight GEMM's rows are compared with the same rows of a
300-row product (FBGEMM's AVX2 kernels change a row's bits at 1, 2, 7, 32 and 200 rows; its
AVX-512 ones at none)."""


@functools.cache
def fp16_weights_available() -> bool:
    """Whether the mixed mode holds fp16 weights: this torch build has the fp16-weight GEMM
    (``fp16_gemm_exists``) and its rows keep their bits at every row count probed
    (``fp16_rows_invariant``: cold == warm needs it; where it fails the weights are held in fp32).
    The row probe's answer is remembered per torch build and CPU (``remembered_probe``)."""
    return fp16_gemm_exists() and remembered_probe("fp16-rows-invariant", fp16_rows_invariant,
                                                   FP16_PROBE_ROWS)


def remembered_probe(name: str, probe: Callable[[], bool], depends: object = None) -> bool:
    """``probe()``, remembered under the cache directory per torch version, CPU flags and
    ``depends`` (what else its answer depends on): a probe costs ~0.4 s of each start. An entry
    that cannot be read or written is passed over (the probe runs)."""
    key = "\0".join([name, torch.__version__, torch.backends.cpu.get_cpu_capability(),
                     " ".join(sorted(cpu_flags())), repr(depends)])
    path = cache_dir("probes") / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    try:
        return {"1": True, "0": False}[path.read_text()]
    except (OSError, KeyError):
        pass
    answer = probe()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, b"1" if answer else b"0", mode=0o644)
    except OSError as e:
        log.info("probe %s not remembered (%s)", name, e)
    return answer


@functools.cache
def fp16_gemm_exists() -> bool:
    """Whether this torch build multiplies fp32 activations with fp16-held weights on CPU (FBGEMM,
    x86 builds), checked on a small product against fp32 arithmetic on the fp16-rounded weight."""
    try:
        g = torch.Generator().manual_seed(0)
        w, x = torch.randn(24, 64, generator=g), torch.randn(3, 64, generator=g)
        y = _fp16_linear(x, Fp16Weight(w), None)
        return y.dtype == torch.float32 and torch.allclose(y, x @ w.half().float().T, atol=1e-4)
    except (AttributeError, RuntimeError):
        return False


def fp16_rows_invariant() -> bool:
    """Whether the fp16-weight GEMM gives each row the same bits at every row count probed."""
    g = torch.Generator().manual_seed(1)
    w = Fp16Weight(torch.randn(576, 1536, generator=g) * 0.05)
    x = torch.randn(FP16_PROBE_ROWS[-1], 1536, generator=g)
    full = _fp16_linear(x, w, None)
    for m in FP16_PROBE_ROWS:
        if not (torch.equal(_fp16_linear(x[:m], w, None), full[:m])
                and torch.equal(_fp16_linear(x[-m:], w, None), full[-m:])):
            log.info("fp16-weight GEMM not row-invariant on this CPU (at %d rows): the mixed "
                     "mode holds its weights in fp32", m)
            return False
    return True


def high_linear(device: torch.device) -> tuple[Callable, Callable, str]:
    """(pack, linear, tag) of the ``mixed`` mode's fp32-activation GEMMs: fp16-held weights on a
    CPU whose torch has FBGEMM (tag ``w16``), fp32 weights elsewhere (tag ``w32``). The tag enters
    the cache namespace: the two give different bits."""
    if device.type == "cpu" and fp16_weights_available():
        return Fp16Weight, _fp16_linear, "w16"
    pack, linear = pick_weight_linear("dense", device, torch.float32)
    return pack, linear, "w32"


def resolve_weights(mode: str, device: torch.device, dtype: torch.dtype) -> str:
    """The weight mode to run.

    ``auto`` is, when the compute dtype is 16-bit, ``gguf`` on a CPU whose vector path runs the
    block kernel (``qlinear.fast_block_kernels``: AVX2+FMA or better; the model falls back to ``mixed`` without GGUF blocks)
    and ``mixed`` elsewhere, and ``dense`` in fp32: the default keeps >= 99% top-1 agreement with
    an fp32 reference (``benchmarks/bench_quality.py``). ``bf16`` means
    dense (every GEMM in the compute dtype: the fastest to prefill on this project's CPU, about 1
    point of top-1 below fp32 in bf16). ``mixed`` in fp32 is dense. The quantized modes run on CPU
    only.
    """
    if mode == "auto" and dtype != torch.float32 and device.type == "cpu" and fast_block_kernels():
        return "gguf"
    if mode in ("auto", "mixed"):
        return "dense" if dtype == torch.float32 else "mixed"
    if mode in ("bf16", "dense"):
        return "dense"
    if device.type != "cpu":
        raise ValueError(f"weights={mode!r} runs on CPU only; use weights='auto' on {device.type}")
    return mode


def pick_weight_linear(mode: str, device: torch.device, dtype: torch.dtype) -> tuple[Callable, Callable]:
    """(pack, linear) for a resolved weight mode: ``pack(w)`` turns an fp32 [out, in] weight into
    what ``linear(x, packed, bias)`` multiplies with."""
    if mode == "int8":
        return (lambda t: _pack_int8(t, dtype)), _int8_linear
    if mode == "int4":
        return (lambda t: _pack_int4(t, dtype)), _int4_linear
    if mode not in ("dense", "mixed", "gguf"):  # gguf: the tensors without blocks run as mixed
        raise ValueError(f"unknown weight mode {mode!r}")
    pack, linear = pick_linear(device, dtype)
    return (lambda t: pack(t.to(device=device, dtype=dtype).contiguous())), linear


def weight_bytes(packed) -> int:
    """Bytes held for one packed weight."""
    if isinstance(packed, tuple):
        return sum(weight_bytes(t) for t in packed)
    if not isinstance(packed, torch.Tensor):  # Fp16Weight, qlinear.QuantWeight
        return packed.nbytes
    if packed.is_mkldnn:
        return packed.numel() * packed.element_size()
    return packed.untyped_storage().nbytes()
