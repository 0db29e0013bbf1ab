"""A hivemind follower's step at a session's start: its leader's.

A session's updates count from its leader's step (stage 0's: the replica's data index), and every
cell of the replica runs them all. A follower whose own count stands elsewhere (resumed from a save
a step apart from its leader's, as a hivemind stop saves each cell where it finds it; or loaded
from another replica's cell further on) would end as far past run.steps, and its saves would
never meet its replica's, where validation and a resume look for the replica whole. So it takes
the session's step, its weights kept.

imports: mesh (engine cell, runtime session).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from mesh.engine.cell import Cell
from mesh.runtime.session import DhtCoordinator, Session


def renumber(cell: Cell, step: int) -> None:
    """Count the cell's updates from `step` on, its weights and stashed versions kept (each
    version keeps its age: the schedule reads them relative to the cell's step)."""
    shift = step - cell.step
    cell.history = OrderedDict((v + shift, w) for v, w in cell.history.items())
    cell.step = step


def take_session_step(
    worker: Any, coord: DhtCoordinator, session: Session, event: Callable[..., None]
) -> None:
    """The follower `worker` (a StageWorker) takes `session`'s step (see the module docstring);
    said as a `session_step` event row. Nothing for a cell already there (its leader)."""
    cell = worker.cell
    step = session.base_mb // worker.mpu
    if step == cell.step:
        return
    old = cell.step
    with worker.lock:  # the state server snapshots between updates
        renumber(cell, step)
        worker.rounds.drop(old)  # rounds launched under the old count are void
    coord.beat.step = step
    event("session_step", from_step=old)
