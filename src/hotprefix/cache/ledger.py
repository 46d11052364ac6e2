"""A bounded ledger of which namespaces and tenants have cached a given token content.

Keys here are the *content* chain of a block (its tokens and its ancestors' tokens, hashed with no
namespace and no salt), so the ledger can tell a miss caused by a model/tokenizer change
(``namespace``) or by another tenant's salt (``salt``) from a cold one. It never stores tokens or
salts in clear: a salt appears only as a short hash, and a report only says *that* another tenant
holds the content, never which or what.

With a path, entries are appended to a file and read back at start-up, so a restart with a new
checkpoint or tokenizer can still explain its misses. Imports no torch.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict

from hotprefix.cache.hashing import BlockKey


class ContentLedger:
    """content key -> {(namespace tag, salt tag)}; least recently recorded entries drop first."""

    def __init__(self, path: str | None = None, max_entries: int = 200_000, max_depth: int = 512):
        self.max_entries = max_entries
        self.max_depth = max_depth
        self.path = path
        self._entries: OrderedDict[bytes, set[tuple[str, str]]] = OrderedDict()
        self._buffer: list[str] = []
        if path and os.path.exists(path):
            with open(path) as f:
                for line in f:
                    parts = line.split()
                    if len(parts) == 3:
                        self._add(bytes.fromhex(parts[0]), parts[1], parts[2])

    @staticmethod
    def salt_tag(salt: str | None) -> str:
        return "-" if salt is None else hashlib.sha256(b"salt\0" + salt.encode()).hexdigest()[:12]

    def _add(self, key: bytes, ns: str, salt_tag: str) -> bool:
        owners = self._entries.get(key)
        if owners is None:
            owners = self._entries[key] = set()
            if len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(key)
        if (ns, salt_tag) in owners:
            return False
        owners.add((ns, salt_tag))
        return True

    def record(self, key: BlockKey, namespace_tag: str, salt: str | None) -> None:
        tag = self.salt_tag(salt)
        if self._add(key, namespace_tag, tag) and self.path:
            self._buffer.append(f"{key.hex()} {namespace_tag} {tag}\n")

    def lookup(self, key: BlockKey) -> set[tuple[str, str]]:
        return self._entries.get(key, set())

    def flush(self) -> None:
        if self.path and self._buffer:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with open(self.path, "a") as f:
                f.writelines(self._buffer)
            self._buffer.clear()
