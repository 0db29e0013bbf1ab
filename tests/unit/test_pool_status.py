"""`meshtrain status`'s stage pools (cli/status.pool_rows) from claims, and a pooled cell's
heartbeat counters (metrics.beat_stats -> claim_stats.parse_stats)."""

from __future__ import annotations

from cli.status import pool_rows
from mesh.runtime.metrics import beat_stats
from mesh.runtime.registry import CLAIMING, CellRecord, parse_stats


def _rec(cell: str, tps: float, stats: dict | None = None, inc: int = 7) -> CellRecord:
    return CellRecord(cell, "peer", inc, 0.0, 0, 10, tps, 0.0, None, stats=stats)


def test_each_stage_pool_counts_its_running_cells_and_sums_their_capacity():
    owned = {
        "s0r0": _rec("s0r0", 100.0, {"routed": 10, "cross": 4}),
        "s0r1": _rec("s0r1", 50.0, {"routed": 10, "cross": 6}),
        "s1r0": _rec("s1r0", 80.0),
        "s1r1": _rec("s1r1", 0.0, inc=CLAIMING),  # a join still starting: not in the pool yet
        "s10r0": _rec("s10r0", 1.0),  # stage 10 is not stage 1
    }
    rows = pool_rows(owned, 2)
    assert rows == [
        {"stage": 0, "cells": 2, "capacity_tps": 150.0, "cross_replica_share": 0.5},
        {"stage": 1, "cells": 1, "capacity_tps": 80.0, "cross_replica_share": None},
    ]


def test_a_pooled_cells_heartbeat_carries_what_it_routed_across_replicas():
    row = {
        "rounds_applied": 1,
        "rounds_partial": 0,
        "rounds_failed": 0,
        "rejects": {},
        "bytes_sent": {},
        "routed": {"s1r0": 3, "s1r1": 5},
        "cross_replica": 5,
    }
    stats = parse_stats(beat_stats(row))
    assert stats is not None and stats["routed"] == 8 and stats["cross"] == 5
    assert "routed" not in (parse_stats({"routed": -1, "cross": "x"}) or {})
