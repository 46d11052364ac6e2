"""A replica's work and rates from its engine's own steps (hotprefix.fleet.work, torch- and
Ray-free): decode-only steps give the seconds per decoded token, prefill steps the prefill rate net
of their decodes, finished requests the expected output; the report counts prompt tokens left and
decode tokens left (capped by the expected output)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from hotprefix.fleet.work import StepMeter


@dataclass
class Req:
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    params: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(max_tokens=1000))


def chunk(req: Req, n: int) -> SimpleNamespace:
    return SimpleNamespace(request=req, num_tokens=n, start=req.num_computed_tokens)


class Clock:
    """Called twice a step, before and after the run: ``step_s`` apart."""

    def __init__(self) -> None:
        self.t = 0.0
        self.step_s = 0.0
        self.calls = 0

    def __call__(self) -> float:
        self.calls += 1
        if self.calls % 2 == 0:
            self.t += self.step_s
        return self.t


def test_rates_come_from_the_engines_steps_and_the_report_counts_work_left():
    clock = Clock()
    runner = SimpleNamespace(run=lambda chunks, tables: ["sampled"])
    engine = SimpleNamespace(runner=runner, on_step=[],
                             scheduler=SimpleNamespace(running=[], waiting=[]))
    meter = StepMeter(clock).attach(engine)
    decoding = [Req(10, 10 + i, i) for i in range(4)]
    clock.step_s = 0.2  # 4 sequences decoded in 0.2 s: 50 ms a token
    assert engine.runner.run([chunk(r, 1) for r in decoding], {}) == ["sampled"]
    assert meter.decode_token_s == pytest.approx(0.05)
    # 800 prompt tokens with 4 decodes in 1.2 s: 0.2 s is theirs, 800 tok/s the prefill's
    clock.step_s = 1.2
    engine.runner.run([chunk(Req(2000), 800)] + [chunk(r, 1) for r in decoding], {})
    assert meter.prefill_tok_s == pytest.approx(800.0)
    assert meter.steps == 2
    # a turn's few new tokens after a cache hit: 20 in 0.1 s is the step's fixed cost, not a
    # rate of 200 tok/s; the rate stays what long prefills measured
    clock.step_s = 0.1
    for _ in range(5):
        engine.runner.run([chunk(Req(400, 380), 20)], {})
    assert meter.prefill_tok_s == pytest.approx(800.0) and meter.steps == 7
    for cb in engine.on_step:  # a request that produced 40 tokens finished
        cb({"num_tokens": 1, "outputs": [SimpleNamespace(finished=True, token_ids=[1] * 40,
                                                         num_cached_tokens=300,
                                                         prompt_token_ids=[0] * 400)]})
    assert meter.output_tokens == 40.0 and meter.hit_ratio == pytest.approx(0.75)
    prefilling = Req(2000, 800)
    short = Req(10, 12, 2, SimpleNamespace(max_tokens=5))  # 3 tokens left of its max_tokens
    long = Req(10, 20, 10)  # expected 40 in all: 30 left
    long.fleet_seq, prefilling.fleet_seq = 17, 9  # the front end's numbers (others unnumbered)
    engine.scheduler = SimpleNamespace(running=[prefilling, short, long], waiting=[Req(500)])
    rep = meter.report(engine)
    assert rep["fleet_seqs"] == [9, 17]  # which of the router's requests this report counts
    assert rep["prefill_tokens"] == 1200 + 500
    assert rep["decode_tokens"] == 40 + 3 + 30 + 40
    assert (rep["running"], rep["waiting"]) == (3, 1)
    assert rep["prefill_tok_s"] == pytest.approx(800.0) and rep["decode_token_s"] == pytest.approx(0.05)
    assert rep["empty_blocks"] is None and rep["pool_blocks"] is None  # no pool: not reported
    engine.cache = SimpleNamespace(pool=SimpleNamespace(empty=[7, 8, 9], num_blocks=64))
    rep = meter.report(engine)
    assert (rep["empty_blocks"], rep["pool_blocks"]) == (3, 64)  # how full, against the fleet
