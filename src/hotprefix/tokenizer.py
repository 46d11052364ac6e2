"""Tokenizer, chat template and tokenizer fingerprint.

Loads the tokenizer that belongs to the model (GGUF metadata, or tokenizer.json in a Hugging Face
directory) through ``transformers``/``tokenizers``. The fingerprint covers everything that decides
which token ids a text becomes: vocabulary, merges, normalizer and pre-tokenizer, added/special
tokens, BOS/EOS handling and the chat template. It is part of the prefix cache's namespace, so a
tokenizer change can never hit blocks cached under the old one.

This module knows nothing about the model's weights or the KV cache.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from typing import Any, Sequence

from transformers.utils import logging as hf_logging

from hotprefix.cachedir import cache_dir

log = logging.getLogger(__name__)


class TokenizerError(ValueError):
    """The tokenizer could not be loaded or a chat template could not be applied."""


def _quiet_hf() -> None:
    hf_logging.set_verbosity_error()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _gguf_tokenizer(path: str) -> Any:
    """A GGUF file's tokenizer. transformers builds it from the file's metadata in seconds (every
    token and merge parsed in Python), so the result is saved once per file under the cache
    directory (keyed by the file's path, size and modification time and the transformers version)
    and loaded from there afterwards, in a fraction of a second. A cache that cannot be written or
    read is passed over: the tokenizer is then built from the file."""
    from transformers import AutoTokenizer
    from transformers import __version__ as hf_version

    st = os.stat(path)
    ident = f"{os.path.realpath(path)}\0{st.st_size}\0{st.st_mtime_ns}\0{hf_version}"
    saved = cache_dir("tokenizers") / hashlib.sha256(ident.encode()).hexdigest()[:16]
    if saved.is_dir():
        try:
            return AutoTokenizer.from_pretrained(str(saved))
        except Exception as e:  # a damaged entry: rebuilt from the file below
            log.warning("cached tokenizer %s unreadable (%s): reading %s", saved, e, path)
            shutil.rmtree(saved, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                        gguf_file=os.path.basename(path))
    tmp = None
    try:
        saved.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=saved.parent)
        tok.save_pretrained(tmp)
        os.rename(tmp, saved)  # whole or not at all
        tmp = None
    except Exception as e:  # not writable, disk full, or another process saved it first
        log.info("tokenizer not cached (%s)", e)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return tok


class Tokenizer:
    """Text <-> token ids, chat templating, and a stable fingerprint."""

    def __init__(self, hf_tokenizer: Any, source: str):
        self._tok = hf_tokenizer
        self.source = source
        self.vocab_size = len(hf_tokenizer)
        self.chat_template: str | None = getattr(hf_tokenizer, "chat_template", None)
        eos = set()
        if hf_tokenizer.eos_token_id is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        for name in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "</s>", "<|end|>"):
            tid = hf_tokenizer.convert_tokens_to_ids(name)
            if isinstance(tid, int) and tid != hf_tokenizer.unk_token_id and tid >= 0:
                eos.add(tid)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.fingerprint = self._fingerprint()
        vocab = hf_tokenizer.get_vocab()
        self.max_token_bytes = max((len(piece.encode("utf-8", "surrogatepass")) for piece in vocab),
                                   default=1)
        """Most UTF-8 bytes of text one token can stand for (an upper bound: byte-level pieces are
        spelled with 1-2 byte characters). Text longer than ``n * max_token_bytes`` bytes cannot
        fit in ``n`` tokens, so it can be refused without tokenizing it."""

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, path: str) -> "Tokenizer":
        """Load from a GGUF file, a HF directory, or a tokenizer.json file.

        Raises:
            TokenizerError: the path does not exist or holds no usable tokenizer.
        """
        _quiet_hf()
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        if not os.path.exists(path):
            raise TokenizerError(f"tokenizer source not found: {path}")
        try:
            if path.endswith(".gguf"):
                tok = _gguf_tokenizer(path)
            elif os.path.isdir(path):
                tok = AutoTokenizer.from_pretrained(path)
            elif path.endswith(".json"):
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
        return cls(tok, path)

    @property
    def hf(self) -> Any:
        """The Hugging Face tokenizer object (for libraries that read it, e.g. llguidance)."""
        return self._tok

    # ------------------------------------------------------------------ encode / decode
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

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
            raise TokenizerError("this model's tokenizer has no chat template; use a plain prompt")
        try:
            return self._tok.apply_chat_template(messages, tokenize=False, tools=tools or None,
                                                 add_generation_prompt=add_generation_prompt)
        except Exception as e:
            raise TokenizerError(f"could not apply the chat template: {e}") from e

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        # The template already contains any BOS/special tokens it wants.
        return self.encode(self.render_chat(messages, add_generation_prompt, tools),
                           add_special_tokens=False)

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
        if backend is not None:
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
