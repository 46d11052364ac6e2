"""The hybrid pool end to end on a tiny random Gemma 3 (5 window layers of 40 keys, 1 full layer):
the same greedy tokens and bit-identical logits as with every layer's K/V kept, cold and warm,
batched and alone; more hits than the full-KV pool at the same bytes; nothing left in use."""

from __future__ import annotations

import pytest
import torch

from hotprefix import LLM, SamplingParams
from hotprefix.cache.report import MissReason

from model_support import save_random_model

WINDOW = 40
GEMMA3 = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=32,
              max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=True,
              initializer_range=0.1, num_hidden_layers=6, num_key_value_heads=1,
              sliding_window=WINDOW, query_pre_attn_scalar=32, rope_parameters={
                  "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
BS = 16


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory, default_tokenizer):
    return save_random_model(tmp_path_factory.mktemp("tiny-gemma3"), default_tokenizer,
                             "Gemma3ForCausalLM", "Gemma3TextConfig", GEMMA3, norm_offset=0.0)


def _llm(d, **kw) -> LLM:
    opts = dict(dtype="float32", block_size=BS, num_blocks=160, max_model_len=2048, num_threads=1)
    return LLM(str(d), **{**opts, **kw})


def _tokens(seed: int, n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def test_layout_and_stats(gemma_dir):
    llm = _llm(gemma_dir)
    eng = llm.engine
    lay = eng.runner.layout
    assert lay.hybrid and lay.page_layers == 1 and lay.groups[0].layers == (5,)
    assert eng.runner.num_blocks == 160 * 6  # the same bytes as 160 whole-model blocks
    base = _llm(gemma_dir, disable_hybrid_kv_cache_manager=True).engine
    assert not base.runner.layout.hybrid and base.runner.num_blocks == 160
    prompt = _tokens(1, 600, eng.runner.arch.vocab_size)
    llm.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))
    s = eng.cache_stats()
    assert [g["kind"] for g in s["kv_groups"]] == ["full"] + [f"window-{WINDOW}"] * 5
    full, win = s["kv_groups"][0], s["kv_groups"][1]
    assert full["pages_cached"] == 600 // BS and full["pages_in_use"] == 0
    # a window group keeps the window before the prompt's end and the sequence's end: a few blocks
    assert 0 < win["pages_kept"] <= 2 * (WINDOW // BS + 2) < full["pages_cached"]
    assert win["bytes_cached"] == win["pages_cached"] * s["page_bytes"]
    assert eng.cache.pool.num_in_use == 0


def test_same_tokens_and_logits_as_full_kv(gemma_dir):
    """Cold, warm (the prefix past several windows from cache) and in a batch with another
    request: greedy tokens equal to the full-KV pool's, and the warm logits bit-identical."""
    hyb, full = _llm(gemma_dir), _llm(gemma_dir, disable_hybrid_kv_cache_manager=True)
    vocab = hyb.engine.runner.arch.vocab_size
    prompt = _tokens(2, 300, vocab)
    other = _tokens(3, 170, vocab)
    p = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3)
    for llm in (hyb, full):
        cold = llm.generate([prompt], p)[0]
        warm = llm.generate([prompt], p)[0]
        both = llm.generate([prompt, other], p)[0]
        assert cold.num_cached_tokens == 0 and warm.num_cached_tokens == 288
        assert cold.token_ids == warm.token_ids == both.token_ids
        lps = [o.outputs[0].logprobs for o in (cold, warm, both)]
        assert len(lps[0]) == 6 and all(len(d) >= 3 for d in lps[0])
        assert lps[0] == lps[1] == lps[2]  # the log-softmax of every step's logits, bit for bit
        llm.result = cold
    assert hyb.result.token_ids == full.result.token_ids
    for e in (hyb.engine, full.engine):
        assert e.cache.pool.num_in_use == 0


def test_resumes_at_a_kept_point_and_stays_exact(gemma_dir):
    """A request still running holds the full layer's blocks; its window blocks past the window
    are interior and evicted; a second request sharing a long prefix resumes where the first
    one's prompt ended (kept), says ``window_evicted``, and gives the cold run's tokens."""
    llm = _llm(gemma_dir)
    eng = llm.engine
    vocab = eng.runner.arch.vocab_size
    head = _tokens(4, 200, vocab)
    first = eng.add_request(head, SamplingParams(max_tokens=120, ignore_eos=True))
    while first.num_output_tokens < 110:
        eng.step()
    pool = eng.cache.pool
    pool.free(pool.allocate(len(pool.empty) + len(pool.low)))  # evict every interior block
    follow = head + first.token_ids[200:300] + _tokens(5, 30, vocab)
    p = SamplingParams(max_tokens=5, ignore_eos=True)
    warm = llm.generate([follow], p)[0]
    rep = warm.cache_report
    assert rep.miss_reason == MissReason.WINDOW_EVICTED
    assert rep.detail["full_layers_cached_tokens"] == 288 and warm.num_cached_tokens == 192
    while eng.scheduler.num_unfinished:
        eng.step()
    eng.reset_prefix_cache()
    cold = llm.generate([follow], p)[0]
    assert cold.num_cached_tokens == 0 and cold.token_ids == warm.token_ids
    assert pool.num_in_use == 0


def test_more_hits_than_full_kv_at_the_same_bytes(gemma_dir):
    """Six chat sessions, each with its own 320-token system prompt, three turns, round-robin, in
    a pool holding about three sessions' full K/V: the hybrid pool keeps every session's turn
    end; the full-KV pool thrashes. The same tokens either way."""
    vocab = 49152
    systems = [_tokens(10 + s, 320, vocab) for s in range(6)]
    results = {}
    for name, kw in (("hybrid", {}), ("full", {"disable_hybrid_kv_cache_manager": True})):
        llm = _llm(gemma_dir, num_blocks=72, **kw)
        convo = [list(s) for s in systems]
        cached = prompt_tokens = 0
        outs = []
        for turn in range(3):
            for s in range(6):
                convo[s] += _tokens(100 + 10 * s + turn, 12, vocab)
                o = llm.generate([convo[s]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
                convo[s] += o.token_ids
                outs.append(o.token_ids)
                if turn:
                    cached += o.num_cached_tokens
                    prompt_tokens += len(o.prompt_token_ids)
                    if name == "hybrid":
                        assert o.num_cached_tokens >= 320, "a turn fell back to a full re-prefill"
        results[name] = (cached / prompt_tokens, outs)
        assert llm.engine.cache.pool.num_in_use == 0
        llm.engine.cache.pool.check_invariants()
    assert results["hybrid"][1] == results["full"][1]
    assert results["hybrid"][0] >= 1.8 * results["full"][0], results
