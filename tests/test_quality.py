"""Output quality per dtype / weights mode against transformers float32 on the same GGUF, under
teacher forcing over a short held-back text (the quality table of ``bench_quality.py``, in small).

The thresholds are set to fail on a broken weight path (checked by hand with ``bench_quality.py
--break``, 256 positions of this text, with the fused elementwise kernels and 256-key attention
tiles): fp32 scores 100% / KL 2e-11, bf16 in the default ``gguf`` weights (the GGUF's blocks,
16-bit integer activations) 98.8% / KL 4.0e-5 and in ``mixed`` weights (fp32 inputs, fp16-held
weights) 99.2% / KL 4.0e-5 (their misses are near-ties), bf16 with every GEMM in bf16
(``dense``) 98.4% / KL 2.4e-4, int8 94.1% / 3.4e-3, int4 98.0% / 3.3e-4 (the LM head of these
three runs on fp32 inputs with fp16-held weights); with every matrix scaled by 1.01, fp32 falls to
95.7% / 1.9e-3, the default to 95.3% / 2.0e-3 (mixed 94.9% / 2.0e-3), dense bf16 to 95.3% /
2.4e-3, int8 to 92.6% / 5.4e-3 and int4 to 95.3% / 2.0e-3; with one layer's MLP zeroed, all to about 77% / 0.1. Each
mode's bounds sit between its own score and its score when broken (int8's top-1 barely separates
them; its KL bound does).
"""

from __future__ import annotations

import os

import pytest

from hotprefix.tools import quality

pytestmark = pytest.mark.model

TEXT = os.path.join(os.path.dirname(__file__), "data", "quality", "held_back.txt")
NUM_POSITIONS = 256

# (mode, least top-1 agreement, largest mean KL(transformers fp32 || ours) in nats)
MODES = [
    pytest.param(quality.QualityMode("float32"), 0.99, 1e-6, id="fp32"),
    pytest.param(quality.QualityMode("bfloat16"), 0.975, 3e-4, id="bf16-default"),
    pytest.param(quality.QualityMode("bfloat16", "mixed"), 0.975, 3e-4, id="bf16-mixed"),
    pytest.param(quality.QualityMode("bfloat16", "dense"), 0.97, 1e-3, id="bf16-dense"),
    pytest.param(quality.QualityMode("bfloat16", "int8"), 0.92, 4.5e-3, id="int8"),
    pytest.param(quality.QualityMode("bfloat16", "int4"), 0.965, 1e-3, id="int4"),
]


@pytest.fixture(scope="module")
def reference(default_tokenizer, hf_default_reference):
    """(windows, transformers fp32 logits of each window) over the held-back text."""
    with open(TEXT) as f:
        windows = quality.windows_from_text(default_tokenizer, [f.read()], NUM_POSITIONS,
                                            window=NUM_POSITIONS)
    model = hf_default_reference
    refs = [quality.reference_logits(model, w) for w in windows]
    return windows, refs


@pytest.mark.parametrize("mode, min_top1, max_kl", MODES)
def test_quality_against_transformers(reference, mode, min_top1, max_kl):
    from hotprefix import LLM

    windows, refs = reference
    llm = LLM(num_threads=2, kv_cache_memory="16MiB", enable_prefix_caching=False,
              **mode.llm_options())
    r = quality.evaluate(llm.engine.runner, windows, refs, mode.name)
    print(f"{mode.name}: top-1 {r.top1_agreement:.2%}, mean KL {r.mean_kl:.2e}, "
          f"{r.weight_bytes / 2**20:.0f} MiB of weights")
    assert r.num_positions == NUM_POSITIONS
    assert r.top1_agreement >= min_top1, r
    assert r.mean_kl <= max_kl, r
    assert r.weight_bytes > 0


def test_weights_option_is_guarded():
    """Until the weights option exists, asking for it is a clear error, not a silent default."""
    if quality.supports_weights_option():
        assert quality.llm_options("bfloat16", "int8") == {"dtype": "bfloat16", "weights": "int8"}
    else:
        with pytest.raises(quality.ConfigError, match="no 'weights' option"):
            quality.llm_options("bfloat16", "int8")
    assert quality.llm_options("float32") == {"dtype": "float32"}
