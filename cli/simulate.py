"""`meshtrain simulate --backend torch|hivemind`: every cell its own process on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import click

from cli.preflight import check_data, check_machine, check_resume
from cli.report import progress_bar
from mesh.algo.topology import cell_name
from mesh.config import Config, ConfigError, with_overrides
from mesh.report import format_table, plot_curves
from mesh.runtime.emulate import resolve_window
from mesh.runtime.evaluate import ValTracker, read_val, tokens_at
from mesh.runtime.launch import GridRun, StopRequest, grid_cells, run_grid
from mesh.runtime.metrics import metrics_offsets, read_metrics, summarize_run
from mesh.runtime.run_lock import run_lock


def simulate_processes(
    cfg: Config,
    backend: str,
    out: Path | None,
    resume: bool = False,
    verify_data: bool = False,
    check_resources: bool = True,
) -> None:
    """Check everything a cell would trip over, then run the grid as processes; one line and
    exit 2 for a user error (here or in a cell), the summary table otherwise.
    check_resources: refuse a grid this machine cannot hold (cli/resources.py)."""
    cfg = with_overrides(cfg, {"transport.backend": backend})
    # resolved here, so a --resume runs the same schedule (and fingerprint): the in-flight window
    # and the lr / lambda horizon (a resume that extends run.steps keeps the one it started with)
    cfg = resolve_window(cfg)
    if cfg.run.schedule_steps is None:
        cfg = with_overrides(cfg, {"run.schedule_steps": cfg.run.steps})
    corpus = None if cfg.emulation.compute == "emulated" else check_data(cfg, verify_data)
    check_machine(cfg)
    if check_resources:
        from cli.resources import check_simulate

        check_simulate(cfg, grid_cells(cfg))
    out = out or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    created = not out.exists()
    if (out / "metrics").exists() and not resume:
        raise ConfigError(f"--out {out} already holds a run; pick another or pass --resume {out}")
    try:
        # held from before anything reads the directory: a live grid there is refused, not
        # joined by a second one; a dead one's lock is taken over
        with run_lock(out):
            _simulate_in(cfg, out, resume, created, corpus)
    finally:
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # refused before anything ran: no empty directory left behind


def _simulate_in(cfg: Config, out: Path, resume: bool, created: bool, corpus: object) -> None:
    """simulate_processes, the run directory's lock held."""
    start_step, point = 0, None
    if resume:
        point = check_resume(cfg, out)
        for note in point.notes:
            click.echo(note, err=True)
        start_step = point.step
        if start_step >= cfg.run.steps:
            click.echo(
                f"nothing to do: the run is at step {start_step} of run.steps = {cfg.run.steps}; "
                f"extend it with --resume {out} --steps N"
            )
            return
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "config.toml", cfg.to_toml())  # only now: every check passed
    val = ValTracker(cfg, out, corpus, start_step) if corpus is not None else None
    if val is not None and not (out / "val.jsonl").exists():  # a fresh run (or none got far)
        val.start()
    segment = metrics_offsets(out)  # a resume appends: its rates are of what it appends
    title = f"simulate {cfg.grid.stages}x{cfg.grid.replicas}"
    evaluating = val.background() if val is not None else contextlib.nullcontext()
    with progress_bar(cfg.run.steps, title, initial=start_step) as bar:
        # validation runs beside the watch loop, never in it: the bar moves while it runs;
        # Ctrl-C is a stop like SIGTERM (every cell saved; a second one stops at once)
        with stop_signals(ctrl_c=True) as stop, evaluating:
            run = run_grid(
                cfg,
                out,
                resume=resume,
                on_progress=bar.goto,
                on_notice=bar.note,
                replica_steps=point.replica_steps if point is not None else None,
                stop=stop,
                cell_steps=point.cell_steps if point is not None else None,
            )
        if run.ok:
            bar.goto(cfg.run.steps)
    if not run.ok and not run.interrupted:
        _report_failure(run, out, created)
    if val is not None:
        val.poll(final=True)
    summary = summarize_run(cfg, out, run.wall_s, start_step, segment)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_run(cfg, out)
    notes = [ROUNDS_NOTE.format(tau=cfg.dp.tau), *left_out_note(summary)]
    if point is not None and len({s or 0 for s in point.replica_steps.values()}) > 1:
        notes.append(resumed_apart_note(point.replica_steps))
    if cfg.emulation.compute == "emulated":
        notes.append(EMULATED_NOTE)
    table = "\n".join([format_table(*summary_table(summary)), *notes])
    (out / "table.md").write_text(table + "\n")
    click.echo(table)
    if run.restarts:
        click.echo(f"restarts ({len(run.restarts)}): " + "; ".join(run.restarts))
    if run.interrupted:  # a stop (SIGTERM, SIGHUP, Ctrl-C): every cell saved
        _say_stopped(run, out)
    click.echo(f"run directory: {out}")


def _say_stopped(run: GridRun, out: Path) -> NoReturn:
    """What a stopped run says under its summary: where each replica stopped (a stop on torch
    runs a replica's cells to one step) and how to continue; exit 130 after Ctrl-C, else 0."""
    if run.stop_steps:
        where = ", ".join(f"replica {i} at step {s}" for i, s in run.stop_steps.items())
        click.echo(f"each replica's cells finished their update and saved one step: {where}")
    how = run.stopped_by or "interrupted"
    click.echo(f"stopped ({how}): every cell saved; continue with --resume {out}")
    sys.exit(130 if how in ("SIGINT", "interrupted") else 0)


def resumed_apart_note(steps: dict[int, int | None]) -> str:
    """The line under the table of a run whose replicas resumed from different steps."""
    where = ", ".join(f"replica {i} from step {s or 0}" for i, s in steps.items())
    return (
        f"replicas resumed from different steps ({where}: each from the newest step all its "
        "cells saved): the trailing replica's round clock jumps to the leader's round "
        "(rounds_jumped) and the leader leaves launches out until they meet (rounds_skipped); "
        "rounds around the jump fail or arrive late"
    )


@contextlib.contextmanager
def stop_signals(ctrl_c: bool = False) -> Iterator[StopRequest]:
    """SIGTERM and SIGHUP request a stop while the grid runs: run_grid stops and saves every
    cell and reaps them, as on Ctrl-C (a launcher that died of the signal would leave its
    cells training on, orphaned). ctrl_c: SIGINT requests one too (the logical backend, whose
    update under way must end before its cells are saved); a second Ctrl-C then interrupts."""
    stop, launcher = StopRequest(), os.getpid()

    def handler(signum: int, frame: object) -> None:
        if os.getpid() != launcher:  # a forked child (the bootstrap DHT): the signal's default
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if signum == signal.SIGINT and stop.signal_name is not None:
            raise KeyboardInterrupt  # asked twice: stop now, unsaved
        stop.request(signal.Signals(signum).name)

    signals = (signal.SIGTERM, signal.SIGHUP) + ((signal.SIGINT,) if ctrl_c else ())
    old = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield stop
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


ROUNDS_NOTE = (
    "rounds: started = applied + failed + in flight at the end (launched in the last "
    "dp.tau = {tau} updates, or due but not yet complete, when the cells stopped)"
)


# under the table of an emulated-compute run, whose loss would otherwise pass for a result
EMULATED_NOTE = (
    "compute was emulated (emulation.compute = emulated): no model math ran, so the loss is "
    "the untrained model's"
)


def summary_table(summary: dict) -> tuple[list[str], list[list[str]]]:
    headers = [
        "grid",
        "steps",
        "tokens",
        "tokens/s",
        "of ideal",
        "val loss",
        "val bits/byte",
        "data unigram/bigram",
        "loss/bigram",
        "pp B/replica/step",
        "dp B/replica/step",
        "rounds started/applied/failed/in flight",
        "rejects",
        *(POOL_HEADERS if "pools" in summary else []),
    ]
    r = summary["rounds"]
    in_flight = r["rounds_started"] - r["rounds_applied"] - r["rounds_failed"]
    rounds = f"{r['rounds_started']}/{r['rounds_applied']}/{r['rounds_failed']}/{in_flight}"
    row = [
        summary["grid"],
        summary["steps"],
        summary["tokens"],
        f"{summary['tokens_per_s']:,.0f}",
        _fmt_fraction(summary.get("fraction_of_ideal")),
        f"{summary['val_loss']:.4f}" if summary.get("val_loss") is not None else "n/a",
        f"{summary['val_bpb']:.4f}" if summary.get("val_bpb") is not None else "n/a",
        *reference_cells(summary),
        f"{summary['bytes']['pp_per_replica_step']:,.0f}",
        f"{summary['bytes']['dp_per_replica_step']:,.0f}",
        rounds,
        rejects_cell(summary),
        *pool_cells(summary),
    ]
    return headers, [[str(c) for c in row]]


# stage pools (summary["pools"], every life of every cell): microbatches sent on from one stage
# to the next and of them to another replica's cell; refusals of full cells and microbatches
# sent again elsewhere; microbatches given up (no live cell took them)
POOL_HEADERS = ["pool routed/across replicas", "pool refused/rerouted", "pool voided"]


def pool_cells(summary: dict) -> list[str]:
    """POOL_HEADERS' cells ([] without stage pools); the simulator, whose cells hold no
    window, refuses and reroutes nothing: n/a."""
    p = summary.get("pools")
    if p is None:
        return []
    refused = f"{p['refused']}/{p['rerouted']}" if "refused" in p else "n/a"
    return [f"{p['routed']}/{p['cross_replica']}", refused, str(p["voided"])]


def left_out_note(summary: dict) -> list[str]:
    """The line under the table that says which replicas the counts leave out, and why ([]:
    none): a replica that never ran (fixed wiring, a cell dead from the start) is in neither
    the tokens nor the validation loss; one that saved no checkpoint, or whose chain lacks a
    pooled cell that never ran, is not in the validation loss."""
    said = {"tokens": "the tokens", "val_loss": "the validation loss"}
    parts = [
        f"replica {d['replica']} left out of "
        + " and ".join(said[k] for k in d["left_out_of"])
        + f" ({d['why']})"
        for d in summary.get("replicas_left_out") or []
    ]
    return ["; ".join(parts)] if parts else []


def rejects_cell(summary: dict) -> str:
    """Messages refused, with the reasons: "83 (late 83)" (docs/faults-and-trust.md)."""
    reasons = summary.get("rejects_by_reason") or {}
    top = sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))
    return f"{summary.get('rejects', 0)}" + (
        " (" + ", ".join(f"{k} {n}" for k, n in top) + ")" if top else ""
    )


def reference_cells(summary: dict) -> list[str]:
    """The data's unigram and bigram cross-entropy (nats/token) and the loss's ratio to the
    bigram's, for a table beside the validation loss ("n/a" for emulated compute)."""
    if summary.get("data_bigram_ce") is None:
        return ["n/a", "n/a"]
    ratio = summary.get("val_loss_to_bigram")
    return [
        f"{summary['data_unigram_ce']:.3f}/{summary['data_bigram_ce']:.3f}",
        "n/a" if ratio is None else f"{ratio:.2f}",
    ]


def _report_failure(run: GridRun, out: Path, created: bool) -> NoReturn:
    """One line for the user (the report of a bug, its traceback, follows it); a directory this
    command made and nothing was saved into is removed again, except after a full disk: the
    run resumes from its config once there is room, and the next line says how."""
    f = run.failure
    if run.interrupted or f is None:
        codes = {cell_name(j, i): c for (j, i), c in run.exit_codes.items() if c != 0}
        click.echo(
            f"stopped: {'interrupted' if run.interrupted else codes}; run directory {out}",
            err=True,
        )
        sys.exit(130 if run.interrupted else 1)
    if f.exit_code == 2:
        click.echo(f"error: cell {f.cell}: {f.message}", err=True)
    else:
        if f.log is not None:  # the traceback of a bug
            click.echo(f.log.read_text().split("\n", 1)[-1].rstrip(), err=True)
        click.echo(f"error: cell {f.cell} failed: {f.message}", err=True)
    if f.exit_code == 2 and NO_SPACE in f.message:  # kept: it resumes once there is room
        free = shutil.disk_usage(out).free / 2**20
        click.echo(
            f"the run directory is kept: free some space on the disk that holds {out} "
            f"({free:,.1f} MiB free now), then continue with: meshtrain simulate --resume {out}",
            err=True,
        )
    elif created and not any((out / "checkpoints").glob("*/step-*.pt")):
        shutil.rmtree(out, ignore_errors=True)
    elif f.log is not None:
        click.echo(f"(the cell's report: {f.log})", err=True)
    sys.exit(2 if f.exit_code == 2 else 1)


NO_SPACE = "no space left on device"  # mesh.errors.disk_full's message


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def plot_run(cfg: Config, out: Path) -> None:
    """DIR/loss.png: each replica's training loss (its last stage's microbatches) and its
    validation loss (DIR/val.jsonl) against the tokens the whole grid has seen."""
    rows = read_metrics(out)
    last = cfg.grid.stages - 1
    curves: dict[str, list[tuple[float, float]]] = {}
    styles: dict[str, dict] = {}
    for i in range(cfg.grid.replicas):
        train = [r for r in rows.get((last, i), []) if r.get("loss") is not None]
        curves[f"replica {i} train"] = [(tokens_at(cfg, r["step"]), r["loss"]) for r in train]
        styles[f"replica {i} train"] = {"alpha": 0.45, "linewidth": 0.8, "color": f"C{i}"}
        val = [(r["tokens"], r["val_loss"]) for r in read_val(out) if r["replica"] == i]
        curves[f"replica {i} validation"] = val
        styles[f"replica {i} validation"] = {"marker": "o", "linewidth": 2, "color": f"C{i}"}
    title = (
        f"{cfg.grid.stages}x{cfg.grid.replicas} {cfg.pipeline.schedule}, {cfg.transport.backend}"
    )
    plot_curves(
        curves, out / "loss.png", "tokens (all replicas)", "loss (nats/token)", title, styles=styles
    )


def _fmt_fraction(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"
