"""Architecture families against transformers (issue 27): tiny random-weight ``Qwen3ForCausalLM``,
``Gemma3ForCausalLM`` (text), ``Qwen2ForCausalLM`` (Q/K/V bias) and ``MistralForCausalLM`` (a
``llama`` GGUF, Q/K rows permuted), each loaded from its HF directory and from a GGUF written here
with ``gguf``'s writer as llama.cpp's ``convert_hf_to_gguf.py`` writes it (its tensor names,
gemma's ``1 + w`` norms, its metadata); where the converter is at hand, its own GGUF is compared
with ours tensor by tensor and run too (skipped without it).

Gemma 3's model has a sliding window of 8 keys on 5 of its 6 layers (layer 5 global, llama.cpp's
default pattern), a second RoPE base on the local layers, QK-norm, sandwich norms and GELU-tanh;
prompts of 40-300 tokens cross the window many times. Every norm weight is random (transformers
initialises them to the identity), so a norm applied wrongly moves the logits. Guards check that
the window, the QK-norm, qwen2's bias and mistral's RoPE base (1e6) matter: without them the
logits are far outside the tolerance.
Cold == warm: the engine's logits with a prefix from the cache past the window equal a cold
prefill's bit for bit, in the fused kernels' path and in torch's.
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
from hotprefix.model.llama import LlamaModel
from hotprefix.model.loader import load_model

from model_support import all_logits, llamacpp_src, save_random_model

LOGIT_TOL = 1e-4
"""Largest |ours - transformers| logit, both fp32 (logits of std ~1)."""
COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=32,
              max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=True,
              initializer_range=0.1)
"""head_dim 32 is not hidden / heads (16): read from the file, as the real models need."""
QWEN3 = dict(COMMON, num_hidden_layers=2, num_key_value_heads=2, rope_theta=1e6)
GEMMA3 = dict(COMMON, num_hidden_layers=6, num_key_value_heads=1, sliding_window=8,
              query_pre_attn_scalar=32, rope_parameters={
                  "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
WINDOW = 8
QWEN2 = dict(COMMON, num_hidden_layers=2, num_key_value_heads=2, rope_theta=1e6,
             use_sliding_window=False)
MISTRAL = dict(COMMON, num_hidden_layers=2, num_key_value_heads=1, rope_theta=1e6,
               sliding_window=None)
"""Mistral 7B v0.2+ / Nemo: GQA, RoPE base 1e6, no window, a head_dim of its own (Nemo's)."""
CLASSES = {"qwen3": ("Qwen3ForCausalLM", "Qwen3Config", QWEN3),
           "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", GEMMA3),
           "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", QWEN2),
           "mistral": ("MistralForCausalLM", "MistralConfig", MISTRAL)}
"""Family -> transformers' model class, config class, and the tiny config."""



def _build(kind: str, d: Path, tokenizer):
    """A random model of ``kind`` saved in ``d`` with the default model's tokenizer; every norm
    weight and bias random too."""
    model_cls, config_cls, cfg = CLASSES[kind]
    return save_random_model(d, tokenizer, model_cls, config_cls, cfg,
                             norm_offset=0.0 if kind == "gemma3" else 1.0)


def _reference(d: Path, kind: str):
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cls = getattr(transformers, CLASSES[kind][0])
    return cls.from_pretrained(str(d), torch_dtype=torch.float32, attn_implementation="eager").eval()


def write_gguf(hf_dir: Path, out: Path, quant: bool = False) -> Path:
    """The HF model as ``convert_hf_to_gguf.py`` writes it (fp32), with ``gguf``'s writer:
    qwen3: llama names plus ``attn_q_norm``/``attn_k_norm``, Q/K rows unpermuted; gemma3: its
    four norms a layer, every ``*norm.weight`` stored as ``1 + w``, the sliding window; qwen2:
    llama names plus the Q/K/V ``.bias``; mistral: a ``llama`` file, Q/K rows permuted as the
    converter's ``LlamaModel.permute``, ``rope.dimension_count``. No tokenizer (``vocab_size``
    instead: the tests load the HF directory's). ``quant``: the matrices (and the embedding) in
    Q8_0 blocks, as ``llama-quantize`` would store them, so the ``gguf`` weight mode runs them."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    gemma = cfg["model_type"] == "gemma3_text"
    arch = {"gemma3_text": "gemma3", "mistral": "llama"}.get(cfg["model_type"], cfg["model_type"])
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = load_file(str(hf_dir / "model.safetensors"))
    wr = gguf.GGUFWriter(str(out), arch)
    wr.add_name(f"tiny-{arch}")
    wr.add_block_count(cfg["num_hidden_layers"])
    wr.add_context_length(cfg["max_position_embeddings"])
    wr.add_embedding_length(cfg["hidden_size"])
    wr.add_feed_forward_length(cfg["intermediate_size"])
    wr.add_head_count(cfg["num_attention_heads"])
    wr.add_head_count_kv(cfg["num_key_value_heads"])
    wr.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    wr.add_key_length(cfg["head_dim"])
    wr.add_value_length(cfg["head_dim"])
    if gemma:
        wr.add_rope_freq_base(cfg["rope_parameters"]["full_attention"]["rope_theta"])
        wr.add_sliding_window(cfg["sliding_window"])
    else:
        wr.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    if arch == "llama":
        wr.add_rope_dimension_count(cfg["head_dim"])
    wr.add_vocab_size(cfg["vocab_size"])
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    names.update({"post_attention_layernorm": "post_attention_norm",
                  "pre_feedforward_layernorm": "ffn_norm",
                  "post_feedforward_layernorm": "post_ffw_norm"} if gemma else
                 {"post_attention_layernorm": "ffn_norm"})

    def put(name: str, t: np.ndarray) -> None:
        if gemma and name.endswith("norm.weight"):
            t = t + np.float32(1.0)  # the converter's norm_shift
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            t = _permute(t, nh if ".attn_q." in name else nkv)
        t = np.ascontiguousarray(t, dtype=np.float32)
        if quant and t.ndim == 2 and not name.endswith("norm.weight"):
            q8 = gguf.GGMLQuantizationType.Q8_0
            wr.add_tensor(name, gguf.quants.quantize(t, q8), raw_dtype=q8)
        else:
            wr.add_tensor(name, t)

    put("token_embd.weight", w["model.embed_tokens.weight"])
    for i in range(cfg["num_hidden_layers"]):
        for hf, gg in names.items():
            if f"model.layers.{i}.{hf}.weight" in w:
                put(f"blk.{i}.{gg}.weight", w[f"model.layers.{i}.{hf}.weight"])
            if f"model.layers.{i}.{hf}.bias" in w:
                put(f"blk.{i}.{gg}.bias", w[f"model.layers.{i}.{hf}.bias"])
    put("output_norm.weight", w["model.norm.weight"])
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return out


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row permutation (``LlamaModel.permute``), for a ``llama`` file."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module", params=["qwen3", "gemma3", "qwen2", "mistral"])
def family_case(request, tmp_path_factory, default_tokenizer):
    """(kind, HF dir, transformers reference, written GGUF) per family."""
    kind = request.param
    d = _build(kind, tmp_path_factory.mktemp(f"tiny-{kind}"), default_tokenizer)
    return kind, d, _reference(d, kind), write_gguf(d, d.parent / f"tiny-{kind}.gguf")


@pytest.fixture(scope="module")
def prompts(default_tokenizer) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    v = default_tokenizer.vocab_size
    return [torch.randint(0, v, (n,), generator=g).tolist() for n in (300, 40, 23)]
"""300 tokens: past a key tile of torch's attention (256) with the window inside it and across it."""


def _llm(path, tokenizer=None, **kw) -> LLM:
    opts = dict(dtype="float32", num_blocks=128, block_size=16, max_model_len=1024,
                enable_prefix_caching=False, num_threads=2)
    return LLM(str(path), tokenizer=None if tokenizer is None else str(tokenizer), **{**opts, **kw})



def _theirs(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float()


def logits_close(model: LlamaModel, llm: LLM, ref, ids: list[int]) -> float:
    """Every position's logits within LOGIT_TOL of transformers', argmaxes equal: the largest
    difference."""
    ours, theirs = all_logits(model, llm, ids), _theirs(ref, ids)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    diff = (ours - theirs).abs().max().item()
    assert diff < LOGIT_TOL, diff
    return diff


def check_against(llm: LLM, ref, prompts: list[list[int]], n: int = 4) -> float:
    """``logits_close`` on the first prompt, greedy continuations equal on every prompt: the
    largest logit difference."""
    diff = logits_close(llm.engine.runner.model, llm, ref, prompts[0])
    for p in prompts:
        with torch.no_grad():
            want = ref.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False,
                                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        got = llm.generate([p], SamplingParams(max_tokens=n, ignore_eos=True))[0].token_ids
        assert got == want, (len(p), got, want)
    return diff


def test_gguf_matches_transformers(family_case, prompts):
    kind, d, ref, path = family_case
    arch = load_model(str(path)).arch
    assert arch.arch == ("llama" if kind == "mistral" else kind) and arch.head_dim == 32
    if kind == "gemma3":
        assert arch.sliding_window == WINDOW and arch.local_layers == (0, 1, 2, 3, 4)
        assert arch.rope_theta == 1e6 and arch.rope_theta_local == 1e4
        assert arch.attn_scale == 32 ** -0.5
    llm = _llm(path, tokenizer=d)
    diff = check_against(llm, ref, prompts)
    model = llm.engine.runner.model
    assert model.fused is not None  # the fused kernels' operators ran; now torch's
    torch_ops = LlamaModel(model.arch, load_model(str(path)).weights, torch.device("cpu"),
                           torch.float32, fused_kernels=False)
    diff_torch = logits_close(torch_ops, llm, ref, prompts[0])
    print(f"{kind} gguf: max |logit diff| {diff:.2e} (fused), {diff_torch:.2e} (torch ops)")
    # the guards: without the window (gemma3), the QK-norm (qwen3), the Q/K/V bias (qwen2) or
    # with llama's old RoPE base 10,000 (mistral) the logits are far off
    if kind == "gemma3":
        wrong_arch = dataclasses.replace(model.arch, local_layers=())
    elif kind == "mistral":
        assert model.arch.rope_theta == 1e6
        wrong_arch = dataclasses.replace(model.arch, rope_theta=1e4)
    else:
        wrong_arch = model.arch
    wrong = LlamaModel(wrong_arch, load_model(str(path)).weights, torch.device("cpu"), torch.float32)
    for layer in wrong.layers:
        if kind == "qwen3":
            del layer["q_norm"], layer["k_norm"]
        elif kind == "qwen2":
            assert layer["qkv_bias"] is not None
            layer["qkv_bias"] = None
    off = (all_logits(wrong, llm, prompts[0]) - _theirs(ref, prompts[0])).abs().max().item()
    assert off > 100 * LOGIT_TOL, off


def test_hf_dir_matches_transformers(family_case, prompts):
    """The HF checkpoint loads too (gemma's norms get the 1 the GGUF holds), same numbers."""
    kind, d, ref, path = family_case
    hf, gg = load_model(str(d)), load_model(str(path))
    assert hf.arch.rms_norm_eps == pytest.approx(gg.arch.rms_norm_eps, rel=1e-6)  # fp32 in a GGUF
    # a Mistral checkpoint is a llama GGUF (the converter writes MistralForCausalLM so)
    assert hf.arch.arch == ("mistral" if kind == "mistral" else gg.arch.arch)
    assert dataclasses.replace(hf.arch, rms_norm_eps=gg.arch.rms_norm_eps,
                               arch=gg.arch.arch) == gg.arch
    name = "model.layers.0.input_layernorm.weight"
    assert torch.equal(hf.weights[name], gg.weights[name])
    llm = _llm(d)
    logits_close(llm.engine.runner.model, llm, ref, prompts[1])


def test_cold_equals_warm_past_the_window(family_case, prompts):
    """A prompt's last logits with 48 tokens (6 windows) from the prefix cache equal a cold
    prefill's, bit for bit; greedy tokens too. The fused kernels, every family."""
    _check_cold_equals_warm(family_case, prompts, fused=True)


@pytest.mark.parametrize("family_case", ["gemma3"], indirect=True)
def test_cold_equals_warm_past_the_window_on_torchs_operators(family_case, prompts):
    """The same on torch's operators (no fused kernels): gemma3, whose windows they must mask."""
    _check_cold_equals_warm(family_case, prompts, fused=False)


def _check_cold_equals_warm(family_case, prompts, fused: bool) -> None:
    kind, d, ref, path = family_case
    llm = _llm(path, tokenizer=d, enable_prefix_caching=True, deterministic=True,
               fused_kernels=fused)
    eng = llm.engine
    prompt = prompts[1][:37] + prompts[2][:16]  # 53 tokens: 3 whole blocks cached

    def last_logits(from_cache: bool) -> torch.Tensor:
        req = eng.add_request(prompt, SamplingParams(max_tokens=1))
        if not from_cache:
            eng.reset_prefix_cache()
        sched = eng.scheduler.schedule()
        assert sched.chunks[0].start == (48 if from_cache else 0)
        tables = {c.request.request_id: eng.cache.block_table(c.request.request_id)
                  for c in sched.chunks}
        logits, _ = eng.runner.forward_logits(sched.chunks, tables)
        eng.scheduler.finish(req, "abort")
        return logits

    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    cold = llm.generate([prompt], greedy)[0]
    warm = llm.generate([prompt], greedy)[0]
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens == 48
    assert cold.token_ids == warm.token_ids
    assert torch.equal(last_logits(True), last_logits(False))
    assert eng.cache.pool.num_in_use == 0


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
@pytest.mark.parametrize("family_case", ["qwen3", "gemma3"], indirect=True)
def test_block_quantized_layers_run_in_one_call(family_case, prompts, tmp_path, kv_dtype):
    """The family's layer on Q8_0 blocks runs in the C layer calls (``qlayer.c``: qwen3's QK-norm;
    gemma3's four norms, GELU-tanh, local RoPE and an 8-key window on the hybrid pool's KV groups):
    every layer in one call, two calls a layer and the per-kernel loop give the same logits to the
    bit; greedy tokens are the same cold and warm (past the window) and follow transformers'. On
    the default bf16 KV pool and on an int8 one (a scale per token and head)."""
    from hotprefix.tools import quality

    kind, d, ref, _ = family_case
    path = write_gguf(d, tmp_path / f"tiny-{kind}-q8.gguf", quant=True)
    llm = _llm(path, tokenizer=d, dtype="bfloat16", enable_prefix_caching=True,
               kv_cache_dtype=kv_dtype)
    model = llm.engine.runner.model
    assert (llm.engine.runner.kv_caches[0][0].dtype == torch.int8) == (kv_dtype == "int8")
    if model.quant_layers is None:
        pytest.skip("the gguf mode's block kernels have no vector path on this CPU")
    runs, layers = [], model.quant_layers
    try:
        for all_layers, quant in ((True, layers), (False, layers), (False, None)):
            model.all_layers_call, model.quant_layers = all_layers, quant
            runs.append(quality.all_position_logits(llm.engine.runner, prompts[0]))
    finally:
        model.all_layers_call, model.quant_layers = True, layers
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[1], runs[2])
    theirs = _theirs(ref, prompts[0])
    assert (runs[0].argmax(-1) == theirs.argmax(-1)).float().mean() > 0.9
    prompt = prompts[1][:37] + prompts[2][:16]
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    cold, warm = (llm.generate([prompt], greedy)[0] for _ in range(2))
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens == 48
    assert cold.token_ids == warm.token_ids
    assert llm.engine.cache.pool.num_in_use == 0


# ------------------------------------------------------------------ llama.cpp's converter
@pytest.fixture(scope="module")
def converted(family_case, tmp_path_factory) -> Path:
    src = llamacpp_src()
    if src is None:
        pytest.skip("llama.cpp's convert_hf_to_gguf.py not found (unpack it with "
                    "../shared/tools/llamacpp-peer.sh build, or set HOTPREFIX_LLAMACPP_SRC)")
    pytest.importorskip("sentencepiece", reason="convert_hf_to_gguf.py imports sentencepiece")
    kind, d, _, _ = family_case
    out = tmp_path_factory.mktemp(f"conv-{kind}") / f"tiny-{kind}.gguf"
    if kind == "qwen2":
        # transformers 5's AutoTokenizer maps model_type qwen2 to Qwen2Tokenizer, which swaps in
        # Qwen2's pre-tokenizer, and the converter does not know that pre-tokenizer over this
        # (SmolLM2) vocabulary. It picks its model class from ``architectures``
        # (Qwen2ForCausalLM), so a copy whose model_type reads llama converts as qwen2 with the
        # tokenizer as it was written.
        d = Path(shutil.copytree(d, out.parent / "hf"))
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
    r = subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(d),
                        "--outfile", str(out), "--outtype", "f32"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def test_writer_matches_the_converter(family_case, converted, prompts):
    """Our writer's tensors (names, shapes, values) and the metadata the loader reads are the
    converter's; the converter's file runs to the same numbers."""
    import gguf

    kind, d, ref, path = family_case
    ours, theirs = gguf.GGUFReader(str(path)), gguf.GGUFReader(str(converted))
    t_ours = {t.name: np.asarray(t.data) for t in ours.tensors}
    t_theirs = {t.name: np.asarray(t.data) for t in theirs.tensors}
    assert set(t_ours) == set(t_theirs)
    for name, arr in t_ours.items():
        np.testing.assert_array_equal(arr, t_theirs[name], err_msg=name)
    a_ours, a_theirs = load_model(str(path)).arch, load_model(str(converted)).arch
    assert a_ours == dataclasses.replace(a_theirs, vocab_size=a_ours.vocab_size)
    check_against(_llm(converted, tokenizer=d), ref, prompts[1:])
