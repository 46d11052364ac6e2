"""What an architecture family is, and the Llama decoder layer every family starts from.

A family (``Family``) says what its models differ in, and nothing else: the GGUF tensor names and
the Hugging Face names they become, whether llama.cpp's converter permuted the Q/K rows, the
per-layer norms, the numbers it reads beyond the common ones (``gguf_fields``/``hf_fields``:
sliding windows, a second RoPE base, an attention scale ...), the embedding scale, and its decoder
layer written over the shared operators (``ops.LayerOps``: residual add + RMSNorm, the Q/K/V GEMM
with QK-norm and RoPE and the K/V write, paged attention with an optional window, the MLP's
activation). The forward pass around the layers (embed, final norm, LM head, the weight modes,
padding for batch invariance) is ``model/llama.py``'s, shared by every family; the numbers the
families share (widths, heads, RoPE base, norm epsilon) are read by ``loader.py``.

The base class is the Llama layer: pre-norm attention and a SwiGLU MLP, optional Q/K/V bias and
QK-norm (present when the layer has ``q_norm``/``k_norm`` weights). The C layer calls
(``qlayer.c``) compute that layer with what gemma3 adds (norms on the attention's and the MLP's
outputs, GELU-tanh, per-layer RoPE and windows); a family whose layer differs otherwise sets
``c_layers`` off.

This module knows nothing about files, tokenizers or the KV cache's keys.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from hotprefix.model.rope import hf_rope

LLAMA_TENSORS: Mapping[str, str] = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
"""GGUF per-layer tensor kind (``blk.N.<kind>.weight``) -> Hugging Face name under
``model.layers.N.``, for the Llama layout."""

QK_NORM_TENSORS: Mapping[str, str] = {"attn_q_norm": "self_attn.q_norm",
                                      "attn_k_norm": "self_attn.k_norm"}
"""The per-head Q and K RMSNorm weights (qwen3, gemma3)."""

MATRICES = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "o": ("self_attn.o_proj",), "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
            "down": ("mlp.down_proj",)}
"""A layer's four GEMMs and the Hugging Face matrices each concatenates (rows in this order)."""

Field = Callable[..., Any]
"""``field(key, default=None)``: a GGUF metadata value (the key with the architecture's prefix
spelled out by the caller)."""


class Family:
    """One architecture family: its names, its differences, its layer. Subclass and register
    (``arch.register``); override only what differs."""

    name = "llama"
    """Registry key and the ``ModelArch.arch`` of its models' canonical form."""
    archs: tuple[str, ...] = ("llama",)
    """GGUF ``general.architecture`` and Hugging Face ``model_type`` values it runs."""
    tensors: Mapping[str, str] = LLAMA_TENSORS
    """GGUF per-layer tensor kinds read (others are ignored) -> Hugging Face names."""
    norms: Mapping[str, str] = {"in_norm": "input_layernorm",
                                "post_norm": "post_attention_layernorm"}
    """A layer's norm weights: the layer's key -> Hugging Face name. ``in_norm`` comes before
    attention and ``post_norm`` before the MLP in every family."""
    permuted: frozenset[str] = frozenset()
    """Architectures whose Q/K rows llama.cpp's converter permuted (undone at load)."""
    c_layers = True
    """The layer is one the C layer calls (``qlayer.c``) compute: the base layer, with optional
    QK-norm, ``attn_out_norm``/``mlp_out_norm`` norms, either activation, windows."""
    activation = "silu"
    """The gated MLP's activation: ``silu`` (SwiGLU) or ``gelu_tanh`` (GeGLU)."""
    rope_scalings: frozenset[str] = frozenset()
    """GGUF ``rope.scaling.type`` values ``gguf_fields`` turns into RoPE factors (besides none;
    llama3's comes as ``rope_freqs.weight`` in every family)."""

    def gguf_fields(self, field: Field, prefix: str, common: dict[str, Any],
                    tensor_names: set[str], path: str) -> dict[str, Any]:
        """``ModelArch`` fields beyond the common ones, from a GGUF's metadata."""
        return {}

    def hf_fields(self, cfg: dict[str, Any], common: dict[str, Any], path: str) -> dict[str, Any]:
        """``ModelArch`` fields beyond the common ones (and overrides of them) from a Hugging Face
        ``config.json``."""
        return {}

    def hf_rope(self, cfg: dict[str, Any], head_dim: int, where: str):
        """(RoPE base, llama3 factors or None) of a Hugging Face config (``rope.hf_rope``)."""
        return hf_rope(cfg, head_dim, where)

    def hf_weights(self, weights: dict) -> None:
        """Rewrite a Hugging Face checkpoint's tensors (in place) into the form the GGUF holds
        (e.g. gemma's ``1 + w`` norms), so the layer has one form to read."""

    def layer_tensors(self) -> list[str]:
        """Hugging Face names (under ``model.layers.N.``, without ``.weight``) each layer needs."""
        return sorted({*(n for names in MATRICES.values() for n in names), *self.norms.values()})

    def embed_scale(self, arch) -> float | None:
        """What the embeddings are multiplied by (None: nothing)."""
        return None

    def layer(self, ops, w: dict, h, pending, kv: tuple, rope, window: int):
        """One decoder layer: ``h`` (the fp32 residual stream, without ``pending`` added yet)
        -> the amount the next layer (or the final norm) adds to it.

        Args:
            ops: the shared operators for this forward pass (``ops.LayerOps``).
            w: the layer's weights (``MATRICES`` keys, ``qkv_bias``, ``norms`` keys).
            pending: the previous layer's output, added to ``h`` by the first norm (None first).
            kv: this layer's (k_cache, v_cache) pools.
            rope: this layer's ``RotaryEmbedding``.
            window: sliding window in keys (0: full attention).
        """
        x = ops.add_norm(h, pending, w["in_norm"])
        q = ops.qkv_rope_write(ops.mm(x, w["qkv"], w["qkv_bias"], "qkv"), w, rope, kv)
        o = ops.attend(q, kv, window)
        x = ops.add_norm(h, ops.mm(ops.heads_flat(o), w["o"], None, "o"), w["post_norm"])
        up = ops.act_mul(ops.mm(x, w["gate_up"], None, "gate_up"), self.activation)
        return ops.mm(up, w["down"], None, "down")
