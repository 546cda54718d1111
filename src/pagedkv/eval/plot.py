"""`pagedkv eval --plot FILE.png`: KL and perplexity against bits per element, Pareto front marked.

Made to be read at a glance: both panels share the x axis (bits per element); KL is on a log
axis and the reference (KL 0, i.e. bf16) sits on its bottom edge as a downward triangle, labelled
"= 0"; perplexity is on a linear axis cut at 1.5x the range of the formats near the reference,
with the formats above the cut drawn on the top edge as upward triangles with their value in the
label; labels are placed beside their point where they do not cover another label or point.
"""

from __future__ import annotations

import math
from typing import Sequence

from ..errors import ConfigError


def require_matplotlib():
    """matplotlib.pyplot on the Agg backend; ConfigError (checked before the work) without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        raise ConfigError("--plot needs matplotlib: pip install 'pagedkv[model]'") from None
    return plt


def _pareto(points: Sequence[tuple[float, float]]) -> list[int]:
    from .runner import pareto_front

    return pareto_front(points)


def _place_labels(ax, xs, ys, labels, fontsize: float = 8) -> None:
    """Annotate each point, trying offsets around it until the label's box overlaps neither an
    earlier label nor a point (display coordinates; a box is estimated from the font size)."""
    fig = ax.figure
    fig.canvas.draw()
    to_px = ax.transData.transform
    pts = [tuple(to_px((x, y))) for x, y in zip(xs, ys)]
    char_w, h = 0.6 * fontsize * fig.dpi / 72, 1.2 * fontsize * fig.dpi / 72
    taken: list = []
    offsets = [(5, 3), (5, -h - 1), (-5, 3), (-5, -h - 1), (5, 3 + h), (-5, 3 + h), (5, -2 * h - 1),
               (-5, -2 * h - 1), (0, 8 + h), (0, -8 - 2 * h)]

    def box(px, py, dx, dy, w):
        x0 = px + dx if dx >= 0 else px + dx - w
        return (x0, py + dy, x0 + w, py + dy + h)

    def free(b):
        if any(not (b[2] < t[0] or b[0] > t[2] or b[3] < t[1] or b[1] > t[3]) for t in taken):
            return False
        return not any(b[0] - 3 < px < b[2] + 3 and b[1] - 3 < py < b[3] + 3 for px, py in pts)

    order = sorted(range(len(labels)), key=lambda i: (xs[i], ys[i]))
    for i in order:
        w = char_w * len(labels[i])
        px, py = pts[i]
        choice = next(((dx, dy) for dx, dy in offsets if free(box(px, py, dx, dy, w))), offsets[0])
        b = box(px, py, *choice, w)
        taken.append(b)
        ax.annotate(labels[i], (xs[i], ys[i]), textcoords="offset points",
                    xytext=(choice[0] * 72 / fig.dpi, choice[1] * 72 / fig.dpi), fontsize=fontsize,
                    ha="left" if choice[0] >= 0 else "right", va="bottom")


def _panel_points(rows: Sequence[dict], key: str):
    """(indices with a value, the y each is drawn at, its label, edge marker or None, y limits)."""
    vals = [float(r[key]) if r.get(key) is not None else math.nan for r in rows]
    ok = [i for i, v in enumerate(vals) if v == v]
    shown = {i: vals[i] for i in ok}
    labels = {i: str(rows[i]["format"]) for i in ok}
    marks: dict = {}
    if not ok:
        return vals, ok, shown, labels, marks, None
    if key == "kl":
        positive = [vals[i] for i in ok if vals[i] > 0]
        floor = min(positive) / 4 if positive else 1e-4
        for i in ok:
            if vals[i] <= 0:  # the reference: on the bottom edge of the log axis
                shown[i], marks[i], labels[i] = floor, "v", f"{labels[i]} (= 0)"
        return vals, ok, shown, labels, marks, (floor / 1.6, (max(positive) * 2.5) if positive else 1e-2)
    ref = min(vals[i] for i in ok)
    near = [vals[i] for i in ok if vals[i] <= ref * 1.25] or [ref]
    top = ref + 1.5 * max(max(near) - ref, ref * 0.01)
    for i in ok:
        if vals[i] > top:  # off the scale: on the top edge, the value in the label
            shown[i], marks[i], labels[i] = top, "^", f"{labels[i]} ({vals[i]:.2f})"
    pad = 0.08 * (top - ref)
    return vals, ok, shown, labels, marks, (ref - pad, top + pad)


def plot_results(rows: Sequence[dict], path: str, title: str = "") -> None:
    """Two panels over bits/element: mean KL vs the bf16 cache (log) and perplexity (linear);
    the Pareto-optimal formats (no cheaper format is better) are joined by a line and ringed."""
    plt = require_matplotlib()
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2), sharex=True)
    bits = [float(r["bits_per_element"]) for r in rows]
    panels = []
    for ax, key, ylabel in ((axes[0], "kl", "mean KL vs the bf16 cache (log scale)"),
                            (axes[1], "ppl", "perplexity")):
        vals, ok, shown, labels, marks, ylim = _panel_points(rows, key)
        if key == "kl":
            ax.set_yscale("log")
        if ylim:
            ax.set_ylim(*ylim)
        inner = [i for i in ok if i not in marks]
        ax.scatter([bits[i] for i in inner], [shown[i] for i in inner], color="tab:blue", zorder=3)
        for marker in ("v", "^"):
            idx = [i for i, m in marks.items() if m == marker]
            if idx:
                ax.scatter([bits[i] for i in idx], [shown[i] for i in idx], marker=marker, s=60,
                           color="tab:gray", zorder=3, clip_on=False)
        front = [ok[j] for j in _pareto([(bits[i], vals[i]) for i in ok])]
        if front:
            ax.plot([bits[i] for i in front], [shown[i] for i in front], color="tab:red", lw=1,
                    label="Pareto front (no cheaper format is better)", zorder=2)
            ax.scatter([bits[i] for i in front], [shown[i] for i in front], s=130, facecolors="none",
                       edgecolors="tab:red", zorder=4, clip_on=False)
            ax.legend(loc="upper right", fontsize=8)
        ax.set_xlabel("bits per element (K and V, all layers)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="major")
        if key == "kl":
            ax.grid(alpha=0.08, which="minor")
        panels.append((ax, ok, shown, labels))
    if bits:
        axes[0].set_xlim(min(bits) - 0.8, max(bits) + 2.5)  # shared: both panels, room for labels
    for ax, ok, shown, labels in panels:
        _place_labels(ax, [bits[i] for i in ok], [shown[i] for i in ok], [labels[i] for i in ok])
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
