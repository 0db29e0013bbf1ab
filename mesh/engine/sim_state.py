"""What the one-process simulator (sim.py) keeps beyond a cell's checkpoint, so a logical run
resumed from its checkpoints continues exactly as the uninterrupted run would.

A checkpoint (mesh/runtime/checkpoint.py) holds what a cell process resumes from: the weights,
the drift buffer, the stashed versions, the optimizer's state and the step. A cell process
resumes without its averaging rounds in flight (their peers' handles died with the old
processes) and with a fresh pipeline sentinel (it learns its neighbours again). The simulator
has no handles to lose: each round's mean is known from its launch. So beside each cell's
checkpoint, under the key `simulator`, a logical run saves:

- the cell's rounds in flight (up to dp.tau / dp.interval_steps of them), each with its mean;
- its sentinel's statistics per sender and message kind (sentinel.enabled: a verdict depends
  on everything the cell accepted before);
- its clip count, whether its last update stalled, the deviation bound's window (dp.outlier_k);
- the grid's counters (bytes sent, rejects, the last training loss), the same in every cell's.

Everything is plain values and tensors (torch.load(..., weights_only=True) reads it back), and
everything read back is checked before it is used (ValueError, nothing changed, otherwise).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch

from mesh.algo.sentinel_state import load_sentinel_state, sentinel_state
from mesh.engine.cell import Cell
from mesh.engine.rounds import Round, RoundBook

if TYPE_CHECKING:
    from mesh.engine.sim import GridSim

VERSION = 1
KEY = "simulator"  # the checkpoint's key of this state


def cell_extras(sim: GridSim, cell: Cell) -> dict[str, Any]:
    """The simulator's state of `cell` (its own tensors, not copies: saved at once)."""
    rounds = [
        {
            "index": r.index,
            "launch_step": r.launch_step,
            "indices": r.indices,
            "snapshot": r.snapshot,
            "payload_bytes": r.payload_bytes,
            "mean": r.mean,
            "sent": r.sent,
            "own": r.own,
        }
        for r, _ in cell.rounds.entries
    ]
    return {
        "version": VERSION,
        "rounds": rounds,
        "sentinel": None if cell.sentinel is None else sentinel_state(cell.sentinel),
        "clipped": cell.clipped,
        "stalled": cell.stalled,
        "distances": list(cell.distances),
        "grid": {
            "update": sim.update,
            "pp_bytes": sim.pp_bytes,
            "dp_bytes": float(sim.dp_bytes),
            "rejects": dict(sim.rejects),
            "verdicts": dict(sim.verdicts),
            "last_loss": float(sim._last_loss),
        },
    }


def restore(sim: GridSim, extras: dict[tuple[int, int], Any]) -> None:
    """Put every cell's simulator state back (the cells already loaded from their checkpoints,
    all at one step); ValueError when a cell's is missing or malformed."""
    step = sim.cells[0][0].step
    cells = [cell for row in sim.cells for cell in row]
    plans = [_checked(cell, extras.get((cell.stage, cell.replica)), step) for cell in cells]
    grid = _checked_grid(extras[(0, 0)].get("grid"), step)
    for cell, (rounds, saved_sentinel, distances) in zip(cells, plans, strict=True):
        state = extras[(cell.stage, cell.replica)]
        book: RoundBook = RoundBook(sim.cfg.dp.tau)
        for rnd in rounds:
            book.launch(rnd, None)
        cell.rounds = book
        if cell.sentinel is not None:
            load_sentinel_state(cell.sentinel, saved_sentinel)
        cell.clipped, cell.stalled = state["clipped"], state["stalled"]
        cell.distances.clear()
        cell.distances.extend(distances)
    sim.update = grid["update"]
    sim.pp_bytes, sim.dp_bytes = grid["pp_bytes"], grid["dp_bytes"]
    sim.rejects, sim.verdicts = Counter(grid["rejects"]), Counter(grid["verdicts"])
    sim._last_loss = grid["last_loss"]


def _checked(cell: Cell, state: Any, step: int) -> tuple[list[Round], Any, list[float]]:
    name = f"cell s{cell.stage}r{cell.replica}"
    if not isinstance(state, dict) or state.get("version") != VERSION:
        raise ValueError(f"{name}: its checkpoint holds no simulator state of this version")
    if cell.step != step:
        raise ValueError(f"{name}: at step {cell.step}, the grid at {step}")
    if not (isinstance(state.get("clipped"), int) and isinstance(state.get("stalled"), bool)):
        raise ValueError(f"{name}: malformed simulator state (clipped, stalled)")
    distances = state.get("distances")
    if not isinstance(distances, list) or not all(isinstance(d, float) for d in distances):
        raise ValueError(f"{name}: malformed simulator state (distances)")
    if (cell.sentinel is None) != (state.get("sentinel") is None):
        raise ValueError(f"{name}: the saved sentinel state does not match sentinel.enabled")
    entries = state.get("rounds")
    if not isinstance(entries, list):
        raise ValueError(f"{name}: malformed simulator state (rounds)")
    rounds = [_round(cell, e, name) for e in entries]
    if any(a.launch_step > b.launch_step for a, b in zip(rounds, rounds[1:], strict=False)):
        raise ValueError(f"{name}: rounds in flight out of launch order")
    return rounds, state.get("sentinel"), distances


def _round(cell: Cell, e: Any, name: str) -> Round:
    """One round in flight from its saved entry, its tensors checked against the stage."""
    bad = ValueError(f"{name}: malformed round in flight in its simulator state")
    if not isinstance(e, dict) or not all(
        isinstance(e.get(k), int) for k in ("index", "launch_step", "payload_bytes")
    ):
        raise bad
    idx = e.get("indices")
    if not (isinstance(idx, torch.Tensor) and idx.dtype == torch.int64 and idx.ndim == 1):
        raise bad
    k, n = idx.numel(), cell.flat.numel()
    if k and (int(idx.min()) < 0 or int(idx.max()) >= n):
        raise bad
    vectors = [e.get(x) for x in ("snapshot", "mean")]
    vectors += [e[x] for x in ("sent", "own") if e.get(x) is not None]
    if not all(
        isinstance(v, torch.Tensor) and v.shape == (k,) and v.is_floating_point() for v in vectors
    ):
        raise bad
    return Round(
        e["index"],
        e["launch_step"],
        idx,
        e["snapshot"],
        e["payload_bytes"],
        mean=e["mean"],
        sent=e.get("sent"),
        own=e.get("own"),
    )


def _checked_grid(grid: Any, step: int) -> dict[str, Any]:
    bad = ValueError("malformed simulator state (the grid's counters)")
    if not isinstance(grid, dict) or grid.get("update") != step:
        raise bad
    if not (isinstance(grid.get("pp_bytes"), int) and isinstance(grid.get("dp_bytes"), float)):
        raise bad
    for key in ("rejects", "verdicts"):
        counts = grid.get(key)
        if not isinstance(counts, dict) or not all(
            isinstance(k, str) and isinstance(v, int) for k, v in counts.items()
        ):
            raise bad
    if not isinstance(grid.get("last_loss"), float) or math.isinf(grid["last_loss"]):
        raise bad
    return grid
