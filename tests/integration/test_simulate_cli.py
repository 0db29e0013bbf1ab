"""`meshtrain simulate` as a user meets it: bad input fails in one line before any cell starts,
a failing cell stops the grid, a damaged checkpoint falls back, a resume extends a run and a
refused one leaves the run directory as it was. Real processes, as a user runs them."""

from __future__ import annotations

import json

import helpers
import pytest

from mesh.config import load_config
from mesh.runtime.checkpoint import checkpoint_path
from mesh.runtime.launch import run_grid

pytestmark = pytest.mark.integration

TINY = [*helpers.TINY, "checkpoint.every=2", "transport.recv_timeout_s=30"]


_meshtrain = helpers.cli


def _sets(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


@pytest.mark.parametrize("backend", ["torch", "hivemind"])
@pytest.mark.parametrize("data", ["/nonexistent/corpus.txt", "/bin/ls"], ids=["missing", "binary"])
def test_bad_data_fails_in_one_line_before_any_cell_starts(tmp_path, backend, data):
    res = _meshtrain("simulate", "--backend", backend, *_sets(f"data.path='{data}'"), cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: data.path"), res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    # no cell ever ran (a cell writes its metrics under the run directory): none was made
    assert not (tmp_path / "runs").exists()


def test_a_failing_cell_stops_the_grid_and_says_why(tmp_path):
    """Past the launcher's checks (run_grid is called directly here), every cell fails to load
    its data: the grid stops at once, and the first failure is one line naming the cell."""
    cfg = load_config([], [*TINY, "grid.stages=2", "grid.replicas=2", "data.path='/nonexistent'"])
    run = run_grid(cfg, tmp_path, timeout_s=120)  # a hang guard, far above the seconds it takes
    assert not run.ok and run.failure is not None
    assert all(code is not None for code in run.exit_codes.values())  # nobody left running
    assert run.failure.exit_code == 2 and run.failure.cell in {"s0r0", "s1r0", "s0r1", "s1r1"}
    assert "data.path" in run.failure.message and "\n" not in run.failure.message
    assert run.failure.log is not None and run.failure.log.read_text().startswith("data.path")


def cell_that_cannot_start(*args, **kwargs) -> None:
    """A real cell whose hivemind transport has 1 ms to start (a machine too loaded to start
    p2pd in time): it cannot start. The rest of the grid is as a user runs it."""
    from comms.p2p.transport import P2PTransport
    from mesh.runtime.trainer import cell_process_main

    init = P2PTransport.__init__

    def short(self, *a, **k):
        init(self, *a, **{**k, "startup_timeout_s": 0.001})

    P2PTransport.__init__ = short
    cell_process_main(*args, **kwargs)


def test_a_hivemind_cell_that_cannot_start_stops_the_grid_at_once(text_file, tmp_path):
    """One cell of a hivemind grid cannot start its transport: the grid stops within the
    launcher's grace, the failure one line naming the cell and the setting to raise. (It was
    taken for a lost neighbour, which hivemind rides out: its replica waited 120 s for it
    while the other trained on, and the launcher said no why.)"""
    cfg = load_config(
        [],
        [
            *TINY,
            f"data.path='{text_file}'",
            "grid.stages=2",
            "grid.replicas=2",
            "transport.backend='hivemind'",
            "run.steps=100000",  # the healthy replica trains until the failure stops it
        ],
    )
    # a hang guard far above the seconds it takes, well under the 120 s wait it replaces
    run = run_grid(cfg, tmp_path, timeout_s=90, targets={(1, 0): cell_that_cannot_start})
    f = run.failure
    assert f is not None and f.cell == "s1r0" and f.exit_code == 2, run
    assert "transport.start_timeout_s" in f.message and "\n" not in f.message, f.message
    assert run.exit_codes[(1, 0)] == 2 and all(c is not None for c in run.exit_codes.values())


def test_resume_falls_back_extends_and_refuses_without_damage(text_file, tmp_path):
    run_dir = tmp_path / "run"
    base = [
        "simulate",
        "--grid",
        "2x2",
        "--out",
        str(run_dir),
        *_sets(*TINY, f"data.path='{text_file}'", "run.steps=8"),
    ]
    first = _meshtrain(*base, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert (run_dir / "table.md").read_text().startswith("| grid")
    val = [json.loads(ln) for ln in (run_dir / "val.jsonl").read_text().splitlines()]
    assert {(r["replica"], r["step"]) for r in val} >= {(0, 0), (1, 0), (0, 8), (1, 8)}

    # a refused resume (it would change the math so far) leaves config.toml byte-identical
    stored = (run_dir / "config.toml").read_bytes()
    refused = _meshtrain("simulate", "--resume", str(run_dir), *_sets("dp.tau=3"), cwd=tmp_path)
    assert refused.returncode == 2 and "dp.tau" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr
    assert (run_dir / "config.toml").read_bytes() == stored

    # one cell's newest checkpoint cut short: its replica falls back to the step before, says
    # so; the other replica resumes where it is (at the end: nothing left for it to train)
    newest = checkpoint_path(run_dir, 1, 0, 8)
    newest.write_bytes(newest.read_bytes()[:2000])
    again = _meshtrain("simulate", "--resume", str(run_dir), cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "resuming replica 0 from step 6, replica 1 from step 8" in again.stderr, again.stderr
    assert "s1r0 step 8" in again.stderr
    assert "Traceback" not in again.stderr
    assert newest.with_name(newest.name + ".bad").exists()
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 8

    # --steps extends the finished run; a plain --resume then continues the longer run
    longer = _meshtrain("simulate", "--resume", str(run_dir), "--steps", "10", cwd=tmp_path)
    assert longer.returncode == 0, longer.stderr
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 10
    for i in range(2):
        for j in range(2):
            assert checkpoint_path(run_dir, j, i, 10).is_file()
    toml = (run_dir / "config.toml").read_text()
    assert "steps = 10" in toml and "schedule_steps = 8" in toml  # the horizon it started with
    done = _meshtrain("simulate", "--resume", str(run_dir), cwd=tmp_path)
    assert done.returncode == 0 and "nothing to do" in done.stdout, done.stdout + done.stderr


def test_resume_of_a_directory_that_is_not_a_run(tmp_path):
    res = _meshtrain("simulate", "--resume", str(tmp_path), cwd=tmp_path)
    assert res.returncode == 2 and "not a run directory (no config.toml)" in res.stderr
    (tmp_path / "config.toml").write_text("")
    res = _meshtrain("simulate", "--resume", str(tmp_path), cwd=tmp_path)
    assert res.returncode == 2 and "not a run directory (no checkpoints" in res.stderr
    assert "Traceback" not in res.stderr
