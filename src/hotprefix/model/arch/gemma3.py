"""Gemma 3 (text): what it differs in from the Llama layer.

- embeddings multiplied by sqrt(hidden) (in fp32: our residual stream's dtype, as llama.cpp's
  ``ggml_scale`` and transformers in fp32 do);
- RMSNorm as ``x * (1 + w)``: llama.cpp's converter stores ``1 + w`` in the GGUF (its
  ``norm_shift``), so a GGUF's norm weights are used as they are and a Hugging Face checkpoint's
  get the 1 added at load (``hf_weights``): one form for the layer;
- norms before and after attention and before and after the MLP (``input_layernorm``,
  ``post_attention_layernorm`` on attention's output, ``pre_feedforward_layernorm``,
  ``post_feedforward_layernorm`` on the MLP's output), QK-norm, a GELU-tanh gated MLP;
- head_dim its own (256 for the released models), queries scaled by ``query_pre_attn_scalar^-0.5``
  (a GGUF does not store it: as llama.cpp, head_dim^-0.5, hidden/heads for the 62-layer 27B);
- sliding-window layers: a query at p sees keys ``[p - W + 1, p]``; which layers from the GGUF's
  ``attention.sliding_window_pattern`` (a period or a per-layer array), else every 6th layer
  global as llama.cpp assumes, or a HF ``layer_types``;
- RoPE base 10,000 on local layers (``rope.freq_base_swa`` where the GGUF has it) and
  ``rope.freq_base`` (1,000,000) on global ones; a linear RoPE scaling (the 4B-27B models')
  divides the global layers' frequencies only, as in llama.cpp and transformers;
- tied embeddings; a final logit softcap ``tanh(x / c) * c`` where the file gives one.

The K/V of every layer stays in the pool (windowed layers included). Not covered: Gemma 3n,
the vision tower of the multimodal checkpoints, attention logit softcapping (Gemma 2's).
"""

from __future__ import annotations

import math

from hotprefix.model.arch.base import QK_NORM_TENSORS, Family
from hotprefix.model.metadata import ModelLoadError
from hotprefix.model.rope import hf_rope

SWA_PATTERN = 6
"""llama.cpp's default for gemma3 GGUFs without ``sliding_window_pattern``: layers 5, 11, 17 ...
are global (``il % 6 == 5``), the rest local; transformers' default too."""
LOCAL_ROPE_BASE = 10000.0
"""RoPE base of the local layers when the file does not give one."""


def _local_layers(pattern, num_layers: int, where: str) -> tuple[int, ...]:
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != num_layers:
            raise ModelLoadError(f"{where}: sliding_window_pattern has {len(pattern)} entries for "
                                 f"{num_layers} layers")
        return tuple(i for i, swa in enumerate(pattern) if swa)
    n = int(pattern)
    return tuple(i for i in range(num_layers) if n == 0 or i % n < n - 1)


class Gemma3(Family):
    name = "gemma3"
    archs = ("gemma3", "gemma3_text")
    tensors = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
               **QK_NORM_TENSORS}
    norms = {"in_norm": "input_layernorm", "attn_out_norm": "post_attention_layernorm",
             "post_norm": "pre_feedforward_layernorm", "mlp_out_norm": "post_feedforward_layernorm",
             "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}
    activation = "gelu_tanh"
    rope_scalings = frozenset({"linear"})

    def gguf_fields(self, field, prefix, common, tensor_names, path):
        a, layers = prefix, common["num_layers"]
        window = int(field(f"{a}.attention.sliding_window", 0) or 0)
        pattern = field(f"{a}.attention.sliding_window_pattern", SWA_PATTERN)
        heads = common["num_heads"]
        scale_dim = (common["hidden_size"] // heads if layers == 62 else common["head_dim"])
        out = {
            "sliding_window": window,
            "local_layers": _local_layers(pattern, layers, path) if window > 0 else (),
            "rope_theta_local": float(field(f"{a}.rope.freq_base_swa", LOCAL_ROPE_BASE)),
            "attn_scale": scale_dim ** -0.5,
            "final_logit_softcap": _cap(field(f"{a}.final_logit_softcapping")),
        }
        if field(f"{a}.rope.scaling.type") == "linear":
            factor = float(field(f"{a}.rope.scaling.factor", 1.0))
            if factor != 1.0:
                out["rope_freq_factors"] = (factor,) * (common["head_dim"] // 2)
        return out

    def hf_rope(self, cfg, head_dim, where):
        """The global layers' (base, factors): transformers 5's ``rope_parameters`` per layer
        type, or 4's ``rope_theta`` and ``rope_scaling``; linear scaling as uniform factors."""
        params = cfg.get("rope_parameters")
        if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
            p = dict(params["full_attention"])
        else:
            p = dict(cfg.get("rope_scaling") or {})
            p.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
        p.setdefault("rope_theta", 1_000_000.0)
        if str(p.get("rope_type", p.get("type"))).lower() == "linear":
            return float(p["rope_theta"]), (float(p["factor"]),) * (head_dim // 2)
        return hf_rope({"rope_parameters": p, "max_position_embeddings":
                        cfg.get("max_position_embeddings")}, head_dim, where)

    def hf_fields(self, cfg, common, path):
        layers = common["num_layers"]
        window = int(cfg.get("sliding_window") or 0)
        types = cfg.get("layer_types")
        if types is not None:
            local = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        else:
            local = _local_layers(cfg.get("sliding_window_pattern", SWA_PATTERN), layers, path)
        params = cfg.get("rope_parameters") or {}
        sliding = params.get("sliding_attention") if isinstance(params, dict) else None
        local_theta = float((sliding or {}).get("rope_theta", cfg.get("rope_local_base_freq",
                                                                       LOCAL_ROPE_BASE)))
        return {
            "arch": self.name,  # model_type gemma3_text: the GGUF's name for the same model
            "sliding_window": window,
            "local_layers": local if window > 0 else (),
            "rope_theta_local": local_theta,
            "attn_scale": float(cfg.get("query_pre_attn_scalar", common["head_dim"])) ** -0.5,
            "final_logit_softcap": _cap(cfg.get("final_logit_softcapping")),
            "attention_bias": bool(cfg.get("attention_bias", False)),
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
        }

    def hf_weights(self, weights):
        for name in list(weights):
            if name.endswith("norm.weight"):  # Gemma3RMSNorm: x * (1 + w), as the GGUF stores it
                weights[name] = weights[name].float() + 1.0

    def embed_scale(self, arch):
        return math.sqrt(arch.hidden_size)

    def layer(self, ops, w, h, pending, kv, rope, window):
        x = ops.add_norm(h, pending, w["in_norm"])
        q = ops.qkv_rope_write(ops.mm(x, w["qkv"], w["qkv_bias"], "qkv"), w, rope, kv)
        o = ops.attend(q, kv, window)
        attn = ops.norm(ops.mm(ops.heads_flat(o), w["o"], None, "o"), w["attn_out_norm"])
        x = ops.add_norm(h, attn, w["post_norm"])
        up = ops.act_mul(ops.mm(x, w["gate_up"], None, "gate_up"), self.activation)
        return ops.norm(ops.mm(up, w["down"], None, "down"), w["mlp_out_norm"])


def _cap(value) -> float | None:
    return float(value) if value else None
