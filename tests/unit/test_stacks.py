"""A cell that outlives its stop is asked for its threads' stacks before its launcher kills it,
and they are kept as DIR/logs/sJrI.stuck (mesh/runtime/stacks.py)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import helpers
import pytest

from mesh.config import load_config
from mesh.runtime.launch import LocalGrid
from mesh.runtime.stacks import STACKS_SIGNAL, keep_stacks, stacks_path, written_on_request
from mesh.runtime.trainer import cell_life


def test_the_signal_writes_every_threads_stack_and_the_file_is_kept(tmp_path: Path) -> None:
    waiting = threading.Event()
    side = threading.Thread(target=waiting.wait, name="side", daemon=True)
    side.start()
    with written_on_request(tmp_path, 1, 0):
        os.kill(os.getpid(), STACKS_SIGNAL)  # written from the handler, before kill returns
        kept = keep_stacks(tmp_path, 1, 0, os.getpid())
    waiting.set()
    assert kept == stacks_path(tmp_path, 1, 0) == tmp_path / "logs" / "s1r0.stuck"
    text = kept.read_text()
    assert "test_the_signal_writes_every_threads_stack_and_the_file_is_kept" in text
    assert text.count("hread 0x") >= 2  # "Current thread" and the side thread
    assert list((tmp_path / "logs").glob(".*")) == []  # nothing hidden is left behind


def test_a_cell_that_ends_on_its_own_leaves_no_stacks_file(tmp_path: Path) -> None:
    with written_on_request(tmp_path, 0, 0):
        pass
    assert keep_stacks(tmp_path, 0, 0, os.getpid()) is None
    assert list((tmp_path / "logs").iterdir()) == []


def _hang_for_ever() -> None:
    threading.Event().wait()


def _stubborn(tree, stage, replica, out_dir, meeting, resume_step) -> None:
    """A cell that never listens for SIGTERM (its launcher started it with SIGTERM ignored)."""
    cell_life(out_dir, stage, replica, _hang_for_ever)


@pytest.mark.slow
def test_a_launcher_keeps_the_stacks_of_a_cell_it_had_to_kill(tmp_path: Path) -> None:
    cfg = load_config([], [*helpers.TINY, "grid.stages=1", "grid.replicas=1"])
    grid = LocalGrid(cfg, tmp_path, meeting=None)
    try:
        grid.start((0, 0), target=_stubborn)
        helpers.wait_for(
            lambda: any((tmp_path / "logs").glob(".s0r0.stuck.*")), 60, "the cell to start"
        )
    finally:
        grid.stop(grace_s=1)
    assert grid.exit_codes() == {(0, 0): -9}
    assert grid.stuck == {(0, 0): tmp_path / "logs" / "s0r0.stuck"}
    assert "_hang_for_ever" in grid.stuck[(0, 0)].read_text()
