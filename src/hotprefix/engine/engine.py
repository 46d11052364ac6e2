"""The engine loop: add_request / step / abort. One step = schedule -> run -> postprocess.

Builds the pieces from an ``EngineConfig``: loads the model and its tokenizer, fingerprints both
into the cache namespace, sizes the pool, and wires scheduler -> cache and runner -> model.
Output processing (detokenizing, stop strings, timings) happens here; the scheduler and runner
know nothing about text.
"""

from __future__ import annotations

import dataclasses
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
from hotprefix.cache.window_groups import WindowGroups
from hotprefix.cache.report import CacheReport
from hotprefix.config.sections import ConfigError, EngineConfig
from hotprefix.text.diagnose import chat_fixed_prefix, explain
from hotprefix.engine.detokenizer import IncrementalDetokenizer
from hotprefix.engine.kv_io import open_tiers
from hotprefix.engine.request import Request
from hotprefix.engine.runner import ModelRunner
from hotprefix.engine.scheduler import RequestRejected, Scheduler
from hotprefix.events import open_kv_events
from hotprefix.model.loader import load_model
from hotprefix.request.sampling import Sampled, SamplingError, SamplingParams, make_generator
from hotprefix.request.structured import GrammarCompiler, GrammarState
from hotprefix.text.tokenizer import Tokenizer
from hotprefix.compat.vllm import CompletionOutput, Logprob, TokenLogprobs

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
    """What a caller gets back for one request (incrementally while streaming). The top-level
    text and tokens are the first sequence's; ``outputs`` holds every sequence (``n``)."""

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
    completions: list[CompletionOutput] | None = None
    """Every sequence of the request (None: the one sequence above, as ``outputs`` builds it)."""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """vLLM's shape: per prompt token its log probabilities (None for the first), when asked."""

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's shape: one completion per sequence, ``outputs[0].text == text``
        (``hotprefix.compat.vllm``)."""
        if self.completions is not None:
            return self.completions
        return [CompletionOutput(0, self.text, self.token_ids, self.finish_reason,
                                 new_text=self.new_text)]

    @property
    def num_generated_tokens(self) -> int:
        """Tokens generated over every sequence."""
        return sum(len(c.token_ids) for c in self.outputs)


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
        self.tokenizer = tokenizer or Tokenizer.load(config.model.tokenizer or loaded.tokenizer_source,
                                                     chat_template=config.model.chat_template)
        self.tokenizer_fingerprint = self.tokenizer.fingerprint
        self.max_model_len = asked or min(loaded.arch.max_position, MAX_DEFAULT_MODEL_LEN)
        """Prompt + output tokens a sequence may reach (``SchedulerConfig.max_model_len``)."""
        self.runner = ModelRunner(loaded, config.model, config.cache, self.max_model_len)
        self.model_fingerprint = loaded.fingerprint  # a GGUF's is hashed while the runner packs
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
        layout = self.runner.layout
        windows = {i: g.window for i, g in enumerate(layout.groups) if i} if layout.hybrid else None
        if windows:
            self.cache.windows = WindowGroups(pool, cc.block_size, windows)
        self.cache.fixed_prefix = chat_fixed_prefix(self.tokenizer)
        self.cache.tiers = open_tiers(cc, self.runner.kv_caches, layout)
        tier_names = self.cache.tiers.tiers.names if self.cache.tiers is not None else []
        self.kv_events = open_kv_events(cc, pool, [n.rstrip("0123456789") for n in tier_names],
                                        windows)
        """The KV events publisher (``--kv-events``), or None."""
        self.scheduler = Scheduler(config.scheduler, self.cache, self.max_model_len)
        self.requests: dict[str, Request] = {}
        """Unfinished requests by id (a group's first sequence)."""
        self.groups: dict[str, list[Request]] = {}
        """Every sequence of each unfinished request, by the request's id (``n`` / ``best_of``)."""
        self._ids = itertools.count()
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}  # by request id, while unfinished
        self.grammars = GrammarCompiler(self.tokenizer, self.runner.arch.vocab_size,
                                        self.tokenizer.eos_token_ids)
        """Structured outputs' compiler and its LRU of compiled grammars (per tenant salt)."""
        self._grammar_states: dict[str, GrammarState] = {}  # by request id, constrained ones
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
                    expect_reuse: bool = False, hit_point_tokens: Sequence[int] = (),
                    turn_end_tokens: Sequence[int] = (), fleet_seq: int | None = None) -> Request:
        """Queue a request. Raises RequestRejected (too long, empty) or ValueError (bad ids).

        The cache controls (``cache_write``, ``priority``, ``pin_ttl_s``, ``pin_breakpoints``,
        ``expect_reuse``, ``hit_point_tokens``, ``turn_end_tokens``) and ``fleet_seq`` (a fleet's
        request number, for the eviction clock) are described on
        ``hotprefix.cache.request.CacheRequest``; every sequence of the request carries the same
        ``fleet_seq``.
        """
        params = params or SamplingParams()
        params.validate()  # again: a field may have been changed since it was made
        if not isinstance(prompt, (str, Sequence)):
            raise ValueError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        vocab = self.runner.arch.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in token_ids):
            raise RequestRejected(f"prompt token ids must be integers in [0, {vocab})")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise SamplingError(f"logit_bias names token {max(params.logit_bias)}; this model's "
                                f"token ids are in [0, {vocab})", "logit_bias")
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise RequestRejected(f"duplicate request id {rid}", "duplicate_request_id")
        grammar = None  # GrammarError (a ValueError) when the spec does not compile
        if params.structured_outputs is not None:
            grammar = self.grammars.compile(params.structured_outputs, cache_salt)
        seqs = [Request(request_id=rid if i == 0 else f"{rid}#{i}", token_ids=list(token_ids),
                        num_prompt_tokens=len(token_ids), salt=cache_salt,
                        salt_from_block=salt_from_block, cache_write=cache_write,
                        priority=priority, pin_ttl_s=pin_ttl_s,
                        pin_breakpoints=tuple((int(t), float(s)) for t, s in pin_breakpoints),
                        expect_reuse=expect_reuse, read_cache=params.prompt_logprobs is None,
                        hit_point_tokens=tuple(int(t) for t in hit_point_tokens),
                        turn_end_tokens=tuple(int(t) for t in turn_end_tokens),
                        fleet_seq=None if fleet_seq is None else int(fleet_seq),
                        params=params, generator=make_generator(params, i), index=i, group_id=rid)
                for i in range(params.num_sequences)]
        req = seqs[0]
        req.forks = seqs[1:]
        if grammar is not None:
            for seq in seqs:
                self._attach_grammar(seq, grammar)
        for seq in seqs:
            if arrival_time is not None:
                seq.arrival_time = arrival_time
        self.scheduler.add(req)
        self.cache.start_tier_fetch(req)
        self.requests[rid] = req
        self.groups[rid] = seqs
        for seq in seqs:
            self._detokenizers[seq.request_id] = IncrementalDetokenizer(self.tokenizer, params.stop_list)
        return req

    def _attach_grammar(self, seq: Request, grammar: Any) -> None:
        """Constrain one sequence by its own matcher of ``grammar``: the sampler masks its logits
        (``Request.logits_mask``), ``_postprocess`` advances the matcher by each drawn token."""
        state = grammar.new_state()
        self._grammar_states[seq.request_id] = state
        seq.logits_mask = state.mask_logits

    def abort(self, request_id: str) -> bool:
        """End a request, every sequence of it, and release their blocks; False if unknown."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for seq in self.groups.pop(request_id, [req]):
            self._detokenizers.pop(seq.request_id, None)
            self._grammar_states.pop(seq.request_id, None)
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        req.forks = []
        return True

    @property
    def has_window_groups(self) -> bool:
        """Whether prefix caching runs on a hybrid pool, whose sliding-window layers keep their
        K/V only before hit points: only then do message ends given as ``hit_point_tokens``
        change what stays cached."""
        return self.cache.enabled and self.cache.windows is not None

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
        sampled, prompt_lps = self.runner.run(sched.chunks, tables)
        if self.cache.tiers is not None:
            self.cache.tiers.observe_compute(sched.num_tokens, time.monotonic() - t0)
        for req, pos, s in prompt_lps:
            req.prompt_logprobs[pos] = self._position(s)
        advanced = self.scheduler.update(sched, {rid: s.token for rid, s in sampled.items()})
        advanced += self._fork(advanced, sampled)
        now = time.monotonic()
        for req in advanced:
            self._record_sampled(req, sampled[req.request_id])
        touched = [self._postprocess(req, now) for req in advanced]
        for req in sched.finished:  # ended by the scheduler: its unforked sequences end with it
            for child in req.forks:
                self.scheduler.finish(child, req.finish_reason or "length")
            req.forks = []
            touched.append(req)
        outputs = []
        for gid in dict.fromkeys(r.group_id for r in touched):
            if gid in self.requests:
                outputs.append(self._output(self.requests[gid]))
        for o in outputs:
            if o.finished:
                self.requests.pop(o.request_id, None)
                for seq in self.groups.pop(o.request_id, []):
                    self._detokenizers.pop(seq.request_id, None)
                    self._grammar_states.pop(seq.request_id, None)
        self.cache.ledger.flush()
        for cb in self.on_step:
            cb({"num_tokens": sched.num_tokens, "outputs": outputs})
        return outputs

    def _fork(self, advanced: list[Request], sampled: dict[str, Sampled]) -> list[Request]:
        """Start the sequences waiting on a group's first sequence that just drew its first token
        (the runner drew theirs from the same logits): they share its prompt blocks, the last
        partial one copied."""
        started = []
        for req in advanced:
            if not req.forks or req.num_output_tokens != 1:
                continue
            for child in req.forks:
                child.token_ids.append(sampled[child.request_id].token)
                child.num_cached_tokens = req.num_cached_tokens
                child.cache_report = req.cache_report  # one report: the prompt counts once
                child.operator_reason = req.operator_reason
                pairs = self.scheduler.fork(req, child)
                if pairs:
                    self.runner.copy_blocks(pairs)
                started.append(child)
            req.forks = []
        return started

    def _record_sampled(self, req: Request, s: Sampled) -> None:
        if s.logprob is None:
            return
        req.cumulative_logprob += s.logprob
        if req.params.logprobs is not None:
            req.logprobs.append(self._position(s))

    def _postprocess(self, req: Request, now: float) -> Request:
        if req.first_token_time is None:
            req.first_token_time = now
            rep = req.cache_report
            if rep is not None and req.index == 0:
                explain(rep, self.tokenizer)
                self.cache.record_cause(req, (rep.detail or {}).get("likely_cause"))
        req.token_times.append(now)
        tok = req.token_ids[-1]
        p = req.params
        reason = None
        grammar = self._grammar_states.get(req.request_id)
        grammar_done = by_grammar = False
        if grammar is not None:
            try:
                grammar.accept(tok)  # and the next token's mask starts computing
                grammar_done = grammar.is_stopped
            except RuntimeError as e:  # the matcher refused a token it had allowed: a bug
                req.error = str(e)
                self.scheduler.finish(req, "error")
                return req
        if not p.ignore_eos and tok in self.tokenizer.eos_token_ids:
            reason = "stop"
        elif p.stop_token_ids and tok in p.stop_token_ids:
            reason = "stop"
        elif grammar_done:  # the grammar is complete: nothing may follow; the token is text
            reason, by_grammar = "stop", True
        elif req.num_output_tokens >= p.max_tokens:
            reason = "length"
        elif req.num_tokens >= self.max_model_len:
            reason = "length"
        detok = self._detokenizers[req.request_id]
        stop_token = reason == "stop" and not by_grammar  # a stop token is not text
        end = req.num_tokens - 1 if stop_token else req.num_tokens
        if detok.add(req.token_ids[req.num_prompt_tokens + detok.num_tokens:end]):
            reason = "stop"  # a stop string; the text is cut before it
        if reason is not None:
            self.scheduler.finish(req, reason)
        return req

    def _output(self, req: Request) -> RequestOutput:
        """The output of the request whose first sequence is ``req``: every sequence's progress;
        finished when all are. Under ``best_of`` the finished output keeps the ``n`` sequences
        with the highest cumulative log probability, best first."""
        seqs = self.groups.get(req.group_id, [req])
        comps = [self._completion(seq) for seq in seqs]
        finished = all(seq.is_finished for seq in seqs)
        p = req.params
        if finished and p.num_sequences > p.n:
            best = sorted(comps, key=lambda c: -(c.cumulative_logprob or 0.0))[:p.n]
            comps = [dataclasses.replace(c, index=i) for i, c in enumerate(best)]
        first = comps[0]
        times = req.token_times
        last = max((seq.token_times[-1] for seq in seqs if seq.token_times), default=None)
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.token_ids[:req.num_prompt_tokens],
            token_ids=first.token_ids, text=first.text, finished=finished,
            finish_reason=first.finish_reason if finished else None,
            num_cached_tokens=max(0, req.num_cached_tokens),
            cache_report=req.cache_report, ttft_s=req.ttft_s(),
            token_latencies_s=[b - a for a, b in zip(times, times[1:])],
            e2e_s=(last - req.arrival_time) if finished and last is not None else None,
            new_text=first.new_text, error=req.error, completions=comps,
            prompt_logprobs=self._prompt_logprobs(req) if finished or req.num_output_tokens <= 1
            else None)

    def _completion(self, seq: Request) -> CompletionOutput:
        detok = self._detokenizers[seq.request_id]
        if seq.is_finished:
            detok.finish()
        text, new = detok.take()
        p = seq.params
        lps = list(seq.logprobs) if p.logprobs is not None else None
        return CompletionOutput(seq.index, text, seq.output_token_ids, seq.finish_reason,
                                seq.cumulative_logprob if p.needs_logprob else None, lps, new)

    def _position(self, s: Sampled) -> TokenLogprobs:
        """One position's log probabilities in vLLM's shape: the chosen token, then the top
        (each token's text as it reads inside the output: a SentencePiece ``▁world`` is `` world``)."""
        def dec(t: int) -> str:
            return self.tokenizer.decode([t], skip_special_tokens=False, continuation=True)

        out: TokenLogprobs = {s.token: Logprob(s.logprob, s.rank, dec(s.token))}
        for rank, (tok, lp) in enumerate(s.top or [], 1):
            if tok not in out:
                out[tok] = Logprob(lp, rank, dec(tok))
        return out

    @staticmethod
    def _prompt_logprobs(req: Request) -> list[TokenLogprobs | None] | None:
        """Per prompt token its log probabilities (set on the first and the last outputs only)."""
        if req.params.prompt_logprobs is None:
            return None
        lps = req.prompt_logprobs
        return [None] + [lps.get(i) for i in range(1, req.num_prompt_tokens)]

    # ------------------------------------------------------------------ cache admin
    def cache_stats(self, tenant_salt: str | None | object = ALL_TENANTS) -> dict[str, Any]:
        """The operator's cache statistics, or with ``tenant_salt`` one tenant's own view."""
        common = dict(model_fingerprint=self.model_fingerprint,
                      tokenizer_fingerprint=self.tokenizer_fingerprint,
                      namespace=self.namespace.hex()[:16], bytes_per_token=self.runner.bytes_per_token,
                      kv_cache_dtype=self.runner.kv_dtype.name)
        if tenant_salt is not ALL_TENANTS:
            return {**self.cache.tenant_snapshot(tenant_salt), **common}  # type: ignore[arg-type]
        s = self.cache.snapshot()
        s.update(common, running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                 state=self.state_health(), tiers=self.tier_stats())
        lay = self.runner.layout
        page_bytes = self.runner.bytes_per_token * self.block_size * lay.page_layers // lay.num_layers
        groups = s.get("kv_groups") or [{"group": 0, "pages_in_use": s["blocks_in_use"],
                                         "pages_cached": s["blocks_cached"],
                                         "pages_kept": s["blocks_cached"]}]
        for g, desc in zip(groups, lay.describe()):
            g.update(desc, bytes_in_use=g["pages_in_use"] * page_bytes,
                     bytes_cached=g["pages_cached"] * page_bytes)
        s.update(kv_groups=groups, page_bytes=page_bytes, hybrid_kv=lay.hybrid)
        return s

    def tier_stats(self) -> dict[str, dict[str, Any]]:
        """Per KV tier: hits (tokens), misses, bytes, dropped writes, corrupt entries, errors..."""
        link = self.cache.tiers
        return link.stats(self.block_size) if link is not None else {}

    def close(self) -> None:
        """Stop the KV tiers' and KV events' threads (queued writes and events are flushed first)."""
        self.grammars.close()
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
