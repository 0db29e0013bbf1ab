"""A launcher's stop runs each replica's cells to one step (mesh/runtime/grid_stop.py): every cell
of a replica saves that step, nothing any cell had completed is lost, and a resume from it ends
with the same weights as a run that never stopped. On hivemind each cell saves where the stop
finds it and resumes from that save."""

from __future__ import annotations

import threading
import time

import helpers
import pytest
import torch

from cli.preflight import check_resume
from mesh.config import load_config
from mesh.runtime.checkpoint import checkpoint_path, saved_steps
from mesh.runtime.launch import StopRequest, run_grid
from mesh.runtime.metrics import read_metrics

pytestmark = pytest.mark.integration

CELLS = [(0, 0), (1, 0), (0, 1), (1, 1)]


def test_a_stop_saves_one_step_per_replica_and_the_resume_is_exact(text_file, tmp_path):
    """2x2, no averaging (so nothing in flight is lost at the cut), weight prediction on, no
    periodic checkpoint before the stop: SIGTERM (as the launcher's handler requests it) once
    a cell is past step 6; each replica's cells end at one step, past every step any of
    them had logged, and the resume from there ends where an uninterrupted run ends, bit for
    bit."""
    base = [
        *helpers.TINY,
        f"data.path='{text_file}'",
        "grid.stages=2",
        "grid.replicas=2",
        "run.steps=40",
        "dp.mode=none",
        "checkpoint.every=1000",
        "pipeline.weight_prediction=1",
        "transport.recv_timeout_s=30",
    ]
    cfg = load_config([], base)
    # the stopped run's cells wait 9x their compute (not part of the math): a tiny grid's 40
    # steps must not end before the stop lands on a loaded box
    slowed = ", ".join(f'"s{j}r{i}=10"' for j, i in CELLS)
    slow_cfg = load_config([], [*base, f"emulation.slowdowns=[{slowed}]"])
    stopped = tmp_path / "stopped"
    stop, seen = StopRequest(), {}

    def stop_past_step_6():
        # watched from the first cell past step 6 (the launcher's progress is its slowest
        # replica's: a replica that formed late on a loaded box would hold it back while the
        # other ran to the run's end)
        while stop.signal_name is None and not done.is_set():
            rows = read_metrics(stopped)
            if any(r["step"] >= 6 for v in rows.values() for r in v if not r.get("final")):
                for c, v in rows.items():
                    seen[c] = max((r["step"] for r in v if not r.get("final")), default=0)
                stop.request("SIGTERM")
            time.sleep(0.02)

    done = threading.Event()
    watcher = threading.Thread(target=stop_past_step_6, daemon=True)
    watcher.start()
    try:
        first = run_grid(slow_cfg, stopped, stop=stop, timeout_s=240)
    finally:
        done.set()
        watcher.join()
    assert first.interrupted and first.stopped_by == "SIGTERM", first
    assert set(first.exit_codes.values()) == {0}, first.exit_codes
    at = first.stop_steps
    assert at is not None and set(at) == {0, 1}, at
    for j, i in CELLS:
        assert saved_steps(stopped, j, i) == [at[i]], (j, i)  # the one stop-time save
        assert at[i] >= seen.get((j, i), 0), (at, seen)  # nothing it had completed is lost
        assert at[i] < 40, "stopped before the run's end"
    resumed = run_grid(cfg, stopped, resume=True, replica_steps=at, timeout_s=240)
    assert resumed.ok, resumed.exit_codes
    straight = tmp_path / "straight"
    assert run_grid(cfg, straight, timeout_s=240).ok
    for j, i in CELLS:
        a = torch.load(checkpoint_path(stopped, j, i, 40), weights_only=True)["flat"]
        b = torch.load(checkpoint_path(straight, j, i, 40), weights_only=True)["flat"]
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_hivemind_grid_stopped_resumes_each_cell_from_its_own_save(text_file, tmp_path):
    """hivemind (sessions take a replica's cells at different steps): a stop saves each cell
    where it finds it, past every step it logged, with no periodic checkpoint to fall back
    on; the resume starts each cell from its own save (a common step would be none, or an
    older one) and every cell ends at the resumed run's run.steps."""
    base = [
        *helpers.TINY,
        f"data.path='{text_file}'",
        "grid.stages=2",
        "grid.replicas=2",
        "transport.backend='hivemind'",
        "elastic.max_lag_steps=1000",  # a replica behind the other downloads nothing here
        "run.schedule_steps=400",  # the state's horizon, whatever run.steps the resume sets
        "checkpoint.every=1000",
        "transport.recv_timeout_s=30",
    ]
    cfg = load_config([], [*base, "run.steps=400"])
    out = tmp_path / "run"
    stop = StopRequest()

    def stop_past_step_6(step, loss):
        # every cell has trained (a replica whose sessions are still forming on a loaded box
        # has nothing to save: it would start again from step 0, which is not this test)
        trained = read_metrics(out)
        if step >= 6 and len(trained) == len(CELLS) and all(trained.values()):
            stop.request("SIGTERM")

    first = run_grid(cfg, out, on_progress=stop_past_step_6, stop=stop, timeout_s=240)
    assert first.interrupted and set(first.exit_codes.values()) == {0}, first
    rows = read_metrics(out, events=True)
    logged = {
        c: max((r["step"] for r in v if "event" not in r), default=0) for c, v in rows.items()
    }
    point = check_resume(cfg, out)
    assert point.cell_steps == {c: saved_steps(out, *c)[-1] for c in CELLS}, point
    assert all(point.cell_steps[c] >= logged[c] for c in CELLS), (point.cell_steps, logged)
    end = max(point.cell_steps.values()) + 10
    longer = load_config([], [*base, f"run.steps={end}"])
    resumed = run_grid(longer, out, resume=True, cell_steps=point.cell_steps, timeout_s=240)
    assert resumed.ok, resumed.exit_codes
    for c, v in read_metrics(out, events=True).items():
        starts = [r["step"] for r in v if r.get("event") == "resumed"]
        assert starts == [point.cell_steps[c]], (c, starts)
        # a session counts from its leader's (stage 0's) step, and a follower resumed a step
        # apart takes it: every cell ends at run.steps, the run's length (it had ended a step
        # past it, or short of it), where its replica's saves meet again
        assert [r for r in v if r.get("final")][-1]["step"] == end, (c, point.cell_steps)
    for i in range(2):
        assert {saved_steps(out, j, i)[-1] for j in range(2)} == {end}


def test_a_hivemind_follower_resumed_ahead_of_its_leader_ends_at_the_runs_end(text_file, tmp_path):
    """s1r0 resumes from a save two steps past its leader's (as a hivemind stop can leave
    them): it takes its session's step, its leader's, and both cells end at run.steps and
    save it (it had ended two steps past the run's end, its saves never meeting its
    leader's)."""
    base = [
        *helpers.TINY,
        f"data.path='{text_file}'",
        "grid.stages=2",
        "grid.replicas=1",
        "transport.backend='hivemind'",
        "run.schedule_steps=400",
        "checkpoint.every=2",
        "transport.recv_timeout_s=30",
    ]
    out = tmp_path / "run"
    assert run_grid(load_config([], [*base, "run.steps=6"]), out, timeout_s=240).ok
    starts = {(0, 0): 4, (1, 0): 6}
    longer = load_config([], [*base, "run.steps=12"])
    assert run_grid(longer, out, resume=True, cell_steps=starts, timeout_s=240).ok
    rows = read_metrics(out, events=True)
    for c in starts:
        assert [r for r in rows[c] if r.get("final")][-1]["step"] == 12, c
        assert saved_steps(out, *c)[-1] == 12, saved_steps(out, *c)
    taken = [r for r in rows[(1, 0)] if r.get("event") == "session_step"]
    assert (6, 4) in [(r["from_step"], r["step"]) for r in taken], taken  # at its first session
