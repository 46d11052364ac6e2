"""Coming from vLLM: vLLM's option names, output shape, sampling fields, ``vllm serve`` flags and
metric names, all read through ``hotprefix.compat.vllm``."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from hotprefix import LLM
from hotprefix.compat import vllm as vllm_compat
from hotprefix.cli import build_parser, main
from hotprefix.config.flags import check_vllm_unsupported, engine_config_from_args
from hotprefix.config.sections import ConfigError, EngineConfig, ServerConfig, flat_options
from hotprefix.request.sampling import SamplingError, SamplingParams
from hotprefix.server.tenants import SINGLE_KEY_TENANT, AuthError, TenantRegistry, single_key_file
from server_support import LiveServer, free_port, tiny_config, wait_idle

# vLLM option: (a value, the hotprefix field it sets, the value that field gets)
VLLM_OPTIONS = {
    "model": ("m.gguf", "model", "m.gguf"),
    "tokenizer": ("tok/tokenizer.json", "tokenizer", "tok/tokenizer.json"),
    "dtype": ("half", "dtype", "float16"),
    "gpu_memory_utilization": (0.5, "memory_utilization", 0.5),
    "enforce_eager": (True, "enforce_eager", True),
    "enable_prefix_caching": (False, "enable_prefix_caching", False),
    "max_model_len": (1024, "max_model_len", 1024),
    "max_num_seqs": (4, "max_num_seqs", 4),
    "max_num_batched_tokens": (512, "max_num_batched_tokens", 512),
    "block_size": (32, "block_size", 32),
    "num_gpu_blocks_override": (64, "num_blocks", 64),
    "kv_cache_memory_bytes": (2**28, "kv_cache_memory", 2**28),
    "kv_cache_dtype": ("int8", "kv_cache_dtype", "int8"),
}
NOT_ACCEPTED = "not-an-accepted-value"


def _sections(cfg: EngineConfig, field: str):
    return next(part for part in (cfg.model, cfg.cache, cfg.scheduler) if hasattr(part, field))


def test_every_mapped_option_is_tested_here():
    assert set(VLLM_OPTIONS) == set(vllm_compat.OPTIONS)
    assert not set(vllm_compat.UNSUPPORTED) & set(flat_options(EngineConfig()))


@pytest.mark.parametrize("name", sorted(VLLM_OPTIONS))
def test_vllm_option_sets_its_hotprefix_field(name):
    value, field, expected = VLLM_OPTIONS[name]
    default = flat_options(EngineConfig())
    assert default[field] != expected  # so the check below means something
    cfg = vllm_compat.engine_config(**{name: value})
    assert getattr(_sections(cfg, field), field) == expected
    assert {k: v for k, v in flat_options(cfg).items() if k != field} == \
        {k: v for k, v in default.items() if k != field}  # nothing else moved


@pytest.mark.parametrize("given,expected", [("half", "float16"), ("float", "float32"), ("float16", "float16"),
                                            ("bfloat16", "bfloat16"), (torch.float16, "float16"),
                                            (torch.bfloat16, "bfloat16")])
def test_vllm_dtype_spellings(given, expected):
    assert vllm_compat.engine_config(dtype=given).model.dtype == expected


def test_one_setting_under_both_names_is_refused():
    with pytest.raises(ConfigError, match="gpu_memory_utilization.*memory_utilization"):
        vllm_compat.engine_config(gpu_memory_utilization=0.5, memory_utilization=0.6)
    cfg = vllm_compat.engine_config(gpu_memory_utilization=0.5)
    assert cfg.replace(**vllm_compat.engine_options({"gpu_memory_utilization": 0.7})).cache.memory_utilization == 0.7


@pytest.mark.parametrize("name", sorted(vllm_compat.UNSUPPORTED))
def test_unsupported_vllm_option_is_an_error_naming_it(name):
    entry = vllm_compat.UNSUPPORTED[name]
    with pytest.raises(ConfigError) as e:
        vllm_compat.engine_config(**{name: NOT_ACCEPTED})
    assert f"'{name}'" in str(e.value) and entry.instead in str(e.value)
    for value in entry.accepted:  # asks for what hotprefix does anyway
        assert vllm_compat.engine_config(**{name: value}) == EngineConfig()


@pytest.mark.parametrize("name", sorted(vllm_compat.SAMPLING_UNSUPPORTED))
def test_unsupported_sampling_field_is_an_error_naming_it(name):
    entry = vllm_compat.SAMPLING_UNSUPPORTED[name]
    with pytest.raises(SamplingError) as e:
        SamplingParams(temperature=0.5, **{name: NOT_ACCEPTED})
    assert e.value.param == name and f"'{name}'" in str(e.value) and entry.instead in str(e.value)
    for value in entry.accepted:
        assert SamplingParams(temperature=0.5, **{name: value}) == SamplingParams(temperature=0.5)


def test_vllm_sampling_params_as_vllm_code_writes_them():
    sp = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=1, max_tokens=8, stop=["\n\n"],
                        stop_token_ids=[2], ignore_eos=True, n=1, presence_penalty=0.0,
                        frequency_penalty=0.0, repetition_penalty=1.0, min_p=0.0, logprobs=None,
                        skip_special_tokens=True)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.seed, sp.max_tokens) == (0.8, 0.95, 50, 1, 8)
    assert dataclasses.replace(sp, seed=2).seed == 2
    assert SamplingParams(n=4, best_of=6).num_sequences == 6
    with pytest.raises(SamplingError, match="min_p"):
        SamplingParams(min_p=0.1)
    with pytest.raises(TypeError, match="no_such_field"):
        SamplingParams(no_such_field=1)


def test_sampling_params_changed_after_construction_count_or_are_refused():
    """vLLM code sets fields on a SamplingParams it made: a field hotprefix has takes effect (the
    stop list is read when the request is added), a vLLM field it lacks is refused unless its
    value asks for nothing, and any other name is an error (never silently kept and ignored)."""
    sp = SamplingParams(temperature=0, max_tokens=4)
    sp.stop = ["."]
    assert sp.stop_list == ["."]
    sp.n, sp.logprobs, sp.presence_penalty = 3, 5, 1.5  # fields hotprefix has: kept
    assert (sp.n, sp.logprobs, sp.presence_penalty) == (3, 5, 1.5)
    sp.min_p = 0  # asks for nothing: accepted, not stored
    for name, value in [("min_p", 0.2), ("bad_words", ["x"])]:
        with pytest.raises(SamplingError, match=f"'{name}'"):
            setattr(sp, name, value)
    sp.n = 0
    with pytest.raises(SamplingError, match="n must be"):
        sp.validate()  # as add_request does
    with pytest.raises(AttributeError, match="no field 'stop_strings'"):
        sp.stop_strings = ["."]


# ---------------------------------------------------------------- the offline LLM (tiny model)

@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir):
    return LLM(tiny_model_dir, num_threads=1, max_model_len=512, gpu_memory_utilization=0.5,
               num_gpu_blocks_override=128, enforce_eager=True, served_model_name=["x", "y"], seed=7)


def test_llm_takes_vllm_options(tiny_llm, tiny_model_dir):
    cfg = tiny_llm.config
    assert cfg.cache.memory_utilization == 0.5 and cfg.cache.num_blocks == 128
    assert cfg.model.enforce_eager is True and cfg.scheduler.max_model_len == 512
    assert tiny_llm.engine.runner.num_blocks == 128 and tiny_llm.engine.max_model_len == 512
    assert tiny_llm.served_model_name == "x" and tiny_llm.seed == 7
    plain = LLM(tiny_model_dir, num_threads=1, num_blocks=16)
    assert plain.served_model_name == plain.engine.model_name and plain.seed is None
    with pytest.raises(ConfigError, match="'quantization'.*GGUF"):
        LLM(tiny_model_dir, quantization="awq")
    with pytest.raises(ConfigError, match="seed must be an integer"):
        LLM(tiny_model_dir, seed="7")


def test_outputs_in_vllm_shape(tiny_llm):
    prompts = ["The capital of France is", [1, 2, 3, 4]]
    outs = tiny_llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
    for out, prompt in zip(outs, prompts):
        (c,) = out.outputs
        assert c.index == 0 and c.text == out.text and c.token_ids == out.token_ids
        assert c.finish_reason == out.finish_reason == "length" and c.finished()
        assert c.cumulative_logprob is None and c.logprobs is None
        assert len(c.token_ids) == 5 and out.num_cached_tokens >= 0
    assert outs[0].prompt == prompts[0] and outs[1].prompt is None
    assert outs[1].prompt_token_ids == [1, 2, 3, 4]
    assert outs[0].prompt_token_ids == tiny_llm.tokenizer.encode(prompts[0])
    conv = [{"role": "user", "content": "Hi!"}]
    (chat,) = tiny_llm.chat(conv, sampling_params=SamplingParams(max_tokens=3))
    assert chat.prompt == tiny_llm.tokenizer.render_chat(conv) and chat.outputs[0].text == chat.text


def test_vllm_prompt_dicts_and_request_keywords(tiny_llm):
    """vLLM's TextPrompt / TokensPrompt dicts are read (a lone dict had been iterated: the model
    ran on the text 'prompt_token_ids'), and vLLM's keywords of generate and chat are accepted
    when they ask for nothing, else refused by name."""
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    ids = tiny_llm.tokenizer.encode("The capital of France is")
    want = tiny_llm.generate([ids, "The capital of France is"], sp)
    for prompts in ([{"prompt_token_ids": ids}, {"prompt": "The capital of France is"}],):
        got = tiny_llm.generate(prompts, sp)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert got[0].prompt_token_ids == ids and got[1].prompt == "The capital of France is"
    (one,) = tiny_llm.generate({"prompt_token_ids": ids}, sp, lora_request=None)
    assert one.prompt_token_ids == ids and one.token_ids == want[0].token_ids
    (old,) = tiny_llm.generate(prompt_token_ids=[ids], sampling_params=sp)  # vLLM's older keyword
    assert old.token_ids == want[0].token_ids
    with pytest.raises(ValueError, match="multi_modal_data"):
        tiny_llm.generate({"prompt": "x", "multi_modal_data": {"image": None}}, sp)
    with pytest.raises(ValueError, match="'lora_request'"):
        tiny_llm.generate("x", sp, lora_request=object())
    conv = [{"role": "user", "content": "Hi!"}]
    assert tiny_llm.chat(conv, sp, add_generation_prompt=True, chat_template_kwargs=None)
    with pytest.raises(ValueError, match="'add_generation_prompt'"):
        tiny_llm.chat(conv, sp, add_generation_prompt=False)
    with pytest.raises(ValueError, match="'chat_template_kwargs'"):
        tiny_llm.chat(conv, sp, chat_template_kwargs={"enable_thinking": False})
    late = SamplingParams(max_tokens=4)
    late.temperature = -1.0  # checked again when the request is added
    with pytest.raises(SamplingError, match="temperature"):
        tiny_llm.generate("x", late)


def test_sampling_params_per_prompt_and_by_vllm_keyword(tiny_llm):
    outs = tiny_llm.generate(["a", "b"], sampling_params=[SamplingParams(max_tokens=2, ignore_eos=True),
                                                          SamplingParams(max_tokens=6, ignore_eos=True)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 6]
    with pytest.raises(TypeError, match="not both"):
        tiny_llm.generate("a", SamplingParams(), sampling_params=SamplingParams())
    with pytest.raises(ValueError, match="3 SamplingParams for 2 prompts"):
        tiny_llm.generate(["a", "b"], [SamplingParams()] * 3)


def test_default_seed_makes_a_run_repeatable(tiny_model_dir):
    sp = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)

    def run(seed):
        llm = LLM(tiny_model_dir, num_threads=1, num_blocks=64, seed=seed)
        return [o.token_ids for o in llm.generate(["same prompt"] * 3, sp)]

    first, again = run(7), run(7)
    assert first == again  # the same script, the same tokens
    assert first[0] != first[1]  # each request its own seed
    assert run(8) != first
    seeded = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=5)
    llm = LLM(tiny_model_dir, num_threads=1, num_blocks=64, seed=7)
    plain = LLM(tiny_model_dir, num_threads=1, num_blocks=64)
    assert llm.generate("x", seeded)[0].token_ids == plain.generate("x", seeded)[0].token_ids


@pytest.mark.model
def test_the_articles_snippet_runs_as_written(monkeypatch):
    """``LLM(max_model_len=8192, gpu_memory_utilization=0.90, enable_prefix_caching=True,
    enforce_eager=False)`` with the embedded model. On CPU the fraction is of host memory; the test
    pretends the machine has 1.5 GiB so that the pool stays small on a shared test machine."""
    from hotprefix.engine import runner

    total = 3 * 2**29
    monkeypatch.setattr(runner, "_total_memory", lambda device: total)
    llm = LLM(max_model_len=8192, gpu_memory_utilization=0.90, enable_prefix_caching=True,
              enforce_eager=False)
    cfg = llm.config
    assert cfg.model.model is None and cfg.cache.memory_utilization == 0.90
    assert cfg.cache.enable_prefix_caching is True and cfg.model.enforce_eager is False
    assert cfg.scheduler.max_model_len == 8192 == llm.engine.max_model_len
    pool = llm.engine.runner.num_blocks * cfg.cache.block_size * llm.engine.runner.bytes_per_token
    assert 0 < pool <= 0.90 * total - 512 * 2**20  # sized from the fraction (weights + reserve aside)
    outs = llm.generate(["What is the capital of France?"], SamplingParams(temperature=0, max_tokens=8))
    assert outs[0].outputs[0].text == outs[0].text and outs[0].outputs[0].token_ids
    (chat,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(temperature=0, max_tokens=8))
    assert "Paris" in chat.outputs[0].text


# ---------------------------------------------------------------- hotprefix serve with vLLM's flags

VLLM_SERVE = ["--max-model-len", "512", "--gpu-memory-utilization", "0.5", "--num-gpu-blocks-override",
              "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "256", "--block-size", "16",
              "--dtype", "float", "--enforce-eager", "--enable-prefix-caching", "--served-model-name", "x",
              "--api-key", "k", "--tensor-parallel-size", "1", "--disable-log-requests"]


def test_vllm_serve_flags_parse_to_hotprefix_settings():
    args = build_parser().parse_args(["serve", "m.gguf", *VLLM_SERVE, "--no-enable-prefix-caching",
                                      "--kv-cache-memory-bytes", "1000000"])
    check_vllm_unsupported(args)
    cfg = engine_config_from_args(args)
    assert cfg == vllm_compat.engine_config(
        model="m.gguf", max_model_len=512, gpu_memory_utilization=0.5, num_gpu_blocks_override=256,
        max_num_seqs=4, max_num_batched_tokens=256, block_size=16, dtype="float", enforce_eager=True,
        enable_prefix_caching=False, kv_cache_memory_bytes="1000000")
    assert args.served_model_name == "x" and args.api_key == "k"


@pytest.mark.parametrize("name", sorted(vllm_compat.UNSUPPORTED))
def test_unsupported_vllm_flag_is_an_error_naming_it(name, capsys):
    entry = vllm_compat.UNSUPPORTED[name]
    flag = "--" + name.replace("_", "-")
    switch = entry.switch
    tries = [([flag], True), ([f"--no-{flag[2:]}"], False)] if switch else \
        [([flag, NOT_ACCEPTED], NOT_ACCEPTED)] + [([flag, str(a)], a) for a in entry.accepted if a is not None]
    for argv, value in tries:
        args = build_parser().parse_args(["serve", *argv])
        if value in entry.accepted:
            check_vllm_unsupported(args)
        else:
            with pytest.raises(ConfigError, match=f"{argv[0]}.*'{name}'"):
                check_vllm_unsupported(args)
    bad = [flag] if switch and True not in entry.accepted else \
        [f"--no-{flag[2:]}"] if switch else [flag, NOT_ACCEPTED]
    assert main(["serve", *bad]) == 2  # refused before any model loads
    assert f"vLLM's '{name}' is not supported" in capsys.readouterr().err


def test_api_key_is_one_admin_tenant_never_written_to_disk(capsys):
    path = single_key_file("k")
    assert not os.path.isfile(path)  # a pipe of this process
    reg = TenantRegistry.from_file(path)
    tenant = reg.authenticate("k")
    assert tenant.name == SINGLE_KEY_TENANT and tenant.admin and reg.enabled
    for wrong in (None, "other"):
        with pytest.raises(AuthError):
            reg.authenticate(wrong)
    for bad in (" ", "k" * 1025):
        with pytest.raises(ConfigError, match="--api-key"):
            single_key_file(bad)
    assert main(["serve", "--api-key", "k", "--api-keys", "keys.json"]) == 2
    assert "not both" in capsys.readouterr().err


def _wait_until_serving(proc: subprocess.Popen, url: str, log_path: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"hotprefix serve exited with {proc.returncode}:\n{open(log_path).read()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    pytest.fail("hotprefix serve did not start:\n" + open(log_path).read()[-3000:])


def test_a_vllm_serve_command_line_serves(tiny_model_dir, tmp_path):
    """``vllm serve MODEL --flags...`` with ``vllm serve`` replaced by ``hotprefix serve``, called
    with the official openai client."""
    import openai

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = str(tmp_path / "serve.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "hotprefix.cli", "serve", tiny_model_dir,
                                 "--host", "127.0.0.1", "--port", str(port), *VLLM_SERVE],
                                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        _wait_until_serving(proc, url, log_path)
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["x"]
        r = client.completions.create(model="x", prompt="The capital of France is", max_tokens=4,
                                      temperature=0)
        assert r.model == "x" and isinstance(r.choices[0].text, str)
        assert 1 <= r.usage.completion_tokens <= 4
        chat = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=3, temperature=0)
        assert chat.choices[0].finish_reason in ("stop", "length")
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert httpx.get(url + "/metrics", timeout=10).status_code == 401
        metrics = httpx.get(url + "/metrics", headers={"Authorization": "Bearer k"}, timeout=10)
        assert metrics.status_code == 200 and "vllm:num_requests_running" in metrics.text
    finally:
        proc.terminate()
        proc.wait(timeout=60)


# ---------------------------------------------------------------- metrics under vLLM's names

def _families(text: str) -> dict[str, dict[tuple, float]]:
    """family name -> {(sample suffix, labels without vLLM's model_name/engine): value}."""
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        samples = out.setdefault(fam.name, {})
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine")))
            samples[(s.name[len(fam.name):], labels)] = s.value
    return out


def test_vllm_metrics_equal_their_hotprefix_twins(tiny_model_dir):
    with LiveServer(tiny_config(tiny_model_dir, num_threads=1)) as srv:
        for i in range(3):
            body = {"model": srv.model, "prompt": "the same prompt, again and again " * 4 + str(i % 2),
                    "max_tokens": 4, "temperature": 0}
            assert httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code == 200
        wait_idle(srv.url)
        text = httpx.get(srv.url + "/metrics", timeout=10).text
        srv.state.metrics.model_name = "x"
        labelled = httpx.get(srv.url + "/metrics", timeout=10).text
    fams = _families(text)
    for vllm_name, ours in vllm_compat.METRICS.items():
        assert fams[vllm_name] == fams[ours], vllm_name
        assert fams[vllm_name], vllm_name
    assert fams["vllm:prompt_tokens"][("_total", ())] > 0
    assert fams["vllm:prefix_cache_hits"][("_total", ())] > 0  # the prompts share a prefix
    assert fams["vllm:time_to_first_token_seconds"][("_count", ())] == 3
    for fam in text_string_to_metric_families(labelled):
        if fam.name.startswith("vllm:"):
            assert all(s.labels.get("model_name") == "x" and s.labels.get("engine") == "0"
                       for s in fam.samples), fam.name
