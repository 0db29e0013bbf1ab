"""Stage pools: which cell of the next stage takes a microbatch, and what a pool can carry. Pure.

With `pipeline.routing = "pools"` the live cells of stage j are stage j's pool. A microbatch is
named by (stream, index): stage 0's cells are the data streams, and every cell reads a
microbatch's tokens and targets from its name, so only activations and gradients cross links.
Leaving stage j a microbatch goes to a stage-(j+1) cell drawn with probability proportional to
rate / (queue + 1) (SWARM's stochastic wiring, arXiv 2301.11913): `pick`. With replica affinity
(`pipeline.pool_affinity`) it keeps to its own replica's next cell unless that cell is clearly
slower than the best other one: `stays`. `pipeline.pool_choice =
"seeded"` draws uniformly by a pure function of the name instead (`seeded_path`): both engines
then route every microbatch the same way, which is what makes them comparable number for number.

The capacity model: a fixed grid carries the sum over replicas of each replica's slowest cell
(`fixed_bound`); pools carry the minimum over stages of the stage's summed speed (`pool_bound`).
A joiner takes the stage of least capacity (`thinnest_stage`); with `elastic.rebalance` a cell
of a stage that has held `ratio` x the thinnest stage's capacity for `after_s` moves there
(`Rebalancer`).
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from mesh.algo import topology

PRIOR_RATE = 1.0  # a cell nobody has measured yet: as fast as the measured ones' mean


def weights(rates: Sequence[float | None], queues: Sequence[int]) -> list[float]:
    """Each candidate's weight rate / (queue + 1); an unmeasured rate (None or <= 0) counts as
    the mean of the measured ones, so a newcomer gets its share from the start."""
    if len(rates) != len(queues):
        raise ValueError(f"{len(rates)} rates for {len(queues)} queues")
    out = []
    for r, queue in zip(resolved_rates(rates), queues, strict=True):
        if queue < 0:
            raise ValueError(f"queue {queue} < 0")
        out.append(r / (queue + 1))
    return out


def resolved_rates(rates: Sequence[float | None]) -> list[float]:
    """The rates weights() uses: an unmeasured one (None or <= 0) is the measured ones' mean."""
    known = [r for r in rates if r is not None and r > 0]
    prior = sum(known) / len(known) if known else PRIOR_RATE
    return [r if r is not None and r > 0 else prior for r in rates]


def pick_by_delay(rates: Sequence[float | None], queues: Sequence[int], u: float, v: float) -> int:
    """Two candidates drawn by weights (u, then v), of which the one that would finish the new
    microbatch first: the smaller (queue + 1) / rate, the first drawn on a tie (the power of
    two choices: it keeps a slow cell's queue short where a draw alone sends it its share)."""
    ws = weights(rates, queues)
    a, b = pick(ws, u), pick(ws, v)
    rs = resolved_rates(rates)
    return a if (queues[a] + 1) / rs[a] <= (queues[b] + 1) / rs[b] else b


def choice(rates: Sequence[float | None], queues: Sequence[int], u: float, v: float | None) -> int:
    """One hop's draw: by weights with u alone (`pick`); with v too, the sooner done of two
    (`pick_by_delay`). The processes and the simulator draw through it alike."""
    return pick(weights(rates, queues), u) if v is None else pick_by_delay(rates, queues, u, v)


def stays(rates: Sequence[float | None], own: int | None, affinity: float) -> bool:
    """Replica affinity (`pipeline.pool_affinity`): whether the microbatch keeps to candidate
    `own`, its own replica's next cell, rather than being routed by load. It does unless own is
    clearly slower: its time per microbatch, 1 / rate, more than `affinity` x the best other
    candidate's. With equal peers a pool is then fixed wiring, and a cell more than `affinity`
    x slower than the best of its stage sheds its stream's work to the draw.

    Never with affinity 0 (off) or own None (not a candidate: down, or full); always when own is
    the only candidate; never while a candidate's rate is unmeasured (None or <= 0): the draw
    then sends it work and its gradients bring its rate (a sender learns a cell's rate only from
    the cells it sent to, so staying from the start would never learn that its own is slow).
    Queues are not compared: every cell of a busy pipeline holds about its stream's window, and
    what a sender knows of them differs by up to the window from reporting lag alone, so
    (queue + 1) / rate did not tell equal peers from a 2x slower one at any threshold
    (docs/pools.md); a full own cell (the window) is what sheds a transient stall."""
    if affinity <= 0 or own is None:
        return False
    if len(rates) == 1:
        return True
    if any(r is None or r <= 0 for r in rates):
        return False
    measured = [float(r) for r in rates if r is not None]
    return affinity * measured[own] >= max(r for k, r in enumerate(measured) if k != own)


def pick(ws: Sequence[float], u: float) -> int:
    """The index drawn by u in [0, 1) from the weights ws (inverse CDF): index k with
    probability ws[k] / sum(ws). Zero weights are never drawn."""
    if not ws:
        raise ValueError("no candidate to pick from")
    if not 0.0 <= u < 1.0:
        raise ValueError(f"u = {u} is outside [0, 1)")
    total = sum(ws)
    if total <= 0:
        raise ValueError("every candidate has weight 0")
    target, acc = u * total, 0.0
    last = max(k for k, w in enumerate(ws) if w > 0)
    for k, w in enumerate(ws):
        acc += w
        if w > 0 and target < acc:
            return k
    return last  # rounding at the top end


def stream_window(round_trip_s: float | None, own_s: float | None, floor: int, cap: int) -> int:
    """The microbatches a stream (a stage-0 cell of a pool) keeps in flight so that its own
    device never waits (Little's law): each microbatch is out downstream for round_trip_s and
    takes own_s of this cell's compute, so ceil(round_trip_s / own_s) + 1 cover the wait,
    within [floor, cap]. floor until both are measured."""
    if not round_trip_s or not own_s:
        return floor
    return max(floor, min(cap, math.ceil(round_trip_s / own_s) + 1))


def next_window(current: int, target: int, next_starved: bool) -> int:
    """A stream's window after one look: down to `target` at once (fewer in flight is never
    wrong), up one toward it only while a cell of the next stage starves (holds nothing as the
    stream knows it). Where every next cell has work, more in flight only waits in their queues:
    staleness, and a stashed weight version each; and a window grown on a round trip that those
    queues lengthen would grow without end."""
    if target <= current:
        return target
    return current + 1 if next_starved else current


def cell_window(floor: int, cap: int, held: int, idle: bool, next_starved: bool) -> int:
    """The microbatches a cell of a later stage takes at most now (`pipeline.pool_cell_window =
    "auto"`; a sender reads it from the cell's tags): `floor` (pool_window), or one more than it
    holds, up to `cap`, while it has nothing of its own to compute (every microbatch it holds
    is out downstream: `idle`) and a cell of the next stage starves (holds nothing as this cell
    knows it). A thin stage's cells otherwise sit full and idle while the next stage waits
    (10% of a 4x8 grid dead: each spends a quarter of its time so, docs/pools.md); where every
    next cell has work, one more held only waits in their queues (staleness, and a stashed
    weight version), so the window stays at the floor there."""
    if idle and next_starved:
        return max(floor, min(cap, held + 1))
    return floor


def windows_that_fit(
    total_at_cap: float, per_microbatch: float, memory_bytes: float | None, floor: int, cap: int
) -> int:
    """The largest stream window in [floor, cap] whose stage fits memory_bytes, the stage
    needing total_at_cap at `cap` and per_microbatch less for each one fewer (a stashed weight
    version and its inputs); cap without a memory to fit (None)."""
    if memory_bytes is None or total_at_cap <= memory_bytes:
        return cap
    return max(floor, cap - math.ceil((total_at_cap - memory_bytes) / per_microbatch))


def unit(*key: int | str) -> float:
    """A uniform number in [0, 1) that is a pure function of key (the same on every peer)."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


def seeded_path(seed: int, stream: int, index: int, pools: Sequence[Sequence[str]]) -> list[str]:
    """The cells microbatch (stream, index) visits with pool_choice = "seeded": stage 0 is
    pools[0][stream] (the stream's own cell), stage j >= 1 a uniform draw from pools[j] keyed by
    (seed, stream, index, j). Every engine and every cell computes the same path."""
    path = [pools[0][stream]]
    for j in range(1, len(pools)):
        pool = pools[j]
        path.append(pool[pick([1.0] * len(pool), unit(seed, stream, index, j))])
    return path


def pool_bound(speeds: Sequence[Sequence[float]]) -> float:
    """Microbatches per unit time a pooled grid carries at most: the minimum over stages of
    the summed speed of the stage's live cells (speeds[stage][replica], 0 for a dead cell)."""
    return min(sum(stage) for stage in speeds)


def fixed_bound(speeds: Sequence[Sequence[float]]) -> float:
    """The same for fixed wiring: each replica runs at its slowest cell (0 if one is dead)."""
    replicas = len(speeds[0])
    return sum(min(stage[i] for stage in speeds) for i in range(replicas))


def thinnest_stage(capacity: Sequence[float], free: Sequence[int]) -> int | None:
    """The stage a joiner should take: of the stages with a free cell, the one of least
    capacity (ties: the lowest stage). None: no free cell anywhere."""
    open_ = [j for j, n in enumerate(free) if n > 0]
    if not open_:
        return None
    return min(open_, key=lambda j: (capacity[j], j))


def stage_capacity(rates: Mapping[str, float], stages: int) -> list[float]:
    """Each stage's capacity from its live cells' measured rates ({cell name: rate}); a cell
    not measured yet (rate <= 0: starting, or just joined) counts as the mean measured one."""
    known = [r for r in rates.values() if r > 0]
    prior = sum(known) / len(known) if known else PRIOR_RATE
    out = [0.0] * stages
    for name, rate in rates.items():
        cell = topology.Place.parse(name)
        if cell is not None and cell.stage < stages:
            out[cell.stage] += rate if rate > 0 else prior
    return out


Place = tuple[int, int]  # (stage, replica)


def thinnest_first(capacity: Sequence[float], cells: Sequence[Place]) -> list[Place]:
    """(stage, replica) cells ordered for a joiner: stage of least capacity first (ties: the
    lower stage), then by replica."""
    return sorted(cells, key=lambda c: (capacity[c[0]], c[0], c[1]))


def move_pays(kept: float, floor: float, rate: float, ratio: float) -> bool:
    """Whether moving a cell of `rate` from a stage of capacity `kept + rate` to the thinnest
    stage (capacity `floor`) is worth it: the two stages' smaller capacity rises (`kept` above
    `floor`), and afterwards neither holds `ratio` x the other, so the move is never undone by
    one back (two stages do not trade a cell back and forth). A 3:1 stage pair of equal cells
    becomes 2:2 however the measured rates jitter about equal; a 2:1 pair stays."""
    after = (kept, floor + rate)
    return kept > floor and max(after) < ratio * min(after)


@dataclass
class Rebalancer:
    """SWARM's rebalancing as a watch over the stages' capacities: `check(now, capacity,
    my_stage, my_rate)` returns (from, to) when the asking cell's stage has held at least
    `ratio` x the capacity of the thinnest stage for `after_s` without a break, and moving the
    cell (its rate from there to there) pays (`move_pays`). A move resets the watch (the pools
    change under it)."""

    ratio: float
    after_s: float
    above_since: dict[int, float] = field(default_factory=dict)

    def check(
        self, now: float, capacity: Sequence[float], my_stage: int, my_rate: float = 0.0
    ) -> tuple[int, int] | None:
        thin = min(range(len(capacity)), key=lambda j: (capacity[j], j))
        floor = capacity[thin]
        for j, c in enumerate(capacity):
            high = j != thin and c >= self.ratio * floor and (floor > 0 or c > 0)
            if not high:
                self.above_since.pop(j, None)
            else:
                self.above_since.setdefault(j, now)
        since = self.above_since.get(my_stage)
        if since is None or now - since < self.after_s:
            return None
        if not move_pays(capacity[my_stage] - my_rate, floor, my_rate, self.ratio):
            return None
        self.above_since.clear()
        return my_stage, thin


def mover(stage_cells: Mapping[str, float]) -> str | None:
    """Which cell of an over-served stage moves ({cell name: rate} of its live cells): the one
    of the highest replica, so every cell of the stage agrees without talking; None when the
    stage has fewer than two (it never empties itself)."""
    if len(stage_cells) < 2:
        return None
    named = [(topology.Place.parse(n), n) for n in stage_cells]
    return max((c.replica, n) for c, n in named if c is not None)[1]


def rebalanced(speeds: Sequence[Sequence[float]], ratio: float) -> list[list[float]]:
    """speeds[stage][replica] (0: a free cell) after rebalancing comes to rest: while a stage
    holds at least `ratio` x the thinnest stage's capacity, its mover (the highest replica,
    `mover`) takes the thinnest stage's first free cell, its speed with it, where the move pays
    (`move_pays`); a thin stage without a free cell takes nobody. The capacity model of a
    grid whose cells rebalance (what `pool_bound` of the result says they could carry)."""
    out = [list(stage) for stage in speeds]
    for _ in range(sum(len(stage) for stage in out)):  # each move fills a free cell
        capacity = [sum(stage) for stage in out]
        thin = min(range(len(out)), key=lambda j: (capacity[j], j))
        free = [i for i, v in enumerate(out[thin]) if v == 0]
        high = [j for j in range(len(out)) if j != thin and capacity[j] >= ratio * capacity[thin]]
        moves = []
        for j in sorted(high, key=lambda j: (-capacity[j], j)):
            name = mover({topology.cell_name(j, i): v for i, v in enumerate(out[j]) if v > 0})
            place = None if name is None else topology.Place.parse(name)
            if place is None:
                continue
            rate = out[j][place.replica]
            if move_pays(capacity[j] - rate, capacity[thin], rate, ratio):
                moves.append((j, place.replica, rate))
        if not free or not moves:
            break
        j, i, rate = moves[0]
        out[j][i], out[thin][free[0]] = 0.0, rate
    return out


_DEATH = re.compile(r"s(\d{1,4})r(\d{1,4})@(\d{1,9})(?:-(\d{1,9}))?")


def parse_deaths(
    items: Sequence[str], stages: int, replicas: int
) -> dict[tuple[int, int], list[tuple[int, int | None]]]:
    """emulation.deaths ["s2r1@100-300", "s0r0@50"] -> {(stage, replica): [(from, to|None)]}:
    dead from update `from` until update `to` (None: for good). ValueError naming the key."""
    out: dict[tuple[int, int], list[tuple[int, int | None]]] = {}
    for item in items:
        found = _DEATH.fullmatch(item.strip())
        if found is None:
            raise ValueError(
                f"emulation.deaths entry {item!r}: write it as sJrI@FROM or sJrI@FROM-TO "
                '(updates), e.g. "s2r1@100-300"'
            )
        j, i, start = int(found.group(1)), int(found.group(2)), int(found.group(3))
        end = None if found.group(4) is None else int(found.group(4))
        if j >= stages or i >= replicas:
            raise ValueError(
                f"emulation.deaths entry {item!r}: cell s{j}r{i} is not in the "
                f"{stages}x{replicas} grid"
            )
        if end is not None and end <= start:
            raise ValueError(f"emulation.deaths entry {item!r}: TO must be after FROM")
        out.setdefault((j, i), []).append((start, end))
    return out


Spans = Mapping[tuple[int, int], Sequence[tuple[int, int | None]]]


def dead_at(spans: Spans, cell: tuple[int, int], update: int) -> bool:
    """Whether the cell is dead at this update (parse_deaths' spans)."""
    return any(a <= update and (b is None or update < b) for a, b in spans.get(cell, ()))


def absent(spans: Spans, stages: int, replicas: int, pooled: bool) -> set[Place]:
    """The cells a process grid never starts: dead from update 0 for good (emulation.deaths
    "sJrI@0"); on a fixed grid (not pooled) their whole replica (it cannot train without
    them)."""
    gone = {c for c, s in spans.items() if any(a == 0 and b is None for a, b in s)}
    if pooled:
        return gone
    return {(j, i) for _, i in gone for j in range(stages)}


def mid_run_deaths(spans: Spans) -> list[str]:
    """The spans a process grid cannot act out, written back as "sJrI@FROM[-TO]": every one
    but a death from update 0 for good (the cells `absent` names, never started). A process
    grid kills no cell mid-run and starts none late; the simulator does both."""
    return [
        f"s{j}r{i}@{a}" + ("" if b is None else f"-{b}")
        for (j, i), s in sorted(spans.items())
        for a, b in s
        if not (a == 0 and b is None)
    ]


@dataclass
class LoadBook:
    """A sender's view of the next stage's cells: each one's last reported rate (microbatches a
    second) and the queue it reported holding for other senders, plus what this sender has
    outstanding there. Its queue estimate is the two added; `choose` draws by `weights`."""

    rate: dict[str, float] = field(default_factory=dict)
    others: dict[str, int] = field(default_factory=dict)
    mine: dict[str, int] = field(default_factory=dict)
    # the window each cell last said it takes (`cell_window`; none said: the sender's own)
    windows: dict[str, int] = field(default_factory=dict)

    def report(self, cell: str, rate: float, others_held: int, window: int = 0) -> None:
        if rate > 0:
            self.rate[cell] = rate
        self.others[cell] = max(0, others_held)
        if window > 0:
            self.windows[cell] = window

    def window_of(self, cell: str, default: int) -> int:
        return self.windows.get(cell, default)

    def sent(self, cell: str) -> None:
        self.mine[cell] = self.mine.get(cell, 0) + 1

    def back(self, cell: str) -> None:
        self.mine[cell] = max(0, self.mine.get(cell, 0) - 1)

    def queue(self, cell: str) -> int:
        return self.others.get(cell, 0) + self.mine.get(cell, 0)

    def choose(
        self,
        cells: Sequence[str],
        u: float,
        window: int | None = None,
        v: float | None = None,
        own: str | None = None,
        affinity: float = 0.0,
    ) -> str:
        """A cell drawn by rate / (queue + 1); with v, the sooner done of two so drawn
        (pick_by_delay); with `window`, among the cells whose queue as this sender knows it is
        below their window (the one each last said it takes, else `window`: a full cell would
        refuse), if any is. With `affinity` > 0, `own` (the microbatch's own replica's cell)
        whenever it has room and `stays` says so."""
        room = [
            c for c in cells if window is None or self.queue(c) < self.window_of(c, window)
        ] or list(cells)
        rates, queues = [self.rate.get(c) for c in room], [self.queue(c) for c in room]
        mine = room.index(own) if own in room else None
        if own is not None and stays(rates, mine, affinity):
            return own
        return room[choice(rates, queues, u, v)]
