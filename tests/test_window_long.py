"""Sliding windows at long prompts (issue 27): a tiny random-weight ``Gemma3ForCausalLM`` with a
64-token window on 5 of its 6 layers, at prompts of 1,600 tokens (25 windows; Gemma 3 270M's
window is 512, its prompts of 1,500+ tokens cross it three times: the same mechanism at a fraction
of the CPU).

Bit for bit: the last prompt token's logits of a cold prefill equal those of a warm run whose
prefix came from the cache (1,088 tokens from a sibling prompt, and every full block of the
prompt itself), and of a run batched with two unrelated prompts; greedy tokens and their log
probabilities likewise through ``generate``, decode steps far past the window included. Queries
there see 64 keys of 1,600: most of the keys torch's attention splits a query tile's keys into are
wholly masked, and they must add nothing (no NaN, no change in the sum's order). Both pools: the
hybrid one (window groups keep only their windows' blocks, issue 28) and one that keeps every
layer's K/V (``disable_hybrid_kv_cache_manager``).
"""

from __future__ import annotations

import pytest
import torch

from hotprefix import LLM, SamplingParams
from hotprefix.config.sections import ConfigError, EngineConfig, SchedulerConfig
from hotprefix.model.loader import load_model

from model_support import save_random_model, step_last_logits

WINDOW = 64
GEMMA3 = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=32,
              num_hidden_layers=6, num_key_value_heads=1, sliding_window=WINDOW,
              max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=True,
              initializer_range=0.1, query_pre_attn_scalar=32, rope_parameters={
                  "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
PROMPT_LEN = 1600
SHARED = 1100
"""Tokens the sibling prompt shares with the prompt: 68 whole blocks of 16 (1,088) can hit."""


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory, default_tokenizer):
    d = tmp_path_factory.mktemp("long-gemma3")
    return save_random_model(d, default_tokenizer, "Gemma3ForCausalLM", "Gemma3TextConfig", GEMMA3,
                             norm_offset=0.0)


@pytest.fixture(scope="module")
def prompts(default_tokenizer) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(5)
    v = default_tokenizer.vocab_size

    def rand(n: int) -> list[int]:
        return torch.randint(0, v, (n,), generator=g).tolist()

    prompt = rand(PROMPT_LEN)
    return {"prompt": prompt, "sibling": prompt[:SHARED] + rand(100),
            "other_a": rand(300), "other_b": rand(500)}


@pytest.fixture(scope="module", params=[False, True], ids=["hybrid", "every-layer"])
def llm(request, gemma_dir) -> LLM:
    return LLM(str(gemma_dir), num_blocks=1024, block_size=16, max_model_len=4096,
               max_num_batched_tokens=4096, window_prefill_chunk=0, num_threads=2,
               disable_hybrid_kv_cache_manager=request.param)


def _last_logits(eng, ids, others=()) -> tuple[torch.Tensor, int]:
    """(logits of the last prompt token, the first position computed), with ``others`` (token
    lists) prefilled in the same step."""
    out, start, n_chunks = step_last_logits(eng, ids, others)
    assert n_chunks == len(others) + 1, "the others must share the step"
    return out, start


def test_the_model_has_the_window(gemma_dir):
    arch = load_model(str(gemma_dir)).arch
    assert arch.arch == "gemma3" and arch.sliding_window == WINDOW
    assert arch.local_layers == (0, 1, 2, 3, 4)
    assert PROMPT_LEN > 20 * WINDOW and SHARED // 16 * 16 > 1000


def test_logits_bit_identical_cold_warm_and_batched(llm, prompts):
    eng = llm.engine
    prompt = prompts["prompt"]
    eng.reset_prefix_cache()
    cold, start = _last_logits(eng, prompt)
    assert start == 0 and torch.isfinite(cold).all()
    # a prefix of 1,088 tokens from a sibling prompt's blocks (the cache reset in between)
    eng.reset_prefix_cache()
    llm.generate([prompts["sibling"]], SamplingParams(max_tokens=1))
    warm, start = _last_logits(eng, prompt)
    assert start == SHARED // 16 * 16
    assert torch.equal(warm, cold)
    # every full block of the prompt from the cache (the last token is always computed)
    llm.generate([prompt], SamplingParams(max_tokens=1))
    warm_all, start = _last_logits(eng, prompt)
    assert start == (PROMPT_LEN - 1) // 16 * 16
    assert torch.equal(warm_all, cold)
    # cold again, in one step with two unrelated prompts of other lengths
    eng.reset_prefix_cache()
    batched, start = _last_logits(eng, prompt, others=[prompts["other_a"], prompts["other_b"]])
    assert start == 0 and torch.equal(batched, cold)
    # warm and batched at once
    batched_warm, start = _last_logits(eng, prompt, others=[prompts["other_b"]])
    assert start > 1000 and torch.equal(batched_warm, cold)
    assert eng.cache.pool.num_in_use == 0


@pytest.mark.parametrize("llm", [False], ids=["hybrid"], indirect=True)
def test_greedy_tokens_and_logprobs_cold_warm_and_batched(llm, prompts):
    """Eight greedy tokens decoded at positions 1,600+ (25 windows in): the same tokens and log
    probabilities alone and cold, from the cache, and batched with other requests. The hybrid
    pool only (the default; the logits test covers the other)."""
    assert not llm.config.cache.disable_hybrid_kv_cache_manager
    prompt = prompts["prompt"]
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2)
    llm.reset_prefix_cache()
    cold = llm.generate([prompt], params)[0]
    warm = llm.generate([prompt], params)[0]
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens == (PROMPT_LEN - 1) // 16 * 16
    llm.reset_prefix_cache()
    batched = llm.generate([prompts["other_a"], prompt, prompts["sibling"]], params)[1]
    assert len(cold.token_ids) == 8
    for out in (warm, batched):
        assert out.token_ids == cold.token_ids
        assert out.outputs[0].logprobs == cold.outputs[0].logprobs
    assert llm.engine.cache.pool.num_in_use == 0


@pytest.mark.parametrize("llm", [False], ids=["hybrid"], indirect=True)
def test_the_hybrid_pools_prefill_chunk_cap_changes_no_bit(llm, gemma_dir, prompts):
    """``window_prefill_chunk`` (default 256): a hybrid pool computes a long prompt in chunks of
    at most 256 tokens, a pool that keeps every layer's K/V in one 4,096-token step; the greedy
    tokens and log probabilities equal those of the whole prompt in one step (``llm``: no cap)."""
    assert not llm.config.cache.disable_hybrid_kv_cache_manager  # one comparison is enough
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2)
    llm.reset_prefix_cache()
    whole = llm.generate([prompts["prompt"]], params)[0]
    for every_layer in (False, True):
        capped = LLM(str(gemma_dir), num_blocks=1024, block_size=16, max_model_len=4096,
                     max_num_batched_tokens=4096, num_threads=2,
                     disable_hybrid_kv_cache_manager=every_layer)
        eng = capped.engine
        assert eng.config.scheduler.window_prefill_chunk == 256
        req = eng.add_request(list(prompts["prompt"]), params)
        step = eng.scheduler.schedule()  # the first step of a cold prompt
        assert [(c.request, c.num_tokens) for c in step.chunks] == [
            (req, PROMPT_LEN if every_layer else 256)]
        eng.scheduler.update(step, {})
        eng.abort(req.request_id)
        if not every_layer:
            capped.reset_prefix_cache()  # the aborted step cached its first 256 tokens
            out = capped.generate([prompts["prompt"]], params)[0]
            assert out.num_cached_tokens == 0
            assert out.token_ids == whole.token_ids
            assert out.outputs[0].logprobs == whole.outputs[0].logprobs
        assert eng.cache.pool.num_in_use == 0


def test_the_prefill_chunk_rule():
    """The cap binds a hybrid pool only, never below one block nor above the step's budget; a
    negative cap is refused."""
    c = SchedulerConfig()
    assert (c.prefill_chunk(True, 16), c.prefill_chunk(False, 16)) == (256, 2048)
    assert c.prefill_chunk(True, 512) == 512 and c.prefill_chunk(True, 4096) == 2048
    assert SchedulerConfig(window_prefill_chunk=0).prefill_chunk(True, 16) == 2048
    assert SchedulerConfig(max_num_batched_tokens=100).prefill_chunk(True, 16) == 100
    with pytest.raises(ConfigError, match="window_prefill_chunk"):
        EngineConfig.from_options(window_prefill_chunk=-1)
