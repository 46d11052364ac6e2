"""Why a prompt stopped hitting: the miss reason of the first block that was not served from cache.

A tenant's report is built only from what that tenant may read: its own blocks, the shared window
(blocks inside ``salt_from_block``) and its own ledger entries. Another tenant's blocks and ledger
entries never change the tenant-facing reason, position or excerpt, so a right guess of another
tenant's prompt gets the same answer as a wrong one. What the operator should know about
cross-tenant duplication (the same tokens cached under another salt) comes back separately as the
``operator_reason`` and only reaches the admin aggregate.

The reasons are defined in ``hotprefix.cache.report.MissReason``.

Knows blocks and token ids; knows nothing about text, tensors or HTTP. Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from hotprefix.cache.block_pool import BlockPool
from hotprefix.cache.hashing import BlockHasher, BlockKey
from hotprefix.cache.ledger import ContentLedger
from hotprefix.cache.report import MissReason
from hotprefix.cache.request import CacheRequest
from hotprefix.text.common import common_prefix_len


class CacheView(Protocol):
    """What the diagnosis reads of the cache manager."""

    block_size: int
    pool: BlockPool
    hasher: BlockHasher
    ledger: ContentLedger
    namespace_tag: str

    def keys(self, req: CacheRequest) -> list[BlockKey]: ...

    def content_keys(self, req: CacheRequest, n: int) -> list[BlockKey]: ...

    def fixed_prefix_len(self, token_ids: Sequence[int]) -> int: ...

EXCERPT_TOKENS = 24
CONTEXT_TOKENS = 12


def readable(block_depth: int, block_salt: str | None, req: CacheRequest) -> bool:
    """May ``req``'s tenant read a cached block found below one of its own or shared blocks?

    Blocks inside the shared window are everyone's; the block where the salt enters must carry the
    tenant's own salt; every block after it descends from that one, hence is the tenant's too.
    """
    if block_depth < req.salt_from_block:
        return block_salt is None
    if block_depth == req.salt_from_block:
        return block_salt == req.salt
    return True


@dataclass(frozen=True)
class Miss:
    """What ``miss_reason`` found: the tenant-facing reason, where, the facts, and the operator's."""

    reason: MissReason
    position: int
    detail: dict[str, Any]
    operator_reason: MissReason | None = None


def miss_reason(m: CacheView, req: CacheRequest, k: int) -> Miss:
    """Why the prompt of ``req``, whose block ``k`` missed, stopped hitting there."""
    keys = m.keys(req)
    bs = m.block_size
    pos = k * bs
    if m.pool.was_evicted(keys[k]):
        return Miss(MissReason.EVICTED, pos, {"block_index": k})
    operator = None
    content = m.content_keys(req, k + 1)[k]
    scope = req.salt if k >= req.salt_from_block else None
    namespaces = m.ledger.lookup(content, scope)
    if m.namespace_tag in namespaces:  # this tenant cached it here before; it is gone now
        return Miss(MissReason.EVICTED, pos, {"block_index": k})
    if namespaces:
        return Miss(MissReason.NAMESPACE, pos, {
            "block_index": k, "note": "you cached these tokens under another model or tokenizer "
            "fingerprint (checkpoint or tokenizer change)",
            "other_namespaces": sorted(namespaces)[:4]})
    if m.ledger.held_by_other_scope(content, m.namespace_tag, scope):
        operator = MissReason.SALT
    parent = keys[k - 1] if k else m.hasher.namespace
    siblings = [b for b in m.pool.cached_children(parent) if readable(k, b.salt, req)]
    if siblings:
        sent = req.token_ids[pos:pos + bs]
        best, common = max(((b, common_prefix_len(sent, b.token_ids or ())) for b in siblings),
                           key=lambda bc: bc[1])
        n = pos + common
        if n > m.fixed_prefix_len(req.token_ids):
            return Miss(MissReason.DIVERGED, n, {
                "block_index": k, "matched_tokens": n,
                "context_token_ids": list(req.token_ids[max(0, n - CONTEXT_TOKENS):n]),
                "sent_token_ids": list(req.token_ids[n:n + EXCERPT_TOKENS]),
                "cached_token_ids": _cached_excerpt(m, req, best, common)}, operator)
    if k == 0:
        return Miss(MissReason.COLD, pos, {"block_index": k}, operator)
    return Miss(MissReason.EXTENDED, pos, {
        "block_index": k, "note": f"the first {pos} tokens came from cache; the prompt goes on past "
        "everything cached (new text, e.g. the next turn of a conversation)"}, operator)


def _cached_excerpt(m: CacheView, req: CacheRequest, best, common: int) -> list[int]:
    """The cached tokens after the divergence point, following only blocks ``req`` may read."""
    cached = list((best.token_ids or ())[common:])
    nxt = best
    while len(cached) < EXCERPT_TOKENS and nxt is not None and nxt.key is not None:
        kids = [b for b in m.pool.cached_children(nxt.key) if readable(b.depth, b.salt, req)]
        nxt = max(kids, key=lambda b: b.num_hits) if kids else None
        if nxt is not None:
            cached += list(nxt.token_ids or ())
    return cached[:EXCERPT_TOKENS]
