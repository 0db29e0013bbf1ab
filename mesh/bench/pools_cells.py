"""Where a pooled grid's time goes, stage by stage (`meshtrain bench pools`' breakdown table).

Each cell's metrics rows carry its running totals: busy_s (emulated device time), and on a
pool cell starved_s (asleep holding nothing: no work came) and blocked_s (asleep holding only
microbatches out downstream: waiting on their answers; at stage 0 the stream window is full).
Over the steady window, from a quarter of the way to the first stream's end (every stream
feeding the grid), each share is its total's growth over the window's length (totals read
linearly between a cell's rows), and a stage's
share is its cells' weighted by speed (a fast cell idle costs more capacity than a slow one),
so a stage's busy share is its throughput over its capacity. What is left of 1 is the loop's
own time (encoding, polling, the averaging rounds).

A cell's rows carry its own life's clock; the cells of a grid start together, within a few
seconds, so the window is laid on every clock alike: the shares are a diagnosis, not a bound.
"""

from __future__ import annotations

from typing import Any

SHARES = ("busy", "starved", "blocked")


def _timed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The progress rows (a final row has the life's wall_s instead of a time_s)."""
    return [r for r in rows if "time_s" in r]


def _totals_at(rows: list[dict[str, Any]], t: float) -> dict[str, float] | None:
    """The cell's running totals at t on its clock, read linearly between its rows (zero at its
    start: a cell writes a row every few updates, a slow one seldom); past its last row, the
    last row's (None: no rows)."""
    points = [(0.0, dict.fromkeys(SHARES, 0.0))]
    points += [(r["time_s"], {k: r.get(f"{k}_s", 0.0) for k in SHARES}) for r in _timed(rows)]
    if len(points) == 1:
        return None
    for (t0, a), (t1, b) in zip(points, points[1:]):
        if t <= t1:
            w = 0.0 if t1 <= t0 else max(0.0, t - t0) / (t1 - t0)
            return {k: a[k] + w * (b[k] - a[k]) for k in SHARES}
    return points[-1][1]


def steady_window(rows: dict[tuple[int, int], list[dict[str, Any]]]) -> tuple[float, float]:
    """(start, end) on the cells' clocks: from a quarter of the way to the first stream's end,
    or from the last cell's first row if later (a cell's clock starts before its transport
    and its first microbatch: no time before its first row counts), to that end."""
    timed = {k: _timed(rs) for k, rs in rows.items()}
    ends = [rs[-1]["time_s"] for (j, _), rs in timed.items() if j == 0 and rs]
    end = min(ends, default=0.0)
    firsts = [rs[0]["time_s"] for rs in timed.values() if rs]
    return min(end, max([0.25 * end, *firsts])), end


def cell_shares(rows: list[dict[str, Any]], start: float, end: float) -> dict[str, float] | None:
    """The cell's busy, starved and blocked shares of [start, end] (None: no rows, or an empty
    window)."""
    a, b = _totals_at(rows, start), _totals_at(rows, end)
    if a is None or b is None or end <= start:
        return None
    return {k: (b[k] - a[k]) / (end - start) for k in SHARES}


def stage_shares(
    rows: dict[tuple[int, int], list[dict[str, Any]]], speeds: list[list[float]]
) -> list[dict[str, Any]]:
    """Per stage: its live capacity (summed speeds) and its busy, starved and blocked shares
    over the steady window, weighted by the cells' speeds."""
    start, end = steady_window(rows)
    out = []
    for j, stage in enumerate(speeds):
        got = [(s, cell_shares(rows.get((j, i), []), start, end)) for i, s in enumerate(stage)]
        got = [(s, c) for s, c in got if s > 0 and c is not None]
        weight = sum(s for s, _ in got)
        shares = {
            k: round(sum(s * c[k] for s, c in got) / weight, 3) if weight else None for k in SHARES
        }
        out.append({"stage": j, "capacity": round(sum(stage), 3), "cells": len(got), **shares})
    return out


def bottleneck(stages: list[dict[str, Any]]) -> dict[str, Any]:
    """The stage with the least capacity (the pool bound's), the first of a tie."""
    return min(stages, key=lambda s: s["capacity"])
