"""Stage pools on the simulator's logical clock: the same routing rule as the processes, driven by
emulated speeds and a schedule of deaths, deterministic for a seed.

At tick u every live stream s (stage 0's cell of replica s) sends microbatch (s, u) along a
path: with `pipeline.pool_choice = "load"` stage j's cell is drawn with probability ~ speed /
(queue + 1) (mesh/algo/routing.weights), its queue being the microbatches this tick already sent
it, by a uniform number keyed by (seed, u, s, j); with "seeded" by routing.seeded_path. With
`pipeline.pool_affinity` (load and delay) the stream's own replica's cell keeps it unless
routing.stays says that cell is clearly slower. Streams go in order; each microbatch is one update
of every cell on its path (async: a backward is an update), so a cell that takes two microbatches
in a tick steps twice and one that takes none does not step. "load" reads the weights the async
schedule's delay says (cell.step - (P-1-j) - pipeline.window[j], as the fixed grid's version_for
does: the window stands in for the staleness the processes' cell windows add); "seeded" reads
the newest, as the processes' seeded mode does one microbatch at a time, which is what makes the
two engines equal number for number.

A cell's new version is stored at the end of the tick, after the tick's averaging arrivals, as
GridSim stores it (a cell taking a second microbatch in the tick first stores what the first
left), and the rounds read the tick's clock (u + 1 after tick u, GridSim's step). So with every
cell taking one microbatch a tick (fixed routing, or equal speeds with affinity) PoolSim trains
GridSim's numbers bit for bit (tests/unit/test_pool_sim.py).

`emulation.deaths` takes cells out for spans of ticks: a dead cell is in no path and no round; a
stream whose stage-0 cell is dead issues nothing, and a microbatch that finds a stage empty is
voided (counted). A cell coming back takes the state of the most advanced live cell of its stage,
as a joiner downloads it. With `pipeline.routing = "fixed"` and deaths, each microbatch keeps to
its replica and a replica with a dead cell is stalled: the fixed grid's behaviour to compare.
Averaging is unchanged: each stage's live cells average with each other.
"""

from __future__ import annotations

import functools
from collections import Counter

import torch

from mesh.algo import routes, routing
from mesh.algo.schedule import stage_delay
from mesh.config import Config, parse_slowdowns
from mesh.data.corpus import Corpus, train_batch
from mesh.engine.cell import Cell
from mesh.engine.sim import GridSim


class PoolSim(GridSim):
    def __init__(self, cfg: Config, corpus: Corpus | None = None) -> None:
        super().__init__(cfg, corpus)
        g = cfg.grid
        self.spans = routing.parse_deaths(cfg.emulation.deaths, g.stages, g.replicas)
        self.route = routes.of(cfg.pipeline)  # chosen once: each path asks it
        self.names = [[str(i) for i in range(self.m)] for _ in range(self.P)]  # its pools
        slow = parse_slowdowns(cfg.emulation.slowdowns, g.stages, g.replicas)
        self.speed = [[1.0 / slow.get((j, i), 1.0) for i in range(self.m)] for j in range(self.P)]
        self.streamed = 0  # microbatches that reached the last stage (tokens = this x each's)
        self.voided = 0  # microbatches that found a stage with no live cell
        self.cross_replica = 0  # hops to a cell of another replica
        self.routed: Counter[tuple[int, int]] = Counter()  # cell -> microbatches it took
        self._dead: set[tuple[int, int]] = set()
        self._unstored: set[tuple[int, int]] = set()  # cells whose live weights have no version
        # each stage's delay in its own updates: the async schedule's P-1-j, plus pipeline.window's
        # extra in-flight microbatches (GridSim's version_for), the staleness a process grid's
        # cell windows add (bench pools measures it) emulated on the logical clock
        self.delays = [stage_delay("async", j, self.P, self.window) for j in range(self.P)]

    @property
    def tokens(self) -> int:
        return self.streamed * self.cfg.tokens_per_microbatch

    # ---- one tick -----------------------------------------------------------------------
    def step(self) -> float:
        u = self.update
        dead = {(j, i) for j in range(self.P) for i in range(self.m) if self._is_dead(j, i, u)}
        for j, i in sorted(self._dead - dead):
            self._revive(j, i, dead)
        self._dead = dead
        queue: Counter[tuple[int, int]] = Counter()
        losses = []
        for s in range(self.m):
            if (0, s) in dead:
                continue
            path = self._path(u, s, dead, queue)
            if path is None:
                self.voided += 1
                continue
            loss = self._microbatch(u, s, path)
            if loss is not None:
                losses.append(loss)
        for j, i in ((j, i) for j in range(self.P) for i in range(self.m) if (j, i) not in dead):
            self.cells[i][j].progress = u + 1  # the tick's updates done (GridSim: its step)
        if self.cfg.dp.mode == "param_avg" and self.m > 1:
            # a stage with one live cell launches nothing: alone is not a mean (GridSim._launch)
            for c in self._average(dead):
                self._unstored.add((c.stage, c.replica))  # its live weights moved
        self.update += 1
        for j, i in sorted(self._unstored):  # after the arrivals, as GridSim stores them
            self.cells[i][j].push_version()
        self._unstored.clear()
        if losses:
            self._last_loss = sum(losses) / len(losses)
        return self._last_loss

    def _is_dead(self, j: int, i: int, u: int) -> bool:
        return routing.dead_at(self.spans, (j, i), u)

    def _path(
        self, u: int, s: int, dead: set[tuple[int, int]], queue: Counter[tuple[int, int]]
    ) -> list[int] | None:
        """The replica index of the cell each stage gives microbatch (s, u); None: a stage
        has no live cell for it (fixed: its own replica's cell is dead)."""
        pipe, seed = self.cfg.pipeline, self.cfg.run.seed
        whole = self.route.path(seed, s, u, self.names)  # fixed or seeded: known whole
        if whole is not None:
            assert not (dead and self.route.seeded), "seeded paths draw from every cell: no deaths"
            path = [int(c) for c in whole]
            return None if any((j, i) in dead for j, i in enumerate(path)) else path
        path = [s]
        for j in range(1, self.P):
            live = [i for i in range(self.m) if (j, i) not in dead]
            if not live:
                return None
            rates, queues = [self.speed[j][i] for i in live], [queue[(j, i)] for i in live]
            own = live.index(s) if s in live else None  # the stream's own replica's cell
            if routing.stays(rates, own, pipe.pool_affinity):
                path.append(s)
                continue
            first, second = self.route.draws(functools.partial(routing.unit, seed, u, s, j))
            path.append(live[routing.choice(rates, queues, first, second)])
        for j, i in enumerate(path):
            queue[(j, i)] += 1
        return path

    def _microbatch(self, u: int, s: int, path: list[int]) -> float | None:
        """Microbatch (s, u) forward through the path's cells and back (GridSim's through_path),
        then one update of each cell its gradient reached, in stage order from the last (as the
        gradient reaches them). Its loss (None: a stage voided it, and no cell updates)."""
        cfg = self.cfg
        cells = [self.cells[i][j] for j, i in enumerate(path)]
        for c in cells:  # a second microbatch this tick reads what the first left
            if (c.stage, c.replica) in self._unstored:
                c.push_version()
                self._unstored.discard((c.stage, c.replica))
        versions = [
            c.step if self.route.seeded else max(min(c.history), c.step - self.delays[j])
            for j, c in enumerate(cells)
        ]
        batch = train_batch(
            self.corpus, cfg.run.seed, s, u, cfg.pipeline.microbatch_size, cfg.model.seq_len
        )
        self.cross_replica += sum(a != b for a, b in zip(path, path[1:]))
        mb = self._through(cells, versions, batch, u)
        for c, grads in zip(cells, mb.weights, strict=True):
            self.routed[(c.stage, c.replica)] += 1
            if grads is None:  # voided, or its gradient dropped on the way: no update
                continue
            c.progress = u  # the schedules by the data's position, as the processes do
            c.apply_update(grads)
            self._unstored.add((c.stage, c.replica))  # its version: at the tick's end
        if mb.loss is not None:
            self.streamed += 1
        return mb.loss

    def _revive(self, j: int, i: int, dead: set[tuple[int, int]]) -> None:
        """A cell back from the dead takes the state of the most advanced live cell of its
        stage (a joiner's download): weights, optimizer, drift, step; its rounds are void."""
        donors = [self.cells[r][j] for r in range(self.m) if (j, r) not in dead and r != i]
        if not donors:
            return  # nobody to copy: it goes on from its own state
        donor = max(donors, key=lambda c: (c.step, -c.replica))
        me: Cell = self.cells[i][j]
        with torch.no_grad():
            me.flat.copy_(donor.flat)
            me.drift.copy_(donor.drift)
        me.optimizer.load_state_dict(_cloned(donor.optimizer.state_dict()))
        me.step = donor.step
        me.rounds.void()
        me.history.clear()
        me.history[me.step] = me.version_weights()


def _cloned(sd: dict) -> dict:  # type: ignore[type-arg]
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}


def make_sim(cfg: Config, corpus: Corpus | None = None) -> GridSim:
    """The simulator a config needs: PoolSim for stage pools or a death schedule, else the
    fixed grid's GridSim (bit for bit what it always computed)."""
    if cfg.pipeline.pooled or cfg.emulation.deaths:
        return PoolSim(cfg, corpus)
    return GridSim(cfg, corpus)
