"""Qwen3 (dense): the Llama layer with QK-norm (an RMSNorm over each head of the queries and keys,
before RoPE) and no Q/K/V bias; ``head_dim`` is its own (``attention.key_length`` in a GGUF), not
hidden / heads. llama.cpp does not permute its Q/K rows.

Not covered: Qwen3-MoE (``qwen3moe``), its experts and router.
"""

from __future__ import annotations

from hotprefix.model.arch.base import LLAMA_TENSORS, QK_NORM_TENSORS, Family


class Qwen3(Family):
    name = "qwen3"
    archs = ("qwen3",)
    tensors = {**LLAMA_TENSORS, **QK_NORM_TENSORS}
    norms = {**Family.norms, "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}

    def hf_fields(self, cfg, common, path):
        return {"attention_bias": bool(cfg.get("attention_bias", False))}
