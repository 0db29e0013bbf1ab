"""`meshtrain simulate --backend torch|hivemind`: every cell its own process on 127.0.0.1."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from cli.launch import run_grid
from cli.report import print_table, progress_bar
from mesh.config import Config, ConfigError, with_overrides
from mesh.emulate import resolve_window
from mesh.metrics import plot_curves, read_metrics, summarize_run


def simulate_processes(cfg: Config, backend: str, out: Path | None, resume: bool = False) -> None:
    cfg = with_overrides(cfg, {"runtime.backend": backend})
    out = out or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    if (out / "metrics").exists() and not resume:
        raise ConfigError(f"--out {out} already holds a run; pick another or pass --resume {out}")
    out.mkdir(parents=True, exist_ok=True)
    # the resolved window, so a --resume runs the same schedule (and fingerprint)
    cfg = resolve_window(cfg)
    (out / "config.toml").write_text(cfg.to_toml())
    with progress_bar(cfg.run.steps, f"simulate {cfg.grid.stages}x{cfg.grid.replicas}") as bar:

        def on_progress(step: int, loss: float | None) -> None:
            bar.bar.n = step
            if loss is not None:
                bar.bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            bar.bar.refresh()

        run = run_grid(cfg, out, resume=resume, on_progress=on_progress)
    if not run.ok:
        failed = {f"s{j}r{i}": c for (j, i), c in run.exit_codes.items() if c != 0}
        click.echo(
            f"stopped: {'interrupted' if run.interrupted else failed}; metrics kept in {out}",
            err=True,
        )
        sys.exit(130 if run.interrupted else 1)
    summary = summarize_run(cfg, out, run.wall_s)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_run(cfg, out)
    print_table(
        [
            "grid",
            "steps",
            "tokens",
            "tokens/s",
            "of ideal",
            "val loss",
            "pp B/replica/step",
            "dp B/replica/step",
            "rounds started/applied/failed",
        ],
        [
            [
                summary["grid"],
                summary["steps"],
                summary["tokens"],
                f"{summary['tokens_per_s']:,.0f}",
                _fmt_fraction(summary.get("fraction_of_ideal")),
                f"{summary['val_loss']:.4f}",
                f"{summary['bytes']['pp_per_replica_step']:,.0f}",
                f"{summary['bytes']['dp_per_replica_step']:,.0f}",
                "/".join(
                    str(summary["rounds"][k])
                    for k in ("rounds_started", "rounds_applied", "rounds_failed")
                ),
            ]
        ],
    )
    click.echo(f"run directory: {out}")


def plot_run(cfg: Config, out: Path) -> None:
    """DIR/loss.png: each replica's training loss (its last stage) against its step."""
    rows = read_metrics(out)
    last = cfg.grid.stages - 1
    curves = {
        f"replica {i}": [(r["step"], r["loss"]) for r in rows.get((last, i), []) if r.get("loss")]
        for i in range(cfg.grid.replicas)
    }
    title = f"{cfg.grid.stages}x{cfg.grid.replicas} {cfg.pipeline.schedule}, {cfg.runtime.backend}"
    plot_curves(curves, out / "loss.png", "update", "training loss (last stage)", title)


def _fmt_fraction(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"
