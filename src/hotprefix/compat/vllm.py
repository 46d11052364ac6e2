"""vLLM's names for hotprefix's settings, outputs and metrics: the one place that maps them.

Code written for vLLM runs on hotprefix through these tables: ``LLM(gpu_memory_utilization=0.9,
enforce_eager=False)``, ``vllm serve`` command lines, ``out.outputs[0].text``, and dashboards or
routers that read ``vllm:*`` metrics.

- ``OPTIONS``: vLLM engine option -> the hotprefix config field that holds the same setting.
  The edges translate: the offline ``LLM`` passes its options through ``engine_options`` (or
  ``engine_config``) and the CLI's flags (``hotprefix.config.flags``) add each renamed option as a flag
  alias (``--gpu-memory-utilization``); the config dataclasses know nothing of vLLM and stay the
  only source of defaults. ``seed`` and ``served_model_name`` are options of the offline ``LLM`` itself.
- ``UNSUPPORTED`` / ``SAMPLING_UNSUPPORTED``: vLLM options and ``SamplingParams`` fields hotprefix
  does not have, each with what to use instead. A value that asks for what hotprefix does anyway
  (``tensor_parallel_size=1``, ``n=1``) is accepted; any other is an error naming the option,
  never silently ignored.
- ``METRICS``: vLLM metric name -> its hotprefix twin; the server exports each twin under both names.
- ``CompletionOutput``: ``RequestOutput.outputs[i]``, vLLM's shape of one completion (one per
  sequence of ``n``), with ``Logprob`` / ``TokenLogprobs`` for its log probabilities.

Torch-free. Knows nothing about the engine, the server or argparse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from hotprefix.config.sections import ConfigError, EngineConfig

OPTIONS: dict[str, str] = {
    "model": "model",
    "tokenizer": "tokenizer",
    "dtype": "dtype",
    "gpu_memory_utilization": "memory_utilization",
    "enforce_eager": "enforce_eager",
    "enable_prefix_caching": "enable_prefix_caching",
    "max_model_len": "max_model_len",
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "block_size": "block_size",
    "num_gpu_blocks_override": "num_blocks",
    "kv_cache_memory_bytes": "kv_cache_memory",
    "kv_cache_dtype": "kv_cache_dtype",
}
"""vLLM engine option -> hotprefix config field (the same setting; same name where both agree)."""

DTYPES: dict[str, str] = {"half": "float16", "float": "float32"}
"""vLLM's other spellings of a dtype -> hotprefix's (``dtype=torch.float16`` is read as ``float16``)."""


@dataclass(frozen=True)
class Unsupported:
    """A vLLM option (or sampling field) that hotprefix does not have."""

    instead: str
    """What to use instead, or why nothing is needed."""
    accepted: tuple[Any, ...] = (None,)
    """Values that ask for nothing beyond what hotprefix does anyway: accepted and dropped."""

    @property
    def switch(self) -> bool:
        """Whether the option is an on/off flag on a command line (``--x`` / ``--no-x``)."""
        return any(isinstance(a, bool) for a in self.accepted) and all(
            isinstance(a, bool) or a is None for a in self.accepted)


_ONE_DEVICE = ("hotprefix runs a model on one device: run one server per device and spread requests "
               "over them (deploy/ has a Ray Serve application with prefix-aware routing)")
_LOCAL_FILES = ("hotprefix loads local files only and downloads nothing: fetch the checkpoint first and "
                "pass its GGUF file or Hugging Face directory as the model")

UNSUPPORTED: dict[str, Unsupported] = {
    "tensor_parallel_size": Unsupported(_ONE_DEVICE, (1,)),
    "pipeline_parallel_size": Unsupported(_ONE_DEVICE, (1,)),
    "data_parallel_size": Unsupported(_ONE_DEVICE, (1,)),
    "distributed_executor_backend": Unsupported(_ONE_DEVICE),
    "quantization": Unsupported("load a quantized GGUF file (Q4_0, Q4_1, Q8_0 or a k-quant) as the model"),
    "trust_remote_code": Unsupported("hotprefix runs its own Llama-family forward (llama, mistral, qwen2, "
                                     "smollm) and never code from a checkpoint", (False,)),
    "revision": Unsupported(_LOCAL_FILES),
    "tokenizer_revision": Unsupported(_LOCAL_FILES),
    "download_dir": Unsupported(_LOCAL_FILES),
    "hf_token": Unsupported(_LOCAL_FILES),
    "load_format": Unsupported("the format is read from the path (a .gguf file or a directory with "
                               "safetensors)", ("auto",)),
    "tokenizer_mode": Unsupported("the tokenizer is a tokenizer.json (fast); tokenizer= picks another",
                                  ("auto",)),
    "prefix_caching_hash_algo": Unsupported("hash_algo ('sha256' or 'fast')", ("sha256",)),
    "swap_space": Unsupported("a preempted request is recomputed, never swapped; a host-memory tier "
                              "below the pool is kv_store=['host:4GiB'] (--kv-store host:4GiB)", (0,)),
    "cpu_offload_gb": Unsupported("the weights stay on the device: pick a smaller or more quantized model",
                                  (0,)),
    "enable_chunked_prefill": Unsupported("long prompts are always chunked; max_num_batched_tokens sets "
                                          "the chunk", (True, None)),
    "max_num_partial_prefills": Unsupported("one prompt is part-way at a time, as vLLM's default; a hybrid "
                                            "pool's chunk is window_prefill_chunk", (1, None)),
    "max_seq_len_to_capture": Unsupported("no CUDA graph is captured (see enforce_eager)"),
    "compilation_config": Unsupported("the forward is not compiled (see enforce_eager)", (None, 0)),
    "speculative_config": Unsupported("no speculative decoding"),
    "enable_lora": Unsupported("no LoRA adapters: merge the adapter into the weights", (False,)),
    "scheduling_policy": Unsupported("admission is first come, first served, with the longest cached "
                                     "prefix first (cache_aware, max_skips)", ("fcfs",)),
    "preemption_mode": Unsupported("a preempted request is always recomputed", (None, "recompute")),
    "enable_sleep_mode": Unsupported("stop the server to free its memory", (False,)),
    "hf_overrides": Unsupported("edit the model's config.json"),
    "seed": Unsupported("the server and the engine take a seed per request (SamplingParams(seed=N), "
                        "the request's 'seed'); the offline LLM(seed=N) seeds the requests that set none"),
    "disable_log_stats": Unsupported("hotprefix logs no periodic stats; read /metrics or "
                                     "/v1/cache/stats", (True,)),
    "disable_log_requests": Unsupported("hotprefix never logs prompt text; its one line per request "
                                        "(logger 'hotprefix.requests') holds counts and timings", (True,)),
    "enable_log_requests": Unsupported("hotprefix never logs prompt text; --log-requests FILE writes each "
                                       "request's block keys (for hotprefix simulate)", (False,)),
}
"""vLLM engine and server options hotprefix does not have."""

SAMPLING_UNSUPPORTED: dict[str, Unsupported] = {
    "min_p": Unsupported("use top_p or top_k", (0,)),
    "min_tokens": Unsupported("ignore_eos=True with max_tokens gives a fixed length", (0,)),
    "allowed_token_ids": Unsupported("no token restrictions"),
    "bad_words": Unsupported("no token restrictions"),
    "logits_processors": Unsupported("no logits processors"),
    "truncate_prompt_tokens": Unsupported("send a shorter prompt"),
    "include_stop_str_in_output": Unsupported("the text ends before the stop string", (False,)),
    "detokenize": Unsupported("the text is always detokenized", (True,)),
    "skip_special_tokens": Unsupported("special tokens are always left out of the text", (True,)),
    "spaces_between_special_tokens": Unsupported("special tokens are left out of the text", (True,)),
}
"""vLLM ``SamplingParams`` fields hotprefix does not have (those it has keep vLLM's names:
temperature, top_p, top_k, seed, max_tokens, stop, stop_token_ids, ignore_eos, n, best_of,
logprobs, prompt_logprobs, presence_penalty, frequency_penalty, repetition_penalty, logit_bias)."""

REQUEST_UNSUPPORTED: dict[str, Unsupported] = {
    "lora_request": Unsupported("no LoRA adapters: merge the adapter into the weights"),
    "prompt_adapter_request": Unsupported("no prompt adapters"),
    "guided_options_request": Unsupported("no constrained (structured) decoding"),
    "add_generation_prompt": Unsupported("the chat template always ends with the assistant's turn "
                                         "opened", (True,)),
    "continue_final_message": Unsupported("the assistant's turn is always a new one", (False,)),
    "chat_template": Unsupported("the model's own chat template is used: load a tokenizer with "
                                 "another one (tokenizer=...)"),
    "chat_template_kwargs": Unsupported("the chat template is rendered with the messages only",
                                        (None, {})),
    "chat_template_content_format": Unsupported("content parts are joined as text", ("auto",)),
    "mm_processor_kwargs": Unsupported("text models only"),
}
"""vLLM keyword arguments of ``LLM.generate`` / ``LLM.chat`` that hotprefix does not have."""

PROMPT_KEYS = {"prompt", "prompt_token_ids"}
"""Keys of vLLM's TextPrompt / TokensPrompt dicts that hotprefix reads (a dict with any other key,
such as ``multi_modal_data``, is refused)."""

METRICS: dict[str, str] = {
    "vllm:num_requests_running": "hotprefix_num_requests_running",
    "vllm:num_requests_waiting": "hotprefix_num_requests_waiting",
    "vllm:kv_cache_usage_perc": "hotprefix_kv_cache_usage_ratio",
    "vllm:gpu_cache_usage_perc": "hotprefix_kv_cache_usage_ratio",  # vLLM's name before 0.10
    "vllm:prefix_cache_queries": "hotprefix_prefix_cache_queries",
    "vllm:prefix_cache_hits": "hotprefix_prefix_cache_hits",
    "vllm:prompt_tokens": "hotprefix_prompt_tokens",
    "vllm:generation_tokens": "hotprefix_generation_tokens",
    "vllm:time_to_first_token_seconds": "hotprefix_time_to_first_token_seconds",
    "vllm:e2e_request_latency_seconds": "hotprefix_e2e_request_latency_seconds",
}
"""vLLM metric (family) name -> the hotprefix family exported with the same samples and values."""


def _spelled(name: str, value: Any, flag: bool) -> str:
    if not flag:
        return f"{name}={value!r}"
    dashed = name.replace("_", "-")
    if isinstance(value, bool):
        return f"--{dashed}" if value else f"--no-{dashed}"
    return f"--{dashed} {value}"


def rejection(name: str, value: Any, entry: Unsupported, flag: bool = False) -> str | None:
    """Why ``name=value`` cannot be honoured, or None when ``value`` is one of ``entry.accepted``.

    Args:
        flag: the value came from a command line (text, or a bool for a switch; spelled
            ``--name-with-dashes`` in the message).
    """
    if any(value == a or (flag and isinstance(value, str) and value == str(a)) for a in entry.accepted):
        return None
    why = f"{_spelled(name, value, flag)}: vLLM's {name!r} is not supported by hotprefix: {entry.instead}"
    fine = [_spelled(name, a, flag) for a in entry.accepted if a is not None]
    return why + (f" ({' or '.join(fine)} is accepted: what hotprefix does anyway)" if fine else "")


def drop_accepted(options: dict[str, Any], table: dict[str, Unsupported],
                  error: Callable[[str, str], Exception]) -> None:
    """Remove from ``options`` the names of ``table`` whose value asks for nothing; raise
    ``error(why, name)`` for the first whose value asks for what hotprefix does not do."""
    for name in [k for k in options if k in table]:
        why = rejection(name, options.pop(name), table[name])
        if why:
            raise error(why, name)


def engine_options(options: dict[str, Any]) -> dict[str, Any]:
    """Flat engine options with vLLM's names renamed to hotprefix's fields and vLLM's value spellings
    (``dtype='half'``) translated; hotprefix's own names pass through unchanged.

    Raises:
        ConfigError: a vLLM option hotprefix does not have (with a value other than an accepted
            one), or one setting given under both its names.
    """
    out: dict[str, Any] = {}
    for key, value in options.items():
        entry = UNSUPPORTED.get(key)
        if entry is not None:
            why = rejection(key, value, entry)
            if why:
                raise ConfigError(why)
            continue
        target = OPTIONS.get(key, key)
        if target != key and target in options:
            raise ConfigError(f"{key!r} is vLLM's name for {target!r}: give one of them, not both")
        out[target] = value
    if "dtype" in out and not isinstance(out["dtype"], str):
        out["dtype"] = str(out["dtype"]).removeprefix("torch.")  # torch.float16 -> float16
    if "dtype" in out:
        out["dtype"] = DTYPES.get(out["dtype"], out["dtype"])
    return out


def engine_config(**options: Any) -> EngineConfig:
    """``EngineConfig.from_options`` for options under vLLM's names or hotprefix's (``LLM``'s edge).

    Raises:
        ConfigError: see ``engine_options``; or an unknown option or invalid value.
    """
    return EngineConfig.from_options(**engine_options(options))


def flag_aliases() -> dict[str, list[str]]:
    """hotprefix config field -> vLLM's command-line spellings of it, where they differ
    (``memory_utilization`` -> ``--gpu-memory-utilization``)."""
    out: dict[str, list[str]] = {}
    for vllm_name, field in OPTIONS.items():
        if vllm_name != field:
            out.setdefault(field, []).append("--" + vllm_name.replace("_", "-"))
    return out


@dataclass(frozen=True)
class Logprob:
    """vLLM's ``Logprob``: one token's log probability at one position."""

    logprob: float
    rank: int | None = None
    """1 + the number of tokens more likely than this one."""
    decoded_token: str | None = None
    """The token's text."""


TokenLogprobs = dict[int, Logprob]
"""One position's log probabilities (vLLM's shape): the chosen token's and the top alternatives',
in order of rank (the chosen token first when it is outside the top)."""


@dataclass(frozen=True)
class CompletionOutput:
    """One completion in vLLM's shape (``RequestOutput.outputs[i]``): one per sequence (``n``)."""

    index: int
    """Position among the request's completions."""
    text: str
    """The generated text (``RequestOutput.text`` is the first completion's)."""
    token_ids: list[int]
    """The generated token ids."""
    finish_reason: str | None
    """``stop``, ``length``, ``abort``; None while unfinished."""
    cumulative_logprob: float | None = None
    """Sum of the generated tokens' log probabilities (None unless logprobs or best_of asked)."""
    logprobs: list[TokenLogprobs] | None = None
    """Per generated token, its log probabilities (None unless ``logprobs`` was asked)."""
    new_text: str = ""
    """hotprefix's: text added since this sequence's previous output (streaming)."""

    def finished(self) -> bool:
        return self.finish_reason is not None
