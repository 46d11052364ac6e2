"""Llama-family decoder (llama, mistral, qwen2, smollm) whose attention reads a paged KV pool.

Our own forward pass: embeddings -> N x (RMSNorm, GQA attention with RoPE, RMSNorm, SwiGLU MLP)
-> RMSNorm -> LM head. Q/K/V and gate/up projections are fused into one matrix each, so a layer is
four GEMMs. Takes a flat batch of tokens (prefill chunks and decodes of many sequences together)
and returns logits only for the rows asked for.

This module knows nothing about requests or the prefix cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hotprefix.model.attention import AttentionMetadata, paged_attention, write_kv
from hotprefix.model.loader import ModelArch


class RotaryEmbedding:
    """cos/sin tables (Hugging Face rotate-half layout) computed once up to max_position."""

    def __init__(self, head_dim: int, theta: float, max_position: int, device, dtype):
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        t = torch.arange(max_position, dtype=torch.float64)
        freqs = torch.outer(t, inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def _onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def pick_linear(device: torch.device, dtype: torch.dtype):
    """(pack, linear): on CPU in fp32, weights prepacked for oneDNN, whose GEMV streams weights
    about twice as fast as the default BLAS path on this class of CPU; elsewhere plain F.linear.
    The oneDNN path is probed once and skipped if this torch build lacks it."""
    if device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available():
        try:
            w = torch.randn(8, 4)
            x = torch.randn(3, 4)
            if torch.allclose(_onednn_linear(x, w.to_mkldnn(), None), F.linear(x, w), atol=1e-5):
                return (lambda t: t.contiguous().to_mkldnn()), _onednn_linear
        except (AttributeError, RuntimeError):
            pass
    return (lambda t: t), F.linear


class LlamaModel:
    """Weights + forward. Not an nn.Module: no autograd, no hooks, just tensors."""

    def __init__(self, arch: ModelArch, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype):
        self.arch = arch
        self.device, self.dtype = device, dtype

        def take(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype).contiguous()

        pack, self.linear = pick_linear(device, dtype)

        self.embed = take("model.embed_tokens.weight")
        self.norm = take("model.norm.weight")
        self.lm_head = pack(self.embed if arch.tie_word_embeddings else take("lm_head.weight"))
        self.layers = []
        for i in range(arch.num_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat([weights[p + f"self_attn.{n}_proj.weight"] for n in "qkv"], 0)
            layer = {
                "in_norm": take(p + "input_layernorm.weight"),
                "post_norm": take(p + "post_attention_layernorm.weight"),
                "qkv": pack(qkv.to(device=device, dtype=dtype)),
                "o": pack(take(p + "self_attn.o_proj.weight")),
                "gate_up": pack(torch.cat([weights[p + "mlp.gate_proj.weight"],
                                           weights[p + "mlp.up_proj.weight"]], 0)
                                .to(device=device, dtype=dtype)),
                "down": pack(take(p + "mlp.down_proj.weight")),
                "qkv_bias": None,
            }
            if arch.attention_bias:
                layer["qkv_bias"] = torch.cat(
                    [weights[p + f"self_attn.{n}_proj.bias"] for n in "qkv"], 0
                ).to(device=device, dtype=dtype)
            self.layers.append(layer)
        self.rope = RotaryEmbedding(arch.head_dim, arch.rope_theta, arch.max_position, device, dtype)
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.scale = arch.head_dim ** -0.5

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple],
                meta: AttentionMetadata, logits_rows: torch.Tensor | None) -> torch.Tensor:
        """Run the decoder over a flat batch.

        Args:
            input_ids: [num_tokens] token ids.
            positions: [num_tokens] absolute positions in their sequences.
            kv_caches: per layer (k_cache, v_cache), each [num_blocks, block_size, nkv, hd].
            meta: slot mapping and per-sequence block tables (see attention.py).
            logits_rows: rows whose logits are wanted (None = all).

        Returns:
            [len(logits_rows), vocab_size] float32 logits.
        """
        a = self.arch
        h = F.embedding(input_ids, self.embed)
        cos, sin = self.rope.tables(positions)
        n = input_ids.shape[0]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = _rms_norm(h, layer["in_norm"], a.rms_norm_eps)
            qkv = self.linear(x, layer["qkv"], layer["qkv_bias"])
            qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            # RoPE on queries and keys together: one set of ops instead of two
            qk = _apply_rope(qk.view(n, a.num_heads + a.num_kv_heads, a.head_dim), cos, sin)
            q, k = qk.split([a.num_heads, a.num_kv_heads], dim=1)
            v = v.view(n, a.num_kv_heads, a.head_dim)
            write_kv(k_cache, v_cache, k, v, meta)
            o = paged_attention(q, k_cache, v_cache, meta, self.scale)
            h = h + self.linear(o.reshape(n, self.q_size), layer["o"], None)
            x = _rms_norm(h, layer["post_norm"], a.rms_norm_eps)
            gate, up = self.linear(x, layer["gate_up"], None).chunk(2, dim=-1)
            h = h + self.linear(F.silu(gate) * up, layer["down"], None)
        if logits_rows is not None:
            h = h[logits_rows]
        h = _rms_norm(h, self.norm, a.rms_norm_eps)
        return self.linear(h, self.lm_head, None).float()
