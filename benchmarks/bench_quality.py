"""Output quality per dtype / weights mode (issue 13): top-1 agreement and mean KL divergence
against transformers float32 on the same GGUF, under teacher forcing over held-back text.

For each hotprefix mode, every position of every window (default 2,048 positions in windows of
512 tokens) is scored: our logits (one fresh prefill per window through the engine's own model,
``hotprefix.tools.quality.all_position_logits``) against transformers' float32 logits of the same
window. Printed: mode, top-1 agreement, mean and max KL(transformers || ours), positions, and the
bytes of the weight tensors the mode keeps in memory.

Text: the prefix-caching article (``../shared/mission``) then the README, tokenized with the
model's tokenizer (no special tokens); none of it is in the model's training data. It is scored
as plain text, never through a chat template (so a base model without one, such as Gemma 3 270M,
is scored the same way; the output says when the model has no template). Where the tokenizer
starts every text with a BOS token (Gemma's does; the default SmolLM2's does not), each window
starts with it, as the model saw its training text.

``--model NAME_OR_PATH`` scores another model (a GGUF file, a Hugging Face directory, or
``gemma3-270m``) against transformers on the same file; its default modes are ``default`` alone
(``--modes`` picks more).

Modes are ``DTYPE[:WEIGHTS][@KV]`` (``float32``, ``bfloat16``, ``bfloat16:int8``, ``default@int8``;
``default`` = no option given, the configuration a user gets; ``@KV`` the KV pool's element type,
``--kv-cache-dtype``). The table names each mode's KV element type and bytes per cached token. ``--break scale|zero-layer`` damages the loaded
weights (all scaled by 1.01; one layer's MLP zeroed) to check the harness catches a broken
dequantization: the scores must collapse.

Run (from the repository root):

    .venv/bin/python benchmarks/bench_quality.py [--modes default,float32,bfloat16] [--positions 2048]
        [--model gemma3-270m | --model FILE.gguf]

Writes benchmarks/results/quality.json and prints a markdown table (stdout; progress on stderr).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import numpy as np  # noqa: E402
from common import log  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TEXTS = [os.path.join(ROOT, "..", "shared", "mission", "prefix-caching-article.txt"),
         os.path.join(ROOT, "README.md")]
# The modes of the quality table; with the weights option (issue 13) its modes join them.
MODES = ["default", "default@int8", "bfloat16:mixed", "float32", "bfloat16:dense"]
WEIGHT_MODES = ["default:int8", "default:int4"]
BREAKS = ("scale", "zero-layer")


def scaled_blocks(qtype: str, raw, factor: float):
    """GGUF blocks [rows, bytes] with every block's scale (and Q4_1's offset) times ``factor``."""
    from hotprefix.model.qlinear import BLOCK_BYTES

    b = raw.reshape(raw.shape[0], -1, BLOCK_BYTES[qtype]).copy()
    fields = 4 if qtype == "Q4_1" else 2  # fp16 d (and m) open each block
    head = b[..., :fields].copy().view(np.float16)
    b[..., :fields] = (head.astype(np.float32) * factor).astype(np.float16).view(np.uint8)
    return b.reshape(raw.shape)


def damage(kind: str) -> None:
    """Make every later model load return damaged weights (a stand-in for a broken dequantization)."""
    import torch

    import hotprefix.engine.engine as engine_mod

    load = engine_mod.load_model

    def broken(*a, **kw):
        loaded = load(*a, **kw)
        w, blocks = loaded.weights, loaded.blocks  # the gguf mode multiplies with the blocks
        if kind == "scale":
            for name, t in w.items():
                if t.dim() == 2 and name != "model.embed_tokens.weight":
                    w[name] = t * 1.01
            for name, (qtype, raw) in blocks.items():
                if name != "model.embed_tokens.weight":
                    blocks[name] = (qtype, scaled_blocks(qtype, raw, 1.01))
        else:
            layer = loaded.arch.num_layers // 2
            name = f"model.layers.{layer}.mlp.down_proj.weight"
            w[name] = torch.zeros_like(w[name])
            if name in blocks:
                blocks[name] = (blocks[name][0], np.zeros_like(blocks[name][1]))
        log(f"  weights damaged: {kind}")
        return loaded

    engine_mod.load_model = broken


def main() -> None:
    from hotprefix import LLM
    from hotprefix.tools import quality

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default=None,
                    help="comma-separated DTYPE[:WEIGHTS][@KV] modes (default: "
                         f"{','.join(MODES)}, plus {','.join(WEIGHT_MODES)} when the weights option exists)")
    ap.add_argument("--positions", type=int, default=2048, help="token positions scored (default 2048)")
    ap.add_argument("--window", type=int, default=quality.DEFAULT_WINDOW,
                    help=f"tokens per window (default {quality.DEFAULT_WINDOW})")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--text", action="append", default=None,
                    help="a text file to score on (repeatable; default: the article, then the README)")
    ap.add_argument("--break", dest="break_", choices=BREAKS, default=None,
                    help="damage the weights to check the harness catches it (not a measurement)")
    ap.add_argument("--out", default=None, help="JSON result path (default benchmarks/results/"
                    "quality.json; another --model: quality_<file stem>.json)")
    common.add_model_argument(ap)
    args = ap.parse_args()
    common.setup_threads(args.threads)

    default_model = common.is_default_model(args.model)
    if args.modes:
        specs = args.modes.split(",")
    elif default_model:
        specs = MODES + (WEIGHT_MODES if quality.supports_weights_option() else [])
    else:
        specs = ["default"]  # the weight modes are the default model's question
    modes = [quality.QualityMode.parse(s) for s in specs]
    for m in modes:
        m.llm_options()  # a weights mode without the option fails here, before any loading
    if args.break_:
        damage(args.break_)

    paths = [p for p in (args.text or TEXTS) if os.path.exists(p)]
    texts = [open(p, encoding="utf-8").read() for p in paths]
    model_path = common.default_model_file(args.model)[0]
    t0 = time.perf_counter()
    ref_model = quality.load_reference(model_path)
    log(f"transformers fp32 loaded in {time.perf_counter() - t0:.1f}s")

    results, windows, refs = [], None, None
    for m in modes:
        t0 = time.perf_counter()
        llm = LLM(args.model, num_threads=args.threads, kv_cache_memory="16MiB",
                  enable_prefix_caching=False, **m.llm_options())
        runner = llm.engine.runner
        if windows is None:
            windows = quality.windows_from_text(llm.tokenizer, texts, args.positions, args.window)
            start = llm.tokenizer.encode("", add_special_tokens=True)  # [BOS] where one is added
            windows = [start + w for w in windows]
            no_template = not llm.tokenizer.chat_template
            counts = [len(llm.tokenizer.encode(t, add_special_tokens=False)) for t in texts]
            paths = [p for i, p in enumerate(paths) if sum(counts[:i]) < args.positions]  # those used
            t1 = time.perf_counter()
            refs = [quality.reference_logits(ref_model, w) for w in windows]
            log(f"reference logits: {len(windows)} windows in {time.perf_counter() - t1:.1f}s")
            del ref_model
            gc.collect()
        r = quality.evaluate(runner, windows, refs, m.name)
        dtype = str(runner.dtype).replace("torch.", "")
        results.append((r, dtype, runner.kv_dtype.name, runner.bytes_per_token))
        log(f"  {m.name} ({dtype}): top-1 {r.top1_agreement:.2%}, mean KL {r.mean_kl:.3g} "
            f"({time.perf_counter() - t0:.1f}s)")
        del llm, runner
        gc.collect()

    rows = [[r.mode, dtype, kv, f"{bpt:,}", f"{r.top1_agreement:.2%}", f"{r.mean_kl:.2e}",
             f"{r.max_kl:.2e}", r.num_positions, f"{r.weight_bytes / 2**20:,.0f} MiB"]
            for r, dtype, kv, bpt in results]
    table = common.md_table(["mode", "compute dtype", "KV dtype", "KV bytes/token", "top-1 agreement",
                             "mean KL", "max KL", "positions", "weight memory"], rows)
    model_name = os.path.basename(model_path.rstrip(os.sep))
    text_note = (" as plain text (no chat template: the model has none)" if no_template
                 else " as plain text (no chat template)")
    bos_note = f", each window after the tokenizer's {len(start)} start token(s)" if start else ""
    note = (f"_{model_name} against transformers fp32 on the same file, teacher forcing over "
            f"{', '.join(os.path.basename(p) for p in paths)}{text_note} in windows of "
            f"{args.window} tokens{bos_note}; "
            f"KL(transformers || ours) in nats; weight memory = bytes of the model's weight tensors "
            f"(a packed copy of a tied LM head counts)._")
    if args.break_:
        note += f"\n\n**weights damaged on purpose ({args.break_}): not a measurement.**"
    print(table + "\n\n" + note)

    if args.break_ and not args.out:
        return  # a check of the harness, not a result to keep
    env = common.environment(args.threads, quick=False)
    default_out = "quality.json" if default_model else \
        f"quality_{os.path.splitext(model_name)[0]}.json"
    common.write_json(args.out or os.path.join(common.RESULTS_DIR, default_out), {
        "benchmark": "quality", "environment": env, "model": model_name,
        "plain_text_no_chat_template": no_template, "start_tokens": start,
        "texts": [os.path.basename(p) for p in paths],
        "window": args.window, "damaged": args.break_,
        "results": [{**r.__dict__, "compute_dtype": dtype, "kv_cache_dtype": kv,
                     "kv_bytes_per_token": bpt} for r, dtype, kv, bpt in results],
        "markdown": table})


if __name__ == "__main__":
    main()
