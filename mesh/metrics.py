"""Summary tables, seed-paired statistics and plots for benchmarks and runs."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table (also readable in a terminal)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[k]) for r in cells) for k in range(len(headers))]

    def fmt(r: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([fmt(cells[0]), sep, *map(fmt, cells[1:])])


def paired_gap(values: dict[int, float], reference: dict[int, float]) -> tuple[float, float] | None:
    """Mean and standard error of (value - reference) over the seeds both have."""
    seeds = sorted(set(values) & set(reference))
    diffs = [values[s] - reference[s] for s in seeds]
    if not diffs or not all(map(math.isfinite, diffs)):
        return None
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.nan
    return statistics.mean(diffs), se


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
    (matplotlib without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def metrics_offsets(run_dir: Path) -> dict[str, int]:
    """Each metrics file's size now: read_metrics(since=...) then reads only what comes after
    (a resumed run appends to the files of the run it continues)."""
    return {p.name: p.stat().st_size for p in (Path(run_dir) / "metrics").glob("*.jsonl")}


def read_metrics(
    run_dir: Path, events: bool = False, since: dict[str, int] | None = None
) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """Every cell's metrics rows, keyed (stage, replica). A line a running cell is still
    writing (no closing brace yet) is skipped, so this is safe to call during a run. Event rows
    ({"event": "session_broken" | "state_loaded", "step"}) only with events=True."""
    import json

    rows: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for path in sorted((Path(run_dir) / "metrics").glob("*.jsonl")):
        stage, replica = (int(x) for x in path.stem.split("-"))
        with path.open("rb") as f:
            f.seek((since or {}).get(path.name, 0))
            lines = f.read().decode().splitlines()
        parsed = [json.loads(ln) for ln in lines if ln.strip().endswith("}")]
        rows[(stage, replica)] = [r for r in parsed if events or "event" not in r]
    return rows


def summarize_run(
    cfg: Any, out_dir: Path, wall_s: float, start_step: int = 0, since: dict[str, int] | None = None
) -> dict[str, Any]:
    """summary.json of a multi-process run, from the cells' metrics files and checkpoints.
    A resumed run (from start_step; its rows after the file offsets `since`): rates and bytes
    are of this segment, tokens and the loss of the whole run."""

    from mesh.data import load_corpus
    from mesh.emulate import throughput
    from mesh.evaluate import common_steps, replica_loss, validation_batches

    rows = read_metrics(out_dir, since=since)
    P, m = cfg.grid.stages, cfg.grid.replicas
    steps = min((r[-1]["step"] for r in rows.values() if r), default=0)
    mpu = cfg.pipeline.microbatches if cfg.pipeline.schedule != "async" else 1
    tokens = steps * mpu * cfg.tokens_per_microbatch * m
    segment_tokens = max(0, steps - start_step) * mpu * cfg.tokens_per_microbatch * m
    last = {k: [r for r in v if not r.get("final")][-1] for k, v in rows.items() if v}
    corpus = load_corpus(cfg.data.path, cfg.data.val_fraction, cfg.model.seq_len)
    batches = validation_batches(cfg, corpus)
    losses = [
        replica_loss(cfg, out_dir, i, common_steps(out_dir, cfg, i)[-1], batches) for i in range(m)
    ]
    rounds = {
        k: sum(r.get(k, 0) for r in last.values())
        for k in ("rounds_started", "rounds_applied", "rounds_partial", "rounds_failed")
    }
    # steady state (warm-up rows left out) against the ideal of the same run (mesh/emulate.py)
    tp = throughput(cfg, rows)
    return {
        "grid": f"{P}x{m}",
        "steps": steps,
        "tokens": tokens,
        "wall_s": round(wall_s, 2),
        "tokens_per_s": segment_tokens / wall_s if wall_s > 0 else None,
        "val_loss": sum(losses) / m,
        "val_loss_replicas": losses,
        "bytes": {  # from the cells' final rows when present (written after sends drained)
            "pp_per_replica_step": tp.pp_bytes_per_replica_step,
            "dp_per_replica_step": tp.dp_bytes_per_replica_step,
        },
        "rounds": rounds,
        "rejects": sum(sum(r.get("rejects", {}).values()) for r in last.values()),
        "compute": cfg.runtime.compute,
        "steady_tokens_per_s": tp.tokens_per_s,
        "ideal_tokens_per_s": tp.ideal_tokens_per_s,
        "fraction_of_ideal": tp.fraction_of_ideal,
        "stage_times_s": tp.stage_s,
        "staleness": tp.staleness,
        "peak_memory": {"stash_bytes": tp.peak_stash_bytes, "rss_mb": tp.peak_rss_mb},
    }
