"""SentencePiece vocabularies of GGUF files, built into the ``tokenizers`` library's BPE model.

A GGUF whose ``tokenizer.ggml.model`` is ``llama`` (Llama 2, Mistral, Gemma, ...) stores a
SentencePiece BPE vocabulary as three parallel arrays: the pieces (``▁`` for a space), a score per
piece and a token type per piece (normal, unknown, control, user-defined, unused, byte), plus the
BOS/EOS/UNK ids and the ``add_bos_token`` / ``add_eos_token`` / ``add_space_prefix`` flags. It has no
merges. llama.cpp tokenizes such a vocabulary (``llm_tokenizer_spm``) as SentencePiece's BPE does:

1. the text is cut at every control, unknown and user-defined piece (with special tokens parsed, as
   ``llama-tokenize`` and llama-server do); those pieces become their ids;
2. each remaining fragment gets a leading space if ``add_space_prefix`` is set, and its spaces
   become ``▁``;
3. starting from single characters, the adjacent pair whose concatenation is a piece with the
   highest score is merged, leftmost first among equal scores, until no pair is a piece;
4. a symbol that is not a piece becomes its UTF-8 bytes, ``<0xXX>`` (byte fallback).

Step 3 is a BPE whose merge ranks are the merged pieces' scores: every split ``(a, b)`` of a normal or
user-defined piece ``a + b`` into two pieces is a merge, ranked by the score of ``a + b`` (then by id).
``tokenizers`` runs exactly that (its ``BPE`` merges the best-ranked pair, leftmost among equals, and
falls back to ``<0xXX>`` bytes), so no Python runs per token. Known differences from SentencePiece, none
of which a vocabulary trained by SentencePiece exercises: two *different* pairs that overlap and yield
pieces of the same score are taken in rank order rather than leftmost first; a character that is not
itself a piece is byte-split before merging instead of after; and added pieces that overlap are
matched leftmost-longest (as SentencePiece does) rather than longest first (llama.cpp).

Byte pieces and control pieces are never merge results (SentencePiece's rule: the text ``<0x41>``
stays six characters and decodes back to itself). Decoding maps ``▁`` to a space and byte pieces to
their bytes; the leading space that ``add_space_prefix`` added is removed by ``Tokenizer.decode``, not
here, so a continuation's first space can be kept.

This module knows nothing about transformers, chat templates or the model's weights.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field

import numpy as np

from hotprefix.files.gguf_header import read_file_metadata

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
"""GGUF token types (``gguf.TokenType``; SentencePiece's ``ModelProto.SentencePiece.Type``)."""

BUILDER_VERSION = 1
"""Bumped whenever ``build`` would turn the same vocabulary into different ids or text: cached
builds (keyed with it) are then rebuilt."""

_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.scores",
         "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
         "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
         "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token",
         "tokenizer.ggml.add_space_prefix", "tokenizer.ggml.remove_extra_whitespaces",
         "tokenizer.chat_template", "general.architecture")


class VocabError(ValueError):
    """The file's metadata does not describe a SentencePiece vocabulary this module can build."""


@dataclass(frozen=True)
class SpmVocab:
    """A GGUF's SentencePiece vocabulary, as llama.cpp reads it."""

    tokens: list[str]
    """The pieces by id (``▁`` for a space; ``<0xXX>`` for byte pieces)."""
    scores: np.ndarray = field(repr=False)
    """float32 score per piece: a merge into a higher-scored piece is done first."""
    types: np.ndarray = field(repr=False)
    """int32 GGUF token type per piece (``NORMAL`` ... ``BYTE``)."""
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    """Encoding with special tokens starts with BOS (llama.cpp's default for this vocabulary type: true)."""
    add_eos: bool
    """Encoding with special tokens ends with EOS (default false)."""
    add_space_prefix: bool
    """A space is put before each text fragment (default true; Gemma files say false)."""
    chat_template: str | None
    architecture: str | None

    @property
    def byte_fallback(self) -> bool:
        """The vocabulary has byte pieces, so no text is ever unknown."""
        return bool(np.any(self.types == BYTE))

    @functools.cached_property
    def _utf8(self) -> list[bytes]:
        return [t.encode("utf-8") for t in self.tokens]

    def max_text_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes of text one piece stands for: its spelling's (``▁``,
        3 bytes, stands for a 1-byte space; ``<0xXX>`` for one byte)."""
        return max(map(len, self._utf8), default=1)

    def digest(self) -> str:
        """sha256 of everything that decides the ids a text becomes and the text ids become:
        pieces, scores, types, special ids and flags (the chat template is fingerprinted apart)."""
        h = hashlib.sha256()
        h.update(b"\0".join(self._utf8))
        h.update(np.ascontiguousarray(self.scores, dtype="<f4").tobytes())
        h.update(np.ascontiguousarray(self.types, dtype="<i4").tobytes())
        h.update(json.dumps({"bos": self.bos_id, "eos": self.eos_id, "unk": self.unk_id,
                             "pad": self.pad_id, "add_bos": self.add_bos, "add_eos": self.add_eos,
                             "add_space_prefix": self.add_space_prefix,
                             "byte_fallback": self.byte_fallback, "builder": BUILDER_VERSION},
                            sort_keys=True).encode())
        return h.hexdigest()


# --------------------------------------------------------------------------- reading the file

def read_metadata(path: str, keys: tuple[str, ...] = _KEYS) -> dict:
    """The named metadata keys of a GGUF file (``files.gguf_header.read_file_metadata``).

    Raises:
        VocabError: not a GGUF file this reader understands.
    """
    try:
        return read_file_metadata(path, keys)
    except ValueError as e:
        raise VocabError(str(e)) from None


def vocab_from_metadata(md: dict) -> SpmVocab | None:
    """The SentencePiece vocabulary the metadata describes; None for another tokenizer model.

    Raises:
        VocabError: a ``llama`` vocabulary this module cannot build exactly (missing or ragged
            arrays, duplicate pieces, an option llama.cpp applies that is not built here).
    """
    if md.get("tokenizer.ggml.model") != "llama":
        return None
    tokens = md.get("tokenizer.ggml.tokens")
    if not tokens:
        raise VocabError("no tokenizer.ggml.tokens")
    n = len(tokens)
    scores = md.get("tokenizer.ggml.scores")
    scores = np.zeros(n, np.float32) if scores is None else np.asarray(scores, np.float32)
    types = md.get("tokenizer.ggml.token_type")
    types = np.full(n, NORMAL, np.int32) if types is None else np.asarray(types, np.int32)
    if len(scores) != n or len(types) != n:
        raise VocabError(f"{n} pieces but {len(scores)} scores and {len(types)} token types")
    if len(set(tokens)) != n:
        raise VocabError("the vocabulary has duplicate pieces")
    if md.get("tokenizer.ggml.remove_extra_whitespaces"):
        raise VocabError("remove_extra_whitespaces is not supported")

    def tid(key: str) -> int | None:
        v = md.get(f"tokenizer.ggml.{key}")
        return int(v) if v is not None and 0 <= int(v) < n else None

    def flag(key: str, default: bool) -> bool:
        v = md.get(f"tokenizer.ggml.{key}")
        return default if v is None else bool(v)

    unk = tid("unknown_token_id")
    if unk is None:  # llama.cpp's default for this vocabulary type
        unk = 0 if n and types[0] == UNKNOWN else None
    return SpmVocab(tokens=list(tokens), scores=scores, types=types, bos_id=tid("bos_token_id"),
                    eos_id=tid("eos_token_id"), unk_id=unk, pad_id=tid("padding_token_id"),
                    add_bos=flag("add_bos_token", True), add_eos=flag("add_eos_token", False),
                    add_space_prefix=flag("add_space_prefix", True),
                    chat_template=md.get("tokenizer.chat_template") or None,
                    architecture=md.get("general.architecture"))


# --------------------------------------------------------------------------- building

def merges(vocab: SpmVocab) -> list[tuple[str, str]]:
    """Every split of a normal or user-defined piece into two pieces, best-scored result first
    (ties by the result's id): SentencePiece's BPE as ``tokenizers`` merge ranks."""
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    mergeable = (vocab.types == NORMAL) | (vocab.types == USER_DEFINED)
    targets = np.nonzero(mergeable)[0]
    order = targets[np.lexsort((targets, -vocab.scores[targets].astype(np.float64)))]
    out: list[tuple[str, str]] = []
    tokens = vocab.tokens
    for i in order.tolist():
        t = tokens[i]
        for k in range(1, len(t)):
            a = t[:k]
            if a in ids:
                b = t[k:]
                if b in ids:
                    out.append((a, b))
    return out


def build(vocab: SpmVocab, merge_list: list[tuple[str, str]] | None = None):
    """A ``tokenizers.Tokenizer`` that gives llama.cpp's ids for this vocabulary (special tokens
    parsed; BOS/EOS by the file's flags when encoding with special tokens).

    Args:
        merge_list: ``merges(vocab)``, when the caller has it already (it takes seconds to derive).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE

    tokens = vocab.tokens
    unk = tokens[vocab.unk_id] if vocab.unk_id is not None else None
    model = BPE({t: i for i, t in enumerate(tokens)},
                merges(vocab) if merge_list is None else merge_list, unk_token=unk,
                fuse_unk=True, byte_fallback=vocab.byte_fallback)
    tok = Tokenizer(model)
    steps = [normalizers.Prepend("\u2581")] if vocab.add_space_prefix else []
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "\u2581")])
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    types = vocab.types.tolist()
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, ty in enumerate(types) if ty in (CONTROL, UNKNOWN)])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i, ty in enumerate(types) if ty == USER_DEFINED])
    single, special = "$A:0", []
    if vocab.add_bos and vocab.bos_id is not None:
        single = f"{tokens[vocab.bos_id]}:0 {single}"
        special.append((tokens[vocab.bos_id], vocab.bos_id))
    if vocab.add_eos and vocab.eos_id is not None:
        single = f"{single} {tokens[vocab.eos_id]}:0"
        special.append((tokens[vocab.eos_id], vocab.eos_id))
    if special:
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=f"{single} {single.replace('$A', '$B').replace(':0', ':1')}",
            special_tokens=special)
    return tok
