"""KV groups: how a model's layers share the pool's pages when some of them attend to a window.

A model whose layers all attend to every key has one group, and a pool page holds the K/V of every
layer for ``block_size`` tokens (today's block). A model with sliding-window layers (Gemma 3: 15 of
18 layers see the last 512 tokens) has two kinds of layers, and keeping the window layers' K/V for
every cached token spends most of the pool on keys no query will read. So, as vLLM's hybrid KV
cache manager does, the layers are cut into **groups of equal size**: a page holds the K/V of
``page_layers`` layers (the greatest common divisor of the two kinds' counts), the full-attention
layers form ``full`` groups and the window layers ``window`` groups, and every group takes its own
pages from the one pool. A full group keeps a page for every block of a sequence; a window group
only for the blocks a query can still see, and for the windows before the points where later
requests will resume (``window_groups``).

Group 0 is always a full group (the one the prefix cache's chains and tiers are built on);
a model without window layers, or ``--disable-hybrid-kv-cache-manager``, has one group of every
layer. Also here, written once for the cache (``window_groups``) and the router (``router.index``):
a window group's block key (``group_key``) and the rule of which blocks a hit needs
(``first_needed_block``, ``resume_point``). Plain arithmetic; imports no torch.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Callable, Iterable

from hotprefix.cache.hashing import BlockKey


@dataclass(frozen=True)
class KVGroup:
    """One group of layers that share block tables."""

    layers: tuple[int, ...]
    """The model's layer indices in this group, in order; layer ``layers[j]`` keeps its K/V in
    slot ``j`` of the group's pages."""
    window: int = 0
    """Keys a query of these layers sees, ``[p - window + 1, p]`` (0: every key)."""

    @property
    def kind(self) -> str:
        return f"window-{self.window}" if self.window else "full"


@dataclass(frozen=True)
class GroupLayout:
    """The pool's groups: ``groups[0]`` is full; a page holds ``page_layers`` layers' K/V."""

    groups: tuple[KVGroup, ...]
    page_layers: int
    num_layers: int

    @property
    def hybrid(self) -> bool:
        """Whether some group keeps only a window (else every page is a whole-model block)."""
        return any(g.window for g in self.groups)

    @property
    def window(self) -> int:
        """The window of the window groups (0: none)."""
        return max((g.window for g in self.groups), default=0)

    @property
    def num_full_groups(self) -> int:
        return sum(1 for g in self.groups if not g.window)

    @property
    def num_window_groups(self) -> int:
        return sum(1 for g in self.groups if g.window)

    def slot_of(self) -> list[tuple[int, int]]:
        """Per model layer: (its group, its slot in the group's pages)."""
        out = [(-1, -1)] * self.num_layers
        for gi, g in enumerate(self.groups):
            for j, layer in enumerate(g.layers):
                out[layer] = (gi, j)
        return out

    def pages_for_blocks(self, num_blocks: int) -> int:
        """Pages holding the same bytes as ``num_blocks`` whole-model blocks."""
        return num_blocks * self.num_layers // self.page_layers

    def describe(self) -> list[dict]:
        """Per group: its kind, window and layers (the operator's view)."""
        return [{"group": i, "kind": g.kind, "window": g.window, "layers": list(g.layers)}
                for i, g in enumerate(self.groups)]


def plan_groups(num_layers: int, local_layers: tuple[int, ...] | list[int] = (), window: int = 0,
                hybrid: bool = True) -> GroupLayout:
    """The groups of a model with ``num_layers`` layers, of which ``local_layers`` attend to a
    window of ``window`` keys.

    Args:
        hybrid: False keeps every layer's K/V for every token (one group: the
            ``--disable-hybrid-kv-cache-manager`` baseline).
    """
    local = sorted(set(local_layers)) if window > 0 else []
    full = [i for i in range(num_layers) if i not in set(local)]
    if not hybrid or not local or not full:
        # no window layers, the baseline, or a model of window layers only (every layer then
        # needs the window: one group, kept whole, is the safe layout)
        return GroupLayout((KVGroup(tuple(range(num_layers))),), num_layers, num_layers)
    page = math.gcd(len(full), len(local))
    groups = [KVGroup(tuple(full[i:i + page])) for i in range(0, len(full), page)]
    groups += [KVGroup(tuple(local[i:i + page]), window) for i in range(0, len(local), page)]
    return GroupLayout(tuple(groups), page, num_layers)


def parse_layer_mix(text: str, window: int) -> GroupLayout:
    """``LOCAL/TOTAL`` (e.g. ``15/18``: the simulator's ``--local-layers``) as a layout whose
    window layers are spread as Gemma's are (all but every ``TOTAL/(TOTAL-LOCAL)``-th)."""
    try:
        local_s, total_s = text.split("/")
        local, total = int(local_s), int(total_s)
    except ValueError:
        raise ValueError(f"--local-layers wants LOCAL/TOTAL (e.g. 15/18), got {text!r}") from None
    if not 0 <= local <= total or total < 1:
        raise ValueError(f"--local-layers {text!r}: need 0 <= LOCAL <= TOTAL and TOTAL >= 1")
    n_full = total - local
    step = total / n_full if n_full else 1
    full = {min(total - 1, int(round((k + 1) * step)) - 1) for k in range(n_full)}
    return plan_groups(total, [i for i in range(total) if i not in full], window)


# ---------------------------------------------------------------------- the hit rule
def group_key(key: BlockKey, group: int) -> BlockKey:
    """The key of a window group's block: the chain key tagged with the group."""
    return BlockKey(hashlib.sha256(b"hotprefix/kv-group\0" + group.to_bytes(2, "little") + key).digest())


def first_needed_block(pos: int, window: int, block_size: int) -> int:
    """First block index that a query at ``pos`` (or later) reads in a group of ``window`` keys
    (0: a full group, which reads from block 0)."""
    return max(0, pos - window + 1) // block_size if window else 0


def resume_point(n_full: int, groups: Iterable[tuple[int, int]], block_size: int,
                 holds: Callable[[int, int], bool]) -> int:
    """The longest n <= ``n_full`` at which every group holds the blocks a hit at block n needs:
    ``first_needed_block(n * block_size)`` .. n - 1 (the full groups' run ``0..n_full-1`` is
    known to be there).

    Args:
        groups: (group, window) of every group past 0.
        holds: ``holds(group, i)``: whether that group's block ``i`` is there.
    """
    groups = list(groups)
    n = n_full
    while n > 0:
        missing = -1
        for g, w in groups:
            for i in range(n - 1, first_needed_block(n * block_size, w, block_size) - 1, -1):
                if i <= missing:
                    break
                if not holds(g, i):
                    missing = i
                    break
        if missing < 0:
            return n
        n = missing  # every hit point above ``missing`` needs it
    return 0
