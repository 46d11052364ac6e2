"""The offline API: ``LLM(model=None, **options).generate(prompts, params)`` and ``.chat(...)``.

A thin loop over ``LLMEngine``: queue every prompt, step until all are finished, return outputs in
the order given.
"""

from __future__ import annotations

from typing import Any, Sequence

from tqdm import tqdm

from hotprefix.config import EngineConfig
from hotprefix.engine.engine import LLMEngine, RequestOutput
from hotprefix.sampling import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    """Offline generation with the paged KV pool and the prefix cache.

    Args:
        model: a .gguf file or a local HF directory; None = the embedded SmolLM2-135M-Instruct.
        **options: any field of ModelConfig / CacheConfig / SchedulerConfig (block_size,
            kv_cache_memory, max_num_seqs, max_num_batched_tokens, max_model_len,
            enable_prefix_caching, deterministic, eviction_policy, ...).
    """

    def __init__(self, model: str | None = None, **options: Any):
        self.config = EngineConfig.from_options(model=model, **options)
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | None = None,
                 cache_salt: str | None = None, use_tqdm: bool | None = None,
                 **request_options: Any) -> list[RequestOutput]:
        """Generate for one prompt or many (strings or token-id lists); outputs in input order.

        ``request_options`` are per-request cache controls passed to ``add_request``
        (``cache_write``, ``priority``, ``pin_ttl_s``, ``salt_from_block``).
        """
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = params or SamplingParams()
        ids = [self.engine.add_request(p, params, cache_salt=cache_salt, **request_options).request_id
               for p in prompts]  # type: ignore[union-attr]
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             params: SamplingParams | None = None, cache_salt: str | None = None,
             use_tqdm: bool | None = None, **request_options: Any) -> list[RequestOutput]:
        """OpenAI-style messages (or a list of conversations) through the chat template."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode_chat(m) for m in convs]  # type: ignore[arg-type]
        return self.generate(prompts, params, cache_salt, use_tqdm, **request_options)

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
