"""Replicas at different speeds keep averaging (mesh/algo/round_clock.py): real cell processes
on hivemind, one replica 3x slower than the other. Numbering rounds by its own updates, the
slow replica would trail by more than a round stays open within a few seconds, and from then
on no round would land on either side; with the shared round clock the fast one launches no
round further ahead than the slow one reaches (and a trailer that falls behind anyway jumps to
the newest round), and the rounds keep landing on both sides."""

from __future__ import annotations

from pathlib import Path

import helpers
import pytest
from helpers import wait_for

from comms.build import local_rendezvous
from mesh.config import load_config
from mesh.runtime.launch import LocalGrid
from mesh.runtime.metrics import read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _last(out: Path, cell: tuple[int, int]) -> dict:
    rows = [r for r in read_metrics(out, events=True).get(cell, []) if "rounds_started" in r]
    return rows[-1] if rows else {"step": 0}


def test_a_replica_3x_slower_keeps_meeting_the_fast_one(text_file, tmp_path):
    cfg = load_config(
        [],
        [
            *helpers.TINY,
            "grid.stages=1",
            "grid.replicas=2",
            f"data.path='{text_file}'",
            "run.steps=100000",  # stopped by the test
            "transport.backend=hivemind",
            "emulation.compute=emulated",
            "emulation.forward_ms=10",
            "emulation.backward_ms=20",
            "emulation.slowdowns=['s0r1=3']",
            "transport.round_timeout_s=10",
            "dp.tau=2",
            "dp.fraction=0.25",
        ],
    )
    fast, slow = (0, 0), (0, 1)
    with local_rendezvous("hivemind") as options:
        grid = LocalGrid(cfg, tmp_path, options)
        try:
            grid.start(fast)
            grid.start(slow)
            # the rounds from the slow one's 50th update on: by then both have run a while (the
            # fast one alone for as long as the other process took to start, its rounds waited
            # out alone and the slow one's first rounds a jump to its newest: how long that
            # lasts is how loaded the box is, so it is left out)
            wait_for(lambda: _last(tmp_path, slow)["step"] >= 50, 180, "50 slow updates")
            s0, f0 = _last(tmp_path, slow), _last(tmp_path, fast)
            # the slow one's 150th update: the fast one is ~200 updates further by then, far
            # beyond tau + max_round_lag_steps = 22
            wait_for(lambda: _last(tmp_path, slow)["step"] >= 150, 180, "150 slow updates")
        finally:
            grid.stop(grace_s=20)
        codes = grid.exit_codes()
    assert codes == {fast: 0, slow: 0}, codes
    s1, f1 = _last(tmp_path, slow), _last(tmp_path, fast)
    s, f = _delta(s1, s0), _delta(f1, f0)
    assert f["step"] > 2 * s["step"], (f, s)  # they did run at different speeds
    # nearly every round the slow one launched met the fast one's (a round may still be open
    # at the stop, and the first ones of the window were launched before it)
    assert s["rounds_applied"] >= 0.8 * s["rounds_started"], (s, s0, s1)
    # ... and landed on the fast side too: it launches a round per update, a third of which
    # are the slow one's
    assert f["rounds_applied"] >= 0.8 * s["rounds_applied"], (f, s)
    # the column's pace: the fast one launches no round further ahead than the slow one
    # reaches (the rest of its updates launch none), and never has to jump
    assert f["rounds_skipped"] > 0 and f["rounds_jumped"] == 0, f
    assert s["rounds_jumped"] == 0, s  # once in step, the slow one never falls behind again


def _delta(after: dict, before: dict) -> dict:
    """The counters of `after` less those of `before` (a window of one cell's run)."""
    keys = ("step", "rounds_started", "rounds_applied", "rounds_jumped", "rounds_skipped")
    return {k: after[k] - before[k] for k in keys}
