"""A launcher's stop at one step (mesh/runtime/grid_stop.py, mesh/runtime/stop.py): the step
chosen from frozen cells' rows, written whole, read by each cell once."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from comms.procs import state
from mesh.runtime.grid_stop import freeze, newest_step, stop_steps, thaw, write_stop_steps
from mesh.runtime.rows import append_row
from mesh.runtime.stop import StopAt, stop_file


def test_each_replica_stops_two_past_its_newest_cell_and_never_past_the_run():
    current = {(0, 0): 116, (1, 0): 117, (0, 1): 85, (1, 1): 86}
    assert stop_steps(current, 2, 1000, together=False) == {0: 119, 1: 88}
    assert stop_steps(current, 2, 1000, together=True) == {0: 119, 1: 119}
    assert stop_steps(current, 2, 118, together=False) == {0: 118, 1: 88}
    assert stop_steps({(0, 0): 5}, 2, 100, together=False) == {0: 7, 1: 2}  # none running: 0


def test_the_newest_step_is_read_from_the_current_life_only(tmp_path):
    """A restarted cell's file holds its earlier life's rows past its new start: only rows
    written since its life began count, and a torn last line is skipped."""
    path = tmp_path / "0-0.jsonl"
    for step in range(1, 40):  # the earlier life, to 39
        append_row(path, {"step": step, "loss": 1.0, "pad": "x" * 2000})
    offset = path.stat().st_size
    assert newest_step(path, offset) is None  # nothing yet in this life
    append_row(path, {"event": "started", "step": 30})
    assert newest_step(path, offset) == 30
    append_row(path, {"step": 31, "loss": 1.0})
    with path.open("ab") as f:
        f.write(b'{"step": 32, "lo')  # torn: the cell is frozen mid-write
    assert newest_step(path, offset) == 31
    assert newest_step(path, 0) == 31  # the tail of a long file: a cut first line is skipped
    assert newest_step(tmp_path / "missing.jsonl", 0) is None


def test_a_cell_reads_its_replicas_step_once(tmp_path):
    at = StopAt(tmp_path, 1)
    assert not at.due(10) and at.step is None  # no stop yet
    write_stop_steps(tmp_path, {0: 12, 1: 14})
    assert json.loads(stop_file(tmp_path).read_text()) == {"replica_steps": {"0": 12, "1": 14}}
    assert not at.due(13) and at.due(14) and at.due(15)
    stop_file(tmp_path).write_text("{}")  # read once: a later change is not seen
    assert at.due(14)
    other = StopAt(tmp_path, 2)  # a file without this replica: it trains on
    assert not other.due(10**6) and not other.due(10**6)


@pytest.mark.slow
def test_freeze_waits_until_each_process_is_stopped_and_thaw_goes_on():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert freeze([busy.pid]) == [busy.pid]
        assert state(busy.pid) == "T"
        thaw([busy.pid])
        deadline = time.monotonic() + 10
        while state(busy.pid) == "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert state(busy.pid) in ("R", "S")
    finally:
        busy.kill()
        busy.wait()
    assert freeze([busy.pid]) == []  # gone: nothing to stop
