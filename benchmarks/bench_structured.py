"""What grammar masking costs a decoded token (structured outputs, ``hotprefix.request.structured``), at
batch 1 and 16, on the real default model through the offline ``LLM``.

Every request is constrained by a JSON schema (greedy, ``max_tokens`` tokens at most). The
matcher's methods are timed where they run:

- ``wait``: the sampler waiting for the next-token mask (the part on the step's critical path;
  the mask itself is computed in a worker thread during the forward pass);
- ``sampler``: the whole mask hook in the sampler: the wait, unpacking the mask and setting the
  disallowed logits to -inf (critical path);
- ``accept``: advancing the matcher by the drawn token and starting the next mask (critical path);
- ``mask``: the worker thread's mask computation (off the critical path).

Each figure is per constrained token, in ms and as a share of the mean step (wall time of the
decode steps / steps). An unconstrained run of the same prompts gives the step time without masks.

    .venv/bin/python benchmarks/bench_structured.py [--batches 1,16] [--max-tokens 48] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

from hotprefix import LLM, SamplingParams
from hotprefix.request.structured import GrammarState

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}


def instrument(times: dict[str, float]) -> None:
    """Time GrammarState's methods into ``times`` (seconds, summed)."""
    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                times[name] += time.perf_counter() - t0
        return wrapper

    orig_allowed = GrammarState.allowed
    orig_wait = GrammarState._wait

    def allowed(self):
        t0 = time.perf_counter()
        orig_wait(self)
        times["wait"] += time.perf_counter() - t0
        return orig_allowed(self)

    GrammarState.allowed = allowed  # type: ignore[method-assign]
    GrammarState._fill = timed("mask", GrammarState._fill)  # type: ignore[method-assign]
    GrammarState.mask_logits = timed("sampler", GrammarState.mask_logits)  # type: ignore[method-assign]
    GrammarState.accept = timed("accept", GrammarState.accept)  # type: ignore[method-assign]


def run(llm: LLM, batch: int, max_tokens: int, constrained: bool, times: dict[str, float]):
    prompts = [[{"role": "user", "content": f"Describe person number {i} as JSON."}] for i in range(batch)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0,
                            structured_outputs={"json": SCHEMA} if constrained else None,
                            ignore_eos=not constrained)
    steps = []
    llm.engine.on_step.append(lambda info: steps.append(time.perf_counter()))
    before = dict(times)
    t0 = time.perf_counter()
    outs = llm.chat(prompts, params)
    wall = time.perf_counter() - t0
    llm.engine.on_step.pop()
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    # decode steps: after the first (prefill) step
    decode = steps[-1] - steps[0] if len(steps) > 1 else wall
    step_ms = decode / max(1, len(steps) - 1) * 1000
    used = {k: times[k] - before.get(k, 0.0) for k in times}
    valid = sum(1 for o in outs if o.outputs[0].finish_reason == "stop" and _parses(o.outputs[0].text))
    return {"batch": batch, "constrained": constrained, "tokens": ntok, "steps": len(steps),
            "step_ms": step_ms, "wall_s": wall, "valid_json": valid,
            **{f"{k}_ms_per_token": used[k] / max(1, ntok) * 1000 for k in used}}


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    times: dict[str, float] = defaultdict(float)
    instrument(times)
    llm = LLM(kv_cache_memory="512MiB", num_threads=args.threads)
    llm.chat([[{"role": "user", "content": "warm up"}]], SamplingParams(max_tokens=4, structured_outputs={"json": SCHEMA}))
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        for constrained in (False, True):
            rows.append(run(llm, b, args.max_tokens, constrained, times))
    print("ms per constrained token; crit = sampler hook + accept (on the critical path), as a share "
          "of the step (x batch: every row of a step pays it)")
    print(f"{'batch':>5} {'constr':>6} {'tokens':>6} {'step ms':>8} {'wait':>7} {'sampler':>8} "
          f"{'accept':>7} {'mask(bg)':>8} {'crit % step':>11} {'valid':>5}")
    for r in rows:
        crit = r.get("sampler_ms_per_token", 0) + r.get("accept_ms_per_token", 0)
        share = crit * r["batch"] / r["step_ms"] * 100 if r["constrained"] else 0.0
        print(f"{r['batch']:>5} {str(r['constrained']):>6} {r['tokens']:>6} {r['step_ms']:>8.2f} "
              f"{r.get('wait_ms_per_token', 0):>7.3f} {r.get('sampler_ms_per_token', 0):>8.3f} "
              f"{r.get('accept_ms_per_token', 0):>7.3f} {r.get('mask_ms_per_token', 0):>8.3f} "
              f"{share:>10.1f}% {r['valid_json']:>5}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
