"""Spawn, watch and reap the local peer processes of a grid (simulate and the tests use it).

Each cell is its own process (spawn context, so no state leaks from the parent) running
`mesh.trainer.run_cell`. The parent holds the rendezvous (a TCP store address, or a bootstrap
DHT), draws one progress bar from the cells' metrics files, and on Ctrl-C or an error
terminates every child (SIGTERM, then SIGKILL after a grace period) and reaps them all.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from comms.build import local_rendezvous
from mesh.checkpoint import CheckpointError, common_step
from mesh.config import Config
from mesh.emulate import resolve_window
from mesh.metrics import read_metrics
from mesh.trainer import cell_process_main


@dataclass
class GridRun:
    exit_codes: dict[tuple[int, int], int | None]
    wall_s: float
    interrupted: bool

    @property
    def ok(self) -> bool:
        return not self.interrupted and all(c == 0 for c in self.exit_codes.values())


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
        the process's main (run_cell's arguments), e.g. a misbehaving peer in a test."""
        j, i = cell
        p = self._ctx.Process(
            target=target,
            args=(self.tree, j, i, str(self.out_dir), self.options, resume_step),
            name=f"cell-s{j}r{i}",
        )
        p.start()
        self.procs[cell] = p

    def pid(self, cell: tuple[int, int]) -> int:
        return self.procs[cell].pid

    def running(self) -> bool:
        return any(p.is_alive() for p in self.procs.values())

    def failed(self) -> bool:
        return any(p.exitcode not in (None, 0) for p in self.procs.values())

    def exit_codes(self) -> dict[tuple[int, int], int | None]:
        return {k: p.exitcode for k, p in self.procs.items()}

    def stop(self, grace_s: float = 5.0) -> None:
        _stop_all(list(self.procs.values()), grace_s)


def run_grid(
    cfg: Config,
    out_dir: Path,
    resume: bool = False,
    on_progress: Callable[[int, float | None], None] | None = None,
    timeout_s: float | None = None,
    grace_s: float = 5.0,
) -> GridRun:
    """Run every cell to cfg.run.steps; returns exit codes (None: killed by us).

    resume: every cell restarts from the latest step all cells have a checkpoint of.
    A failed cell does not stop the grid: the other replicas keep training (their rounds with
    it fail fast and are counted). Its own replica waits for it: on torch.distributed until
    runtime.timeout_s (a gloo world cannot re-admit a rank), on hivemind up to
    runtime.rejoin_timeout_s for it to come back (restarted with its checkpoint, or a `join`).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    resume_step = None
    if resume:
        cells = [(j, i) for i in range(cfg.grid.replicas) for j in range(cfg.grid.stages)]
        resume_step = common_step(out_dir, cells)
        if resume_step is None:
            raise CheckpointError(f"{out_dir}: no step that every cell has a checkpoint of")
    start = time.perf_counter()
    interrupted = False
    with local_rendezvous(cfg.runtime.backend, cfg.runtime.host) as options:
        grid = LocalGrid(cfg, out_dir, options)
        try:
            for i in range(cfg.grid.replicas):
                for j in range(cfg.grid.stages):
                    grid.start((j, i), resume_step)
            last_step = -1
            while grid.running():
                if timeout_s is not None and time.perf_counter() - start > timeout_s:
                    raise TimeoutError(f"grid did not finish within {timeout_s} s")
                time.sleep(0.2)
                if on_progress:
                    step, loss = _progress(out_dir, cfg.grid.stages - 1)
                    if step != last_step:
                        on_progress(step, loss)
                        last_step = step
        except KeyboardInterrupt:
            interrupted = True
        finally:
            grid.stop(grace_s)
    return GridRun(grid.exit_codes(), time.perf_counter() - start, interrupted)


def _progress(out_dir: Path, last_stage: int) -> tuple[int, float | None]:
    """The slowest replica's step and the latest loss seen on a last stage."""
    rows = read_metrics(out_dir)
    last = [r for (s, _), rs in rows.items() if s == last_stage for r in rs[-1:]]
    if not last:
        return 0, None
    return min(r["step"] for r in last), last[-1].get("loss")


def _stop_all(procs: list[Any], grace_s: float) -> None:
    """SIGTERM the children still running, SIGKILL what is left after grace_s, reap all."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
