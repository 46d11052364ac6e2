"""Incremental detokenization (engine/detokenizer.py) with the default model's tokenizer: the
streamed text equals the one-shot decode (multi-byte characters split across tokens included), the
decode work is linear in the output length, and stop strings are cut exactly as a search of the
whole text cuts them, without a stream ever showing part of one."""

from __future__ import annotations

import random

import pytest

from hotprefix import LLM, SamplingParams
from hotprefix.engine.detokenizer import IncrementalDetokenizer

N = 2000

PARAGRAPHS = [
    "The café on the corner serves crème brûlée, jalapeño bagels and piña coladas; "
    "naïve visitors say “déjà vu” — Ünïcödé everywhere, Œuvres complètes, Ærøskøbing. ",
    "日本語のテキストと中文文本，混在している。東京の天気は晴れ、北京下雨了。"
    "難しい漢字：鬱、麤、齉、龘。한국어 문장도 있습니다. ",
    "Emoji: 😀😃🤖🚀🧪👩🏽‍💻🏳️‍🌈 and flags 🇫🇷🇯🇵, symbols ✓ ✗ ∑ ∫ √ ≈ ≠ ∞ ♠ ♥ €£¥. ",
    "Русский текст, ελληνικά γράμματα, עברית, العربية, हिन्दी, ไทย, Tiếng Việt có dấu. ",
    "def f(x):\n    return {'κλειδί': x ** 2, \"值\": [1, 2, 3]}  # ← arrows ⇒ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢\n",
]


@pytest.fixture(scope="module")
def tok(default_tokenizer):
    default_tokenizer.skipped_token_ids  # computed once, outside any decode counting
    return default_tokenizer


@pytest.fixture(scope="module")
def text_ids(tok) -> list[int]:
    """2,000 ids of multilingual text (accents, CJK, emoji), cut at an arbitrary token."""
    rng = random.Random(7)
    ids: list[int] = []
    while len(ids) < N + 50:
        ids += tok.encode("".join(rng.sample(PARAGRAPHS, len(PARAGRAPHS))), add_special_tokens=False)
    return ids[13:13 + N]


@pytest.fixture(scope="module")
def random_ids(tok) -> list[int]:
    """2,000 ids drawn from the whole vocabulary: byte tokens, fragments of characters, specials."""
    rng = random.Random(11)
    return [rng.randrange(tok.vocab_size) for _ in range(N)]


def stream(tok, ids, stop=()):
    """Feed ``ids`` one at a time. Returns (texts shown after each token, pieces, final text,
    number of tokens consumed)."""
    d = IncrementalDetokenizer(tok, stop)
    shown, pieces = [], []
    for k, t in enumerate(ids, 1):
        stopped = d.add([t])
        if stopped:
            break
        text, new = d.take()
        shown.append(text)
        pieces.append(new)
    else:
        k = len(ids)
        d.finish()
    text, new = d.take()
    pieces.append(new)
    return shown, pieces, text, k


def one_shot_stop(tok, ids, stop):
    """The engine's former rule: after each token decode everything and cut before the first stop
    string found. Returns (text, number of tokens consumed)."""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k])
        cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
        if cut >= 0:
            return text[:cut], k
    return tok.decode(ids), len(ids)


# ---------------------------------------------------------------------- (a) same text as one-shot
@pytest.mark.parametrize("which", ["text_ids", "random_ids"])
def test_streamed_text_equals_one_shot_decode(tok, which, request):
    ids = request.getfixturevalue(which)
    want = tok.decode(ids)
    shown, pieces, text, _ = stream(tok, ids)
    assert text == want
    assert "".join(pieces) == want
    assert all(want.startswith(s) for s in shown)  # shown text only ever grows
    if which == "text_ids":
        assert not any(s.endswith("\ufffd") for s in shown)  # never half a character
        assert {"😀", "日", "é", "鬱"} <= set(want)  # the multi-byte cases are really there


def test_every_prefix_ends_like_a_one_shot_decode(tok, text_ids):
    """Stopping after any token gives decode(ids[:k]), a trailing unfinished character included."""
    ids = text_ids[:300]
    d = IncrementalDetokenizer(tok)
    for k, t in enumerate(ids, 1):
        d.add([t])
        probe = IncrementalDetokenizer(tok)
        probe.add(ids[:k])
        probe.finish()
        assert probe.take()[0] == tok.decode(ids[:k])
    d.finish()
    assert d.take()[0] == tok.decode(ids)


def test_special_tokens_add_no_text_and_no_work(tok, text_ids, monkeypatch):
    eos = min(tok.skipped_token_ids)
    ids = text_ids[:40] + [eos] * 500 + text_ids[40:80]
    seen = []
    real = tok.decode
    monkeypatch.setattr(tok, "decode", lambda t, **kw: seen.append(len(t)) or real(t, **kw))
    _, pieces, text, _ = stream(tok, ids)
    monkeypatch.undo()
    assert text == "".join(pieces) == tok.decode(ids)
    assert sum(seen) <= 8 * 80


# ---------------------------------------------------------------------- (b) linear decode work
@pytest.mark.parametrize("which", ["text_ids", "random_ids"])
def test_decode_work_is_linear(tok, which, request, monkeypatch):
    ids = request.getfixturevalue(which)
    seen: list[int] = []
    real = tok.decode

    def counting(token_ids, **kw):
        seen.append(len(token_ids))
        return real(token_ids, **kw)

    monkeypatch.setattr(tok, "decode", counting)
    _, _, text, _ = stream(tok, ids, stop=["never appears \x00"])
    monkeypatch.undo()
    assert text == tok.decode(ids)
    # re-decoding everything per token would be N*(N+1)/2 = 2,001,000 tokens
    assert sum(seen) <= 8 * N, (sum(seen), max(seen))
    assert max(seen) <= 32


# ---------------------------------------------------------------------- (c) stop strings
def test_stop_string_spanning_two_tokens(tok, text_ids):
    ids = text_ids[:200]
    pieces = [tok.decode([t]) for t in ids]
    i = next(i for i in range(20, 200) if len(pieces[i]) >= 3 and len(pieces[i + 1]) >= 3
             and pieces[i].isascii() and pieces[i + 1].isascii())
    needle = pieces[i][-2:] + pieces[i + 1][:2]
    want, k = one_shot_stop(tok, ids, [needle])
    shown, streamed, text, consumed = stream(tok, ids, [needle])
    assert (text, consumed) == (want, k)
    assert k <= i + 2 and needle not in text
    assert "".join(streamed) == text
    assert all(text.startswith(s) for s in shown)  # no part of the stop string was ever shown


def test_stop_strings_match_whole_text_search(tok, text_ids):
    """Random stop strings cut from the text (any length, any boundary, several at once): the
    same cut and the same stopping token as searching the whole text after every token."""
    ids = text_ids[:160]
    full = tok.decode(ids)
    rng = random.Random(3)
    for trial in range(60):
        stops = []
        for _ in range(rng.randint(1, 3)):
            a = rng.randrange(len(full) - 1)
            stops.append(full[a:a + rng.randint(1, 12)])
        if rng.random() < 0.3:
            stops.append("not in the text")
        want, k = one_shot_stop(tok, ids, stops)
        shown, pieces, text, consumed = stream(tok, ids, stops)
        assert (text, consumed) == (want, k), stops
        assert "".join(pieces) == text
        assert all(text.startswith(s) for s in shown), stops


def test_held_back_only_while_it_could_be_a_stop_string(tok):
    ids = tok.encode("Hello wor", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, ["world peace", "xyz"])
    d.add(ids)
    assert d.take()[0] == "Hello "  # "wor" might become "world peace"
    d.add(tok.encode("k", add_special_tokens=False))
    assert d.take()[0] == "Hello work"  # it did not
    d.finish()
    assert d.take() == ("Hello work", "")


# ---------------------------------------------------------------------- (d) multi-byte stop strings
def test_stop_string_is_a_character_split_across_tokens(tok):
    text = "Hello 世界 and more"
    ids = tok.encode(text, add_special_tokens=False)
    assert any(tok.decode([t]).endswith("\ufffd") for t in ids)  # 世 is split over tokens
    shown, pieces, out, k = stream(tok, ids, ["界"])
    assert out == "Hello 世" == one_shot_stop(tok, ids, ["界"])[0]
    assert not any("\ufffd" in s for s in shown)
    assert "".join(pieces) == out


def test_stop_string_completed_by_a_token_that_starts_a_character(tok):
    """The token that completes the stop string also holds the first bytes of the next
    character: the stop is found at that token, not one later."""
    text = " naïve café Ünïcödé"
    ids = tok.encode(text, add_special_tokens=False)
    i = next(i for i, t in enumerate(ids) if tok.decode(ids[:i + 1]).endswith("café \ufffd"))
    want, k = one_shot_stop(tok, ids, ["café "])
    assert (want, k) == (" naïve ", i + 1)
    _, pieces, out, consumed = stream(tok, ids, ["café "])
    assert (out, consumed) == (want, k)
    assert "".join(pieces) == out


def test_stop_string_ending_inside_an_unfinished_emoji(tok):
    ids = tok.encode("ok 😀😃 done", add_special_tokens=False)
    for stop in (["😃"], ["😀😃 d"], ["k 😀"]):
        want, k = one_shot_stop(tok, ids, stop)
        shown, pieces, out, consumed = stream(tok, ids, stop)
        assert (out, consumed) == (want, k)
        assert "".join(pieces) == out and not any("\ufffd" in s for s in shown)


# ---------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return LLM(tiny_model_dir, num_blocks=128, block_size=16, enable_prefix_caching=False)


def run_streaming(engine, prompt, params):
    req = engine.add_request(prompt, params)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == req.request_id]
    return outs


def test_engine_stream_equals_final_text_and_one_shot_decode(tiny, tok):
    eng = tiny.engine
    outs = run_streaming(eng, [5, 17, 300, 4000], SamplingParams(max_tokens=300, ignore_eos=True))
    final = outs[-1]
    assert final.finished and final.finish_reason == "length"
    assert final.text == tok.decode(final.token_ids)
    assert "".join(o.new_text for o in outs) == final.text
    assert not eng._detokenizers


def test_engine_stop_string_and_stop_token(tiny, tok):
    eng = tiny.engine
    full = run_streaming(eng, [9, 99, 999], SamplingParams(max_tokens=40, ignore_eos=True))[-1]
    needle = full.text[len(full.text) // 2:len(full.text) // 2 + 3]
    outs = run_streaming(eng, [9, 99, 999], SamplingParams(max_tokens=40, ignore_eos=True, stop=[needle]))
    assert outs[-1].finish_reason == "stop"
    assert outs[-1].text == full.text[:full.text.find(needle)]
    assert "".join(o.new_text for o in outs) == outs[-1].text
    stop_at = full.token_ids[5]
    out = run_streaming(eng, [9, 99, 999], SamplingParams(max_tokens=40, ignore_eos=True,
                                                          stop_token_ids=[stop_at]))[-1]
    j = full.token_ids.index(stop_at)
    assert out.token_ids == full.token_ids[:j + 1]
    assert out.text == tok.decode(full.token_ids[:j])  # the stop token is not text
