"""Tokenizer, chat template and tokenizer fingerprint.

Loads the tokenizer that belongs to the model (GGUF metadata, or tokenizer.json in a Hugging Face
directory) through ``transformers``/``tokenizers``. A GGUF's SentencePiece vocabulary (Llama 2,
Mistral, Gemma) is built by ``hotprefix.text.spm_vocab`` into the ``tokenizers`` library's BPE model,
giving llama.cpp's ids; other GGUF vocabularies through transformers' GGUF support, built once and
read back after from a snapshot of transformers' object. Neither imports transformers at a start
(``tokenizer_snapshot``; templates render through ``chat_template``); a library that needs
transformers' own object (llguidance) gets it on first use (``Tokenizer.hf``). The fingerprint
covers everything that decides which token ids a text becomes: vocabulary, merges (for a
SentencePiece vocabulary: its pieces, scores, token types, byte fallback and flags), normalizer and
pre-tokenizer, added/special tokens, BOS/EOS handling and the chat template. It is part of the
prefix cache's namespace, so a tokenizer change can never hit blocks cached under the old one.

A model without a chat template (a base model) has no chat: ``render_chat`` refuses with a
``TokenizerError`` (the server's 400) that says to send a plain prompt; no template is guessed
(not even the family's: a guess would silently decide the prompt's tokens). A template file given
to ``Tokenizer.load(path, chat_template=...)`` is used instead of the tokenizer's own, and
fingerprinted.

This module knows nothing about the model's weights or the KV cache.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
from importlib import metadata
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from hotprefix.text import spm_vocab, tokenizer_snapshot
from hotprefix.text.prefix_tokens import PrefixTokens, splits_at_specials
from hotprefix.files.atomic import atomic_path
from hotprefix.files.cachedir import cache_dir
from hotprefix.files.gguf_reads import fast_gguf_reads

log = logging.getLogger(__name__)


class TokenizerError(ValueError):
    """The tokenizer could not be loaded or a chat template could not be applied."""


def _offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _quiet_hf() -> None:
    """Called before transformers is used: importing it takes 0.4-0.6 s, so only where needed."""
    from transformers.utils import logging as hf_logging

    _offline()
    hf_logging.set_verbosity_error()


PREFIX_MAX_SPECIALS = 16
"""Most special tokens a remembered prefix may end at (each one probed at load)."""

END_OF_TURN_NAMES = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "</s>", "<|end|>", "<end_of_turn>")
"""Tokens that end generation beside the file's EOS wherever the vocabulary has them (llama.cpp's
end-of-generation set names the same ones)."""


def _spm_merges(vocab: spm_vocab.SpmVocab, digest: str) -> list[tuple[str, str]]:
    """The vocabulary's merges, derived once (2 s for 262k pieces) and kept under the cache
    directory as id pairs keyed by the vocabulary's digest (so every file with this vocabulary
    shares them, and a changed vocabulary never reads another's). An entry that is unreadable or
    fails its checksum is rebuilt; one that cannot be written is passed over."""
    saved = cache_dir("tokenizers") / f"spm-{digest[:32]}.npz"
    tokens = np.array(vocab.tokens, dtype=object)
    try:
        with np.load(saved) as z:
            pairs, check = z["pairs"], bytes(z["sha256"])
        if (check == hashlib.sha256(pairs.tobytes()).digest() and pairs.ndim == 2
                and pairs.shape[1] == 2 and (pairs.size == 0 or int(pairs.max()) < len(tokens))):
            return list(zip(tokens[pairs[:, 0]].tolist(), tokens[pairs[:, 1]].tolist()))
        log.warning("cached merges %s fail their checksum: rebuilt", saved)
    except FileNotFoundError:
        pass
    except Exception as e:  # a damaged entry: rebuilt below
        log.warning("cached merges %s unreadable (%s): rebuilt", saved, e)
    merges = spm_vocab.merges(vocab)
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    pairs = np.array([(ids[a], ids[b]) for a, b in merges], dtype=np.int32).reshape(-1, 2)
    try:
        saved.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(saved) as tmp, open(tmp, "wb") as f:  # whole or not at all
            np.savez(f, pairs=pairs, sha256=np.frombuffer(hashlib.sha256(pairs.tobytes()).digest(),
                                                          dtype=np.uint8))
    except Exception as e:  # not writable, disk full
        log.info("merges not cached (%s)", e)
    return merges


def _spm_ids(vocab: spm_vocab.SpmVocab) -> dict[str, int]:
    """The vocabulary's named special tokens' ids (transformers' names), those it has."""
    return {name: i for name, i in (("bos_token", vocab.bos_id), ("eos_token", vocab.eos_id),
                                    ("unk_token", vocab.unk_id), ("pad_token", vocab.pad_id))
            if i is not None}


def _spm_extras(vocab: spm_vocab.SpmVocab, digest: str) -> dict[str, Any]:
    """What a SentencePiece tokenizer object carries for ``Tokenizer``, as ``hotprefix_*``
    attributes: ``vocab_digest`` (fingerprinted instead of the 30 MB tokenizer JSON, which it
    decides), ``strips_space_prefix`` (``decode`` removes the space ``add_space_prefix`` put before
    the text), ``control_ids`` (only these may end a turn: Gemma's ``</s>`` is an HTML tag, not an
    EOS), ``max_token_bytes``."""
    return {"vocab_digest": digest, "strips_space_prefix": vocab.add_space_prefix,
            "control_ids": frozenset(np.nonzero(vocab.types == spm_vocab.CONTROL)[0].tolist()),
            "max_token_bytes": vocab.max_text_bytes()}


@functools.cache
def _spm_class() -> type:
    _quiet_hf()
    from transformers import PreTrainedTokenizerFast

    class SpmGgufTokenizer(PreTrainedTokenizerFast):
        """transformers' tokenizer interface over a ``tokenizers.Tokenizer`` that ``spm_vocab``
        built (handed over as model tokenizers do theirs: ``tokenizer_object=`` would copy it
        through JSON, 3 s for 262k pieces)."""

        def __init__(self, backend: Any, vocab: spm_vocab.SpmVocab, digest: str):
            self._tokenizer = backend
            super().__init__(**{name: vocab.tokens[i] for name, i in _spm_ids(vocab).items()},
                             clean_up_tokenization_spaces=False)
            self._add_bos_token, self._add_eos_token = vocab.add_bos, vocab.add_eos
            if vocab.chat_template:
                self.chat_template = vocab.chat_template
            for name, value in _spm_extras(vocab, digest).items():
                setattr(self, "hotprefix_" + name, value)

    return SpmGgufTokenizer


def _spm_tokenizer(vocab: spm_vocab.SpmVocab) -> Any:
    """The vocabulary's tokenizer, without importing transformers where its class would leave the
    backend as built (every named special token an added token, and a post-processor: then it
    only reads it); transformers' object, over the same backend, when a library asks for it."""
    digest = vocab.digest()
    backend = spm_vocab.build(vocab, _spm_merges(vocab, digest))
    make = lambda: _spm_class()(backend, vocab, digest)  # noqa: E731
    ids = _spm_ids(vocab)
    named = {name: vocab.tokens[i] for name, i in ids.items()}
    added = {str(t) for t in backend.get_added_tokens_decoder().values()}
    if backend.post_processor is None or not set(named.values()) <= added:
        return make()
    snap = {"format": tokenizer_snapshot.FORMAT, "special_tokens_map": named,
            "all_special_tokens": list(dict.fromkeys(named.values())),
            "add_bos_token": vocab.add_bos, "add_eos_token": vocab.add_eos,
            "chat_template": vocab.chat_template or None, "ids": ids,
            "hotprefix": _spm_extras(vocab, digest)}
    return tokenizer_snapshot.SnapshotTokenizer(snap, make, backend)


def _gguf_tokenizer(path: str) -> Any:
    """A GGUF file's tokenizer: a SentencePiece vocabulary built here (``spm_vocab``), any other
    one by transformers. A SentencePiece vocabulary this module cannot build exactly (duplicate
    pieces, ``remove_extra_whitespaces``) is logged and left to transformers too."""
    try:  # the tokenizer's model first: a BPE vocabulary's pieces are not read here (30 ms)
        spm = spm_vocab.read_metadata(path, ("tokenizer.ggml.model",)).get("tokenizer.ggml.model")
        vocab = (spm_vocab.vocab_from_metadata(spm_vocab.read_metadata(path)) if spm == "llama"
                 else None)
    except spm_vocab.VocabError as e:
        log.warning("%s: %s; its tokenizer is built by transformers", path, e)
        vocab = None
    if vocab is not None:
        return _spm_tokenizer(vocab)
    return _transformers_gguf_tokenizer(path)


def _transformers_gguf_tokenizer(path: str, snapshot: bool = True) -> Any:
    """A GGUF file's tokenizer by transformers. transformers builds it from the file's metadata in seconds (every
    token and merge parsed in Python), so the result is saved once per file under the cache
    directory (keyed by the file's path, size and modification time and the transformers version)
    and loaded from there afterwards, in a fraction of a second; with the save, a snapshot of the
    built object (``tokenizer_snapshot``) that later starts read without importing transformers. A
    cache that cannot be written or read is passed over: the tokenizer is then built from the file."""
    st = os.stat(path)
    ident = f"{os.path.realpath(path)}\0{st.st_size}\0{st.st_mtime_ns}\0{metadata.version('transformers')}"
    saved = cache_dir("tokenizers") / hashlib.sha256(ident.encode()).hexdigest()[:16]
    if saved.is_dir() and snapshot:
        light = tokenizer_snapshot.load(saved, functools.partial(_saved_or_rebuilt, saved, path))
        if light is not None:
            return light
    tok = _read_save(saved, path) if saved.is_dir() else None
    if tok is not None:
        if snapshot:
            tokenizer_snapshot.keep(tok, saved)
        return tok
    _quiet_hf()
    from transformers import AutoTokenizer

    with fast_gguf_reads():  # gguf's reader over a plain array: 2.8 -> 0.8 s for a 49k vocabulary
        tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                            gguf_file=os.path.basename(path))
    try:
        saved.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(saved, directory=True, replace=False) as tmp:  # whole or not at all
            tok.save_pretrained(tmp)
    except Exception as e:  # not writable, disk full, or another process saved it first
        log.info("tokenizer not cached (%s)", e)
    else:
        if snapshot:
            tokenizer_snapshot.keep(tok, saved)
    return tok


def _saved_or_rebuilt(saved: Path, path: str) -> Any:
    """transformers' object for a snapshot read from ``saved``, when a library asks for it: that
    save (the same file as the snapshot, even if ``path`` changed since), or, where it is damaged,
    built from ``path`` again as a start without the snapshot would."""
    tok = _read_save(saved, path)
    return tok if tok is not None else _transformers_gguf_tokenizer(path, snapshot=False)


def _read_save(saved: Path, path: str) -> Any | None:
    """The tokenizer saved in ``saved``, or None where that save is damaged (logged, and removed:
    the caller builds it from ``path`` again)."""
    try:
        return _load_saved(saved)
    except Exception as e:
        log.warning("cached tokenizer %s unreadable (%s): reading %s", saved, e, path)
        shutil.rmtree(saved, ignore_errors=True)
        return None


def _load_saved(saved: Path) -> Any:
    """A tokenizer this module saved (``_transformers_gguf_tokenizer``): the class its config names,
    by the generic fast class where it is that one (the same object ``AutoTokenizer`` gives)."""
    _quiet_hf()
    with open(saved / "tokenizer_config.json", encoding="utf-8") as f:
        cls = json.load(f).get("tokenizer_class")
    if cls in tokenizer_snapshot.GENERIC_CLASSES:  # loaded by that class, not through
        # ``AutoTokenizer``, whose class lookup costs ~0.3 s
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(saved))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(saved))


class Tokenizer:
    """Text <-> token ids, chat templating, and a stable fingerprint."""

    def __init__(self, hf_tokenizer: Any, source: str, chat_template: str | None = None):
        """Args:
            chat_template: a Jinja chat template used instead of the tokenizer's own (how a base
                model gets a chat); it is fingerprinted like the tokenizer's own.
        """
        self._tok = hf_tokenizer
        self.source = source
        self.vocab_size = len(hf_tokenizer)
        if chat_template:
            hf_tokenizer.chat_template = chat_template
        self.chat_template: str | None = getattr(hf_tokenizer, "chat_template", None)
        eos = set()
        if hf_tokenizer.eos_token_id is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        control = getattr(hf_tokenizer, "hotprefix_control_ids", None)
        for name in END_OF_TURN_NAMES:
            tid = hf_tokenizer.convert_tokens_to_ids(name)
            if isinstance(tid, int) and tid != hf_tokenizer.unk_token_id and tid >= 0 and (
                    control is None or tid in control):
                eos.add(tid)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self._strips_space_prefix = bool(getattr(hf_tokenizer, "hotprefix_strips_space_prefix", False))
        self.fingerprint = self._fingerprint()
        self._prefixes = self._prefix_cache()
        """Ids of remembered prefixes per scope (``prefix_tokens``), or None where the
        tokenizer's ids do not split at its special tokens."""
        self.max_token_bytes = getattr(hf_tokenizer, "hotprefix_max_token_bytes", None) or max(
            (len(piece.encode("utf-8", "surrogatepass")) for piece in hf_tokenizer.get_vocab()),
            default=1)
        """Most UTF-8 bytes of text one token can stand for (an upper bound: byte-level pieces are
        spelled with 1-2 byte characters). Text longer than ``n * max_token_bytes`` bytes cannot
        fit in ``n`` tokens, so it can be refused without tokenizing it."""

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, path: str, chat_template: str | None = None) -> "Tokenizer":
        """Load from a GGUF file, a HF directory, or a tokenizer.json file.

        Args:
            chat_template: path of a Jinja chat template file to use instead of the tokenizer's
                own (vLLM's ``--chat-template``); None keeps the tokenizer's (or none).
        Raises:
            TokenizerError: the path does not exist or holds no usable tokenizer, or the chat
                template file cannot be read.
        """
        template = None
        if chat_template:
            try:
                with open(chat_template, encoding="utf-8") as f:
                    template = f.read()
            except (OSError, UnicodeDecodeError) as e:
                raise TokenizerError(f"chat template {chat_template!r} unreadable: {e}") from None
            if not template.strip():
                raise TokenizerError(f"chat template {chat_template!r} is empty")
        _offline()
        if not os.path.exists(path):
            raise TokenizerError(f"tokenizer source not found: {path}")
        try:
            if path.endswith(".gguf"):
                tok = _gguf_tokenizer(path)
            elif os.path.isdir(path):
                _quiet_hf()
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(path)
            elif path.endswith(".json"):
                _quiet_hf()
                from transformers import PreTrainedTokenizerFast

                tok = PreTrainedTokenizerFast(tokenizer_file=path)
                cfg_path = os.path.join(os.path.dirname(path), "tokenizer_config.json")
                if os.path.exists(cfg_path):
                    with open(cfg_path) as f:
                        cfg = json.load(f)
                    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
                        val = cfg.get(key)
                        if isinstance(val, dict):
                            val = val.get("content")
                        if val:
                            setattr(tok, key, val)
                    if cfg.get("chat_template"):
                        tok.chat_template = cfg["chat_template"]
            else:
                raise TokenizerError(f"unsupported tokenizer source {path!r}: expected a .gguf file, "
                                     "a tokenizer.json or a Hugging Face directory")
        except TokenizerError:
            raise
        except Exception as e:  # transformers raises many kinds; give one clear message
            raise TokenizerError(f"could not load a tokenizer from {path}: {e}") from e
        return cls(tok, path, template)

    @property
    def hf(self) -> Any:
        """The Hugging Face tokenizer object (for libraries that read it, e.g. llguidance); a
        snapshot's (``tokenizer_snapshot``) is loaded by transformers on first use."""
        if isinstance(self._tok, tokenizer_snapshot.SnapshotTokenizer):
            return self._tok.transformers()
        return self._tok

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        """The vocabulary's pieces of ``token_ids`` (``Ġworld``, not the text)."""
        return list(self._tok.convert_ids_to_tokens(list(token_ids)))

    @functools.cached_property
    def byte_level(self) -> bool:
        """Whether the pieces spell bytes (a byte-level BPE decoder), not text."""
        decoder = getattr(getattr(self._tok, "backend_tokenizer", None), "decoder", None)
        return type(decoder).__name__ == "ByteLevel"

    # ------------------------------------------------------------------ encode / decode
    def encode(self, text: str, add_special_tokens: bool = True, scope: str | None = None) -> list[int]:
        """The text's ids. ``scope`` (a tenant's salt; ``""`` for a single user): start from a
        prefix this scope's earlier texts tokenized (``prefix_tokens``: the same ids, only the
        new text is tokenized); None: no cache."""
        if scope is not None and self._prefixes is not None:
            return self._prefixes.encode(text, add_special_tokens, scope)
        return self._encode(text, add_special_tokens)

    @property
    def prefix_hits(self) -> int:
        """Encodes that started from a remembered prefix (``encode``'s ``scope``); 0 without the
        cache."""
        return self._prefixes.hits if self._prefixes is not None else 0

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def _prefix_cache(self) -> PrefixTokens | None:
        """The prefix cache over this tokenizer's special tokens, where its ids split at them
        (``prefix_tokens.splits_at_specials``), else None."""
        added = getattr(self._tok, "added_tokens_decoder", None) or {}
        specials = {str(t): int(i) for i, t in added.items()
                    if getattr(t, "special", False) and str(t)}
        # the boundaries: the special tokens the chat template writes (turn markers), and the
        # end-of-turn names; each one checked (a vocabulary may hold thousands of unused ones)
        template = self.chat_template or ""
        wanted = {s: i for s, i in specials.items() if s in template or s in END_OF_TURN_NAMES}
        wanted = dict(list(wanted.items())[:PREFIX_MAX_SPECIALS])
        try:
            if not wanted or not splits_at_specials(self._encode, list(wanted)):
                return None
        except Exception:  # a tokenizer that cannot encode the probes: no cache
            return None
        return PrefixTokens(self._encode, wanted)

    def add_specials(self, token_ids: Sequence[int]) -> list[int]:
        """``token_ids`` inside the special tokens this tokenizer's ``encode`` puts around a text
        (a BOS, for most): the tokenizer's own ``build_inputs_with_special_tokens`` where it has
        one, else what it adds around an empty text."""
        build = getattr(self._tok, "build_inputs_with_special_tokens", None)
        if build is not None:
            return list(build(list(token_ids)))
        empty = self.encode("", add_special_tokens=True)
        pre = empty[:1] if empty[:1] == [self._tok.bos_token_id] else []
        post = [t for t in empty[len(pre):] if t == self._tok.eos_token_id]
        return pre + list(token_ids) + post

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True,
               continuation: bool = False) -> str:
        """The text of ``token_ids``.

        Args:
            skip_special_tokens: leave control tokens (BOS, EOS, turn markers) out of the text.
            continuation: the ids follow other text (a model's output after its prompt): the
                space a SentencePiece ``add_space_prefix`` vocabulary puts before a text's first
                word is text here, not removed as at the start of a text. No effect otherwise.
        """
        text = self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        if self._strips_space_prefix and not continuation and text.startswith(" "):
            text = text[1:]
        return text

    @functools.cached_property
    def skipped_token_ids(self) -> frozenset[int]:
        """Special tokens that ``decode`` leaves out of the text: wherever they stand, they add no
        text, so an incremental detokenizer may drop them before decoding."""
        added = getattr(self._tok, "added_tokens_decoder", None) or {}
        return frozenset(int(i) for i, t in added.items()
                         if getattr(t, "special", False) and self.decode([i]) == "")

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> str:
        """The chat template applied to OpenAI-style messages (and ``tools``, for a template that
        renders them: ``renders_tools``), as text."""
        if not self.chat_template:
            raise TokenizerError(
                "this model has no chat template (a base model, or a file that carries none), so it "
                "has no chat: send the text as a plain prompt (/v1/completions, LLM.generate, "
                "`hotprefix generate --raw`), or give it a template (--chat-template FILE)")
        try:
            return self._tok.apply_chat_template(messages, tokenize=False, tools=tools or None,
                                                 add_generation_prompt=add_generation_prompt)
        except Exception as e:
            raise TokenizerError(f"could not apply the chat template: {e}") from e

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, scope: str | None = None) -> list[int]:
        """The rendered conversation's ids (``scope``: as ``encode``'s)."""
        # The template already contains any BOS/special tokens it wants.
        return self.encode(self.render_chat(messages, add_generation_prompt, tools),
                           add_special_tokens=False, scope=scope)

    @functools.cached_property
    def renders_tools(self) -> bool:
        """Whether the chat template renders a ``tools`` list (a probe function's name shows up in
        the text); when not, the server describes the tools itself (``hotprefix.server.tools``)."""
        probe = "hotprefix_probe_fn_7f3a"
        tools = [{"type": "function", "function": {"name": probe, "parameters": {"type": "object"}}}]
        try:
            return probe in self.render_chat([{"role": "user", "content": "x"}], tools=tools)
        except TokenizerError:
            return False

    # ------------------------------------------------------------------ fingerprint
    def _fingerprint(self) -> str:
        h = hashlib.sha256()
        backend = getattr(self._tok, "backend_tokenizer", None)
        digest = getattr(self._tok, "hotprefix_vocab_digest", None)
        if digest is not None:  # a SentencePiece GGUF vocabulary: what its tokenizer is built from
            h.update(f"spm-gguf\0{digest}\0".encode())
        elif backend is not None:
            h.update(backend.to_str().encode())
        else:  # slow tokenizer: vocab is the best we have
            h.update(json.dumps(sorted(self._tok.get_vocab().items())).encode())
        meta = {
            "bos": self._tok.bos_token_id, "eos": self._tok.eos_token_id,
            "add_bos": getattr(self._tok, "add_bos_token", None),
            "add_eos": getattr(self._tok, "add_eos_token", None),
            "special": sorted(str(t) for t in self._tok.all_special_tokens),
            "chat_template": self.chat_template or "",
        }
        h.update(json.dumps(meta, sort_keys=True, default=str).encode())
        return h.hexdigest()[:16]

    def save_json(self, path: str) -> None:
        """Write tokenizer.json (+ tokenizer_config.json with the chat template) beside it."""
        backend = self._tok.backend_tokenizer
        backend.save(path)
        cfg = {"bos_token": self._tok.bos_token, "eos_token": self._tok.eos_token,
               "chat_template": self.chat_template}
        with open(os.path.join(os.path.dirname(path), "tokenizer_config.json"), "w") as f:
            json.dump(cfg, f)
