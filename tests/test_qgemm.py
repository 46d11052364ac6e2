"""The ``gguf`` weight mode's block GEMM (``qgemm.c`` through ``qlinear.py``): GGUF blocks repacked
without loss, products within the 16-bit activations' rounding of exact arithmetic, and a row's bits
independent of the rows beside it, the thread count and the code path (vector or portable C)."""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from hotprefix import SamplingParams
from hotprefix.model.fused import library
from hotprefix.model.isa import runnable_levels
from hotprefix.model.gguf_blocks import QF_Q4, QF_Q8, decode, group_bytes
from hotprefix.model.qlinear import (BlockRows, QuantLayers, QuantLinear, QuantWeight,
                                     fast_block_kernels, quantize_rows)

LIB = library()
pytestmark = pytest.mark.skipif(LIB is None, reason="no C compiler: the gguf mode is not offered")
LEVELS = [lv.name for lv in runnable_levels()]
"""Every ISA level this CPU executes (``isa.runnable_levels``): each vector path is tested here
against the portable reference; levels the CPU lacks are tested on the machines that have them."""


def make_blocks(kind: str, n: int, k: int, seed: int = 0,
                scale: float = 0.1) -> tuple[str, np.ndarray, torch.Tensor]:
    """(kind, raw GGUF blocks [n, bytes a row], the fp32 weight gguf dequantizes them to)."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * scale
    raw = quantize(w, gguf.GGMLQuantizationType[kind])
    deq = dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(n, k)
    return kind, raw.reshape(n, -1), torch.from_numpy(np.ascontiguousarray(deq, dtype=np.float32))


def exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().T)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("n", [16, 40, 96])
def test_packing_keeps_every_weight(kind, n):
    _, raw, deq = make_blocks(kind, n, 96, seed=n)
    q, d, m = decode(kind, raw, 96)
    assert q.shape == (n, 3, 32) and d.shape == m.shape == (n, 3)
    w = QuantWeight([(kind, raw)], 96)
    groups = -(-n // 16)  # groups of 16 outputs, the last one padded
    fmt = QF_Q8 if kind == "Q8_0" else QF_Q4
    assert w.n == n and w.formats == (fmt,) * groups
    assert w.nbytes == groups * (8 + group_bytes(fmt, 3)) == groups * (8 + LIB.qg_group_bytes(fmt, 3))
    assert torch.equal(w.dequantize(), deq)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_block_rows_are_gguf_values(kind):
    """Rows dequantized on demand (the LM head's refine rows, a tied embedding) hold exactly what
    gguf's dequantizer gives; an id outside the matrix is an IndexError."""
    _, raw, deq = make_blocks(kind, 40, 96, seed=11)
    rows = BlockRows(LIB, QuantWeight([(kind, raw)], 96))
    idx = torch.tensor([[39, 0, 17], [16, 16, 5]])
    got = rows[idx]
    assert got.shape == (2, 3, 96) and torch.equal(got, deq[idx])
    with pytest.raises(IndexError, match="outside"):
        rows[torch.tensor([3, 40])]
    with pytest.raises(IndexError):
        rows[torch.tensor([-1])]


def test_stacked_tensors_of_mixed_kinds_pack_a_shared_group_as_8_bit():
    """Each group of 16 outputs keeps its type's format; one holding Q4_1 and Q8_0 rows is 8-bit."""
    parts = [make_blocks("Q4_1", 24, 64, 1), make_blocks("Q8_0", 8, 64, 2), make_blocks("Q4_0", 16, 64, 3)]
    w = QuantWeight([(kind, raw) for kind, raw, _ in parts], 64)
    assert w.formats == (QF_Q4, QF_Q8, QF_Q4) and w.n == 48
    assert torch.equal(w.dequantize(), torch.cat([deq for _, _, deq in parts]))
    assert QuantWeight([(k, r) for k, r, _ in parts[::2]], 64).formats == (QF_Q4,) * 3


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_product_is_within_16_bit_activation_rounding_of_exact(kind):
    _, raw, deq = make_blocks(kind, 72, 160, seed=7)
    w = QuantWeight([(kind, raw)], 160)
    x = torch.randn(37, 160) * torch.logspace(-3, 2, 160)  # blocks of very different sizes
    y = QuantLinear(LIB, None)(x, w, None)
    ref = exact(x, deq)
    # each block's activations keep 15 bits against its largest: ~3e-5 of a block's size
    err = ((y.double() - ref).abs() / exact(x.abs(), deq.abs()).clamp(min=1e-30)).max().item()
    assert err < 2e-4, err
    assert y.shape == (37, 72) and y.dtype == torch.float32


@pytest.mark.parametrize("narrow", [False, True], ids=["a16", "a8"])
@pytest.mark.parametrize("level", LEVELS)
def test_row_bits_do_not_depend_on_neighbours_threads_or_path(level, narrow):
    """At each ISA level, with 16- and 8-bit activations (``narrow``: AMX's one tile product a
    block): a row's bits alone, in any slice (tiles of 6 or 8 rows cut anywhere, the AMX path's
    16 from 32 rows on), on one thread, and equal to the portable reference's; a group's partial
    last lanes (n = 200, 40) included."""
    kind, raw, _ = make_blocks("Q4_1", 200, 576, seed=3)
    w8 = QuantWeight([make_blocks("Q8_0", 40, 576, seed=4)[:2]], 576, narrow=narrow)
    w4 = QuantWeight([(kind, raw)], 576, narrow=narrow)
    lin = QuantLinear(library(level), None)
    x = torch.randn(130, 576)
    x[5, :32] *= 1e6  # one block far above the rest
    for w in (w4, w8):
        full = lin(x, w, None)
        for lo, hi in [(7, 8), (3, 8), (0, 6), (5, 18), (60, 130), (1, 10), (2, 17)]:
            assert torch.equal(lin(x[lo:hi], w, None), full[lo:hi]), (lo, hi)
        torch.set_num_threads(1)
        try:
            assert torch.equal(lin(x, w, None), full)
        finally:
            torch.set_num_threads(2)
        assert torch.equal(lin.reference(x[:13], w), full[:13])  # the portable path: same bits
        assert torch.equal(QuantLinear(library("portable"), None)(x, w, None), full)


@pytest.mark.parametrize("level", LEVELS)
def test_activation_quantization_vector_path_gives_the_portable_bits(level):
    """Each level's quantization against the C reference, value for value, on hostile rows: ties
    at .5 (round half to even), a block whose every product is exact, blocks of zeros, subnormals, huge values, a lone NaN (ignored by
    the block's max, clamped to -32767 like fmaxf/fminf do), infinities (the block zeroed, its scale
    inf), and 37 ordinary rows so both thread paths run."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(37, 160, generator=g) * torch.logspace(-30, 30, 160).float()
    x[0, :32] = torch.arange(32) - 15.5  # amax 15.5, so the scale 32767 / 15.5 = 2114 exactly
    x[1, 32:64] = 0.0
    x[2, :32] = torch.full((32,), 1e-40)  # subnormals
    x[3, 64:96] = 3e38
    x[4, 7] = float("nan")
    x[5, 40] = float("inf")
    x[6, 100] = float("-inf")
    x[6, 101] = float("nan")
    lib = library(level)
    got, ref = quantize_rows(lib, x, 2), quantize_rows(lib, x, 1, portable=True)
    for a, b in zip(got, ref):
        assert torch.equal(a.view(torch.int16) if a.dtype == torch.int16 else a.view(torch.int32),
                           b.view(torch.int16) if b.dtype == torch.int16 else b.view(torch.int32))
    qa, sa, _ = got
    assert qa[4, 7] == -32767 and torch.isfinite(sa[4, 0])  # NaN clamped, the scale from the rest
    assert sa[5, 1] == float("inf") and not qa[5, 32:64].any()
    assert torch.equal(qa[0, :32].abs().max(), torch.tensor(32767, dtype=torch.int16))
    assert qa[0, :32].tolist() == [2114 * i - 32767 for i in range(32)]
    half = torch.tensor([[0.5, 1.5, 2.5, -0.5] + [0.0] * 27 + [32767.0]])
    assert quantize_rows(lib, half, 1)[0][0, :4].tolist() == [0, 2, 2, 0]  # ties to even
    # 8-bit (narrow): the same steps to +-127, the same bits as the reference
    got, ref = quantize_rows(lib, x, 2, narrow=True), quantize_rows(lib, x, 1, portable=True, narrow=True)
    for a, b in zip(got, ref):
        assert torch.equal(a.view(torch.int16) if a.dtype == torch.int16 else a.view(torch.int32),
                           b.view(torch.int16) if b.dtype == torch.int16 else b.view(torch.int32))
    qa, sa, _ = got
    inv = torch.tensor(127.0) / torch.tensor(15.5)  # the kernel's fp32 steps: v * (127 / amax), rint
    assert torch.equal(qa[0, :32], torch.round(x[0, :32] * inv).to(torch.int16))
    assert int(qa.abs().max()) == 127 and qa[4, 7] == -127 and sa[5, 1] == float("inf")
    half8 = torch.tensor([[0.5, 1.5, 2.5, -0.5] + [0.0] * 27 + [127.0]])
    assert quantize_rows(lib, half8, 1, narrow=True)[0][0, :4].tolist() == [0, 2, 2, 0]


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_8_bit_activations_are_within_their_rounding_of_exact(kind):
    """``narrow``: each block's activations are rounded to amax / 127 steps (llama.cpp's width), so
    an output is off by at most half a step times the block's weights' sizes, summed over blocks;
    16 bits keep a 258th of that bound. Both reached well past the other's bound."""
    _, raw, deq = make_blocks(kind, 72, 160, seed=7)
    x = torch.randn(37, 160) * torch.logspace(-3, 2, 160)
    amax = x.abs().view(37, 5, 32).amax(-1).repeat_interleave(32, 1)  # each input's block max
    step = (amax.double() / 2) @ deq.abs().double().T  # sum over inputs of half a unit step x |w|
    ref = exact(x, deq)
    err8 = (QuantLinear(LIB, None)(x, QuantWeight([(kind, raw)], 160, narrow=True), None).double() - ref).abs()
    err16 = (QuantLinear(LIB, None)(x, QuantWeight([(kind, raw)], 160), None).double() - ref).abs()
    assert (err8 <= step / 127 * 1.001 + 1e-6 * ref.abs()).all()
    assert (err16 <= step / 32767 * 1.001 + 1e-6 * ref.abs()).all()
    assert (err8 > step / 32767 * 2).float().mean() > 0.5  # 8 bits really are coarser


def test_zero_and_non_finite_blocks():
    _, raw, deq = make_blocks("Q4_1", 16, 64)
    w = QuantWeight([("Q4_1", raw)], 64)
    lin = QuantLinear(LIB, None)
    x = torch.zeros(3, 64)
    x[1, 40] = 2.0  # one block zero, the other not
    x[2, 3] = float("inf")
    y = lin(x, w, None)
    assert torch.equal(y[0], torch.zeros(16))
    assert torch.allclose(y[1].double(), exact(x[1:2], deq)[0], rtol=1e-4, atol=1e-6)
    assert torch.isnan(y[2]).all()  # like a float GEMM, a non-finite input poisons its row
    assert lin(torch.zeros(0, 64), w, None).shape == (0, 16)  # a step with no logits rows


def test_other_weights_go_to_the_fallback_and_bias_is_added():
    seen = []
    lin = QuantLinear(LIB, lambda x, w, b: seen.append(w) or x)
    assert lin(torch.ones(2, 3), "dense", None).shape == (2, 3) and seen == ["dense"]
    _, raw, deq = make_blocks("Q8_0", 16, 32)
    b = torch.arange(16, dtype=torch.float32)
    x = torch.randn(2, 32)
    w = QuantWeight([("Q8_0", raw)], 32)
    assert torch.equal(lin(x, w, b), lin(x, w, None) + b)


@pytest.mark.model
def test_real_model_blocks_hold_the_loaded_weights():
    """The loader's raw blocks, Q/K rows un-permuted like the dequantized weights, pack to exactly
    the weights the other modes multiply with (Q4_1 layers, the Q8_0 embedding)."""
    from hotprefix.model.loader import load_model

    loaded = load_model(None)
    kinds = {kind for kind, _ in loaded.blocks.values()}
    assert kinds == {"Q4_1", "Q8_0"}
    for name in ["model.layers.0.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight",
                 "model.layers.5.mlp.down_proj.weight", "model.embed_tokens.weight"]:
        kind, raw = loaded.blocks[name]
        w = loaded.weights[name]
        assert torch.equal(QuantWeight([(kind, raw)], w.shape[1]).dequantize(), w), name
    kind, raw = loaded.blocks["model.embed_tokens.weight"]
    ids = torch.tensor([0, 1, 2, 500, 49151])
    emb = BlockRows(LIB, QuantWeight([(kind, raw)], raw.shape[1] // 34 * 32))[ids]
    assert torch.equal(emb, loaded.weights["model.embed_tokens.weight"][ids])


@pytest.mark.model
def test_gguf_mode_selection(real_llm, tiny_model_dir, monkeypatch, caplog):
    """The default takes the gguf mode on a CPU whose kernels have a vector path (AVX2+FMA or
    better; else mixed or dense, silently); asked
    for on a model without GGUF blocks it runs mixed and says so. Each has its own namespace."""
    import hotprefix.model.linear as linear
    from hotprefix import LLM

    model = real_llm.engine.runner.model
    if model.weight_mode == "gguf":
        assert "/gguf-a16-" in model.numerics
        assert isinstance(model.layers[0]["gate_up"], QuantWeight)
        assert isinstance(model.lm_head, QuantWeight) and set(model.lm_head.formats) == {QF_Q8}
        assert isinstance(model.embed, BlockRows)  # no fp32 copy of the tied embedding
    assert (model.weight_mode == "gguf") == fast_block_kernels()
    assert f"/isa-{LIB.isa}" in model.numerics
    monkeypatch.setattr(linear, "fast_block_kernels", lambda: False)
    mixed = LLM(kv_cache_memory="32MiB", num_threads=2)
    # without the gguf mode the dtype probe decides: mixed in bf16, dense where bf16 is not native
    assert mixed.engine.runner.model.weight_mode == (
        "mixed" if mixed.engine.runner.dtype == torch.bfloat16 else "dense")
    # another weight mode, another namespace (under HOTPREFIX_ISA=portable the default is not
    # gguf: then the patch changes nothing and both engines are the same mode)
    assert (mixed.engine.namespace != real_llm.engine.namespace) == (
        mixed.engine.runner.model.weight_mode != model.weight_mode)
    asked = LLM(kv_cache_memory="32MiB", num_threads=2, weights="gguf")  # explicit: runs anyway
    assert asked.engine.runner.model.weight_mode == "gguf"
    with caplog.at_level(logging.WARNING):
        tiny = LLM(model=tiny_model_dir, kv_cache_memory="8MiB", num_threads=2, dtype="bfloat16",
                   weights="gguf")
    assert tiny.engine.runner.model.weight_mode == "mixed"
    assert "weights='gguf' needs a GGUF model" in caplog.text


@pytest.mark.model
def test_a_cpu_without_native_bf16_gets_the_gguf_default_and_the_same_tokens(real_llm, monkeypatch):
    """Where bf16 matmuls are missing or slow (the dtype probe says fp32), the gguf mode still
    runs by default, storing K/V in bf16: it does no bf16 arithmetic, so it computes what it
    computes here, bit for bit (the same namespace, the same tokens). Other weight modes follow the
    probe."""
    import hotprefix.engine.runner as runner
    from hotprefix import LLM
    from hotprefix.model.dtype_probe import DtypeChoice

    if real_llm.engine.runner.model.weight_mode != "gguf":
        pytest.skip("the gguf mode does not run here")
    monkeypatch.setattr(runner, "probed_cpu_dtype",
                        lambda: DtypeChoice(torch.float32, False, 0.0, "float32: no native bf16"))
    llm = LLM(kv_cache_memory="64MiB", num_threads=2)
    model = llm.engine.runner.model
    assert model.dtype == torch.bfloat16 and model.weight_mode == "gguf"
    assert llm.engine.namespace == real_llm.engine.namespace
    prompts = [real_llm.tokenizer.encode("The three primary colours are"), [1, 2, 3, 4, 5]]
    params = SamplingParams(max_tokens=12)
    assert ([o.token_ids for o in llm.generate(prompts, params)]
            == [o.token_ids for o in real_llm.generate(prompts, params)])
    mixed = LLM(kv_cache_memory="32MiB", num_threads=2, weights="mixed")
    assert mixed.engine.runner.model.dtype == torch.float32  # the probe's choice


@pytest.mark.model
def test_gguf_mode_never_dequantizes_its_block_matrices(monkeypatch):
    """The loader dequantizes a tensor only when the model reads it, and the gguf mode reads only
    those without blocks (the norms here): no fp32 copy of the model is made at start-up."""
    import gguf.quants

    from hotprefix import LLM

    seen: list[int] = []
    real = gguf.quants.dequantize

    def counted(data, qtype):
        seen.append(data.nbytes)
        return real(data, qtype)

    monkeypatch.setattr(gguf.quants, "dequantize", counted)
    llm = LLM(kv_cache_memory="64MiB", num_threads=2)
    if llm.engine.runner.model.weight_mode != "gguf":
        pytest.skip("the gguf mode does not run here")
    assert len(seen) > 200  # every tensor's first row is checked at load time
    assert 0 < sum(seen) < 2**20, sum(seen)  # the norms: 61 x 576 fp32, not 100 MB of blocks
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].token_ids


def test_layer_calls_give_the_per_kernel_bits(real_llm):
    """The two-call layer (``qlayer.c``) runs the kernels the per-kernel loop runs, in the same
    order, and the one call for every layer (with the C attention) the two-call layers': the same
    logits to the bit, and the same greedy tokens from decode steps."""
    from hotprefix.tools import quality

    model = real_llm.engine.runner.model
    if model.quant_layers is None:
        pytest.skip("the default here is not the gguf mode")
    ids = real_llm.tokenizer.encode("The ferry to the outer islands leaves the harbour at seven, "
                                    "unless the wind from the north is strong. " * 40)
    assert len(ids) > 512  # qg_layer_post runs the MLP in parts of 512 rows
    layers = model.quant_layers
    runs, tokens = [], []
    try:
        for all_layers, quant in ((True, layers), (False, layers), (False, None)):
            model.all_layers_call, model.quant_layers = all_layers, quant
            runs.append(quality.all_position_logits(real_llm.engine.runner, ids))
            real_llm.reset_prefix_cache()
            out = real_llm.generate([ids[:40], ids[:23]], SamplingParams(max_tokens=12))
            tokens.append([o.token_ids for o in out])
    finally:
        model.all_layers_call, model.quant_layers = True, layers
    assert runs[0].shape[0] == len(ids)
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[1], runs[2])
    assert tokens[0] == tokens[1] == tokens[2]


def test_tiny_model_with_bias_and_mixed_block_types():
    """A model whose Q/K/V stack mixes Q4_0, Q4_1 and Q8_0 (groups of each format), with Q/K/V biases
    (Qwen2's), an untied Q8_0 LM head and a tied-free embedding: the two-call layers give the
    per-kernel loop's bits, and the gguf forward computes what the fp32 dense mode computes on the
    dequantized weights. The untied embedding stays in its blocks, its rows read in fp32."""
    from hotprefix.model.attention import AttentionMetadata, PrefillSeq
    from hotprefix.model.llama import LlamaModel
    from hotprefix.model.loader import ModelArch

    arch = ModelArch(arch="qwen2", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
                     max_position=512, attention_bias=True, tie_word_embeddings=False)
    kinds = {"q_proj": "Q4_0", "k_proj": "Q4_1", "v_proj": "Q8_0", "o_proj": "Q4_1",
             "gate_proj": "Q4_1", "up_proj": "Q4_0", "down_proj": "Q8_0"}
    shapes = {"q_proj": (64, 64), "k_proj": (32, 64), "v_proj": (32, 64), "o_proj": (64, 64),
              "gate_proj": (128, 64), "up_proj": (128, 64), "down_proj": (64, 128)}
    weights, blocks, g = {}, {}, torch.Generator().manual_seed(5)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        for name, kind in kinds.items():
            part = "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            _, raw, deq = make_blocks(kind, *shapes[name], seed=10 * i + len(name), scale=0.3)
            weights[f"{p}{part}.{name}.weight"] = deq
            blocks[f"{p}{part}.{name}.weight"] = (kind, raw)
        for n, size in (("q", 64), ("k", 32), ("v", 32)):
            weights[f"{p}self_attn.{n}_proj.bias"] = torch.randn(size, generator=g) * 0.1
        weights[p + "input_layernorm.weight"] = torch.ones(64)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(64)
    for name, kind in (("model.embed_tokens.weight", "Q8_0"), ("lm_head.weight", "Q8_0")):
        _, raw, deq = make_blocks(kind, 96, 64, seed=len(name), scale=0.5)
        weights[name], blocks[name] = deq, (kind, raw)
    weights["model.norm.weight"] = torch.ones(64)

    def run(model, ids):
        caches = [(torch.zeros(4, 16, 2, 16, dtype=torch.bfloat16),
                   torch.zeros(4, 16, 2, 16, dtype=torch.bfloat16)) for _ in range(2)]
        n = len(ids)
        meta = AttentionMetadata(slot_mapping=torch.arange(n),
                                 prefills=[PrefillSeq(0, n, n, torch.arange(4))])
        return model.forward(torch.tensor(ids), torch.arange(n), caches, meta, None)

    ids = torch.randint(0, 96, (40,), generator=g).tolist()
    cpu = torch.device("cpu")
    quant = LlamaModel(arch, weights, cpu, torch.bfloat16, "gguf", True, blocks)
    assert quant.weight_mode == "gguf" and quant.quant_layers is not None
    assert quant.layers[0]["qkv"].formats == (QF_Q4,) * 6 + (QF_Q8,) * 2
    assert set(quant.layers[0]["gate_up"].formats) == {QF_Q4}
    assert isinstance(quant.embed, BlockRows) and quant.embed.weight is not quant.lm_head
    assert "-emb32" in quant.numerics
    assert torch.equal(quant.embed[torch.tensor([3, 95])], weights["model.embed_tokens.weight"][[3, 95]])
    fast = run(quant, ids)
    quant.quant_layers = None
    assert torch.equal(run(quant, ids), fast)
    mixed = run(LlamaModel(arch, weights, cpu, torch.float32, "dense", True), ids)  # fp32 reference
    assert fast.shape == (40, 96)
    tol = 2e-2 * mixed.abs().max()
    assert (fast - mixed).abs().max() < tol, (fast - mixed).abs().max()
    assert (fast.argmax(-1) == mixed.argmax(-1)).float().mean() >= 0.9
    quant.quant_layers = QuantLayers(LIB, arch.rms_norm_eps, 4, 2, 16, 128)
    for layer in quant.layers:
        layer["qkv_bias"] = torch.zeros_like(layer["qkv_bias"])
    assert (run(quant, ids) - fast).abs().max() > 2 * tol  # the biases weigh in: the check sees them


def _small_product():
    """A 40-row product on a small Q4_1 weight through ``qg_linear`` on 2 threads (its scratch and
    OpenMP team are the calling thread's)."""
    _, raw, _ = make_blocks("Q4_1", 64, 256, seed=3)
    w = QuantWeight([("Q4_1", raw)], 256, LIB)
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(2))

    def run() -> torch.Tensor:
        y = torch.empty(40, 64)
        assert LIB.qg_linear(w.packed.data_ptr(), 64, 256, x.data_ptr(), 40, y.data_ptr(), 2) == 0
        return y

    return run


def test_scratch_is_kept_per_thread_and_released():
    """The kernels' scratch (``scratch.c``) is made on a thread's first call, reused by the next
    call of the same size (no growth), kept per thread (another thread's calls leave it as is) and
    freed on release; a product after the release is made again with the same result."""
    import threading

    run = _small_product()

    LIB.qg_scratch_release()
    assert LIB.qg_scratch_bytes() == 0
    first = run()
    kept = LIB.qg_scratch_bytes()
    assert kept >= 40 * 256 * 2
    assert torch.equal(run(), first) and LIB.qg_scratch_bytes() == kept
    seen = []
    t = threading.Thread(target=lambda: (run(), seen.append(LIB.qg_scratch_bytes())))
    t.start()
    t.join()
    assert seen == [kept] and LIB.qg_scratch_bytes() == kept
    LIB.qg_scratch_release()
    assert LIB.qg_scratch_bytes() == 0
    assert torch.equal(run(), first)


def _native_threads() -> int:
    import os

    return len(os.listdir("/proc/self/task"))


def test_a_thread_that_hands_the_kernels_over_frees_its_scratch_and_workers(tiny_model_dir):
    """``qg_thread_release`` frees the calling thread's scratch and its OpenMP worker threads (an
    idle team left on a loading thread made libgomp throttle the serving thread's spin-waits); the
    thread's next product makes both again, with the same result. ``AsyncEngine.start`` does it
    for the thread that starts the engine thread."""
    import threading
    import time

    from hotprefix.engine.async_engine import AsyncEngine
    from hotprefix.engine.engine import LLMEngine
    from server_support import tiny_config

    run = _small_product()

    def fewer_threads_than(n: int) -> bool:  # a released worker exits after its last barrier
        deadline = time.monotonic() + 30
        while _native_threads() >= n and time.monotonic() < deadline:
            time.sleep(0.01)
        return _native_threads() < n

    seen: dict = {}

    def loader():  # a fresh thread: its OpenMP team is its own
        before = _native_threads()
        first = run()
        seen["team"] = _native_threads() - before  # the team's worker (2 threads asked)
        seen["kept"] = LIB.qg_scratch_bytes()
        seen["released"] = LIB.qg_thread_release()
        seen["scratch"] = LIB.qg_scratch_bytes()
        seen["gone"] = fewer_threads_than(before + 1)
        seen["same"] = torch.equal(run(), first)  # made again on demand
        aengine = AsyncEngine(LLMEngine(tiny_config(tiny_model_dir))).start()
        seen["after_start"] = LIB.qg_scratch_bytes()  # the engine thread now runs the model
        aengine.shutdown()

    t = threading.Thread(target=loader)
    t.start()
    t.join()
    assert seen["team"] >= 1 and seen["kept"] > 0
    assert seen["released"] == 0 and seen["scratch"] == 0 and seen["gone"]
    assert seen["same"] and seen["after_start"] == 0
