"""`train`'s stop at one step: a replica's cells agree on one step in the rendezvous store they
share, each trains up to it and saves it, so the same command continues from there and loses
nothing any cell completed (mesh/runtime/stop.py says why a stop must be at one step).

`simulate`'s launcher freezes its cells to read their steps (grid_stop.py); torchrun's agent, or
srun, only signals them, each node its own. So the cells decide themselves. A signalled cell
(SIGTERM, Ctrl-C: STOP.asked) proposes, after its next update u, the step u + margin under one
key (compare-and-set: the first proposal wins, every later one reads it); every cell reads that
key after each update and ends at the step it names. A cell reads the key at most one update
after it was written, and no cell of the scope is more than `margin - 1` updates past the
proposer then: a pipeline's last stage runs at most ceil((P - 1 + window) / M) updates ahead of
its first (the microbatches in flight), one more for an update under way, and across replicas
tau more under dp.strict_tau, one under grad_allreduce. So every cell reaches the step, none has
passed it. A cell that finds itself past it anyway, or the store gone, or not at it while its
launcher waits (a neighbour gone), stops where it is (the resume then goes back to the newest
step its replica shares).

The key is per replica, or one for the grid where a step needs every replica (grad_allreduce's
all-reduce, strict_tau's rounds), as grid_stop.py's `together`. Stage 0 deletes it at each start
before its column settles (mesh/runtime/cluster_start.py), so a stop a past start of the job
named (torchrun's store outlives its workers' restarts) is not taken for this one's.

imports: stdlib, comms.torchdist, mesh (config, schedule), mesh.runtime.stop.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from comms.torchdist.gloo import store_client
from mesh.algo.schedule import microbatches_per_update
from mesh.config import Config
from mesh.runtime.stop import STOP

STORE_WAIT_S = 10.0  # the longest one store call of the stop may take: a stop must not hang
SHUTDOWN_S = 30.0  # torchrun's grace for its workers' stop (TORCH_ELASTIC_SHUTDOWN_TIMEOUT)
SAVE_ROOM_S = 10.0  # of it, left for the save after a stop that gave up on its step


def together(cfg: Config) -> bool:
    """Whether every replica stops at one step (a step that needs every replica)."""
    return cfg.dp.mode == "grad_allreduce" or cfg.dp.strict_tau


def stop_margin(cfg: Config) -> int:
    """Updates past the proposer's step that the stop is named at (the module docstring)."""
    window = max(cfg.pipeline.extra_warmups() or [0])
    mpu = microbatches_per_update(cfg.pipeline.schedule, cfg.pipeline.microbatches)
    ahead = -(-(cfg.grid.stages - 1 + window) // mpu)
    across = (cfg.dp.tau if cfg.dp.strict_tau else 1) if together(cfg) else 0
    return 2 + ahead + across


class StoreStop:
    """A `train` cell's stop step, agreed in the store at host:port (asked by CellRun.on_step
    after each update, as mesh.runtime.stop.StopAt). event(name, **fields): the cell's event
    row: `stop_step` (the step, once known), `stop_step_passed`."""

    def __init__(
        self, cfg: Config, replica: int, host: str, port: int, event: Callable[..., None]
    ) -> None:
        self.key = "mt/stop/all" if together(cfg) else f"mt/stop/r{replica}"
        self.margin = stop_margin(cfg)
        self.host, self.port, self.event = host, port, event
        self.store: Any = None
        self.step: int | None = None
        self.broken = False  # the store failed once: not asked again (a stop stops at once)

    def _store(self) -> Any:
        if self.store is None:
            self.store = store_client(self.host, self.port, timedelta(seconds=STORE_WAIT_S))
        return self.store

    def clear(self) -> None:
        """A start's first word (stage 0, before its column settles): no stop named yet."""
        try:
            self._store().delete_key(self.key)
        except Exception:  # noqa: BLE001 - no store to agree in: a signal stops at once
            self.broken = True

    def arm(self) -> None:
        """From here a signal asks for a stop at one step instead of stopping at once; one not
        reached while torchrun waits (a neighbour gone) stops where it is, saved before the
        launcher's SIGKILL."""
        shutdown = float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", SHUTDOWN_S))
        STOP.one_step_wait_s = max(5.0, shutdown - SAVE_ROOM_S)
        STOP.one_step = not self.broken

    def due(self, step: int) -> bool:
        if self.step is None and not self.broken:
            self.step = self._read(step)
        if self.step is None:
            if STOP.asked:  # the store failed: stop here, as before there was one step
                raise SystemExit(0)
            return False
        if step > self.step:  # past it already: stop here (the resume goes back further)
            self.event("stop_step_passed", at=self.step)
            raise SystemExit(0)
        return step >= self.step

    def _read(self, step: int) -> int | None:
        """The stop step: ours proposed when this cell was signalled, else one proposed."""
        try:
            store = self._store()
            if STOP.asked:
                value = store.compare_set(self.key, "", str(step + self.margin))
            elif store.check([self.key]):
                value = store.get(self.key)
            else:
                return None
            at = int(value)
        except Exception:  # noqa: BLE001 - the store is gone (or garbled): no step to agree on
            self.broken = True
            STOP.one_step = False
            return None
        self.event("stop_step", at=at)
        return at
