"""Token ids of text prefixes that end right after a special token, remembered per scope, so a
prompt that repeats a long rendered prefix (a chat's system prompt, the turns so far) tokenizes only
its new text.

A fast tokenizer splits its input at special tokens before anything else, so the ids of
``A + B``, where ``A`` ends with a special token, are the ids of ``A`` followed by the ids of ``B``
tokenized alone (no BOS). ``splits_at_specials`` checks that on probe texts for every special
token (a token that strips the spaces beside it, a normalizer or pre-tokenizer that treats a text's
first word apart, a post-processor that appends a token: any of them fails it) and the cache is
off where it fails. Entries are keyed by a SHA-256 of (scope, the BOS flag, the prefix text), so a
prefix is found only by the same scope: the server passes the tenant's salt, and one tenant's text
never makes another's tokenization faster (a timing we control). Memory is bounded by the ids
kept (``max_ids``, least recently used first out).

This module knows nothing about models, the KV cache or HTTP.
"""

from __future__ import annotations

import array
import hashlib
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable

Encode = Callable[[str, bool], list[int]]

MAX_IDS = 1 << 21
"""Token ids kept, in all (4 bytes each: 8 MiB)."""
MIN_PREFIX_CHARS = 256
"""Prefixes shorter than this are not remembered (tokenizing them costs less than a lookup)."""
_PROBE_HEADS = ("", "Hello world", "a\n")
_PROBE_TAILS = ("abc", " abc", "\n abc", "  two  spaces", "\u00e9t\u00e9 42", "\n")


def splits_at_specials(encode: Encode, specials: Iterable[str]) -> bool:
    """Whether ``encode(A + s + B) == encode(A + s) + encode(B, no specials)`` on the probe texts,
    for every special token ``s``, with and without the tokenizer's own specials (BOS)."""
    for s in specials:
        for head in _PROBE_HEADS:
            for tail in _PROBE_TAILS:
                for add in (False, True):
                    if encode(head + s + tail, add) != encode(head + s, add) + encode(tail, False):
                        return False
    return True


class PrefixTokens:
    """The cache (see the module's docstring) over one tokenizer's ``encode``."""

    def __init__(self, encode: Encode, specials: dict[str, int], max_ids: int = MAX_IDS):
        """Args:
            encode: ``encode(text, add_special_tokens) -> ids`` of the tokenizer.
            specials: each special token's text -> its id (the boundaries a prefix may end at).
        """
        self._encode, self._max_ids = encode, max_ids
        self.specials = tuple(specials)
        """The special tokens' texts a remembered prefix may end at."""
        self._ids = frozenset(specials.values())
        self._lead = len(encode("", True))  # the specials (a BOS) encode puts before a text
        longest_first = sorted(specials, key=len, reverse=True)
        self._pattern = re.compile("|".join(re.escape(s) for s in longest_first))
        self._entries: dict[bytes, tuple[array.array, int]] = {}  # prefix digest -> (run, length)
        self._runs: OrderedDict[int, array.array] = OrderedDict()  # id(run) -> run, LRU: evicted whole
        self._kept = 0
        self.hits = 0
        """Encodes that started from a remembered prefix (tests, stats)."""

    def encode(self, text: str, add_special_tokens: bool, scope: str) -> list[int]:
        """``encode(text, add_special_tokens)``, from the longest remembered prefix of ``text`` in
        ``scope`` that ends after a special token; the text's own such prefixes are remembered."""
        ends = [m.end() for m in self._pattern.finditer(text)]
        digests = self._digests(text, ends, add_special_tokens, scope)
        start, ids = 0, None
        for pos, digest in zip(reversed(ends), reversed(digests)):
            hit = self._entries.get(digest)
            if hit is not None:
                run, n = hit
                self._runs.move_to_end(id(run))
                start, ids = pos, run[:n].tolist()
                self.hits += 1
                break
        if ids is None:
            ids = self._encode(text, add_special_tokens)
        else:
            ids += self._encode(text[start:], False) if start < len(text) else []
        self._remember(ids, ends, digests, add_special_tokens)
        return ids

    @staticmethod
    def _digests(text: str, ends: list[int], add: bool, scope: str) -> list[bytes]:
        h = hashlib.sha256(f"{len(scope)}:{scope}\0{int(add)}\0".encode())
        out, last = [], 0
        for pos in ends:
            h.update(text[last:pos].encode("utf-8", "surrogatepass"))
            last = pos
            out.append(h.copy().digest())
        return out

    def _remember(self, ids: list[int], ends: list[int], digests: list[bytes], add: bool) -> None:
        """Each prefix ending at a special token, as a length into one stored copy of ``ids``;
        nothing when the ids hold another count of special tokens than the text (a boundary would
        be misplaced)."""
        lead = self._lead if add else 0
        at = [i + 1 for i, t in enumerate(ids) if t in self._ids and i >= lead]
        if len(at) != len(ends) or not ends or ends[-1] < MIN_PREFIX_CHARS:
            return
        run = array.array("i", ids[:at[-1]])
        for pos, n, digest in zip(ends, at, digests):
            if pos >= MIN_PREFIX_CHARS:
                self._entries[digest] = (run, n)
        self._runs[id(run)] = run
        self._kept += len(run)
        while self._kept > self._max_ids and len(self._runs) > 1:
            _, old = self._runs.popitem(last=False)
            self._kept -= len(old)
            for d in [d for d, (r, _) in self._entries.items() if r is old]:
                del self._entries[d]
