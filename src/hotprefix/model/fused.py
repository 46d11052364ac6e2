"""The decoder's elementwise work in fused C kernels (``fused.c``), called through ctypes.

At batch 1 a decode step is mostly small operators: a layer ran about 200 torch calls (RMSNorm
alone is seven, RoPE six, the K/V write and casts eight), each costing microseconds of dispatch
and a pass over memory, against four GEMMs. Four kernels replace them:

- ``add_rms_norm``: the residual add and the RMSNorm after it, in place on the residual stream;
- ``rope_write_kv``: RoPE on queries and keys, the K/V rounding to the pool's element type (bf16,
  fp32, or int8 with a scale per token and KV head: ``kv_dtype.py``) and the write through the slot
  mapping;
- ``act_mul``: SiLU(gate) * up or GELU-tanh(gate) * up;
- ``head_rms_norm``: QK-norm, each head's RMSNorm in place;
- ``gather_widen_kv``: a sequence's K and V blocks read from a bf16 or int8 pool into fp32 for
  attention.

``attn.c`` is attention itself, read straight from the pool (``attention``); ``select.c`` the
logits' top k (refined in fp32) and argmax (greedy sampling).

Their arithmetic is row-local and in a fixed order (fixed lanes, a fixed combining tree, no FMA
contraction), so a row's bits never depend on how many rows share the call, the thread count or the
CPU (the kernels' own bits, that is: the GEMMs and attention around them are torch's): cold == warm
holds. RoPE, the
roundings and the widening give the torch path's exact bits; RMSNorm and SiLU do not (another
summation order, another exp), so the numerics tag (cache namespace) says which path ran.

The source is compiled once per machine and ISA level (``isa.py``: portable, avx2, avxvnni,
avx512, amx; the one this CPU runs best unless ``$HOTPREFIX_ISA`` names another) with the system C
compiler (``cc``) and cached under ``~/.cache/hotprefix`` (or ``$HOTPREFIX_CACHE_DIR``), keyed by
the source, the flags and the CPU. Where no compiler works, or ``ModelConfig.fused_kernels`` is
off, the model runs the torch ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from hotprefix.files.atomic import atomic_path
from hotprefix.files.cachedir import cache_dir
from hotprefix.model.dtype_probe import cpu_flags
from hotprefix.model.isa import BY_NAME, ISA_ENV, IsaLevel, best_level, compile_flags, requested_level
from hotprefix.model.kv_dtype import kv_dtype_of

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(f)
           for f in ("isa.c", "fused.c", "qgemm.c", "qgemm_amx.c", "qgemm_a8.c", "qlayer.c", "qpack.c",
                     "attn.c", "select.c", "scratch.c")]
"""The ISA level's name, the elementwise kernels, the ``gguf`` weight mode's GEMM, layer calls and
weight packing (``qlinear.py``), attention, the logits' top-k and argmax, and the scratch buffers
the kernels keep between calls."""
HEADERS = [Path(__file__).with_name(f) for f in ("isa.h", "kvpool.h", "attn_chunk.h", "qgemm_layout.h",
                                                 "qgemm_avx2.h", "scratch.h")]
"""Included by the sources (the vector path each level compiles; the KV pool's element types;
attention's per-chunk arithmetic): part of the build key."""
CFLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared"]
"""No FMA contraction and no fast-math: the kernels' bits are those of the source. OpenMP binds to
the libgomp torch already loaded (same soname), so both share one thread pool. The level's -march
flags come from ``isa.compile_flags``."""
C_ATTN_CHUNK = 16
"""Keys per chunk of ``attn.c`` (its ``CH``): a row's result depends on this grid, so it is part of
the numerics tag."""
C_ATTN_SEGMENT = 256
"""Keys per segment of ``attn.c`` (its ``SEG``): a row's softmax state restarts at each and the
segments' states are merged in order (so a decode's segments can run on several threads); part of
the numerics tag too."""
MAX_HEAD_DIM = 512
"""Largest head size ``rope_write_kv`` takes (its per-head scratch is on the stack)."""

ACTIVATIONS = ("silu", "gelu_tanh")
"""The gated MLP's activations ``act_mul`` (``fused.c``) computes, by its code (0, 1)."""

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {  # name -> (argument types, return type)
    "add_rms_norm": ([_P, _P, _P, _P, _I, _I, _F, ctypes.c_int], None),
    "rope_write_kv": ([_P, _I, _I, _I, _I, _P, _P, _I, _P, _P, _P, _P, ctypes.c_int, _P, _I,
                       ctypes.c_int], _I),
    "act_mul": ([_P, _P, _I, _I, ctypes.c_int, ctypes.c_int], None),
    "head_rms_norm": ([_P, _I, _I, _I, _I, _I, _P, _F, ctypes.c_int], None),
    "gather_widen_kv": ([_P, _P, ctypes.c_int, _P, _I, _I, _I, _I, _P, _P, ctypes.c_int], None),
    "qg_quantize_rows": ([_P, _P, _P, _P, _I, _I, ctypes.c_int, ctypes.c_int], None),
    "qg_quantize_rows_reference": ([_P, _P, _P, _P, _I, _I, ctypes.c_int], None),
    "qg_gemm": ([_P, _I, _I, _P, _P, _P, _I, _P, ctypes.c_int], None),
    "qg_gemm_reference": ([_P, _I, _I, _P, _P, _P, _I, _P], None),
    "qg_linear": ([_P, _I, _I, _P, _I, _P, ctypes.c_int], ctypes.c_int),
    "qg_dequant_rows": ([_P, _I, _I, _P, _I, _P], _I),
    "qg_group_bytes": ([ctypes.c_int, _I], _I),
    "qg_pack": ([_P, _I, _I, _I, _P, _P, ctypes.c_int], _I),
    "qg_layer_pre": ([_P, _P, _P, _F, _I, _I, _P, _P, _P, _P, _I, _I, _I, _P, _P, _I, _P, _P,
                      _P, _P, ctypes.c_int, _P, _I, ctypes.c_int], _I),
    "attn_paged": ([_P, _I, _I, _I, _I, _P, _P, ctypes.c_int, _I, _I, _P, _I, _P, _P, _I, _F, _P,
                    ctypes.c_int, ctypes.c_int], ctypes.c_int),
    "qg_layer_fields": ([], _I),
    "qg_scratch_release": ([], None),
    "qg_thread_release": ([], ctypes.c_int),
    "qg_scratch_bytes": ([], _I),
    "select_top_k": ([_P, _I, _I, _I, _P, ctypes.c_int], ctypes.c_int),
    "select_argmax": ([_P, _I, _I, _P, ctypes.c_int], None),
    "qg_layers": ([_P, _I, _I, _I, _P, _F, _I, _I, _I, _I, ctypes.c_int, _P, ctypes.c_int, _I, _F,
                   ctypes.c_int], _I),
    "qg_layer_post": ([_P, _I, _P, _P, _P, _P, ctypes.c_int, _F, _I, _I, _P, _P, _I, _P, _P,
                       ctypes.c_int], ctypes.c_int),
}


def _build(cc: str, level: IsaLevel) -> Path:
    """Compile the source for ``level`` to a cached shared object (atomic rename: concurrent
    builds are safe)."""
    flags = [*CFLAGS, *compile_flags(level)]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    parts = [*(s.read_text() for s in (*SOURCES, *HEADERS)), *flags, version,
             " ".join(sorted(cpu_flags()))]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    for d in (cache_dir("kernels"), Path(tempfile.gettempdir()) / "hotprefix-kernels"):
        out = d / f"fused-{level.name}-{key}.so"
        if out.exists():
            return out
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if not os.access(d, os.W_OK):
            continue
        with atomic_path(out) as tmp:
            _compile(cc, flags, tmp)
        return out
    raise OSError("no writable directory for the compiled kernels")


def _compile(cc: str, flags: list[str], out: str) -> None:
    """The sources compiled side by side, one a CPU (the largest first: ``qgemm.c`` alone is
    about 40% of the 11 s a build takes on one core), then linked into ``out``."""
    def run(args: list[str]) -> None:
        subprocess.run([cc, *args], check=True, capture_output=True, text=True, timeout=300)

    object_flags = [f for f in flags if f != "-shared"]
    with tempfile.TemporaryDirectory(prefix="hotprefix-build-") as d:
        objects = [os.path.join(d, s.stem + ".o") for s in SOURCES]
        order = sorted(range(len(SOURCES)), key=lambda i: -SOURCES[i].stat().st_size)
        with ThreadPoolExecutor(max_workers=max(1, min(len(SOURCES), os.cpu_count() or 1))) as pool:
            for f in [pool.submit(run, [*object_flags, "-c", "-o", objects[i], str(SOURCES[i])])
                      for i in order]:
                f.result()
        run([*flags, "-o", out, *objects, "-lm"])


def library(level: str | None = None) -> ctypes.CDLL | None:
    """The compiled kernels for ``level`` (an ``isa.LEVELS`` name the CPU runs; None: the level
    ``isa.requested_level`` picks, logged once), or None (logged once) where they cannot be built
    or loaded. The library's ``isa`` attribute names the level it compiled."""
    if level is None:
        chosen = requested_level()
        if chosen.name not in _LOGGED:
            _LOGGED.add(chosen.name)
            best = best_level()
            why = (f"${ISA_ENV}={chosen.name}" if chosen != best else
                   "the best this CPU runs (flags: "
                   + (", ".join(sorted(chosen.needs)) or "no AVX2+FMA") + ")")
            log.info("kernels: ISA level %s, %s", chosen.name, why)
        level = chosen.name
    return _library(level)


_LOGGED: set[str] = set()


@functools.cache
def _library(level: str) -> ctypes.CDLL | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler found: the decoder's elementwise work runs as torch ops")
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc, BY_NAME[level])))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("fused kernels unavailable (%s): the elementwise work runs as torch ops", detail)
        return None
    return bind(lib)


library.cache_clear = _library.cache_clear  # forget the loaded builds (tests rebuild)


_BOUND: list[ctypes.CDLL] = []
"""Every kernel build bound in this process (``release_thread`` frees a thread's state in each)."""


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` with the kernels' argument and return types set (a build of ``SOURCES``)."""
    for name, (args, result) in _SIGNATURES.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = result
    lib.hp_isa_level.restype = ctypes.c_char_p
    lib.isa = lib.hp_isa_level().decode()
    if lib not in _BOUND:
        _BOUND.append(lib)
    return lib


def release_thread() -> None:
    """Free the calling thread's kernel scratch and OpenMP worker threads, in every kernel build
    loaded (``qg_thread_release``; made again if the thread runs kernels later). Called by a thread
    that hands the model to another, as the server's main thread does when its engine thread starts:
    an idle team left on the loading thread made libgomp throttle the engine thread's spin-waits
    (more managed threads than CPUs), which then slept and woke at every barrier (a 1B decode step
    on 2 cores: 10 ms more, about 165 context switches)."""
    for lib in _BOUND:
        lib.qg_thread_release()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class FusedOps:
    """The kernels bound to one model's shapes. Inputs must be contiguous fp32 on CPU."""

    def __init__(self, lib: ctypes.CDLL, eps: float, num_heads: int, num_kv_heads: int, head_dim: int):
        self.lib, self.eps = lib, eps
        self.nh, self.nkv, self.hd = num_heads, num_kv_heads, head_dim

    @staticmethod
    def threads() -> int:
        return torch.get_num_threads()

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor) -> torch.Tensor:
        """``h += delta`` (in place; skipped when None), then RMSNorm(h) * w as a new tensor."""
        out = torch.empty_like(h)
        self.lib.add_rms_norm(h.data_ptr(), _ptr(delta), w.data_ptr(), out.data_ptr(), h.shape[0],
                              h.shape[1], self.eps, self.threads())
        return out

    def rope_write_kv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slots: torch.Tensor) -> torch.Tensor:
        """RoPE'd queries [rows, nh, hd] fp32; K (RoPE'd) and V written to the pool at ``slots``
        (rows past it or with slot -1 are not written). A position outside the cos/sin tables
        raises IndexError (the kernel checks each row and skips it)."""
        n = qkv.shape[0]
        q = torch.empty(n, self.nh, self.hd, dtype=torch.float32)
        bad = self.lib.rope_write_kv(qkv.data_ptr(), n, self.nh, self.nkv, self.hd, cos.data_ptr(),
                                     sin.data_ptr(), cos.shape[0], positions.data_ptr(), q.data_ptr(),
                                     k_cache.data_ptr(), v_cache.data_ptr(),
                                     kv_kind(k_cache), slots.data_ptr(),
                                     slots.shape[0], self.threads())
        if bad:
            raise IndexError(f"{bad} positions outside the model's {cos.shape[0]} RoPE positions")
        return q

    def head_rms_norm(self, qkv: torch.Tensor, lo: int, heads: int, w: torch.Tensor) -> None:
        """RMSNorm * w over each head of columns ``lo : lo + heads * hd`` of every row of ``qkv``
        (contiguous fp32), in place: QK-norm, ``add_rms_norm``'s arithmetic per head."""
        self.lib.head_rms_norm(qkv.data_ptr(), qkv.shape[0], qkv.shape[1], lo, heads, self.hd,
                               w.data_ptr(), self.eps, self.threads())

    def act_mul(self, gate_up: torch.Tensor, kind: str) -> torch.Tensor:
        """``act(gate) * up`` of gate_up [rows, 2 inter] (contiguous fp32): ``silu`` (SwiGLU) or
        ``gelu_tanh`` (GeGLU)."""
        n, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(n, inter, dtype=torch.float32)
        self.lib.act_mul(gate_up.data_ptr(), out.data_ptr(), n, inter, ACTIVATIONS.index(kind),
                         self.threads())
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.act_mul(gate_up, "silu")

    def gather_widen_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, idx: torch.Tensor,
                        k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        """Blocks ``idx`` (contiguous int64) of the pools [blocks, bs, nkv, row] -> ``k_out``/``v_out``
        [len(idx), bs * nkv * hd] fp32 (int8 rows as ``float(q) * scale``)."""
        self.lib.gather_widen_kv(k_cache.data_ptr(), v_cache.data_ptr(),
                                 kv_kind(k_cache), idx.data_ptr(), idx.numel(),
                                 k_cache.shape[1], k_cache.shape[2], self.hd,
                                 k_out.data_ptr(), v_out.data_ptr(), self.threads())

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  tables: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor, scale: float,
                  portable: bool = False, window: int = 0) -> torch.Tensor:
        """``attn.c``: q [rows, nh, hd] fp32 -> [rows, nh, hd]; row i attends keys 0..pos[i] of
        the sequence whose block table is ``tables[seq[i]]`` (seq -1: a padding row, zeros), read
        from the pools [blocks, bs, nkv, hd]; ``window`` > 0: keys pos[i] - window + 1 .. pos[i]
        only (a sliding-window layer; the table may hold anything before them). ``portable``: the
        plain C path (the same bits)."""
        out = torch.empty_like(q)
        err = self.lib.attn_paged(q.data_ptr(), q.shape[0], self.nh, self.nkv, self.hd,
                                  k_cache.data_ptr(), v_cache.data_ptr(),
                                  kv_kind(k_cache), k_cache.shape[1],
                                  k_cache.shape[0], tables.data_ptr(), tables.shape[1],
                                  seq.data_ptr(), pos.data_ptr(), window, scale, out.data_ptr(),
                                  self.threads(), int(portable))
        check_attention(err, "attention scratch")
        return out

    def top_k(self, logits: torch.Tensor, k: int) -> torch.Tensor:
        """The indices [rows, k] of each row's k largest logits (contiguous fp32 [rows, n]), best
        first; ties go to the lower index and a NaN ranks above every number (``select.c``)."""
        rows, n = logits.shape
        idx = torch.empty(rows, k, dtype=torch.int64)
        if self.lib.select_top_k(logits.data_ptr(), rows, n, k, idx.data_ptr(), self.threads()):
            raise ValueError(f"top-k of {k} over rows of {n}: k must be in [1, min(n, 64)]")
        return idx

    def argmax(self, logits: torch.Tensor) -> list[int]:
        """Each row's argmax (contiguous fp32 [rows, n], n >= 1), as ``torch.argmax``: the first
        index of the largest value, or of the first NaN."""
        rows, n = logits.shape
        idx = torch.empty(rows, dtype=torch.int64)
        self.lib.select_argmax(logits.data_ptr(), rows, n, idx.data_ptr(), self.threads())
        return idx.tolist()


def check_attention(err: int, what: str) -> None:
    """Raise for a C attention call's negative return: -2 a block table that does not cover its
    row (nothing computed), -1 scratch memory that could not be allocated."""
    if err == -2:
        raise ValueError("a row's keys reach past its block table or outside the KV pool")
    if err < 0:
        raise MemoryError(f"no memory for the {what}")


def kv_kind(cache: torch.Tensor) -> int:
    """The kernels' ``kv`` code for a pool tensor (``kvpool.h``; fp32, bf16 or int8)."""
    kind = kv_dtype_of(cache).kind
    if kind is None:
        raise ValueError(f"the C kernels do not read a {cache.dtype} KV pool")
    return kind


def fused_ops(enabled: bool, device: torch.device, pool_dtype: torch.dtype, eps: float,
              num_heads: int, num_kv_heads: int, head_dim: int) -> FusedOps | None:
    """The kernels for a model, or None where they do not apply (off, not on CPU, a pool dtype
    they do not write: fp16, a head too large) or cannot be built."""
    if not enabled or device.type != "cpu" or pool_dtype not in (torch.bfloat16, torch.float32,
                                                                  torch.int8):
        return None
    if head_dim > MAX_HEAD_DIM or head_dim % 2:
        return None
    lib = library()
    return None if lib is None else FusedOps(lib, eps, num_heads, num_kv_heads, head_dim)
