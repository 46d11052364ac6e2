"""The offline API: ``LLM(model=None, **options).generate(prompts, params)`` and ``.chat(...)``.

A thin loop over ``LLMEngine``: queue every prompt, step until all are finished, return outputs in
the order given. Code written for vLLM runs as is: vLLM's option names (``gpu_memory_utilization``,
``enforce_eager``...), ``seed`` and ``served_model_name``, ``sampling_params=``, and the outputs'
``outputs[0].text`` (names mapped in ``hotprefix.compat.vllm``: this is one of the two edges where
vLLM's option names are translated, the CLI's flags being the other).

What it does not know: how a step is scheduled or run (``LLMEngine``), tokenization beyond
``encode_chat``, the cache, the server; it keeps no state beyond its engine and a request counter.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Mapping, Sequence

from tqdm import tqdm

from hotprefix.config.sections import ConfigError
from hotprefix.engine.engine import LLMEngine, RequestOutput
from hotprefix.request.sampling import SamplingParams
from hotprefix.compat.vllm import PROMPT_KEYS, REQUEST_UNSUPPORTED, drop_accepted, engine_config

Prompt = str | Sequence[int]
Params = SamplingParams | Sequence[SamplingParams] | None


def derived_seed(seed: int, index: int) -> int:
    """The seed of an LLM's ``index``-th request under its default ``seed``: a different one for
    each request, the same on every run."""
    digest = hashlib.sha256(f"hotprefix/default-seed\0{seed}\0{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _drop_vllm_request_options(options: dict[str, Any]) -> None:
    """Remove vLLM's request keywords whose value asks for nothing (``lora_request=None``); raise
    ValueError naming the first that asks for what hotprefix does not do."""
    drop_accepted(options, REQUEST_UNSUPPORTED, lambda why, name: ValueError(why))


def _prompt_list(prompts: Any) -> list[str | list[int]]:
    """One prompt or many as a list of strings and token-id lists; vLLM's prompt dicts read by
    their ``prompt_token_ids`` (else ``prompt``). Raises ValueError for anything else."""
    if isinstance(prompts, (str, Mapping)) or (isinstance(prompts, Sequence) and prompts
                                               and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not isinstance(prompts, Sequence):
        raise ValueError(f"prompts must be a string, a list of token ids, or a list of those, "
                         f"got {type(prompts).__name__}")
    out: list[str | list[int]] = []
    for i, p in enumerate(prompts):
        if isinstance(p, Mapping):
            extra = sorted(set(p) - PROMPT_KEYS)
            if extra or not set(p) & PROMPT_KEYS:
                raise ValueError(f"prompts[{i}]: a prompt dict takes 'prompt' or 'prompt_token_ids' "
                                 f"(text only){f'; not {extra}' if extra else ''}")
            p = p["prompt_token_ids"] if "prompt_token_ids" in p else p["prompt"]
        if not isinstance(p, (str, Sequence)):
            raise ValueError(f"prompts[{i}] must be a string or a list of token ids, "
                             f"got {type(p).__name__}")
        out.append(p if isinstance(p, str) else list(p))
    return out


def _one_of(params: Params, sampling_params: Params) -> Params:
    if params is not None and sampling_params is not None:
        raise TypeError("give params or sampling_params (vLLM's name for it), not both")
    return params if params is not None else sampling_params


class LLM:
    """Offline generation with the paged KV pool and the prefix cache.

    Args:
        model: a .gguf file or a local HF directory; None = the embedded SmolLM2-135M-Instruct.
        seed: default seed of sampled requests that set none (vLLM's ``seed``): this LLM's i-th
            request gets ``derived_seed(seed, i)``, so a script samples the same tokens on every run.
            None = such requests draw fresh randomness. Greedy requests use no seed.
        served_model_name: the name the model goes by (vLLM's option; of a list, the first), kept
            as ``self.served_model_name``; None = the model's own name. Serving, the same setting is
            ``hotprefix serve --served-model-name``.
        **options: any field of ModelConfig / CacheConfig / SchedulerConfig (block_size,
            kv_cache_memory, kv_cache_dtype, max_num_seqs, max_num_batched_tokens, max_model_len,
            enable_prefix_caching, deterministic, eviction_policy, ...) or its vLLM name
            (gpu_memory_utilization, num_gpu_blocks_override, ...). A vLLM option hotprefix does not
            have is a ConfigError naming it and what to use instead.
    """

    def __init__(self, model: str | None = None, *, seed: int | None = None,
                 served_model_name: str | Sequence[str] | None = None, **options: Any):
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ConfigError(f"seed must be an integer, got {seed!r}")
        names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
        if not all(isinstance(n, str) and n for n in names):
            raise ConfigError(f"served_model_name must be a non-empty string or a list of them, "
                              f"got {served_model_name!r}")
        self.config = engine_config(model=model, **options)  # vLLM's names translated here
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer
        self.seed = seed
        self.served_model_name: str = names[0] if names else self.engine.model_name
        self._num_requests = 0

    def generate(self, prompts: Prompt | Sequence[Prompt] | None = None, params: Params = None,
                 cache_salt: str | None = None, use_tqdm: bool | None = None, *,
                 sampling_params: Params = None, prompt_token_ids: Any = None,
                 **request_options: Any) -> list[RequestOutput]:
        """Generate for one prompt or many (strings, token-id lists, or vLLM's ``{"prompt": ...}``
        / ``{"prompt_token_ids": [...]}`` dicts); outputs in input order.

        ``params`` (or, by vLLM's name, ``sampling_params``) is one SamplingParams for every prompt
        or a list with one per prompt. ``request_options`` are per-request cache controls passed to
        ``add_request`` (``cache_write``, ``priority``, ``pin_ttl_s``, ``salt_from_block``); vLLM's
        other keywords (``lora_request``...) are accepted when they ask for nothing, else refused
        with a ValueError naming them. ``prompt_token_ids``: vLLM's older keyword for ``prompts``.
        """
        if prompt_token_ids is not None:
            if prompts is not None:
                raise ValueError("give prompts or prompt_token_ids, not both")
            prompts = prompt_token_ids
        if prompts is None:
            raise ValueError("generate() needs prompts")
        _drop_vllm_request_options(request_options)
        prompts = _prompt_list(prompts)
        per_prompt = self._params_per_prompt(_one_of(params, sampling_params), len(prompts))
        ids = [self.engine.add_request(p, sp, cache_salt=cache_salt, **request_options).request_id
               for p, sp in zip(prompts, per_prompt)]  # type: ignore[arg-type]
        outs = self._run(ids, use_tqdm)
        for out, p in zip(outs, prompts):
            out.prompt = p if isinstance(p, str) else None
        return outs

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             params: Params = None, cache_salt: str | None = None,
             use_tqdm: bool | None = None, *, sampling_params: Params = None,
             tools: list[dict[str, Any]] | None = None,
             **request_options: Any) -> list[RequestOutput]:
        """OpenAI-style messages (or a list of conversations) through the chat template.

        ``tools`` (OpenAI's shape) are rendered into the prompt as the server renders them (the
        template's way, or the tool block of ``hotprefix.server.tools``), as vLLM's ``LLM.chat``
        does; the answer is text (the server parses tool calls out of it)."""
        _drop_vllm_request_options(request_options)
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        template_tools = None
        if tools or any(m.get("tool_calls") or m.get("role") == "tool" for c in convs for m in c):
            from hotprefix.server import tools as T

            functions = T.parse_tools(tools)  # ToolError (a ValueError) names a bad tool
            native = self.tokenizer.renders_tools
            convs = [T.render_messages(list(c), functions, native) for c in convs]  # type: ignore[arg-type]
            template_tools = [f.raw for f in functions] if native and functions else None
        # tokenized from the prefixes earlier chats with this salt tokenized (Tokenizer.encode)
        prompts = [self.tokenizer.encode_chat(m, tools=template_tools, scope=cache_salt or "")  # type: ignore[arg-type]
                   for m in convs]
        outs = self.generate(prompts, _one_of(params, sampling_params), cache_salt, use_tqdm,
                             **request_options)
        for out, conv in zip(outs, convs):
            out.prompt = self.tokenizer.render_chat(conv, tools=template_tools)  # type: ignore[arg-type]
        return outs

    def _params_per_prompt(self, params: Params, n: int) -> list[SamplingParams]:
        """One SamplingParams per prompt, the LLM's default seed given to sampled ones without one."""
        if params is None or isinstance(params, SamplingParams):
            given = [params or SamplingParams()] * n
        else:
            given = list(params)
            if len(given) != n:
                raise ValueError(f"{len(given)} SamplingParams for {n} prompts: give one, or one per prompt")
        out = []
        for p in given:
            index, self._num_requests = self._num_requests, self._num_requests + 1
            if self.seed is not None and p.seed is None and not p.greedy:
                p = dataclasses.replace(p, seed=derived_seed(self.seed, index))
            out.append(p)
        return out

    def _run(self, ids: list[str], use_tqdm: bool | None) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        show = len(ids) >= 16 if use_tqdm is None else use_tqdm
        bar = tqdm(total=len(ids), desc="generate", disable=not show)
        wanted = set(ids)
        while len(done) < len(ids) and self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[i] for i in ids]

    def close(self) -> None:
        """Flush and stop the KV tiers' background threads (nothing to do without tiers)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def cache_stats(self) -> dict[str, Any]:
        return self.engine.cache_stats()

    def reset_prefix_cache(self) -> dict[str, int]:
        return self.engine.reset_prefix_cache()
