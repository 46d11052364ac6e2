"""The tokenizer's prefix cache (``text/prefix_tokens.py``): a prompt that repeats a rendered
prefix ending at a special token is tokenized from the remembered ids, with exactly the ids a
whole encode gives; per scope (a tenant never starts from another's prefix, through the server
too); off for a tokenizer whose ids do not split at its special tokens; bounded in memory."""

from __future__ import annotations

import random

import pytest

from hotprefix.model.loader import ModelLoadError
from hotprefix.model.metadata import resolve_model_path
from hotprefix.text.prefix_tokens import PrefixTokens, splits_at_specials
from hotprefix.text.tokenizer import Tokenizer

WORDS = ["the", " The", "  spaced", "\n", "\n\n", "naïve", "日本語", "42", " 3.14", "x" * 40, "é",
         "{\"k\": [1, 2]}", "\t", "déjà vu", "don't", " "]


def _texts(specials: list[str], rng: random.Random, n: int) -> list[str]:
    """Texts of words and special tokens, each often the prefix of an earlier one up to a special
    token plus something new."""
    out: list[str] = []
    for _ in range(n):
        if out and rng.random() < 0.7:
            base = rng.choice(out)
            cuts = [i + len(s) for s in specials for i in range(len(base)) if base.startswith(s, i)]
            head = base[:rng.choice(cuts)] if cuts else ""
        else:
            head = ""
        body = "".join(rng.choice(WORDS + specials if rng.random() < 0.2 else WORDS)
                       for _ in range(rng.randint(1, 400)))
        out.append(head + body)
    return out


def _check_tokenizer(tok: Tokenizer, seed: int) -> None:
    cache = tok._prefixes
    assert cache is not None, "this tokenizer's ids split at its special tokens: the cache runs"
    specials = list(cache.specials)
    rng = random.Random(seed)
    hits = tok.prefix_hits
    for text in _texts(specials, rng, 120):
        for add in (False, True):
            assert tok.encode(text, add, scope="a") == tok.encode(text, add), (text[:80], add)
    assert tok.prefix_hits > hits + 20  # the property above held on many remembered prefixes


def test_cached_ids_equal_a_whole_encode(default_tokenizer):
    _check_tokenizer(default_tokenizer, 1)


def test_cached_ids_equal_a_whole_encode_sentencepiece():
    """A SentencePiece vocabulary (Gemma 3's, built by ``spm_vocab``): the same, where installed."""
    try:
        path = resolve_model_path("gemma3-270m")
    except ModelLoadError as e:
        pytest.skip(str(e))
    _check_tokenizer(Tokenizer.load(path), 2)


def test_scopes_do_not_share(default_tokenizer):
    tok = default_tokenizer
    msgs = [{"role": "system", "content": "Policies. " * 300}, {"role": "user", "content": "Hi"}]
    tok.encode_chat(msgs, scope="tenant-a")
    hits = tok.prefix_hits
    other = [msgs[0], {"role": "user", "content": "Another question"}]
    ids_b = tok.encode_chat(other, scope="tenant-b")
    assert tok.prefix_hits == hits  # another scope: tokenized whole
    ids_a = tok.encode_chat(other, scope="tenant-a")
    assert tok.prefix_hits == hits + 1 and ids_a == ids_b == tok.encode_chat(other)
    tok.encode_chat(other)  # no scope: no cache
    assert tok.prefix_hits == hits + 1


def test_memory_is_bounded(default_tokenizer):
    tok = default_tokenizer
    specials = {"<|im_start|>": 1, "<|im_end|>": 2}
    cache = PrefixTokens(tok._encode, specials, max_ids=3000)
    rng = random.Random(3)
    for text in _texts(list(specials), rng, 60):
        assert cache.encode(text, False, "") == tok.encode(text, False)
        assert cache._kept <= 3000 or len(cache._runs) == 1
    assert all(r in cache._runs.values() for r, _ in cache._entries.values())


def test_off_where_ids_do_not_split_at_specials():
    """A special token that swallows the spaces after it (``rstrip``): ``A<s>  b`` is not
    ``A<s>`` then ``  b``, so the probe fails and the cache stays off."""
    from tokenizers import AddedToken, Tokenizer as HFTok, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = HFTok(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(["hello world  two  spaces abc\n abc été 42"] * 20,
                          trainers.BpeTrainer(special_tokens=["<unk>"],
                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    t.add_special_tokens([AddedToken("<eot>", rstrip=True, special=True)])
    fast = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eot>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}<eot>{% endfor %}"
    tok = Tokenizer(fast, "test")
    assert not splits_at_specials(tok._encode, ["<eot>"])
    assert tok._prefixes is None
    text = "hello <eot>  two  spaces " * 40
    assert tok.encode(text, False, scope="a") == tok.encode(text, False) and tok.prefix_hits == 0


@pytest.mark.model
def test_server_scopes_by_tenant():
    """Through the server: alice's second chat on her system prompt starts from her first one's
    ids; bob's chat on the same text does not (his tokenization is not made faster by hers); every
    prompt's token count is a whole encode's."""
    import openai

    from server_support import default_model_server

    system = "You answer questions about the ferry timetable. " * 120
    with default_model_server() as s:
        tok = s.state.tokenizer

        def ask(key: str, question: str) -> int:
            client = openai.OpenAI(base_url=s.url + "/v1", api_key=key)
            r = client.chat.completions.create(model=s.model, max_tokens=1, messages=[
                {"role": "system", "content": system}, {"role": "user", "content": question}])
            return r.usage.prompt_tokens

        want = len(tok.encode_chat([{"role": "system", "content": system},
                                    {"role": "user", "content": "When is the first boat?"}]))
        assert ask("sk-alice-1", "When is the last boat?") > 0
        hits = tok.prefix_hits
        assert ask("sk-bob", "When is the first boat?") == want
        assert tok.prefix_hits == hits
        assert ask("sk-alice-2", "When is the first boat?") == want
        assert tok.prefix_hits == hits + 1
