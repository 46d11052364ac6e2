"""Raw engine speed (issue 2): hotprefix vs Hugging Face transformers on the default model.

What it measures, in ONE process, with the same torch thread count for every contender:

* prefill tokens/s at 512 / 2048 / 4096 prompt tokens (4096 / 1024 / 2048... see --quick), taken
  from time-to-first-token: a request with ``max_tokens=1`` whose prompt is prefilled in a single
  step (``max_num_batched_tokens=4096``); prefix caching is OFF so every prefill is computed.
  transformers: one forward over the prompt with a KV cache and ``logits_to_keep=1`` + argmax
  (its strongest path for a first token).
* decode at batch 1 (ms/token, 64 greedy tokens, ``ignore_eos``) and at batch 16 (total generated
  tokens/s over the decode steps only; 16 different prompts of 96..128 tokens). transformers: a
  hand-written greedy loop over its KV cache (batch 16: left padding, attention mask and
  position ids), timing only the decode steps.

Contenders: hotprefix fp32 (the default on CPU), hotprefix ``dtype="bfloat16"`` (extra row), and
transformers fp32 (``AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., torch_dtype=float32)``).
Prompts are real tokenized text (a generated policy handbook), never random ids. Every model is
loaded once and warmed up once; each measurement is repeated (default 3) with the contenders
interleaved inside each repetition, and the median is reported, so the ratios printed side by side
come from the same run even on a noisy machine.

Targets printed next to the figures: prefill >= 1.0x transformers at every length; batch-1 decode
<= 40 ms/token; batch-16 decode >= 150 tokens/s total. Earlier measurements of transformers and of
llama.cpp's server on this machine are printed as static reference rows (NOT from this run).

Run (from the repository root):

    .venv/bin/python benchmarks/bench_engine.py [--quick] [--threads 2] [--repeats 3] [--no-bf16]

Writes benchmarks/results/engine.json and prints a markdown table (stdout; progress on stderr).
A full run takes about 5-7 minutes on 2 cores; ``--quick`` about 2.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from common import log, median  # noqa: E402

TARGET_PREFILL_RATIO = 1.0
TARGET_B1_MS = 40.0
TARGET_B16_TPS = 150.0

# Earlier measurements on this machine (NOT this run): printed as reference rows only.
REFERENCE = {
    "transformers fp32 (earlier measurement)": {
        "prefill_tps": {"512": "290-357", "2048": "250-276", "4096": "175-233 (at 4,000)"},
        "decode_b1_ms": "135", "decode_b16_tps": "-"},
    "llama.cpp server, same GGUF (earlier measurement)": {
        "prefill_tps": {"512": "177", "2048": "144", "4096": "101 (at 4,000)"},
        "decode_b1_ms": "21", "decode_b16_tps": "-"},
}


# --------------------------------------------------------------------------- hotprefix
class HotprefixContender:
    def __init__(self, name: str, llm, prefill_only: bool = False):
        self.name = name
        self.llm = llm
        self.prefill_only = prefill_only  # deterministic mode: its cost is a prefill question

    def prefill_tps(self, ids: list[int]) -> float:
        from hotprefix.sampling import SamplingParams

        out = self.llm.generate(ids, SamplingParams(max_tokens=1), use_tqdm=False)[0]
        assert out.num_cached_tokens == 0, "prefix caching should be off in this benchmark"
        return len(ids) / out.ttft_s

    def decode(self, prompts: list[list[int]], n_out: int) -> dict[str, float]:
        """Greedy decode of n_out tokens for every prompt at once."""
        from hotprefix.sampling import SamplingParams

        params = SamplingParams(max_tokens=n_out, ignore_eos=True)
        wall, outs = common.timed(lambda: self.llm.generate(prompts, params, use_tqdm=False))
        assert all(len(o.token_ids) == n_out for o in outs)
        # decode span: from the last request's first token to the last token of any request
        first = max(o.ttft_s for o in outs)
        last = max(o.ttft_s + sum(o.token_latencies_s) for o in outs)
        n_dec = sum(len(o.token_latencies_s) for o in outs)
        span = last - first
        return {"decode_tps": n_dec / span, "ms_per_step": 1000 * span / (n_out - 1),
                "e2e_tps": len(prompts) * n_out / wall}


# --------------------------------------------------------------------------- transformers
class TransformersContender:
    name = "transformers fp32"

    def __init__(self, model):
        self.model = model

    def prefill_tps(self, ids: list[int]) -> float:
        import torch

        x = torch.tensor([ids])
        with torch.inference_mode():
            t0 = time.perf_counter()
            out, _ = common.hf_forward(self.model, input_ids=x, logits_to_keep=1)
            int(out.logits[0, -1].argmax())
            dt = time.perf_counter() - t0
        return len(ids) / dt

    def decode(self, prompts: list[list[int]], n_out: int) -> dict[str, float]:
        """Batched greedy loop: left padding + attention mask + position ids; times decode only."""
        import torch

        b = len(prompts)
        width = max(len(p) for p in prompts)
        ids = torch.zeros((b, width), dtype=torch.long)
        mask = torch.zeros((b, width), dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.inference_mode():
            t0 = time.perf_counter()
            out, past = common.hf_forward(self.model, input_ids=ids, attention_mask=mask,
                                          position_ids=pos, logits_to_keep=1)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            t1 = time.perf_counter()
            pos = pos[:, -1:]
            for _ in range(n_out - 1):
                mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype)], dim=1)
                pos = pos + 1
                out, past = common.hf_forward(self.model, past, input_ids=nxt, attention_mask=mask,
                                              position_ids=pos)
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            t2 = time.perf_counter()
        span = t2 - t1
        return {"decode_tps": b * (n_out - 1) / span, "ms_per_step": 1000 * span / (n_out - 1),
                "e2e_tps": b * n_out / (t2 - t0)}


# --------------------------------------------------------------------------- main
def main() -> None:
    ap = common.base_parser(__doc__)
    ap.add_argument("--no-bf16", action="store_true", help="skip the hotprefix bfloat16 contender")
    ap.add_argument("--no-transformers", action="store_true", help="skip transformers")
    ap.add_argument("--no-deterministic", action="store_true",
                    help="skip the deterministic-mode prefill contender")
    args = ap.parse_args()
    common.setup_threads(args.threads)
    if args.quick:
        lengths, n_out, batch, repeats = [128, 256, 512], 16, 4, args.repeats or 2
    else:
        lengths, n_out, batch, repeats = [512, 2048, 4096], 64, 16, args.repeats or 3
    max_batched = max(4096, max(lengths))

    log("loading models ...")
    contenders = [HotprefixContender("hotprefix fp32", common.load_hotprefix(
        args.threads, enable_prefix_caching=False, max_num_batched_tokens=max_batched))]
    if not args.no_bf16:
        contenders.append(HotprefixContender("hotprefix bf16", common.load_hotprefix(
            args.threads, dtype="bfloat16", enable_prefix_caching=False,
            max_num_batched_tokens=max_batched)))
    if not args.no_deterministic:
        contenders.append(HotprefixContender("hotprefix fp32 deterministic", common.load_hotprefix(
            args.threads, deterministic=True, enable_prefix_caching=False,
            max_num_batched_tokens=max_batched), prefill_only=True))
    if not args.no_transformers:
        contenders.append(TransformersContender(common.load_transformers()))
    tok = contenders[0].llm.tokenizer

    # one warm-up per contender (allocator, kernels, lazy init)
    warm = common.text_tokens(tok, 96, seed=999)
    for c in contenders:
        t, _ = common.timed(lambda: (c.prefill_tps(warm), None if getattr(c, "prefill_only", False)
                                     else c.decode([warm, warm[:80]], 4)))
        log(f"  warm-up {c.name}: {t:.1f}s")

    names = [c.name for c in contenders]
    prefill = {n: {str(L): [] for L in lengths} for n in names}
    dec1 = {n: [] for n in names}
    dec16 = {n: [] for n in names}
    seed = 0
    t_start = time.perf_counter()
    for rep in range(repeats):
        order = contenders[rep % len(contenders):] + contenders[:rep % len(contenders)]
        for L in lengths:
            seed += 1
            ids = common.text_tokens(tok, L, seed=seed)  # new text each repetition
            for c in order:
                tps = c.prefill_tps(ids)
                prefill[c.name][str(L)].append(tps)
                log(f"  rep {rep} prefill {L:5d}  {c.name:18s} {tps:8.1f} tok/s")
        seed += 1
        p1 = [common.text_tokens(tok, 128, seed=seed)]
        order = [c for c in order if not getattr(c, "prefill_only", False)]
        for c in order:
            r = c.decode(p1, n_out)
            dec1[c.name].append(r)
            log(f"  rep {rep} decode b1      {c.name:18s} {r['ms_per_step']:8.1f} ms/token")
        pb = [common.text_tokens(tok, 96 + (32 * i) // batch, seed=seed * 100 + i) for i in range(batch)]
        for c in order:
            r = c.decode(pb, n_out)
            dec16[c.name].append(r)
            log(f"  rep {rep} decode b{batch:<3d}    {c.name:18s} {r['decode_tps']:8.1f} tok/s "
                f"({r['ms_per_step']:.1f} ms/step)")
    elapsed = time.perf_counter() - t_start

    res: dict[str, dict] = {}
    for n in names:
        if not dec1[n]:  # prefill-only contender
            res[n] = {"prefill_tps": {L: median(v) for L, v in prefill[n].items()},
                      "prefill_tps_all": prefill[n], "decode_b1_ms_per_token": None,
                      f"decode_b{batch}_tps": None}
            continue
        res[n] = {
            "prefill_tps": {L: median(v) for L, v in prefill[n].items()},
            "prefill_tps_all": prefill[n],
            "decode_b1_ms_per_token": median([r["ms_per_step"] for r in dec1[n]]),
            f"decode_b{batch}_tps": median([r["decode_tps"] for r in dec16[n]]),
            f"decode_b{batch}_ms_per_step": median([r["ms_per_step"] for r in dec16[n]]),
            f"e2e_b{batch}_tps": median([r["e2e_tps"] for r in dec16[n]]),
        }
    hf = "transformers fp32"
    ratios: dict[str, dict] = {}
    if hf in res:
        for n in names:
            if n == hf:
                continue
            if res[n]["decode_b1_ms_per_token"] is None:
                ratios[n] = {"prefill_vs_transformers": {
                    L: res[n]["prefill_tps"][L] / res[hf]["prefill_tps"][L] for L in res[n]["prefill_tps"]}}
                continue
            ratios[n] = {
                "prefill_vs_transformers": {L: res[n]["prefill_tps"][L] / res[hf]["prefill_tps"][L]
                                            for L in res[n]["prefill_tps"]},
                "decode_b1_speedup_vs_transformers":
                    res[hf]["decode_b1_ms_per_token"] / res[n]["decode_b1_ms_per_token"],
                f"decode_b{batch}_vs_transformers":
                    res[n][f"decode_b{batch}_tps"] / res[hf][f"decode_b{batch}_tps"],
            }

    # ---------------------------------------------------------------- tables
    Ls = [str(L) for L in lengths]
    header = ["contender"] + [f"prefill {L} (tok/s)" for L in Ls] + \
             ["decode b1 (ms/token)", f"decode b{batch} (tok/s)"]
    rows = []
    for n in names:
        r = res[n]
        rows.append([f"**{n}**" if n.startswith("hotprefix") else n]
                    + [r["prefill_tps"][L] for L in Ls]
                    + [r["decode_b1_ms_per_token"] or "-", r[f"decode_b{batch}_tps"] or "-"])
    for n, ref in REFERENCE.items():
        rows.append([f"_{n}_"] + [ref["prefill_tps"].get(str(L), "-") if not args.quick else "-"
                                  for L in (512, 2048, 4096)][:len(Ls)]
                    + [ref["decode_b1_ms"], ref["decode_b16_tps"]])
    lines = [common.md_table(header, rows), ""]
    if ratios:
        rheader = ["ratio vs transformers (same run)"] + [f"prefill {L}" for L in Ls] + \
                  ["decode b1 speedup", f"decode b{batch}"]
        rrows = []
        for n, rt in ratios.items():
            dec = ([f"{rt['decode_b1_speedup_vs_transformers']:.2f}x",
                    f"{rt[f'decode_b{batch}_vs_transformers']:.2f}x"]
                   if "decode_b1_speedup_vs_transformers" in rt else ["-", "-"])
            rrows.append([n] + [f"{rt['prefill_vs_transformers'][L]:.2f}x" for L in Ls] + dec)
        lines += [common.md_table(rheader, rrows), ""]
    # targets (the default contender: hotprefix fp32)
    main_r = res["hotprefix fp32"]
    checks = []
    if "hotprefix fp32" in ratios:
        worst = min(ratios["hotprefix fp32"]["prefill_vs_transformers"].values())
        checks.append(["prefill vs transformers, every length", f">= {TARGET_PREFILL_RATIO:.1f}x",
                       f"{worst:.2f}x (worst)", "PASS" if worst >= TARGET_PREFILL_RATIO else "FAIL"])
    b1 = main_r["decode_b1_ms_per_token"]
    checks.append(["decode batch 1", f"<= {TARGET_B1_MS:.0f} ms/token", f"{b1:.1f} ms/token",
                   "PASS" if b1 <= TARGET_B1_MS else "FAIL"])
    bN = main_r[f"decode_b{batch}_tps"]
    checks.append([f"decode batch {batch}", f">= {TARGET_B16_TPS:.0f} tok/s", f"{bN:.0f} tok/s",
                   ("PASS" if bN >= TARGET_B16_TPS else "FAIL") + (" (quick: batch 4)" if args.quick else "")])
    lines += [common.md_table(["target (hotprefix fp32)", "target", "measured", "result"], checks), ""]
    mode = "quick run, noisy" if args.quick else "full run"
    lines.append(f"_{mode}: {args.threads} torch threads, median of {repeats} interleaved "
                 f"repetitions, {n_out} output tokens for decode; rows in italics are earlier "
                 f"measurements on this machine, not this run. Decode tok/s counts decode steps "
                 f"only (prefill excluded)._")
    table = "\n".join(lines)
    print(table)

    env = common.environment(args.threads, args.quick)
    env["elapsed_s"] = elapsed
    common.write_json(args.out or os.path.join(common.RESULTS_DIR, "engine.json"), {
        "benchmark": "engine", "environment": env, "repeats": repeats, "prompt_lengths": lengths,
        "decode_tokens": n_out, "batch": batch, "results": res, "ratios": ratios,
        "targets": {"prefill_ratio_min": TARGET_PREFILL_RATIO, "decode_b1_ms_max": TARGET_B1_MS,
                    "decode_b16_tps_min": TARGET_B16_TPS},
        "checks": checks, "reference_earlier_measurements": REFERENCE, "markdown": table})


if __name__ == "__main__":
    main()
