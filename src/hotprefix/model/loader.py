"""Model loading: a GGUF file or a local Hugging Face directory -> architecture + fp weights.

A GGUF's header is read by ``gguf_file.py``; its tensors are dequantized with the ``gguf`` package,
each when read. Weights are returned under
Hugging Face names (``model.layers.0.self_attn.q_proj.weight`` ...) in Hugging Face layout, so the
model code has one layout to know. The model fingerprint (a hash of the weight bytes and the
architecture) is part of the prefix cache's namespace: a new checkpoint never reuses an old
checkpoint's blocks. Finding the file (``resolve_model_path``) and reading its KV shape without
torch live in ``metadata.py``; the RoPE base and llama3 scaling factors are read by ``rope.py``.

This module knows nothing about tokenization, scheduling or the KV cache.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from dataclasses import field as dataclass_field

import numpy as np
import torch

from hotprefix.files.fingerprint import files_digest, identities
from hotprefix.model.arch import SUPPORTED_ARCHS, family
from hotprefix.model.gguf_file import GgufFile
from hotprefix.model.metadata import (DEFAULT_MODEL_FILE, ModelLoadError, default_model_path,
                                      resolve_model_path)
from hotprefix.model.qlinear import BLOCK, GGUF_TYPES
from hotprefix.model.rope import gguf_freq_factors

__all__ = ["DEFAULT_MODEL_FILE", "SUPPORTED_ARCHS", "LoadedModel", "ModelArch", "ModelLoadError",
           "default_model_path", "load_model", "resolve_model_path"]

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class ModelArch:
    """Shape of a decoder: the numbers every family has, then those some families have (their
    defaults: absent). The family (``arch.family(arch)``) says what the layer does with them."""

    arch: str
    """Architecture name (``arch.SUPPORTED_ARCHS``: llama, mistral, qwen2, smollm, qwen3, gemma3 ...)."""
    vocab_size: int
    """Rows of the embedding matrix."""
    hidden_size: int
    """Model width."""
    intermediate_size: int
    """MLP width."""
    num_layers: int
    """Decoder layers."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (GQA when fewer than num_heads)."""
    head_dim: int
    """Width of one head."""
    rope_theta: float
    """RoPE base frequency."""
    rms_norm_eps: float
    """RMSNorm epsilon."""
    max_position: int
    """Context length the model was trained for."""
    attention_bias: bool
    """Q/K/V projections carry a bias (qwen2)."""
    tie_word_embeddings: bool
    """The output head reuses the embedding matrix."""
    rope_freq_factors: tuple[float, ...] | None = None
    """Llama 3 RoPE scaling: one divisor per rotary frequency pair (``head_dim // 2``), so that
    ``inv_freq[i] = rope_theta ** (-2i / head_dim) / rope_freq_factors[i]``: a GGUF's
    ``rope_freqs.weight``, or computed from a HF ``rope_scaling`` of type llama3
    (``rope.llama3_freq_factors``); a linear scaling as one factor repeated. They apply to the
    global (full-attention) layers. None: no scaling. Part of the fingerprint."""
    sliding_window: int = 0
    """Keys a query of a local layer sees: those at ``[p - sliding_window + 1, p]`` (0: none)."""
    local_layers: tuple[int, ...] = ()
    """The sliding-window layers (gemma3: all but every 6th); the others attend to every key."""
    rope_theta_local: float | None = None
    """RoPE base of the local layers (None: ``rope_theta``), without ``rope_freq_factors``."""
    attn_scale: float | None = None
    """What queries are scaled by before attention (None: ``head_dim ** -0.5``)."""
    final_logit_softcap: float | None = None
    """Logits become ``tanh(x / c) * c`` (None: none)."""

    def fingerprint_json(self) -> str:
        """The architecture as hashed into the fingerprint: every field, but a field added for a
        family (``OPTIONAL``) only where it is set, so the fingerprints of models without it
        (the default one's) stay what they were."""
        d = {k: v for k, v in self.__dict__.items()
             if k not in _OPTIONAL or v != _OPTIONAL[k]}
        return json.dumps(d, sort_keys=True)


_OPTIONAL = {"sliding_window": 0, "local_layers": (), "rope_theta_local": None,
             "attn_scale": None, "final_logit_softcap": None}
"""ModelArch fields that enter the fingerprint only when not at these defaults."""


@dataclass
class LoadedModel:
    arch: ModelArch
    weights: Mapping[str, torch.Tensor]
    """HF name -> fp32 tensor (a GGUF's are dequantized when read: ``GgufWeights``)."""
    fingerprint_digest: str | Future
    """The fingerprint, or (a GGUF) its hash still being computed on a thread while the weights
    are packed: read ``fingerprint``."""
    path: str
    tokenizer_source: str
    name: str
    identity: list[tuple] | None = None
    """A GGUF file's identity (``files.fingerprint.identities``) taken before it was mapped: its
    bytes are those mapped while the file keeps it."""
    blocks: dict[str, tuple[str, np.ndarray]] = dataclass_field(default_factory=dict)
    """A GGUF's block-quantized matrices as stored (HF name -> (GGUF type, raw bytes [..., bytes a
    row]): views of the file's memory map, rows in C order of the leading axes, Q/K rows in the
    same order as ``weights``): the ``gguf`` weight mode multiplies with them
    (``qlinear.GGUF_TYPES``)."""

    @property
    def fingerprint(self) -> str:
        """A hash of the weight files' bytes and the architecture (the cache namespace's root)."""
        fp = self.fingerprint_digest
        return fp.result() if isinstance(fp, Future) else fp


def load_model(model: str | None) -> LoadedModel:
    """Load a GGUF file or a HF directory.

    Raises:
        ModelLoadError: missing file, unknown architecture, unsupported quantization, bad layout.
    """
    path = resolve_model_path(model)
    if os.path.isdir(path):
        return _load_hf_dir(path)
    if path.endswith(".gguf"):
        return _load_gguf(path)
    raise ModelLoadError(f"unsupported model file {path}: expected a .gguf file or a directory "
                         "with config.json and *.safetensors")


# --------------------------------------------------------------------------- GGUF


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo the Q/K row permutation llama.cpp's converter applies for its RoPE layout."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermuted_rows(raw: np.ndarray, n_head: int) -> np.ndarray:
    """``_unpermute``'s rows as a view of ``raw`` [rows, bytes a row], without a copy: shape
    [n_head, 2, rows / n_head / 2, bytes a row], rows in C order of the leading axes."""
    rows = raw.shape[0]
    return raw.reshape(n_head, rows // n_head // 2, 2, raw.shape[1]).swapaxes(1, 2)


class GgufWeights(Mapping):
    """A GGUF's tensors by Hugging Face name, dequantized to fp32 (Q/K rows un-permuted) each time
    one is read: the model reads each once and keeps what it packs, and the ``gguf`` weight mode
    reads only the few without blocks, so the fp32 copy of the whole model (540 MB for the default
    one) is never held at once."""

    def __init__(self, entries: dict[str, tuple]):
        self._entries = entries  # name -> (reader tensor, shape, Q/K head count or None)

    def __getitem__(self, name: str) -> torch.Tensor:
        from gguf.quants import dequantize

        t, shape, heads = self._entries[name]
        arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if heads:
            arr = _unpermute(arr, heads)
        return torch.from_numpy(np.array(arr, dtype=np.float32, order="C", copy=True))

    def __contains__(self, name: object) -> bool:  # Mapping's would dequantize the tensor
        return name in self._entries

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def _load_gguf(path: str) -> LoadedModel:
    try:
        from gguf.quants import dequantize
    except ImportError as e:  # pragma: no cover - dependency
        raise ModelLoadError("the gguf package is needed to load .gguf files") from e
    try:
        identity = identities([path])  # before the map: a file replaced after this is not it
        reader = GgufFile(path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {e}") from e

    def field(key: str, default=None):
        return reader.fields.get(key, default)

    arch_name = field("general.architecture")
    fam = family(arch_name)
    if fam is None:
        raise ModelLoadError(f"unsupported architecture {arch_name!r} in {path}; "
                             f"supported: {', '.join(SUPPORTED_ARCHS)}")
    a = arch_name
    n_heads = int(field(f"{a}.attention.head_count"))
    n_kv = int(field(f"{a}.attention.head_count_kv", n_heads))
    hidden = int(field(f"{a}.embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = field(f"{a}.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"])
    head_dim = int(field(f"{a}.attention.key_length", hidden // n_heads))
    scaling = field(f"{a}.rope.scaling.type")
    if scaling not in (None, "none") and scaling not in fam.rope_scalings:
        raise ModelLoadError(f"{path}: RoPE scaling type {scaling!r} is not supported (only "
                             "llama3's, as rope_freqs.weight)")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    common = dict(
        arch=a, vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(field(f"{a}.feed_forward_length")),
        num_layers=int(field(f"{a}.block_count")), num_heads=n_heads, num_kv_heads=n_kv,
        head_dim=head_dim, rope_theta=float(field(f"{a}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(field(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=int(field(f"{a}.context_length", 4096)),
        attention_bias="blk.0.attn_q.bias" in names,
        tie_word_embeddings="output.weight" not in names,
        rope_freq_factors=(None if freqs is None else gguf_freq_factors(
            dequantize(freqs.data, freqs.tensor_type), head_dim, path)),
    )
    arch = ModelArch(**{**common, **fam.gguf_fields(field, a, common, names, path)})
    permuted = a in fam.permuted  # llama.cpp permutes Q/K for llama, mistral, smollm

    entries: dict[str, tuple] = {}
    blocks: dict[str, tuple[str, np.ndarray]] = {}
    unblocked: list[tuple[str, int, int]] = []  # matrices without a block kernel: type, bytes, size
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists dims fastest-first
        name = t.name
        heads = None  # Q/K rows llama.cpp permuted: un-permuted with their head count
        if name == "token_embd.weight":
            hf = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            hf = "model.norm.weight"
        elif name == "output.weight":
            hf = "lm_head.weight"
        elif name.startswith("blk."):
            _, idx, kind, suffix = name.split(".", 3)
            if kind not in fam.tensors:
                continue  # no other per-layer tensor is read
            if permuted:
                heads = {"attn_q": n_heads, "attn_k": n_kv}.get(kind)
            hf = f"model.layers.{idx}.{fam.tensors[kind]}.{suffix}"
        else:
            continue  # rope_freqs.weight is read into the arch above
        try:  # one row now: an unsupported type fails the load, not a later read
            dequantize(t.data[:1], t.tensor_type)
        except NotImplementedError as e:
            raise ModelLoadError(f"tensor {t.name} uses quantization {t.tensor_type.name}, which "
                                 "is not supported") from e
        entries[hf] = (t, shape, heads)
        if t.tensor_type.name in GGUF_TYPES and len(shape) == 2 and shape[1] % BLOCK == 0:
            raw = np.asarray(t.data, dtype=np.uint8).reshape(shape[0], -1)  # a block row per row
            blocks[hf] = (t.tensor_type.name, _unpermuted_rows(raw, heads) if heads else raw)
        elif len(shape) == 2:
            unblocked.append((t.tensor_type.name, int(t.n_bytes), shape[0] * shape[1]))
    if unblocked:  # the gguf mode multiplies these as the mixed mode does (fp16 or fp32 weights)
        log.warning("%d matrices stored as %s have no block kernel: the gguf weight mode "
                    "dequantizes them (%.1f MiB in the file, %.1f MiB as fp32)", len(unblocked),
                    "/".join(sorted({k for k, _, _ in unblocked})),
                    sum(b for _, b, _ in unblocked) / 2**20, sum(4 * n for _, _, n in unblocked) / 2**20)
    weights = GgufWeights(entries)
    _check_weights(arch, weights, path)
    # hashed on a thread (hashlib releases the GIL) while the caller packs the weights
    pool = ThreadPoolExecutor(1, thread_name_prefix="fingerprint")
    fp = pool.submit(files_digest, [path], arch.fingerprint_json())
    pool.shutdown(wait=False)
    name = str(field("general.name") or os.path.basename(path))
    return LoadedModel(arch, weights, fp, path, path, name, identity, blocks)


# --------------------------------------------------------------------------- HF directory
def _load_hf_dir(path: str) -> LoadedModel:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise ModelLoadError(f"{path} has no config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    mtype = cfg.get("model_type", "")
    fam = family(mtype)
    if fam is None:
        raise ModelLoadError(f"unsupported architecture {mtype!r} in {cfg_path}; "
                             f"supported: {', '.join(SUPPORTED_ARCHS)}")
    n_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // n_heads)
    rope_theta, rope_factors = fam.hf_rope(cfg, head_dim, cfg_path)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weights")
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for fpath in files:
        for k, v in load_file(fpath).items():
            weights[k] = v.float()
    fam.hf_weights(weights)
    common = dict(
        arch=mtype, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]), num_layers=int(cfg["num_hidden_layers"]),
        num_heads=n_heads, num_kv_heads=int(cfg.get("num_key_value_heads", n_heads)),
        head_dim=head_dim, rope_theta=rope_theta,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position=int(cfg.get("max_position_embeddings", 4096)),
        attention_bias=bool(cfg.get("attention_bias", mtype == "qwen2")),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", "lm_head.weight" not in weights)),
        rope_freq_factors=rope_factors,
    )
    arch = ModelArch(**{**common, **fam.hf_fields(cfg, common, cfg_path)})
    if "lm_head.weight" not in weights and not arch.tie_word_embeddings:
        raise ModelLoadError(f"{path}: lm_head.weight missing and embeddings are not tied")
    _check_weights(arch, weights, path)
    tok_src = os.path.join(path, "tokenizer.json")
    if not os.path.exists(tok_src):
        raise ModelLoadError(f"{path} has no tokenizer.json")
    fp = files_digest(files, arch.fingerprint_json())
    return LoadedModel(arch, weights, fp, path, path, os.path.basename(os.path.normpath(path)))


def _check_weights(arch: ModelArch, w: dict[str, torch.Tensor], path: str) -> None:
    need = ["model.embed_tokens.weight", "model.norm.weight"]
    names = family(arch.arch).layer_tensors()
    for i in range(arch.num_layers):
        need += [f"model.layers.{i}.{n}.weight" for n in names]
    missing = [n for n in need if n not in w]
    if missing:
        raise ModelLoadError(f"{path} lacks {len(missing)} expected tensors, e.g. {missing[:3]}")
