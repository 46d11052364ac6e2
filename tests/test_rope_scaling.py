"""Llama 3 RoPE scaling (issue 27): a tiny random-weight ``LlamaForCausalLM`` with
``rope_type: llama3`` against transformers fp32, loaded from its HF directory, from the GGUF that
llama.cpp's own ``convert_hf_to_gguf.py`` writes (``rope_freqs.weight``), and from a GGUF written
here with ``gguf``'s writer under the converter's names (for machines without the converter).

The model's context is 8,192 positions over an original 1,024: its frequencies with wavelengths
over 256 positions are divided by up to 8, so the wrong frequencies change the logits at every
position, most beyond 1,024 (each comparison is made below and beyond it). A guard checks that the
unscaled frequencies give logits well outside the tolerance, so the comparisons can fail.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hotprefix import LLM, SamplingParams
from hotprefix.model.llama import LlamaModel, RotaryEmbedding
from hotprefix.model.loader import ModelLoadError, load_model
from hotprefix.model.rope import hf_rope, inverse_frequencies, llama3_freq_factors

from model_support import all_logits, llamacpp_src

ORIGINAL = 1024
"""original_max_position_embeddings of the scaled model (its max_position_embeddings is 8,192)."""
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": ORIGINAL}
CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=8192, rope_theta=500000.0,
              rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.1)
"""Weights of std 0.1: transformers' default 0.02 gives near-uniform attention, which RoPE barely
moves; at 0.25 attention is so sharp that transformers' own fp32 RoPE angles (position x
frequency rounded to fp32) move its logits by 1e-3 from a float64 computation, where ours stay
within 1e-4 of it."""
PROMPT_LEN = 1400
"""Tokens of the long prompt: positions below and beyond ``ORIGINAL``."""
LOGIT_TOL = 1e-4
"""Largest |ours - transformers| logit, both fp32 (logits of std 0.8). Measured: 4e-6 below
position 100, 1.5e-5 up to 1,400 (our tables are computed in float64, transformers' position x
frequency in fp32). The unscaled frequencies are 0.5 to 3 off, with 629 of 1,400 argmaxes changed."""



def _hf_config(scaled: bool, vocab: int):
    from transformers import LlamaConfig

    return LlamaConfig(**CONFIG, vocab_size=vocab, rope_scaling=dict(LLAMA3) if scaled else None)


def _save_model(d: Path, scaled: bool, tokenizer) -> Path:
    """A random LlamaForCausalLM (seed 0: the scaled and plain models share weights) in ``d``."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_hf_config(scaled, tokenizer.vocab_size))
    model.save_pretrained(str(d))
    tokenizer.save_json(str(d / "tokenizer.json"))
    return d


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory, default_tokenizer) -> Path:
    return _save_model(tmp_path_factory.mktemp("llama3-rope"), True, default_tokenizer)


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory, default_tokenizer) -> Path:
    return _save_model(tmp_path_factory.mktemp("plain-rope"), False, default_tokenizer)


def _reference(d: Path):
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    return LlamaForCausalLM.from_pretrained(str(d), torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llama3_ref(llama3_dir):
    return _reference(llama3_dir)


@pytest.fixture(scope="module")
def prompts(default_tokenizer) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    v = default_tokenizer.vocab_size
    return [torch.randint(0, v, (n,), generator=g).tolist() for n in (PROMPT_LEN, 24, 1100)]


def _llm(path, tokenizer=None) -> LLM:
    return LLM(str(path), dtype="float32", num_blocks=200, block_size=16, max_model_len=3200,
               enable_prefix_caching=False, num_threads=2,
               tokenizer=None if tokenizer is None else str(tokenizer))



def _compare(llm: LLM, ref, ids: list[int]) -> tuple[float, float]:
    """(max |logit diff| below ORIGINAL, beyond it) against transformers; argmax equal at every
    position."""
    ours = all_logits(llm.engine.runner.model, llm, ids)
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0].float()
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    diff = (ours - theirs).abs().amax(-1)
    return diff[:ORIGINAL].max().item(), (diff[ORIGINAL:].max().item() if len(ids) > ORIGINAL else 0.0)


def _greedy_equal(llm: LLM, ref, prompts: list[list[int]], n: int = 8) -> None:
    for ids in prompts:
        with torch.no_grad():
            want = ref.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        got = llm.generate([ids], SamplingParams(max_tokens=n, ignore_eos=True))[0].token_ids
        assert got == want, (len(ids), got, want)


def _check_model(path, ref, prompts, tokenizer=None) -> LLM:
    llm = _llm(path, tokenizer)
    below, beyond = _compare(llm, ref, prompts[0])
    print(f"{os.path.basename(str(path))}: max |logit diff| {below:.2e} below {ORIGINAL}, "
          f"{beyond:.2e} beyond")
    assert below < LOGIT_TOL and beyond < LOGIT_TOL, (below, beyond)
    _greedy_equal(llm, ref, prompts)
    return llm


# ------------------------------------------------------------------ frequencies
def test_llama3_frequencies_match_transformers(llama3_dir):
    """Our inverse frequencies (float64) round to transformers' fp32 ones; some are scaled, some
    smoothed, some kept."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = json.loads((llama3_dir / "config.json").read_text())
    theta, factors = hf_rope(cfg, 16, "config.json")
    assert theta == CONFIG["rope_theta"] and len(factors) == 8
    assert factors[0] == 1.0 and factors[-1] == 8.0 and any(1.0 < f < 8.0 for f in factors)
    theirs, scale = ROPE_INIT_FUNCTIONS["llama3"](_hf_config(True, 100), "cpu")
    assert scale == 1.0
    ours = inverse_frequencies(16, theta, factors)
    np.testing.assert_allclose(ours.numpy(), theirs.double().numpy(), rtol=2 ** -23, atol=0)
    plain = inverse_frequencies(16, theta)
    assert not torch.allclose(ours, plain)


def test_rotary_tables_match_transformers():
    """cos/sin of the scaled model against transformers' LlamaRotaryEmbedding at positions up to
    8,191: within its fp32 rounding of position x frequency (about pos x 2^-24 rad; the bound is
    4 times that, plus an fp32 ulp of cos/sin). The unscaled tables are far outside it."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = _hf_config(True, 100)
    _, factors = hf_rope(cfg.to_dict(), 16, "cfg")
    ours = RotaryEmbedding(16, CONFIG["rope_theta"], 8192, torch.device("cpu"), torch.float32, factors)
    pos = torch.arange(8192)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # torch's fp32 cos on its intra-op worker was at times 3e-5 off (pos 1)
    try:
        cos, sin = LlamaRotaryEmbedding(cfg)(torch.zeros(1, 8192, 16), pos[None])
    finally:
        torch.set_num_threads(threads)
    bound = (pos.float() * 2 ** -22 + 2 ** -22)[:, None]
    assert ((ours.cos - cos[0]).abs() <= bound).all() and ((ours.sin - sin[0]).abs() <= bound).all()
    assert ours.cos.dtype == torch.float32
    plain = RotaryEmbedding(16, CONFIG["rope_theta"], 8192, torch.device("cpu"), torch.float32)
    assert ((plain.cos - cos[0]).abs() > 100 * bound).any()


def test_hf_rope_formats_and_refusals():
    """transformers 4's ``rope_scaling`` (``type`` or ``rope_type``, base beside it) and 5's
    ``rope_parameters`` (base inside it) give the same factors; other types are refused by name."""
    want = llama3_freq_factors(500000.0, 16, 8.0, 1.0, 4.0, ORIGINAL)
    params = {k: v for k, v in LLAMA3.items() if k != "rope_type"}
    v4 = {"rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **params}}
    v4b = {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **params}}
    v5 = {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **params}}
    for cfg in (v4, v4b, v5):
        assert hf_rope(cfg, 16, "c") == (500000.0, want)
    assert hf_rope({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, 16, "c") == (5e5, None)
    assert hf_rope({"rope_theta": 5e5, "rope_scaling": None}, 16, "c") == (5e5, None)
    # original_max_position_embeddings falls back to max_position_embeddings, as in transformers
    no_orig = {k: v for k, v in params.items() if k != "original_max_position_embeddings"}
    assert hf_rope({"max_position_embeddings": ORIGINAL, "rope_theta": 5e5,
                    "rope_scaling": {"rope_type": "llama3", **no_orig}}, 16, "c") == (5e5, want)
    for kind in ("linear", "dynamic", "yarn", "longrope"):
        with pytest.raises(ModelLoadError, match=f"RoPE scaling type '{kind}' is not supported"):
            hf_rope({"rope_scaling": {"rope_type": kind, "factor": 2.0}}, 16, "c")
    with pytest.raises(ModelLoadError, match="needs factor"):
        hf_rope({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 16, "c")


# ------------------------------------------------------------------ HF directory
def test_hf_dir_llama3_matches_transformers(llama3_dir, llama3_ref, prompts):
    loaded = load_model(str(llama3_dir))
    assert loaded.arch.rope_freq_factors is not None
    llm = _check_model(llama3_dir, llama3_ref, prompts)
    # the guard: the same weights with the unscaled frequencies are far outside the tolerance
    eng = llm.engine
    model = LlamaModel(dataclasses.replace(loaded.arch, rope_freq_factors=None), loaded.weights,
                       torch.device("cpu"), torch.float32)
    ids = prompts[0]
    wrong = all_logits(model, llm, ids)
    with torch.no_grad():
        theirs = llama3_ref(torch.tensor([ids])).logits[0].float()
    diff = (wrong - theirs).abs().amax(-1)
    assert diff[:ORIGINAL].max() > 100 * LOGIT_TOL and diff[ORIGINAL:].max() > 100 * LOGIT_TOL
    assert eng.runner.model.arch.rope_freq_factors == loaded.arch.rope_freq_factors


def test_hf_dir_without_scaling_still_matches(plain_dir, prompts):
    assert load_model(str(plain_dir)).arch.rope_freq_factors is None
    _check_model(plain_dir, _reference(plain_dir), prompts)


def test_fingerprint_names_the_factors(llama3_dir, plain_dir, tmp_path):
    """Scaled and unscaled checkpoints of the same weights are different namespaces."""
    scaled, plain = load_model(str(llama3_dir)), load_model(str(plain_dir))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(scaled.weights[name], plain.weights[name])  # the same weights (seed 0)
    assert scaled.fingerprint != plain.fingerprint
    copy = tmp_path / "copy"
    shutil.copytree(plain_dir, copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["rope_parameters"] = {**LLAMA3, "rope_theta": CONFIG["rope_theta"], "factor": 4.0}
    (copy / "config.json").write_text(json.dumps(cfg))
    other = load_model(str(copy))
    assert other.arch.rope_freq_factors != scaled.arch.rope_freq_factors
    assert len({other.fingerprint, scaled.fingerprint, plain.fingerprint}) == 3


def test_hf_dir_other_scaling_type_is_refused(plain_dir, tmp_path):
    bad = tmp_path / "yarn"
    shutil.copytree(plain_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                              "original_max_position_embeddings": 1024}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="RoPE scaling type 'yarn' is not supported"):
        load_model(str(bad))


# ------------------------------------------------------------------ GGUF
@pytest.fixture(scope="module")
def converted_gguf(llama3_dir, tmp_path_factory) -> Path:
    """The scaled model through llama.cpp's own converter (fp32 tensors)."""
    src = llamacpp_src()
    if src is None:
        pytest.skip("llama.cpp's convert_hf_to_gguf.py not found (unpack it with "
                    "../shared/tools/llamacpp-peer.sh build, or set HOTPREFIX_LLAMACPP_SRC)")
    pytest.importorskip("sentencepiece", reason="convert_hf_to_gguf.py imports sentencepiece")
    out = tmp_path_factory.mktemp("llama3-gguf") / "tiny-llama3.gguf"
    env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
    r = subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(llama3_dir),
                        "--outfile", str(out), "--outtype", "f32"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def test_converted_gguf_matches_transformers(converted_gguf, llama3_dir, llama3_ref, prompts):
    import gguf

    reader = gguf.GGUFReader(str(converted_gguf))
    freqs = [t for t in reader.tensors if t.name == "rope_freqs.weight"]
    assert len(freqs) == 1  # what the converter writes for llama3 (and no rope.scaling.type)
    arch = load_model(str(converted_gguf)).arch
    hf = load_model(str(llama3_dir)).arch
    np.testing.assert_allclose(arch.rope_freq_factors, hf.rope_freq_factors, rtol=1e-6)
    # the HF directory's tokenizer: building one from a GGUF's vocabulary takes 15 s, and the
    # RoPE is what is compared here
    _check_model(converted_gguf, llama3_ref, prompts, tokenizer=llama3_dir)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row permutation (``LlamaModel.permute``)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(hf_dir: Path, out: Path, rope_freqs: np.ndarray | None,
                scaling_type: str | None = None) -> Path:
    """The HF model as the converter writes it, with ``gguf``'s writer: its tensor names, Q/K
    permutation, llama metadata and ``rope_freqs.weight``; no tokenizer (``llama.vocab_size``
    instead: the tests load the HF directory's)."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = load_file(str(hf_dir / "model.safetensors"))
    wr = gguf.GGUFWriter(str(out), "llama")
    wr.add_name("tiny-llama3")
    wr.add_context_length(cfg["max_position_embeddings"])
    wr.add_embedding_length(cfg["hidden_size"])
    wr.add_block_count(cfg["num_hidden_layers"])
    wr.add_feed_forward_length(cfg["intermediate_size"])
    wr.add_head_count(nh)
    wr.add_head_count_kv(nkv)
    wr.add_rope_freq_base(CONFIG["rope_theta"])
    wr.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    wr.add_rope_dimension_count(cfg["hidden_size"] // nh)
    if scaling_type:
        wr.add_rope_scaling_type(gguf.RopeScalingType(scaling_type))
        wr.add_rope_scaling_factor(2.0)
    wr.add_vocab_size(cfg["vocab_size"])
    if rope_freqs is not None:
        wr.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    wr.add_tensor("token_embd.weight", w["model.embed_tokens.weight"])
    wr.add_tensor("output_norm.weight", w["model.norm.weight"])
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(cfg["num_hidden_layers"]):
        for hf, gg in names.items():
            t = w[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                t = _permute(t, nh)
            elif gg == "attn_k":
                t = _permute(t, nkv)
            wr.add_tensor(f"blk.{i}.{gg}.weight", np.ascontiguousarray(t))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return out


def test_written_gguf_matches_transformers(llama3_dir, llama3_ref, prompts, tmp_path):
    """The GGUF path without the converter: ``rope_freqs.weight`` written by ``gguf``'s writer
    (the factors llama.cpp's converter computes, in fp32)."""
    factors = np.array(llama3_freq_factors(CONFIG["rope_theta"], 16, 8.0, 1.0, 4.0, ORIGINAL),
                       dtype=np.float32)
    path = _write_gguf(llama3_dir, tmp_path / "written.gguf", factors)
    arch = load_model(str(path)).arch
    assert arch.rope_freq_factors == tuple(float(x) for x in factors)
    assert arch.rope_theta == CONFIG["rope_theta"] and arch.max_position == 8192
    _check_model(path, llama3_ref, prompts, tokenizer=llama3_dir)


def test_gguf_bad_factors_and_other_scaling_are_refused(llama3_dir, tmp_path):
    with pytest.raises(ModelLoadError, match="rope_freqs.weight has 4 factors, expected 8"):
        load_model(str(_write_gguf(llama3_dir, tmp_path / "short.gguf", np.ones(4))))
    with pytest.raises(ModelLoadError, match="not a positive finite number"):
        load_model(str(_write_gguf(llama3_dir, tmp_path / "zero.gguf", np.zeros(8))))
    with pytest.raises(ModelLoadError, match="RoPE scaling type 'linear' is not supported"):
        load_model(str(_write_gguf(llama3_dir, tmp_path / "linear.gguf", None, "linear")))


_TABLES_TWICE = """
import torch
from hotprefix.model.llama import RotaryEmbedding
torch.set_num_threads(2)
a = RotaryEmbedding(64, 10000.0, 256, torch.device("cpu"), torch.float32)
b = RotaryEmbedding(64, 10000.0, 256, torch.device("cpu"), torch.float32)
print(int(torch.equal(a.cos, b.cos) and torch.equal(a.sin, b.sin)))
"""


def test_rope_tables_are_the_same_in_every_process_and_call():
    """The tables are those of float64 cos/sin on one thread, rounded (the values every start had
    but some: torch's two-thread cos gave the half its worker computed values about 1e-9 off in
    the first call of about one process in five, a float32 ULP in a few entries, so that start's
    K/V differed). Fresh processes each build the tables twice: with the old tables one process
    in five differed, so these four catch it in about three runs of five."""
    import torch

    from hotprefix.model.llama import RotaryEmbedding
    from hotprefix.model.rope import inverse_frequencies

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for hd, theta, n in [(64, 10000.0, 4096), (128, 500000.0, 8192), (256, 1e6, 1024)]:
            f = torch.outer(torch.arange(n, dtype=torch.float64), inverse_frequencies(hd, theta))
            e = torch.cat([f, f], -1)
            r = RotaryEmbedding(hd, theta, n, torch.device("cpu"), torch.float32)
            assert torch.equal(r.cos, e.cos().float()) and torch.equal(r.sin, e.sin().float())
    finally:
        torch.set_num_threads(old)
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    for _ in range(4):
        out = subprocess.run([sys.executable, "-c", _TABLES_TWICE], capture_output=True, text=True,
                             env=env, check=True)
        assert out.stdout.strip() == "1", out.stderr[-2000:]
