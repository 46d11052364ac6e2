"""Raw engine speed (issue 2): hotprefix vs Hugging Face transformers and llama.cpp, on the default
model or on the one ``--model`` names (issue 27: ``--model gemma3-270m``, any GGUF path).

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

Contenders: the hotprefix configurations in ``MODES`` (the first, the default configuration, is
"ours": the targets are about it; ``--dtype`` / ``--weights`` set its options), transformers fp32
(``AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., torch_dtype=float32)``), and llama.cpp
(issue 13) when its ``llama-bench`` is built (``../shared/tools/llamacpp-peer.sh build``, or
``--llamacpp`` builds it): the same GGUF, the same thread count, ``--repack 0``, one llama-bench
process per measurement (with its own warm-up run), interleaved with ours: prefill at each length
(``-p L -n 0``) and batch-1 decode (``-p 0 -n 64 -d 128``: 64 tokens after a 128-token context,
like ours). llama-bench has no batch of separate sequences, so it has no batch-16 figure.
Prompts are real tokenized text (a generated policy handbook), never random ids (llama-bench
uses its own token ids; its speed does not depend on them). Every model is
loaded once and warmed up once; each measurement is repeated (default 3) with the contenders
interleaved inside each repetition, and the median is reported, so the ratios printed side by side
come from the same run even on a noisy machine.

Targets printed next to the figures (the embedded default model; another ``--model`` gets only
issue 27's targets against llama.cpp: batch-1 decode <= 1.0x its ms/token, prefill >= 2.0x its
tokens/s at 512 and 2,048 tokens): prefill >= 1.0x transformers at every length; batch-1 decode
<= 40 ms/token; batch-16 decode >= 150 tokens/s total. Against llama.cpp in the same run (issue
13, 26): batch-1 decode <= 1.0x its ms/token; prefill >= 2.5x its tokens/s at every length; and our
batch-16 decode >= 3x our batch-1 tokens/s, on every CPU (an AVX2-only one included; the CPU's
model, its ISA flags and the kernels' level are printed with the table, and ``HOTPREFIX_ISA=avx2``
measures the AVX2 path on a faster CPU). Earlier measurements of transformers
and of llama.cpp's server on this machine are printed as static reference rows (NOT from this run)
when llama.cpp is not in the run.

Run (from the repository root):

    .venv/bin/python benchmarks/bench_engine.py [--quick] [--threads 2] [--repeats 3] [--skip int8]
        [--dtype bfloat16] [--weights int8] [--llamacpp | --no-llamacpp] [--lengths 512,2048]
        [--model gemma3-270m | --model FILE.gguf] [--modes default,fp32] [--batch 0]

With ``--model`` other than the default, only our default configuration runs (``--modes`` picks
more by label), at 512 and 2,048 tokens, and the static reference rows are left out (they are the
default model's). A GGUF's llama.cpp figures need the file itself (not a Hugging Face directory).

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
# issues 13 and 26, against llama.cpp in the same run
TARGET_LLAMACPP_DECODE = 1.0  # our batch-1 ms/token over llama.cpp's, at most
TARGET_LLAMACPP_PREFILL = 2.5  # our prefill tok/s over llama.cpp's, at least, up to 2,048 tokens
TARGET_LLAMACPP_PREFILL_LONG = 2.5  # ... and above 2,048 tokens
TARGET_BATCH_SCALING = 3.0  # our batch-16 decode tok/s over our batch-1 tok/s, at least
# issue 27, for the models users bring (--model other than the default), against llama.cpp
TARGET_MODEL_DECODE = 1.0  # our batch-1 ms/token over llama.cpp's, at most
TARGET_MODEL_PREFILL = 2.0  # our prefill tok/s over llama.cpp's, at least, at 512 and 2,048 tokens
# (issue 26: the same targets on every CPU, an AVX2-only one included)

PEER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "tools",
                           "llamacpp-peer.sh")

# The hotprefix configurations this run measures: label, LLM options, and whether only its
# prefill is measured. The first is "ours" (the default configuration): the targets and the
# llama.cpp ratios are about it, and --dtype / --weights set its options.
MODES = [
    {"label": "default", "options": {}},  # bf16 where the CPU has native bf16 (probed), else fp32
    {"label": "mixed", "options": {"weights": "mixed"}},  # the default where gguf does not run
    {"label": "fp32", "options": {"dtype": "float32"}},
    {"label": "bf16-dense", "options": {"weights": "dense"}},  # every GEMM in the default dtype
    {"label": "int4", "options": {"weights": "int4"}},
    {"label": "int8", "options": {"weights": "int8"}},
    {"label": "a8", "options": {"activations": "int8"}},  # 8-bit activations in the layer GEMMs
    {"label": "deterministic", "options": {"deterministic": True}, "prefill_only": True},  # --no-deterministic
]

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
        from hotprefix.request.sampling import SamplingParams

        out = self.llm.generate(ids, SamplingParams(max_tokens=1), use_tqdm=False)[0]
        assert out.num_cached_tokens == 0, "prefix caching should be off in this benchmark"
        return len(ids) / out.ttft_s

    def decode(self, prompts: list[list[int]], n_out: int) -> dict[str, float]:
        """Greedy decode of n_out tokens for every prompt at once."""
        from hotprefix.request.sampling import SamplingParams

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


# --------------------------------------------------------------------------- llama.cpp
class LlamaCppContender:
    """llama.cpp's ``llama-bench`` on the same GGUF through ``llamacpp-peer.sh`` (one process per
    measurement, with llama-bench's own warm-up run; ``--repack 0``, see the script)."""

    name = "llama.cpp"
    batch1_only = True  # llama-bench decodes one sequence: no batch-16 figure

    def __init__(self, gguf: str, threads: int, decode_depth: int, repack: bool = False):
        self.gguf, self.threads, self.decode_depth = gguf, threads, decode_depth
        self.build_info = ""
        self.repack = repack  # llama.cpp's default weight repacking (AMX / AVX-512 layouts)
        if repack:
            self.name = "llama.cpp repack"

    @staticmethod
    def locate(build: bool) -> str | None:
        """The llama-bench bin directory, building it first when ``build``; None if not built."""
        import subprocess

        if not os.path.exists(PEER_SCRIPT):
            return None
        r = subprocess.run(["bash", PEER_SCRIPT, "bin"], capture_output=True, text=True)
        if r.returncode == 0:
            return r.stdout.strip()
        if not build:
            return None
        log("building llama.cpp's llama-bench (about 6 minutes on 2 cores) ...")
        r = subprocess.run(["bash", PEER_SCRIPT, "build"], stdout=subprocess.PIPE, text=True)
        if r.returncode != 0:
            raise SystemExit(f"llama.cpp build failed ({PEER_SCRIPT} build, exit {r.returncode})")
        return r.stdout.strip().splitlines()[-1]

    def _bench(self, *args: str) -> dict:
        import json
        import subprocess

        env = {**os.environ, "THREADS": str(self.threads)}
        cmd = ["bash", PEER_SCRIPT, "bench", self.gguf, "-r", "1", *args]
        if self.repack:  # the script pins --repack 0: call llama-bench itself with its default
            bin_dir = subprocess.run(["bash", PEER_SCRIPT, "bin"], capture_output=True, text=True).stdout.strip()
            cmd = [os.path.join(bin_dir, "llama-bench"), "-m", self.gguf, "-t", str(self.threads),
                   "--repack", "1", "-o", "json", "-r", "1", *args]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode != 0:
            raise RuntimeError(f"llama-bench {' '.join(args)} failed (exit {r.returncode}): "
                               f"{r.stderr.strip()[-2000:]}")
        out = json.loads(r.stdout)[0]
        self.build_info = f"llama.cpp {out.get('build_commit', '?')}, {out.get('model_type', '')}"
        return out

    def prefill_tps(self, ids: list[int]) -> float:
        """Prompt processing of as many tokens (llama-bench's own token ids)."""
        return float(self._bench("-p", str(len(ids)), "-n", "0")["avg_ts"])

    def decode(self, prompts: list[list[int]], n_out: int) -> dict[str, float]:
        """Batch-1 decode of n_out tokens after a context of ``decode_depth`` tokens."""
        assert len(prompts) == 1, "llama-bench decodes one sequence"
        tps = float(self._bench("-p", "0", "-n", str(n_out), "-d", str(self.decode_depth))["avg_ts"])
        return {"decode_tps": tps, "ms_per_step": 1000.0 / tps, "e2e_tps": tps}


def mode_name(label: str, llm) -> str:
    """``hotprefix <label> (<compute dtype>[, weights <mode>][, activations <width>])`` from what
    the LLM resolved."""
    dtype = str(llm.engine.runner.dtype).replace("torch.", "")
    weights = getattr(llm.config.model, "weights", None)
    extra = f", weights {weights}" if weights not in (None, "auto") else ""
    if getattr(llm.config.model, "activations", "int16") != "int16":
        extra += f", activations {llm.config.model.activations}"
    return f"hotprefix {label} ({dtype}{extra})"


def roofline(contenders: list, levels: dict, res: dict, Ls: list[str], threads: int) -> str:
    """Our prefill's GEMM multiply-adds per second (tokens/s x the decoder matrices'
    multiply-adds a token: a lower bound on the GEMMs' own rate, as the step's other work is in
    the time) beside the peak of the instruction each kernel level builds on, measured now."""
    import isa_peak

    rows = []
    for c in contenders:
        if c.name not in levels or getattr(c, "prefill_only", False):
            continue
        macs = isa_peak.gemm_macs_per_token(c.llm)
        kind, peak = isa_peak.int16_peak(levels[c.name], threads)
        if not macs or peak is None:
            continue
        got = [res[c.name]["prefill_tps"][L] * macs for L in Ls]
        rows.append([c.name, kind, f"{peak / 1e9:.0f}"] + [f"{g / 1e9:.0f} ({g / peak:.0%})" for g in got])
    if not rows:
        return ""
    head = ["contender", "GEMM built on", f"int16 multiply-add peak, {threads} threads (G/s)"] + \
           [f"prefill {L}: achieved G/s (share of peak)" for L in Ls]
    return common.md_table(head, rows) + ("\n\n_The peak: a loop of independent instructions on every "
                                          "thread (benchmarks/isa_peak.c; AMX: half its int8 rate, two "
                                          "tile products an int16 product). Achieved: prefill tokens/s x "
                                          "the decoder matrices' multiply-adds a token._")


# --------------------------------------------------------------------------- main
def parse_args():
    ap = common.base_parser(__doc__)
    ap.add_argument("--skip", default="",
                    help="comma-separated hotprefix MODES labels to leave out (fp32, int4, int8)")
    ap.add_argument("--no-transformers", action="store_true", help="skip transformers")
    ap.add_argument("--no-deterministic", action="store_true",
                    help="skip the deterministic-mode prefill contender")
    ap.add_argument("--dtype", default=None,
                    help="LLM(dtype=...) of our default configuration (float32, bfloat16, ...)")
    ap.add_argument("--weights", default=None,
                    help="LLM(weights=...) of our default configuration (auto, bf16, int8, int4)")
    peer = ap.add_mutually_exclusive_group()
    peer.add_argument("--llamacpp", action="store_true",
                      help="run llama.cpp as a contender, building it first if needed (~6 min)")
    peer.add_argument("--no-llamacpp", action="store_true", help="skip llama.cpp even if built")
    ap.add_argument("--lengths", default=None,
                    help="comma-separated prefill lengths (default 512,2048,4096, with --model "
                         "512,2048; --quick 128,256,512)")
    ap.add_argument("--modes", default=None,
                    help="comma-separated MODES labels to run (default: all for the default model, "
                         "'default' alone for another --model)")
    ap.add_argument("--batch", type=int, default=None,
                    help="sequences of the batch decode (default 16, --quick 4; 0 leaves it out)")
    ap.add_argument("--isa", default="",
                    help="comma-separated kernel levels (isa.py: avx2, avxvnni, avx512, amx) at which our "
                         "default configuration also runs, as contenders of their own in the same run; "
                         "LABEL@LEVEL runs a MODES label there (a8@avx512)")
    ap.add_argument("--no-repack", action="store_true",
                    help="leave out llama.cpp with its default weight repacking (run with --repack 1 "
                         "beside --repack 0; dropped from the run if it fails on this CPU)")
    common.add_model_argument(ap)
    return ap.parse_args()


def hotprefix_modes(args) -> list[dict]:
    """MODES with the command line applied: --dtype/--weights on the first, skips on the others."""
    from hotprefix.tools.quality import llm_options

    first = {**MODES[0], "options": {**MODES[0]["options"], **llm_options(args.dtype, args.weights)}}
    modes = [first]
    wanted = args.modes.split(",") if args.modes else None
    if wanted is None and not common.is_default_model(args.model):
        wanted = ["default"]  # the weight modes are the default model's question
    for m in MODES[1:]:
        if m["label"] in args.skip.split(",") or (wanted is not None and m["label"] not in wanted):
            continue
        if args.no_deterministic and m["options"].get("deterministic"):
            continue
        if m["options"].get("dtype") is not None and m["options"] == {"dtype": args.dtype}:
            continue  # the same as the first
        modes.append(m)
    return modes


def main_checks(checks: list, rt: dict | None, main_r: dict, batch: int, quick_note: str) -> None:
    """The default model's own targets (issue 2): prefill vs transformers, absolute decode speeds."""
    if rt is not None:
        worst = min(rt["prefill_vs_transformers"].values())
        checks.append(["prefill vs transformers, every length", f">= {TARGET_PREFILL_RATIO:.1f}x",
                       f"{worst:.2f}x (worst)", "PASS" if worst >= TARGET_PREFILL_RATIO else "FAIL"])
    b1 = main_r["decode_b1_ms_per_token"]
    checks.append(["decode batch 1", f"<= {TARGET_B1_MS:.0f} ms/token", f"{b1:.1f} ms/token",
                   "PASS" if b1 <= TARGET_B1_MS else "FAIL"])
    bN = main_r[f"decode_b{batch}_tps"]
    if bN is not None:
        checks.append([f"decode batch {batch}", f">= {TARGET_B16_TPS:.0f} tok/s", f"{bN:.0f} tok/s",
                       ("PASS" if bN >= TARGET_B16_TPS else "FAIL") + quick_note])


def main() -> None:
    from hotprefix.model import fused, isa

    args = parse_args()
    load_at_start = os.getloadavg()
    common.setup_threads(args.threads)
    if args.quick:
        lengths, n_out, batch, repeats = [128, 256, 512], 16, 4, args.repeats or 2
    else:
        lengths, n_out, batch, repeats = [512, 2048, 4096], 64, 16, args.repeats or 3
    default_model = common.is_default_model(args.model)
    model_path = common.default_model_file(args.model)[0]
    if not args.quick and not default_model:
        lengths = [512, 2048]  # issue 27's lengths
    if args.lengths:
        lengths = [int(x) for x in args.lengths.split(",")]
    if args.batch is not None:
        batch = args.batch
    max_batched = max(4096, max(lengths))
    b1_context = 128  # tokens of context before batch-1 decode (ours and llama.cpp's -d)

    peer_bin = None if args.no_llamacpp else LlamaCppContender.locate(build=args.llamacpp)
    if peer_bin is None and not args.no_llamacpp:
        log(f"llama.cpp: not built, run `bash {os.path.normpath(PEER_SCRIPT)} build` "
            "(or pass --llamacpp) to add it as a contender")

    log("loading models ...")
    contenders: list = []
    for m in hotprefix_modes(args):
        llm = common.load_hotprefix(args.threads, model=args.model, enable_prefix_caching=False,
                                    max_num_batched_tokens=max_batched, **m["options"])
        contenders.append(HotprefixContender(mode_name(m["label"], llm), llm,
                                             prefill_only=m.get("prefill_only", False)))
    ours = contenders[0].name  # the default configuration: the targets are about it
    levels = {ours: fused.library().isa}
    for entry in [x for x in args.isa.split(",") if x and x != levels[ours]]:
        label, _, level = entry.rpartition("@")  # LEVEL (our default) or LABEL@LEVEL (a mode's)
        options = (hotprefix_modes(args)[0] if label in ("", "default") else
                   next(m for m in MODES if m["label"] == label))["options"]
        saved = os.environ.get(isa.ISA_ENV)
        os.environ[isa.ISA_ENV] = level  # the kernels are chosen when a model is built
        try:
            llm = common.load_hotprefix(args.threads, model=args.model, enable_prefix_caching=False,
                                        max_num_batched_tokens=max_batched, **options)
        finally:
            if saved is None:
                os.environ.pop(isa.ISA_ENV)
            else:
                os.environ[isa.ISA_ENV] = saved
        name = f"{mode_name(label or 'default', llm)} [{level}]"
        if label in ("", "default"):  # the roofline's peaks are the int16 kernels'
            levels[name] = level
        contenders.append(HotprefixContender(name, llm))
    if not args.no_transformers:
        contenders.append(TransformersContender(common.load_transformers(args.model)))
    peer, repack_failed = None, ""
    if peer_bin is not None and os.path.isdir(model_path):
        log("llama.cpp: left out, it runs GGUF files and the model is a directory")
    elif peer_bin is not None:
        peer = LlamaCppContender(model_path, args.threads, b1_context)
        contenders.append(peer)
        log(f"  llama.cpp: {peer_bin}")
        if not args.no_repack:
            try:
                repacked = LlamaCppContender(model_path, args.threads, b1_context, repack=True)
                repacked.prefill_tps(list(range(64)))  # a trial run: it crashed on AMX machines
                contenders.append(repacked)
            except RuntimeError as e:
                repack_failed = str(e).splitlines()[0][:160]
                log(f"  llama.cpp repack: left out ({repack_failed})")
    tok = contenders[0].llm.tokenizer

    # one warm-up per contender (allocator, kernels, lazy init); llama-bench warms up every run
    warm = common.text_tokens(tok, 96, seed=999)
    for c in contenders:
        if c is peer:
            continue
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
        # every contender in turn at each size (ours, transformers, llama.cpp, ...), the order
        # rotated each repetition, so that noise hits all of them alike
        order = contenders[rep % len(contenders):] + contenders[:rep % len(contenders)]
        for L in lengths:
            seed += 1
            ids = common.text_tokens(tok, L, seed=seed)  # new text each repetition
            for c in order:
                tps = c.prefill_tps(ids)
                prefill[c.name][str(L)].append(tps)
                log(f"  rep {rep} prefill {L:5d}  {c.name:18s} {tps:8.1f} tok/s")
        seed += 1
        p1 = [common.text_tokens(tok, b1_context, seed=seed)]
        order = [c for c in order if not getattr(c, "prefill_only", False)]
        for c in order:
            r = c.decode(p1, n_out)
            dec1[c.name].append(r)
            log(f"  rep {rep} decode b1      {c.name:18s} {r['ms_per_step']:8.1f} ms/token")
        pb = [common.text_tokens(tok, 96 + (32 * i) // batch, seed=seed * 100 + i) for i in range(batch)]
        for c in order:
            if getattr(c, "batch1_only", False) or not batch:
                continue
            r = c.decode(pb, n_out)
            dec16[c.name].append(r)
            log(f"  rep {rep} decode b{batch:<3d}    {c.name:18s} {r['decode_tps']:8.1f} tok/s "
                f"({r['ms_per_step']:.1f} ms/step)")
    elapsed = time.perf_counter() - t_start

    res: dict[str, dict] = {}
    for n in names:
        r = {"prefill_tps": {L: median(v) for L, v in prefill[n].items()}, "prefill_tps_all": prefill[n],
             "decode_b1_ms_per_token": median([x["ms_per_step"] for x in dec1[n]]) if dec1[n] else None,
             f"decode_b{batch}_tps": None}
        if dec16[n]:
            r.update({f"decode_b{batch}_tps": median([x["decode_tps"] for x in dec16[n]]),
                      f"decode_b{batch}_ms_per_step": median([x["ms_per_step"] for x in dec16[n]]),
                      f"e2e_b{batch}_tps": median([x["e2e_tps"] for x in dec16[n]])})
        res[n] = r
    hf = "transformers fp32"
    ratios: dict[str, dict] = {}
    if hf in res:
        for n in names:
            if n in (hf, "llama.cpp"):
                continue
            rt = {"prefill_vs_transformers": {L: res[n]["prefill_tps"][L] / res[hf]["prefill_tps"][L]
                                              for L in res[n]["prefill_tps"]}}
            if res[n]["decode_b1_ms_per_token"] is not None:
                rt["decode_b1_speedup_vs_transformers"] = \
                    res[hf]["decode_b1_ms_per_token"] / res[n]["decode_b1_ms_per_token"]
                rt[f"decode_b{batch}_vs_transformers"] = \
                    res[n][f"decode_b{batch}_tps"] / res[hf][f"decode_b{batch}_tps"] if batch else None
            ratios[n] = rt
    vs_peer: dict[str, dict] = {}
    if peer is not None:
        pr = res[peer.name]
        if "llama.cpp repack" in res:  # llama.cpp at its best of repacking on and off
            rp = res["llama.cpp repack"]
            pr = {"prefill_tps": {L: max(v, rp["prefill_tps"][L]) for L, v in pr["prefill_tps"].items()},
                  "decode_b1_ms_per_token": min(pr["decode_b1_ms_per_token"], rp["decode_b1_ms_per_token"])}
        for n in names:
            if not n.startswith("hotprefix"):
                continue
            rt = {"prefill_vs_llamacpp": {L: res[n]["prefill_tps"][L] / pr["prefill_tps"][L]
                                          for L in res[n]["prefill_tps"]}}
            if res[n]["decode_b1_ms_per_token"] is not None:
                rt["decode_b1_ms_vs_llamacpp"] = res[n]["decode_b1_ms_per_token"] / pr["decode_b1_ms_per_token"]
            vs_peer[n] = rt
    main_r = res[ours]
    scaling = (main_r[f"decode_b{batch}_tps"] / (1000.0 / main_r["decode_b1_ms_per_token"])
               if batch else None)

    # ---------------------------------------------------------------- tables
    Ls = [str(L) for L in lengths]
    header = ["contender"] + [f"prefill {L} (tok/s)" for L in Ls] + \
             ["decode b1 (ms/token)"] + ([f"decode b{batch} (tok/s)"] if batch else [])
    rows = []
    for n in names:
        r = res[n]
        rows.append([f"**{n}**" if n.startswith("hotprefix") else n]
                    + [r["prefill_tps"][L] for L in Ls]
                    + [r["decode_b1_ms_per_token"] or "-"] + ([r[f"decode_b{batch}_tps"] or "-"] if batch else []))
    for n, ref in REFERENCE.items():
        if not default_model or (peer is not None and n.startswith("llama.cpp")):
            continue  # measured in this run, or another model's
        rows.append([f"_{n}_"] + [ref["prefill_tps"].get(str(L), "-") if not args.quick else "-"
                                  for L in (512, 2048, 4096)][:len(Ls)]
                    + [ref["decode_b1_ms"]] + ([ref["decode_b16_tps"]] if batch else []))
    lines = [common.md_table(header, rows), ""]
    if ratios:
        rheader = ["ratio vs transformers (same run)"] + [f"prefill {L}" for L in Ls] + \
                  ["decode b1 speedup", f"decode b{batch}"]
        rrows = []
        for n, rt in ratios.items():
            dec = ([f"{rt['decode_b1_speedup_vs_transformers']:.2f}x",
                    f"{rt[f'decode_b{batch}_vs_transformers']:.2f}x" if batch else "-"]
                   if "decode_b1_speedup_vs_transformers" in rt else ["-", "-"])
            rrows.append([n] + [f"{rt['prefill_vs_transformers'][L]:.2f}x" for L in Ls] + dec)
        lines += [common.md_table(rheader, rrows), ""]
    if vs_peer:
        pheader = ["ratio vs llama.cpp (same run" + (", its best of repack on and off)" if "llama.cpp repack" in res else ")")] + [f"prefill {L} (tok/s, ours/llama.cpp)" for L in Ls] + \
                  ["decode b1 (ms/token, ours/llama.cpp)"]
        prows = [[n] + [f"{rt['prefill_vs_llamacpp'][L]:.2f}x" for L in Ls]
                 + [f"{rt['decode_b1_ms_vs_llamacpp']:.2f}x" if "decode_b1_ms_vs_llamacpp" in rt else "-"]
                 for n, rt in vs_peer.items()]
        lines += [common.md_table(pheader, prows), ""]
    roof = roofline(contenders, levels, res, Ls, args.threads)
    if roof:
        lines += [roof, ""]
    # targets: our default configuration
    checks: list = []
    quick_note = f" (batch {batch})" if batch != 16 else ""
    if default_model:
        main_checks(checks, ratios.get(ours), main_r, batch, quick_note)
    if ours in vs_peer:
        d = vs_peer[ours]["decode_b1_ms_vs_llamacpp"]
        dec_t = TARGET_LLAMACPP_DECODE if default_model else TARGET_MODEL_DECODE
        checks.append(["decode batch 1 vs llama.cpp (ms/token)", f"<= {dec_t:.1f}x",
                       f"{d:.2f}x", "PASS" if d <= dec_t else "MISS"])
        for L in Ls:
            if default_model:
                target = TARGET_LLAMACPP_PREFILL if int(L) <= 2048 else TARGET_LLAMACPP_PREFILL_LONG
            else:
                target = TARGET_MODEL_PREFILL if int(L) <= 2048 else None
            x = vs_peer[ours]["prefill_vs_llamacpp"][L]
            checks.append([f"prefill {L} vs llama.cpp (tok/s)", "-" if target is None else f">= {target:.1f}x",
                           f"{x:.2f}x", "-" if target is None else "PASS" if x >= target else "MISS"])
    else:
        checks.append(["vs llama.cpp", "-", "llama.cpp: not built, run "
                       f"`bash ../shared/tools/llamacpp-peer.sh build`" if peer_bin is None and not
                       args.no_llamacpp else "llama.cpp: not run (--no-llamacpp)" if args.no_llamacpp
                       else "llama.cpp: not run (a GGUF file is needed)", "-"])
    if not batch:
        pass  # --batch 0: no batch decode
    elif default_model:
        checks.append([f"decode batch {batch} over batch 1 (ours, tok/s)", f">= {TARGET_BATCH_SCALING:.0f}x",
                       f"{scaling:.2f}x", ("PASS" if scaling >= TARGET_BATCH_SCALING else "MISS") + quick_note])
    else:
        checks.append([f"decode batch {batch} over batch 1 (ours, tok/s)", "-", f"{scaling:.2f}x", "-"])
    lines += [common.md_table([f"target ({ours})", "target", "measured", "result"], checks), ""]
    mode = "quick run, noisy" if args.quick or args.lengths else "full run"
    if repack_failed:
        peer_note_repack = f" llama-bench with its default repacking (--repack 1) failed on this CPU and is left out: {repack_failed}."
    else:
        peer_note_repack = " 'llama.cpp repack': llama-bench --repack 1 (its default)." if "llama.cpp repack" in res else ""
    peer_note = (f" llama.cpp: {peer.build_info}, llama-bench -t {args.threads} --repack 0, one "
                 f"process per measurement; its decode is {n_out} tokens after a {b1_context}-token "
                 f"context (-d {b1_context}).{peer_note_repack}" if peer is not None else "")
    lines.append(f"_Model: {os.path.basename(model_path)}. CPU: {common.cpu_description()}. "
                 f"Load average at the start: {' '.join(f'{x:.2f}' for x in load_at_start)}._")
    lines.append(f"_{mode}: {args.threads} torch threads, median of {repeats} interleaved "
                 f"repetitions, {n_out} output tokens for decode; rows in italics are earlier "
                 f"measurements on this machine, not this run. Decode tok/s counts decode steps "
                 f"only (prefill excluded).{peer_note}_")
    table = "\n".join(lines)
    print(table)

    env = common.environment(args.threads, args.quick)
    env["elapsed_s"] = elapsed
    env["model"] = os.path.basename(model_path)
    env["load_avg_at_start"] = list(load_at_start)
    if peer is not None:
        env["llamacpp"] = peer.build_info
    default_out = "engine.json" if default_model else \
        f"engine_{os.path.splitext(os.path.basename(model_path.rstrip(os.sep)))[0]}.json"
    common.write_json(args.out or os.path.join(common.RESULTS_DIR, default_out), {

        "benchmark": "engine", "environment": env, "repeats": repeats, "prompt_lengths": lengths,
        "decode_tokens": n_out, "batch": batch, "ours": ours, "results": res, "ratios": ratios,
        "ratios_vs_llamacpp": vs_peer, f"decode_b{batch}_over_b1": scaling,
        "targets": {"prefill_ratio_min": TARGET_PREFILL_RATIO, "decode_b1_ms_max": TARGET_B1_MS,
                    "decode_b16_tps_min": TARGET_B16_TPS,
                    "llamacpp_decode_ms_ratio_max": TARGET_LLAMACPP_DECODE,
                    "llamacpp_prefill_ratio_min": TARGET_LLAMACPP_PREFILL,
                    "llamacpp_prefill_ratio_min_above_2048": TARGET_LLAMACPP_PREFILL_LONG,
                    "batch_scaling_min": TARGET_BATCH_SCALING},
        "checks": checks, "reference_earlier_measurements": REFERENCE, "markdown": table})


if __name__ == "__main__":
    main()
