"""Token-exact continuations (``server/continuation.py``) without a model: the tail after the
stored ids is what the template renders after the answer, the model's own end-of-turn token is
not repeated, a template that re-renders earlier turns keeps the stored tokens (and says so), and
one that rewrites an earlier answer's text falls back to a re-render whose miss is reported as the
server's doing.
"""

from __future__ import annotations

import copy

from hotprefix.server.continuation import continue_ids
from hotprefix.server.responses import report
from hotprefix.text.tokenizer import Tokenizer


def test_the_tail_is_the_templates_and_the_eos_is_not_repeated(default_tokenizer):
    tok = default_tokenizer
    head = [{"role": "user", "content": "Hi"}]
    prompt = tok.encode_chat(head)
    answer = tok.encode("Hello !", add_special_tokens=False)  # a split a re-tokenization would merge
    eos = tok.encode("<|im_end|>", add_special_tokens=False)
    assert len(eos) == 1 and eos[0] in tok.eos_token_ids
    new = [{"role": "user", "content": "Again"}]
    got = continue_ids(tok, head, None, prompt + answer + eos, True, new)
    assert got is not None and not got.rewrites_history
    assert got.ids[:len(prompt) + len(answer) + 1] == prompt + answer + eos
    tail = tok.decode(got.ids[len(prompt) + len(answer) + 1:], skip_special_tokens=False)
    assert tail == "\n<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\n"
    cut = continue_ids(tok, head, None, prompt + answer, False, new)  # cut by max_tokens: closed here
    assert tok.decode(cut.ids[len(prompt) + len(answer):], skip_special_tokens=False).startswith("<|im_end|>\n")


def _with_template(tok, template):
    return Tokenizer(copy.deepcopy(tok.hf), tok.source, template)


def test_a_template_that_drops_earlier_answers_falls_back(default_tokenizer):
    tok = _with_template(default_tokenizer, (
        "{% for m in messages %}{% if m.role != 'assistant' or loop.last %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"))
    head = [{"role": "user", "content": "Hi"}]
    assert continue_ids(tok, head, None, [1, 2, 3], True, [{"role": "user", "content": "x"}]) is None
    rep = {"miss_reason": "diverged", "detail": {"likely_cause": "system_prompt_changed"}}
    out = report(rep, {"mode": "re_rendered", "reason": "template_rewrites_answer"})
    assert out["detail"]["likely_cause"] == "server_re_rendered" and "nothing the client" in out["detail"]["hint"]
    kept = report({"miss_reason": "diverged", "detail": {"likely_cause": "x"}},
                  {"mode": "re_rendered", "reason": "tools_changed"})
    assert kept["detail"]["likely_cause"] == "x"  # a change the client made stays the client's


def test_a_template_that_re_renders_earlier_turns_keeps_the_stored_tokens(default_tokenizer):
    tok = _with_template(default_tokenizer, (  # the last user turn is marked: earlier turns change
        "{% set users = messages | selectattr('role', 'equalto', 'user') | list %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m == users[-1] %}[LAST] {% endif %}"
        "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"))
    head = [{"role": "user", "content": "Hi"}]
    stored = tok.encode_chat(head) + [42, 43]
    got = continue_ids(tok, head, None, stored, False, [{"role": "user", "content": "Again"}])
    assert got.rewrites_history and got.ids[:len(stored)] == stored
    assert "[LAST] Again" in tok.decode(got.ids[len(stored):], skip_special_tokens=False)
