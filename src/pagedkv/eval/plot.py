"""`pagedkv eval --plot FILE.png`: KL and perplexity against bits per element, Pareto front marked."""

from __future__ import annotations

from typing import Sequence

from ..errors import ConfigError
from .runner import pareto_front


def plot_results(rows: Sequence[dict], path: str, title: str = "") -> None:
    """Two panels (mean KL vs the bf16 cache, log scale; perplexity) over bits/element; the
    Pareto-optimal formats (no cheaper format is better) are joined by a line and ringed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        raise ConfigError("--plot needs matplotlib: pip install 'pagedkv[model]'") from None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, key, label in ((axes[0], "kl", "mean KL vs bf16 cache"), (axes[1], "ppl", "perplexity")):
        pts = [(r["bits_per_element"], r[key]) for r in rows]
        usable = [i for i, (_, y) in enumerate(pts) if y == y and (key != "kl" or y > 0)]
        ax.scatter([pts[i][0] for i in usable], [pts[i][1] for i in usable], color="tab:blue", zorder=3)
        for i in usable:
            ax.annotate(rows[i]["format"], pts[i], textcoords="offset points", xytext=(4, 4), fontsize=8)
        front = [usable[j] for j in pareto_front([pts[i] for i in usable])]
        ax.plot([pts[i][0] for i in front], [pts[i][1] for i in front], color="tab:red", lw=1,
                label="Pareto front", zorder=2)
        ax.scatter([pts[i][0] for i in front], [pts[i][1] for i in front], s=120, facecolors="none",
                   edgecolors="tab:red", zorder=4)
        if key == "kl":
            ax.set_yscale("log")
        ax.set_xlabel("bits per element (K and V, all layers)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
