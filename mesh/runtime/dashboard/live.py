"""The dashboard's JSON of a live WAN run: `meshtrain status --json` rows (cli/status.py, read
from the DHT at each poll) with each cell's state, the cells this dashboard saw die, and the
training loss curves it gathered from the heartbeats since it started.

A claim that stops beating expires from the DHT after 4 heartbeats and its cell reads as free;
a cell this dashboard saw held and no longer sees is shown dead (with what it last showed)
until someone claims it again: a peer that vanished is what a user watching needs to see.

imports: stdlib, this package's state and rundir (thin).
"""

from __future__ import annotations

from typing import Any

from mesh.runtime.dashboard.rundir import thin
from mesh.runtime.dashboard.state import DEAD, Seen, StepClock, cell_state

DEFAULT_HEARTBEAT_S = 1.0  # runtime.heartbeat_s's default, when the run's record is unreadable


class LiveView:
    """Turns successive status rows into the dashboard's JSON (state kept between polls)."""

    def __init__(self) -> None:
        self.clock = StepClock()
        self.last: dict[str, tuple[dict[str, Any], float]] = {}  # cell -> (row, seen at)
        self.losses: dict[str, dict[int, float]] = {}  # replica -> step -> loss
        self.start: float | None = None

    def json(self, rows: dict[str, Any], now: float) -> dict[str, Any]:
        heartbeat_s = (rows.get("run") or {}).get("heartbeat_s") or DEFAULT_HEARTBEAT_S
        P = int(rows["grid"].split("x")[0]) if rows.get("grid") else None
        cells, bytes_by_kind = [], {}
        for c in rows["cells"]:
            seen = Seen(
                claimed=True,
                heartbeat_age_s=c["heartbeat_age_s"],
                step_still_s=self.clock.still_s(c["cell"], c["step"], now),
                loading=not c.get("running", True),
            )
            cells.append({**c, "state": cell_state(seen, heartbeat_s)})
            self.last[c["cell"]] = (c, now)
            if c.get("since"):
                self.start = min(self.start or c["since"], c["since"])
            for kind, n in (c.get("bytes_sent") or {}).items():
                bytes_by_kind[kind] = bytes_by_kind.get(kind, 0) + n
            stage, _, replica = c["cell"][1:].partition("r")
            if P is not None and int(stage) == P - 1 and c.get("loss") is not None:
                self.losses.setdefault(replica, {})[c["step"]] = c["loss"]
        free = []
        for name in rows["free"]:
            if name not in self.last:
                free.append(name)
                continue
            row, at = self.last[name]
            age = (row["heartbeat_age_s"] or 0) + now - at
            cells.append({**row, "heartbeat_age_s": round(age, 1), "state": DEAD})
        cells.sort(key=lambda c: c["cell"])
        per_step = rows.get("tokens_per_step") or 0
        train = {
            r: thin([[s * per_step, loss] for s, loss in sorted(pts.items())])
            for r, pts in sorted(self.losses.items())
        }
        run = {**(rows.get("run") or {}), "start": self.start, "source": "DHT"}
        return {
            **rows,
            "cells": cells,
            "free": free,
            "run": run,
            "bytes_sent": bytes_by_kind,
            "curves": {"train": train, "val": {}},
            "now": now,
        }
