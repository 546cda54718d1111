"""`pagedkv eval --task ... --plot FILE.png`: retrieval accuracy by length (with its 95% interval)
and by needle depth, one line per format, one row of panels per task. Cells where bf16 scores
below 80% (not informative) are drawn hollow."""

from __future__ import annotations

from typing import Sequence

from .plot import require_matplotlib


def plot_retrieval(rows: Sequence[dict], path: str, title: str = "") -> None:
    plt = require_matplotlib()
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    formats = list(dict.fromkeys(r["format"] for r in rows))
    fig, axes = plt.subplots(len(tasks), 2, figsize=(12, 4.2 * len(tasks)), squeeze=False)
    colours = plt.get_cmap("tab10")
    for ti, task in enumerate(tasks):
        by_len, by_depth = axes[ti]
        for fi, fmt in enumerate(formats):
            mine = sorted((r for r in rows if r["task"] == task and r["format"] == fmt), key=lambda r: r["length"])
            if not mine:
                continue
            colour = colours(fi % 10)
            xs = [r["length"] for r in mine]
            ys = [r["accuracy"] for r in mine]
            err = [[max(0.0, y - r["ci95"][0]) for y, r in zip(ys, mine)],
                   [max(0.0, r["ci95"][1] - y) for y, r in zip(ys, mine)]]
            bits = mine[-1]["bits_per_element"]
            by_len.errorbar(xs, ys, yerr=err, color=colour, marker="o", capsize=3, lw=1.2,
                            label=f"{fmt} ({bits:.2f} b at {xs[-1]})")
            for x, y, r in zip(xs, ys, mine):
                if not r["informative"]:
                    by_len.plot([x], [y], marker="o", ms=9, mfc="white", mec=colour)
            bins: dict = {}
            for r in mine:
                for b in r["by_depth"]:
                    key = (b["depth_lo"] + b["depth_hi"]) / 2
                    c, n = bins.get(key, (0, 0))
                    bins[key] = (c + b["correct"], n + b["trials"])
            pts = sorted((k, c / n) for k, (c, n) in bins.items() if n)
            by_depth.plot([p[0] for p in pts], [p[1] for p in pts], color=colour, marker="o", lw=1.2, label=fmt)
        by_len.set_xscale("log", base=2)
        lengths = sorted({r["length"] for r in rows if r["task"] == task})
        by_len.set_xticks(lengths, [f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in lengths])
        by_len.set(ylim=(-0.03, 1.03), xlabel="context length (tokens)", ylabel="accuracy",
                   title=f"{task}: accuracy by length (95% Wilson interval; hollow: bf16 < 80%)")
        by_depth.set(ylim=(-0.03, 1.03), xlim=(0, 1), xlabel="needle depth (fraction of the haystack)",
                     ylabel="accuracy", title=f"{task}: accuracy by depth (all lengths)")
        by_len.grid(alpha=0.3)
        by_depth.grid(alpha=0.3)
        by_len.legend(fontsize=7, loc="lower left")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
