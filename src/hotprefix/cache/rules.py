"""Rules of the prefix cache that more than one caller applies, written once.

Knows block arithmetic only: nothing about pools, requests, tensors or traces. Imports no torch.
"""

from __future__ import annotations


def cacheable_blocks(num_tokens: int, block_size: int) -> int:
    """How many leading full blocks of a sequence may be served from cache.

    The last token is never served from cache: it must be computed so that there are logits to
    sample the next token from. So at most ``num_tokens - 1`` tokens, in whole blocks, come from cache.

    Args:
        num_tokens: Tokens known for the request (its prompt, or prompt + output after a preemption).
        block_size: Tokens per KV block.

    Returns:
        ``(num_tokens - 1) // block_size``, and 0 for an empty sequence.
    """
    return max(0, (num_tokens - 1) // block_size)
