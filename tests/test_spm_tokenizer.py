"""SentencePiece GGUF vocabularies (``tokenizer.ggml.model = llama``: Llama 2, Mistral, Gemma),
built by ``hotprefix.text.spm_vocab`` into the ``tokenizers`` BPE model.

No download: a tiny SentencePiece BPE model is trained in the test (byte fallback, control and
user-defined pieces), written to a GGUF the way llama.cpp's ``convert_hf_to_gguf.py`` writes a
SentencePiece vocabulary, and loaded by ``Tokenizer.load``. Its ids on hostile texts (spaces, tabs,
newlines, CJK, emoji, combining marks, bytes that need byte fallback, text that looks like special
tokens, long words) are compared with two independent references: the ``sentencepiece`` library on
the same model (cut at control pieces, which it never parses), and a plain-Python transcription of
llama.cpp's ``llm_tokenizer_spm`` (longest-first special-token partition, score-ordered bigram
merges, byte fallback). The real Gemma 3 270M file is compared with the second reference and, where
the llama.cpp peer has built ``llama-tokenize``, with llama.cpp itself.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

spm = pytest.importorskip("sentencepiece")
gguf = pytest.importorskip("gguf")

from hotprefix.text import spm_vocab, tokenizer_snapshot  # noqa: E402
from hotprefix.engine.detokenizer import IncrementalDetokenizer  # noqa: E402
from hotprefix.text.tokenizer import Tokenizer, TokenizerError  # noqa: E402

CONTROL = ["<start_of_turn>", "<end_of_turn>"]
USER_DEFINED = ["<table>", "\u2581\u2581", "\u2581\u2581\u2581"]  # Gemma has whitespace runs as these

HOSTILE = [
    "", " ", "  ", "   ", "\n", "\n\n", "\t", " \t \n ", "Hello world", " Hello world", "Hello world ",
    "hello  world", "hello   world    ", "  leading", "trailing  ", "a\nb\n\nc\n\n\n\nd", "tab\there\t\tx",
    "日本語のテキスト、中文文本。한국어", "emoji 😀👍🏽 🇫🇷 👨‍👩‍👧", "e\u0301 combining a\u0308o\u0303",
    "\x00\x01\x7f control \x1b[31m", "\u200b\u200d\ufeff zero width", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𓀀 \U0010fffd",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n", "<s>text</s>", "<s><s>",
    "< s>", "<start_of_turn", "<unk>", "<table><tr>x</tr></table>", "<0x41>", "a" * 300,
    "supercalifragilisticexpialidocious" * 20, "x" + "\n" * 40 + "y", " " * 45 + "z",
    "def f(x):\n    return x  # comment\n", "The quick brown fox. 1234567890 3.14159 $%^&*()",
    "mixed\r\nCRLF\rCR", "ÅÆØåæø ß ı İ ﬁ ＡＢＣ", "\u00a0nbsp\u2003emsp a\u3000b", "café naïve über straße",
]
"""Texts for every comparison. Literal ``▁`` is left out here: SentencePiece reads it as a space
(so ``▁▁`` matches its user-defined piece) while llama.cpp matches the GGUF's ``"  "`` only against
real spaces; the Gemma test below has it."""


def _random_texts(n: int, seed: int) -> list[str]:
    """Random strings over an alphabet of the hard cases (runs of spaces and newlines, pieces of
    control tokens, CJK, emoji, combining marks, characters the model never saw)."""
    rng = random.Random(seed)
    alphabet = (["the ", "quick", " fox", "hello", "world", "café", " ", "  ", "   ", "\n", "\t", "東京",
                 "日本語", "😀", "👍🏽", "e\u0301", "<", ">", "/", "start_of_turn", "<start_of_turn>",
                 "<end_of_turn>", "<table>", "<s>", "x", "ß", "\u00a0", "0x41", "Z̴̡"] +
                [c for c in (chr(rng.randrange(0x20, 0x2FFF)) for _ in range(20)) if c != "\u2581"])
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 25))) for _ in range(n)]


# --------------------------------------------------------------------------- the tiny model

def _train(add_dummy_prefix: bool, user_defined: list[str]) -> bytes:
    rng = random.Random(3)
    words = ("the quick brown fox jumps over lazy dog hello world prefix cache token block tenant "
             "café naïve 東京 日本語 中文 données über straße supercalifragilistic").split()
    corpus = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 15))) for _ in range(400)]
    corpus += ["    indented code line", "a  b   c", "x\ty", "多个  空格", "tail   "]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=model, vocab_size=520, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=add_dummy_prefix,
        allow_whitespace_only_pieces=True, split_digits=True, user_defined_symbols=user_defined,
        control_symbols=CONTROL, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2, num_threads=1)
    return model.getvalue()


def _write_gguf(path: Path, sp, user_defined: list[str], *, add_bos: bool = True,
                add_eos: bool = False, add_space_prefix: bool | None = None,
                drop_bytes: bool = False, score_of: dict[int, float] | None = None) -> str:
    """The vocabulary as ``convert_hf_to_gguf.py``'s ``_create_vocab_sentencepiece`` writes it
    (user-defined pieces come from tokenizer_config.json there: score -1000, ``▁`` written as a
    space). ``add_space_prefix=None`` writes no key (llama.cpp's default: true)."""
    T = gguf.TokenType
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        piece, score, ty = sp.id_to_piece(i), sp.get_score(i), T.NORMAL
        if sp.is_unknown(i):
            ty = T.UNKNOWN
        elif sp.is_control(i):
            ty = T.CONTROL
        elif sp.is_unused(i):
            ty = T.UNUSED
        elif sp.is_byte(i):
            ty = T.UNUSED if drop_bytes else T.BYTE  # a vocabulary without byte fallback
        if piece in user_defined:
            piece, score, ty = piece.replace("\u2581", " "), -1000.0, T.USER_DEFINED
        tokens.append(piece)
        scores.append((score_of or {}).get(i, score))
        types.append(int(ty))
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(add_bos)
    w.add_add_eos_token(add_eos)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


STYLES = {  # name: (add_dummy_prefix, user-defined pieces)
    "gemma": (False, USER_DEFINED),  # no space prefix, whitespace runs as user-defined pieces
    "llama2": (True, []),  # a space before each text fragment, no user-defined pieces
}


@pytest.fixture(scope="module", params=sorted(STYLES))
def tiny(request, tmp_path_factory):
    """(style, sentencepiece processor, GGUF path, hotprefix Tokenizer) of a freshly trained model."""
    prefix, user_defined = STYLES[request.param]
    sp = spm.SentencePieceProcessor(model_proto=_train(prefix, user_defined))
    d = tmp_path_factory.mktemp(f"spm-{request.param}")
    path = _write_gguf(d / "tiny.gguf", sp, user_defined, add_space_prefix=False if not prefix else None)
    return request.param, sp, path, Tokenizer.load(path)


# --------------------------------------------------------------------------- the references

def sp_reference(sp, vocab: spm_vocab.SpmVocab, text: str, add_special: bool = True) -> list[int]:
    """sentencepiece's ids, with control and unknown pieces parsed as llama.cpp does (sentencepiece
    never reads them from text): the text is cut at them and each piece between is encoded alone."""
    control = sorted((t for t, ty in zip(vocab.tokens, vocab.types)
                      if ty in (spm_vocab.CONTROL, spm_vocab.UNKNOWN)), key=len, reverse=True)
    out = [vocab.bos_id] if add_special and vocab.add_bos else []
    rest = text
    while rest:
        hits = [(rest.find(c), -len(c), c) for c in control if c in rest]
        if not hits:
            out += sp.encode(rest)
            break
        at, _, c = min(hits)
        if at:
            out += sp.encode(rest[:at])
        out.append(vocab.tokens.index(c))
        rest = rest[at + len(c):]
    return out + ([vocab.eos_id] if add_special and vocab.add_eos else [])


class LlamaCppSpm:
    """llama.cpp's ``llama_vocab::impl::tokenize`` for an SPM vocabulary with special tokens
    parsed, transcribed to Python (slow: for short texts)."""

    def __init__(self, vocab: spm_vocab.SpmVocab):
        self.vocab = vocab
        self.ids = {t: i for i, t in enumerate(vocab.tokens)}
        self.scores = vocab.scores.tolist()
        self.special = sorted((i for i, ty in enumerate(vocab.types.tolist())
                               if ty in (spm_vocab.CONTROL, spm_vocab.USER_DEFINED, spm_vocab.UNKNOWN)),
                              key=lambda i: len(vocab.tokens[i]), reverse=True)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        vocab, ids, scores = self.vocab, self.ids, self.scores
        frags: list[str | int] = [text] if text else []
        for sid in self.special:  # tokenizer_st_partition: each special token, longest first
            s = vocab.tokens[sid]
            if not any(isinstance(f, str) and s in f for f in frags):
                continue
            out: list[str | int] = []
            for f in frags:
                while isinstance(f, str) and s in f:
                    at = f.index(s)
                    out += ([f[:at]] if at else []) + [sid]
                    f = f[at + len(s):]
                if not isinstance(f, str) or f:
                    out.append(f)
            frags = out
        result = [vocab.bos_id] if add_special and vocab.add_bos else []
        prev_special = True
        for f in frags:
            if isinstance(f, int):
                result.append(f)
                prev_special = True
                continue
            f = ((" " if vocab.add_space_prefix and prev_special else "") + f).replace(" ", "\u2581")
            prev_special = False
            syms = list(f)
            while True:  # the best-scored bigram that is a piece, leftmost among equals
                best, best_score = -1, 0.0
                for k in range(len(syms) - 1):
                    tid = ids.get(syms[k] + syms[k + 1])
                    if tid is not None and (best < 0 or scores[tid] > best_score):
                        best, best_score = k, scores[tid]
                if best < 0:
                    break
                syms[best:best + 2] = [syms[best] + syms[best + 1]]
            for s in syms:  # resegment: a piece, else its bytes
                result += [ids[s]] if s in ids else [ids[f"<0x{b:02X}>"] for b in s.encode("utf-8")]
        return result + ([vocab.eos_id] if add_special and vocab.add_eos else [])


def _vocab(path: str) -> spm_vocab.SpmVocab:
    return spm_vocab.vocab_from_metadata(spm_vocab.read_metadata(path))


# --------------------------------------------------------------------------- the tiny model's tests

def test_ids_equal_sentencepiece_and_llama_cpp_on_hostile_texts(tiny):
    style, sp, path, tok = tiny
    vocab = _vocab(path)
    ref = LlamaCppSpm(vocab)
    texts = HOSTILE + _random_texts(150, seed=5)
    for text in texts:
        want = ref.encode(text)
        assert tok.encode(text) == want, text
        assert tok.encode(text, add_special_tokens=False) == want[1:], text
        assert want == sp_reference(sp, vocab, text), text
    # the hard cases are really there: byte fallback, whitespace pieces, parsed control tokens
    ids = tok.encode("".join(HOSTILE))
    assert any(vocab.types[i] == spm_vocab.BYTE for i in ids)
    assert vocab.tokens.index("<start_of_turn>") in ids
    if style == "gemma":
        assert vocab.tokens.index("   ") in tok.encode("a   b")


def test_decode_round_trips_and_keeps_byte_fallback_whole(tiny):
    style, sp, path, tok = tiny
    vocab = _vocab(path)
    specials = [t for t, ty in zip(vocab.tokens, vocab.types) if ty in (spm_vocab.CONTROL, spm_vocab.UNKNOWN)]
    for text in HOSTILE + _random_texts(100, seed=6):
        ids = tok.encode(text, add_special_tokens=False)
        if style == "gemma":  # no space prefix: every text, control tokens included, comes back
            assert tok.decode(ids, skip_special_tokens=False) == text
            # both leave control pieces out; sentencepiece spells <unk> " ⁇ ", llama.cpp drops it
            assert tok.decode(ids) == sp.decode([i for i in ids if i != sp.unk_id()])
        elif not any(c in text for c in specials):  # llama.cpp puts a space after a control token
            assert tok.decode(ids) == text == sp.decode(ids)
    assert tok.decode(tok.encode("Hello")) == "Hello"
    assert tok.decode(tok.encode("Hello", add_special_tokens=False), continuation=True) == (
        " Hello" if style == "llama2" else "Hello")


def _stream(tok, ids: list[int]) -> tuple[list[str], str]:
    """``ids`` through the incremental detokenizer one token at a time: the text shown after each
    token, and the final text."""
    d = IncrementalDetokenizer(tok)
    shown = []
    for t in ids:
        d.add([t])
        shown.append(d.take()[0])
    d.finish()
    return shown, d.take()[0]


def test_streamed_text_equals_decode_and_never_shows_half_a_character(tiny):
    style, _, _, tok = tiny
    text = "".join(HOSTILE[16:30]) + " 東京😀👍🏽 done"
    ids = tok.encode(text, add_special_tokens=False)
    shown, final = _stream(tok, ids)
    assert final == tok.decode(ids, continuation=True)
    assert not any(s.endswith("\ufffd") for s in shown)
    assert all(final.startswith(s) for s in shown)
    # a character split into byte pieces stays hidden until its last byte
    emoji = [i for i in tok.encode("😀", add_special_tokens=False)]
    assert len(emoji) >= 4 and all(_vocab(tiny[2]).types[i] == spm_vocab.BYTE for i in emoji[-4:])


def test_bos_eos_and_space_prefix_follow_the_file(tiny, tmp_path):
    style, sp, path, tok = tiny
    user_defined = STYLES[style][1]
    no_bos = Tokenizer.load(_write_gguf(tmp_path / "nobos.gguf", sp, user_defined, add_bos=False,
                                        add_space_prefix=False if style == "gemma" else None))
    with_eos = Tokenizer.load(_write_gguf(tmp_path / "eos.gguf", sp, user_defined, add_eos=True,
                                          add_space_prefix=False if style == "gemma" else None))
    body = tok.encode("hello world", add_special_tokens=False)
    assert tok.encode("hello world") == [sp.bos_id()] + body
    assert no_bos.encode("hello world") == body
    assert with_eos.encode("hello world") == [sp.bos_id()] + body + [sp.eos_id()]
    assert tok.encode("") == [sp.bos_id()] and no_bos.encode("") == []
    assert len({tok.fingerprint, no_bos.fingerprint, with_eos.fingerprint}) == 3
    first = tok.decode([body[0]], continuation=True)
    assert first.startswith(" ") == (style == "llama2")  # the file's add_space_prefix


def test_fingerprint_covers_scores_types_and_byte_fallback(tiny, tmp_path):
    style, sp, path, tok = tiny
    user_defined = STYLES[style][1]
    prefix = False if style == "gemma" else None
    copy = tmp_path / "copy.gguf"
    shutil.copy(path, copy)
    assert Tokenizer.load(str(copy)).fingerprint == tok.fingerprint  # same vocabulary, any file
    last = sp.vocab_size() - 1
    variants = {
        "score": _write_gguf(tmp_path / "s.gguf", sp, user_defined, add_space_prefix=prefix,
                             score_of={last: sp.get_score(last) - 0.5}),
        "no byte fallback": _write_gguf(tmp_path / "b.gguf", sp, user_defined,
                                        add_space_prefix=prefix, drop_bytes=True),
        "space prefix": _write_gguf(tmp_path / "p.gguf", sp, user_defined,
                                    add_space_prefix=style == "gemma"),
    }
    fps = {name: Tokenizer.load(p).fingerprint for name, p in variants.items()}
    assert tok.fingerprint not in fps.values() and len(set(fps.values())) == len(fps)
    v = _vocab(path)
    types = v.types.copy()
    types[last] = spm_vocab.USER_DEFINED
    other = dataclasses.replace(v, types=types)
    assert other.digest() != v.digest()


def test_merges_cache_is_used_checked_and_rebuilt(tiny, tmp_path, monkeypatch):
    _, _, path, tok = tiny
    monkeypatch.setenv("HOTPREFIX_CACHE_DIR", str(tmp_path))
    calls = []
    real = spm_vocab.merges
    monkeypatch.setattr(spm_vocab, "merges", lambda v: calls.append(1) or real(v))
    texts = HOSTILE[:30]
    first = Tokenizer.load(path)
    (entry,) = (tmp_path / "tokenizers").iterdir()
    second = Tokenizer.load(path)
    assert len(calls) == 1  # derived once, then read back
    entry.write_bytes(entry.read_bytes()[:-40])  # damaged
    third = Tokenizer.load(path)
    assert len(calls) == 2 and entry.stat().st_size > 100
    for t in (first, second, third):
        assert [t.encode(x) for x in texts] == [tok.encode(x) for x in texts]
        assert t.fingerprint == tok.fingerprint


def test_base_model_has_no_chat_and_says_what_to_do(tiny):
    _, _, _, tok = tiny
    assert tok.chat_template is None
    with pytest.raises(TokenizerError, match="no chat template.*plain prompt"):
        tok.encode_chat([{"role": "user", "content": "hi"}])


def test_chat_template_from_the_file_is_used(tiny, tmp_path):
    style, sp, path, _ = tiny
    reader_md = spm_vocab.read_metadata(path)
    v = spm_vocab.vocab_from_metadata({**reader_md, "tokenizer.chat_template":
                                       "{% for m in messages %}<start_of_turn>{{ m['content'] }}"
                                       "<end_of_turn>{% endfor %}"})
    from hotprefix.text.tokenizer import _spm_tokenizer

    tok = Tokenizer(_spm_tokenizer(v), path)
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == v.tokens.index("<start_of_turn>") and ids[-1] == v.tokens.index("<end_of_turn>")
    assert tok.eos_token_ids >= {v.eos_id, v.tokens.index("<end_of_turn>")}


def test_a_chat_template_file_gives_a_base_model_a_chat(tiny, tmp_path):
    _, _, path, tok = tiny
    f = tmp_path / "chat.jinja"
    f.write_text("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
                 "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
    chat = Tokenizer.load(path, chat_template=str(f))
    ids = chat.encode_chat([{"role": "user", "content": "hi there"}])
    assert ids == tok.encode("<start_of_turn>user\nhi there<end_of_turn>\n<start_of_turn>model\n")
    assert chat.fingerprint != tok.fingerprint  # a template changes the namespace
    (tmp_path / "empty.jinja").write_text(" ")
    for bad in (tmp_path / "missing.jinja", tmp_path / "empty.jinja"):
        with pytest.raises(TokenizerError, match="chat template"):
            Tokenizer.load(path, chat_template=str(bad))


def test_a_vocabulary_it_cannot_build_exactly_is_refused_by_name():
    md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a", "b", "a"]}
    with pytest.raises(spm_vocab.VocabError, match="duplicate"):
        spm_vocab.vocab_from_metadata(md)
    assert spm_vocab.vocab_from_metadata({"tokenizer.ggml.model": "gpt2"}) is None
    bad = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a", "b"],
           "tokenizer.ggml.scores": [0.0]}
    with pytest.raises(spm_vocab.VocabError, match="scores"):
        spm_vocab.vocab_from_metadata(bad)


# --------------------------------------------------------------------------- the real Gemma 3 file

GEMMA_EXTRA = ["\u2581", "\u2581\u2581 x", "a \u2581b", "<bos>text<eos>", "<bos><bos>", "<pad>", "<mask>",
               "[multimodal]", "<table><tr><td>x</td></tr></table>", "<s>", "</s>", "<start_of_image>",
               "<unused5> x", "\u2581" * 31 + "z"]


@pytest.fixture(scope="module")
def gemma(gemma3_gguf_path):
    return gemma3_gguf_path, Tokenizer.load(gemma3_gguf_path), _vocab(gemma3_gguf_path)


GEMMA_TEXTS = HOSTILE + GEMMA_EXTRA + _random_texts(40, seed=9)


def test_gemma3_vocabulary_as_the_file_states_it(gemma):
    _, tok, vocab = gemma
    assert tok.vocab_size == len(vocab.tokens) == 262144
    assert (vocab.bos_id, vocab.eos_id, vocab.add_bos, vocab.add_space_prefix) == (2, 1, True, False)
    assert vocab.byte_fallback and tok.chat_template is None
    assert tok.eos_token_ids == {1, vocab.tokens.index("<end_of_turn>")}  # not the HTML tag </s>
    assert tok.encode("Hello")[0] == 2


def test_gemma3_ids_equal_llama_cpp_reference(gemma):
    _, tok, vocab = gemma
    ref = LlamaCppSpm(vocab)
    for text in GEMMA_TEXTS:
        want = ref.encode(text)
        assert tok.encode(text) == want, text
        assert tok.decode(want, skip_special_tokens=False) == "<bos>" + text.replace("\u2581", " ")


def _llama_tokenize() -> str | None:
    root = os.environ.get("PEER_DIR", os.path.expanduser("~/.cache/hotprefix-peers"))
    found = sorted(Path(root).glob("llama_cpp_python-*/vendor/llama.cpp/build/bin/llama-tokenize"))
    return str(found[-1]) if found else shutil.which("llama-tokenize")


def test_gemma3_ids_equal_llama_tokenize(gemma, tmp_path):
    """All texts in one ``llama-tokenize`` run, joined by a control token none of them holds:
    Gemma puts no space before a fragment, so llama.cpp tokenizes each text between two control
    tokens on its own."""
    exe = _llama_tokenize()
    if exe is None:
        pytest.skip("llama-tokenize not built (in the peer's tree: cmake --build build --target "
                    "llama-tokenize); the plain-Python llama.cpp reference test covers the same")
    path, tok, vocab = gemma
    sep = vocab.tokens[-1]
    assert vocab.types[-1] == spm_vocab.CONTROL and not any(sep in t for t in GEMMA_TEXTS)
    f = tmp_path / "texts.txt"
    f.write_bytes(sep.join(GEMMA_TEXTS).encode("utf-8"))
    run = subprocess.run([exe, "-m", path, "-bf", str(f), "--ids", "--no-escape", "--log-disable"],
                         capture_output=True, text=True, timeout=300, check=True)
    ids = json.loads(run.stdout.strip().splitlines()[-1])
    assert ids[0] == vocab.bos_id
    per_text, cur = [], []
    for i in ids[1:] + [len(vocab.tokens) - 1]:
        if i == len(vocab.tokens) - 1:
            per_text.append(cur)
            cur = []
        else:
            cur.append(i)
    assert len(per_text) == len(GEMMA_TEXTS)
    for text, want in zip(GEMMA_TEXTS, per_text):
        assert tok.encode(text, add_special_tokens=False) == want, text


# --------------------------------------------------------------------------- serving a base model

def _tiny_llama_dir(d: Path, vocab_size: int) -> str:
    """A 2-layer random Llama whose vocabulary is the tiny SentencePiece model's."""
    import torch
    from safetensors.torch import save_file

    h, inter, nh, nkv, layers = 32, 64, 4, 2, 2
    cfg = dict(hidden_size=h, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=nh,
               num_key_value_heads=nkv, max_position_embeddings=512, rms_norm_eps=1e-5,
               rope_theta=10000.0, tie_word_embeddings=True, model_type="llama",
               vocab_size=vocab_size, architectures=["LlamaForCausalLM"])
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    hd = h // nh
    w = {"model.embed_tokens.weight": torch.randn(vocab_size, h, generator=g) * 0.5,
         "model.norm.weight": torch.ones(h)}
    shapes = {"self_attn.q_proj": (nh * hd, h), "self_attn.k_proj": (nkv * hd, h),
              "self_attn.v_proj": (nkv * hd, h), "self_attn.o_proj": (h, nh * hd),
              "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h), "mlp.down_proj": (h, inter)}
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = w[p + "post_attention_layernorm.weight"] = torch.ones(h)
        for name, shape in shapes.items():
            w[p + name + ".weight"] = torch.randn(*shape, generator=g) * 0.2
    save_file({k: v.clone() for k, v in w.items()}, str(d / "model.safetensors"))
    return str(d)


@pytest.mark.parametrize("tiny", ["gemma"], indirect=True)  # one vocabulary style is enough for the server
def test_server_base_model_chat_is_a_400_completions_work_and_a_template_file_gives_a_chat(tiny, tmp_path):
    """No chat template: /v1/chat/completions refuses with a 400 that says what to send instead
    (never a 500, no template guessed); /v1/completions generates, streamed or not, and its text
    is the decode of its tokens."""
    import httpx

    from hotprefix.config.sections import EngineConfig
    from server_support import LiveServer

    style, sp, path, tok = tiny
    assert style == "gemma"
    model = _tiny_llama_dir(tmp_path / "model", sp.vocab_size())
    tok.save_json(os.path.join(model, "tokenizer.json"))  # the directory needs one; the GGUF's is used
    cfg = EngineConfig.from_options(model=model, tokenizer=path, kv_cache_memory="16MiB", num_threads=1)
    with LiveServer(cfg) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        r = http.post("/v1/chat/completions", json={"model": srv.model, "max_tokens": 4,
                                                   "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400, r.text
        assert "no chat template" in r.json()["error"]["message"]
        assert "--chat-template" in r.json()["error"]["message"]
        r = http.post("/v1/completions", json={"model": srv.model, "prompt": "hello  world 東京",
                                              "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["prompt_tokens"] == len(tok.encode("hello  world 東京"))
        assert body["usage"]["completion_tokens"] >= 1 and isinstance(body["choices"][0]["text"], str)
        with http.stream("POST", "/v1/completions", json={"model": srv.model, "prompt": "hello  world 東京",
                                                          "max_tokens": 6, "temperature": 0,
                                                          "stream": True}) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        streamed = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
        assert streamed == body["choices"][0]["text"]
        plain_fp = srv.state.engine.tokenizer_fingerprint
    template = tmp_path / "chat.jinja"  # --chat-template FILE gives the base model a chat
    template.write_text("{% for m in messages %}<start_of_turn>{{ m['content'] }}<end_of_turn>{% endfor %}"
                        "<start_of_turn>")
    cfg = EngineConfig.from_options(model=model, tokenizer=path, chat_template=str(template),
                                    kv_cache_memory="16MiB", num_threads=1)
    with LiveServer(cfg) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        r = http.post("/v1/chat/completions", json={"model": srv.model, "max_tokens": 3, "temperature": 0,
                                                   "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        want = tok.encode("<start_of_turn>hi<end_of_turn><start_of_turn>", add_special_tokens=False)
        assert r.json()["usage"]["prompt_tokens"] == len(want)  # the template's text, no BOS added
        assert srv.state.engine.tokenizer_fingerprint != plain_fp  # another namespace


def test_gemma3_streaming_equals_decode_on_random_ids_and_text(gemma):
    """Random ids from the whole vocabulary (byte pieces, control tokens, HTML tags, fragments) and
    a multilingual text's ids, streamed one token at a time: the final text is the one-shot
    decode, shown text only grows, and a text's stream never shows half a character."""
    _, tok, _ = gemma
    rng = random.Random(12)
    text_ids = tok.encode("".join(HOSTILE[16:24]) * 3, add_special_tokens=False)
    for ids, whole_chars in (([rng.randrange(tok.vocab_size) for _ in range(600)], False), (text_ids, True)):
        shown, final = _stream(tok, ids)
        assert final == tok.decode(ids, continuation=True)
        assert all(final.startswith(s) for s in shown)
        if whole_chars:
            assert not any(s.endswith("\ufffd") for s in shown) and "😀" in final


# --------------------------------------------------------------------------- without transformers

def _as_transformers(tok: Tokenizer) -> Tokenizer:
    """The same vocabulary through transformers' object (what every start used before)."""
    return Tokenizer(tok.hf, tok.source, None)


def _spm_observed(tok: Tokenizer, texts: list[str]) -> tuple:
    ids = [tok.encode(t) for t in texts]
    return (tok.fingerprint, tok.vocab_size, tok.eos_token_ids, tok.skipped_token_ids, ids,
            [tok.encode(t, add_special_tokens=False) for t in texts],
            [tok.decode(i, skip_special_tokens=s) for i in ids for s in (True, False)],
            [tok.decode(i[1:], continuation=True) for i in ids], [tok.convert_ids_to_tokens(i) for i in ids],
            tok.add_specials([5, 6]), tok.max_token_bytes, tok.byte_level)


def test_a_vocabulary_is_read_without_transformers_and_behaves_as_transformers_object(tiny, tmp_path):
    """Where transformers' class would leave the built backend as it is (a post-processor, every
    named special token an added one), the tokenizer is ``tokenizer_snapshot``'s object over it:
    the same ids, text, pieces, stop tokens and fingerprint as transformers' object, which a
    library still gets (``hf``); where it would change it (no BOS or EOS to add: it writes a
    post-processor), transformers' object, as before."""
    style, sp, path, tok = tiny
    assert isinstance(tok._tok, tokenizer_snapshot.SnapshotTokenizer)
    ref = _as_transformers(tok)
    assert type(tok.hf).__name__ == "SpmGgufTokenizer" and not tokenizer_snapshot.differences(tok.hf, tok._tok)
    texts = HOSTILE + _random_texts(20, seed=3)
    assert _spm_observed(tok, texts) == _spm_observed(ref, texts)
    no_bos = Tokenizer.load(_write_gguf(tmp_path / "nobos.gguf", sp, STYLES[style][1], add_bos=False,
                                        add_space_prefix=False if style == "gemma" else None))
    assert not isinstance(no_bos._tok, tokenizer_snapshot.SnapshotTokenizer)


def test_gemma3_is_read_without_transformers_and_behaves_as_transformers_object(gemma):
    path, tok, _ = gemma
    assert isinstance(tok._tok, tokenizer_snapshot.SnapshotTokenizer)
    code = (f"import sys; from hotprefix.text.tokenizer import Tokenizer; t = Tokenizer.load({path!r}); "
            "t.decode(t.encode('Hello <start_of_turn>user')); print('transformers' in sys.modules, t.fingerprint)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", tok.fingerprint]
    assert not tokenizer_snapshot.differences(tok.hf, tok._tok)
    texts = GEMMA_TEXTS[:40]
    assert _spm_observed(tok, texts) == _spm_observed(_as_transformers(tok), texts)
