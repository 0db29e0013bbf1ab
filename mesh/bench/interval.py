"""The convergence study's averaging-interval axis (`meshtrain bench convergence --interval`):
AsyncMesh-fp8 at its tuned settings on the data-parallel study's 4x2 grid, seeds and budget,
with a round launched every H = 1, 4, 16 updates (dp.interval_steps). H = 1 is the study's own
AsyncMesh-fp8 run (reused where its config is unchanged). The gap of an H is its validation loss
against H = 1's, paired by seed, as a share of H = 1's; `plan --uplink-mbit` reads it.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from mesh.bench.convergence import study_variants
from mesh.bench.regime import data_reference, stamp
from mesh.bench.report import fmt_gap, paired_gap
from mesh.bench.simruns import run_specs
from mesh.bench.tuning import known_runs
from mesh.config import Config
from mesh.engine import measured
from mesh.report import format_table

INTERVALS = (1, 4, 16)
LABEL = "interval"


def variants(intervals: tuple[int, ...] = INTERVALS) -> list[tuple[str, str, dict[str, Any]]]:
    return [(f"H={h}", "AsyncMesh-fp8", {"dp.interval_steps": h}) for h in intervals]


def summarize(runs: list[dict[str, Any]], intervals: tuple[int, ...]) -> list[dict[str, Any]]:
    """One row per H: bytes, mean loss, the paired relative gap to H = 1."""
    by_h: dict[int, dict[int, dict[str, Any]]] = {}
    for r in runs:
        by_h.setdefault(int(r["method"].split("=")[1]), {})[r["seed"]] = r
    ref = {s: r["val_loss"] for s, r in by_h.get(1, {}).items()}
    rows = []
    for h in intervals:
        got = by_h.get(h, {})
        rel = {s: r["val_loss"] / ref[s] for s, r in got.items() if s in ref}
        gap = paired_gap(rel, dict.fromkeys(rel, 1.0))
        losses = [r["val_loss"] for r in got.values()]
        dp = [r["dp_bytes_per_replica_step"] for r in got.values()]
        rows.append(
            {
                "interval_steps": h,
                "dp_bytes_per_replica_step": _mean(dp),
                "val_loss": _mean(losses),
                "loss_gap": None if gap is None else round(gap[0], 5),
                "loss_gap_se": None
                if gap is None or not math.isfinite(gap[1])
                else round(gap[1], 5),
                "seeds": sorted(got),
            }
        )
    return rows


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else None


def run_interval(base: Config, study_dir: Path, workers: int, quick: bool = False) -> dict:
    """The axis on the study in study_dir (its summary.json and tuning.json); writes
    study_dir/interval/{summary.json, table.md}."""
    out = study_dir / "interval"
    study, specs, budget = study_variants(study_dir, LABEL, variants())
    if quick:  # the machinery on one seed at a tenth of the budget
        specs = [s for s in specs if s.seed == specs[0].seed]
        budget = {LABEL: max(8, budget[LABEL] // 10)}
    start = time.perf_counter()
    known = known_runs(study_dir / "summary.json")  # H = 1 is the study's own run
    runs = run_specs(base, specs, budget, out, workers, "interval axis", known)
    rows = summarize(runs, INTERVALS)
    summary = {
        "grid": "4x2",
        "method": "AsyncMesh-fp8",
        "microbatches_per_replica": budget[LABEL],
        "seeds": sorted({s.seed for s in specs}),
        "quick": quick,
        "rows": rows,
        "wall_s": round(time.perf_counter() - start, 1),
        "runs": runs,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "table.md").write_text(table(summary))
    summary.update(stamp(out, "interval", data_reference(base)))  # the rule (bench/regime.py)
    if not quick and study_dir == Path("results/convergence"):  # what plan ships with
        measured.record("interval", measured.interval_entry(summary, str(out / "summary.json")))
    (out / "runs.partial.jsonl").unlink(missing_ok=True)
    return summary


def table(summary: dict[str, Any]) -> str:
    rows = [
        [
            r["interval_steps"],
            "n/a" if (b := r["dp_bytes_per_replica_step"]) is None else f"{b:,.0f}",
            "n/a" if r["val_loss"] is None else f"{r['val_loss']:.4f}",
            "n/a"
            if r["loss_gap"] is None
            else fmt_gap((100 * r["loss_gap"], 100 * (r["loss_gap_se"] or math.nan))) + " %",
            len(r["seeds"]),
        ]
        for r in summary["rows"]
    ]
    head = (
        f"# Averaging interval: a round every H updates ({summary['method']}, "
        f"{summary['grid']}, {summary['microbatches_per_replica']} microbatches a replica, "
        f"seeds {summary['seeds']})\n\n"
    )
    return (
        head
        + format_table(["H", "dp B/replica/step", "val loss", "gap vs H = 1", "seeds"], rows)
        + "\n"
    )
