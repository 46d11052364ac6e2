"""Helpers for the architecture reference tests (test_archs, test_rope_scaling, test_window_long):
the llama.cpp source tree holding ``convert_hf_to_gguf.py``, a tiny random model saved with
transformers' own classes, and every position's logits of one prompt through a model over an
engine's KV pool. No tests here."""

from __future__ import annotations

import json
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


def save_random_model(d: Path, tokenizer, model_cls: str, config_cls: str, config: dict,
                      norm_offset: float = 1.0) -> Path:
    """A random transformers ``model_cls`` (seed 0) of ``config_cls(**config)`` saved in ``d``
    with ``tokenizer`` (the default model's): every norm weight random around ``norm_offset``
    (0 for Gemma's ``1 + w`` norms) and every bias random (transformers initialises them to the
    identity and zero, where a wrongly applied norm or bias would not show)."""
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(
        **config, vocab_size=tokenizer.vocab_size))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.3 + norm_offset)
            elif name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.3)
    model.save_pretrained(str(d))
    tokenizer.save_json(str(d / "tokenizer.json"))
    # the default model's BPE tokenizer, not the class transformers maps gemma3_text to
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


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


def step_last_logits(eng, ids, others=()):
    """One engine step with ``ids`` (and ``others``, token lists, prefilled in the same step):
    (the logits of ``ids``' last prompt token, the first position it computed, the step's number
    of chunks). The requests are aborted after."""
    reqs = [eng.add_request(list(o), SamplingParams(max_tokens=1)) for o in others]
    req = eng.add_request(list(ids), SamplingParams(max_tokens=1))
    sched = eng.scheduler.schedule()
    mine = [c for c in sched.chunks if c.request is req]
    assert mine and mine[0].start + mine[0].num_tokens == len(ids), "the prompt must fit one step"
    tables = {c.request.request_id: eng.cache.block_table(c.request.request_id) for c in sched.chunks}
    logits, owners = eng.runner.forward_logits(sched.chunks, tables)
    out = logits[[o.request for o in owners].index(req)].clone()
    eng.scheduler.update(sched, {})
    for r in reqs + [req]:
        eng.abort(r.request_id)
    return out, mine[0].start, len(sched.chunks)
