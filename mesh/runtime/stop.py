"""How a cell process stops: SIGTERM (a launcher, a user) or Ctrl-C is a clean stop (checkpoint,
release, exit 0), deferred inside a checkpoint write, and immediate while the transport starts
(mesh/runtime/trainer.py run_cell installs the handler and opens the windows).

A launcher's cells stop another way first: at one step. Each cell of a pipeline is a step or so
ahead of or behind its neighbours at any moment, so cells that each saved where a signal found
them share no step, and a resume would go back to their last common (periodic) checkpoint. The
launcher instead names a step per replica in DIR/stop.json (mesh/runtime/grid_stop.py), every
cell of the replica trains up to it and ends there as at the run's end (StopAt, StopAtStep),
and a resume starts from it. A launcher's cells ignore the terminal's Ctrl-C (it reaches the
whole process group): their launcher handles it (ctrl_c = False). `train`'s cells, which only
torchrun or srun signals, agree on the step themselves (mesh/runtime/cluster_stop.py).

imports: stdlib, comms.procs.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from comms.procs import kill_descendants


class StopSignal:
    """SIGTERM -> SystemExit(0), except inside a checkpoint write: there it waits until the
    write is complete (an exception inside torch.save would fail the stop, not the file: the
    write is atomic either way), and once the cell's `finally` runs (`exiting`) further
    signals are ignored. Until then each signal raises again: Python swallows an exception a
    handler raises while the main thread runs a weakref or finalizer callback ("Exception
    ignored in ..."), and a stop lost that way must not wait for the launcher's SIGKILL (its
    repeated SIGTERMs are what find the cell next)."""

    def __init__(self) -> None:
        self.depth, self.pending, self.exiting = 0, False, False
        self.ctrl_c = True  # SIGINT stops the cell too (False: a launcher's cell ignores it)
        # a `train` cell while it trains: a signal asks its replica for a stop at one step
        # (mesh/runtime/cluster_stop.py) and the cell trains on to it; further ones are ignored
        # (torchrun forwards the terminal's Ctrl-C that reached the cells already)
        self.one_step, self.asked = False, False
        self.one_step_wait_s = 20.0  # then it stops where it is (a neighbour gone: no step)
        self.give_up: threading.Timer | None = None

    def handler(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and not self.ctrl_c:
            return
        if self.one_step and not self.exiting:
            if not self.asked:
                self.asked = True
                self.give_up = threading.Timer(self.one_step_wait_s, self._give_up)
                self.give_up.daemon = True
                self.give_up.start()
            return
        if self.depth or self.exiting:
            self.pending = True
            return
        raise SystemExit(0)

    def _give_up(self) -> None:
        """The stop step not reached in time: the next signal stops the cell where it is."""
        self.one_step = False
        if not self.exiting:
            os.kill(os.getpid(), signal.SIGTERM)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
        if self.pending and not self.depth and not self.exiting:
            self.exiting = True
            raise SystemExit(0)

    @contextlib.contextmanager
    def immediate(self) -> Iterator[None]:
        """A stop inside exits the process at once (exit 0), from a thread the signal's wakeup
        fd wakes: the main thread may sit in a C++ call (a TCPStore or gloo connect waits up to
        transport.start_timeout_s) where a Python handler cannot run, and a stop must not wait that
        long. The processes this one started (a half-started DHT and its p2pd) are killed
        first, by PID. Only for a window where nothing else needs undoing: no file open,
        nothing claimed, nothing trained since the last save."""
        r, w = os.pipe()
        os.set_blocking(w, False)
        stops = {int(signal.SIGTERM)} | ({int(signal.SIGINT)} if self.ctrl_c else set())
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                got = os.read(r, 64)
                if not done.is_set() and stops & set(got):
                    kill_descendants()
                    os._exit(0)

        old = signal.set_wakeup_fd(w)
        watcher = threading.Thread(target=watch, name="stop-watch", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            signal.set_wakeup_fd(old)
            done.set()
            os.write(w, b"\0")  # wakes the watcher to see `done`
            watcher.join()
            os.close(r)
            os.close(w)


STOP = StopSignal()  # the process's one handler (run_cell installs it)

STOP_FILE = "stop.json"  # in the run directory: {"replica_steps": {"0": 139, "1": 120}}


def stop_file(out_dir: str | Path) -> Path:
    return Path(out_dir) / STOP_FILE


class StopAtStep(Exception):  # noqa: N818 - the end of a run, not an error
    """This cell reached the step its launcher's stop names: it ends there as at the run's end
    (its sends drained, its final row, its checkpoint)."""


class StopAt:
    """The step at which this cell stops, once its launcher wrote one (DIR/stop.json): `due`
    is asked after every update (one stat of a missing file until then)."""

    def __init__(self, out_dir: str | Path, replica: int) -> None:
        self.path, self.replica = stop_file(out_dir), replica
        self.step: int | None = None
        self.read = False

    def due(self, step: int) -> bool:
        if not self.read and self.path.exists():  # written whole (a rename): read once
            self.read = True
            try:
                self.step = int(
                    json.loads(self.path.read_text())["replica_steps"][str(self.replica)]
                )
            except (OSError, ValueError, KeyError, TypeError):
                self.step = None  # none for this replica: it trains on until stopped
        return self.step is not None and step >= self.step


PARENT_POLL_S = 1.0


def watch_parent(poll_s: float = PARENT_POLL_S) -> threading.Thread:
    """Stop this process cleanly (SIGTERM to itself: checkpoint, release, exit 0) once the
    process that started it is gone: a launcher killed with SIGKILL cannot stop its cells, and
    an orphan would train on beside the next grid a `--resume` starts. A multiprocessing child
    watches its launcher's end of the pipe it was started through (it closes however the
    launcher dies; a cell's parent pid is the fork server's, which outlives the launcher while
    a cell runs); any other process polls for a changed parent pid (Linux re-parents an orphan)."""
    launcher = mp.parent_process()
    parent = os.getppid()

    def watch() -> None:
        if launcher is not None:
            launcher.join()
        else:
            while os.getppid() == parent:
                time.sleep(poll_s)
        while True:  # again until it takes: a cell still starting ignores SIGTERM until ready
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(poll_s)

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread
