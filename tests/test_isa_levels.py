"""The elementwise kernels (``fused.c``) and the two-call layer (``qlayer.c``) give the portable
build's bits at every ISA level this CPU runs. Their source is plain C with 16 fixed lanes and no
intrinsics, so a level differs only in the vectors the compiler picks; with no FMA contraction and
no fast-math (``fused.CFLAGS``) each lane's IEEE operations are the same. Compared as bits (NaN
payloads and signed zeros included) on hostile inputs: huge, tiny and subnormal values, NaN and
infinities, exp's clamps, rows shorter than and not a multiple of the lanes, bf16 rounding ties,
and row counts on both sides of the kernels' threading thresholds. Levels the CPU cannot run are
skipped, saying so."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hotprefix.model import fused, isa
from isa_support import level_lib

NAN, INF = float("nan"), float("inf")
OTHER_LEVELS = [lv.name for lv in isa.LEVELS if lv.name != "portable"]


def _ops(level: str, nh: int = 9, nkv: int = 3, hd: int = 64) -> fused.FusedOps:
    return fused.FusedOps(level_lib(level), 1e-5, nh, nkv, hd)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _same_bits(a: torch.Tensor, b: torch.Tensor, what) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, what
    diff = (_bits(a) != _bits(b)).nonzero()
    assert diff.numel() == 0, (what, diff[:4].tolist())


def _hostile(rows: int, width: int, g: torch.Generator, decades: int = 20) -> torch.Tensor:
    """Rows of mixed magnitude (10^-decades to 10^decades across the row), then special rows and
    values."""
    x = torch.randn(rows, width, generator=g) * torch.logspace(-decades, decades, width).float()
    x[:, ::5] = torch.randn(rows, len(range(0, width, 5)), generator=g)  # ordinary values too
    specials = [0.0, -0.0, NAN, INF, -INF, 1e-45, -1e-40, 3e38, -3e38, 88.3762626647949,
                -87.3365447504019, 88.4, -87.4, 0.5, 1.5]
    for i, v in enumerate(specials):
        x[i % rows, (7 * i) % width] = v
    if rows > 3:
        x[1] = 0.0  # an all-zero row
        x[2] = torch.randn(width, generator=g) * 1e-42  # subnormals only
        x[3] = torch.randn(width, generator=g) * 1e25  # squares overflow to inf
    return x


@pytest.mark.parametrize("level", OTHER_LEVELS)
def test_add_rms_norm_gives_the_portable_bits(level):
    ops, ref = _ops(level), _ops("portable")
    g = torch.Generator().manual_seed(1)
    for rows in (1, 5, 40, 300):  # from 32 rows the kernel shares them over threads
        for dim in (1, 7, 16, 17, 33, 100, 576):
            w = torch.randn(dim, generator=g) * 3
            hostile = (_hostile(rows, dim, g, 12), _hostile(rows, dim, g, 12) * 0.5)
            plain = (torch.randn(rows, dim, generator=g), torch.randn(rows, dim, generator=g))
            for kind, (h, d) in (("hostile", hostile), ("plain", plain)):
                for delta in (None, d):
                    h1, h2 = h.clone(), h.clone()
                    out1, out2 = ops.add_rms_norm(h1, delta, w), ref.add_rms_norm(h2, delta, w)
                    what = (kind, rows, dim, delta is None)
                    _same_bits(h1, h2, (*what, "h"))
                    _same_bits(out1, out2, (*what, "out"))


@pytest.mark.parametrize("level", OTHER_LEVELS)
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 2, 18), (2, 1, 2)])
def test_rope_write_kv_gives_the_portable_bits(level, heads):
    nh, nkv, hd = heads
    ops, ref = _ops(level, nh, nkv, hd), _ops("portable", nh, nkv, hd)
    g = torch.Generator().manual_seed(2)
    n_pos, blocks, bs = 300, 6, 8
    ang = torch.randn(n_pos, hd, generator=g) * 40
    cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
    cos[5, 0], sin[6, 1], cos[7, hd - 1] = NAN, INF, -0.0
    for rows in (5, 40):
        qkv = _hostile(rows, (nh + 2 * nkv) * hd, g)
        # values halfway between two bf16 numbers (round to even) and just off it
        qkv[0, : 4] = torch.tensor([1.00390625, 1.01171875, 1.0039063, -1.00390625])
        pos = torch.randint(0, n_pos, (rows,), generator=g)
        pos[:3] = torch.tensor([5, 6, 7])
        slots = torch.randperm(blocks * bs, generator=g)[: rows - 2]
        slots[1] = -1  # not written; the last two rows have no slot
        for dtype in (torch.bfloat16, torch.float32):
            caches = [torch.full((blocks, bs, nkv, hd), 7.0, dtype=dtype) for _ in range(4)]
            q1 = ops.rope_write_kv(qkv, cos, sin, pos, caches[0], caches[1], slots)
            q2 = ref.rope_write_kv(qkv, cos, sin, pos, caches[2], caches[3], slots)
            _same_bits(q1, q2, (heads, rows, dtype, "q"))
            _same_bits(caches[0], caches[2], (heads, rows, dtype, "k"))
            _same_bits(caches[1], caches[3], (heads, rows, dtype, "v"))


@pytest.mark.parametrize("level", OTHER_LEVELS)
def test_act_mul_gives_the_portable_bits(level):
    """SiLU and GELU-tanh, including exp's clamps (±88.38 / -87.34), its overflow and underflow sides, NaN and
    infinities in gate and up."""
    ops, ref = _ops(level), _ops("portable")
    g = torch.Generator().manual_seed(3)
    sweep = torch.linspace(-120, 120, 4801)
    for rows in (1, 6, 40):
        for inter in (1, 15, 16, 17, 100, 1536):
            gu = _hostile(rows, 2 * inter, g)
            m = min(inter, sweep.numel())
            gu[0, :m] = sweep[:m]  # the gate across exp's whole range
            for kind in ("silu", "gelu_tanh"):
                _same_bits(ops.act_mul(gu, kind), ref.act_mul(gu, kind), (rows, inter, kind))
                plain = torch.randn(rows, 2 * inter, generator=g) * 4
                _same_bits(ops.act_mul(plain, kind), ref.act_mul(plain, kind), (rows, inter, kind, "plain"))
    full = torch.linspace(-120, 120, 2 * 4801).view(1, -1)  # every gate value of the sweep
    for kind in ("silu", "gelu_tanh"):
        _same_bits(ops.act_mul(full, kind), ref.act_mul(full, kind), ("sweep", kind))


def _exp_numpy(x: np.ndarray) -> np.ndarray:
    """``fused.c``'s exp_poly transcribed in numpy float32, one rounding an operation (no FMA)."""
    f = np.float32
    with np.errstate(over="ignore", invalid="ignore"):
        x = np.where(x > f(88.3762626647949), f(88.3762626647949), x)
        x = np.where(x < f(-87.3365447504019), f(-87.3365447504019), x)
        fx = (x * f(1.44269504088896341) + f(12582912.0)) - f(12582912.0)
        x = x - fx * f(0.693359375)
        x = x - fx * f(-2.12194440e-4)
        z = x * x
        y = np.full_like(x, f(1.9875691500e-4))
        for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
            y = y * x + f(c)
        y = y * z + x + f(1.0)
        e = fx.astype(np.int32) + np.int32(127)
        p = (e.astype(np.uint32) << np.uint32(23)).view(np.float32)
        return y * p


def _act_mul_numpy(kind: str, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """``fused.c``'s act_mul (SiLU, GELU-tanh) transcribed in numpy float32."""
    f = np.float32
    with np.errstate(over="ignore", invalid="ignore"):
        if kind == "silu":
            return gate / (f(1.0) + _exp_numpy(-gate)) * up
        y = f(0.7978845608028654) * (gate + f(0.044715) * (gate * gate * gate))
        t = f(1.0) - f(2.0) / (_exp_numpy(f(2.0) * y) + f(1.0))
        return ((f(0.5) * gate) * (f(1.0) + t)) * up


@pytest.mark.parametrize("level", [lv.name for lv in isa.LEVELS])
@pytest.mark.parametrize("kind", ["silu", "gelu_tanh"])
def test_act_mul_gives_its_sources_bits(level, kind):
    """At every level (the portable one included), act_mul's SiLU and GELU-tanh are their C
    source's arithmetic to the bit, whether the compiler vectorized the loop or not: the gate
    across exp's whole range and its clamps, subnormals, zeros and infinities (NaN compared as
    NaN); and GELU-tanh within 1e-6 (relative to max(1, |x|)) of torch's."""
    ops = _ops(level)
    g = torch.Generator().manual_seed(7)
    gate = torch.cat([torch.linspace(-120, 120, 20001), torch.randn(20000, generator=g) * 10,
                      torch.tensor([0.0, -0.0, INF, -INF, 1e-45, -1e-45, 1e-40, 3e38, -3e38,
                                    -88.3762626647949, 87.3365447504019, -88.38, 87.34]),
                      torch.randint(-2**31, 2**31, (20000,), generator=g).to(torch.int32)
                      .view(torch.float32)])
    gate = gate[: gate.numel() // 16 * 16 + 7]  # a partial last vector
    up = torch.randn(gate.numel(), generator=g) * 2
    got = ops.act_mul(torch.cat([gate, up]).view(1, -1), kind)[0].numpy()
    want = _act_mul_numpy(kind, gate.numpy(), up.numpy())
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all()
    assert (got[~nan].view(np.int32) == want[~nan].view(np.int32)).all(), \
        np.flatnonzero(got[~nan].view(np.int32) != want[~nan].view(np.int32))[:5]
    if kind == "gelu_tanh":
        x = torch.linspace(-30, 30, 60001)
        ours = ops.act_mul(torch.cat([x, torch.ones_like(x)]).view(1, -1), kind)[0]
        err = (ours - torch.nn.functional.gelu(x, approximate="tanh")).abs() / x.abs().clamp(min=1)
        assert err.max() < 1e-6, err.max()


@pytest.mark.parametrize("level", OTHER_LEVELS)
def test_gather_widen_kv_gives_the_portable_bits(level):
    """Small gathers (block by block on the calling thread) and one past 2^20 elements (split
    over threads by head), bf16 pools of arbitrary bit patterns (NaN payloads too) and fp32 ones;
    padding blocks (-1) left as they were."""
    g = torch.Generator().manual_seed(4)
    for nkv, hd, bs, n in ((3, 64, 16, 5), (3, 64, 16, 400), (5, 18, 8, 3), (5, 64, 16, 700)):
        ops, ref = _ops(level, 3 * nkv, nkv, hd), _ops("portable", 3 * nkv, nkv, hd)
        blocks = n + 3
        raw = torch.randint(-2**15, 2**15, (2, blocks, bs, nkv, hd), dtype=torch.int32, generator=g)
        for dtype in (torch.bfloat16, torch.float32):
            if dtype == torch.bfloat16:
                kc, vc = (r.to(torch.int16).view(torch.bfloat16) for r in raw)
            else:
                kc, vc = (torch.randn(blocks, bs, nkv, hd, generator=g) for _ in range(2))
                kc.view(-1)[::97] = NAN
            idx = torch.randint(0, blocks, (n,), generator=g)
            idx[-1], idx[n // 2] = -1, -1
            outs = [torch.full((n, bs * nkv * hd), 3.0) for _ in range(4)]
            ops.gather_widen_kv(kc, vc, idx, outs[0], outs[1])
            ref.gather_widen_kv(kc, vc, idx, outs[2], outs[3])
            _same_bits(outs[0], outs[2], (nkv, hd, n, dtype, "k"))
            _same_bits(outs[1], outs[3], (nkv, hd, n, dtype, "v"))
            assert (outs[0][-1] == 3.0).all()


def _quant_layer(g: torch.Generator, dim: int, nh: int, nkv: int, hd: int, inter: int) -> dict:
    """One layer's weights in the gguf block layout (Q4_1 and Q8_0 stacks), with a Q/K/V bias."""
    import gguf
    from gguf.quants import quantize

    from hotprefix.model.qlinear import QuantWeight

    def blocks(kind: str, n: int, k: int) -> tuple[str, np.ndarray]:
        w = (torch.randn(n, k, generator=g) * 0.1).numpy()
        return kind, quantize(w, gguf.GGMLQuantizationType[kind]).reshape(n, -1)

    width = (nh + 2 * nkv) * hd
    return {
        "in_norm": torch.randn(dim, generator=g) * 0.3 + 1, "post_norm": torch.randn(dim, generator=g) + 1,
        "qkv": QuantWeight([blocks("Q4_1", width, dim)], dim), "qkv_bias": torch.randn(width, generator=g),
        "o": QuantWeight([blocks("Q8_0", dim, nh * hd)], nh * hd),
        "gate_up": QuantWeight([blocks("Q4_1", inter, dim), blocks("Q4_1", inter, dim)], dim),
        "down": QuantWeight([blocks("Q8_0", dim, inter)], inter),
    }


@pytest.mark.parametrize("level", OTHER_LEVELS)
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_quant_layer_calls_give_the_portable_bits(level, family):
    """``qlayer.c``'s two calls (norm, Q/K/V with bias, RoPE and the K/V write; output projection,
    norm, SiLU MLP; and gemma3's: QK-norm, norms on both sublayers' outputs, GELU-tanh) at the
    level against the portable build: queries, pools, residual stream and MLP output to the bit,
    on 3 and 40 rows."""
    from types import SimpleNamespace

    from hotprefix.model.qlinear import QuantLayers

    _ops(level)  # skips a level the CPU cannot run
    nh, nkv, hd, dim, inter = 4, 2, 32, 128, 256
    g = torch.Generator().manual_seed(6)
    layer = _quant_layer(g, dim, nh, nkv, hd, inter)
    act = "silu"
    if family == "gemma3":
        act = "gelu_tanh"
        layer.update(q_norm=torch.randn(hd, generator=g) + 1, k_norm=torch.randn(hd, generator=g) + 1,
                     attn_out_norm=torch.randn(dim, generator=g) + 1,
                     mlp_out_norm=torch.randn(dim, generator=g) + 1)
    ang = torch.randn(64, hd, generator=g)
    rope = SimpleNamespace(cos=ang.cos().contiguous(), sin=ang.sin().contiguous())
    layers = {lv: QuantLayers(fused.library(lv), 1e-5, nh, nkv, hd, inter, act)
              for lv in ("portable", level)}
    for rows in (3, 40):
        h0 = torch.randn(rows, dim, generator=g) * 2
        h0[0, :5] = torch.tensor([1e-42, 3e4, -0.0, 0.0, -7e3])
        pending = torch.randn(rows, dim, generator=g)
        pos = torch.randint(0, 64, (rows,), generator=g)
        slots = torch.randperm(4 * 16, generator=g)[:rows]
        o = torch.randn(rows, nh * hd, generator=g)
        got = {}
        for lv, ql in layers.items():
            kc, vc = (torch.zeros(4, 16, nkv, hd, dtype=torch.bfloat16) for _ in range(2))
            h = h0.clone()
            q = ql.pre(h, pending, layer, rope, pos, kc, vc, slots)
            mlp = ql.post(o, h, layer)
            got[lv] = (q, kc, vc, h, mlp)
        for name, a, b in zip(("q", "k", "v", "h", "mlp"), got[level], got["portable"]):
            _same_bits(a, b, (rows, name))
