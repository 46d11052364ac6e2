"""Helpers for the architecture reference tests (test_archs, test_rope_scaling): the llama.cpp
source tree holding ``convert_hf_to_gguf.py``, and every position's logits of one prompt through a
model over an engine's KV pool. No tests here."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from hotprefix import LLM, SamplingParams
from hotprefix.model.attention import AttentionMetadata, PrefillSeq
from hotprefix.model.llama import LlamaModel


def llamacpp_src() -> Path | None:
    """The llama.cpp source tree that ``../shared/tools/llamacpp-peer.sh`` unpacks (or
    ``$HOTPREFIX_LLAMACPP_SRC``), when it holds the converter."""
    cand = os.environ.get("HOTPREFIX_LLAMACPP_SRC") or os.path.join(
        os.environ.get("PEER_DIR", os.path.expanduser("~/.cache/hotprefix-peers")),
        "llama_cpp_python-0.3.36", "vendor", "llama.cpp")
    p = Path(cand)
    return p if (p / "convert_hf_to_gguf.py").is_file() and (p / "gguf-py").is_dir() else None


def all_logits(model: LlamaModel, llm: LLM, ids: list[int]) -> torch.Tensor:
    """Every position's logits of one prompt through ``model`` over ``llm``'s KV pool."""
    eng = llm.engine
    req = eng.add_request(ids, SamplingParams(max_tokens=1))
    eng.scheduler.waiting.remove(req)
    assert eng.cache.allocate(req, len(ids), 0)
    bs, n = eng.block_size, len(ids)
    tables = eng.runner._group_tables({req.request_id: eng.cache.block_table(req.request_id)})
    metas = [AttentionMetadata(  # one per KV group (a hybrid pool has several)
        slot_mapping=torch.tensor([bt[p // bs] * bs + p % bs for p in range(n)]),
        prefills=[PrefillSeq(0, n, n, torch.tensor(bt))]) for bt in tables[req.request_id]]
    try:
        return model.forward(torch.tensor(ids), torch.arange(n), eng.runner.kv_caches,
                             eng.runner._per_layer(metas), None)
    finally:
        eng.cache.free(req)
        eng.requests.pop(req.request_id, None)
