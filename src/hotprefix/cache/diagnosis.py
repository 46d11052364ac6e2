"""Why a prompt stopped hitting: the miss reason of the first block that was not served from cache.

A tenant's report is built only from what that tenant may read: its own blocks, the shared window
(blocks inside ``salt_from_block``) and its own ledger entries. Another tenant's blocks and ledger
entries never change the tenant-facing reason, position or excerpt, so a right guess of another
tenant's prompt gets the same answer as a wrong one. What the operator should know about
cross-tenant duplication (the same tokens cached under another salt) comes back separately as the
``operator_reason`` and only reaches the admin aggregate.

Reasons (tenant-facing):
  ``hit``        every cacheable block came from cache;
  ``too_short``  the prompt is shorter than one block plus the token that is always computed;
  ``extended``   a cached prefix was reused and the prompt goes on past everything cached
                 (the next turn of a chat, a new question after a cached document);
  ``cold``       nothing of this prompt (beyond the chat template's fixed opening) was cached;
  ``diverged``   a cached prompt readable by this tenant shares a prefix with this one and then
                 differs inside a block (a timestamp, an id...): the excerpts show where;
  ``evicted``    this tenant's blocks for these tokens were cached here and were evicted;
  ``namespace``  this tenant cached these tokens under another model or tokenizer fingerprint.
Operator-only: ``salt`` (another tenant holds the same tokens; the tenant sees ``cold`` or
``extended``).

Knows blocks and token ids; knows nothing about text, tensors or HTTP. Imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from hotprefix.cache.manager import CacheRequest, KVCacheManager

EXCERPT_TOKENS = 24
CONTEXT_TOKENS = 12


def common_prefix_len(a: Sequence, b: Sequence) -> int:
    """Length of the longest common prefix of two sequences (token ids, characters)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def readable(block_depth: int, block_salt: str | None, req: "CacheRequest") -> bool:
    """May ``req``'s tenant read a cached block found below one of its own or shared blocks?

    Blocks inside the shared window are everyone's; the block where the salt enters must carry the
    tenant's own salt; every block after it descends from that one, hence is the tenant's too.
    """
    if block_depth < req.salt_from_block:
        return block_salt is None
    if block_depth == req.salt_from_block:
        return block_salt == req.salt
    return True


def miss_reason(m: "KVCacheManager", req: "CacheRequest", k: int) -> tuple[dict[str, Any], str | None]:
    """(report fields, operator-only reason or None) for a prompt whose block ``k`` missed."""
    keys = m.keys(req)
    bs = m.block_size
    pos = k * bs
    base: dict[str, Any] = {"miss_position": pos}
    if m.pool.was_evicted(keys[k]):
        return {**base, "miss_reason": "evicted", "detail": {"block_index": k}}, None
    operator = None
    if not req.keys_given:
        content = m.content_keys(req, k + 1)[k]
        scope = req.salt if k >= req.salt_from_block else None
        namespaces = m.ledger.lookup(content, scope)
        if m.namespace_tag in namespaces:  # this tenant cached it here before; it is gone now
            return {**base, "miss_reason": "evicted", "detail": {"block_index": k}}, None
        if namespaces:
            return {**base, "miss_reason": "namespace", "detail": {
                "block_index": k, "note": "you cached these tokens under another model or tokenizer "
                "fingerprint (checkpoint or tokenizer change)",
                "other_namespaces": sorted(namespaces)[:4]}}, None
        if m.ledger.held_by_other_scope(content, m.namespace_tag, scope):
            operator = "salt"
    parent = keys[k - 1] if k else m.hasher.namespace
    siblings = [b for b in m.pool.cached_children(parent) if readable(k, b.salt, req)]
    if siblings and req.keys_given:  # trace replay: no tokens to compare
        return {**base, "miss_reason": "diverged", "detail": {"block_index": k}}, operator
    if siblings:
        sent = req.token_ids[pos:pos + bs]
        best, common = max(((b, common_prefix_len(sent, b.token_ids or ())) for b in siblings),
                           key=lambda bc: bc[1])
        n = pos + common
        if n > m.fixed_prefix_len(req.token_ids):
            return {**base, "miss_position": n, "miss_reason": "diverged",
                    "detail": {"block_index": k, "matched_tokens": n,
                               "context_token_ids": list(req.token_ids[max(0, n - CONTEXT_TOKENS):n]),
                               "sent_token_ids": list(req.token_ids[n:n + EXCERPT_TOKENS]),
                               "cached_token_ids": _cached_excerpt(m, req, best, common)}}, operator
    if k == 0:
        return {**base, "miss_reason": "cold", "detail": {"block_index": k}}, operator
    return {**base, "miss_reason": "extended", "detail": {
        "block_index": k, "note": f"the first {pos} tokens came from cache; the prompt goes on past "
        "everything cached (new text, e.g. the next turn of a conversation)"}}, operator


def _cached_excerpt(m: "KVCacheManager", req: "CacheRequest", best, common: int) -> list[int]:
    """The cached tokens after the divergence point, following only blocks ``req`` may read."""
    cached = list((best.token_ids or ())[common:])
    nxt = best
    while len(cached) < EXCERPT_TOKENS and nxt is not None and nxt.key is not None:
        kids = [b for b in m.pool.cached_children(nxt.key) if readable(b.depth, b.salt, req)]
        nxt = max(kids, key=lambda b: b.num_hits) if kids else None
        if nxt is not None:
            cached += list(nxt.token_ids or ())
    return cached[:EXCERPT_TOKENS]
