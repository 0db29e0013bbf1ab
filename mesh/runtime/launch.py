"""Spawn, watch and reap the local peer processes of a grid (simulate and the tests use it).

Each cell is its own process (spawn context, so no state leaks from the parent) running
`mesh.runtime.trainer.run_cell`. The parent holds the rendezvous (a TCP store address, or a
bootstrap DHT), draws one progress bar from the cells' metrics files, and on Ctrl-C or an error
terminates every child (SIGTERM, then SIGKILL after a grace period) and reaps them all.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from comms.build import local_rendezvous
from mesh.algo.topology import cell_name
from mesh.config import Config
from mesh.runtime.checkpoint import CheckpointError, resume_point
from mesh.runtime.emulate import resolve_window
from mesh.runtime.metrics import RowTail
from mesh.runtime.trainer import cell_process_main, failure_report


@dataclass
class GridRun:
    exit_codes: dict[tuple[int, int], int | None]
    wall_s: float
    interrupted: bool
    failure: CellFailure | None = None  # the first cell that failed on its own, if any

    @property
    def ok(self) -> bool:
        return not self.interrupted and all(c == 0 for c in self.exit_codes.values())


@dataclass(frozen=True)
class CellFailure:
    cell: str  # "s1r0"
    exit_code: int  # 2: a user error (message says the fix); else a bug or a crash
    message: str  # one line
    log: Path | None  # the cell's whole report (traceback for a bug)


class LocalGrid:
    """The cells of one grid as local processes: start, signal, restart, stop and reap them."""

    def __init__(self, cfg: Config, out_dir: Path, options: dict[str, Any]) -> None:
        self.out_dir, self.options = out_dir, options
        # pipeline.window = "auto": sized once here, so every cell runs the same schedule
        self.tree = resolve_window(cfg).model_dump(mode="json")
        self.procs: dict[tuple[int, int], Any] = {}
        self._ctx = mp.get_context("spawn")

    def start(
        self,
        cell: tuple[int, int],
        resume_step: int | None = None,
        target: Callable[..., None] = cell_process_main,
    ) -> None:
        """Start (or restart) a cell; resume_step -1: from its own latest checkpoint. target:
        the process's main (run_cell's arguments), e.g. a misbehaving peer in a test; it must
        install its own SIGTERM handler (run_cell does), since it starts with SIGTERM ignored."""
        j, i = cell
        p = self._ctx.Process(
            target=target,
            args=(self.tree, j, i, str(self.out_dir), self.options, resume_step),
            name=f"cell-s{j}r{i}",
        )
        with _sigterm_ignored():
            p.start()
        self.procs[cell] = p

    def pid(self, cell: tuple[int, int]) -> int:
        return self.procs[cell].pid

    def running(self) -> bool:
        return any(p.is_alive() for p in self.procs.values())

    def exit_codes(self) -> dict[tuple[int, int], int | None]:
        return {k: p.exitcode for k, p in self.procs.items()}

    def first_failure(self) -> CellFailure | None:
        """The cell that failed first on its own (exit code > 0), from the report it wrote."""
        failed = [(j, i) for (j, i), p in self.procs.items() if (p.exitcode or 0) > 0]
        if not failed:
            return None
        reports = {c: failure_report(self.out_dir, *c) for c in failed}
        cell = min(failed, key=lambda c: reports[c][0])
        when, message, log = reports[cell]
        code = self.procs[cell].exitcode or 1
        return CellFailure(cell_name(*cell), code, message, log)

    def stop(self, grace_s: float = 5.0) -> None:
        _stop_all(list(self.procs.values()), grace_s)


def grid_cells(cfg: Config) -> list[tuple[int, int]]:
    """(stage, replica) of every cell, replica-major (the launch order)."""
    return [(j, i) for i in range(cfg.grid.replicas) for j in range(cfg.grid.stages)]


def run_grid(
    cfg: Config,
    out_dir: Path,
    resume: bool = False,
    on_progress: Callable[[int, float | None], None] | None = None,
    timeout_s: float | None = None,
    grace_s: float = 5.0,
    resume_step: int | None = None,
) -> GridRun:
    """Run every cell to cfg.run.steps; returns exit codes (None: killed by us).

    resume: every cell restarts from `resume_step`, or (None) from the newest step that every
    cell has an intact checkpoint of (mesh.runtime.checkpoint.resume_point).
    A cell that fails on its own (it raised: exit code > 0) stops the grid at once, since no
    one here would replace it; GridRun.failure names it and says why. A cell killed by a signal
    is a fault the grid rides out: the other replicas keep training, and its own replica waits
    for it, on torch.distributed until runtime.timeout_s (a gloo world cannot re-admit a rank),
    on hivemind up to runtime.rejoin_timeout_s for it to come back (restarted or a `join`).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    if resume and resume_step is None:
        point = resume_point(out_dir, grid_cells(cfg), cfg.state_fingerprint())
        if point.step is None:
            raise CheckpointError(f"{out_dir}: no step that every cell has a checkpoint of")
        resume_step = point.step
    start = time.perf_counter()
    interrupted, failure = False, None
    tail = MetricsTail(out_dir, cfg.grid.stages - 1, resume_step or 0)
    with local_rendezvous(cfg.runtime.backend, cfg.runtime.host) as options:
        grid = LocalGrid(cfg, out_dir, options)
        try:
            for j, i in grid_cells(cfg):
                grid.start((j, i), resume_step)
            last_step = -1
            while grid.running():
                if timeout_s is not None and time.perf_counter() - start > timeout_s:
                    raise TimeoutError(f"grid did not finish within {timeout_s} s")
                time.sleep(0.2)
                failure = grid.first_failure()
                if failure is not None:
                    break
                if on_progress:
                    step, loss = tail.progress()
                    if step != last_step:
                        on_progress(step, loss)
                        last_step = step
            failure = failure or grid.first_failure()
        except KeyboardInterrupt:
            interrupted = True
        finally:
            grid.stop(grace_s)
    return GridRun(grid.exit_codes(), time.perf_counter() - start, interrupted, failure)


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


@contextlib.contextmanager
def _sigterm_ignored() -> Iterator[None]:
    """Spawn children with SIGTERM ignored (an ignored signal stays ignored across exec): a
    child still importing torch when a stop comes would otherwise die of it (exit -15) before
    run_cell installs its handler, which makes SIGTERM a clean stop (checkpoint, release,
    exit 0). _stop_all repeats the signal until then. Only the main thread can set handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


RESIGNAL_S = 0.5  # a stop repeats SIGTERM this often: a starting child ignores it until ready


def _stop_all(procs: list[Any], grace_s: float) -> None:
    """SIGTERM the children still running (again every RESIGNAL_S, for children that were
    still starting), SIGKILL what is left after grace_s, reap all."""
    deadline = time.monotonic() + grace_s
    while True:
        alive = [p for p in procs if p.is_alive()]
        left = deadline - time.monotonic()
        if not alive or left <= 0:
            break
        for p in alive:
            p.terminate()  # idempotent in a cell: its handler ignores a second one
        alive[0].join(min(RESIGNAL_S, left))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
