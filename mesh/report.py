"""Markdown tables and plots: what the CLI's tables and loss.png and the studies' reports are
drawn with.

imports: mesh.errors; matplotlib when a plot is drawn (the plots extra).
"""

from __future__ import annotations

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
    drawn = 0
    for label, pts in curves.items():
        if pts:
            xs, ys = zip(*pts, strict=True)
            style = {"marker": "." if len(pts) < 30 else None, **(styles or {}).get(label, {})}
            ax.plot(xs, ys, label=label, **style)
            drawn += 1
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if logx:
        ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    if drawn:  # no curve has a point (emulated compute has no loss): no legend to draw
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
