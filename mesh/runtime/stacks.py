"""What a cell that outlived its stop was doing: its threads' stacks, kept as DIR/logs/sJrI.stuck.

A launcher that stops its cells (SIGTERM, a clean stop) kills what is still running after the
grace period. Before the kill it sends STACKS_SIGNAL: the cell's faulthandler writes every
thread's Python stack from inside the signal handler, so a thread that holds the GIL in C code
for ever (a C++ call spinning, a lock never given back) does not keep it from writing. The
stacks go to a hidden file the cell opened at its start (DIR/logs/.sJrI.stuck.PID: a handler
cannot open one); the launcher keeps it under the cell's name once the cell is dead. A cell
that ends on its own removes its hidden file; those of processes that died otherwise are
removed by the next cell of that name.

imports: stdlib, mesh (topology, failure).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
from collections.abc import Iterator
from pathlib import Path

from mesh.algo.topology import cell_name
from mesh.runtime.failure import drop_dead_processes_files

STACKS_SIGNAL = signal.SIGUSR1
STACKS_WAIT_S = 1.0  # what a launcher gives a cell to write its stacks before the kill


def stacks_path(out_dir: str | Path, stage: int, replica: int) -> Path:
    return Path(out_dir) / "logs" / f"{cell_name(stage, replica)}.stuck"


def _hidden(out_dir: str | Path, stage: int, replica: int, pid: int) -> Path:
    path = stacks_path(out_dir, stage, replica)
    return path.with_name(f".{path.name}.{pid}")


@contextlib.contextmanager
def written_on_request(out_dir: str | Path, stage: int, replica: int) -> Iterator[None]:
    """Inside, STACKS_SIGNAL writes this process's threads' stacks to its hidden file."""
    path = _hidden(out_dir, stage, replica, os.getpid())
    drop_dead_processes_files(stacks_path(out_dir, stage, replica))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = path.open("w")
    except OSError:  # no room: the cell runs on without (its kill then says nothing more)
        yield
        return
    faulthandler.register(STACKS_SIGNAL, file=f, all_threads=True)
    try:
        yield
    finally:
        faulthandler.unregister(STACKS_SIGNAL)
        f.close()
        path.unlink(missing_ok=True)


def keep_stacks(out_dir: str | Path, stage: int, replica: int, pid: int) -> Path | None:
    """After a launcher killed cell process `pid`: its stacks as DIR/logs/sJrI.stuck, or None
    when it wrote none (it had not started to listen for the signal, or had no room)."""
    hidden = _hidden(out_dir, stage, replica, pid)
    try:
        if hidden.stat().st_size == 0:
            hidden.unlink()
            return None
        path = stacks_path(out_dir, stage, replica)
        os.replace(hidden, path)
        return path
    except OSError:
        return None
