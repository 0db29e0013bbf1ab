"""Stage pools over hivemind: a grid of `meshtrain join`s on 127.0.0.1 with pipeline.routing =
"pools". Joins fill the thinnest stage; a killed cell's stream keeps training through the other
cells of that stage within seconds (no stall until a replacement joins); `status` shows each
stage's pool."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from mesh.runtime.metrics import read_metrics
from mesh.testing.local_peers import (
    LOOPBACK,
    PACE_MS,
    cell_of,
    kill,
    meshtrain,
    rows,
    start_dht,
    status,
    step,
    stop,
    tiny_grid_config,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HANG_S = 90


@dataclass
class PooledJoins:
    """A bootstrap node of a pooled tiny grid and its joins (`join(name, *args)`; the first
    brings `config`)."""

    tmp: Path
    config: Path
    maddr: str
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def join(self, name: str, *extra: str) -> None:
        log = (self.tmp / f"{name}.log").open("w")
        self.procs[name] = meshtrain(
            "join",
            "--initial-peers",
            self.maddr,
            *LOOPBACK,
            "--out",
            str(self.tmp / name),
            *extra,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        if name == "j0":  # the run's record is in the DHT before the others ask for it
            wait_for(lambda: "joined run" in (self.tmp / "j0.log").read_text(), 60, "a claim")


@contextlib.contextmanager
def pooled_joins(tmp: Path, text_file: Path, replicas: int, local: str) -> Iterator[PooledJoins]:
    """A 2 x `replicas` pooled grid's bootstrap node; every process stopped at the end."""
    cfg = tiny_grid_config(tmp, text_file, replicas=replicas, min_compute_ms=PACE_MS, local=local)
    cfg.write_text(cfg.read_text().replace("[pipeline]", '[pipeline]\nrouting = "pools"'))
    dht, maddr = start_dht()
    grid = PooledJoins(tmp, cfg, maddr)
    try:
        yield grid
    finally:
        for p in grid.procs.values():
            stop(p)
        stop(dht)


@pytest.mark.timeout(600)  # a hang guard: six joins and a kill on a loaded box
def test_pooled_joins_route_around_a_killed_cell(text_file, tmp_path):
    """2 stages x 3 replicas of joins: the first join's config makes it pools; the joins
    without --stage fill the stages evenly (thinnest first); s1 cells carry all streams;
    SIGKILL of one stage-1 cell: within seconds every stream trains on through the two others
    (its replica never waits for a replacement), and `status` shows the pools."""
    with pooled_joins(tmp_path, text_file, 3, "elastic.pool_timeout_s = 4") as grid:
        maddr, joins, join = grid.maddr, grid.procs, grid.join
        join("j0", "--config", str(grid.config))
        for name in ("j1", "j2", "j3", "j4", "j5"):
            join(name)
            wait_for(lambda n=name: cell_of(tmp_path / n) is not None, HANG_S, f"{name}'s cell")
        outs = {n: tmp_path / n for n in joins}
        cells = {n: cell_of(o) for n, o in outs.items()}
        # the thinnest stage first: three cells in each stage, whatever the order
        assert sorted(j for j, _ in cells.values()) == [0, 0, 0, 1, 1, 1], cells
        wait_for(lambda: all(step(o) >= 20 for o in outs.values()), 3 * HANG_S, "all training")
        grid = status(maddr)
        pools = {p["stage"]: p for p in grid["pools"]}
        assert set(pools) == {0, 1} and all(p["cells"] == 3 for p in pools.values()), grid
        assert all(p["capacity_tps"] > 0 for p in pools.values()), pools
        # paced as on devices: each forward and backward took at least PACE_MS
        paced = [r for r in rows(outs["j0"]) if r.get("microbatches")][-1]
        assert paced["busy_s"] >= 0.9 * paced["microbatches"] * 2 * PACE_MS / 1e3, paced
        victim = next(n for n, c in cells.items() if c == (1, 1))
        streams = [n for n, c in cells.items() if c[0] == 0]
        survivors = [n for n, c in cells.items() if c[0] == 1 and n != victim]
        kill(joins.pop(victim))
        killed_at = time.monotonic()
        at_kill = {n: step(outs[n]) for n in (*streams, *survivors)}
        # every stream goes on (replica 1's through the other replicas' cells), within seconds
        wait_for(
            lambda: all(step(outs[n]) >= at_kill[n] + 15 for n in streams),
            HANG_S,
            "every stream training on without s1r1",
        )
        took_s = time.monotonic() - killed_at
        # the two live stage-1 cells carried the three streams' microbatches: each took work
        assert all(step(outs[n]) > at_kill[n] for n in survivors), (at_kill, survivors)

        # the killed cell's claim expires, the others' stay (stage 1 down to 2 cells, stage 0
        # at 3): one read of a loaded DHT can miss a live claim whose heartbeat is late, so the
        # pools are read until they are so
        def pools_now() -> dict:
            return {p["stage"]: p["cells"] for p in status(maddr)["pools"]}

        wait_for(lambda: pools_now() == {0: 3, 1: 2}, HANG_S, "s1r1's claim expired alone")
        for n in streams:
            events = [r.get("event") for r in rows(outs[n])]
            assert "session_broken" not in events, (n, events)
        assert took_s < HANG_S


@pytest.mark.timeout(600)  # a hang guard: four joins, a move and a state download
def test_rebalancing_moves_a_cell_to_the_thinnest_stage(text_file, tmp_path):
    """2 stages x 3 replicas, elastic.rebalance on: three joins hold stage 0 and one stage 1
    (3:1 capacity). The stage-0 cell of the highest replica moves (an event, and `join` says
    so), downloads stage 1's state as a joiner does, and the grid trains on 2:2."""
    local = "elastic.pool_timeout_s = 4\nelastic.rebalance = true\nelastic.rebalance_after_s = 3"
    with pooled_joins(tmp_path, text_file, 3, local) as grid:
        maddr, joins, join = grid.maddr, grid.procs, grid.join
        join("j0", "--config", str(grid.config), "--stage", "0")
        for name, stage in (("j1", "0"), ("j2", "0"), ("j3", "1")):
            join(name, "--stage", stage)
        logs = {n: tmp_path / f"{n}.log" for n in joins}
        wait_for(
            lambda: any("moving to stage 1" in p.read_text() for p in logs.values()),
            3 * HANG_S,
            "a stage-0 cell moving",
        )
        movers = [n for n, p in logs.items() if "moving to stage 1" in p.read_text()]
        assert len(movers) == 1, movers
        out = tmp_path / movers[0]
        every_cell = read_metrics(out, events=True).values()  # "moved" is its old cell's row
        events = [r for v in every_cell for r in v if r.get("event") == "moved"]
        assert events and events[0]["from_stage"] == 0 and events[0]["to_stage"] == 1, events

        def pools_now() -> dict:
            return {p["stage"]: p["cells"] for p in status(maddr)["pools"]}

        wait_for(lambda: pools_now() == {0: 2, 1: 2}, 2 * HANG_S, "the pools at 2:2")
        moved_cell = [c for c in status(maddr)["cells"] if c["cell"].startswith("s1r")]
        assert len(moved_cell) == 2

        def now_step(n: str) -> int:  # the mover's directory holds its old cell's rows too
            cells = read_metrics(tmp_path / n)
            mine = [v for (j, _), v in cells.items() if n not in movers or j == 1]
            return max((r["step"] for v in mine for r in v if "step" in r), default=0)

        at = {n: now_step(n) for n in joins}
        wait_for(
            lambda: all(now_step(n) > at[n] + 5 for n in joins),
            2 * HANG_S,
            "every cell training after the move",
        )
        new_cell = [v for (j, _), v in read_metrics(out, events=True).items() if j == 1]
        loaded = [r for v in new_cell for r in v if r.get("event") == "state_loaded"]
        assert loaded, "the mover downloaded stage 1's state"
