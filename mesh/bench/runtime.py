"""`meshtrain bench runtime`: does a multi-process run learn what the simulator learns?

The same config and seed (AsyncMesh-fp8, a 2x2 grid of the default model) trained on the
one-process logical clock (`--backend logical`, rounds land exactly tau late) and as real cell
processes (torch.distributed and hivemind, rounds applied when they complete: the asynchrony a
user gets). Target (issue 4): at equal tokens the processes' validation loss is within noise of
the simulator's, where noise is the spread between seeds of the simulator itself (at least 1%).
Writes summary.json and table.md.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from mesh.bench.regime import data_reference, stamp
from mesh.config import Config, with_overrides
from mesh.engine.sim import GridSim
from mesh.methods import apply_method
from mesh.report import format_table
from mesh.runtime.launch import run_grid
from mesh.runtime.metrics import summarize_run

SETS = {"grid.stages": 2, "grid.replicas": 2, "run.steps": 200, "checkpoint.every": 0}
QUICK = {"run.steps": 40}


def run_equivalence(base: Config, out: Path, quick: bool = False) -> dict[str, Any]:
    cfg = with_overrides(apply_method(base, "AsyncMesh-fp8"), {**SETS, **(QUICK if quick else {})})
    seeds = [0, 1]
    runs: list[dict[str, Any]] = []
    out.mkdir(parents=True, exist_ok=True)
    for seed in seeds:
        c = with_overrides(cfg, {"run.seed": seed})
        t0 = time.perf_counter()
        res = GridSim(c).run()
        runs.append(_row("logical", seed, res.val_loss, time.perf_counter() - t0))
        for backend in ("torch", "hivemind") if seed == 0 else ("torch",):
            cb = with_overrides(c, {"transport.backend": backend})
            run_dir = out / f"{backend}-seed{seed}"
            grid = run_grid(cb, run_dir, timeout_s=1800)
            if not grid.ok:
                raise RuntimeError(f"{backend} seed {seed}: cells failed {grid.exit_codes}")
            summary = summarize_run(cb, run_dir, grid.wall_s)
            runs.append(_row(backend, seed, summary["val_loss"], grid.wall_s))
    sim = {r["seed"]: r["val_loss"] for r in runs if r["engine"] == "logical"}
    noise = max(abs(sim[0] - sim[1]), 0.01 * statistics.mean(sim.values()))
    for r in runs:
        r["gap_vs_logical"] = round(r["val_loss"] - sim[r["seed"]], 4)
    procs = [r for r in runs if r["engine"] != "logical"]
    summary = {
        "config": {"method": "AsyncMesh-fp8", "steps": cfg.run.steps, "grid": "2x2"},
        "noise": round(noise, 4),
        "runs": runs,
        "max_gap": max(abs(r["gap_vs_logical"]) for r in procs),
        "within_noise": all(abs(r["gap_vs_logical"]) <= noise for r in procs),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    table = format_table(
        ["engine", "seed", "val loss", "gap vs logical", "wall s"],
        [
            [
                r["engine"],
                r["seed"],
                f"{r['val_loss']:.4f}",
                f"{r['gap_vs_logical']:+.4f}",
                f"{r['wall_s']:.0f}",
            ]
            for r in runs
        ],
    )
    verdict = "within" if summary["within_noise"] else "NOT within"
    note = (
        f"\nnoise (seed spread of the simulator, at least 1%): {noise:.4f}; processes {verdict}\n"
    )
    (out / "table.md").write_text(table + note)
    summary.update(stamp(out, "runtime", data_reference(base)))  # the rule (bench/regime.py)
    print(table + note)
    return summary


def _row(engine: str, seed: int, val_loss: float | None, wall_s: float) -> dict[str, Any]:
    if val_loss is None:
        raise RuntimeError(f"{engine} seed {seed}: diverged")
    return {"engine": engine, "seed": seed, "val_loss": round(val_loss, 4), "wall_s": wall_s}
