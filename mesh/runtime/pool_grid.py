"""A pooled cell's view of the grid around it on hivemind (mesh/runtime/pool.py): the cells
with a live claim, whether it should move to the thinnest stage (elastic.rebalance), and its
routing counters in a metrics row."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from mesh.algo import routing
from mesh.algo.topology import cell_name, stage_of
from mesh.config import Config
from mesh.runtime.pool_wire import PoolStats
from mesh.runtime.registry import running
from mesh.runtime.session import DhtCoordinator
from mesh.runtime.stage_stats import StageStats


def pool_members(coord: DhtCoordinator, max_age_s: float) -> Callable[[], set[str] | None]:
    """The cells with a live claim, as the heartbeat thread last read them (None: no read
    yet, or the DHT did not answer: unknown, never "left")."""

    def live() -> set[str] | None:
        owned = coord.cached_owners(4 * max_age_s)
        return None if owned is None else {c for c, rec in owned.items() if running(rec)}

    return live


def pool_move(
    coord: DhtCoordinator, cfg: Config, stage: int, replica: int, watch: routing.Rebalancer
) -> int | None:
    """The stage this pooled cell should move to now (elastic.rebalance), or None: its stage
    has held rebalance_ratio x the thinnest stage's capacity for rebalance_after_s, the move
    raises the bottleneck, it is the stage's mover (routing.mover: all agree which) and the
    thin stage has a free cell."""
    owned = coord.cached_owners(4 * cfg.elastic.heartbeat_s)
    if owned is None:
        return None  # unknown: never a move on a read that failed
    rates = {c: rec.tps for c, rec in owned.items() if running(rec)}
    me = cell_name(stage, replica)
    verdict = watch.check(
        time.monotonic(), routing.stage_capacity(rates, cfg.grid.stages), stage, rates.get(me, 0.0)
    )
    if verdict is None:
        return None
    mine = {c: r for c, r in rates.items() if stage_of(c) == stage}
    to = verdict[1]
    free = [i for i in range(cfg.grid.replicas) if cell_name(to, i) not in owned]
    return to if routing.mover(mine) == me and free else None


def pool_row(st: StageStats) -> dict[str, Any]:
    """A pool cell's routing counters ({} on a fixed grid): where its microbatches went."""
    if not isinstance(st, PoolStats):
        return {}
    return {
        "routed": dict(st.routed),
        "cross_replica": st.cross_replica,
        "refused": st.refused,
        "rerouted": st.rerouted,
        "voided": st.voided,
        "held_peak": st.held_peak,
        "window_peak": st.window_peak,
        "starved_s": round(st.starved_s, 3),
        "blocked_s": round(st.blocked_s, 3),
    }
