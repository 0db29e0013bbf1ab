"""A launcher's stop at one step (mesh/runtime/stop.py says why): every cell of a replica trains
up to one step, ends there as at the run's end and saves it, so `--resume` starts from the step
the stop reached and loses at most the microbatches that were in flight.

How the step is chosen: the cells are frozen for a moment (SIGSTOP, each one's state read until
it is stopped) and each one's step read from its metrics file. A cell writes its row of step s
right after that update, so a frozen cell is at most one step past its last row (inside the
update after it); the replica's stop step is its newest row + 2, which every cell of the replica
reaches after at least one more update (where it asks). The step goes to DIR/stop.json, the cells
go on (SIGCONT). Replicas stop each at their own step (a slow replica is not made to catch up),
except where a step needs every replica (dp.mode = grad_allreduce's all-reduce, dp.strict_tau's
rounds): there one step for all. A pipeline reaches any step every cell of it is at or before:
each cell's update s needs only what its neighbours send before their own update s.

imports: stdlib, comms.procs, mesh (config), mesh.runtime (rows, stop).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from comms.procs import state
from mesh.config import Config
from mesh.runtime.rows import parse_rows
from mesh.runtime.stop import stop_file

STOP_MARGIN = 2  # steps past a frozen cell's newest row (see the module docstring)
FREEZE_WAIT_S = 30.0  # a cell inside a long write (a checkpoint's fsync) stops when it returns
TAIL_BYTES = 64 << 10  # the end of a metrics file read for its newest row (rows are ~1-2 KB)
STOP_EXTRA_S = 30.0  # the wait for the cells to reach their step: this past their timeouts


def stop_steps(
    current: dict[tuple[int, int], int], replicas: int, last_step: int, together: bool
) -> dict[int, int]:
    """Each replica's stop step from its cells' steps (cell (stage, replica) -> newest step):
    its newest + STOP_MARGIN, one for all replicas when `together`, never past the run's end."""
    newest = {
        i: max((s for (_, r), s in current.items() if r == i), default=0) for i in range(replicas)
    }
    if together:
        newest = dict.fromkeys(newest, max(newest.values(), default=0))
    return {i: min(last_step, s + STOP_MARGIN) for i, s in newest.items()}


def newest_step(path: Path, offset: int) -> int | None:
    """The step of the newest row (update or event) written to the metrics file at `path` at
    or after `offset` (where the cell's current life began); None when it wrote none yet.
    Reads only the file's end."""
    try:
        with path.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            start = max(offset, size - TAIL_BYTES)
            f.seek(start)
            chunk = f.read()
    except FileNotFoundError:
        return None
    if start > offset:  # the first line may be cut: it is not a whole row
        chunk = chunk[chunk.find(b"\n") + 1 :]
    steps = [r["step"] for r in parse_rows(chunk) if isinstance(r.get("step"), int)]
    return steps[-1] if steps else None


def write_stop_steps(out_dir: Path, steps: dict[int, int]) -> None:
    path = stop_file(out_dir)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"replica_steps": {str(i): s for i, s in steps.items()}}))
    os.replace(tmp, path)


def freeze(pids: Iterable[int], wait_s: float = FREEZE_WAIT_S) -> list[int]:
    """SIGSTOP each process and wait until it is stopped (or gone); returns those signalled."""
    sent = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGSTOP)
            sent.append(pid)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if all(state(pid) in (None, "T", "t", "Z", "X") for pid in sent):
            break
        time.sleep(0.005)
    return sent


def thaw(pids: Iterable[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def stop_at_one_step(
    out_dir: Path,
    cells: dict[tuple[int, int], tuple[int, int, int]],
    replicas: int,
    last_step: int,
    together: bool,
) -> dict[int, int]:
    """Name each replica's stop step (DIR/stop.json) from its running cells (cell -> (pid, the
    step its life started at, its metrics file's size then)); the cells run on to it. Returns
    the steps."""
    frozen = freeze(pid for pid, _, _ in cells.values())
    try:
        current = {}
        for (j, i), (_, start, offset) in cells.items():
            row = newest_step(out_dir / "metrics" / f"{j}-{i}.jsonl", offset)
            current[(j, i)] = max(start, row if row is not None else start)
        steps = stop_steps(current, replicas, last_step, together)
        write_stop_steps(out_dir, steps)
    finally:
        thaw(frozen)  # whatever happened: a frozen cell would never stop
    return steps


def wait_for_cells(running: Callable[[], bool], failed: Callable[[], bool], wait_s: float) -> bool:
    """Wait until no cell runs (True), or one failed or died, or wait_s passed (False)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if not running():
            return True
        if failed():
            return False
        time.sleep(0.1)
    return not running()


def one_step_stop(cfg: Config) -> bool:
    """Whether a stop runs each replica's cells to one step: on a fixed torch grid (hivemind's
    sessions resume cells at different steps; a pool's cells take different numbers of
    updates: they save where the stop finds them)."""
    return cfg.transport.backend == "torch" and not cfg.pipeline.pooled


def stop_grid_at_one_step(
    cfg: Config, grid: Any, notice: Callable[[str], None]
) -> dict[int, int] | None:
    """A launcher's grid (mesh.runtime.launch.LocalGrid) stopped at one step: named, said on
    the console, then waited for; the steps, or None when a cell failed or died first, or the
    cells took longer than their own timeouts allow (the caller then stops every cell where
    it is)."""
    # a step that needs every replica (grad_allreduce's all-reduce, strict_tau's rounds)
    together = cfg.dp.mode == "grad_allreduce" or cfg.dp.strict_tau
    steps = stop_at_one_step(
        grid.out_dir, grid.running_lives(), cfg.grid.replicas, cfg.run.steps, together
    )
    where = ", ".join(f"replica {i} at step {s}" for i, s in steps.items())
    notice(
        f"stopping: each cell finishes its update and stops ({where}); Ctrl-C again to "
        "stop at once (each cell saves where it is)"
    )
    t = cfg.transport
    done = wait_for_cells(
        grid.running,
        lambda: grid.first_failure() is not None or bool(grid.dead()),
        t.recv_timeout_s + t.round_timeout_s + STOP_EXTRA_S,
    )
    return steps if done else None
