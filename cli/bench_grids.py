"""The handlers and options of the `meshtrain bench` commands that run grids of real processes:
joins over a DHT, peers behind NAT, stage pools, the hour-long soak and 32 peers (cli/bench.py's
table makes them commands)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from cli.options import out_option
from mesh.config import load_config

JOIN_OPTIONS = (
    out_option("join"),
    click.option(
        "--repeats",
        type=click.IntRange(min=1),
        default=3,
        show_default=True,
        help="Grids to form, one after another (about 30 s each on 2 cores).",
    ),
)


def join(out: str, repeats: int) -> None:
    """Joins on 127.0.0.1 (a 2x2 tiny grid): join to training, a killed peer's replacement to
    its replica resumed, a join naming a dead bootstrap to its error."""
    from mesh.bench.join import run_join_bench

    run_join_bench(Path(out), repeats=repeats)


NAT_OPTIONS = (out_option("nat"),)


def nat(out: str) -> str:
    """Peers behind NAT in network namespaces (root and nftables): streams direct against
    relayed, a relay's default limit, and a 2x2 grid whose replica 1 is relayed (about 5
    minutes)."""
    from comms.natns import unavailable

    why = unavailable()
    if why:
        click.echo(f"error: bench nat needs network namespaces: {why}", err=True)
        sys.exit(2)
    from mesh.bench.nat import run_nat_bench

    run_nat_bench(Path(out))
    return (Path(out) / "table.md").read_text()


POOLS_OPTIONS = (
    out_option("pools"),
    click.option("--quick", is_flag=True, help="The gpu-mix scenario alone, 30 updates a stream."),
    click.option("--steps", type=click.IntRange(min=10), default=None, help="Updates a stream."),
    click.option(
        "--convergence",
        is_flag=True,
        help="Instead: validation loss at equal tokens, pools against fixed, on the convergence "
        "study's 4x2 grid with one slow cell (simulator, seeds 10-17; about an hour here).",
    ),
    click.option(
        "--controls",
        is_flag=True,
        help="Instead: what in pools costs the loss, on the same grid and budget (simulator, "
        "seeds 10-11, one run at a time: pools with no slow cell, routing alone, replica "
        "affinity, pools against fixed under DPAvg; controls.md in --out).",
    ),
    click.option(
        "--workers", type=int, default=2, help="Simulator runs in parallel (--convergence)."
    ),
    click.option(
        "--report-only",
        is_flag=True,
        help="Run nothing: write the table and plot again from --out's summary.json, the "
        "capacity bounds recomputed.",
    ),
    click.option(
        "--set",
        "overrides",
        multiple=True,
        metavar="KEY=VALUE",
        help="A config key on top of the study's settings, in both arms (repeatable), e.g. --set "
        "pipeline.pool_window=8 --out results/pools-window8.",
    ),
    click.option(
        "--only",
        multiple=True,
        type=click.Choice(["gpu-mix", "dead-10", "churn", "equal"]),
        help="Run these scenarios (repeatable), keeping the others from --out's summary.json "
        "(a fresh --out holds only these).",
    ),
    click.option(
        "--keep-runs",
        is_flag=True,
        help="Keep each arm's run directory (its cells' metrics rows) under OUT/runs/.",
    ),
)


def pools(
    out: str,
    quick: bool,
    steps: int | None,
    convergence: bool,
    controls: bool,
    workers: int,
    report_only: bool,
    overrides: tuple[str, ...],
    only: tuple[str, ...],
    keep_runs: bool,
) -> str:
    """Stage pools against fixed wiring on process grids (emulated compute): a 4x8 GPU mix,
    4x8 with 10% of the cells dead, 4x4 under churn, 3x3 of equal peers; tokens/s against the
    capacity bounds (fixed, pools, pools whose cells rebalance)."""
    from mesh.bench import pools as study

    if controls:
        from mesh.bench.pools_convergence import run_controls

        run_controls(load_config([], []), Path(out))
        return (Path(out) / "controls.md").read_text()
    if convergence:
        from mesh.bench.pools_convergence import run_convergence

        run_convergence(load_config([], []), Path(out), workers)
        return (Path(out) / "convergence.md").read_text()
    if report_only:
        summary = study.report_only(Path(out))
    else:
        try:
            summary = study.run_study(Path(out), quick, steps, overrides, only, keep_runs)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
    text = (Path(out) / "table.md").read_text()
    if not all(t["met"] for t in summary["targets"].values()):
        text += "some targets missed (see above)\n"
    return text


SOAK_OPTIONS = (
    out_option("soak"),
    click.option(
        "--minutes",
        type=click.FloatRange(min=1.0),
        default=None,
        help="How long the grid trains (default 60; 3 with --quick); a peer is killed and "
        "replaced about every 10 minutes (at least once).",
    ),
    click.option("--quick", is_flag=True, help="3 minutes, one kill, a sample every 5 s."),
)


def soak(out: str, minutes: float | None, quick: bool) -> None:
    """A 2x2 hivemind grid of joins on wan100-shaped loopback links for an hour, one peer
    SIGKILLed and replaced every ~10 minutes: per peer RSS, descriptors, threads, asyncio tasks,
    mailbox depth and socket files over time; leftovers after the run; the loss by window."""
    from mesh.bench.soak import run_soak

    _grid_bench(lambda: run_soak(Path(out), minutes or (3.0 if quick else 60.0), quick), out)


SCALE_OPTIONS = (
    out_option("scale"),
    click.option(
        "--quick", is_flag=True, help="A 4x2 grid, one status call, a 20 s window (a smoke test)."
    ),
)


def scale(out: str, quick: bool) -> None:
    """32 joins (an 8x4 grid, emulated compute) over one bootstrap on 127.0.0.1: time until
    all train, `status` latency, DHT records and bytes per peer per minute, rounds complete."""
    from mesh.bench.scale import run_scale

    # too little memory: a user error, exit 2
    _grid_bench(lambda: run_scale(Path(out), quick), out)


def _grid_bench(run: Callable[[], dict[str, Any]], out: str) -> None:
    """A grid bench: exit 1 with one line when the grid failed (what it measured is written,
    the reason in error.txt); a line pointing at table.md when a target was missed."""
    try:
        summary = run()
    except RuntimeError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    if not summary["all_targets_met"]:
        click.echo(f"some targets missed: see {out}/table.md", err=True)
