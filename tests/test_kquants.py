"""The gguf mode on Q5_0 and the k-quants (Q4_K, Q5_K, Q6_K): their blocks repacked without loss
(``gguf_blocks.py``: the same fp32 weights as ``gguf.quants.dequantize``, bit for bit), multiplied
by ``qgemm.c`` with every ISA level giving the portable reference's bits whatever the rows beside
a row, and a GGUF file of such tensors loaded in the gguf mode holding about the file's bytes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from hotprefix.model.fused import library
from hotprefix.model.gguf_blocks import (BLOCK_BYTES, QF_K4, QF_K5, QF_K6, QF_Q5, QF_Q8, PackError,
                                         group_bytes)
from hotprefix.model.isa import runnable_levels
from hotprefix.model.qlinear import BlockRows, QuantLinear, QuantWeight

LIB = library()
pytestmark = pytest.mark.skipif(LIB is None, reason="no C compiler: the gguf mode is not offered")
LEVELS = [lv.name for lv in runnable_levels()]
KINDS = ["Q5_0", "Q4_K", "Q5_K", "Q6_K"]
T = gguf.GGMLQuantizationType


def make(kind: str, n: int, k: int, seed: int = 0) -> tuple[str, np.ndarray, torch.Tensor]:
    """(kind, raw blocks [n, bytes a row], gguf's dequantization of them). gguf-py quantizes Q5_0;
    the k-quants' blocks are random bytes (every value and 6-bit scale pattern) with finite fp16
    super-block scales of either sign, a few of them zero."""
    rng = np.random.default_rng(seed)
    if kind == "Q5_0":
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.1
        raw = quantize(w, T.Q5_0).reshape(n, -1)
    else:
        nsb = k // 256
        b = rng.integers(0, 256, (n, nsb, BLOCK_BYTES[kind]), dtype=np.uint8)
        d = (rng.standard_normal((n, nsb, 2)) * 1e-3).astype(np.float16)
        d[rng.random((n, nsb, 2)) < 0.05] = 0
        if kind == "Q6_K":
            b[..., 208:210] = d[..., :1].copy().view(np.uint8)
        else:
            b[..., 0:4] = d.view(np.uint8)
        raw = b.reshape(n, -1)
    deq = dequantize(raw, T[kind]).reshape(n, k).astype(np.float32)
    return kind, raw, torch.from_numpy(np.ascontiguousarray(deq))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


@pytest.mark.parametrize("kind", KINDS)
def test_repacked_blocks_hold_ggufs_own_weights(kind):
    """The packed weight read back (numpy oracle, and the C rows the LM head and a tied
    embedding use) is gguf's dequantization to the bit, -0.0 included; the bytes held per weight
    stay near the file's."""
    _, raw, deq = make(kind, 40, 512, seed=len(kind))
    w = QuantWeight([(kind, raw)], 512)
    fmt = {"Q5_0": QF_Q5, "Q4_K": QF_K4, "Q5_K": QF_K5, "Q6_K": QF_K6}[kind]
    assert w.formats == (fmt,) * 3
    assert w.nbytes == 3 * (8 + group_bytes(fmt, 16)) == 3 * (8 + LIB.qg_group_bytes(fmt, 16))
    per_weight = (w.nbytes / 3) / (16 * 512)
    file_per_weight = raw.nbytes / (40 * 512)
    assert per_weight <= {"Q5_0": 1.01, "Q4_K": 1.04, "Q5_K": 1.03, "Q6_K": 1.02}[kind] * file_per_weight
    assert same_bits(w.dequantize(), deq)
    ids = torch.tensor([[39, 0, 17], [16, 31, 5]])
    assert same_bits(BlockRows(LIB, w)[ids], deq[ids])


def test_a_stack_keeps_each_groups_format_and_refuses_a_shared_k_group():
    parts = [make("Q4_K", 32, 256, 1), make("Q6_K", 16, 256, 2), make("Q5_0", 16, 256, 3),
             make("Q5_K", 16, 256, 4)]
    w = QuantWeight([(kind, raw) for kind, raw, _ in parts], 256)
    assert w.formats == (QF_K4, QF_K4, QF_K6, QF_Q5, QF_K5)
    assert same_bits(w.dequantize(), torch.cat([deq for _, _, deq in parts]))
    with pytest.raises(PackError, match="share a group"):
        QuantWeight([(k, r[:24]) for k, r, _ in parts[:2]], 256)  # rows 16-31: Q4_K and Q6_K


def _bits_alone(lin, x, w, slices) -> torch.Tensor:
    """``lin(x, w)``, checked to give each slice of rows its bits alone, on one thread, and the
    portable reference's bits (both its C reference and the portable level's library)."""
    full = lin(x, w, None)
    for lo, hi in slices:
        assert same_bits(lin(x[lo:hi], w, None), full[lo:hi]), (lo, hi)
    torch.set_num_threads(1)
    try:
        assert same_bits(lin(x, w, None), full)
    finally:
        torch.set_num_threads(2)
    assert same_bits(lin.reference(x, w), full)
    assert same_bits(QuantLinear(library("portable"), None)(x, w, None), full)
    return full


@pytest.mark.parametrize("level", LEVELS)
def test_every_level_gives_the_portable_bits_whatever_shares_the_call(level):
    """At each ISA level, on a stack of every new format with a partial last group: a row's bits
    in any slice of the batch, on one thread, equal the portable reference's; and the product is
    within the 16-bit activations' rounding of exact arithmetic on gguf's weights."""
    parts = [make("Q4_K", 48, 512, 5), make("Q6_K", 32, 512, 6), make("Q5_K", 16, 512, 7),
             make("Q5_0", 21, 512, 8)]
    w = QuantWeight([(kind, raw) for kind, raw, _ in parts], 512)
    deq = torch.cat([d for _, _, d in parts])
    lin = QuantLinear(library(level), None)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(37, 512, generator=g) * torch.logspace(-2, 2, 512)
    x[3, :32] *= 1e5  # one block far above the rest
    full = _bits_alone(lin, x, w, [(0, 1), (5, 6), (3, 8), (0, 6), (5, 18), (1, 37), (2, 17), (3, 31), (0, 25)])
    ref = x.double() @ deq.double().T
    err = ((full.double() - ref).abs() / (x.double().abs() @ deq.double().abs().T).clamp(min=1e-30)).max()
    assert err < 2e-4, err.item()
    # Q5_0 rows in a group shared with Q8_0 ones are packed 8-bit: the same integer sums and float
    # steps, so the same bits as in their own 5-bit groups
    shared = QuantWeight([parts[3][:2], ("Q8_0", quantize(np.ones((11, 512), np.float32), T.Q8_0).reshape(11, -1))], 512)
    assert shared.formats == (QF_Q5, QF_Q8)
    assert same_bits(lin(x, shared, None)[:, :21], full[:, -21:])


@pytest.mark.parametrize("level", LEVELS)
def test_paired_groups_give_each_group_its_own_bits(level):
    """AVX-512 runs two groups of one format side by side on tiles of several rows
    (one broadcast of a row's activations feeds both; 5-bit groups decoded once a span of
    several tiles, else as read; 8-bit ones read as stored; Q6_K never): groups pair only
    within a format (Q4_K with Q6_K: apart; a Q5_K pair; a Q8_0 pair; Q5_0 with Q4_K: apart; a
    Q4_K pair whose second group has 8 of 16 lanes), and every row's bits in slices below, at
    and above the 6-row tile, and on one thread, equal the portable reference's."""
    q8 = quantize(np.random.default_rng(16).standard_normal((32, 512)).astype(np.float32), T.Q8_0)
    q8 = q8.reshape(32, -1)
    parts = [make("Q4_K", 16, 512, 11), make("Q6_K", 16, 512, 12), make("Q5_K", 32, 512, 14),
             ("Q8_0", q8, torch.from_numpy(dequantize(q8, T.Q8_0).reshape(32, 512))),
             make("Q5_0", 16, 512, 15), make("Q4_K", 40, 512, 13)]
    w = QuantWeight([(kind, raw) for kind, raw, _ in parts], 512)
    assert w.formats == (QF_K4, QF_K6, QF_K5, QF_K5, QF_Q8, QF_Q8, QF_Q5, QF_K4, QF_K4, QF_K4)
    lin = QuantLinear(library(level), None)
    x = torch.randn(29, 512, generator=torch.Generator().manual_seed(4)) * torch.logspace(-2, 2, 512)
    full = _bits_alone(lin, x, w, [(0, 1), (2, 7), (0, 6), (3, 9), (5, 17), (1, 24), (0, 29)])
    deq = torch.cat([d for _, _, d in parts])
    ref = x.double() @ deq.double().T
    err = ((full.double() - ref).abs() / (x.double().abs() @ deq.double().abs().T).clamp(min=1e-30)).max()
    assert err < 2e-4, err.item()


@pytest.mark.parametrize("level", LEVELS)
def test_8_bit_activations_give_the_portable_bits_on_every_format(level):
    """``narrow`` (8-bit activations; on AMX one tile product a block, Q6_K two half tiles): at
    each level, a row's bits in any slice and on one thread equal the portable reference's."""
    parts = [make("Q4_K", 48, 512, 5), make("Q6_K", 32, 512, 6), make("Q5_K", 16, 512, 7),
             make("Q5_0", 21, 512, 8)]
    w = QuantWeight([(kind, raw) for kind, raw, _ in parts], 512, narrow=True)
    lin = QuantLinear(library(level), None)
    x = torch.randn(70, 512, generator=torch.Generator().manual_seed(9)) * torch.logspace(-2, 2, 512)
    x[3, :32] *= 1e5
    full = _bits_alone(lin, x, w, [(0, 1), (5, 6), (0, 6), (5, 18), (1, 37), (2, 70), (32, 64), (3, 31)])
    assert not same_bits(QuantLinear(library(level), None)(x, QuantWeight([(k, r) for k, r, _ in parts], 512), None), full)


def _write_gguf(path, kinds: dict[str, str], seed: int = 0) -> dict[str, np.ndarray]:
    """A 2-layer llama GGUF (hidden 256, MLP 512, 4 heads of 64, 2 KV heads, vocab 64) with the
    matrices in ``kinds`` (GGUF tensor name part -> type); returns the raw bytes by tensor name."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(256)
    w.add_feed_forward_length(512)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(64)
    raws = {}

    def matrix(name: str, kind: str, n: int, k: int, s: int):
        if kind == "F16":  # no block kernel: dequantized, with a log line
            raws[name] = np.random.default_rng(s).standard_normal((n, k)).astype(np.float16) * 0.05
            w.add_tensor(name, raws[name])
            return
        _, raw, _ = make(kind, n, k, seed=s)
        if kind == "Q5_0":  # bigger weights than make's default so the model's signal is not noise
            raw = quantize(np.random.default_rng(s).standard_normal((n, k)).astype(np.float32) * 0.3,
                           T.Q5_0).reshape(n, -1)
        raws[name] = raw
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=T[kind])

    matrix("token_embd.weight", kinds["token_embd"], 64, 256, seed)
    ones = np.ones(256, np.float32)
    w.add_tensor("output_norm.weight", ones)
    shapes = {"attn_q": (256, 256), "attn_k": (128, 256), "attn_v": (128, 256), "attn_output": (256, 256),
              "ffn_gate": (512, 256), "ffn_up": (512, 256), "ffn_down": (256, 512)}
    for i in range(2):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        for j, (part, (n, k)) in enumerate(shapes.items()):
            matrix(f"blk.{i}.{part}.weight", kinds[part], n, k, seed + 10 * i + j + 1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return raws


def test_a_k_quant_gguf_loads_in_the_gguf_mode_near_its_file_size(tmp_path):
    """Q4_K / Q6_K / Q5_K / Q5_0 matrices as llama-quantize's Q4_K_M writes them: the loader keeps
    their blocks, the model multiplies with them (no dense copy: about the file's bytes), its
    logits follow the mixed mode on gguf's dequantized weights, and a prefix's rows computed alone
    have the bits they have inside the longer prefill (cold == warm)."""
    from hotprefix.model.attention import AttentionMetadata, PrefillSeq
    from hotprefix.model.llama import LlamaModel
    from hotprefix.model.loader import load_model

    kinds = {"token_embd": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K",
             "attn_output": "Q5_0", "ffn_gate": "Q4_K", "ffn_up": "Q5_K", "ffn_down": "Q6_K"}
    raws = _write_gguf(tmp_path / "tiny-k.gguf", kinds)
    loaded = load_model(str(tmp_path / "tiny-k.gguf"))
    assert {kind for kind, _ in loaded.blocks.values()} == {"Q4_K", "Q5_K", "Q6_K", "Q5_0"}
    cpu = torch.device("cpu")
    quant = LlamaModel(loaded.arch, loaded.weights, cpu, torch.bfloat16, "gguf", True, loaded.blocks)
    assert quant.weight_mode == "gguf"
    layer = quant.layers[0]
    assert layer["qkv"].formats == (QF_K4,) * 24 + (QF_K6,) * 8
    assert set(layer["gate_up"].formats) == {QF_K4, QF_K5} and set(layer["down"].formats) == {QF_K6}
    assert isinstance(quant.lm_head, QuantWeight) and isinstance(quant.embed, BlockRows)
    file_bytes = sum(r.nbytes for r in raws.values())
    assert file_bytes < quant.weight_bytes() < 1.5 * file_bytes, (quant.weight_bytes(), file_bytes)
    mixed = LlamaModel(loaded.arch, loaded.weights, cpu, torch.bfloat16, "mixed", True)

    def run(model, ids):
        caches = [(torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16),
                   torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)) for _ in range(2)]
        n = len(ids)
        meta = AttentionMetadata(slot_mapping=torch.arange(n), prefills=[PrefillSeq(0, n, n, torch.arange(4))])
        return model.forward(torch.tensor(ids), torch.arange(n), caches, meta, None)

    ids = torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    fast, ref = run(quant, ids), run(mixed, ids)
    assert fast.shape == (40, 64)
    assert (fast - ref).abs().max() < 3e-2 * ref.abs().max(), ((fast - ref).abs().max(), ref.abs().max())
    assert (fast.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    assert same_bits(run(quant, ids[:23]), fast[:23])


def test_the_one_call_layers_follow_new_pools_at_old_addresses(tmp_path):
    """The one-call layers keep their table of each layer's weights and pools between steps: a step
    whose pools differ from the previous step's in any tensor (here new V pools beside the old K
    pools, as when freed pools' memory is handed out again in another order) writes and reads the
    new pools, never the old ones (a kept V pointer once wrote into freed memory)."""
    from hotprefix.model.attention import AttentionMetadata, PrefillSeq
    from hotprefix.model.llama import LlamaModel
    from hotprefix.model.loader import load_model

    kinds = {"token_embd": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K",
             "attn_output": "Q4_K", "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"}
    _write_gguf(tmp_path / "tiny-pools.gguf", kinds)
    loaded = load_model(str(tmp_path / "tiny-pools.gguf"))
    model = LlamaModel(loaded.arch, loaded.weights, torch.device("cpu"), torch.bfloat16, "gguf", True,
                       loaded.blocks)
    ids = torch.randint(0, 64, (30,), generator=torch.Generator().manual_seed(5))
    meta = AttentionMetadata(slot_mapping=torch.arange(30), prefills=[PrefillSeq(0, 30, 30, torch.arange(4))])

    def pool():
        return torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)

    for all_layers in (True, False):
        model.all_layers_call = all_layers
        first = [(pool(), pool()) for _ in range(2)]
        logits = model.forward(ids, torch.arange(30), first, meta, None)
        for swap in ("v", "k"):
            pools = [(k, pool()) if swap == "v" else (pool(), v) for k, v in first]
            again = model.forward(ids, torch.arange(30), pools, meta, None)
            assert same_bits(again, logits)
            for (k0, v0), (k1, v1) in zip(first, pools):
                assert v0.abs().sum() > 0 and k0.abs().sum() > 0
                assert torch.equal(k1, k0) and torch.equal(v1, v0), (all_layers, swap)
            first = pools
    assert model.quant_layers is not None  # the one call for every layer runs where the C attention does


def test_a_matrix_without_a_block_kernel_is_dequantized_and_logged(tmp_path, caplog):
    """An F16 down projection beside k-quant matrices: the loader says which type has no kernel
    and what it costs in fp32; the model multiplies it through the fp32-input GEMM, the rest on
    their blocks."""
    import logging

    from hotprefix.model.llama import LlamaModel
    from hotprefix.model.loader import load_model

    kinds = {"token_embd": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K",
             "attn_output": "Q4_K", "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "F16"}
    _write_gguf(tmp_path / "tiny-f16.gguf", kinds)
    with caplog.at_level(logging.WARNING):
        loaded = load_model(str(tmp_path / "tiny-f16.gguf"))
    assert "2 matrices stored as F16 have no block kernel" in caplog.text
    assert "1.0 MiB as fp32" in caplog.text  # 2 x 256 x 512 x 4 bytes
    model = LlamaModel(loaded.arch, loaded.weights, torch.device("cpu"), torch.bfloat16, "gguf", True,
                       loaded.blocks)
    assert model.weight_mode == "gguf" and model.quant_layers is None
    assert isinstance(model.layers[1]["gate_up"], QuantWeight)
    assert not isinstance(model.layers[1]["down"], QuantWeight)


@pytest.mark.parametrize("level", LEVELS)
def test_8_bit_products_at_their_bounds_keep_the_portable_bits(level):
    """The byte-product paths' worst case (qgemm_a8.c): every Q6_K value at -32 or +31 against
    activations at +127 and -127 (stored as 255 and 1), so each VPMADDUBSW pair sum reaches
    +-16,320 and two added +-32,640: nothing may saturate or wrap. At each level, equal to the
    portable reference, and to the exact sum of the integer products."""
    n, k = 32, 512
    raw = np.zeros((n, k // 256, BLOCK_BYTES["Q6_K"]), np.uint8)  # ql = qh = 0: q = -32
    raw[16:, :, :192] = 0xFF  # lanes 16-31: q = 63 - 32 = 31
    raw[..., 192:208] = 1  # every 16-input scale 1
    raw[..., 208:210] = np.array([1.0], np.float16).view(np.uint8)  # d = 1
    raw = raw.reshape(n, -1)
    w = QuantWeight([("Q6_K", raw)], k, narrow=True)
    x = torch.ones(40, k)
    x[20:] = -1.0  # rows 20-39: every activation -127
    x[10:20, ::2] = -1.0  # rows 10-19: +127 and -127 alternating
    y = QuantLinear(library(level), None)(x, w, None)
    assert same_bits(y, QuantLinear(library("portable"), None)(x, w, None))
    q = torch.where(torch.arange(n) < 16, -32.0, 31.0)
    assert torch.equal(y, x @ torch.ones(k, 1) * q)  # 127 * (1 / 127) per input, exact here
