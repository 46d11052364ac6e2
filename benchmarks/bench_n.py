"""n=4 on one prefill against four separate requests, and the cost of prompt log probabilities.

Three ways to get four sampled answers to one long prompt, each from an empty cache, one after the
other in this process (same model, same threads):

  * ``n=4``: one request; the prompt is computed once and the four sequences fork from its blocks;
  * ``4 requests``: four requests sent together (seeds ``choice_seed(seed, i)``, so the same four
    answers); with prefix caching on, three of them wait for the first's blocks and read them;
  * ``4 requests, no cache``: the same with prefix caching off (each computes the whole prompt).

Reported per way (median of ``--repeats``): wall time, time to the last first token (every
choice has one), tokens the forward passes computed, blocks written to the cache. Then a warm
request with and without ``prompt_logprobs`` (the latter skips the cache read).

Writes benchmarks/results/n_fork.json.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def run(llm, prompts, params):
    """(wall s, slowest TTFT s, forward tokens, written blocks, outputs)"""
    counted = []
    llm.engine.on_step.append(lambda s: counted.append(s["num_tokens"]))
    before = llm.cache_stats()["written_blocks"]
    t0 = time.perf_counter()
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.engine.on_step.pop()
    wall = time.perf_counter() - t0
    written = llm.cache_stats()["written_blocks"] - before
    return wall, max(o.ttft_s for o in outs), sum(counted), written, outs


def main() -> None:
    p = common.base_parser(__doc__)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()
    if args.quick:
        args.prompt_tokens, args.max_tokens = 200, 8
    repeats = args.repeats or (1 if args.quick else 3)
    common.setup_threads(args.threads)
    from hotprefix import SamplingParams
    from hotprefix.request.sampling import choice_seed

    cached = common.load_hotprefix(args.threads)
    plain = common.load_hotprefix(args.threads, enable_prefix_caching=False)
    prompt = common.text_tokens(cached.tokenizer, args.prompt_tokens, seed=1)
    kw = dict(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True)
    ways = {
        "n=4": (cached, [prompt], SamplingParams(n=4, seed=7, **kw)),
        "4 requests": (cached, [prompt] * 4, [SamplingParams(seed=choice_seed(7, i), **kw) for i in range(4)]),
        "4 requests, no cache": (plain, [prompt] * 4,
                                 [SamplingParams(seed=choice_seed(7, i), **kw) for i in range(4)]),
    }
    res: dict = {"env": common.environment(args.threads, args.quick), "prompt_tokens": len(prompt),
                 "max_tokens": args.max_tokens, "ways": {}}
    answers = {}
    rows = []
    for name, (llm, prompts, params) in ways.items():
        runs = []
        for _ in range(repeats):
            llm.reset_prefix_cache()
            runs.append(run(llm, prompts, params))
        wall = common.median([r[0] for r in runs])
        ttft = common.median([r[1] for r in runs])
        toks, written, outs = runs[-1][2], runs[-1][3], runs[-1][4]
        answers[name] = [c.token_ids for o in outs for c in o.outputs]
        res["ways"][name] = {"wall_s": wall, "last_ttft_s": ttft, "forward_tokens": toks,
                             "written_blocks": written}
        rows.append([name, wall, ttft, toks, written])
        common.log(f"  {name}: {wall:.2f}s, TTFT {ttft:.2f}s, {toks} tokens, {written} blocks")
    res["same_answers"] = answers["n=4"] == answers["4 requests"] == answers["4 requests, no cache"]
    # prompt log probabilities: a warm prompt read from cache, or recomputed for its logits
    one = SamplingParams(max_tokens=1)
    cached.reset_prefix_cache()
    cached.generate([prompt], one, use_tqdm=False)
    warm = common.median([run(cached, [prompt], one)[0] for _ in range(repeats)])
    plp = common.median([run(cached, [prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
                         for _ in range(repeats)])
    res["prompt_logprobs"] = {"warm_s": warm, "with_prompt_logprobs_s": plp}
    print(common.md_table(["way", "wall s", "last TTFT s", "forward tokens", "blocks written"], rows))
    print(f"\nsame answers: {res['same_answers']}; warm request {warm:.3f}s, with prompt_logprobs "
          f"{plp:.3f}s ({plp / warm:.1f}x); {res['env']['cpu']}")
    common.write_json(args.out or os.path.join(common.RESULTS_DIR, "n_fork.json"), res)


if __name__ == "__main__":
    main()
