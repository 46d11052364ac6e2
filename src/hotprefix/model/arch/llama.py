"""The Llama family: llama, mistral and smollm (Q/K rows permuted by llama.cpp's converter) and
qwen2 (the same layer with a Q/K/V bias, rows as Hugging Face stores them).

Everything they are is the base layer (``base.Family``): pre-norm attention with RoPE and a SwiGLU
MLP. Llama 3.x's RoPE scaling arrives as ``rope_freqs.weight`` (or a HF ``rope_scaling`` of type
llama3), read by ``rope.py`` for every family. This module knows nothing else.
"""

from __future__ import annotations

from hotprefix.model.arch.base import Family


class Llama(Family):
    name = "llama"
    archs = ("llama", "mistral", "smollm")
    permuted = frozenset(archs)  # convert_hf_to_gguf.py's LlamaModel.permute


class Qwen2(Family):
    name = "qwen2"
    archs = ("qwen2",)
