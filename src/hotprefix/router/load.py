"""A replica's load as time: the work it has queued and running, at the rates it measures itself.

Each replica reports (``Router.report``) its prompt tokens still to prefill, its decode tokens
left (or expected) over its requests, and two rates measured from its engine's own steps: prefill
tokens per second and seconds per decoded token (a decode step's time over the sequences it
advanced). The router turns that into *seconds of work*:

    work_s = prefill tokens left / prefill rate + decode tokens left x seconds per decoded token

and adds, at once, every request it routes there (optimistic accounting), so a burst of decisions
between two reports sees each other. A report supersedes the additions made before it was sampled;
``finished`` takes one back early. A replica may also report its empty pool blocks and its hit
ratio and its pool's size: what writing a prompt there evicts, what an evicted block was worth,
and how full it is against the rest of the fleet. Rates a replica has not measured yet are the fleet's mean of
those it has (a fleet of identical replicas then compares work in tokens, whatever the priors).

Knows nothing about blocks or policies. Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable


@dataclass
class Pending:
    """One routed request counted on its replica before that replica reports it."""

    at: float
    """Router clock when it was routed."""
    prefill_tokens: float
    decode_tokens: float
    blocks: float = 0.0
    """Blocks it writes into the replica's pool."""
    tag: int | None = None
    """The request's fleet number, where the front end numbers requests (``fleet_seq``): a
    report that names the numbers its scheduler holds counts exactly those."""


@dataclass
class ReplicaLoad:
    """What one replica last reported, plus what the router routed there since."""

    prefill_tokens: float = 0.0
    """Prompt tokens still to compute (running and waiting requests)."""
    decode_tokens: float = 0.0
    """Decode tokens left or expected over its running and waiting requests."""
    prefill_tok_s: float | None = None
    """Measured prefill tokens per second (None: not measured yet)."""
    decode_token_s: float | None = None
    """Measured seconds per decoded token (a decode step's time / the sequences it advanced)."""
    output_tokens: float | None = None
    """Mean output tokens of its finished requests (what a new request is expected to decode)."""
    empty_blocks: float | None = None
    """Pool blocks holding nothing (a write there evicts nothing); None: not reported."""
    hit_ratio: float | None = None
    """Share of its prompt tokens served from its cache (what a cached block is worth: the chance
    it is read again)."""
    pool_blocks: float | None = None
    """Blocks in its pool (its capacity); None: not reported."""
    sampled_at: float = float("-inf")
    pending: list[Pending] = field(default_factory=list)

    def report(self, prefill_tokens: float, decode_tokens: float, sampled_at: float,
               prefill_tok_s: float | None = None, decode_token_s: float | None = None,
               output_tokens: float | None = None, empty_blocks: float | None = None,
               hit_ratio: float | None = None, pool_blocks: float | None = None,
               tags: Iterable[int] | None = None) -> None:
        """A new report: it already counts what was routed here before ``sampled_at``, except,
        where it names the fleet numbers its scheduler holds (``tags``), a numbered request it does
        not name (still on its way: in Ray Serve's queue, or being tokenized by the replica). A
        numbered request that finished is taken back by ``take_back``."""
        self.prefill_tokens = max(0.0, float(prefill_tokens))
        self.decode_tokens = max(0.0, float(decode_tokens))
        if prefill_tok_s is not None and prefill_tok_s > 0:
            self.prefill_tok_s = float(prefill_tok_s)
        if decode_token_s is not None and decode_token_s > 0:
            self.decode_token_s = float(decode_token_s)
        if output_tokens is not None and output_tokens >= 0:
            self.output_tokens = float(output_tokens)
        if empty_blocks is not None:
            self.empty_blocks = max(0.0, float(empty_blocks))
        if hit_ratio is not None:
            self.hit_ratio = min(1.0, max(0.0, float(hit_ratio)))
        if pool_blocks is not None and pool_blocks > 0:
            self.pool_blocks = float(pool_blocks)
        self.sampled_at = sampled_at
        held = None if tags is None else set(tags)
        self.pending = [p for p in self.pending
                        if (p.at > sampled_at if held is None or p.tag is None else p.tag not in held)]

    def add(self, p: Pending) -> None:
        self.pending.append(p)

    def take_back(self, p: Pending) -> None:
        """The request ended before a report counted it (or went elsewhere)."""
        for i, q in enumerate(self.pending):
            if q is p:
                del self.pending[i]
                return

    def tokens(self) -> tuple[float, float]:
        """(prefill tokens, decode tokens) reported plus those routed since."""
        return (self.prefill_tokens + sum(p.prefill_tokens for p in self.pending),
                self.decode_tokens + sum(p.decode_tokens for p in self.pending))

    def empty_left(self) -> float | None:
        """Empty pool blocks reported, less those the requests routed since will write."""
        if self.empty_blocks is None:
            return None
        return max(0.0, self.empty_blocks - sum(p.blocks for p in self.pending))

    def filled(self) -> float | None:
        """Pool blocks holding something (reported, plus what was routed here since); None where
        the pool's size or its empty blocks are not reported."""
        empty = self.empty_left()
        if empty is None or self.pool_blocks is None:
            return None
        return max(0.0, self.pool_blocks - empty)

    def work_s(self, prefill_tok_s: float, decode_token_s: float) -> float:
        """Seconds its queued and running work takes at these rates (its own, once measured)."""
        pre, dec = self.tokens()
        return pre / prefill_tok_s + dec * decode_token_s
