"""A cell's averaging rounds (the StageWorker's part that launches, applies and drops them).

Role: the averaging of the real runtime: every interval updates the cell launches the
round the column's round clock says (mesh/algo/round_clock.py) through the transport's
non-blocking mean; each round is applied tau or more updates later, in launch order, with the
simulator's drift correction (mesh/engine/cell.py). A round still missing a member
dp.max_round_lag_steps updates after it was due is cut and applied over what it has; a failed
round is counted and dropped. With dp.strict_tau a due round is waited for, as the simulator
assumes, so a run reproduces its numbers.

A cell's worker (mesh/runtime/stage.py) holds one Rounds, built from the averaging's slice of
the config (RoundSettings) and the cell, transport, counters and column it works on.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from comms.means import alone
from comms.transport import MeanResult, MeanStatus
from mesh.algo import round_clock, sparse
from mesh.algo.topology import cell_name, group_name
from mesh.engine.rounds import Action, Round, after_update, round_index

if TYPE_CHECKING:
    from comms.transport import Transport
    from mesh.config import Config, DPConfig
    from mesh.engine.cell import Cell
    from mesh.runtime.emulate import ComputeClock
    from mesh.runtime.stage_stats import StageStats

PACE_N = 32  # launch opportunities a pace is measured over


def skipped_rounds(old_step: int, new_step: int, interval_steps: int) -> range:
    """The averaging rounds a cell never launches when its state jumps from old_step to
    new_step (a download). Update u (0-based) launches round u // interval when u % interval
    == 0, and a cell at step s has done updates 0..s-1: it launched rounds below
    ceil(s / interval) and will launch those from ceil(new_step / interval) on."""
    return range(-(-old_step // interval_steps), -(-new_step // interval_steps))


@dataclass(frozen=True)
class RoundSettings:
    """The averaging's slice of the config: all a cell's rounds read."""

    dp: DPConfig
    round_timeout_s: float  # transport.round_timeout_s: a round's deadline
    last_update: int  # run.steps - 1: the rounds end with the run's last update

    @classmethod
    def of(cls, cfg: Config) -> RoundSettings:
        return cls(cfg.dp, cfg.transport.round_timeout_s, cfg.run.steps - 1)


class Rounds:
    """One cell's averaging rounds over its stage's column (itself included)."""

    def __init__(
        self,
        settings: RoundSettings,
        cell: Cell,
        transport: Transport,
        stats: StageStats,
        column: list[str],
        emu: ComputeClock | None = None,
    ) -> None:
        self.settings, self.dp = settings, settings.dp
        self.cell, self.transport, self.stats, self.column, self.emu = (
            cell,
            transport,
            stats,
            column,
            emu,
        )
        self.j, self.me = cell.stage, cell_name(cell.stage, cell.replica)
        self.last_round: int | None = None  # the round id launched last (round_clock.py)
        dp = self.dp
        self._jump_after = (
            round_clock.NEVER  # strict: rounds at the cell's own steps, as in the simulator
            if dp.strict_tau
            else round_clock.jump_threshold(dp.tau, dp.max_round_lag_steps, dp.interval_steps)
        )
        self._parts = sparse.num_parts(dp.fraction) if dp.selector == "partition" else None
        # (time, round id) at each launch opportunity: this cell's pace and its partners'
        self._own_pace: collections.deque[tuple[float, int]] = collections.deque(maxlen=PACE_N)
        self._seen_pace: collections.deque[tuple[float, int]] = collections.deque(maxlen=PACE_N)
        # the partners' pace is counted in the rounds they launch, not in how far the newest
        # round id moved: a trailer that jumps moves it as fast as the leader does, and a leader
        # that read that as a partner keeping up would never bound its lead, so the trailer
        # would keep jumping (a 3x slower replica met a third of its rounds so, 1 run in 3)
        self._seen_newest, self._seen_launches = -1, 0

    def drop(self, old_step: int) -> None:
        """After the cell's state was replaced (it was at old_step): rounds launched on the old
        state are void, and the other replicas' payloads for the rounds the jump skipped will
        never be taken: they go now, not when the mailbox's ttl runs out (the soak saw ~160 of
        them held for 10 minutes by every cell whose replica had re-formed)."""
        self.stats.rounds_failed += self.cell.rounds.void()
        if self.dp.mode == "param_avg" and len(self.column) > 1:
            skipped = skipped_rounds(old_step, self.cell.step, self.dp.interval_steps)
            if self.last_round is not None:  # the round clock may have run ahead of old_step
                skipped = range(max(skipped.start, self.last_round + 1), skipped.stop)
            self.transport.void_rounds(group_name(self.j), self.column, skipped)

    def next_round(self, own_round_id: int) -> None:
        """Launch the round the shared clock says (mesh/algo/round_clock.py): this cell's own
        count while it keeps up with its column, the newest round a peer launched once it
        trails it by jump_after rounds. The rounds jumped over will never be run here: the
        peers' payloads for them are dropped now, not held until the mailbox's ttl."""
        group = group_name(self.j)
        newest = self.transport.newest_round(group, self.column)
        lead = self._lead(own_round_id, newest)
        round_id = round_clock.next_round(
            own_round_id,
            self.last_round,
            newest,
            self._jump_after,
            self.cell.rounds.indices(),
            self._parts,
            round_index(self.settings.last_update, self.dp.interval_steps),
            lead,
        )
        if round_id is None:
            self.stats.rounds_skipped += 1
            return
        base = round_clock.own_next(own_round_id, self.last_round)
        if round_id > base:
            self.transport.void_rounds(group, self.column, range(base, round_id))
            self.stats.rounds_jumped += round_id - base
        self.last_round = round_id
        self._launch_round(round_id)

    def _lead(self, own_round_id: int, newest: int) -> int | None:
        """How far past its partners' newest round this cell may launch (round_clock.lead_limit),
        from the paces of its own count and of the partners' launches (each newer round seen
        counts one: never more than they launched, and a jump counts one)."""
        now = time.monotonic()
        self._own_pace.append((now, own_round_id))
        if newest > self._seen_newest:  # a partner launched (one or more rounds) since
            self._seen_newest, self._seen_launches = newest, self._seen_launches + 1
        if newest >= 0:
            self._seen_pace.append((now, self._seen_launches))
        own = round_clock.pace(list(self._own_pace))
        if own is None or own <= 0:
            return None
        dp = self.dp
        open_s = min(
            self.settings.round_timeout_s,
            (dp.tau + dp.max_round_lag_steps) / (own * dp.interval_steps),
        )
        return round_clock.lead_limit(
            open_s, own, round_clock.pace(list(self._seen_pace)), self._jump_after
        )

    def _launch_round(self, round_id: int) -> None:
        rnd, _ = self.cell.open_round(round_id)
        handle = self.transport.start_mean(
            group_name(self.j),
            self.column,
            round_id,
            rnd.payload.cpu(),  # the snapshot (an emulated hostile cell's: scaled)
            self.dp.codec,
            self.settings.round_timeout_s,
            abstain=self.cell.sits_out(),
        )
        self.cell.rounds.launch(rnd, handle)
        self.stats.rounds_started += 1

    def apply_due(self) -> None:
        """Apply, in launch order, every round whose tau has passed and that has completed.

        strict: a due round is waited for (deadline round_timeout_s), as the simulator assumes.
        """
        strict = self.dp.strict_tau
        while (due := self.cell.rounds.due(self.cell.step)) is not None:
            rnd, handle = due
            if not handle.done() and not strict:
                late = self.cell.step - rnd.launch_step - self.dp.tau
                # members whose payload is this many updates late are dropped from the round:
                # it ends now over the contributions it has (counted partial); a round that
                # cannot be cut (a collective) is waited for up to its deadline
                if late < self.dp.max_round_lag_steps or not handle.cut():
                    return
            self.cell.rounds.pop()
            t0 = time.perf_counter()
            res = handle.result(self.settings.round_timeout_s)
            if self.emu:
                self.emu.waited(t0)  # strict: the next op cannot start before the round landed
            self._finish_round(rnd, res)

    def after_update(self) -> None:
        """This update's round actions (mesh/engine/rounds.py), as the simulator runs them."""
        update, dp = self.cell.step - 1, self.dp
        for action in after_update(update, dp.interval_steps, dp.tau):
            if action is Action.LAUNCH:
                self.next_round(round_index(update, dp.interval_steps))
            else:
                self.apply_due()

    def _finish_round(self, rnd: Round, res: MeanResult) -> None:
        took_part = self.me in res.contributors or self.me in res.abstained
        usable = res.mean is not None and took_part
        if res.status is MeanStatus.FAILED or not usable or alone(res.contributors, self.me):
            self.stats.rounds_failed += 1
            return
        mean = res.mean
        if self.cell.screens_rounds:  # robust combination (mesh/algo/robust.py)
            parts = [p.to(self.cell.flat.device) for p in res.parts]
            mean, rejected = self.cell.combine_round(res.contributors, parts, self.me)
            for _ in rejected:
                self.transport.stats.add_reject("outlier")
            kept = [c for c in res.contributors if c not in rejected]
            if alone(kept, self.me):  # only our own payload is left
                self.stats.rounds_failed += 1
                return
        if res.status is MeanStatus.PARTIAL:
            self.stats.rounds_partial += 1
        rnd.mean = mean.to(self.cell.flat.device)
        self.cell.apply_round(rnd)
        self.stats.rounds_applied += 1

    def drain(self) -> None:
        """At the end, wait briefly for rounds in flight so peers are not left hanging."""
        deadline = time.monotonic() + self.settings.round_timeout_s
        for handle in self.cell.rounds.handles():
            handle.result(max(0.0, deadline - time.monotonic()))
        self.cell.rounds.void()
