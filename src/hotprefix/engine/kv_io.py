"""Moves whole KV blocks between the runner's pool tensors and bytes, for the KV tiers.

One block's payload is the K and V of every layer for that block's ``block_size`` slots, in the
pool's element type, laid out ``[layer][k|v][slot][kv_head][row]`` (a row: ``head_dim`` values, and
for int8 the row's scale, ``hotprefix.model.kv_dtype``). The ``layout`` string names everything that
shapes those bytes (KV element type, layers, KV heads, head dim, block size), so a tier entry
written by another layout (an int8 block in a bf16 pool, say) is never read back. Reads and writes gather/scatter many blocks with
one indexed copy per layer and tensor. Loads go through one staging buffer, allocated and touched
when the tiers open and reused for every load: a fresh process's first load would otherwise pay
the page faults of a new buffer as large as the prompt's K/V, which is most of a load's time on a
machine where other big processes run.

A hybrid pool (``cache/kv_groups.py``) moves pages instead: a page holds one KV group's layers
(``page_layers`` of them, in the slot order of ``runner.kv_slots``), and its layout tag names the
groups (each one's layers and window) after the page's shape, so no whole-model block is read as
a page, nor a page of another grouping.
"""

from __future__ import annotations

import logging
import os
from typing import Sequence

import numpy as np
import torch

from hotprefix.cache.kv_groups import GroupLayout
from hotprefix.config.sections import CacheConfig, ConfigError, parse_bytes
from hotprefix.model.kv_dtype import head_dim_of, kv_dtype_of

log = logging.getLogger(__name__)

LAYOUT_VERSION = 1
STAGING_BLOCKS = 32
"""Blocks copied into the pool per indexed copy on a load (the staging buffer's size)."""


class KVBlockIO:
    """The runner's ``BlockIO`` (see ``hotprefix.cache.tier_link``)."""

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], tag: str = ""):
        """
        Args:
            kv_caches: (K, V) per layer of a block (per slot of a page, for a hybrid pool).
            tag: appended to the layout tag (a hybrid pool's groups).
        """
        self.kv_caches = kv_caches
        k0 = kv_caches[0][0]
        _, self.block_size, self.num_kv_heads, row = k0.shape
        self.head_dim = head_dim_of(k0)
        self.dtype = k0.dtype
        self.device = k0.device
        self.num_layers = len(kv_caches)
        self.block_shape = (self.num_layers, 2, self.block_size, self.num_kv_heads, row)
        self.payload_len = k0[0].numel() * k0.element_size() * 2 * self.num_layers
        self._staging = torch.zeros((STAGING_BLOCKS, self.payload_len), dtype=torch.uint8)
        kv = kv_dtype_of(k0)
        # 16-bit and fp32 pools keep the tag they always had; int8 names its scale layout
        elem = (str(self.dtype).replace("torch.", "") if not kv.quantized
                else f"{kv.name}-s{kv.row_extra}")
        self.layout = (f"kv{LAYOUT_VERSION}/{elem}/L{self.num_layers}"
                       f"/H{self.num_kv_heads}/D{self.head_dim}/B{self.block_size}{tag}")

    def read_blocks(self, block_ids: Sequence[int]) -> list[bytes]:
        """The payload of each block (copied: the pool may reuse the block right after)."""
        if not block_ids:
            return []
        idx = torch.tensor(list(block_ids), device=self.device)
        out = torch.empty((len(block_ids),) + self.block_shape, dtype=self.dtype)
        for layer, (k, v) in enumerate(self.kv_caches):
            out[:, layer, 0] = k.index_select(0, idx).cpu()
            out[:, layer, 1] = v.index_select(0, idx).cpu()
        raw = out.view(torch.uint8).reshape(len(block_ids), self.payload_len).numpy()
        return [raw[i].tobytes() for i in range(len(block_ids))]

    def write_blocks(self, block_ids: Sequence[int], payloads: Sequence[bytes | memoryview]) -> None:
        """Copy payloads (verified by the tier) into the given pool blocks, ``STAGING_BLOCKS`` at
        a time through the staging buffer."""
        if not block_ids:
            return
        if any(len(p) != self.payload_len for p in payloads):
            raise ValueError(f"a KV payload is not {self.payload_len} bytes")
        arr = self._staging.numpy()
        for lo in range(0, len(block_ids), STAGING_BLOCKS):
            chunk = payloads[lo:lo + STAGING_BLOCKS]
            for i, p in enumerate(chunk):  # one copy each, straight into the staging buffer
                arr[i] = np.frombuffer(p, dtype=np.uint8)
            n = len(chunk)
            blocks = self._staging[:n].view(self.dtype).view((n,) + self.block_shape).to(self.device)
            idx = torch.tensor(list(block_ids[lo:lo + n]), device=self.device)
            for layer, (k, v) in enumerate(self.kv_caches):  # index_put: ~2x faster than index_copy_
                k[idx] = blocks[:, layer, 0]
                v[idx] = blocks[:, layer, 1]


def read_secret(value: str | None) -> bytes | None:
    """``--kv-store-secret``: the literal text, ``env:NAME`` or ``file:PATH`` (keeps it out of ``ps``)."""
    if not value:
        return None
    if value.startswith("env:"):
        name = value[4:]
        if not os.environ.get(name):
            raise ConfigError(f"kv_store_secret: the environment variable {name} is not set")
        return os.environ[name].encode()
    if value.startswith("file:"):
        try:
            with open(value[5:], "rb") as f:
                data = f.read().strip()
        except OSError as e:
            raise ConfigError(f"kv_store_secret: cannot read {value[5:]}: {e.strerror or e}") from None
        if not data:
            raise ConfigError(f"kv_store_secret: {value[5:]} is empty")
        return data
    return value.encode()


def groups_tag(layout: GroupLayout) -> str:
    """A hybrid layout's part of the layout tag: every group's layers and window."""
    return "/G" + ";".join(f"{'-'.join(map(str, g.layers))}w{g.window}" for g in layout.groups)


def open_tiers(cache_cfg: CacheConfig, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
               layout: GroupLayout | None = None):
    """The ``TierLink`` for ``--kv-store`` (None without tiers). Raises ConfigError on a bad URL.

    Args:
        kv_caches: (K, V) per model layer (a hybrid pool's layers share their slots' tensors).
        layout: the pool's KV groups; a hybrid one stores a page per group (``group_blob``).
    """
    if not cache_cfg.kv_store:
        return None
    from hotprefix.cache.tier_link import TierLink
    from hotprefix.cache.tiers import TierStack

    grouped = layout is not None and layout.hybrid
    if grouped:  # slot j's tensors: those of group 0's j-th layer (every group's, alike)
        io = KVBlockIO([kv_caches[layer] for layer in layout.groups[0].layers], groups_tag(layout))
    else:
        io = KVBlockIO(kv_caches)
    max_bytes = parse_bytes(cache_cfg.kv_store_max_bytes) if cache_cfg.kv_store_max_bytes else None
    try:
        stack = TierStack(list(cache_cfg.kv_store), io.layout, secret=read_secret(cache_cfg.kv_store_secret),
                          max_bytes=max_bytes, timeout_s=cache_cfg.kv_store_timeout,
                          ttl_s=cache_cfg.kv_store_ttl_s, grouped=grouped)
    except ValueError as e:
        raise ConfigError(f"kv_store: {e}") from None
    log.info("KV tiers: %s (layout %s, %d bytes per %s)", ", ".join(stack.names), io.layout,
             io.payload_len, "group page" if grouped else "block")
    return TierLink(stack, io, cache_cfg.kv_store_timeout)
