"""What a warm hit costs: time to first token of a chat whose long system prompt is cached, against
the same kind of question asked alone, with the time broken down into its stages.

For each context size (default 4,096 and 8,192 tokens of system prompt) the system prompt is
prefilled once (cold); then, several times, a new ~20-token user question is asked after it (warm:
everything but the question hits) and, interleaved, a question alone (no system prompt: nothing
to reuse, a prompt of about the same number of new tokens). Each request is timed stage by stage,
in one process, on the offline engine (no HTTP):

* render: the chat template (``Tokenizer.render_chat``);
* tokenize: the rendered text to ids (``Tokenizer.encode`` with a scope, as ``LLM.chat`` and the
  server call it: a prefix the scope's earlier prompts tokenized is not tokenized again);
* hash + lookup: the scheduler's step (block hashes, the prefix cache lookup, allocation);
* tail prefill + first token: the forward pass over the uncached tokens and the sampling;
* the rest of the engine step (outputs, bookkeeping).

The question alone is rendered with the template's default system prompt where the template has
one (SmolLM2's does): its first full blocks hit like any repeated prefix, and the table says how
many.

The article's promise is that a hit costs "a few milliseconds of cache lookup": the target here is
a warm TTFT at most 1.5x the question alone's. What a warm request cannot avoid is the attention of
its new tokens over the cached context (about 4 x new x context x hidden multiply-adds a layer),
which the question alone does not have; the table prints it.

    .venv/bin/python benchmarks/bench_warm.py [--model FILE.gguf] [--contexts 4096,8192]
        [--repeats 5] [--threads 2]

Writes benchmarks/results/warm_<model>.json and prints a markdown table (stdout).
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from common import log, median  # noqa: E402

TARGET_RATIO = 1.5  # warm TTFT over the question alone's, at most
STAGES = ("render", "tokenize", "hash + lookup", "tail prefill + first token", "rest of the step")


class StageTimer:
    """Wraps the engine's scheduler and runner to time one request's stages."""

    def __init__(self, llm):
        self.engine, self.tok = llm.engine, llm.tokenizer
        self.t: dict[str, float] = {}
        sched, run = self.engine.scheduler.schedule, self.engine.runner.run

        def timed(name, fn):
            def wrapper(*a, **kw):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    self.t[name] = self.t.get(name, 0.0) + time.perf_counter() - t0
            return wrapper

        self.engine.scheduler.schedule = timed("hash + lookup", sched)
        self.engine.runner.run = timed("tail prefill + first token", run)

    def ask(self, messages: list[dict]) -> tuple[float, dict[str, float], int, int]:
        """TTFT of ``messages`` (one token generated), its stages, prompt and cached tokens."""
        from hotprefix.request.sampling import SamplingParams

        self.t = {}
        t0 = time.perf_counter()
        text = self.tok.render_chat(messages)
        t1 = time.perf_counter()
        ids = self.tok.encode(text, add_special_tokens=False, scope="")  # as LLM.chat and the server
        t2 = time.perf_counter()
        rid = self.engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0)).request_id
        out = None
        while out is None:
            for o in self.engine.step():
                if o.request_id == rid and o.finished:
                    out = o
        t3 = time.perf_counter()
        stages = {"render": t1 - t0, "tokenize": t2 - t1, **self.t}
        stages["rest of the step"] = (t3 - t2) - sum(self.t.values())
        return t3 - t0, stages, len(ids), out.num_cached_tokens


def system_text(tok, n: int) -> str:
    """About ``n`` tokens of a policy handbook, as text."""
    return tok.decode(common.text_tokens(tok, n, seed=7))


def main() -> None:
    ap = common.base_parser(__doc__)
    ap.add_argument("--contexts", default="4096,8192", help="comma-separated system-prompt sizes")
    common.add_model_argument(ap)
    ap.add_argument("--chat-template", default=None,
                    help="a Jinja chat template for a model whose file has none (Gemma 3 270M: "
                         "benchmarks/gemma_chat_template.jinja)")
    args = ap.parse_args()
    common.setup_threads(args.threads)
    repeats = args.repeats or 5
    contexts = [int(x) for x in args.contexts.split(",")]
    load_at_start = os.getloadavg()
    from hotprefix.config.sections import ConfigError

    try:
        llm = common.load_hotprefix(args.threads, model=args.model, max_model_len=max(contexts) + 512,
                                    max_num_batched_tokens=max(contexts) + 512,
                                    chat_template=args.chat_template)
    except ConfigError:  # more than the model's positions: its own length, the contexts cut below
        llm = common.load_hotprefix(args.threads, model=args.model,
                                    max_num_batched_tokens=max(contexts) + 512,
                                    chat_template=args.chat_template)
    limit = llm.engine.max_model_len - 128  # room for the template and the question
    if max(contexts) > limit:
        log(f"  contexts above the model's {llm.engine.max_model_len} positions cut to {limit}")
        contexts = sorted({min(n, limit) for n in contexts})
    timer, tok = StageTimer(llm), llm.tokenizer
    per = 2 * repeats + 1  # questions a context asks: each new, so that none is cached
    questions = [tok.decode(common.question_tokens(tok, 20, seed=100 + i))
                 for i in range(per * len(contexts) + 1)]
    timer.ask([{"role": "user", "content": questions[-1]}])  # warm-up: kernels, allocator
    rows, results = [], {}
    for c, n in enumerate(contexts):
        q = questions[c * per:(c + 1) * per]
        system = {"role": "system", "content": system_text(tok, n)}
        timer.ask([system, {"role": "user", "content": q[-1]}])  # cold: the prefix is cached
        warm, alone = [], []
        for i in range(repeats):  # interleaved, so that noise hits both alike
            warm.append(timer.ask([system, {"role": "user", "content": q[2 * i]}]))
            alone.append(timer.ask([{"role": "user", "content": q[2 * i + 1]}]))
            log(f"  {n}: warm {warm[-1][0] * 1e3:.1f} ms ({warm[-1][3]} of {warm[-1][2]} cached), "
                f"alone {alone[-1][0] * 1e3:.1f} ms")
        w, a = median([x[0] for x in warm]), median([x[0] for x in alone])
        ws = {s: median([x[1].get(s, 0.0) for x in warm]) for s in STAGES}
        as_ = {s: median([x[1].get(s, 0.0) for x in alone]) for s in STAGES}
        new = median([x[2] - x[3] for x in warm])
        results[str(n)] = {"warm_ttft_s": w, "alone_ttft_s": a, "ratio": w / a, "warm_stages_s": ws,
                           "alone_stages_s": as_, "prompt_tokens": warm[0][2], "cached_tokens": warm[0][3],
                           "new_tokens_warm": new, "prompt_tokens_alone": alone[0][2]}
        rows.append([f"{warm[0][3]:,} cached + {new} new", f"{w * 1e3:.1f}", f"{a * 1e3:.1f} ({alone[0][2]} tokens, {alone[0][3]} cached)",
                     f"**{w / a:.2f}x**", "PASS" if w / a <= TARGET_RATIO else "MISS"]
                    + [f"{ws[s] * 1e3:.1f} / {as_[s] * 1e3:.1f}" for s in STAGES])
    head = ["warm prompt", "warm TTFT ms", "question alone ms", "warm / alone", f"<= {TARGET_RATIO}x"] + \
           [f"{s} ms (warm / alone)" for s in STAGES]
    table = common.md_table(head, rows)
    model = os.path.basename(common.default_model_file(args.model)[0].rstrip(os.sep))
    table += (f"\n\n_Model: {model}, kernels {llm.engine.runner.model.quant_layers.lib.isa if getattr(llm.engine.runner.model, 'quant_layers', None) else '-'}. "
              f"CPU: {common.cpu_description()}. {args.threads} threads, median of {repeats}, warm and "
              f"alone interleaved. Load average at the start: "
              f"{' '.join(f'{x:.2f}' for x in load_at_start)}._")
    print(table)
    env = common.environment(args.threads, False)
    common.write_json(args.out or os.path.join(common.RESULTS_DIR, f"warm_{os.path.splitext(model)[0]}.json"),
                      {"benchmark": "warm", "environment": env, "model": model, "repeats": repeats,
                       "results": results, "target_ratio": TARGET_RATIO, "markdown": table})


if __name__ == "__main__":
    main()
