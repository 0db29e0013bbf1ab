"""How a launcher starts its cell processes and stops them: started with SIGTERM ignored (a
cell makes it a clean stop once it can take one), stopped by SIGTERM repeated until it takes,
and what outlives the grace period asked for its threads' stacks, then killed.

imports: stdlib, mesh.runtime.stacks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

from mesh.runtime.stacks import STACKS_SIGNAL, STACKS_WAIT_S


@contextlib.contextmanager
def sigterm_ignored() -> Iterator[None]:
    """Start children, and the cells' fork server whose forks inherit it, with SIGTERM ignored
    (an ignored signal stays ignored across exec): a child still starting when a stop comes
    would otherwise die of it (exit -15) before run_cell installs its handler, which makes
    SIGTERM a clean stop (checkpoint, release, exit 0). stop_all repeats the signal until
    then. Only the main thread can set handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


RESIGNAL_S = 0.5  # a stop repeats SIGTERM this often: a starting child ignores it until ready


def stop_all(procs: list[Any], grace_s: float) -> None:
    """SIGTERM the children still running (again every RESIGNAL_S, for children that were
    still starting), SIGKILL what is left after grace_s (asked for its threads' stacks first:
    mesh/runtime/stacks.py), reap all."""
    deadline = time.monotonic() + grace_s
    while True:
        alive = [p for p in procs if p.is_alive()]
        left = deadline - time.monotonic()
        if not alive or left <= 0:
            break
        for p in alive:
            p.terminate()  # idempotent in a cell: its handler ignores a second one
        alive[0].join(min(RESIGNAL_S, left))
    stuck = [p for p in procs if p.is_alive()]
    for p in stuck:  # what it is doing, before the kill (mesh/runtime/stacks.py)
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, STACKS_SIGNAL)
    if stuck:
        time.sleep(STACKS_WAIT_S)
    for p in stuck:
        p.kill()
        p.join(5)
