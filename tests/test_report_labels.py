"""How the bench words a speed comparison and draws its lines: never "faster by 0.9×", no hidden s4r line."""

from __future__ import annotations

import math

from s4r.bench.report_plot import plot_styles
from s4r.bench.report_tables import speedup_label


def test_speedup_label_says_slower_below_one() -> None:
    assert speedup_label(2.34) == "faster by 2.3×"
    assert speedup_label(1.0) == "faster by 1.0×"
    assert speedup_label(0.9) == "slower by 1.1×"
    assert speedup_label(0.5) == "slower by 2.0×"
    assert speedup_label(None) == "-" and speedup_label(math.nan) == "-"


def test_s4r_is_drawn_on_top_with_its_own_marker() -> None:
    methods = ["s4r", "s4r-paper", "full", "streaming", "snapkv", "svd", "offline"]
    styles = plot_styles(methods)
    others = [styles[m]["zorder"] for m in methods if m != "s4r"]
    assert styles["s4r"]["zorder"] > max(others)
    assert styles["s4r"]["linewidth"] > styles["svd"]["linewidth"]
    markers = [styles[m]["marker"] for m in methods]
    assert len(set(markers)) == len(markers)
