"""Routing as one component: fixed wiring, or stage pools drawing by load, by delay or by seed.
`of(pipeline)` chooses it once from the config's slice, where a run is wired
(mesh/runtime/wiring.py, worker_settings.py) and where the simulator is built
(mesh/engine/pools.py); every other place asks the component, never the config's names. The
math it draws with is mesh/algo/routing.py's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from mesh.algo import routing

if TYPE_CHECKING:
    from mesh.config_sections import PipelineConfig

Draw = Callable[..., float]  # a uniform number in [0, 1); a key names the second of two
Columns = Sequence[Sequence[str]]  # each stage's cells


class Routing:
    """Fixed wiring: stage j of replica i sends only to stage j+1 of replica i."""

    # a stage's live cells share its work: its links, the cells a death takes out, the
    # restarts, the heartbeat's capacity and the routing counters follow from this
    pooled = False
    # every path a pure function of the microbatch's name, each cell taking its microbatches
    # one at a time on the newest weights: what lets the simulator reproduce a process grid
    seeded = False

    def path(self, seed: int, stream: int, index: int, pools: Columns) -> list[str] | None:
        """The cells microbatch (stream, index) visits, known before it starts (None: drawn
        stage by stage as it goes, `draws`); fixed: its own replica's chain."""
        return [pool[stream] for pool in pools]

    def absent(self, spans: routing.Spans, stages: int, replicas: int) -> set[routing.Place]:
        """The cells a process grid never starts (routing.absent)."""
        return routing.absent(spans, stages, replicas, self.pooled)


class Pools(Routing):
    """pool_choice = load: the next cell drawn by rate / (queue + 1) (SWARM's wiring)."""

    pooled = True

    def path(self, seed: int, stream: int, index: int, pools: Columns) -> list[str] | None:
        return None

    def draws(self, draw: Draw) -> tuple[float, float | None]:
        """The uniform numbers one hop takes (routing.choice's u and v): one here."""
        return draw(), None


class DelayPools(Pools):
    """pool_choice = delay: the sooner done of two cells drawn by load (routing.pick_by_delay)."""

    def draws(self, draw: Draw) -> tuple[float, float | None]:
        second = draw("second")  # drawn first: the processes' draws keep their order
        return draw(), second


class SeededPools(Pools):
    """pool_choice = seeded: every path drawn uniformly by a pure function of the name."""

    seeded = True

    def path(self, seed: int, stream: int, index: int, pools: Columns) -> list[str] | None:
        return routing.seeded_path(seed, stream, index, pools)


FIXED = Routing()
_POOLS = {"load": Pools(), "delay": DelayPools(), "seeded": SeededPools()}


def of(pipeline: PipelineConfig) -> Routing:
    """The routing pipeline.routing and pipeline.pool_choice name."""
    return _POOLS[pipeline.pool_choice] if pipeline.pooled else FIXED
