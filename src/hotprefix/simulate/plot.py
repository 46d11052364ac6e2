"""Draw a miss-ratio curve (``sweep``'s result) to a PNG with matplotlib (imported on call).

Knows nothing about how the curve was measured.
"""

from __future__ import annotations

from typing import Any


def plot_mrc(result: dict[str, Any], path: str, title: str = "") -> None:
    """Hit ratio against capacity (log scale), one line per policy, MIN dashed, the ceiling dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    caps = [c / 1e6 for c in result["capacities_tokens"]]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for name, ys in result["policies"].items():
        style = dict(color="black", linestyle="--") if name == "min" else {}
        label = "MIN (Belady, offline)" if name == "min" else name
        ax.plot(caps, ys, marker="o", markersize=3, label=label, **style)
    ax.axhline(result["ceiling"], color="gray", linestyle=":", label="ceiling (infinite cache)")
    ax.set_xscale("log")
    ax.set_xlabel("KV pool capacity (million tokens)")
    ax.set_ylabel("block hit ratio")
    ax.set_title(title or "Miss-ratio curve")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
