"""Miss labels that say what happened, on a tiny random-weight model with the default chat
template: a new system prompt is ``cold`` (not ``diverged`` inside the template's fixed opening),
the next turn of a chat is ``extended`` (a cached prefix reused, new text after it), and a real
divergence past the opening is still ``diverged`` with excerpts."""

from __future__ import annotations

import pytest

from hotprefix import LLM
from hotprefix.request.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, num_blocks=256, num_threads=2)


def chat(llm, messages):
    return llm.chat(messages, GREEDY)[0]


def test_a_new_system_prompt_is_cold_not_diverged_in_the_template(llm):
    llm.reset_prefix_cache()
    fixed = llm.engine.cache.fixed_prefix
    assert 0 < len(fixed) < 8  # "<|im_start|>system\n" and no more
    chat(llm, [{"role": "system", "content": "You answer questions about ships and harbors. " * 4},
               {"role": "user", "content": "Hello"}])
    o = chat(llm, [{"role": "system", "content": "Translate every message into French, politely. " * 4},
                   {"role": "user", "content": "Hello"}])
    rep = o.cache_report
    assert rep.miss_reason == "cold" and rep.cached_tokens == 0, rep
    assert "sent_excerpt" not in str(rep)


def test_the_next_turn_of_a_chat_is_extended(llm):
    llm.reset_prefix_cache()
    conv = [{"role": "system", "content": "You are a concise assistant for a bakery. " * 6},
            {"role": "user", "content": "What bread do you sell on Mondays?"}]
    first = chat(llm, conv)
    conv += [{"role": "assistant", "content": first.text},
             {"role": "user", "content": "And do you have anything without gluten on Tuesdays?"}]
    second = chat(llm, conv)
    rep = second.cache_report
    assert rep.cached_tokens >= 0.6 * len(second.prompt_token_ids)
    assert rep.miss_reason == "extended", rep
    assert rep.miss_position == rep.cached_tokens
    assert "came from cache" in rep.detail["note"]
    stats = llm.cache_stats()
    assert stats["requests_by_reason"].get("extended", 0) >= 1


def test_a_divergence_past_the_template_opening_is_still_diverged(llm):
    llm.reset_prefix_cache()
    base = "You are the assistant of Harbor Logistics. Customs papers are due 48 hours ahead. " * 2
    chat(llm, [{"role": "system", "content": base + "Request 1001."}, {"role": "user", "content": "Hi"}])
    o = chat(llm, [{"role": "system", "content": base + "Request 2002."}, {"role": "user", "content": "Hi"}])
    rep = o.cache_report
    assert rep.miss_reason == "diverged", rep
    assert rep.miss_position > len(llm.engine.cache.fixed_prefix) + 16
    assert "1001" in rep.detail["cached_excerpt"] and "2002" in rep.detail["sent_excerpt"]


def test_the_report_type_keeps_the_api_fields_and_the_docs_list_every_reason():
    import os
    import re

    from hotprefix.cache.report import CacheReport, MissReason

    rep = CacheReport(16, 5, written_blocks=2, miss_reason=MissReason.EXTENDED, miss_position=16,
                      detail={"block_index": 1}, sources={"pool": 16})
    assert rep.to_json() == {"cached_tokens": 16, "computed_tokens": 5, "written_blocks": 2,
                             "sources": {"pool": 16},
                             "miss_reason": "extended", "miss_position": 16,
                             "detail": {"block_index": 1}}
    assert CacheReport.not_admitted(7).to_json()["miss_reason"] == "not_admitted"
    page = open(os.path.join(os.path.dirname(__file__), "..", "docs", "features", "why-it-missed.md")).read()
    listed = set(re.findall(r"^\| `(\w+)` \|", page, re.M))
    assert {r.value for r in MissReason} <= listed | {"salt"}  # salt: the operator's row, in prose
    assert "`salt`" in page
