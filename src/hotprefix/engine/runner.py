"""Model runner: owns the model and the KV pool tensors; turns a scheduled step into tensors
(input ids, positions, slot mapping, block tables), runs the forward pass and samples.

Sizes the pool from ``kv_cache_memory`` / ``memory_utilization`` / ``num_blocks``. In deterministic
mode every sequence's tokens are cut at block boundaries and each piece runs padded to one fixed
tile of ``block_size`` rows, so a token's arithmetic never depends on how much of its prefix came
from cache or what else was in the batch.

A model with sliding-window layers gets a hybrid pool (``cache/kv_groups.py``): a page holds the
K/V of a group of layers, each KV group has its own block tables (the scheduler's tables come as
one list per group), and a forward pass gets one attention metadata per group.

Knows the model and the scheduler's output; not the cache's hashing or the tokenizer.
"""

from __future__ import annotations

import logging
import math
import mmap
import os

import torch

from hotprefix.cache.kv_groups import GroupLayout, plan_groups
from hotprefix.config.sections import CacheConfig, ConfigError, ModelConfig, parse_bytes
from hotprefix.engine.request import Request
from hotprefix.engine.scheduler import ScheduledChunk
from hotprefix.model.attention import PAD_BLOCK, AttentionMetadata, PrefillSeq, padded_len
from hotprefix.model.dtype_probe import probed_cpu_dtype
from hotprefix.model.fused import library
from hotprefix.model.kv_dtype import resolve_kv_dtype
from hotprefix.model.linear import resolve_weights
from hotprefix.model.llama import LlamaModel
from hotprefix.model.loader import LoadedModel
from hotprefix.model.packed_store import PackedStore
from hotprefix.request.logits import RowInput
from hotprefix.request.sampling import Sampled, sample

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_MEMORY = "1GiB"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("device 'cuda' was asked for but CUDA is not available")
        return torch.device("cuda")
    return torch.device("cpu")


def pick_dtype(name: str, device: torch.device, gguf_default: bool = False) -> torch.dtype:
    """The compute dtype: as asked, or for ``auto`` bf16 on CUDA, on a CPU where the ``gguf``
    weight mode will run (``gguf_default``: every GEMM takes fp32 inputs, quantized to 16-bit
    integers, and attention runs in fp32, so bf16 only stores K/V, at half fp32's bytes, and needs
    no bf16 arithmetic from the CPU), and on CPUs that multiply bf16 natively and fast (probed);
    fp32 elsewhere. The choice is logged."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16
    if gguf_default:
        log.info("dtype auto -> bfloat16: the gguf weight mode computes in fp32 and 16-bit "
                 "integers; bf16 stores K/V")
        return torch.bfloat16
    choice = probed_cpu_dtype()
    log.info("dtype auto -> %s", choice.reason)
    return choice.dtype


def _total_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def plan_num_blocks(cache: CacheConfig, bytes_per_block: int, weights_bytes: int,
                    device: torch.device) -> int:
    """Number of KV blocks for the configured pool size."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    if cache.kv_cache_memory is not None:
        budget = parse_bytes(cache.kv_cache_memory)
    else:
        util = cache.memory_utilization
        if util is None and device.type == "cpu":
            budget = parse_bytes(DEFAULT_CPU_KV_MEMORY)
        else:
            util = 0.9 if util is None else util
            used = torch.cuda.memory_allocated(device) if device.type == "cuda" else weights_bytes
            reserve = 512 * 1024**2  # activations of one step
            budget = int(_total_memory(device) * util) - used - reserve
    n = budget // bytes_per_block
    if n < 2:
        raise ConfigError(f"the KV pool budget ({budget} bytes) holds fewer than 2 blocks of "
                          f"{bytes_per_block} bytes; raise kv_cache_memory or memory_utilization")
    return int(n)


def zeros_on_demand(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on CPU over private anonymous memory that the OS maps (zeroed) on first write,
    so the pool's blocks take memory as they are first used, not all at start (``torch.zeros``
    writes every page: a 1 GiB pool costs about half a second and 1 GiB resident before the
    first request)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # 4 KiB pages, as
    # torch.zeros had: a first write faults one page in, never a huge page's compaction mid-request
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)  # keeps buf alive


class ModelRunner:
    def __init__(self, loaded: LoadedModel, model_cfg: ModelConfig, cache_cfg: CacheConfig,
                 positions: int | None = None):
        """``positions``: the most positions a sequence reaches (the engine's ``max_model_len``;
        None: the model's), which the RoPE tables cover."""
        if model_cfg.num_threads:
            torch.set_num_threads(model_cfg.num_threads)
        self.device = pick_device(model_cfg.device)
        gguf_default = (model_cfg.weights == "auto" and bool(loaded.blocks)
                        and library() is not None
                        and resolve_weights("auto", self.device, torch.bfloat16) == "gguf")
        self.dtype = pick_dtype(model_cfg.dtype, self.device, gguf_default)
        self.kv_dtype = kv = resolve_kv_dtype(cache_cfg.kv_cache_dtype, self.dtype, self.device,
                                              explicit_dtype=model_cfg.dtype != "auto")
        """The pool's element type (``CacheConfig.kv_cache_dtype``)."""
        self.deterministic = model_cfg.deterministic
        self.arch = arch = loaded.arch
        kept = (PackedStore([loaded.path], arch.fingerprint_json(),
                            "a8" if model_cfg.activations == "int8" else "a16", loaded.identity)
                if model_cfg.packed_cache and loaded.blocks else None)  # blocks: a GGUF file
        self.model = LlamaModel(arch, loaded.weights, self.device, self.dtype, model_cfg.weights,
                                model_cfg.fused_kernels, loaded.blocks, kv, model_cfg.activations,
                                kept, positions)
        self.kept = kept
        """The packed weights kept on disk (``packed_store.PackedStore``), or None."""
        self.keeping = kept.keep(loaded.fingerprint_digest) if kept is not None else None
        """The thread writing the packed weights for the next start (``packed_store``), or None."""
        if kept is not None and kept.path is not None:
            log.info("packed weights mapped from %s", kept.path)
        self.block_size = bs = cache_cfg.block_size
        self.bytes_per_token = kv.bytes_per_token(arch.num_layers, arch.num_kv_heads, arch.head_dim)
        """Pool bytes a cached token costs (K and V of every layer, int8 scales included)."""
        self.weights_bytes = self.model.weight_bytes()
        blocks = plan_num_blocks(cache_cfg, self.bytes_per_token * bs, self.weights_bytes, self.device)
        self.layout: GroupLayout = plan_groups(
            arch.num_layers, arch.local_layers, arch.sliding_window,
            hybrid=not cache_cfg.disable_hybrid_kv_cache_manager)
        """The pool's KV groups (one group of every layer unless the model has window layers)."""
        if self.layout.hybrid and cache_cfg.kv_store:
            log.info("KV tiers with the hybrid pool: a tier entry holds each group's page of a "
                     "block (group 0's always; a window group's when the pool had it cached)")
        lay = self.layout
        self.num_blocks = lay.pages_for_blocks(blocks)
        """Pages in the pool (whole-model blocks unless hybrid: then ``page_layers`` layers each)."""
        shape = (self.num_blocks, bs, arch.num_kv_heads, kv.row(arch.head_dim))
        self.kv_slots = [(zeros_on_demand(shape, kv.torch_dtype, self.device),
                          zeros_on_demand(shape, kv.torch_dtype, self.device))
                         for _ in range(lay.page_layers)]
        """One (K, V) pair per layer of a page; a layer keeps its K/V in its slot's pair."""
        self.layer_group = [g for g, _ in lay.slot_of()]
        self.kv_caches = [self.kv_slots[j] for _, j in lay.slot_of()]
        self.capacity_tokens = blocks * bs
        self.numerics = self.model.numerics
        """What the K/V values depend on besides the weights (``LlamaModel.numerics``)."""
        log.info("weights: %s, %.1f MiB held; GEMMs padded to %d rows (batch-invariant)",
                 self.numerics, self.weights_bytes / 2**20, self.model.min_rows)
        log.info("KV pool: %d blocks x %d tokens = %d tokens (%.1f MiB, %d bytes/token) on %s, "
                 "K/V in %s", blocks, bs, self.capacity_tokens,
                 blocks * bs * self.bytes_per_token / 2**20, self.bytes_per_token,
                 self.device, kv.name)
        if lay.hybrid:
            log.info("KV groups (hybrid): %d pages of %d layers shared by %d full group(s) and %d "
                     "window-%d group(s); a cached token costs %d bytes in the full groups and "
                     "the window groups hold only windows", self.num_blocks, lay.page_layers,
                     lay.num_full_groups, lay.num_window_groups, lay.window,
                     self.bytes_per_token * lay.num_full_groups * lay.page_layers // lay.num_layers)

    # ------------------------------------------------------------------ one step
    def run(self, chunks: list[ScheduledChunk], block_tables: dict[str, list[int]]
            ) -> tuple[dict[str, Sampled], list[tuple[Request, int, Sampled]]]:
        """Forward the scheduled chunks; sample for those that reached their last token.

        A group's first sequence drawing its first token also draws, from the same logits, the
        first token of each sequence waiting to fork from it (``Request.forks``), each with its
        own stream.

        Args:
            chunks: This step's scheduled chunks.
            block_tables: request id -> the request's block table.

        Returns:
            request id -> sampled token (forks included), and the prompt log probabilities
            computed this step: (request, prompt position, that position's token's log probs).
        """
        if not chunks:
            return {}, []
        logits, owners, prompt_logits, prompt_rows = self._forward(chunks, block_tables)
        prompt = self._prompt_logprobs(prompt_logits, prompt_rows)
        if not owners:
            return {}, prompt
        seqs: list[Request] = []
        index: list[int] = []
        for i, c in enumerate(owners):
            req = c.request
            forks = req.forks if req.num_output_tokens == 0 else []
            for seq in [req, *forks]:
                seqs.append(seq)
                index.append(i)
        rows = [RowInput(r.params, r.generator, r.token_ids, r.num_prompt_tokens, r.logits_mask)
                for r in seqs]
        picked = logits if len(index) == len(owners) else logits[index]
        drawn = sample(picked, rows, self.model.argmax)
        return {r.request_id: t for r, t in zip(seqs, drawn)}, prompt

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, rows: list[tuple[Request, int]]
                         ) -> list[tuple[Request, int, Sampled]]:
        """The log probabilities of prompt token ``pos`` from the logits at ``pos - 1``, for every
        row at once (raw: no penalty or temperature applies to a prompt)."""
        if not rows:
            return []
        lsm = torch.log_softmax(logits.to("cpu", torch.float32), dim=-1)
        toks = torch.tensor([req.token_ids[pos] for req, pos in rows], dtype=torch.long)
        lp = lsm.gather(1, toks[:, None])
        ranks = ((lsm > lp).sum(dim=1) + 1).tolist()
        k = max(req.params.prompt_logprobs for req, _ in rows)
        top_v, top_i = torch.topk(lsm, k) if k else (lsm[:, :0], toks[:, None][:, :0])
        out = []
        for r, (req, pos) in enumerate(rows):
            kk = req.params.prompt_logprobs
            top = list(zip(top_i[r, :kk].tolist(), top_v[r, :kk].tolist()))
            out.append((req, pos, Sampled(int(toks[r]), float(lp[r, 0]), ranks[r], top)))
        return out

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks of K/V (every layer), ``src -> dst`` for each pair (a fork's last
        partial block)."""
        if not pairs:
            return
        src = torch.tensor([a for a, _ in pairs], device=self.device)
        dst = torch.tensor([b for _, b in pairs], device=self.device)
        for k, v in self.kv_slots:
            k[dst] = k[src]
            v[dst] = v[src]

    def forward_logits(self, chunks: list[ScheduledChunk], block_tables: dict[str, list[int]]):
        """Logits of the chunks' last tokens (for tests); same path as ``run``."""
        logits, owners, _, _ = self._forward(chunks, block_tables)
        return logits, owners

    def _forward(self, chunks, block_tables):
        """(logits of the sampled rows, their chunks, logits of the prompt positions whose
        request wants prompt log probabilities, those (request, position of the predicted token))."""
        run = self._run_tiled if self.deterministic else self._run_batched
        return run(chunks, block_tables)

    @staticmethod
    def _prompt_positions(c: ScheduledChunk) -> range:
        """Positions of the chunk whose logits predict a prompt token (prompt log probabilities)."""
        req = c.request
        if req.params.prompt_logprobs is None:
            return range(0)
        return range(c.start, min(c.start + c.num_tokens, req.num_prompt_tokens - 1))

    def _group_tables(self, block_tables: dict) -> dict[str, list[list[int]]]:
        """request id -> one block table per KV group (a single group's table may come bare)."""
        n = len(self.layout.groups)
        out = {}
        for rid, t in block_tables.items():
            tables = t if t and isinstance(t[0], list) else [t]
            if len(tables) != n:
                raise ValueError(f"{len(tables)} block tables for a pool of {n} KV groups")
            out[rid] = tables
        return out

    def _per_layer(self, metas: list[AttentionMetadata]):
        """The forward pass's metadata: one, or one per layer (its KV group's)."""
        return metas[0] if len(metas) == 1 else [metas[g] for g in self.layer_group]

    def _run_batched(self, chunks, block_tables):
        bs, dev = self.block_size, self.device
        tables = self._group_tables(block_tables)
        # decodes in order of context length: those with one key count are one attention call
        decodes = sorted((c for c in chunks if c.num_tokens == 1), key=lambda c: c.start)
        prefills = [c for c in chunks if c.num_tokens > 1]
        ids: list[int] = []
        pos: list[int] = []
        logit_rows: list[int] = []
        owners: list[ScheduledChunk] = []
        for r, c in enumerate(decodes):
            p = c.start
            ids.append(c.request.token_ids[p])
            pos.append(p)
            if c.wants_logits:
                logit_rows.append(r)
                owners.append(c)
        extra_rows: list[int] = []
        extra: list[tuple[Request, int]] = []
        for r, c in enumerate(decodes):  # a one-token prompt chunk runs as a decode
            for p in self._prompt_positions(c):
                extra_rows.append(r)
                extra.append((c.request, p + 1))
        starts = []
        for c in prefills:
            start, n = c.start, c.num_tokens
            q0 = len(ids)
            starts.append(q0)
            ids.extend(c.request.token_ids[start:start + n])
            pos.extend(range(start, start + n))
            if c.wants_logits:
                logit_rows.append(q0 + n - 1)
                owners.append(c)
            for p in self._prompt_positions(c):
                extra_rows.append(q0 + p - start)
                extra.append((c.request, p + 1))
        metas = []
        masks: dict = {}  # the groups' prefill masks are the same tensors
        for g in range(len(self.layout.groups)):
            slots = [tables[c.request.request_id][g][c.start // bs] * bs + c.start % bs for c in decodes]
            decode_tables = [tables[c.request.request_id][g] for c in decodes]
            prefill_seqs: list[PrefillSeq] = []
            for c, q0 in zip(prefills, starts):
                start, n = c.start, c.num_tokens
                bt = tables[c.request.request_id][g]
                slots.extend(bt[p // bs] * bs + p % bs for p in range(start, start + n))
                nb = math.ceil((start + n) / bs)
                prefill_seqs.append(PrefillSeq(q0, q0 + n, start + n, torch.tensor(bt[:nb], device=dev)))
            metas.append(self._batched_metadata(slots, decodes, decode_tables, prefill_seqs, masks))
        rows = torch.tensor(logit_rows + extra_rows, dtype=torch.long, device=dev)
        logits = self.model.forward(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev),
                                    self.kv_caches, self._per_layer(metas), rows)
        n_sampled = len(logit_rows)
        return logits[:n_sampled], owners, logits[n_sampled:], extra

    def _batched_metadata(self, slots: list[int], decodes: list[ScheduledChunk],
                          decode_tables: list[list[int]], prefills: list[PrefillSeq],
                          masks: dict | None = None) -> AttentionMetadata:
        """The step's attention metadata, complete: slots, prefill sequences, and for the decodes
        their context lengths and block tables (padded with PAD_BLOCK to the longest)."""
        bs, dev = self.block_size, self.device
        slot_mapping = torch.tensor(slots, device=dev)
        shared = {} if masks is None else {"masks": masks}
        if not decodes:
            return AttentionMetadata(slot_mapping=slot_mapping, prefills=prefills, **shared)
        ctx = [c.start + 1 for c in decodes]
        nblocks = padded_len(max(ctx)) // bs
        table = torch.tensor([bt[:nblocks] + [PAD_BLOCK] * (nblocks - min(len(bt), nblocks)) for bt in decode_tables],
                             dtype=torch.long)
        return AttentionMetadata(
            slot_mapping=slot_mapping, num_decode=len(decodes), prefills=prefills,
            decode_block_tables=table.to(dev), decode_context_lens=ctx, **shared)

    def _run_tiled(self, chunks, block_tables):
        """Deterministic mode: one fixed-shape tile per (sequence, block) piece."""
        bs, dev = self.block_size, self.device
        tables = self._group_tables(block_tables)
        rows, owners = [], []
        extra_logits, extra = [], []
        for c in chunks:
            wanted = self._prompt_positions(c)
            group_bts = tables[c.request.request_id]
            p, end = c.start, c.start + c.num_tokens
            while p < end:
                b = p // bs
                tile_end = min(end, (b + 1) * bs)
                ids = [0] * bs
                for q in range(p, tile_end):
                    ids[q % bs] = c.request.token_ids[q]
                metas, masks = [], {}
                for bt in group_bts:
                    slots = [-1] * bs
                    for q in range(p, tile_end):
                        slots[q % bs] = bt[b] * bs + q % bs
                    metas.append(AttentionMetadata(
                        slot_mapping=torch.tensor(slots, device=dev), has_padding=True, masks=masks,
                        prefills=[PrefillSeq(0, bs, (b + 1) * bs, torch.tensor(bt[:b + 1], device=dev))]))
                positions = torch.arange(b * bs, (b + 1) * bs, device=dev)
                logits = self.model.forward(torch.tensor(ids, device=dev), positions, self.kv_caches,
                                            self._per_layer(metas), None)
                if tile_end == end and c.wants_logits:
                    rows.append(logits[(end - 1) % bs])
                    owners.append(c)
                for q in range(p, tile_end):
                    if q in wanted:
                        extra_logits.append(logits[q % bs])
                        extra.append((c.request, q + 1))
                p = tile_end
        stacked = torch.stack(extra_logits) if extra_logits else torch.empty(0)
        if not rows:
            return torch.empty(0), [], stacked, extra
        return torch.stack(rows), owners, stacked, extra
