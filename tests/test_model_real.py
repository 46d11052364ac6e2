"""Our forward pass on the real default model against Hugging Face transformers' reference on the
same GGUF checkpoint: logits within a tight tolerance, identical greedy continuations."""

from __future__ import annotations

import pytest
import torch

from hotprefix import SamplingParams
from hotprefix.model.loader import ModelLoadError, load_model

pytestmark = pytest.mark.model

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three prime numbers."}],
    [{"role": "user", "content": "Write one sentence about the ocean and the moon."}],
    [{"role": "user", "content": "Explain what a hash function is, briefly."}],
]


@pytest.fixture(scope="module")
def hf_model(hf_default_reference):
    """transformers' fp32 model of the same GGUF (read by its own GGUF reader)."""
    return hf_default_reference


def our_logits(llm, ids):
    """All-position logits of one prompt through the engine's runner (fresh, uncached)."""
    eng = llm.engine
    req = eng.add_request(ids, SamplingParams(max_tokens=1))
    eng.scheduler.waiting.remove(req)
    assert eng.cache.allocate(req, len(ids), 0)
    from hotprefix.model.attention import AttentionMetadata, PrefillSeq

    bs = eng.block_size
    bt = eng.cache.block_table(req.request_id)
    n = len(ids)
    meta = AttentionMetadata(slot_mapping=torch.tensor([bt[p // bs] * bs + p % bs for p in range(n)]),
                             prefills=[PrefillSeq(0, n, n, torch.tensor(bt))])
    logits = eng.runner.model.forward(torch.tensor(ids), torch.arange(n), eng.runner.kv_caches, meta, None)
    eng.cache.free(req)
    eng.requests.pop(req.request_id, None)
    return logits


def test_logits_match_transformers(real_llm_fp32, hf_model):
    worst = 0.0
    for msgs in PROMPTS:
        ids = real_llm_fp32.tokenizer.encode_chat(msgs)
        ours = our_logits(real_llm_fp32, ids)
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0].float()
        diff = (ours - ref).abs().max().item()
        worst = max(worst, diff)
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    print(f"max abs logit diff vs transformers: {worst:.2e}")
    assert worst < 1e-3, worst


def test_greedy_32_tokens_match_transformers(real_llm_fp32, hf_model):
    for msgs in PROMPTS[:2]:
        ids = real_llm_fp32.tokenizer.encode_chat(msgs)
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    eos_token_id=None, pad_token_id=2)[0, len(ids):].tolist()
        out = real_llm_fp32.generate([ids], SamplingParams(max_tokens=32, ignore_eos=True))[0]
        assert out.token_ids == ref


def test_capital_of_france(real_llm):
    out = real_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                        SamplingParams(max_tokens=16))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"


def test_clear_load_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(str(tmp_path / "missing.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="GGUF"):
        load_model(str(bad))
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        load_model(str(d))


def test_cli_generate_default_model():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "hotprefix.cli", "generate", "What is the capital of France?",
                          "--max-tokens", "16", "--kv-cache-memory", "64MiB"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Paris" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "hotprefix.cli", "generate", "hi", "--model", "/no/such.gguf"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert "model not found" in bad.stderr and "Traceback" not in bad.stderr


def test_unsupported_tensor_type_is_a_clear_load_error(tmp_path):
    """A tensor of a type gguf cannot dequantize fails the load with its name, even though the
    weights are dequantized only when read."""
    import gguf
    import numpy as np

    path = str(tmp_path / "q81.gguf")
    w = gguf.GGUFWriter(path, "llama")
    for add, v in ((w.add_block_count, 1), (w.add_embedding_length, 64), (w.add_head_count, 4),
                   (w.add_feed_forward_length, 128), (w.add_vocab_size, 32), (w.add_context_length, 64)):
        add(v)
    kind = gguf.GGMLQuantizationType.Q8_1
    block, size = gguf.GGML_QUANT_SIZES[kind]
    w.add_tensor("token_embd.weight", np.zeros((32, 64 // block * size), dtype=np.uint8), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="token_embd.weight uses quantization Q8_1"):
        load_model(path)
