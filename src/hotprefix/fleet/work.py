"""A replica's work and rates, measured from its own engine's steps: what it reports to the router.

``StepMeter.attach(engine)`` times every forward pass the engine runs (its runner's ``run``, with
the scheduled chunks) and keeps exponentially weighted means of

  * seconds per decoded token: a step's time over the sequences it decoded, from steps that only
    decode;
  * prefill tokens per second: a step's prompt tokens over its time less its decodes' share,
    from steps that prefill at least ``MIN_RATE_TOKENS`` (a short one's time is mostly the step's
    fixed cost: a replica serving cache hits, whose prefills are a turn's few new tokens, would
    measure itself slow and be priced off the prefixes it holds);
  * output tokens of finished requests, and the share of their prompts served from cache (from
    the engine's ``on_step`` outputs).

``report(engine)`` (call it on the engine's thread) reads the scheduler and the pool (its empty
blocks and its size): the fleet numbers of the requests it holds (so the router knows which of
the requests it sent are counted here), prompt tokens still to
prefill over the running and waiting requests, and decode tokens left: per request, what its
``max_tokens`` leaves, but no more than the mean output less what it has produced (at least one).
The router prices a replica by that work at those rates (``hotprefix.router.load``).

Knows nothing about Ray or routing. Imports no torch.
"""

from __future__ import annotations

import time
from typing import Any, Callable

EWMA = 0.2
"""Weight of the newest step in the running means (about the last ten steps count)."""
MIN_RATE_TOKENS = 128
"""Fewest prompt tokens a step must prefill to count toward the prefill rate."""


class StepMeter:
    """Running means of one engine's step rates (see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.prefill_tok_s: float | None = None
        self.decode_token_s: float | None = None
        self.output_tokens: float | None = None
        self.hit_ratio: float | None = None
        self.steps = 0

    def attach(self, engine: Any) -> "StepMeter":
        """Time ``engine``'s forward passes and watch its finished requests."""
        runner = engine.runner
        run = runner.run

        def timed(chunks: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = self.clock()
            out = run(chunks, *args, **kwargs)
            self.observe(chunks, self.clock() - t0)
            return out

        runner.run = timed
        engine.on_step.append(self._outputs)
        return self

    def observe(self, chunks: Any, seconds: float) -> None:
        """One step: its scheduled chunks (``request``, ``num_tokens``, ``start``) and its time."""
        if not chunks or seconds <= 0:
            return
        prefill = decodes = 0
        for c in chunks:
            if c.start >= c.request.num_prompt_tokens:
                decodes += 1
            else:
                prefill += c.num_tokens
        self.steps += 1
        if prefill == 0:
            self.decode_token_s = _mean(self.decode_token_s, seconds / decodes)
            return
        if prefill < MIN_RATE_TOKENS:
            return
        decode_s = decodes * (self.decode_token_s or 0.0)
        self.prefill_tok_s = _mean(self.prefill_tok_s, prefill / max(seconds - decode_s, seconds / 2))

    def _outputs(self, step: dict[str, Any]) -> None:
        for o in step.get("outputs", ()):
            if getattr(o, "finished", False):
                self.output_tokens = _mean(self.output_tokens, float(len(o.token_ids)))
                n = len(o.prompt_token_ids)
                if n:
                    self.hit_ratio = _mean(self.hit_ratio, o.num_cached_tokens / n)

    def report(self, engine: Any) -> dict[str, Any]:
        """The replica's work and rates (on the engine's thread)."""
        sched = engine.scheduler
        prefill = 0
        decode = 0.0
        mean_out = self.output_tokens
        for r in list(sched.running) + list(sched.waiting):
            prefill += max(0, r.num_prompt_tokens - r.num_computed_tokens)
            out = r.num_output_tokens
            left = max(1, r.params.max_tokens - out)
            decode += left if mean_out is None else min(left, max(1.0, mean_out - out))
        seqs = sorted({r.fleet_seq for r in list(sched.running) + list(sched.waiting)
                       if getattr(r, "fleet_seq", None) is not None})
        return {"prefill_tokens": prefill, "decode_tokens": round(decode, 1), "fleet_seqs": seqs,
                "running": len(sched.running), "waiting": len(sched.waiting),
                "prefill_tok_s": self.prefill_tok_s, "decode_token_s": self.decode_token_s,
                "output_tokens": mean_out, "hit_ratio": self.hit_ratio,
                "empty_blocks": _empty_blocks(engine), "pool_blocks": _pool_blocks(engine)}


def _empty_blocks(engine: Any) -> int | None:
    """Pool blocks that hold nothing (writing there evicts nothing)."""
    pool = getattr(getattr(engine, "cache", None), "pool", None)
    empty = getattr(pool, "empty", None)
    return None if empty is None else len(empty)


def _pool_blocks(engine: Any) -> int | None:
    """Blocks in the pool (its capacity: how full it is against the rest of the fleet)."""
    pool = getattr(getattr(engine, "cache", None), "pool", None)
    n = getattr(pool, "num_blocks", None)
    return n if isinstance(n, int) else None


def _mean(old: float | None, new: float) -> float:
    return new if old is None else (1 - EWMA) * old + EWMA * new
