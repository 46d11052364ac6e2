"""RoPE parameters of a model: the base frequency and, for llama3 scaling, one factor per rotary
frequency pair, read from a Hugging Face ``config.json`` or from a GGUF's ``rope_freqs.weight``.

A factor divides its pair's base frequency: ``inv_freq[i] = base ** (-2i / head_dim) / factor[i]``,
as llama.cpp's RoPE does with ``rope_freqs`` (ggml's ``freq_factors``) and as transformers'
``_compute_llama3_parameters`` does for ``rope_type: llama3``. Llama 3.1 and 3.2 checkpoints carry
them. Other scaling types (linear, dynamic, yarn, longrope, ...) are refused with their name: a
model run with the wrong rotary frequencies gives plausible-looking but wrong output.

This module knows nothing about weights, the forward pass or the KV cache.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from hotprefix.model.metadata import ModelLoadError

__all__ = ["hf_rope", "gguf_freq_factors", "inverse_frequencies", "llama3_freq_factors"]


def llama3_freq_factors(theta: float, head_dim: int, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_max_position: int) -> tuple[float, ...]:
    """The llama3 divisor of each rotary frequency, computed as llama.cpp's converter writes it
    to ``rope_freqs.weight`` (and as transformers divides its inverse frequencies): 1 where the
    wavelength is shorter than ``original_max_position / high_freq_factor``, ``factor`` where it is
    longer than ``original_max_position / low_freq_factor``, and a smooth blend between.

    Returns:
        ``head_dim // 2`` factors, computed in float64.
    """
    low_wavelen = original_max_position / low_freq_factor
    high_wavelen = original_max_position / high_freq_factor
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)  # 2 pi / inv_freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(float(factor))
        else:
            smooth = ((original_max_position / wavelen - low_freq_factor)
                      / (high_freq_factor - low_freq_factor))
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(factors)


def hf_rope(cfg: dict[str, Any], head_dim: int, where: str) -> tuple[float, tuple[float, ...] | None]:
    """The RoPE base and llama3 factors of a Hugging Face ``config.json``.

    Reads transformers 5's ``rope_parameters`` (the base inside it) and 4's ``rope_scaling``
    (the base beside it as ``rope_theta``), with the scaling type as ``rope_type`` or ``type``.

    Returns:
        (base, factors): factors is None when the config has no scaling (``default``).

    Raises:
        ModelLoadError: a scaling type other than llama3, per-layer-type RoPE parameters, a partial
            rotary factor, or llama3 parameters missing.
    """
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ModelLoadError(f"{where}: RoPE parameters {params!r} are not a mapping")
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ModelLoadError(f"{where}: RoPE parameters per layer type ({', '.join(params)}) "
                             "are not supported")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ModelLoadError(f"{where}: partial_rotary_factor {partial} is not supported")
    kind = str(params.get("rope_type", params.get("type", "default"))).lower()
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ModelLoadError(f"{where}: RoPE scaling type {kind!r} is not supported (only "
                             f"'llama3' is): {params}")
    original = params.get("original_max_position_embeddings",
                          cfg.get("original_max_position_embeddings",
                                  cfg.get("max_position_embeddings")))
    try:
        factors = llama3_freq_factors(
            theta, head_dim, float(params["factor"]), float(params["low_freq_factor"]),
            float(params["high_freq_factor"]), int(original))
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise ModelLoadError(f"{where}: llama3 RoPE scaling needs factor, low_freq_factor, "
                             f"high_freq_factor and original_max_position_embeddings "
                             f"(high != low): {params}") from e
    return theta, factors


def gguf_freq_factors(values: np.ndarray, head_dim: int, where: str) -> tuple[float, ...]:
    """A GGUF's ``rope_freqs.weight`` as factors, checked: ``head_dim // 2`` finite, positive.

    Raises:
        ModelLoadError: another length, or a factor that is not a positive finite number.
    """
    arr = np.asarray(values, dtype=np.float32).reshape(-1)
    if arr.shape[0] != head_dim // 2:
        raise ModelLoadError(f"{where}: rope_freqs.weight has {arr.shape[0]} factors, expected "
                             f"{head_dim // 2} (head_dim {head_dim} / 2)")
    if not (np.isfinite(arr).all() and (arr > 0).all()):
        raise ModelLoadError(f"{where}: rope_freqs.weight holds a factor that is not a positive "
                             f"finite number: {arr.tolist()}")
    return tuple(float(x) for x in arr)


def inverse_frequencies(head_dim: int, theta: float,
                        factors: tuple[float, ...] | None = None) -> torch.Tensor:
    """``base ** (-2i / head_dim) / factor[i]`` for i < head_dim / 2, in float64.

    Raises:
        ValueError: ``factors`` not of length ``head_dim // 2``.
    """
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if factors is not None:
        if len(factors) != inv.shape[0]:
            raise ValueError(f"{len(factors)} RoPE factors for {inv.shape[0]} frequencies")
        inv = inv / torch.tensor(factors, dtype=torch.float64)
    return inv
