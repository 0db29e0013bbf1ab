"""The dashboard's JSON of a live WAN run: `meshtrain status --json` rows (cli/status.py, read
from the DHT at each poll) with each cell's state, the cells this dashboard saw die, and the
training loss curves it gathered from the heartbeats since it started.

A claim that stops beating expires from the DHT after 4 heartbeats and its cell reads as free;
a cell this dashboard saw held and no longer sees is shown dead (with what it last showed)
until someone claims it again: a peer that vanished is what a user watching needs to see. Not
before its last heartbeat is as old as a dead peer's, though: a read that misses a fresh claim
(a DHT under load answers without some records) keeps the state the cell last showed. A
peer that stopped cleanly withdrew its claim (status's `released`, checked against the signer
of the claim this dashboard saw): its cell is free, as `meshtrain status` says.

Bytes sent per link kind sum every peer this dashboard saw, the ones that left included (with
the totals they last reported), so the totals never go down when a peer leaves.

imports: stdlib, mesh.algo.topology, this package's state and rundir (thin).
"""

from __future__ import annotations

from typing import Any

from mesh.algo.topology import Place
from mesh.runtime.dashboard.rundir import SentTotals, thin
from mesh.runtime.dashboard.state import DEAD, Seen, StepClock, cell_state

DEFAULT_HEARTBEAT_S = 1.0  # elastic.heartbeat_s's default, when the run's record is unreadable


def missed(row: dict[str, Any], age_s: float, heartbeat_s: float) -> str:
    """The state of a cell this dashboard saw held and a read now finds free, its last heartbeat
    age_s old: dead once a live peer's heartbeat cannot be that old (cell_state's rule), before
    that the state it last showed. A claim expires 4 beats after its last heartbeat, so a read
    that misses a fresher one missed it (a DHT read under load answers without every record)."""
    if cell_state(Seen(claimed=True, heartbeat_age_s=age_s), heartbeat_s) == DEAD:
        return DEAD
    return row.get("state") or DEAD


class LiveView:
    """Turns successive status rows into the dashboard's JSON (state kept between polls)."""

    def __init__(self) -> None:
        self.clock = StepClock()
        self.last: dict[str, tuple[dict[str, Any], float]] = {}  # cell -> (row, seen at)
        self.losses: dict[str, dict[int, float]] = {}  # replica -> step -> loss
        self.start: float | None = None
        self.sent = SentTotals()  # by (cell, peer): a peer that left keeps its last totals

    def json(self, rows: dict[str, Any], now: float) -> dict[str, Any]:
        heartbeat_s = (rows.get("run") or {}).get("heartbeat_s") or DEFAULT_HEARTBEAT_S
        P = int(rows["grid"].split("x")[0]) if rows.get("grid") else None
        cells = []
        for c in rows["cells"]:
            seen = Seen(
                claimed=True,
                heartbeat_age_s=c["heartbeat_age_s"],
                step_still_s=self.clock.still_s(c["cell"], c["step"], now),
                loading=not c.get("running", True),
            )
            cells.append({**c, "state": cell_state(seen, heartbeat_s)})
            self.last[c["cell"]] = (cells[-1], now)
            if c.get("since"):
                self.start = min(self.start or c["since"], c["since"])
            self.sent.see((c["cell"], c["peer"]), c.get("bytes_sent") or {})
            place = Place.parse(c["cell"])
            last_stage = place is not None and P is not None and place.stage == P - 1
            if last_stage and c.get("loss") is not None:
                self.losses.setdefault(str(place.replica), {})[c["step"]] = c["loss"]
        free = []
        released = rows.get("released") or {}
        for name in rows["free"]:
            if name in self.last and self.last[name][0].get("signer") in released.get(name, []):
                del self.last[name]  # its peer stopped cleanly: free, not dead
            if name not in self.last:
                free.append(name)
                continue
            row, at = self.last[name]
            age = (row["heartbeat_age_s"] or 0) + now - at
            cells.append(
                {**row, "heartbeat_age_s": round(age, 1), "state": missed(row, age, heartbeat_s)}
            )
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
            "bytes_sent": self.sent.total(),
            "curves": {"train": train, "val": {}},
            "now": now,
        }
