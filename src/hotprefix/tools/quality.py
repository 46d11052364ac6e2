"""Output quality of a hotprefix configuration (dtype, weights mode) against a reference.

Under teacher forcing over held-back text, cut into windows of tokens: for every position, our
logits (all rows of one fresh prefill through the engine's own model) against the reference's
(transformers in float32 on the same checkpoint), scored as top-1 agreement and the mean KL
divergence KL(reference || ours). Also the bytes of the weights a mode keeps in memory.

Used by ``benchmarks/bench_quality.py`` (the quality table) and ``tests/test_quality.py``. A new
weights mode is one more ``QualityMode``; nothing here knows how it is implemented.

Knows the runner's model and its KV pool layout (to build a private, fresh one); knows nothing of
the scheduler or the prefix cache: the windows never touch the engine's pool.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

from hotprefix.config.sections import ConfigError, ModelConfig
from hotprefix.files.gguf_reads import fast_gguf_reads

DEFAULT_WINDOW = 512
DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True)
class QualityMode:
    """One hotprefix configuration whose quality is measured."""

    dtype: str | None = "float32"
    """Compute dtype, as ``LLM(dtype=...)``; None = not passed (the configuration's default)."""
    weights: str | None = None
    """Weights mode, as ``LLM(weights=...)`` (``auto``, ``gguf``, ``mixed``, ``bf16``, ``int8``, ``int4``); None = the
    option is not passed (the configuration's default)."""
    kv_cache_dtype: str | None = None
    """The KV pool's element type, as ``LLM(kv_cache_dtype=...)`` (``bf16``, ``int8``...); None = not
    passed (``auto``)."""
    activations: str | None = None
    """The gguf mode's activation width, as ``LLM(activations=...)`` (``int16``, ``int8``); None = not
    passed."""

    @property
    def name(self) -> str:
        short = DTYPE_NAMES.get(self.dtype, self.dtype) if self.dtype is not None else "default"
        name = short if self.weights is None else f"{short} / weights {self.weights}"
        name = name if self.activations is None else f"{name} / activations {self.activations}"
        return name if self.kv_cache_dtype is None else f"{name} / KV {self.kv_cache_dtype}"

    @classmethod
    def parse(cls, spec: str) -> "QualityMode":
        """``DTYPE[:WEIGHTS][+ACTIVATIONS][@KV]`` (``float32``, ``bfloat16:int8``, ``default+int8``,
        ``default@int8``; ``default`` = no dtype given)."""
        spec, _, kv = spec.partition("@")
        spec, _, act = spec.partition("+")
        dtype, _, weights = spec.partition(":")
        return cls(None if dtype in ("", "default") else dtype, weights or None, kv or None,
                   act or None)

    def llm_options(self) -> dict[str, Any]:
        """The ``LLM(...)`` options of this mode (see ``llm_options``)."""
        opts = llm_options(self.dtype, self.weights)
        if self.kv_cache_dtype is not None:
            opts["kv_cache_dtype"] = self.kv_cache_dtype
        if self.activations is not None:
            opts["activations"] = self.activations
        return opts


def supports_weights_option() -> bool:
    """Whether this build has the ``weights`` option (ModelConfig.weights, issue 13)."""
    return any(f.name == "weights" for f in dataclasses.fields(ModelConfig))


def llm_options(dtype: str | None = None, weights: str | None = None) -> dict[str, Any]:
    """``LLM(...)`` options for a dtype and a weights mode, passing only those given.

    Raises:
        ConfigError: ``weights`` was given but this build has no such option yet.
    """
    opts: dict[str, Any] = {}
    if dtype is not None:
        opts["dtype"] = dtype
    if weights is not None:
        if not supports_weights_option():
            raise ConfigError(f"weights={weights!r}: this build has no 'weights' option yet "
                              "(ModelConfig.weights, issue 13); leave it out to use the dtype's "
                              "dequantized weights")
        opts["weights"] = weights
    return opts


@dataclass(frozen=True)
class QualityResult:
    """One mode's scores over all windows."""

    mode: str
    """The mode's name (``QualityMode.name``)."""
    top1_agreement: float
    """Fraction of positions whose argmax equals the reference's."""
    mean_kl: float
    """Mean over positions of KL(reference || ours), in nats."""
    max_kl: float
    """The largest per-position KL."""
    num_positions: int
    """Positions scored (every token of every window)."""
    weight_bytes: int
    """Bytes of the model's weight tensors in this mode."""


# --------------------------------------------------------------------------- text
def windows_from_text(tokenizer, texts: Iterable[str], num_positions: int,
                      window: int = DEFAULT_WINDOW) -> list[list[int]]:
    """Token windows (of ``window`` ids, the last one shorter) covering ``num_positions`` ids of
    the texts, tokenized one after another with the model's tokenizer (no special tokens).

    Raises:
        ValueError: the texts have fewer than ``num_positions`` tokens.
    """
    ids: list[int] = []
    for t in texts:
        ids.extend(tokenizer.encode(t, add_special_tokens=False))
        if len(ids) >= num_positions:
            break
    if len(ids) < num_positions:
        raise ValueError(f"the texts hold {len(ids)} tokens, fewer than the {num_positions} asked for")
    ids = ids[:num_positions]
    return [ids[i:i + window] for i in range(0, num_positions, window)]


# --------------------------------------------------------------------------- logits
def all_position_logits(runner, ids: Sequence[int]) -> torch.Tensor:
    """Logits at every position of ``ids`` from the runner's model, as one fresh prefill.

    The K/V go to a private pool of fresh blocks shaped like the runner's (same block size, dtype
    and device), so the engine's pool and prefix cache are untouched and nothing is reused. The
    window runs as one untiled prefill, even for a runner in deterministic mode.

    Args:
        runner: a ``ModelRunner`` (``llm.engine.runner``), in any dtype it supports.
        ids: the window's token ids.

    Returns:
        [len(ids), vocab_size] float32 logits.
    """
    from hotprefix.model.attention import AttentionMetadata, PrefillSeq

    n = len(ids)
    k0 = runner.kv_caches[0][0]
    bs = k0.shape[1]
    nb = math.ceil(n / bs)
    dev = k0.device

    def fresh(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros((nb, *t.shape[1:]), dtype=t.dtype, device=dev)

    kv = [(fresh(k), fresh(v)) for k, v in runner.kv_caches]
    positions = torch.arange(n, device=dev)
    meta = AttentionMetadata(slot_mapping=positions,
                             prefills=[PrefillSeq(0, n, n, torch.arange(nb, device=dev))])
    logits = runner.model.forward(torch.tensor(list(ids), device=dev), positions, kv, meta, None)
    return logits.float().cpu()


def load_reference(model_path: str):
    """transformers' model of the same checkpoint in float32 (a GGUF file or a HF directory)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if os.path.isdir(model_path):
        model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
    else:
        with fast_gguf_reads():  # gguf's reader once and over a plain array: 22.8 -> 12.5 s
            model = AutoModelForCausalLM.from_pretrained(os.path.dirname(model_path) or ".",
                                                         gguf_file=os.path.basename(model_path),
                                                         torch_dtype=torch.float32)
    model.eval()
    return model



def reference_logits(model, ids: Sequence[int]) -> torch.Tensor:
    """[len(ids), vocab] float32 logits of the reference model at every position."""
    with torch.inference_mode():
        return model(torch.tensor([list(ids)]), use_cache=False).logits[0].float()


# --------------------------------------------------------------------------- scores
def compare_logits(ref: torch.Tensor, ours: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(positions whose argmax agrees, per-position KL(ref || ours) in float64)."""
    if ref.shape != ours.shape:
        raise ValueError(f"logits shapes differ: reference {tuple(ref.shape)}, ours {tuple(ours.shape)}")
    agree = int((ref.argmax(-1) == ours.argmax(-1)).sum())
    rows = max(1, 2 ** 24 // max(1, ref.shape[-1]))  # a few float64 copies of 128 MiB at a time
    kl = []
    for i in range(0, ref.shape[0], rows):  # (a 262k vocabulary's window would take GiBs at once)
        lp = torch.log_softmax(ref[i:i + rows].double(), -1)
        lq = torch.log_softmax(ours[i:i + rows].double(), -1)
        kl.append((lp.exp() * (lp - lq)).sum(-1).clamp(min=0.0))
    return agree, torch.cat(kl) if kl else torch.zeros(0, dtype=torch.float64)


def evaluate(runner, windows: Sequence[Sequence[int]], references: Sequence[torch.Tensor],
             mode_name: str) -> QualityResult:
    """Score one mode's runner over the windows against the reference logits of each window."""
    agree, n = 0, 0
    kl_sum, kl_max = 0.0, 0.0
    for ids, ref in zip(windows, references, strict=True):
        a, kl = compare_logits(ref, all_position_logits(runner, ids))
        agree += a
        n += len(ids)
        kl_sum += float(kl.sum())
        kl_max = max(kl_max, float(kl.max()))
    return QualityResult(mode=mode_name, top1_agreement=agree / n, mean_kl=kl_sum / n, max_kl=kl_max,
                         num_positions=n, weight_bytes=runner.model.weight_bytes())
