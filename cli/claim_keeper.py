"""A join's placeholder claim, kept alive until the cell's own claim shows.

`join` claims its cell from a scout DHT node (cli/join.py: claim_cell), then starts the cell,
whose own DHT node and heartbeats take seconds to come up (many more on a loaded box). A
placeholder that only expired by itself left the cell free in between: a second join took it
and two peers trained one cell (16 joins 1 s apart on 2 cores). So the scout stays up and
re-stores the placeholder every heartbeat until a read shows the cell owned by a running claim
(the cell's, published a hair earlier than the placeholder: mesh.runtime.registry.owners), then
withdraws it and closes; or until the cell stops, or after `give_up_s` (the cell never came up:
the placeholder then expires within its lives).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from mesh.runtime.registry import CellRecord, Registry, replica_of, running


def handed_over(owned: dict[str, CellRecord] | None, placeholder: CellRecord) -> bool:
    """Whether the claims as read show the placeholder's cell owned by a running claim (the
    cell's own; or an earlier one, when the join lost and the cell will say so)."""
    owner = (owned or {}).get(placeholder.cell)
    return owner is not None and owner.peer != placeholder.peer and running(owner)


class ClaimKeeper:
    """Beats `placeholder` through `registry` (the scout's) on a thread until handed_over; then
    withdraws it and closes `scout`. stop() ends it early (the cell ended) and always closes
    the scout, so its p2pd is reaped before the process exits."""

    def __init__(
        self,
        registry: Registry,
        placeholder: CellRecord,
        scout: Any,
        give_up_s: float,
        ttl_s: float = 0.0,
    ) -> None:
        self.registry, self.placeholder, self.scout = registry, placeholder, scout
        self.give_up_s, self.ttl_s = give_up_s, ttl_s  # ttl_s: each store's least lifetime
        self.handed = threading.Event()  # the cell's claim was read: the placeholder withdrawn
        self._stop = threading.Event()
        self._closed = threading.Lock()
        self._thread = threading.Thread(target=self._keep, name="claim-keeper", daemon=True)
        self._thread.start()

    def _keep(self) -> None:
        replica = replica_of(self.placeholder.cell)
        assert replica is not None, self.placeholder.cell
        period_s = self.registry.heartbeat_s
        deadline = time.monotonic() + self.give_up_s  # (a read may take seconds: by the clock)
        while not self._stop.wait(period_s) and time.monotonic() < deadline:
            try:
                if handed_over(self.registry.owners([replica]), self.placeholder):
                    self.handed.set()
                    break
                self.registry.beat(self.placeholder, self.ttl_s)
            except Exception:  # noqa: BLE001 - a slow DHT: the next beat tries again
                continue
        self._close(withdraw=self.handed.is_set())

    def _close(self, withdraw: bool) -> None:
        if not self._closed.acquire(blocking=False):
            return
        if withdraw:  # otherwise it expires within its lives: nothing is left to chance
            try:
                self.registry.release(self.placeholder.cell, self.placeholder.peer, self.ttl_s)
            except Exception:  # noqa: BLE001 - it expires by itself
                pass
        try:
            self.scout.close()
        except Exception:  # noqa: BLE001 - closing a DHT node that is already going down
            pass

    def stop(self, timeout_s: float = 10.0) -> None:
        """End the keeping (the cell ended) and close the scout; waits up to timeout_s."""
        self._stop.set()
        self._thread.join(timeout_s)
        self._close(withdraw=True)
