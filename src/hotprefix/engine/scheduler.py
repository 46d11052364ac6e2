"""Continuous batching: who runs in the next step, and with how many tokens.

Each step has a token budget (``max_num_batched_tokens``). Running requests go first: a decoding
request takes 1 token, a request still prefilling takes the next chunk of its prompt (chunked
prefill), so long prompts share steps with decodes. Then waiting requests are admitted: each gets a
prefix-cache lookup, its cached blocks are referenced, and only the rest is scheduled.

  * cache-aware admission: among waiting requests, those with the longest cached prefix go first,
    but none is passed over more than ``max_skips`` times (fairness);
  * in-flight sharing: a waiting request whose next block is being computed by a running request
    waits for it instead of computing the same tokens in the same step;
  * one prompt part-way at a time (vLLM's ``max_num_partial_prefills`` = 1): a request whose
    chunk would leave some of its prompt for later steps waits while another is part-way, so
    prompts finish one after another (the first one's TTFT is not held back by the others') and
    a hybrid pool holds one part-way prompt's window pages at a time, not every one's;
  * preemption by recompute: when the pool cannot supply a running request's next block, the most
    recently admitted request gives back its blocks and returns to the front of the queue (its
    blocks stay cached, so re-admission usually hits them).

Knows the cache manager, not the model or the tokenizer.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from hotprefix.cache.manager import KVCacheManager
from hotprefix.config.sections import SchedulerConfig
from hotprefix.engine.request import Request, Status

ADMISSION_WINDOW = 64  # waiting requests considered for cache-aware ordering each step
PROMPT_LOGPROBS_CHUNK = 256
"""Longest prefill chunk of a request that wants prompt log probabilities: each of its tokens
needs a row of logits (4 bytes x the vocabulary) in that step."""


def chunk_limit(req: Request, budget: int, chunk: int) -> int:
    """The most tokens ``req`` may compute in one step given the step's remaining budget and the
    longest chunk (``SchedulerConfig.prefill_chunk``)."""
    budget = min(budget, chunk)
    return min(budget, PROMPT_LOGPROBS_CHUNK) if req.params.prompt_logprobs is not None else budget


class RequestRejected(ValueError):
    """The request can never run (too long for the model or the pool, empty, malformed).

    ``code`` is a stable machine-readable name of the reason (the API's ``error.code``).
    """

    def __init__(self, message: str, code: str = "invalid_prompt"):
        super().__init__(message)
        self.code = code


@dataclass
class ScheduledChunk:
    request: Request
    num_tokens: int
    start: int  # num_computed_tokens before this step

    @property
    def wants_logits(self) -> bool:
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # ended by the scheduler (capacity)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, manager: KVCacheManager, max_model_len: int):
        self.config = config
        self.manager = manager
        self.max_model_len = max_model_len
        self.block_size = manager.block_size
        self.chunk = config.prefill_chunk(manager.windows is not None, manager.block_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # ------------------------------------------------------------------ intake
    def check(self, num_prompt_tokens: int) -> None:
        """Raise RequestRejected if a request of this size can never be served."""
        if num_prompt_tokens < 1:
            raise RequestRejected("the prompt is empty", "empty_prompt")
        if num_prompt_tokens >= self.max_model_len:
            raise RequestRejected(
                f"the prompt has {num_prompt_tokens} tokens, but this model's max_model_len is "
                f"{self.max_model_len} (prompt + at least one generated token must fit)",
                "context_length_exceeded")
        if self.manager.pages_to_hold(num_prompt_tokens + 1, self.chunk) > self.manager.pool.num_blocks:
            raise RequestRejected(
                f"the prompt has {num_prompt_tokens} tokens, more than the KV pool holds "
                f"({self.manager.pool.num_blocks * self.block_size} tokens); raise kv_cache_memory",
                "context_length_exceeded")

    def add(self, req: Request) -> None:
        self.check(req.num_prompt_tokens)
        req.status = Status.WAITING
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Take an aborted or finished request out of the queues and free its blocks."""
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.manager.free(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        partial = False  # a prompt chunk that leaves some of its prompt for later steps
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            left = req.num_tokens - req.num_computed_tokens
            n = min(left, chunk_limit(req, budget, self.chunk))
            if n <= 0 or (partial and n < left):  # one prompt part-way per step
                i += 1
                continue
            while not self.manager.allocate(req, n, req.num_computed_tokens):
                victim = self.running[-1]
                if victim is req and len(self.running) == 1:
                    # Alone and still out of blocks: it has outgrown the pool.
                    self.running.pop()
                    self.manager.free(req)
                    req.status = Status.FINISHED
                    req.finish_reason = "length"
                    out.finished.append(req)
                    break
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.chunks.append(ScheduledChunk(req, n, req.num_computed_tokens))
                budget -= n
                partial = partial or n < left
                i += 1
                continue
            # req itself left the running list; the next request is now at index i
        if not out.preempted:
            self._admit(out, budget, partial)
        return out

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.manager.free(victim)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.status = Status.PREEMPTED
        self.waiting.appendleft(victim)
        out.preempted.append(victim)
        out.chunks = [c for c in out.chunks if c.request is not victim]

    def _order(self, window: list[Request]) -> list[tuple[Request, list | None, int]]:
        """The window of waiting requests in admission order, with their cache hits when already
        looked up and the pool's eviction count just after each lookup (a later lookup that
        installs a KV tier's blocks may evict what an earlier one returned)."""
        pool = self.manager.pool
        if not self.config.cache_aware or not self.manager.enabled or len(window) < 2:
            return [(r, None, pool.num_evictions) for r in window]
        hits = {r.request_id: (self.manager.lookup(r), pool.num_evictions) for r in window}
        overdue = [r for r in window if r.num_skips >= self.config.max_skips]
        rest = [r for r in window if r.num_skips < self.config.max_skips]
        rest.sort(key=lambda r: -len(hits[r.request_id][0]))  # stable: FCFS among equal hits
        return [(r, *hits[r.request_id]) for r in overdue + rest]

    def _admit(self, out: SchedulerOutput, budget: int, partial: bool) -> None:
        admitted: list[Request] = []
        fcfs = list(self.waiting)[:ADMISSION_WINDOW]
        for req, hits, evictions in self._order(fcfs):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if self.manager.tier_pending(req):
                continue  # its prefix is being read from a KV tier: admit it when that is done
            if hits is None or admitted or self.manager.pool.num_evictions != evictions:
                # an admission above, or another request's tier install, may have evicted blocks
                # (or window pages) that this lookup returned: never admit on a stale hit
                hits = self.manager.lookup(req)
            if self.manager.inflight_owner(req, len(hits)) is not None:
                continue  # its next block is being computed right now: reuse it next step
            num_computed = len(hits) * self.block_size
            left = req.num_tokens - num_computed
            n = min(left, chunk_limit(req, budget, self.chunk))
            if partial and n < left:
                continue  # a prompt is part-way this step already: start this one when it is done
            if not self.manager.allocate(req, n, num_computed, hits):
                break  # pool full: keep the order, retry next step
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_computed
                self.manager.report(req, hits)
            req.num_computed_tokens = num_computed
            req.status = Status.RUNNING
            self.running.append(req)
            admitted.append(req)
            out.chunks.append(ScheduledChunk(req, n, num_computed))
            budget -= n
            partial = partial or n < left
        if admitted:
            ids = {r.request_id for r in admitted}
            for r in admitted:
                self.waiting.remove(r)
            last = max(fcfs.index(r) for r in admitted)
            for r in fcfs[:last]:
                if r.request_id not in ids:
                    r.num_skips += 1

    # ------------------------------------------------------------------ after the step
    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance progress, append sampled tokens, register full blocks.

        Args:
            sampled: request id -> token sampled for requests whose chunk reached their last token.

        Returns:
            Requests that got a new token this step (the engine checks them for stops).
        """
        advanced = []
        for c in out.chunks:
            req = c.request
            req.num_computed_tokens = c.start + c.num_tokens
            self.manager.commit(req, req.num_computed_tokens)
            tok = sampled.get(req.request_id)
            if tok is not None:
                req.token_ids.append(tok)
                advanced.append(req)
        return advanced

    def fork(self, parent: Request, child: Request) -> list[tuple[int, int]] | None:
        """Start ``child``, another sequence of ``parent``'s prompt, right after ``parent``
        computed that prompt: it shares the prompt's blocks (``KVCacheManager.fork``) and runs
        from the next step, as a decode (``max_num_seqs`` may be passed for a while).

        Returns the block pairs whose contents the caller must copy before the next step, or None
        when the pool had no block for the copy: the child then waits at the front of the queue,
        as a preempted request does, and computes what the cache does not hold.
        """
        pairs = self.manager.fork(parent, child, parent.num_prompt_tokens)
        if pairs is None:
            child.num_computed_tokens = 0
            child.status = Status.PREEMPTED
            self.waiting.appendleft(child)
            return None
        child.num_computed_tokens = parent.num_prompt_tokens
        child.status = Status.RUNNING
        self.running.append(child)
        return pairs

    def finish(self, req: Request, reason: str) -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.remove(req)
