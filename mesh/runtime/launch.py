"""Spawn, watch and reap the local peer processes of a grid (simulate and the tests use it).

Each cell is its own process running `mesh.runtime.trainer.run_cell`, forked from a fork
server that imported torch once (`cell_context`; no state leaks from the parent). The parent
holds the rendezvous for the whole run (the TCP store, which outlives every cell, or a
bootstrap DHT), draws one progress bar from the cells' metrics files, on torch starts a dead
cell's replica again (run_grid), and on an error terminates every child (SIGTERM, then SIGKILL
after a grace period) and reaps them all. A stop (SIGTERM, SIGHUP, Ctrl-C) on torch first runs
each replica's cells to one step (mesh/runtime/grid_stop.py), so that they save the same one.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.forkserver
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from comms.build import Meeting, local_rendezvous
from mesh.algo.topology import cell_name
from mesh.config import Config
from mesh.runtime.checkpoint import (
    CheckpointError,
    checkpoint_path,
    resume_point,
    saved_steps,
)
from mesh.runtime.child_stop import sigterm_ignored, stop_all
from mesh.runtime.emulate import resolve_window
from mesh.runtime.failure import LOST_NEIGHBOUR, failure_report
from mesh.runtime.grid_stop import one_step_stop, stop_grid_at_one_step
from mesh.runtime.metrics import RowTail
from mesh.runtime.stacks import keep_stacks
from mesh.runtime.stop import STOP, stop_file
from mesh.runtime.trainer import cell_process_main
from mesh.runtime.wiring import grid_of


@dataclass
class GridRun:
    exit_codes: dict[tuple[int, int], int | None]
    wall_s: float
    interrupted: bool
    failure: CellFailure | None = None  # the first cell that failed on its own, if any
    restarts: list[str] = field(default_factory=list)  # what died and was restarted, in order
    stopped_by: str | None = None  # the signal that stopped the launcher (SIGTERM, SIGHUP)
    stop_steps: dict[int, int] | None = None  # each replica's step a stop ran its cells to
    left: list[str] = field(default_factory=list)  # pools: dead cells the grid trained on without

    @property
    def ok(self) -> bool:
        codes = [c for cell, c in self.exit_codes.items() if cell_name(*cell) not in self.left]
        return not self.interrupted and all(c == 0 for c in codes)


@dataclass(frozen=True)
class CellFailure:
    cell: str  # "s1r0"
    exit_code: int  # 2: a user error (message says the fix); else a bug or a crash
    message: str  # one line
    log: Path | None  # the cell's whole report (traceback for a bug)


class LocalGrid:
    """The cells of one grid as local processes: start, signal, restart, stop and reap them."""

    def __init__(
        self,
        cfg: Config,
        out_dir: Path,
        meeting: Meeting,
        targets: dict[tuple[int, int], Callable[..., None]] | None = None,
    ) -> None:
        self.out_dir, self.meeting = out_dir, meeting
        self.targets = targets or {}  # a cell's process main in place of the real one (start)
        # pipeline.window = "auto": sized once here, so every cell runs the same schedule
        self.tree = resolve_window(cfg).model_dump(mode="json")
        self.procs: dict[tuple[int, int], Any] = {}
        self.left: set[tuple[int, int]] = set()  # pools: dead cells not started again
        # each cell's current life: the step it started from, its metrics file's size then
        self.lives: dict[tuple[int, int], tuple[int, int]] = {}
        # cells killed after outliving a stop: their threads' stacks (mesh/runtime/stacks.py)
        self.stuck: dict[tuple[int, int], Path] = {}
        self._ctx = cell_context()

    def start(
        self,
        cell: tuple[int, int],
        resume_step: int | None = None,
        target: Callable[..., None] | None = None,
    ) -> None:
        """Start (or restart) a cell; resume_step -1: from its own latest checkpoint. target:
        the process's main (run_cell's arguments; default: the grid's `targets`, else the real
        cell), e.g. a misbehaving peer in a test; it must install its own SIGTERM handler
        (run_cell does), since it starts with SIGTERM ignored."""
        target = target or self.targets.get(cell, cell_process_main)
        j, i = cell
        metrics = self.out_dir / "metrics" / f"{j}-{i}.jsonl"
        size = metrics.stat().st_size if metrics.exists() else 0
        self.lives[cell] = (max(resume_step or 0, 0), size)
        p = self._ctx.Process(
            target=launched_cell,
            args=(target, self.tree, j, i, str(self.out_dir), self.meeting, resume_step),
            name=f"cell-{cell_name(j, i)}",
        )
        with sigterm_ignored():
            p.start()
        self.procs[cell] = p

    def running_lives(self) -> dict[tuple[int, int], tuple[int, int, int]]:
        """The running cells: (pid, the step its life started from, its metrics file's size
        then)."""
        return {c: (p.pid, *self.lives[c]) for c, p in self.procs.items() if p.is_alive()}

    def pid(self, cell: tuple[int, int]) -> int:
        return self.procs[cell].pid

    def running(self) -> bool:
        return any(p.is_alive() for p in self.procs.values())

    def exit_codes(self) -> dict[tuple[int, int], int | None]:
        return {k: p.exitcode for k, p in self.procs.items()}

    def first_failure(self) -> CellFailure | None:
        """The cell that failed first on its own (exit code > 0), from the report it wrote."""
        failed = [c for c, p in self.procs.items() if p.exitcode in (1, 2)]
        if not failed:
            return None
        reports = {c: failure_report(self.out_dir, *c) for c in failed}
        cell = min(failed, key=lambda c: reports[c][0])
        when, message, log = reports[cell]
        code = self.procs[cell].exitcode or 1
        return CellFailure(cell_name(*cell), code, message, log)

    def dead(self) -> list[tuple[tuple[int, int], int]]:
        """Cells that died (a signal we did not send, e.g. SIGKILL or the OOM killer) or left
        because a neighbour died (LOST_NEIGHBOUR): (cell, exit code), the signalled first."""
        out = [
            (c, p.exitcode)
            for c, p in self.procs.items()
            if p.exitcode is not None
            and (p.exitcode < 0 or p.exitcode == LOST_NEIGHBOUR)
            and c not in self.left
        ]
        return sorted(out, key=lambda x: x[1] >= 0)

    def stop(self, grace_s: float = 5.0, cells: list[tuple[int, int]] | None = None) -> None:
        """Stop these cells (default: all) cleanly; one still running after grace_s is asked
        for its threads' stacks and killed, and its stacks kept (`stuck`)."""
        procs = {c: self.procs[c] for c in (self.procs if cells is None else cells)}
        running = {c: p.pid for c, p in procs.items() if p.is_alive()}
        stop_all(list(procs.values()), grace_s)
        for cell, pid in running.items():
            if procs[cell].exitcode == -signal.SIGKILL:
                path = keep_stacks(self.out_dir, *cell, pid)
                if path is not None:
                    self.stuck[cell] = path


# What the fork server imports once, before it forks any cell: a spawned cell spent ~2 s of CPU
# importing them. None starts a Python thread or opens a file; the native threads of numpy's and
# scipy's OpenBLAS are stopped and restarted around a fork (pthread_atfork).
CELL_PRELOAD = ["torch", "mesh.runtime.trainer", "comms.torchdist.transport", "comms.p2p.transport"]


def launched_cell(target: Callable[..., None], *args: Any) -> None:
    """A launcher's cell process: `target(*args)` ignoring the terminal's Ctrl-C, which reaches
    the whole process group: the launcher handles it and stops its cells at one step."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    STOP.ctrl_c = False  # run_cell's handler ignores it too
    target(*args)


def cell_context() -> multiprocessing.context.ForkServerContext:
    """The cells' start method: "forkserver", one server process per launcher (started on the
    first call, in the main thread with SIGTERM ignored, a disposition every cell inherits:
    see child_stop.sigterm_ignored). Each cell is a fork of it, then prepared as a spawned
    process is (the launcher's working directory, sys.path and __main__). Its parent is the
    server, not the launcher: a cell watches the launcher itself
    (mesh.runtime.stop.watch_parent)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(CELL_PRELOAD)
    with sigterm_ignored():
        multiprocessing.forkserver.ensure_running()
    return ctx


def grid_cells(cfg: Config) -> list[tuple[int, int]]:
    """(stage, replica) of every cell, replica-major (the launch order), less the cells
    emulation.deaths takes out from the start (wiring.grid_of)."""
    g, gone = cfg.grid, grid_of(cfg).absent
    return [(j, i) for i in range(g.replicas) for j in range(g.stages) if (j, i) not in gone]


def run_grid(
    cfg: Config,
    out_dir: Path,
    resume: bool = False,
    on_progress: Callable[[int, float | None], None] | None = None,
    timeout_s: float | None = None,
    grace_s: float = 5.0,
    resume_step: int | None = None,
    on_notice: Callable[[str], None] | None = None,
    replica_steps: dict[int, int | None] | None = None,
    stop: StopRequest | None = None,
    cell_steps: dict[tuple[int, int], int | None] | None = None,
    targets: dict[tuple[int, int], Callable[..., None]] | None = None,
) -> GridRun:
    """Run every cell to cfg.run.steps; returns exit codes (None: killed by us).

    resume: every cell restarts from `resume_step`, or from its own step in `cell_steps`, or
    its replica's in `replica_steps` (None: from the start), or (all None) from the newest step
    that every cell has an intact checkpoint of (mesh.runtime.checkpoint.resume_point).
    Checkpoints past a cell's start
    are of a life the resume abandons, and go (drop_abandoned).
    A cell that fails on its own (it raised: exit code 1 or 2) stops the grid at once (every
    cell saves): GridRun.failure names it and says why. A cell that DIES (a signal: killed,
    out of memory) on torch.distributed: its replica alone starts again, in place: its other
    cells (which leave with LOST_NEIGHBOUR once a neighbour is gone, or are stopped here) are
    stopped and every cell of the replica restarts from the newest step all of them saved;
    the other replicas train on untouched (same processes; the links re-form with the new
    processes: comms/torchdist/pairs.py). Up to elastic.max_restarts times a run, each said
    through on_notice with the replica and its step; past that the grid stops, saved:
    GridRun.failure says so, and `--resume` continues. On hivemind the others ride it out
    (its replica waits up to elastic.rejoin_timeout_s for a replacement: a restart or a
    `join`).
    A stop (`stop` requested by a launcher's signal handler) on a fixed torch grid runs each
    replica's cells to one step (GridRun.stop_steps), where they end and save; on hivemind, or
    on KeyboardInterrupt (a second Ctrl-C), every cell saves where it is. GridRun.interrupted,
    GridRun.stopped_by names the signal.
    targets: a cell's process main in place of the real one (LocalGrid.start; a test's
    misbehaving peer).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    stop_file(out_dir).unlink(missing_ok=True)  # an earlier life's stop is not this one's
    if resume and resume_step is None and replica_steps is None and cell_steps is None:
        point = resume_point(out_dir, grid_cells(cfg), cfg.state_fingerprint())
        if point.step is None:
            raise CheckpointError(f"{out_dir}: no step that every cell has a checkpoint of")
        resume_step = point.step
    notice = on_notice or (lambda line: None)
    start = time.perf_counter()
    steps: dict[tuple[int, int], int | None] = dict.fromkeys(grid_cells(cfg), resume_step)
    if resume and replica_steps is not None:
        steps = {(j, i): replica_steps[i] for j, i in grid_cells(cfg)}
    if resume and cell_steps is not None:
        steps = {c: cell_steps.get(c) for c in grid_cells(cfg)}
    if resume:
        drop_abandoned(out_dir, steps)
    resume_step = min((s for s in steps.values() if s is not None), default=None)
    restarts: list[str] = []
    tail = MetricsTail(out_dir, cfg.grid.stages - 1, resume_step or 0)
    grid: LocalGrid | None = None
    try:
        with local_rendezvous(cfg.transport.backend, cfg.transport.host) as meeting:
            grid = LocalGrid(cfg, out_dir, meeting, targets)
            outcome = _watch(
                cfg,
                grid,
                steps,
                tail,
                on_progress,
                start,
                timeout_s,
                grace_s,
                restarts,
                notice,
                stop,
            )
    except KeyboardInterrupt:  # outside the watch (no cell running): a stop all the same
        outcome = _Outcome(interrupted=True)
    except Stopped as e:
        outcome = _Outcome(interrupted=True, stopped_by=e.signal_name)
    return GridRun(
        grid.exit_codes() if grid is not None else {},
        time.perf_counter() - start,
        outcome.interrupted,
        outcome.failure,
        restarts,
        outcome.stopped_by,
        outcome.stop_steps,
        left=[cell_name(*c) for c in sorted(grid.left)] if grid is not None else [],
    )


@dataclass
class _Outcome:
    interrupted: bool = False
    failure: CellFailure | None = None
    stopped_by: str | None = None
    stop_steps: dict[int, int] | None = None


class Stopped(Exception):  # noqa: N818 - a stop, not an error
    """A stop a launcher's signal handler asked for (StopRequest): run_grid stops and saves
    every cell as on Ctrl-C."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


class StopRequest:
    """Set by a signal handler (SIGTERM, SIGHUP), read by run_grid's watch loop, which
    raises Stopped there: a handler that raised would do so inside whatever the main thread
    runs at that moment (an event loop's callback swallows it, and the stop is lost)."""

    def __init__(self) -> None:
        self.signal_name: str | None = None

    def request(self, signal_name: str) -> None:
        self.signal_name = self.signal_name or signal_name

    def check(self) -> None:
        if self.signal_name is not None:
            raise Stopped(self.signal_name)


def _watch(
    cfg: Config,
    grid: LocalGrid,
    steps: dict[tuple[int, int], int | None],
    tail: MetricsTail,
    on_progress: Callable[[int, float | None], None] | None,
    start: float,
    timeout_s: float | None,
    grace_s: float,
    restarts: list[str],
    notice: Callable[[str], None],
    stop: StopRequest | None = None,
) -> _Outcome:
    """Start the cells, watch them until they are all done, restart a dead cell's replica
    (see run_grid)."""
    out = _Outcome()
    try:
        for cell in grid_cells(cfg):
            grid.start(cell, steps[cell])
        last_step = -1
        while True:
            if timeout_s is not None and time.perf_counter() - start > timeout_s:
                raise TimeoutError(f"grid did not finish within {timeout_s} s")
            time.sleep(0.2)
            if stop is not None:
                stop.check()
            out.failure = grid.first_failure()
            if out.failure is not None:
                break
            dead = grid.dead() if cfg.transport.backend == "torch" else []
            if dead:
                cell, code = dead[0]
                what = f"cell {cell_name(*cell)} died ({_death(code)})"
                pooled = cfg.pipeline.pooled
                if pooled and run_over_around(cell, grid.exit_codes(), grid.left):
                    grid.left.add(cell)  # started again, it would wait for links to nobody
                    notice(f"{what} after every other cell finished; not started again")
                    continue
                if len(restarts) >= cfg.elastic.max_restarts and pooled:
                    grid.left.add(cell)  # a pool trains on without it
                    notice(
                        f"{what}; past elastic.max_restarts = {cfg.elastic.max_restarts} it "
                        "stays out, the pools training on without it"
                    )
                    continue
                if len(restarts) >= cfg.elastic.max_restarts:
                    out.failure = CellFailure(
                        cell_name(*cell),
                        LOST_NEIGHBOUR,
                        f"died ({_death(code)}) after {len(restarts)} restarts "
                        f"(elastic.max_restarts = {cfg.elastic.max_restarts}); every cell saved: "
                        "resume the run to go on",
                        None,
                    )
                    break
                restarts.append(what)
                n = f"restart {len(restarts)} of {cfg.elastic.max_restarts}"
                if cfg.pipeline.pooled:  # its stage's pool routes around it meanwhile
                    grid.start(cell, -1)  # from its own newest checkpoint
                    notice(
                        f"{what}; it starts again from its own checkpoint, the pools "
                        f"training on, {n}"
                    )
                    continue
                at = restart_replica(cfg, grid, cell[1], grace_s)
                notice(f"{what}; replica {cell[1]} starts again from step {at or 0}, {n}")
                continue
            if not grid.running():
                break
            if on_progress:
                step, loss = tail.progress()
                if step != last_step:
                    on_progress(step, loss)
                    last_step = step
        out.failure = out.failure or grid.first_failure()
    except KeyboardInterrupt:
        out.interrupted = True
    except Stopped as e:
        out.interrupted, out.stopped_by = True, e.signal_name
        if one_step_stop(cfg):
            with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C again: at once, below
                out.stop_steps = stop_grid_at_one_step(cfg, grid, notice)
    finally:
        grid.stop(grace_s)  # what is still running (after a one-step stop: nothing)
        stop_file(grid.out_dir).unlink(missing_ok=True)
        for cell, path in grid.stuck.items():
            notice(
                f"cell {cell_name(*cell)} did not stop within {grace_s:.0f} s and was killed; "
                f"what its threads were doing: {path}"
            )
    return out


def run_over_around(
    cell: tuple[int, int],
    exit_codes: dict[tuple[int, int], int | None],
    left: set[tuple[int, int]],
) -> bool:
    """Whether a pooled grid's run is over around a dead cell: no other cell is running and one
    at least finished (exit 0). Started again, the cell would have nobody to open its links with,
    and would time out and die again for as long as the launcher restarts it. (Cells that died
    with it are over too: they are not running; a grid whose every cell died at once, none having
    finished, is started again.)"""
    others = {c: code for c, code in exit_codes.items() if c != cell and c not in left}
    running = any(code is None for code in others.values())
    return not running and any(code == 0 for code in others.values())


def restart_replica(cfg: Config, grid: LocalGrid, replica: int, grace_s: float) -> int | None:
    """Stop what is left of a replica (each cell saves; those saves are past the cut and go),
    and start all its cells again from the newest step every one of them saved (None: from
    the start). Returns that step."""
    cells = [(j, replica) for j in range(cfg.grid.stages)]
    grid.stop(grace_s, cells)
    step = resume_point(grid.out_dir, cells, cfg.state_fingerprint()).step
    drop_abandoned(grid.out_dir, dict.fromkeys(cells, step))
    for cell in cells:
        grid.start(cell, step)
    return step


def _death(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return signal.Signals(-code).name
    return "lost a neighbour" if code == LOST_NEIGHBOUR else f"exit {code}"


def drop_abandoned(out_dir: Path, steps: dict[tuple[int, int], int | None]) -> None:
    """Remove each cell's checkpoints past the step it starts from (None: all of them): they
    are of the life a restart or resume abandons, and a later resume must not pick one of
    them beside a cell of the new life."""
    for cell, start in steps.items():
        for step in saved_steps(out_dir, *cell):
            if start is None or step > start:
                checkpoint_path(out_dir, *cell, step).unlink(missing_ok=True)


class MetricsTail:
    """Progress from the cells' metrics files, reading only what was appended since the grid
    started (a resumed run's files still hold the old run's rows, which must not count)."""

    def __init__(self, out_dir: Path, last_stage: int, start_step: int) -> None:
        self.dir, self.last_stage, self.start_step = out_dir / "metrics", last_stage, start_step
        self.tails = {p: RowTail(p, p.stat().st_size) for p in self.dir.glob("*.jsonl")}
        self.last: dict[str, dict[str, Any]] = {}

    def progress(self) -> tuple[int, float | None]:
        """The slowest replica's step and the latest loss seen on a last stage."""
        for path in sorted(self.dir.glob(f"{self.last_stage}-*.jsonl")):
            for row in self.tails.setdefault(path, RowTail(path)).read():
                if "step" in row and "event" not in row and not row.get("final"):
                    self.last[path.stem] = row
        if not self.last:
            return self.start_step, None
        rows = list(self.last.values())
        return min(r["step"] for r in rows), rows[-1].get("loss")
