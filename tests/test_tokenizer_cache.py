"""A GGUF's tokenizer is built from the file once and read back from the cache directory after:
the same ids, text, chat rendering, stop tokens and fingerprint (the prefix cache's namespace must
not change across restarts), and a damaged or unwritable cache never stops a load."""

from __future__ import annotations

import shutil

import pytest
import transformers

from hotprefix.model.loader import default_model_path
from hotprefix.text.tokenizer import Tokenizer

TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n\nnew lines", "naïve café 東京 🚀",
         "<|im_start|>user\nhi<|im_end|>", "x" * 300]
CHAT = [{"role": "system", "content": "Be short."}, {"role": "user", "content": "What is 2+2?"}]


def _observed(tok: Tokenizer) -> tuple:
    ids = [tok.encode(t) for t in TEXTS]
    return (tok.fingerprint, tok.vocab_size, tok.eos_token_ids, tok.skipped_token_ids, ids,
            [tok.decode(i, skip_special_tokens=False) for i in ids], tok.render_chat(CHAT),
            tok.max_token_bytes)


def _sources(monkeypatch) -> list[str]:
    """Record where each tokenizer load through ``AutoTokenizer`` reads from (a directory, and a
    GGUF file name if any), and each load of a saved one by the generic fast class directly
    (``fast:`` and its directory)."""
    seen: list[str] = []
    real = transformers.AutoTokenizer.from_pretrained.__func__
    fast = transformers.PreTrainedTokenizerFast
    real_fast = fast.from_pretrained.__func__
    depth = []

    def spy(cls, path, *a, **k):
        seen.append(k.get("gguf_file") or str(path))
        depth.append(1)  # AutoTokenizer calls the class's own from_pretrained: not recorded twice
        try:
            return real(cls, path, *a, **k)
        finally:
            depth.pop()

    def spy_fast(cls, path, *a, **k):
        if not depth:
            seen.append(f"fast:{path}")
        return real_fast(cls, path, *a, **k)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", classmethod(spy))
    monkeypatch.setattr(fast, "from_pretrained", classmethod(spy_fast))
    return seen


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(cache directory, where the load read from, what it observed): the default GGUF's
    tokenizer loaded once into an empty cache directory (a build from the file: seconds of CPU,
    so made once and copied by the test that damages it)."""
    root = tmp_path_factory.mktemp("tok-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOTPREFIX_CACHE_DIR", str(root))
        seen = _sources(mp)
        observed = _observed(Tokenizer.load(default_model_path()))
    return root, seen, observed


def test_built_once_then_read_from_the_cache_with_the_same_behaviour(monkeypatch, built):
    root, seen_first, first = built
    monkeypatch.setenv("HOTPREFIX_CACHE_DIR", str(root))
    seen = _sources(monkeypatch)
    gguf = default_model_path()
    entries = list((root / "tokenizers").iterdir())
    assert len(entries) == 1 and (entries[0] / "tokenizer.json").exists()
    second = Tokenizer.load(gguf)
    # the file, then the cache, by the generic fast class (AutoTokenizer's class lookup: ~0.3 s)
    assert seen_first + seen == [gguf.rsplit("/", 1)[-1], f"fast:{entries[0]}"]
    assert _observed(second) == first


def test_a_damaged_entry_is_rebuilt_and_an_unwritable_cache_is_passed_over(monkeypatch, tmp_path, built):
    shutil.copytree(built[0], tmp_path, dirs_exist_ok=True)
    monkeypatch.setenv("HOTPREFIX_CACHE_DIR", str(tmp_path))
    gguf = default_model_path()
    want = built[2]  # a load from the file into an empty cache directory
    (entry,) = (tmp_path / "tokenizers").iterdir()
    (entry / "tokenizer.json").write_text("{not json")
    assert _observed(Tokenizer.load(gguf)) == want
    assert (entry / "tokenizer.json").read_text().startswith("{\n")  # written again, whole
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("HOTPREFIX_CACHE_DIR", str(blocked))  # a directory cannot be made under it
    assert _observed(Tokenizer.load(gguf)) == want
