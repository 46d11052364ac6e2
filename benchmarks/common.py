"""Shared helpers for the benchmark scripts: threads, model loading, real-text prompts, timing,
markdown tables and JSON results.

Not a benchmark by itself. Both scripts import it as ``common`` (they put this folder on
``sys.path``), so run them from the repository root: ``.venv/bin/python benchmarks/<script>.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from typing import Any, Callable, Sequence

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MOONCAKE_TRACE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared",
                              "traces", "mooncake_conversation_trace.jsonl")


def trace_parser(description: str) -> argparse.ArgumentParser:
    """Parser of the trace-replay benchmarks: ``--trace`` (Mooncake conversation trace) and
    ``--out`` (results folder)."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=MOONCAKE_TRACE)
    p.add_argument("--out", default=RESULTS_DIR, help="results folder (default benchmarks/results)")
    return p


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes, to check the script works")
    p.add_argument("--threads", type=int, default=2,
                   help="torch threads, the same for every contender (default 2)")
    p.add_argument("--repeats", type=int, default=None,
                   help="repetitions per measurement (median is reported)")
    p.add_argument("--out", default=None, help="JSON result path (default benchmarks/results/...)")
    return p


def setup_threads(n: int) -> None:
    """Same thread count for every contender in this process."""
    import torch

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set once in this process
        pass


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def add_model_argument(p: argparse.ArgumentParser) -> None:
    """``--model NAME_OR_PATH``: the model every contender runs (default: the embedded one)."""
    p.add_argument("--model", default=None,
                   help="the model: a .gguf file, a Hugging Face directory, or a packaged name "
                        "(default: the embedded SmolLM2-135M-Instruct Q4_1; gemma3-270m: Gemma 3 "
                        "270M Q4_K_M from its package)")


def default_model_file(model: str | None = None) -> tuple[str, str, str]:
    """(path, directory, file name) of ``model`` as ``--model`` resolves it (None: the embedded
    default GGUF; a packaged name such as ``gemma3-270m``: its assembled GGUF)."""
    from hotprefix.model.metadata import resolve_model_path

    path = os.path.abspath(resolve_model_path(model))
    return path, os.path.dirname(path), os.path.basename(path)


def is_default_model(model: str | None) -> bool:
    """Whether ``model`` names the embedded default (the model the fixed targets are about)."""
    from hotprefix.model.metadata import default_model_path

    if model in (None, "default", "smollm2"):
        return True
    try:
        return os.path.samefile(default_model_file(model)[0], default_model_path())
    except OSError:
        return False


def load_hotprefix(threads: int, **options: Any):
    from hotprefix import LLM

    t0 = time.perf_counter()
    llm = LLM(num_threads=threads, **options)
    log(f"  hotprefix {options} loaded in {time.perf_counter() - t0:.1f}s")
    return llm


def load_transformers(model: str | None = None):
    """The model's GGUF (default: the embedded one) through transformers, dequantized to fp32
    (its only CPU path); a Hugging Face directory as it is, in fp32."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    path, d, name = default_model_file(model)
    t0 = time.perf_counter()
    if os.path.isdir(path):
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, torch_dtype=torch.float32)
    model.eval()
    log(f"  transformers fp32 ({model.config._attn_implementation}) loaded in "
        f"{time.perf_counter() - t0:.1f}s")
    return model


# --------------------------------------------------------------------------- real text
_SUBJECTS = ["The employee", "Each contractor", "A team lead", "The security officer", "Every visitor",
             "The finance department", "A new hire", "The data owner", "Any manager", "The auditor",
             "The support engineer", "A customer representative", "The on-call developer",
             "The procurement office", "Each regional director", "The privacy team"]
_VERBS = ["must report", "should document", "is required to review", "may request", "shall approve",
          "needs to archive", "will verify", "must not disclose", "is expected to escalate",
          "has to encrypt", "can delegate", "must reconcile", "should retain", "may postpone"]
_OBJECTS = ["all expense claims", "the quarterly access logs", "any suspected phishing attempt",
            "customer records older than seven years", "travel bookings above the approved limit",
            "changes to the production database", "laptops that leave the office",
            "vendor contracts before signature", "overtime hours", "incident timelines",
            "shared passwords", "the annual training certificate", "refund requests",
            "backups of the payroll system", "personal data exports", "conference invitations"]
_WHEN = ["within two business days", "before the end of each month", "after every deployment",
         "whenever a deadline is missed", "during the annual review", "as soon as practical",
         "no later than Friday noon", "before any external audit", "on the first Monday of the quarter",
         "within 24 hours of discovery", "unless the director grants an exception",
         "when the budget exceeds 5,000 euros"]
_WHY = ["to keep the records consistent", "so that the regulator can trace decisions",
        "because the insurance policy requires it", "to protect our customers' privacy",
        "in line with section 4.2 of the handbook", "so that nobody is surprised at year end",
        "to reduce the risk of fraud", "as agreed with the works council"]
_QUESTIONS = ["Who approves {o} {w}?", "What happens if {s} forgets to handle {o}?",
              "Can {s} skip the review of {o} {w}?", "Which rule covers {o}?",
              "Summarize the obligations around {o} in two sentences.",
              "Is there an exception for {o} {w}?", "Why does {s} have to deal with {o}?"]


def policy_sentences(rng: random.Random):
    """An endless stream of varied policy-handbook sentences (real words, real grammar)."""
    section = 1
    while True:
        yield f"\n\nSection {section}. "
        for _ in range(rng.randint(4, 9)):
            s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_WHEN)}"
            if rng.random() < 0.5:
                s += f" {rng.choice(_WHY)}"
            yield s + ". "
        section += 1


def text_tokens(tokenizer, n: int, seed: int) -> list[int]:
    """Exactly ``n`` token ids of tokenized policy text (no special tokens)."""
    rng = random.Random(seed)
    ids: list[int] = []
    gen = policy_sentences(rng)
    while len(ids) < n:
        chunk = "".join(next(gen) for _ in range(40))
        ids.extend(tokenizer.encode(chunk, add_special_tokens=False))
    return ids[:n]


def question_tokens(tokenizer, n: int, seed: int) -> list[int]:
    """Exactly ``n`` token ids of user questions about the policy (padded with more questions)."""
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < n:
        q = rng.choice(_QUESTIONS).format(s=rng.choice(_SUBJECTS).lower(), o=rng.choice(_OBJECTS),
                                          w=rng.choice(_WHEN))
        ids.extend(tokenizer.encode(" " + q, add_special_tokens=False))
    return ids[:n]


# --------------------------------------------------------------------------- output
def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.3g}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


ISA_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
             "amx_tile", "amx_bf16", "amx_int8")
"""The CPU flags that decide the kernels' level and the dtype probe: printed with every figure."""


def cpu_description() -> str:
    """``model name; flags: ...; kernels: LEVEL`` of this machine (the level $HOTPREFIX_ISA forces,
    or the best the CPU runs)."""
    from hotprefix.model.dtype_probe import cpu_flags
    from hotprefix.model.isa import requested_level

    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), name)
    except OSError:
        pass
    flags = [fl for fl in ISA_FLAGS if fl in cpu_flags()]
    return f"{name}; flags: {' '.join(flags) or 'none of ' + '/'.join(ISA_FLAGS[:3])}; kernels: {requested_level().name}"


def environment(threads: int, quick: bool) -> dict[str, Any]:
    import torch

    try:
        import transformers
        tv = transformers.__version__
    except ImportError:  # pragma: no cover
        tv = None
    return {"quick": quick, "threads": threads, "torch": torch.__version__, "transformers": tv,
            "python": platform.python_version(), "machine": platform.machine(),
            "cpu_count": os.cpu_count(), "cpu": cpu_description(),
            "load_avg_at_start": list(os.getloadavg()),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def write_json(path: str, data: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
    log(f"wrote {path}")


# --------------------------------------------------------------------------- transformers calls
def hf_forward(model, cache=None, **kw):
    """``model(**kw)`` passing a KV cache under whichever name this transformers uses
    (``cache`` in 5.x, ``past_key_values`` before); returns (output, its cache)."""
    import inspect

    name = getattr(model, "_bench_cache_kw", None)
    if name is None:
        params = inspect.signature(model.forward).parameters
        name = "cache" if "cache" in params else "past_key_values"
        model._bench_cache_kw = name
    if cache is not None:
        kw[name] = cache
    out = model(use_cache=True, **kw)
    new_cache = getattr(out, "cache", None)
    if new_cache is None:
        new_cache = out.past_key_values
    return out, new_cache
