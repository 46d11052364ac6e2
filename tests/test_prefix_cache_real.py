"""The prefix cache on the real default model: hits where a user expects them, misses explained,
outputs identical with caching on and off, bit-identical logits in deterministic mode."""

from __future__ import annotations

import datetime

import pytest
import torch

from hotprefix import LLM, SamplingParams

pytestmark = pytest.mark.model

SYSTEM = ("You are the support assistant of Northwind Outfitters, a store for hiking and camping gear. "
          "Answer questions about orders, returns, shipping and product care. Returns are accepted "
          "within 30 days with a receipt; sale items can be exchanged but not refunded. Shipping is "
          "free above 50 dollars. Tents must be dried before storage; boots need wax twice a season. "
          "Never invent order numbers. If you do not know, say so and offer to escalate to a human. "
          "Be brief, friendly and precise, and answer in the language of the customer. ") * 2
GREEDY = SamplingParams(max_tokens=12)


def chat_ids(llm, user, system=SYSTEM):
    return llm.tokenizer.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": user}])


def test_second_request_hits_full_blocks_of_shared_system_prompt(real_llm):
    real_llm.reset_prefix_cache()
    a = chat_ids(real_llm, "Where is my order?")
    b = chat_ids(real_llm, "Can I return boots I bought on sale?")
    shared = 0
    while a[shared] == b[shared]:
        shared += 1
    bs = real_llm.engine.block_size
    o1 = real_llm.generate([a], GREEDY)[0]
    o2 = real_llm.generate([b], GREEDY)[0]
    assert o1.num_cached_tokens == 0
    assert o2.num_cached_tokens == (shared // bs) * bs
    assert o2.num_cached_tokens > 200
    assert o2.cache_report.cached_tokens == o2.num_cached_tokens
    assert o2.cache_report.computed_tokens == len(b) - o2.num_cached_tokens
    # prompt + answer tokens whose K/V were computed (the last sampled token never was)
    assert o1.cache_report.written_blocks == (len(a) + len(o1.token_ids) - 1) // bs
    stats = real_llm.cache_stats()
    assert stats["blocks_in_use"] == 0 and stats["hit_tokens"] >= o2.num_cached_tokens


def test_multiturn_turn2_hits_turn1_prompt_and_answer(real_llm):
    real_llm.reset_prefix_cache()
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "How do I care for my tent?"}]
    t1_ids = real_llm.tokenizer.encode_chat(msgs)
    t1 = real_llm.generate([t1_ids], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    history = t1_ids + t1.token_ids  # what the KV pool saw: prompt + answer
    msgs2 = msgs + [{"role": "assistant", "content": t1.text}, {"role": "user", "content": "And boots?"}]
    t2_ids = real_llm.tokenizer.encode_chat(msgs2)
    common = 0
    while common < min(len(history), len(t2_ids)) and history[common] == t2_ids[common]:
        common += 1
    assert common > len(t1_ids)  # the template re-renders the answer with the same tokens
    t2 = real_llm.generate([t2_ids], GREEDY)[0]
    bs = real_llm.engine.block_size
    assert t2.num_cached_tokens == (common // bs) * bs
    assert t2.num_cached_tokens > len(t1_ids)  # beyond turn 1's prompt: its answer was cached too


def test_timestamp_in_first_line_gets_zero_and_is_explained(real_llm):
    real_llm.reset_prefix_cache()
    body = "\nYou are a helpful assistant for a bank. Answer precisely. " * 12 + "\nQuestion: what is APR?"
    t1 = datetime.datetime(2026, 11, 29, 9, 15, 2).isoformat()
    t2 = datetime.datetime(2026, 11, 30, 14, 47, 43).isoformat()
    o1 = real_llm.generate([f"Request received at {t1}{body}"], GREEDY)[0]
    o2 = real_llm.generate([f"Request received at {t2}{body}"], GREEDY)[0]
    assert o1.num_cached_tokens == 0 and o2.num_cached_tokens == 0
    rep = o2.cache_report
    assert rep.miss_reason == "diverged" and rep.detail["block_index"] == 0
    d = rep.detail
    assert d["likely_cause"] in ("timestamp", "date")
    assert "30T14:47:43" in d["sent_excerpt"] and "29T09:15:02" in d["cached_excerpt"]
    causes = real_llm.cache_stats()["top_miss_causes"]
    assert any(c["reason"] == "diverged" and c["cause"] in ("timestamp", "date") and c["block_index"] == 0
               for c in causes)
    # the diverging token position is inside the timestamp
    prefix_len = len(real_llm.tokenizer.encode("Request received at 2026-11-"))
    assert prefix_len - 2 <= rep.miss_position <= prefix_len + 1


def test_tenant_salts_never_share(real_llm):
    real_llm.reset_prefix_cache()
    p = chat_ids(real_llm, "What are your opening hours?")
    a1 = real_llm.generate([p], GREEDY, cache_salt="tenant-a")[0]
    b1 = real_llm.generate([p], GREEDY, cache_salt="tenant-b")[0]
    a2 = real_llm.generate([p], GREEDY, cache_salt="tenant-a")[0]
    assert a1.num_cached_tokens == 0
    assert b1.num_cached_tokens == 0
    assert b1.cache_report.miss_reason == "cold"  # never told another tenant holds it
    assert real_llm.cache_stats()["requests_by_reason"].get("salt", 0) >= 1  # the operator is
    assert "tenant-a" not in str(b1.cache_report)
    assert a2.num_cached_tokens > 200
    assert a1.token_ids == b1.token_ids == a2.token_ids


def test_too_short_and_cold(real_llm):
    o = real_llm.generate(["Hi there"], GREEDY)[0]
    assert o.cache_report.miss_reason == "too_short" and o.num_cached_tokens == 0
    o = real_llm.generate(["A completely new prompt about lighthouses and their keepers, " * 3], GREEDY)[0]
    assert o.cache_report.miss_reason == "cold" and o.cache_report.miss_position == 0


def test_greedy_identical_with_caching_on_and_off(real_llm):
    """>= 20 prompts: whole-prompt hits, partial blocks, exact block multiples, multi-turn."""
    off = LLM(enable_prefix_caching=False, kv_cache_memory="256MiB", num_threads=2)
    real_llm.reset_prefix_cache()
    tok = real_llm.tokenizer
    prompts: list[list[int]] = []
    for q in ["Where is my order?", "Can I return a tent?", "Do you ship abroad?", "Boot care tips?",
              "Is shipping free?", "What if my tent is wet?", "Do you sell stoves?", "Hello!"]:
        prompts.append(chat_ids(real_llm, q))
    base = prompts[0]
    prompts.append(list(base))  # whole-prompt hit (all but the last token)
    prompts.append(list(base))
    bs = real_llm.engine.block_size
    prompts.append(base[:bs * 10])  # exact multiple of the block size
    prompts.append(base[:bs * 10 + 1])
    prompts.append(base[:bs * 10 + 7])  # partial block
    prompts.append(base[:bs * 12 - 1])
    conv = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi, I need help."}]
    for turn in range(3):
        ids = tok.encode_chat(conv)
        prompts.append(ids)
        ans = real_llm.generate([ids], SamplingParams(max_tokens=12))[0]
        conv += [{"role": "assistant", "content": ans.text}, {"role": "user", "content": f"Follow-up {turn}?"}]
    prompts += [tok.encode(f"Summarize: the quick brown fox number {i} jumps over the lazy dog. " * 4) for i in range(4)]
    assert len(prompts) >= 20
    on = [real_llm.generate([p], SamplingParams(max_tokens=8))[0] for p in prompts]
    ref = off.generate(prompts, SamplingParams(max_tokens=8))
    assert sum(o.num_cached_tokens > 0 for o in on) >= 12
    for i, (a, b) in enumerate(zip(on, ref)):
        assert a.token_ids == b.token_ids, f"prompt {i}: cached {a.num_cached_tokens}"


def test_deterministic_mode_bit_identical_logits_real_model():
    llm = LLM(deterministic=True, kv_cache_memory="128MiB", num_threads=2)
    eng = llm.engine
    ids = chat_ids(llm, "Is the tent waterproof?")[:100]

    def last_logits(expect_start):
        req = eng.add_request(ids, SamplingParams(max_tokens=1))
        sched = eng.scheduler.schedule()
        assert sched.chunks[0].start == expect_start
        tables = {c.request.request_id: eng.cache.block_table(c.request.request_id) for c in sched.chunks}
        logits, _ = eng.runner.forward_logits(sched.chunks, tables)
        eng.scheduler.update(sched, {})
        eng.abort(req.request_id)
        return logits

    fresh = last_logits(0)
    cached = last_logits(96)  # 6 full blocks from cache, 4 tokens computed
    assert torch.equal(fresh, cached)
    eng.reset_prefix_cache()
    again = last_logits(0)
    assert torch.equal(fresh, again)


def test_evicted_and_namespace_reasons(tmp_path, default_tokenizer):
    """A small pool evicts; a restart with a changed tokenizer file reports namespace misses."""
    state = str(tmp_path / "state")
    small = LLM(num_blocks=40, state_dir=state, num_threads=2)
    p1 = "Long policy text about refunds and exchanges for all customers. " * 20
    o = small.generate([p1], GREEDY)[0]
    assert o.num_cached_tokens == 0
    # fill the pool with other prompts so p1's blocks get evicted
    for i in range(3):
        small.generate([f"Filler document {i}: " + "lorem ipsum dolor sit amet " * 40], GREEDY)
    assert small.cache_stats()["evictions"] > 0
    o = small.generate([p1], GREEDY)[0]
    assert o.cache_report.miss_reason == "evicted"
    small.generate([p1], GREEDY)  # cached again under the old namespace
    # "restart" with a tokenizer whose chat template changed: same token ids, new fingerprint
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    default_tokenizer.save_json(str(tok_dir / "tokenizer.json"))
    import json

    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (cfg["chat_template"] or "") + "{# v2 #}"
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    restarted = LLM(num_blocks=40, state_dir=state, tokenizer=str(tok_dir / "tokenizer.json"), num_threads=2)
    assert restarted.engine.tokenizer_fingerprint != small.engine.tokenizer_fingerprint
    o = restarted.generate([p1], GREEDY)[0]
    assert o.num_cached_tokens == 0
    assert o.cache_report.miss_reason == "namespace"
