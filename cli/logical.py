"""`meshtrain simulate --backend logical`: the whole grid in one process (mesh/engine/sim.py).

With --out its run directory is like the cell processes' (config.toml, a checkpoint of every
cell every checkpoint.every updates and at the end, summary.json), so export, generate
and the dashboard read it, and `--resume DIR` continues it: every cell from the newest step all
of them saved, with the simulator's own state saved beside each checkpoint (its rounds in
flight, sentinel statistics and counters: mesh/engine/sim_state.py), so a resumed run ends with
the weights and loss of an uninterrupted one. SIGTERM, SIGHUP and Ctrl-C stop it after the
update under way, every cell saved (a second Ctrl-C stops it at once, unsaved).

imports: click, cli (report, simulate's stop signals, reference and pool cells), mesh (config, data,
engine, runtime).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from cli.report import print_table, progress_bar
from cli.simulate import POOL_HEADERS, pool_cells, reference_cells
from mesh.config import Config
from mesh.data.corpus import ngram_ce
from mesh.data.ngram import beside_loss
from mesh.engine import sim_state
from mesh.engine.pools import PoolSim, make_sim
from mesh.engine.sim import GridSim
from mesh.runtime.checkpoint import (
    CheckpointError,
    checkpoint_path,
    load_cell,
    read_checkpoint,
    resume_point,
    save_cell,
    saved_steps,
)
from mesh.runtime.launch import Stopped, StopRequest


def simulate_logical(
    cfg: Config,
    out: Path | None,
    corpus: Any,
    resume: bool = False,
    stop: StopRequest | None = None,
) -> None:
    """Run (or with resume, continue) the grid to cfg.run.steps; the summary table at the end.
    A stop requested (stop.request, from a signal handler) ends it after the current update,
    every cell saved (with --out)."""
    sim = make_sim(cfg, corpus)
    start = 0
    if resume:
        assert out is not None, "a resume continues in its run directory"
        if isinstance(sim, PoolSim):
            # its cells end at different updates with microbatches queued between them, and
            # the pool simulator saves neither queue: an honest refusal, not a wrong restart
            raise CheckpointError(
                f"--resume {out}: a logical run with pipeline.routing = 'pools' does not "
                "resume (its cells stop at different updates with microbatches in flight); "
                "run it again with more --steps, or use --backend torch/hivemind, whose pooled "
                "cells resume"
            )
        start = load_grid(sim, cfg, out)
        if start >= cfg.run.steps:
            click.echo(
                f"nothing to do: the run is at step {start} of run.steps = {cfg.run.steps}; "
                f"extend it with --resume {out} --steps N"
            )
            return
    if out is not None:  # a run directory like the cell processes': export and generate read it
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.toml").write_text(cfg.to_toml())

    def on_step(step: int, loss: float) -> None:
        bar.goto(step, loss)
        every = cfg.checkpoint.every
        if out is not None and every and step % every == 0:
            save_grid(sim, cfg, out)
        if stop is not None and stop.signal_name is not None:
            if out is not None:
                save_grid(sim, cfg, out)
            stop.check()  # raises Stopped

    try:
        with progress_bar(cfg.run.steps, "simulate", initial=start) as bar:
            result = sim.run(on_step)
    except Stopped as e:
        where = f"every cell saved; continue with --resume {out}" if out else "nothing saved"
        click.echo(f"stopped ({e.signal_name}) at step {sim.update}: {where}")
        sys.exit(130 if e.signal_name == "SIGINT" else 0)
    except KeyboardInterrupt:  # a second Ctrl-C: at once, the update under way unsaved
        click.echo(
            f"interrupted at step {sim.update}: not saved since the last checkpoint", err=True
        )
        sys.exit(130)
    summary = {
        "config_fingerprint": cfg.fingerprint(),
        **result.__dict__,
        **beside_loss(result.val_loss, ngram_ce(sim.corpus)),  # the data's reference points
        **pool_counts(sim),
    }
    if out is not None:
        if result.val_loss is not None:  # a diverged run keeps its last finite checkpoint
            save_grid(sim, cfg, out)
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    headers = [
        "grid",
        "steps",
        "tokens",
        "val loss",
        "val bits/byte",
        "data unigram/bigram",
        "loss/bigram",
        "pp B/replica/step",
        "dp B/replica/step",
        "wall s",
        *(POOL_HEADERS if "pools" in summary else []),
    ]
    print_table(
        headers,
        [
            [
                result.grid,
                result.steps,
                result.tokens,
                "diverged" if result.val_loss is None else f"{result.val_loss:.4f}",
                "n/a" if result.val_bpb is None else f"{result.val_bpb:.4f}",
                *reference_cells(summary),
                f"{result.pp_bytes_per_replica_step:,.0f}",
                f"{result.dp_bytes_per_replica_step:,.0f}",
                f"{result.wall_s:.1f}",
                *pool_cells(summary),
            ]
        ],
    )
    for line in stalled_note(summary):
        click.echo(line)


def pool_counts(sim: GridSim) -> dict[str, Any]:
    """What the pool engine counted (mesh/engine/pools.py; {} for the fixed grid's GridSim):
    "pools" with stage pools (microbatches sent on from one stage to the next, of them to
    another replica's cell, and voided: a stage had no live cell), and each replica's updates
    where emulation.deaths stalled a fixed one."""
    if not isinstance(sim, PoolSim):
        return {}
    if sim.cfg.pipeline.pooled:
        routed = sim.streamed * (sim.P - 1)
        return {
            "pools": {"routed": routed, "cross_replica": sim.cross_replica, "voided": sim.voided}
        }
    return {"replica_updates": [sim.routed[(0, i)] for i in range(sim.m)]}


def stalled_note(summary: dict) -> list[str]:
    """The line under a fixed grid's table whose replicas emulation.deaths stalled ([]: none
    was): each one's updates, and what the validation loss holds of it."""
    done, steps = summary.get("replica_updates"), summary["steps"]
    short = [f"replica {i} trained {n} of {steps}" for i, n in enumerate(done or []) if n < steps]
    if not short:
        return []
    return [
        f"emulation.deaths stalled replicas ({', '.join(short)} updates: a fixed replica waits "
        "while a cell of it is dead); the validation loss averages every replica's weights as "
        "they stand, a stalled one's included"
    ]


def save_grid(sim: GridSim, cfg: Config, out: Path) -> None:
    """Every cell of a logical run, checkpointed as a cell process saves itself (one file per
    cell and step, atomically), with the simulator's state of the cell beside it: export,
    generate and the dashboard read either the same way, and a resume continues exactly."""
    fingerprint = cfg.state_fingerprint()
    for replica in sim.cells:
        for cell in replica:  # (the end's save after one at the interval: the same file)
            saved = checkpoint_path(out, cell.stage, cell.replica, cell.step).is_file()
            if cell.step > 0 and not saved:
                extra = {sim_state.KEY: sim_state.cell_extras(sim, cell)}
                save_cell(cell, fingerprint, out, extra)


def load_grid(sim: GridSim, cfg: Config, run_dir: Path) -> int:
    """Every cell from the newest step all of them have an intact checkpoint of, and the
    simulator's state saved with it; returns that step. A process run's checkpoints (no
    simulator state) resume too, without rounds in flight and with fresh sentinel statistics
    (as a cell process resumes), said in one line. Checkpoints past the step (of a life this
    resume abandons) go."""
    from mesh.runtime.launch import drop_abandoned

    cells = [(c.stage, c.replica) for row in sim.cells for c in row]
    point = resume_point(run_dir, cells, cfg.state_fingerprint())
    if point.foreign or point.step is None:
        raise CheckpointError(
            f"--resume {run_dir}: no step that every cell has an intact checkpoint of "
            "written by this config"
        )
    step = point.step
    extras = {}
    for row in sim.cells:
        for cell in row:
            path = checkpoint_path(run_dir, cell.stage, cell.replica, step)
            load_cell(cell, cfg.state_fingerprint(), path)
            extras[(cell.stage, cell.replica)] = read_checkpoint(path).state.get(sim_state.KEY)
    if all(e is None for e in extras.values()):
        click.echo(
            f"resuming from step {step} of a process run's checkpoints: without its averaging "
            "rounds in flight and with fresh sentinel statistics (a process run's cells keep "
            "neither)",
            err=True,
        )
        sim.update = step
    else:
        try:
            sim_state.restore(sim, extras)
        except ValueError as e:
            raise CheckpointError(f"--resume {run_dir}: step {step}: {e}") from None
    drop_abandoned(run_dir, dict.fromkeys(cells, step))
    return step


def is_logical_run(run_dir: Path) -> bool:
    """Whether a run directory's checkpoints were written by the logical backend (they hold
    the simulator's state): `--resume` then continues it on that backend."""
    for cell_dir in sorted((run_dir / "checkpoints").glob("*-*")):
        stage, _, replica = cell_dir.name.partition("-")
        if not (stage.isdigit() and replica.isdigit()):
            continue
        steps = saved_steps(run_dir, int(stage), int(replica))
        if steps:
            try:
                state = read_checkpoint(
                    checkpoint_path(run_dir, int(stage), int(replica), steps[-1])
                )
            except CheckpointError:
                continue
            return isinstance(state.state, dict) and sim_state.KEY in state.state
    return False
