"""n > 1 on one prefill, best_of, log probabilities, penalties and logit_bias, on the tiny random
Llama: the prompt computed once and forked (blocks shared, none leaked), seeded choices that repeat
and do not depend on n, log probabilities equal to an independent log-softmax of transformers'
logits, penalties as a reference implementation defines them, batch invariance with penalties."""

from __future__ import annotations

import math

import pytest
import torch

from hotprefix import LLM, SamplingParams
from hotprefix.cache.report import MissReason
from hotprefix.request.logits import RowInput, process
from hotprefix.request.sampling import SamplingError, choice_seed

PROMPT = list(range(300, 340))  # 40 tokens: 2 full blocks of 16 and a partial one


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, num_blocks=256, block_size=16, dtype="float32", num_threads=1)


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def idle(llm):
    s = llm.cache_stats()
    assert s["blocks_in_use"] == 0 and s["running"] == 0 and s["waiting"] == 0
    llm.engine.cache.pool.check_invariants()


def sampled(n=1, **kw):
    return SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, n=n, **kw)


def steps_tokens(llm, prompts, params):
    """(outputs, tokens the engine's forward passes computed)"""
    counted = []
    llm.engine.on_step.append(lambda s: counted.append(s["num_tokens"]))
    try:
        outs = llm.generate(prompts, params)
    finally:
        llm.engine.on_step.pop()
    return outs, sum(counted)


# ---------------------------------------------------------------- n > 1

@pytest.mark.parametrize("prompt", [PROMPT, PROMPT[:32]], ids=["partial-last-block", "block-boundary"])
def test_n_computes_the_prompt_once_and_forks(llm, prompt):
    llm.reset_prefix_cache()
    (one,), tokens_one = steps_tokens(llm, [prompt], sampled(1, seed=11))
    llm.reset_prefix_cache()
    (four,), tokens_four = steps_tokens(llm, [prompt], sampled(4, seed=11))
    # the prompt once, then 5 decode steps for each of the 4 sequences
    assert tokens_one == len(prompt) + 5 and tokens_four == len(prompt) + 4 * 5
    assert len(four.outputs) == 4 and [c.index for c in four.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 6 for c in four.outputs)
    rep = four.cache_report
    assert (rep.computed_tokens, rep.cached_tokens) == (len(prompt), 0)
    assert rep.written_blocks == one.cache_report.written_blocks == len(prompt) // 16
    assert len({tuple(c.token_ids) for c in four.outputs}) >= 3  # distinct at temperature 1
    assert four.outputs[0].token_ids == one.token_ids  # sequence 0 is the n=1 sequence
    idle(llm)


def test_seeded_choices_repeat_and_do_not_depend_on_n(llm):
    four = [c.token_ids for c in llm.generate([PROMPT], sampled(4, seed=5))[0].outputs]
    again = [c.token_ids for c in llm.generate([PROMPT], sampled(4, seed=5))[0].outputs]
    two = [c.token_ids for c in llm.generate([PROMPT], sampled(2, seed=5))[0].outputs]
    assert four == again and two == four[:2]
    # sequence i is the request seeded choice_seed(seed, i) alone
    alone = llm.generate([PROMPT], sampled(1, seed=choice_seed(5, 3)))[0].token_ids
    assert alone == four[3]
    other = [c.token_ids for c in llm.generate([PROMPT], sampled(4, seed=6))[0].outputs]
    assert other != four
    idle(llm)


def test_n_greedy_choices_are_the_greedy_sequence(llm):
    greedy = SamplingParams(max_tokens=5, ignore_eos=True)
    ref = llm.generate([PROMPT], greedy)[0].token_ids
    out = llm.generate([PROMPT], SamplingParams(max_tokens=5, ignore_eos=True, n=3))[0]
    assert [c.token_ids for c in out.outputs] == [ref] * 3


def test_abort_at_every_stage_leaks_no_block(llm):
    eng = llm.engine
    for steps in range(4):  # before admission, after the prefill+fork, while decoding
        req = eng.add_request(PROMPT, SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True,
                                                     n=4, logprobs=2))
        for _ in range(steps):
            eng.step()
        assert eng.abort(req.request_id)
        assert not eng.has_unfinished()
        idle(llm)


def test_fork_without_a_free_block_waits_and_gives_the_same_tokens(tiny_model_dir, llm):
    # 40-token prompt: 3 blocks; each fork needs 1 block for its copy of the partial last block.
    small = LLM(tiny_model_dir, num_blocks=5, block_size=16, dtype="float32", num_threads=1)
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, n=4, seed=9)
    got = [c.token_ids for c in small.generate([PROMPT], params)[0].outputs]
    ref = [c.token_ids for c in llm.generate([PROMPT], params)[0].outputs]
    assert got == ref
    idle(small)


def test_best_of_keeps_the_most_likely_sequences(llm):
    all5 = llm.generate([PROMPT], sampled(5, seed=3, logprobs=0))[0].outputs
    best = llm.generate([PROMPT], sampled(2, seed=3, best_of=5))[0].outputs
    ranked = sorted(all5, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked]
    assert [c.index for c in best] == [0, 1]
    assert best[0].cumulative_logprob >= best[1].cumulative_logprob
    for c in all5:
        assert c.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(c.token_ids, c.logprobs)))


# ---------------------------------------------------------------- log probabilities

def test_logprobs_are_the_log_softmax_of_the_models_logits(llm, hf):
    out = llm.generate([PROMPT], SamplingParams(max_tokens=4, ignore_eos=True, logprobs=5,
                                                prompt_logprobs=3))[0]
    comp = out.outputs[0]
    ids = PROMPT + comp.token_ids
    ref = torch.log_softmax(hf_logits(hf, ids), dim=-1)
    for t, (tok, pos) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref[len(PROMPT) - 1 + t]
        top = sorted(pos.values(), key=lambda lp: lp.rank)
        assert len(pos) == 5 and [lp.rank for lp in top] == [1, 2, 3, 4, 5]
        assert pos[tok].rank == 1 and pos[tok].logprob == max(lp.logprob for lp in top)  # greedy
        assert all(lp.logprob <= 0 for lp in top)
        assert [lp.logprob for lp in top] == sorted([lp.logprob for lp in top], reverse=True)
        assert set(pos) == set(row.topk(5).indices.tolist())
        for tid, lp in pos.items():
            assert lp.logprob == pytest.approx(float(row[tid]), abs=2e-4)
    # prompt log probabilities: none for the first token, then the token at p from logits at p-1
    plp = out.prompt_logprobs
    assert len(plp) == len(PROMPT) and plp[0] is None
    for p in range(1, len(PROMPT)):
        assert plp[p][PROMPT[p]].logprob == pytest.approx(float(ref[p - 1, PROMPT[p]]), abs=2e-4)
        assert len(plp[p]) in (3, 4)  # the top 3, plus the prompt's token when outside them


def test_sampled_logprobs_use_the_temperature(llm, hf):
    comp = llm.generate([PROMPT], SamplingParams(temperature=0.5, seed=2, max_tokens=1,
                                                 logprobs=2))[0].outputs[0]
    ref = torch.log_softmax(hf_logits(hf, PROMPT)[-1] / 0.5, dim=-1)
    tok = comp.token_ids[0]
    assert comp.logprobs[0][tok].logprob == pytest.approx(float(ref[tok]), abs=2e-4)


def test_prompt_logprobs_skip_the_cache_read_and_say_so(llm):
    llm.generate([PROMPT], SamplingParams(max_tokens=1))  # cached now
    warm = llm.generate([PROMPT], SamplingParams(max_tokens=1))[0].cache_report
    assert warm.cached_tokens == 32
    rep = llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=0))[0].cache_report
    assert rep.miss_reason == MissReason.READ_SKIPPED and rep.cached_tokens == 0
    assert rep.computed_tokens == len(PROMPT) and rep.to_json()["miss_reason"] == "read_skipped"
    idle(llm)


def test_logprobs_are_the_same_cold_and_warm_and_across_tenants(llm):
    """What a tenant sees in log probabilities must not tell whether the prompt (or another
    tenant's copy of it) was cached: the values are the same, bit for bit."""
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=5, n=2, temperature=0.9, seed=4)

    def values(salt):
        out = llm.generate([PROMPT], params, cache_salt=salt)[0]
        return [[(t, p[t].logprob) for p in c.logprobs for t in sorted(p)] for c in out.outputs], \
            out.cache_report.cached_tokens

    llm.reset_prefix_cache()
    cold_b, cached = values("tenant-b")
    assert cached == 0
    values("tenant-a")  # another tenant caches the same prompt
    again_b, cached = values("tenant-b")  # b's own blocks are warm now
    assert cached == 32 and again_b == cold_b
    llm.reset_prefix_cache()
    values("tenant-a")
    first_c, cached = values("tenant-c")  # a holds the prompt; c computes it: nothing shows
    assert cached == 0 and first_c == cold_b


# ---------------------------------------------------------------- penalties and logit_bias

def reference_process(logits, prompt, output, presence=0.0, frequency=0.0, repetition=1.0, bias=None):
    """OpenAI's and vLLM's definitions, token by token."""
    out = logits.clone()
    for tok, b in (bias or {}).items():
        out[tok] += b
    for tok in set(prompt) | set(output):
        if repetition != 1.0:
            out[tok] = out[tok] / repetition if out[tok] > 0 else out[tok] * repetition
    for tok in set(output):
        out[tok] -= frequency * output.count(tok) + presence
    return out


@pytest.mark.parametrize("kw", [dict(presence=1.5), dict(frequency=-0.7), dict(repetition=1.8),
                                dict(repetition=0.6, frequency=0.4, presence=-1.0),
                                dict(bias={3: 100.0, 7: -100.0, 11: 2.5}, frequency=2.0)])
def test_process_matches_the_reference_definitions(kw):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, generator=g) * 3
    prompt, output = [1, 2, 3, 5, 8], [8, 8, 13, 21, 8, 2]
    params = SamplingParams(presence_penalty=kw.get("presence", 0.0),
                            frequency_penalty=kw.get("frequency", 0.0),
                            repetition_penalty=kw.get("repetition", 1.0), logit_bias=kw.get("bias"))
    got = process(logits, RowInput(params, None, prompt + output, len(prompt)))
    assert torch.allclose(got, reference_process(logits, prompt, output, **kw), atol=1e-5)
    assert not torch.equal(got, logits)


def test_greedy_with_penalties_follows_the_reference(llm, hf):
    # the bias makes token 777 the favourite; the penalties then push it down once it was drawn
    last = hf_logits(hf, PROMPT)[-1]
    bias = {777: round(float(last.max() - last[777]) + 2.0, 3)}
    kw = dict(presence=1.0, frequency=1.5, repetition=1.3, bias=bias)
    comp = llm.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True, presence_penalty=1.0,
                                                 frequency_penalty=1.5, repetition_penalty=1.3,
                                                 logit_bias=bias, logprobs=1))[0].outputs[0]
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True,
                                                  logit_bias=bias))[0].token_ids
    assert plain.count(777) > comp.token_ids.count(777) >= 1  # the penalties changed the output
    for t, tok in enumerate(comp.token_ids):
        out = comp.token_ids[:t]
        row = reference_process(hf_logits(hf, PROMPT + out)[-1], PROMPT, out, **kw)
        assert tok == int(row.argmax())
        ref = torch.log_softmax(row, dim=-1)[tok]
        assert comp.logprobs[t][tok].logprob == pytest.approx(float(ref), abs=2e-4)


def test_logit_bias_bans_and_forces_tokens(llm):
    greedy = llm.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    banned = {t: -100.0 for t in set(greedy)}
    got = llm.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True,
                                                logit_bias=banned))[0].token_ids
    assert not set(got) & set(banned)
    sampled_ban = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=1, max_tokens=16,
                                                        ignore_eos=True, logit_bias={greedy[0]: -100}))
    assert greedy[0] not in sampled_ban[0].token_ids
    forced = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=1, max_tokens=6,
                                                   ignore_eos=True, logit_bias={777: 100}))
    assert forced[0].token_ids == [777] * 6
    with pytest.raises(SamplingError, match="logit_bias"):
        llm.generate([PROMPT], SamplingParams(logit_bias={10**7: 1.0}))
    idle(llm)


def test_penalties_batched_equal_alone(llm):
    params = [SamplingParams(max_tokens=8, ignore_eos=True, frequency_penalty=1.0),
              SamplingParams(max_tokens=8, ignore_eos=True),
              SamplingParams(max_tokens=8, ignore_eos=True, repetition_penalty=1.5, logit_bias={5: 3.0}),
              SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True, presence_penalty=2.0, n=2)]
    prompts = [PROMPT, PROMPT[:20], PROMPT[5:], PROMPT[::-1]]
    alone = [[c.token_ids for c in llm.generate([p], sp)[0].outputs] for p, sp in zip(prompts, params)]
    batched = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
    assert alone == batched
    idle(llm)


@pytest.mark.parametrize("kw,param", [
    (dict(n=0), "n"), (dict(n=65), "n"), (dict(n=2, best_of=1), "best_of"),
    (dict(logprobs=21), "logprobs"), (dict(logprobs=-1), "logprobs"), (dict(prompt_logprobs=99), "prompt_logprobs"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=math.nan), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(repetition_penalty=math.inf), "repetition_penalty"),
    (dict(logit_bias={1: 101}), "logit_bias"), (dict(logit_bias={-1: 1}), "logit_bias"),
    (dict(logit_bias={"5": 1}), "logit_bias")])
def test_out_of_range_values_name_the_field(kw, param):
    with pytest.raises(SamplingError) as e:
        SamplingParams(**kw)
    assert e.value.param == param
