"""Exact means exact, in every dtype and weight mode: a request's logits (and so its greedy tokens)
do not depend on whether its prefix came from the cache, how its prompt was chunked, whether a
position was computed by a decode step or a prefill, nor on what else shared its batch.

The default mode (bf16 where the CPU multiplies bf16 natively) is checked bit for bit on the real
model; the quantized weight modes on the real model with greedy tokens, multi-turn included."""

from __future__ import annotations

import pytest
import torch

from hotprefix import LLM, SamplingParams
from hotprefix.model import llama
from hotprefix.model.dtype_probe import MIN_SPEEDUP, choose_cpu_dtype

from model_support import step_last_logits

SYSTEM = ("You are the help desk of a city library. Books are lent for three weeks and can be renewed "
          "twice online. Fines are ten cents a day. The reading room opens at nine and closes at "
          "eight; on Sundays it opens at noon. Be short and kind. ") * 3
SHORT_SYSTEM = SYSTEM[:len(SYSTEM) // 3]
"""The system prompt once (76 tokens with a question: 4 whole blocks), for the modes whose check
is about their GEMMs and elementwise kernels, not long attention: a cached prefix, a partial block
and a batch still meet them, at under half the prefill rows (int8 and int4 run torch's row-by-row
kernels in fp32 here)."""
QUESTIONS = ["Can I renew a book twice?", "When do you open on Sunday?", "How much is a fine?",
             "Do you lend films?", "Where do I return books?"]


def _last_logits(eng, ids, expect_start=None, others=()):
    """Logits of the last prompt token, with ``others`` (token lists) prefilled in the same step."""
    out, start, _ = step_last_logits(eng, ids, others)
    if expect_start is not None:
        assert start == expect_start
    return out


@pytest.mark.model
def test_default_mode_logits_bit_identical_cold_warm_and_batched(real_llm):
    _logits_cold_warm_batched(real_llm)


@pytest.mark.model
def test_int8_activations_have_their_own_namespace_and_exact_logits(real_llm):
    """``activations='int8'`` (the gguf mode's layer GEMMs on 8-bit activations): other bits, so
    another namespace (``a8``), and the logits cold == warm == batched bit for bit there too, on
    whichever path this CPU runs (AMX's one tile product a block, or the int16 kernels)."""
    llm = LLM(kv_cache_memory="64MiB", num_threads=2, weights="gguf", activations="int8")
    model = llm.engine.runner.model
    assert model.narrow and "-a8-" in model.numerics
    assert all(w.narrow for op, w in model.layers[0].items() if op in ("qkv", "o", "gate_up", "down"))
    assert not model.lm_head.narrow
    assert llm.engine.namespace != real_llm.engine.namespace
    _logits_cold_warm_batched(llm)


def _logits_cold_warm_batched(real_llm):
    eng = real_llm.engine
    eng.reset_prefix_cache()
    tok = real_llm.tokenizer
    ids = tok.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}])
    cold = _last_logits(eng, ids, expect_start=0)
    # prefix from cache: a sibling request shares the system prompt (a different question)
    eng.reset_prefix_cache()
    sib = tok.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[1]}])
    real_llm.generate([sib], SamplingParams(max_tokens=1))
    warm = _last_logits(eng, ids)
    assert torch.equal(cold, warm)
    # every full block of the prompt from cache (the last token is always computed)
    real_llm.generate([ids], SamplingParams(max_tokens=1))
    full = (len(ids) - 1) // eng.block_size * eng.block_size
    assert torch.equal(_last_logits(eng, ids, expect_start=full), cold)
    # cold again, batched with two unrelated prompts of other lengths
    eng.reset_prefix_cache()
    others = [tok.encode("An unrelated note about trains and timetables. " * k) for k in (3, 11)]
    assert torch.equal(_last_logits(eng, ids, expect_start=0, others=others), cold)
    assert eng.cache.pool.num_in_use == 0


@pytest.mark.model
def test_default_mode_decode_computed_blocks_equal_prefill(real_llm):
    """Turn 2 reuses K/V that turn 1's decode steps wrote; a cold engine prefills them. Same bits."""
    eng = real_llm.engine
    eng.reset_prefix_cache()
    tok = real_llm.tokenizer
    conv = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[2]}]
    ans = real_llm.generate([tok.encode_chat(conv)], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    conv += [{"role": "assistant", "content": ans.text}, {"role": "user", "content": "And on Sundays?"}]
    ids = tok.encode_chat(conv)
    warm = _last_logits(eng, ids)
    eng.reset_prefix_cache()
    assert torch.equal(_last_logits(eng, ids, expect_start=0), warm)


def _greedy_cold_warm(llm, questions=QUESTIONS, turns=2, system=SYSTEM):
    tok = llm.tokenizer
    prompts = [tok.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": q}])
               for q in questions]
    bs = llm.engine.block_size
    cut = min(bs * 8, (len(prompts[0]) - 6) // bs * bs)  # bs * 8 for SYSTEM
    prompts += [prompts[0][:cut], prompts[0][:cut + 5]]  # exact block multiple, partial block
    conv = [{"role": "system", "content": system}, {"role": "user", "content": "Hello!"}]
    for turn in range(turns):
        ids = tok.encode_chat(conv)
        prompts.append(ids)
        ans = llm.generate([ids], SamplingParams(max_tokens=10))[0]
        conv += [{"role": "assistant", "content": ans.text}, {"role": "user", "content": f"More {turn}?"}]
    prompts.append(tok.encode_chat(conv))
    warm = [llm.generate([p], SamplingParams(max_tokens=8))[0] for p in prompts]  # one at a time, cached
    llm.reset_prefix_cache()
    batched = llm.generate(prompts, SamplingParams(max_tokens=8))  # together, shared prefixes in flight
    llm.reset_prefix_cache()
    cold = [None] * len(prompts)
    for i in reversed(range(len(prompts))):  # each alone with an empty cache
        llm.reset_prefix_cache()
        cold[i] = llm.generate([prompts[i]], SamplingParams(max_tokens=8))[0]
    assert sum(w.num_cached_tokens > 0 for w in warm) >= len(prompts) - 2
    for i, (w, b, c) in enumerate(zip(warm, batched, cold)):
        assert w.token_ids == c.token_ids == b.token_ids, f"prompt {i}: cached {w.num_cached_tokens}"
    assert llm.engine.cache.pool.num_in_use == 0


@pytest.mark.model
def test_default_mode_greedy_cold_warm_batched(real_llm):
    assert real_llm.engine.runner.model.min_rows >= 1
    _greedy_cold_warm(real_llm)


@pytest.mark.model
def test_mixed_mode_greedy_cold_warm_and_without_fp16_weights(real_layers_dir, monkeypatch):
    """``mixed`` (the default where the gguf kernel does not run fast): cold == warm. Where torch
    lacks the fp16-weight GEMM it holds those weights in fp32: other bits, another namespace, and
    cold == warm still. On the real model's first 2 layers (torch's GEMMs at the real shapes, a
    fifteenth of the work)."""
    import hotprefix.model.linear as linear

    mixed = LLM(model=real_layers_dir, kv_cache_memory="64MiB", num_threads=2, weights="mixed")
    model = mixed.engine.runner.model
    if model.dtype == torch.float32:
        pytest.skip("no native bf16 here: mixed is dense fp32")
    assert model.weight_mode == "mixed" and "mixed-w16" in model.numerics
    _greedy_cold_warm(mixed, QUESTIONS[:2], turns=1, system=SHORT_SYSTEM)
    monkeypatch.setattr(linear, "fp16_weights_available", lambda: False)
    llm = LLM(model=real_layers_dir, kv_cache_memory="64MiB", num_threads=2, weights="mixed")
    model = llm.engine.runner.model
    assert model.weight_mode == "mixed" and "mixed-w32" in model.numerics
    assert llm.engine.namespace != mixed.engine.namespace
    assert not any(isinstance(w, linear.Fp16Weight) for w in model.layers[0].values())
    _greedy_cold_warm(llm, QUESTIONS[:1], turns=1, system=SHORT_SYSTEM)


@pytest.mark.model
def test_torch_elementwise_path_has_its_own_namespace_and_cold_equals_warm(real_llm):
    """Without the fused C kernels (no compiler, or turned off) torch ops run the elementwise work:
    other RMSNorm and SiLU bits, so another namespace, and cold == warm there too."""
    if real_llm.engine.runner.model.fused is None:
        pytest.skip("the fused kernels did not build here: the default already runs torch ops")
    llm = LLM(kv_cache_memory="64MiB", num_threads=2, fused_kernels=False)
    assert llm.engine.runner.model.fused is None
    cold_tag, fused_tag = llm.engine.runner.numerics, real_llm.engine.runner.numerics
    assert "/fused/" in fused_tag and "/fused" not in cold_tag
    assert fused_tag.split("/")[:2] == cold_tag.split("/")[:2]  # the same dtype and weights
    assert llm.engine.namespace != real_llm.engine.namespace
    _greedy_cold_warm(llm, QUESTIONS[:1], turns=1, system=SHORT_SYSTEM)


@pytest.mark.model
def test_torch_attention_with_fused_kernels_cold_equals_warm(real_llm, monkeypatch):
    """Kernels without attn.c's vector path (the portable level) run torch's attention on gathered
    K/V beside the fused kernels: another namespace, and cold == warm there too."""
    model = real_llm.engine.runner.model
    if not model.c_attention:
        pytest.skip("the C attention does not run here: the default already runs torch's")
    monkeypatch.setattr(llama, "c_attention_fast", lambda lib: False)
    llm = LLM(kv_cache_memory="64MiB", num_threads=2)
    other = llm.engine.runner.model
    assert other.fused is not None and not other.c_attention
    assert "/attn-float32-t256/" in other.numerics and "/attn-c-k16-s256/" in model.numerics
    assert llm.engine.namespace != real_llm.engine.namespace
    _greedy_cold_warm(llm, QUESTIONS[:2], turns=2)


@pytest.mark.model
@pytest.mark.parametrize("weights", ["int8", "int4", "dense", "gguf"])
def test_other_weight_modes_greedy_cold_warm_batched(weights, request):
    """Each weight mode: greedy tokens warm == batched == cold. int8 and int4 run torch's kernels
    (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``; minutes a prompt set on an AVX2
    CPU), and dense runs torch's fp32/bf16 GEMMs: on the real model's first 2 layers, the same
    shapes and kernels, a fifteenth the work.
    The mode the default already runs (gguf on AVX2) is the default-mode test's, not built twice."""
    if weights == "gguf":
        default = request.getfixturevalue("real_llm").engine.runner.model
        if default.weight_mode == "gguf":
            pytest.skip("gguf is this CPU's default mode: test_default_mode_greedy_cold_warm_batched")
    model_path = request.getfixturevalue("real_layers_dir") if weights != "gguf" else None
    llm = LLM(model=model_path, kv_cache_memory="64MiB", num_threads=2, weights=weights)
    model = llm.engine.runner.model
    assert model.weight_mode == weights
    assert model.fp32_ops <= {"head"} or weights == "gguf"
    _greedy_cold_warm(llm, QUESTIONS[:2], turns=1, system=SHORT_SYSTEM)  # quantized prefill is slower


def test_dtype_probe_falls_back_to_fp32():
    assert choose_cpu_dtype(flags=set()).dtype == torch.float32  # no native bf16: never probed
    slow = choose_cpu_dtype(flags={"avx512f", "avx512_bf16"}, speedup=MIN_SPEEDUP * 0.8)
    assert slow.dtype == torch.float32 and "faster" in slow.reason
    fast = choose_cpu_dtype(flags={"avx512_bf16", "amx_bf16", "amx_tile"}, speedup=6.0)
    assert fast.dtype == torch.bfloat16 and "amx_bf16" in fast.reason


def test_dtype_probe_measures_this_machine():
    choice = choose_cpu_dtype()
    if not choice.native_bf16:
        assert choice.dtype == torch.float32 and choice.speedup == 0.0
    else:
        assert choice.speedup > 0 and (choice.dtype == torch.bfloat16) == (choice.speedup >= MIN_SPEEDUP)
