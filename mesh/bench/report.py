"""Markdown tables, seed-paired statistics and plots: what the studies' reports (and the CLI's
tables and loss.png) are made of."""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mesh.errors import need_extra


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table (also readable in a terminal)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[k]) for r in cells) for k in range(len(headers))]

    def fmt(r: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([fmt(cells[0]), sep, *map(fmt, cells[1:])])


def checks_table(checks: dict[str, bool]) -> str:
    """A bench's targets as a table: yes, or MISSED."""
    return format_table(
        ["target", "met"], [[k, "yes" if ok else "MISSED"] for k, ok in checks.items()]
    )


def paired_gap(values: dict[int, float], reference: dict[int, float]) -> tuple[float, float] | None:
    """Mean and standard error of (value - reference) over the seeds both have."""
    seeds = sorted(set(values) & set(reference))
    diffs = [values[s] - reference[s] for s in seeds]
    if not diffs or not all(map(math.isfinite, diffs)):
        return None
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.nan
    return statistics.mean(diffs), se


def fmt_gap(g: tuple[float, float] | None) -> str:
    """A paired gap as `+0.0123 +- 0.0045` (no SE with one seed; n/a without a gap)."""
    if g is None:
        return "n/a"
    return f"{g[0]:+.4f} +- {g[1]:.4f}" if math.isfinite(g[1]) else f"{g[0]:+.4f}"


_SAID: set[str] = set()


def pyplot() -> Any | None:
    """matplotlib's pyplot without a display; None, said once on stderr, where the plots extra
    is not installed (a plot is a view of the numbers the run writes anyway)."""
    try:
        import matplotlib
    except ImportError:
        if "plots" not in _SAID:
            _SAID.add("plots")
            print(f"note: no plots: {need_extra('matplotlib', 'a plot')}", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curves(
    curves: dict[str, list[tuple[float, float]]],
    path: Path,
    xlabel: str,
    ylabel: str,
    title: str,
    logx: bool = False,
    styles: dict[str, dict[str, Any]] | None = None,
) -> None:
    """One line per label (styles: matplotlib keyword arguments per label); written as PNG
    (matplotlib without a display; nothing without the plots extra: see pyplot)."""
    plt = pyplot()
    if plt is None:
        return

    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for label, pts in curves.items():
        if pts:
            xs, ys = zip(*pts, strict=True)
            style = {"marker": "." if len(pts) < 30 else None, **(styles or {}).get(label, {})}
            ax.plot(xs, ys, label=label, **style)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if logx:
        ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
