"""A tokenizer that transformers built, kept as the state its behaviour depends on and read back
without importing transformers.

Importing transformers takes 0.4-0.6 s of every start (it scans its 1,700 model files at import);
a 1B model is otherwise ready in about 2 s. A GGUF file's byte-level BPE vocabulary (Llama 3,
Qwen, SmolLM2) is built by transformers once and saved (``tokenizer._transformers_gguf_tokenizer``);
beside that save this module keeps a snapshot of the built object: its backend (the
``tokenizers`` library's tokenizer, as JSON, after everything transformers did to it), its named
special tokens and their ids, the special tokens it lists, its BOS/EOS flags and its chat template.
A later start reads the snapshot into ``SnapshotTokenizer``, which answers the calls ``Tokenizer``
makes as transformers' object does: encode and decode by the same backend, templates rendered by
``chat_template`` (transformers' environment and inputs). Where a library needs transformers' own
object (llguidance, for structured outputs), ``transformers()`` loads it from the save.

Only transformers' generic fast tokenizer is kept (a model-specific class may override encoding),
and only without the behaviours this does not carry (cleaning up spaces in decode, splitting
special tokens, a dict of templates). Before a snapshot is written, it is read back and checked
against the object it came from on probe texts, decodes and a conversation: where anything
differs nothing is kept (and the start after uses transformers, as before). The snapshot's name
carries the ``tokenizers`` version that wrote it and this module's format.
"""

from __future__ import annotations

import json
import logging
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Sequence

from hotprefix.files.atomic import atomic_path
from hotprefix.text import chat_template

log = logging.getLogger(__name__)

FORMAT = 1
"""This module's snapshot layout; a new one never reads an older one."""

NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""transformers' named special tokens (its ``SPECIAL_TOKENS_ATTRIBUTES``)."""

GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
"""transformers' generic fast tokenizer (its name in 5.x and before)."""

PROBES = ("Hello, world!", "  two  spaces\tand a tab\n\nnew lines ", "naïve café 東京 🙂 ∑x²",
          "<|im_start|>user\nhi<|im_end|>", "<s>[INST] x [/INST]</s>", "1234567 3.14159 -42",
          "def f(x):\n    return x  # ok\n", "")
"""Texts a snapshot must encode (and decode back) as its source does before it is kept; each
special token of the tokenizer is probed too."""


def path_in(saved: Path) -> Path:
    """The snapshot file of the tokenizer saved at ``saved`` for the installed ``tokenizers``."""
    return saved / f"hotprefix-snapshot-{FORMAT}-tokenizers-{metadata.version('tokenizers')}.json"


class SnapshotTokenizer:
    """transformers' tokenizer interface, as far as ``Tokenizer`` and its callers use it, over a
    snapshot (``take``)."""

    def __init__(self, snap: dict[str, Any], load_transformers: Callable[[], Any] | None = None,
                 backend: Any = None):
        """Args:
            load_transformers: builds transformers' own object for this tokenizer (``transformers``).
            backend: the ``tokenizers`` object itself, instead of the snapshot's JSON (a
                SentencePiece vocabulary ``spm_vocab`` built); ``snap["hotprefix"]``'s entries
                then become ``hotprefix_*`` attributes, as ``tokenizer``'s SentencePiece class has.
        Raises:
            KeyError, TypeError, ValueError, Exception: a malformed snapshot (the backend's own
                errors for a bad JSON).
        """
        from tokenizers import Tokenizer as Backend

        if snap["format"] != FORMAT:
            raise ValueError(f"snapshot format {snap['format']!r}, expected {FORMAT}")
        self.backend_tokenizer = backend if backend is not None else Backend.from_str(snap["backend"])
        for name, value in snap.get("hotprefix", {}).items():
            setattr(self, "hotprefix_" + name, value)
        self.backend_tokenizer.encode_special_tokens = False
        self.special_tokens_map: dict[str, str] = {k: str(v) for k, v in snap["special_tokens_map"].items()}
        self.all_special_tokens: list[str] = [str(t) for t in snap["all_special_tokens"]]
        self.add_bos_token = bool(snap["add_bos_token"])
        self.add_eos_token = bool(snap["add_eos_token"])
        template = snap["chat_template"]
        if template is not None and not isinstance(template, str):
            raise TypeError("the chat template is not a text")
        self.chat_template: str | None = template
        for name in NAMED:
            tid = snap["ids"].get(name)
            setattr(self, name, self.special_tokens_map.get(name))
            setattr(self, name + "_id", int(tid) if tid is not None else None)
        self._load_transformers = load_transformers
        self._transformers: Any = None

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            tid = self.backend_tokenizer.token_to_id(tokens)
            return self.unk_token_id if tid is None else tid
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids]

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    @property
    def added_tokens_decoder(self) -> dict[int, Any]:
        return dict(sorted(self.backend_tokenizer.get_added_tokens_decoder().items()))

    def apply_chat_template(self, conversation: list[dict[str, Any]], tools: list[dict] | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = False) -> str:
        if tokenize:
            raise ValueError("a snapshot tokenizer renders text only (tokenize=False)")
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        return chat_template.render(self.chat_template, conversation, tools, add_generation_prompt,
                                    self.special_tokens_map)

    def transformers(self) -> Any:
        """transformers' own object for this tokenizer (imports transformers), with this one's
        chat template."""
        if self._transformers is None:
            if self._load_transformers is None:
                raise RuntimeError("no way to build transformers' tokenizer for this snapshot")
            tok = self._load_transformers()
            tok.chat_template = self.chat_template
            self._transformers = tok
        return self._transformers


def take(hf: Any) -> dict[str, Any] | None:
    """The snapshot of transformers' tokenizer ``hf``, or None where its behaviour depends on more
    than a snapshot keeps."""
    template = getattr(hf, "chat_template", None)
    if (type(hf).__name__ not in GENERIC_CLASSES or getattr(hf, "clean_up_tokenization_spaces", False)
            or getattr(hf, "split_special_tokens", False)
            or (template is not None and not isinstance(template, str))):
        return None
    smap = dict(hf.special_tokens_map)
    return {"format": FORMAT, "backend": hf.backend_tokenizer.to_str(),
            "special_tokens_map": smap, "all_special_tokens": list(hf.all_special_tokens),
            "add_bos_token": bool(getattr(hf, "add_bos_token", False)),
            "add_eos_token": bool(getattr(hf, "add_eos_token", False)),
            "chat_template": template,
            "ids": {name: getattr(hf, name + "_id", None) for name in NAMED if name in smap}}


PROBE_CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
              {"role": "assistant", "content": "Hello!", "tool_calls": None},
              {"role": "user", "content": "naïve café 東京"}]


def differences(hf: Any, light: SnapshotTokenizer) -> list[str]:
    """What ``light`` does differently from ``hf`` on the probes (empty: nothing)."""
    out = []
    if hf.backend_tokenizer.to_str() != light.backend_tokenizer.to_str():
        out.append("backend JSON")
    for name in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id", "add_bos_token",
                 "add_eos_token", "all_special_tokens", "chat_template"):
        if getattr(hf, name, None) != getattr(light, name, None):
            out.append(name)
    if len(hf) != len(light) or hf.get_vocab() != light.get_vocab():
        out.append("vocabulary")
    specials = [str(t) for t in hf.added_tokens_decoder.values()][:64]
    for text in PROBES + tuple(specials) + (" ".join(specials),):
        for add in (True, False):
            ids = list(hf.encode(text, add_special_tokens=add))
            if ids != light.encode(text, add_special_tokens=add):
                out.append(f"encode {text!r}")
            for skip in (True, False):
                if hf.decode(ids, skip_special_tokens=skip) != light.decode(ids, skip_special_tokens=skip):
                    out.append(f"decode {text!r}")
    if light.chat_template:
        for gen in (True, False):
            try:
                ref = hf.apply_chat_template(PROBE_CHAT, tokenize=False, add_generation_prompt=gen)
            except Exception as e:  # the template refuses the probe: so must ours
                ref = f"error {type(e).__name__}"
            try:
                got = light.apply_chat_template(PROBE_CHAT, add_generation_prompt=gen)
            except Exception as e:
                got = f"error {type(e).__name__}"
            if ref != got:
                out.append("chat template")
    return out


def keep(hf: Any, saved: Path) -> bool:
    """Write the snapshot of ``hf`` (saved at ``saved``) where it behaves as ``hf`` on the probes.
    Returns whether one was written; nothing is raised (a snapshot is only a faster start)."""
    try:
        snap = take(hf)
        if snap is None:
            return False
        diff = differences(hf, SnapshotTokenizer(snap))
        if diff:
            log.info("tokenizer snapshot not kept: it differs from transformers' in %s", ", ".join(diff[:5]))
            return False
        with atomic_path(path_in(saved)) as tmp, open(tmp, "w", encoding="utf-8") as f:
            json.dump(snap, f)
        return True
    except Exception as e:  # not writable, disk full, a backend that will not serialize
        log.info("tokenizer snapshot not kept (%s)", e)
        return False


def load(saved: Path, load_transformers: Callable[[], Any]) -> SnapshotTokenizer | None:
    """The snapshot kept beside the tokenizer saved at ``saved``, or None (none, another format or
    ``tokenizers`` version, unreadable: logged)."""
    path = path_in(saved)
    try:
        with open(path, encoding="utf-8") as f:
            return SnapshotTokenizer(json.load(f), load_transformers)
    except FileNotFoundError:
        return None
    except Exception as e:  # damaged: transformers loads the save instead (and keeps a new one)
        log.warning("tokenizer snapshot %s unreadable (%s): passed over", path, e)
        return None
