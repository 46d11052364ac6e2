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

Group 0 is always a full group (the one the prefix cache's chains, tiers and events are built on);
a model without window layers, or ``--disable-hybrid-kv-cache-manager``, has one group of every
layer. Plain arithmetic; imports no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


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
