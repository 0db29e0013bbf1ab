"""A cell's lives in its metrics file: every process that ran the cell (a restart after a kill,
a `--resume`, a `join` started again) appends to the same file, its rows after a `started` event
(whose step is where that life began: the checkpoint it loaded, 0 for a fresh one). That event is
each row's life mark:

- a later life that began at step s replays every step after s, so an earlier life's update rows
  past s are superseded: `without_replayed` drops them on read (one row per step, the one whose
  state the run went on from);
- a row's counters (bytes sent, rounds, rejects, microbatches, a pooled cell's routing) count
  from its process's start, so a cell's totals are the sum over its lives of each life's last
  counters (`cell_totals`): the bytes a replayed step sent were sent twice, and count twice.

Pure functions of the rows (mesh.runtime.metrics reads them).

imports: stdlib.
"""

from __future__ import annotations

from typing import Any

Row = dict[str, Any]
ROUNDS = ("rounds_started", "rounds_applied", "rounds_partial", "rounds_failed")
# a pooled cell's routing counters (mesh.runtime.pool_grid.pool_row; "routed" summed over the
# next cells): microbatches sent on, of them to another replica's cell, refusals it sent (it
# was full), microbatches it sent again elsewhere, and those it gave up
POOL = ("routed", "cross_replica", "refused", "rerouted", "voided")


def is_update(row: Row) -> bool:
    return "event" not in row and not row.get("final") and isinstance(row.get("step"), int)


def split_lives(rows: list[Row]) -> list[list[Row]]:
    """A cell's rows (events included, in file order) cut into lives, each from its `started`
    event on (rows before the first one: a life of their own)."""
    lives: list[list[Row]] = []
    for row in rows:
        if row.get("event") == "started" or not lives:
            lives.append([])
        lives[-1].append(row)
    return [life for life in lives if life]


def life_start(life: list[Row]) -> int:
    """The step a life began at: its `started` event's, else one before its first update."""
    head = life[0]
    if head.get("event") == "started" and isinstance(head.get("step"), int):
        return head["step"]
    first = next((r["step"] for r in life if is_update(r)), 1)
    return max(first - 1, 0)


def without_replayed(rows: list[Row]) -> list[Row]:
    """The rows less the update rows a later life replayed (step past that life's start);
    events and final rows stay."""
    lives = split_lives(rows)
    out: list[Row] = []
    for k, life in enumerate(lives):
        later = [life_start(x) for x in lives[k + 1 :]]
        cut = min(later) if later else None
        out += [r for r in life if cut is None or not is_update(r) or r["step"] <= cut]
    return out


def life_totals(life: list[Row]) -> Row:
    """One life's counters: updates trained, microbatches, rounds (its last update row), bytes
    sent and rejects (its final row, written after its sends drained; or its `stopped` event;
    or its last update row), a pooled cell's routing counters (POOL: its last row that has
    them, the final one or an update's)."""
    updates = [r for r in life if is_update(r)]
    last = updates[-1] if updates else {}
    end = next((r for r in reversed(life) if r.get("final") or r.get("event") == "stopped"), last)
    pool = next((r for r in reversed(life) if "routed" in r and "event" not in r), {})
    return {
        "steps": len(updates),  # one row per update (a state download jumps steps)
        "microbatches": int(last.get("microbatches", 0)),
        **{k: int(last.get(k, 0)) for k in ROUNDS},
        "routed": sum(int(n) for n in (pool.get("routed") or {}).values()),
        **{k: int(pool.get(k, 0)) for k in POOL[1:]},
        "bytes_sent": dict(end.get("bytes_sent") or last.get("bytes_sent") or {}),
        "rejects": dict(end.get("rejects") or last.get("rejects") or {}),
    }


def add_counts(into: dict[str, int], more: dict[str, Any]) -> dict[str, int]:
    for k, n in more.items():
        into[k] = into.get(k, 0) + int(n)
    return into


def cell_totals(rows: list[Row]) -> Row:
    """A cell's counters over every life (see the module docstring), and how many lives."""
    lives = [life_totals(life) for life in split_lives(rows)]
    total: Row = {k: sum(x[k] for x in lives) for k in ("steps", "microbatches", *ROUNDS, *POOL)}
    total["bytes_sent"], total["rejects"] = {}, {}
    for x in lives:
        add_counts(total["bytes_sent"], x["bytes_sent"])
        add_counts(total["rejects"], x["rejects"])
    total["lives"] = len(lives)
    return total
