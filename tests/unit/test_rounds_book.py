"""A cell's round book and the runtime's Rounds (mesh/engine/rounds.py,
mesh/runtime/rounds.py): launch order, tau, cutting a late round, failures, voiding, the clock.

Rounds run on a real Cell of the tiny model; its transport is a scripted stand-in whose
rounds complete when the test says (the real transports' rounds run in
tests/integration/test_transport_suite.py).
"""

from __future__ import annotations

import helpers
import pytest
import torch

from comms.transport import MeanResult, MeanStatus, TransportStats
from mesh.algo.topology import group_name
from mesh.config import load_config
from mesh.engine.cell import Cell
from mesh.engine.rounds import Action, RoundBook, after_update, round_index
from mesh.model.build import build_stage
from mesh.runtime.rounds import Rounds, RoundSettings
from mesh.runtime.stage_stats import StageStats

A, LAUNCH = Action.APPLY, Action.LAUNCH


@pytest.mark.parametrize(
    ("update", "interval", "tau", "want"),
    [
        (0, 1, 2, (A, LAUNCH)),
        (5, 1, 2, (A, LAUNCH)),
        (5, 4, 2, (A,)),
        (8, 4, 2, (A, LAUNCH)),
        (8, 4, 0, (A, LAUNCH, A)),  # blocking: the round launched is applied at once
        (9, 4, 0, (A,)),
    ],
)
def test_after_update_applies_before_it_launches(update, interval, tau, want):
    assert after_update(update, interval, tau) == want


def test_round_index_counts_launches():
    assert [round_index(u, 4) for u in (0, 3, 4, 8, 11)] == [0, 0, 1, 2, 2]


# ------------------------------------------------------------------ the mixin


class Handle:
    """A round the test completes: done() once `finish` was called; cut() as the transport."""

    def __init__(self, cuttable: bool) -> None:
        self.cuttable, self.res, self.cuts = cuttable, None, 0

    def finish(self, res: MeanResult) -> None:
        self.res = res

    def done(self) -> bool:
        return self.res is not None

    def cut(self) -> bool:
        self.cuts += 1
        if self.cuttable and self.res is None:
            self.res = MeanResult(MeanStatus.FAILED, None, (), "cut with nothing")
        return self.cuttable

    def result(self, timeout_s: float) -> MeanResult:
        return self.res or MeanResult(MeanStatus.FAILED, None, (), "deadline")


class Transport:
    def __init__(self, cuttable: bool = True) -> None:
        self.cuttable = cuttable
        self.stats = TransportStats()
        self.handles: dict[int, Handle] = {}
        self.voided: list[range] = []
        self.newest = -1

    def start_mean(self, group, members, round_id, values, codec, timeout_s, abstain=False):
        assert group == group_name(0) and round_id not in self.handles
        self.handles[round_id] = Handle(self.cuttable)
        return self.handles[round_id]

    def newest_round(self, group, members):
        return self.newest

    def void_rounds(self, group, members, round_ids):
        self.voided.append(round_ids)
        return 0


class Worker(Rounds):
    """A cell's Rounds around a real tiny Cell, with update() as a StageWorker steps."""

    def __init__(self, *overrides: str, cuttable: bool = True) -> None:
        cfg = load_config([], [*helpers.TINY_MODEL, "grid.stages=1", "grid.replicas=2", *overrides])
        cell = Cell.build(cfg, 0, 0, build_stage(cfg.model, 1, 0, cfg.run.seed))
        column = ["s0r0", "s0r1"]
        super().__init__(RoundSettings.of(cfg), cell, Transport(cuttable), StageStats(), column)

    def update(self) -> None:
        """One optimizer update (a small step) and its round actions, as StageWorker._step."""
        self.cell.apply_update([torch.full_like(p, 1e-3) for p in self.cell.params])
        self.after_update()
        self.cell.push_version()

    def ok(self, round_id: int) -> MeanResult:
        """The round's mean as two members would have it: their snapshots, the other's +1."""
        rnd = next(r for r, _ in self.cell.rounds.entries if r.index == round_id)
        other = rnd.payload + 1.0
        parts = (rnd.payload.clone(), other)
        return MeanResult(MeanStatus.OK, (parts[0] + parts[1]) / 2, ("s0r0", "s0r1"), parts=parts)


def test_a_round_is_applied_tau_updates_after_launch_and_only_when_done():
    w = Worker("dp.tau=2", "dp.interval_steps=1")
    w.update()  # update 0 launches round 0
    assert w.stats.rounds_started == 1 and len(w.cell.rounds) == 1
    w.transport.handles[0].finish(w.ok(0))
    w.update()  # step 2: round 0 (launched at step 1) is not due before step 3
    assert w.stats.rounds_applied == 0
    before = w.cell.flat.clone()
    w.update()
    assert w.stats.rounds_applied == 1 and not torch.equal(before, w.cell.flat)


def test_rounds_are_applied_in_launch_order():
    w = Worker("dp.tau=1", "dp.interval_steps=1", "dp.max_round_lag_steps=100")
    for _ in range(3):
        w.update()  # rounds 0, 1, 2 launched
    w.transport.handles[1].finish(w.ok(1))  # a later round completes first
    w.update()
    assert w.stats.rounds_applied == 0  # round 1 waits behind round 0
    w.transport.handles[0].finish(w.ok(0))
    w.update()
    assert w.stats.rounds_applied == 2 and [r.index for r, _ in w.cell.rounds.entries][0] == 2


@pytest.mark.parametrize("cuttable", [True, False])
def test_a_late_round_is_cut_where_the_transport_can(cuttable):
    w = Worker("dp.tau=1", "dp.interval_steps=1", "dp.max_round_lag_steps=2", cuttable=cuttable)
    for _ in range(5):
        w.update()
    cuts = w.transport.handles[0].cuts
    if cuttable:  # cut once it was max_round_lag_steps late, and dropped (its result failed)
        assert cuts >= 1 and w.stats.rounds_failed >= 1
        assert all(r.index > 0 for r, _ in w.cell.rounds.entries)
    else:  # a collective cannot be cut: it stays at the head, waited for up to its deadline
        assert cuts >= 1 and w.stats.rounds_failed == 0
        assert next(iter(w.cell.rounds.indices())) == 0


def test_a_failed_or_lonely_round_counts_failed_and_changes_nothing():
    w = Worker("dp.tau=0", "dp.interval_steps=1", "dp.strict_tau=true")
    w.cell.apply_update([torch.zeros_like(p) for p in w.cell.params])
    before = w.cell.flat.clone()
    w.next_round(0)
    rnd, handle = next(iter(w.cell.rounds.entries))
    handle.finish(MeanResult(MeanStatus.OK, rnd.payload.clone(), ("s0r0",)))  # alone: no mean
    w.apply_due()
    assert w.stats.rounds_failed == 1 and w.stats.rounds_applied == 0 and not w.cell.rounds
    assert torch.equal(before, w.cell.flat)


def test_drop_rounds_voids_what_a_download_skipped():
    w = Worker("dp.tau=5", "dp.interval_steps=2")
    for _ in range(4):
        w.update()  # rounds 0 and 1 in flight
    assert len(w.cell.rounds) == 2
    old = w.cell.step
    w.cell.step = 10  # a download moved the state to step 10
    w.drop(old)
    assert not w.cell.rounds and w.stats.rounds_failed == 2
    assert w.transport.voided == [range(2, 5)]  # rounds of updates 4, 6, 8 will never run here


def test_a_trailing_cell_jumps_to_its_column_and_voids_the_rounds_between():
    w = Worker("dp.tau=1", "dp.interval_steps=1", "dp.max_round_lag_steps=2")
    w.update()
    w.transport.newest = 40  # its column launched round 40: the partition part round 0 holds
    w.update()  # (5%: 20 parts) is in flight, so no launch this time (no coordinate twice)
    assert w.last_round == 0 and w.stats.rounds_skipped == 1
    w.transport.newest = 41
    w.update()  # its own count is at 2 now: it jumps over 2..40
    assert w.last_round == 41 and w.stats.rounds_jumped == 39
    assert w.transport.voided == [range(2, 41)]


def test_the_book_keeps_launch_order_and_tau():
    book: RoundBook[str] = RoundBook(tau=2)
    w = Worker()
    r0, _ = w.cell.open_round(0)
    assert book.due(100) is None
    book.launch(r0, "h0")
    assert book.due(r0.launch_step + 1) is None and book.due(r0.launch_step + 2) == (r0, "h0")
    assert list(book.indices()) == [0] and list(book.handles()) == ["h0"]
    assert book.void() == 1 and not book
