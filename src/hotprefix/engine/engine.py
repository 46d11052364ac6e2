"""The engine loop: add_request / step / abort. One step = schedule -> run -> postprocess.

Builds the pieces from an ``EngineConfig``: loads the model and its tokenizer, fingerprints both
into the cache namespace, sizes the pool, and wires scheduler -> cache and runner -> model.
Output processing (detokenizing, stop strings, timings) happens here; the scheduler and runner
know nothing about text.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from hotprefix.cache.block_pool import BlockPool
from hotprefix.cache.hashing import BlockHasher, namespace_key
from hotprefix.cache.ledger import ContentLedger
from hotprefix.cache.state_dir import StateDir
from hotprefix.cache.manager import KVCacheManager
from hotprefix.cache.report import CacheReport
from hotprefix.config import ConfigError, EngineConfig
from hotprefix.diagnose import chat_fixed_prefix, explain
from hotprefix.engine.detokenizer import IncrementalDetokenizer
from hotprefix.engine.kv_io import open_tiers
from hotprefix.engine.request import Request
from hotprefix.engine.runner import ModelRunner
from hotprefix.engine.scheduler import RequestRejected, Scheduler
from hotprefix.events import open_kv_events
from hotprefix.model.loader import load_model
from hotprefix.sampling import SamplingParams, make_generator
from hotprefix.tokenizer import Tokenizer
from hotprefix.vllm_compat import CompletionOutput

log = logging.getLogger(__name__)

MAX_DEFAULT_MODEL_LEN = 8192
IDLE_WAIT_S = 0.002
TIER_WAIT_S = 0.05
"""Longest wait, in a step that scheduled nothing, for one of the tier fetches in flight."""
"""Pause of a step that scheduled nothing while requests wait (e.g. on their KV tier reads)."""
ALL_TENANTS = object()
"""``cache_stats()`` without a tenant: the operator's view of every tenant."""


@dataclass
class RequestOutput:
    """What a caller gets back for one request (incrementally while streaming)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    cache_report: CacheReport | None
    """Where the prompt's tokens came from and why the rest missed (None: never admitted)."""
    ttft_s: float | None
    """Seconds from arrival to the first generated token."""
    token_latencies_s: list[float] = field(default_factory=list)
    """Seconds between consecutive generated tokens."""
    e2e_s: float | None = None
    new_text: str = ""
    """Text added since the previous output of this request (streaming)."""
    error: str | None = None
    prompt: str | None = None
    """The prompt's text, set by the offline ``LLM`` (the template's text for ``chat``); None when the
    prompt was given as token ids, and from the engine itself."""

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's shape: one completion, ``outputs[0].text == text`` (``hotprefix.vllm_compat``)."""
        return [CompletionOutput(0, self.text, self.token_ids, self.finish_reason)]

    @property
    def mean_token_latency_s(self) -> float | None:
        lat = self.token_latencies_s
        return sum(lat) / len(lat) if lat else None


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None = None):
        self.config = config
        t0 = time.monotonic()
        # checked before the model loads, so an unusable directory fails fast
        state = StateDir(config.cache.state_dir) if config.cache.state_dir else None
        loaded = load_model(config.model.model)
        asked = config.scheduler.max_model_len
        if asked and asked > loaded.arch.max_position:
            raise ConfigError(f"max_model_len {asked} exceeds the model's {loaded.arch.max_position} "
                              "positions (its RoPE table); lower it")
        self.model_name = loaded.name
        self.model_path = loaded.path
        self.tokenizer = tokenizer or Tokenizer.load(config.model.tokenizer or loaded.tokenizer_source)
        self.model_fingerprint = loaded.fingerprint
        self.tokenizer_fingerprint = self.tokenizer.fingerprint
        self.runner = ModelRunner(loaded, config.model, config.cache)
        del loaded
        cc = config.cache
        self.block_size = cc.block_size
        pool = BlockPool(self.runner.num_blocks, cc.block_size, cc.eviction_policy, cc.ghost_size)
        # K/V depend on the numerics too: a bf16 or int4 engine never reuses an fp32 engine's blocks
        self.namespace = namespace_key(f"{self.model_fingerprint}/{self.runner.numerics}",
                                       self.tokenizer_fingerprint)
        hasher = BlockHasher(self.namespace, cc.block_size, cc.hash_algo)
        self.cache = KVCacheManager(pool, hasher, cc.enable_prefix_caching, cc.stats_window,
                                    ContentLedger(state), cc.admission_tail_tokens)
        self.cache.fixed_prefix = chat_fixed_prefix(self.tokenizer)
        self.cache.tiers = open_tiers(cc, self.runner.kv_caches)
        tier_names = self.cache.tiers.tiers.names if self.cache.tiers is not None else []
        self.kv_events = open_kv_events(cc, pool, [n.rstrip("0123456789") for n in tier_names])
        """The KV events publisher (``--kv-events``), or None."""
        arch_len = self.runner.arch.max_position
        self.max_model_len = config.scheduler.max_model_len or min(arch_len, MAX_DEFAULT_MODEL_LEN)
        self.scheduler = Scheduler(config.scheduler, self.cache, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}  # by request id, while unfinished
        self.on_step: list[Callable[[dict[str, Any]], None]] = []
        log.info("model %s (fingerprint %s), tokenizer fingerprint %s, namespace %s, "
                 "max_model_len %d, prefix caching %s, loaded in %.1fs",
                 self.model_name, self.model_fingerprint, self.tokenizer_fingerprint,
                 self.namespace.hex()[:16], self.max_model_len,
                 "on" if cc.enable_prefix_caching else "off", time.monotonic() - t0)

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str | None = None,
                    salt_from_block: int = 0, cache_write: bool = True, priority: int = 0,
                    pin_ttl_s: float = 0.0, arrival_time: float | None = None,
                    pin_breakpoints: Sequence[tuple[int, float]] = (),
                    expect_reuse: bool = False) -> Request:
        """Queue a request. Raises RequestRejected (too long, empty) or ValueError (bad ids).

        The cache controls (``cache_write``, ``priority``, ``pin_ttl_s``, ``pin_breakpoints``,
        ``expect_reuse``) are described on ``hotprefix.cache.request.CacheRequest``.
        """
        params = params or SamplingParams()
        params.validate()  # again: a field may have been changed since it was made
        if not isinstance(prompt, (str, Sequence)):
            raise ValueError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        vocab = self.runner.arch.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in token_ids):
            raise RequestRejected(f"prompt token ids must be integers in [0, {vocab})")
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise RequestRejected(f"duplicate request id {rid}", "duplicate_request_id")
        req = Request(request_id=rid, token_ids=token_ids, num_prompt_tokens=len(token_ids),
                      salt=cache_salt, salt_from_block=salt_from_block, cache_write=cache_write,
                      priority=priority, pin_ttl_s=pin_ttl_s,
                      pin_breakpoints=tuple((int(t), float(s)) for t, s in pin_breakpoints),
                      expect_reuse=expect_reuse, params=params, generator=make_generator(params))
        if arrival_time is not None:
            req.arrival_time = arrival_time
        self.scheduler.add(req)
        self.cache.start_tier_fetch(req)
        self.requests[rid] = req
        self._detokenizers[rid] = IncrementalDetokenizer(self.tokenizer, params.stop_list)
        return req

    def abort(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self._detokenizers.pop(request_id, None)
        self.scheduler.finish(req, "abort")
        return True

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission."""
        return len(self.scheduler.waiting)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """One forward pass over the scheduled batch; outputs of requests that progressed."""
        sched = self.scheduler.schedule()
        tables = {c.request.request_id: self.cache.block_table(c.request.request_id) for c in sched.chunks}
        if not sched.chunks and self.scheduler.waiting:
            # waiting on tier reads (or a full pool): sleep until a fetch ends, without spinning
            # (a busy loop here would hold the GIL the fetch threads need)
            if self.cache.tiers is None or not self.cache.tiers.wait_any(TIER_WAIT_S):
                time.sleep(IDLE_WAIT_S)
        t0 = time.monotonic()
        sampled = self.runner.run(sched.chunks, tables)
        if self.cache.tiers is not None:
            self.cache.tiers.observe_compute(sched.num_tokens, time.monotonic() - t0)
        advanced = self.scheduler.update(sched, sampled)
        now = time.monotonic()
        outputs = [self._postprocess(req, now) for req in advanced]
        outputs += [self._output(req) for req in sched.finished if req.request_id in self.requests]
        for o in outputs:
            if o.finished:
                self.requests.pop(o.request_id, None)
                self._detokenizers.pop(o.request_id, None)
        self.cache.ledger.flush()
        for cb in self.on_step:
            cb({"num_tokens": sched.num_tokens, "outputs": outputs})
        return outputs

    def _postprocess(self, req: Request, now: float) -> RequestOutput:
        if req.first_token_time is None:
            req.first_token_time = now
            rep = req.cache_report
            if rep is not None:
                explain(rep, self.tokenizer)
                self.cache.record_cause(req, (rep.detail or {}).get("likely_cause"))
        req.token_times.append(now)
        tok = req.token_ids[-1]
        p = req.params
        reason = None
        if not p.ignore_eos and tok in self.tokenizer.eos_token_ids:
            reason = "stop"
        elif p.stop_token_ids and tok in p.stop_token_ids:
            reason = "stop"
        elif req.num_output_tokens >= p.max_tokens:
            reason = "length"
        elif req.num_tokens >= self.max_model_len:
            reason = "length"
        detok = self._detokenizers[req.request_id]
        end = req.num_tokens - 1 if reason == "stop" else req.num_tokens  # a stop token is not text
        if detok.add(req.token_ids[req.num_prompt_tokens + detok.num_tokens:end]):
            reason = "stop"  # a stop string; the text is cut before it
        if reason is not None:
            self.scheduler.finish(req, reason)
        return self._output(req)

    def _output(self, req: Request) -> RequestOutput:
        detok = self._detokenizers[req.request_id]
        if req.is_finished:
            detok.finish()
        text, new = detok.take()
        times = req.token_times
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.token_ids[:req.num_prompt_tokens],
            token_ids=req.output_token_ids,
            text=text, finished=req.is_finished,
            finish_reason=req.finish_reason, num_cached_tokens=max(0, req.num_cached_tokens),
            cache_report=req.cache_report, ttft_s=req.ttft_s(),
            token_latencies_s=[b - a for a, b in zip(times, times[1:])],
            e2e_s=(times[-1] - req.arrival_time) if req.is_finished and times else None,
            new_text=new, error=req.error)

    # ------------------------------------------------------------------ cache admin
    def cache_stats(self, tenant_salt: str | None | object = ALL_TENANTS) -> dict[str, Any]:
        """The operator's cache statistics, or with ``tenant_salt`` one tenant's own view."""
        common = dict(model_fingerprint=self.model_fingerprint,
                      tokenizer_fingerprint=self.tokenizer_fingerprint,
                      namespace=self.namespace.hex()[:16], bytes_per_token=self.runner.bytes_per_token)
        if tenant_salt is not ALL_TENANTS:
            return {**self.cache.tenant_snapshot(tenant_salt), **common}  # type: ignore[arg-type]
        s = self.cache.snapshot()
        s.update(common, running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                 state=self.state_health(), tiers=self.tier_stats())
        return s

    def load_tokens(self) -> int:
        """Tokens still to compute for the running and waiting requests (prompt tokens not yet
        computed, plus one a step for each decoding request): what a router calls the load."""
        reqs = list(self.scheduler.running) + list(self.scheduler.waiting)
        return sum(max(1, r.num_tokens - r.num_computed_tokens) for r in reqs)

    def tier_stats(self) -> dict[str, dict[str, Any]]:
        """Per KV tier: hits (tokens), misses, bytes, dropped writes, corrupt entries, errors..."""
        link = self.cache.tiers
        return link.stats(self.block_size) if link is not None else {}

    def close(self) -> None:
        """Stop the KV tiers' and KV events' threads (queued writes and events are flushed first)."""
        if self.kv_events is not None:
            self.kv_events.close()
        link = self.cache.tiers
        if link is not None:
            link.tiers.flush(timeout_s=5.0)
            link.close()

    def state_health(self) -> dict[str, Any]:
        """Whether state is being persisted: ``ok`` or ``degraded`` with the last error."""
        ledger = self.cache.ledger
        return {"status": "degraded" if ledger.last_error else "ok", "error": ledger.last_error,
                "write_failures": ledger.write_failures, "dir": self.config.cache.state_dir}

    def top_prefixes(self, n: int = 10) -> list[dict[str, Any]]:
        """The most reused cached blocks (operator view: key hashes and counts, no content)."""
        return self.cache.top_prefixes(n)

    def prefix_tree(self, n: int = 24, excerpt_chars: int = 48) -> list[dict[str, Any]]:
        """The most reused cached blocks as a forest of chains (operator view: it shows content,
        never hand it to a tenant).

        Args:
            n: At most this many blocks: the most hit first, each with its still-cached ancestors
                (a chain is skipped rather than cut, so every listed block's parent is listed or
                not cached).
            excerpt_chars: Length of each block's decoded excerpt.

        Returns:
            Blocks ordered by depth, then hits: ``id`` (short key hex), ``parent`` (the parent's
            ``id``, None at block 0 or when the parent is no longer cached), ``depth``, ``hits``,
            ``tokens`` (prompt tokens up to the block's end), ``in_use``, ``salt`` (the tenant
            salt that entered the chain at this block, else None) and ``excerpt``.
        """
        pool = self.cache.pool
        ranked = sorted((b for b in pool.index.values() if b.num_hits > 0),
                        key=lambda b: (-b.num_hits, b.depth))
        chosen: dict[Any, Any] = {}  # key -> KVBlock, in insertion order
        for b in ranked:
            if len(chosen) >= n:
                break
            chain = []
            cur = b
            while cur is not None and cur.key not in chosen:
                chain.append(cur)
                cur = pool.index.get(cur.parent) if cur.parent is not None else None
            if len(chosen) + len(chain) <= n:
                chosen.update((c.key, c) for c in reversed(chain))
        out = []
        for b in sorted(chosen.values(), key=lambda b: (b.depth, -b.num_hits)):
            text = self.tokenizer.decode(list(b.token_ids or ()), skip_special_tokens=False)
            text = text.replace("\r", "").replace("\n", "\u21b5")
            if len(text) > excerpt_chars:
                text = text[:excerpt_chars - 1] + "\u2026"
            parent = b.parent if b.parent in chosen else None
            out.append({"id": b.key.hex()[:16], "parent": parent.hex()[:16] if parent else None,
                        "depth": b.depth, "hits": b.num_hits,
                        "tokens": (b.depth + 1) * self.block_size, "in_use": b.ref_cnt > 0,
                        "salt": b.salt, "excerpt": text})
        return out

    def tenant_overview(self) -> dict[str | None, dict[str, Any]]:
        """Per-tenant request figures keyed by tenant salt (operator view)."""
        return self.cache.tenants_overview()

    def request_block_keys(self, req: Request) -> list[str]:
        """Hex block keys of a request's tokens (for ``--log-requests``)."""
        return [k.hex() for k in self.cache.keys(req)]

    def reset_prefix_cache(self) -> dict[str, int]:
        return self.cache.reset()
