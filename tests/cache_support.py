"""What the cache tests check after every step of their state machines (no model)."""

from __future__ import annotations


def assert_pool_consistent(manager, live_ids, block_size: int) -> None:
    """The pool's own invariants; the live requests' block tables hold exactly the pool's
    references; every indexed block is a full block under its own key."""
    pool = manager.pool
    pool.check_invariants()
    held = sum(manager.num_blocks_held(rid) for rid in live_ids)
    refs = sum(b.ref_cnt for b in pool.blocks)
    assert held == refs, f"block tables hold {held} refs, pool counts {refs}"
    for key, blk in pool.index.items():
        assert blk.key == key and blk.token_ids is not None and len(blk.token_ids) == block_size
