"""A GGUF's tokenizer is built from the file once and read back from the cache directory after,
as a snapshot read without importing transformers (``text/tokenizer_snapshot.py``): the same ids,
text, pieces, chat rendering, stop tokens and fingerprint (the prefix cache's namespace must not
change across restarts); transformers' own object still there for the libraries that need it; a
damaged snapshot or save, or an unwritable cache, never stops a load; a snapshot that would
behave differently is never kept."""

from __future__ import annotations

import functools
import json
from pathlib import Path
import logging
import shutil
import subprocess
import sys

import pytest
import transformers

from hotprefix.model.loader import default_model_path
from hotprefix.text import chat_template, tokenizer_snapshot
from hotprefix.text.tokenizer import Tokenizer

TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n\nnew lines", "naïve café 東京 🚀",
         "<|im_start|>user\nhi<|im_end|>", "x" * 300]
CHAT = [{"role": "system", "content": "Be short."}, {"role": "user", "content": "What is 2+2?"}]


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def _observed(tok: Tokenizer) -> tuple:
    ids = [tok.encode(t) for t in TEXTS]
    return (tok.fingerprint, tok.vocab_size, tok.eos_token_ids, tok.skipped_token_ids, ids,
            [tok.encode(t, add_special_tokens=False) for t in TEXTS],
            [tok.decode(i, skip_special_tokens=False) for i in ids],
            [tok.decode(i, skip_special_tokens=True) for i in ids],
            [tok.convert_ids_to_tokens(i) for i in ids], tok.byte_level, tok.add_specials([5, 6]),
            tok.render_chat(CHAT), tok.render_chat(CHAT, add_generation_prompt=False, tools=TOOLS),
            tok.renders_tools, tok.encode_chat(CHAT, scope="t"), tok.encode_chat(CHAT, scope="t"),
            tok.max_token_bytes, tok.chat_template)


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


def _snapshot(entry):
    (snap,) = entry.glob("hotprefix-snapshot-*.json")
    return snap


def test_built_once_then_read_from_the_cache_with_the_same_behaviour(monkeypatch, built):
    root, seen_first, first = built
    monkeypatch.setenv("HOTPREFIX_CACHE_DIR", str(root))
    seen = _sources(monkeypatch)
    gguf = default_model_path()
    entries = list((root / "tokenizers").iterdir())
    assert len(entries) == 1 and (entries[0] / "tokenizer.json").exists()
    assert _snapshot(entries[0]).name == tokenizer_snapshot.path_in(entries[0]).name
    second = Tokenizer.load(gguf)
    assert seen_first + seen == [gguf.rsplit("/", 1)[-1]]  # the file once; then neither it nor the save
    assert isinstance(second._tok, tokenizer_snapshot.SnapshotTokenizer)
    assert _observed(second) == first
    # transformers' own object for the libraries that need it (llguidance): loaded from the save
    # by the generic fast class (AutoTokenizer's class lookup: ~0.3 s), the same ids
    hf = second.hf
    assert seen == [f"fast:{entries[0]}"] and type(hf).__name__ in tokenizer_snapshot.GENERIC_CLASSES
    assert [list(hf.encode(t)) for t in TEXTS] == first[4] and hf.chat_template == second.chat_template
    assert second.hf is hf


def test_a_start_from_the_snapshot_does_not_import_transformers(built):
    root = built[0]
    code = (f"import sys; from hotprefix.text.tokenizer import Tokenizer; t = Tokenizer.load({default_model_path()!r}); "
            "ids = t.encode_chat([{'role': 'user', 'content': 'hi'}]); t.decode(ids); "
            "print(type(t._tok).__name__, 'transformers' in sys.modules, t.fingerprint)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "HOTPREFIX_CACHE_DIR": str(root)}).stdout.split()
    assert out == ["SnapshotTokenizer", "False", built[2][0]]


@pytest.mark.parametrize("damage", ["garbage", "format", "backend", "ids", "empty"])
def test_a_damaged_snapshot_is_passed_over_and_written_again(monkeypatch, tmp_path, built, damage, caplog):
    shutil.copytree(built[0], tmp_path, dirs_exist_ok=True)
    monkeypatch.setenv("HOTPREFIX_CACHE_DIR", str(tmp_path))
    (entry,) = (tmp_path / "tokenizers").iterdir()
    snap = _snapshot(entry)
    good = json.loads(snap.read_text())
    bad = dict(good)
    if damage == "garbage":
        snap.write_text("{not json")
    else:
        if damage == "format":
            bad["format"] = tokenizer_snapshot.FORMAT + 1
        elif damage == "backend":
            bad["backend"] = bad["backend"][: len(bad["backend"]) // 2]
        elif damage == "ids":
            bad["ids"] = "not a dict"
        elif damage == "empty":
            bad = {}
        snap.write_text(json.dumps(bad))
    with caplog.at_level(logging.WARNING, logger="hotprefix.text.tokenizer_snapshot"):
        tok = Tokenizer.load(default_model_path())
    assert "passed over" in caplog.text
    assert not isinstance(tok._tok, tokenizer_snapshot.SnapshotTokenizer)  # transformers', from the save
    assert _observed(tok) == built[2]
    assert json.loads(snap.read_text()) == good  # written again, whole


def test_a_damaged_save_under_a_good_snapshot_is_rebuilt_when_transformers_is_asked_for(monkeypatch, tmp_path, built):
    shutil.copytree(built[0], tmp_path, dirs_exist_ok=True)
    monkeypatch.setenv("HOTPREFIX_CACHE_DIR", str(tmp_path))
    (entry,) = (tmp_path / "tokenizers").iterdir()
    (entry / "tokenizer.json").write_text("{not json")
    tok = Tokenizer.load(default_model_path())
    assert isinstance(tok._tok, tokenizer_snapshot.SnapshotTokenizer) and _observed(tok) == built[2]
    assert [list(tok.hf.encode(t)) for t in TEXTS] == built[2][4]  # from the file
    assert (entry / "tokenizer.json").read_text().startswith("{\n")  # the save written again, whole


def test_a_snapshot_that_would_behave_differently_is_not_kept(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("HOTPREFIX_CACHE_DIR", str(tmp_path))
    real = chat_template.render
    monkeypatch.setattr(chat_template, "render", lambda *a: real(*a) + " ")  # one space more
    with caplog.at_level(logging.INFO, logger="hotprefix.text.tokenizer_snapshot"):
        tok = Tokenizer.load(default_model_path())
    assert "differs from transformers' in chat template" in caplog.text
    (entry,) = (tmp_path / "tokenizers").iterdir()
    assert not list(entry.glob("hotprefix-snapshot-*")) and (entry / "tokenizer.json").exists()
    hf = tok.hf
    assert tokenizer_snapshot.take(hf) is not None
    # what a snapshot does not carry is never kept: a model-specific class, space clean-up
    monkeypatch.setattr(hf, "clean_up_tokenization_spaces", True)
    assert tokenizer_snapshot.take(hf) is None
    monkeypatch.setattr(hf, "clean_up_tokenization_spaces", False)
    hf.chat_template = {"default": "x", "tool_use": "y"}
    assert tokenizer_snapshot.take(hf) is None


def test_a_damaged_entry_is_rebuilt_and_an_unwritable_cache_is_passed_over(monkeypatch, tmp_path, built):
    shutil.copytree(built[0], tmp_path, dirs_exist_ok=True)
    monkeypatch.setenv("HOTPREFIX_CACHE_DIR", str(tmp_path))
    gguf = default_model_path()
    want = built[2]  # a load from the file into an empty cache directory
    (entry,) = (tmp_path / "tokenizers").iterdir()
    _snapshot(entry).unlink()
    (entry / "tokenizer.json").write_text("{not json")
    assert _observed(Tokenizer.load(gguf)) == want
    assert (entry / "tokenizer.json").read_text().startswith("{\n")  # written again, whole
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("HOTPREFIX_CACHE_DIR", str(blocked))  # a directory cannot be made under it
    assert _observed(Tokenizer.load(gguf)) == want


VOCAB_FIELDS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")


@functools.cache
def _default_vocab_fields() -> dict:
    """The default model's vocabulary fields, read once (by our header reader: gguf's builds a
    record for each of their 150,000 elements first, seconds of CPU)."""
    from hotprefix.files.gguf_header import read_file_metadata

    return read_file_metadata(default_model_path(), VOCAB_FIELDS)


def _bpe_gguf(path, *, pre: str, add_bos: bool, add_eos: bool, template: str | None) -> str:
    """A tokenizer-only GGUF with the default model's byte-level BPE vocabulary and merges, its
    flags, pre-tokenizer and chat template as given (the class of file: Llama 3, Qwen, SmolLM2)."""
    import gguf

    f = _default_vocab_fields()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(f["tokenizer.ggml.tokens"])
    w.add_token_types(f["tokenizer.ggml.token_type"].tolist())
    w.add_token_merges(f["tokenizer.ggml.merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(add_bos)
    w.add_add_eos_token(add_eos)
    if template is not None:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


LLAMA3_TOOLS = (Path(__file__).parent / "data" / "templates" / "llama3_tools.jinja").read_text()


@pytest.mark.parametrize("pre,add_bos,add_eos,template", [
    ("llama-bpe", True, False, LLAMA3_TOOLS),  # Llama 3's: a BOS before every text
    ("qwen2", False, True, None),  # an EOS after it, no chat (a base model)
])
def test_other_bpe_files_read_back_from_a_snapshot_as_transformers_built_them(tmp_path, monkeypatch, pre,
                                                                             add_bos, add_eos, template):
    monkeypatch.setenv("HOTPREFIX_CACHE_DIR", str(tmp_path / "cache"))
    path = _bpe_gguf(tmp_path / "tok.gguf", pre=pre, add_bos=add_bos, add_eos=add_eos, template=template)
    first = Tokenizer.load(path)
    second = Tokenizer.load(path)
    assert not isinstance(first._tok, tokenizer_snapshot.SnapshotTokenizer)
    assert isinstance(second._tok, tokenizer_snapshot.SnapshotTokenizer)
    ids = second.encode("Hello")
    assert (ids[0] == 1) == add_bos and (ids[-1] == 2) == add_eos  # the flags took effect
    observe = _observed if template else lambda t: _observed_no_chat(t)
    assert observe(second) == observe(first)


def _observed_no_chat(tok: Tokenizer) -> tuple:
    ids = [tok.encode(t) for t in TEXTS]
    with pytest.raises(Exception, match="no chat template"):
        tok.render_chat(CHAT)
    return (tok.fingerprint, tok.vocab_size, tok.eos_token_ids, tok.skipped_token_ids, ids,
            [tok.decode(i, skip_special_tokens=False) for i in ids],
            [tok.convert_ids_to_tokens(i) for i in ids], tok.add_specials([5, 6]), tok.max_token_bytes)
