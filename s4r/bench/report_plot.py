"""Benchmark results (the JSON document of :func:`s4r.bench.report.to_json`) as a matplotlib figure."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from s4r.bench.records import length_label

__all__ = ["plot", "plot_styles"]



_MARKERS = "os^vDP*Xph<>"
# the methods this project is about go on top; baselines with near-identical points hid the s4r line
_ON_TOP = ("s4r", "s4r-paper")


def plot_styles(methods: Iterable[str]) -> dict[str, dict[str, Any]]:
    """matplotlib keyword arguments per method: a marker each, and s4r drawn last, thicker, on top."""
    styles: dict[str, dict[str, Any]] = {}
    for i, method in enumerate(methods):
        top = method in _ON_TOP
        zorder = 10 - _ON_TOP.index(method) if top else 2
        styles[method] = {"marker": _MARKERS[i % len(_MARKERS)], "markersize": 7 if top else 5,
                          "linewidth": 2.4 if top else 1.2, "zorder": zorder, "alpha": 1.0 if top else 0.8}
    return styles

def plot(doc: dict[str, Any], path: str | Path) -> None:
    """Save a figure: accuracy against ratio per method, and decode tokens/s against context length.

    Needs matplotlib (the `plot` extra); panels without data are left out.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed (CI, ssh)
    import matplotlib.pyplot as plt

    methods = list(doc.get("methods", []))
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
    colors["full"] = "black"
    styles = plot_styles(methods)
    panels = [p for p, has in (("accuracy", bool(doc["accuracy"]["overall"])),
                               ("speed", any(s["decode_tok_s"] for s in doc["speed"]))) if has]
    if not panels:
        raise ValueError("nothing to plot: the run measured neither accuracy nor decode speed")
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        if panel == "accuracy":
            overall = doc["accuracy"]["overall"]
            for method in methods:
                pts = sorted((s["ratio"], s["score"]) for s in overall if s["method"] == method
                             and s["score"] is not None)
                if not pts:
                    continue
                if method == "full":
                    ax.axhline(pts[0][1], color=colors[method], linestyle="--", label="full (uncompressed)")
                else:
                    ax.plot(*zip(*pts, strict=True), color=colors[method], label=method, **styles[method])
            ratios = sorted({s["ratio"] for s in overall if s["method"] != "full"})
            if ratios:
                ax.set_xticks(ratios, [f"×{r:g}" for r in ratios])
            ax.set_ylim(-2, 102)
            ax.set_xlabel("compression ratio")
            ax.set_ylabel("accuracy (mean score over tasks and lengths)")
            ax.set_title("Accuracy against compression")
        else:
            dashes = ["-", "--", ":", "-."]
            ratios = sorted({s["ratio"] for s in doc["speed"] if s["method"] != "full"})
            for method in methods:
                for ratio in ([1.0] if method == "full" else ratios):
                    pts = sorted((s["length"], s["decode_tok_s"]) for s in doc["speed"]
                                 if s["method"] == method and s["ratio"] == ratio and s["decode_tok_s"])
                    if not pts:
                        continue
                    style = "-" if method == "full" else dashes[ratios.index(ratio) % len(dashes)]
                    label = "full" if method == "full" else f"{method} ×{ratio:g}"
                    ax.plot(*zip(*pts, strict=True), linestyle=style, color=colors[method], label=label,
                            **styles[method])
            lengths = sorted({s["length"] for s in doc["speed"]})
            ax.set_xscale("log", base=2)
            ax.set_xticks(lengths, [length_label(n) for n in lengths])
            ax.minorticks_off()
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel("decode tokens/s")
            ax.set_title("Decode speed against context length")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    run = doc.get("run", {})
    fig.suptitle(f"s4r bench · {run.get('model')} · {run.get('device')} {run.get('dtype')}", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
