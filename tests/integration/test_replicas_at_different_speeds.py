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
            "runtime.backend=hivemind",
            "runtime.compute=emulated",
            "runtime.forward_ms=10",
            "runtime.backward_ms=20",
            "runtime.slowdowns=['s0r1=3']",
            "runtime.round_timeout_s=10",
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
            # the slow one's 150th update: the fast one is ~300 updates ahead by then, far
            # beyond tau + max_round_lag_steps = 22
            wait_for(lambda: _last(tmp_path, slow)["step"] >= 150, 180, "150 slow updates")
        finally:
            grid.stop(grace_s=20)
        codes = grid.exit_codes()
    assert codes == {fast: 0, slow: 0}, codes
    f, s = _last(tmp_path, fast), _last(tmp_path, slow)
    assert f["step"] > 2 * s["step"]  # they did run at different speeds
    # nearly every round the slow one launched met the fast one's (the first ones formed
    # while the other process started; a round may still be open at the stop)
    assert s["rounds_applied"] >= 0.8 * s["rounds_started"], s
    # ... and landed on the fast side too: it launches a round per update, a third of which
    # are the slow one's
    assert f["rounds_applied"] >= 0.8 * s["rounds_applied"], (f, s)
    # the column's pace: the fast one launches no round further ahead than the slow one
    # reaches (the rest of its updates launch none); its rounds before the slow one's first
    # payload (while that process started) are waited out alone, as they must be
    assert f["rounds_skipped"] > 0 and f["rounds_jumped"] == 0, f
