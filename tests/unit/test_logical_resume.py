"""Resuming a logical run: `simulate --backend logical --out DIR` stopped (a signal, or a
shorter --steps) and continued with `--resume DIR` ends with the weights, drift, stashes,
optimizer states and validation loss of the uninterrupted run, bit for bit: the simulator is
deterministic, and its checkpoints keep what a cell process's do not (the rounds in flight with
their means, the sentinel's statistics, the grid's counters)."""

from __future__ import annotations

import json

import helpers
import pytest
import torch
from click.testing import CliRunner

from cli.main import main
from mesh.runtime.checkpoint import checkpoint_path, write_digested

pytestmark = pytest.mark.slow  # three small runs of the simulator and their checkpoints

GRID, STEPS = (2, 2), 10
SETS = [
    *helpers.TINY,
    "grid.stages=2",
    "grid.replicas=2",
    f"run.schedule_steps={STEPS}",
    "checkpoint.every=4",
    "dp.tau=2",
    "run.eval_every=5",
    # a sentinel that learns fast and drops often: its verdicts after the resume depend on
    # what it learned before (not so often that every cell sits its rounds out: Cell.sits_out)
    "sentinel.warmup=2",
    "sentinel.z=0.8",
]


def _simulate(*args, text_file):
    sets = [f"--set={s}" for s in [*SETS, f"data.path='{text_file}'"]]
    res = CliRunner().invoke(main, ["simulate", *args, *sets])
    return res


def _cells(run, step):
    out = {}
    for i in range(GRID[1]):
        for j in range(GRID[0]):
            state = torch.load(checkpoint_path(run, j, i, step), weights_only=True)
            out[(j, i)] = state
    return out


def _assert_same_state(a, b):
    for cell in a:
        x, y = a[cell], b[cell]
        assert x["step"] == y["step"] == STEPS
        for key in ("flat", "drift"):
            assert torch.equal(x[key], y[key]), (cell, key)
        assert torch.equal(x["versions"], y["versions"])
        assert all(torch.equal(s, t) for s, t in zip(x["stashes"], y["stashes"], strict=True))
        assert x["optimizer"].keys() == y["optimizer"].keys()
        for k, v in x["optimizer"].items():
            w = y["optimizer"][k]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, (cell, k)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, text_file):
    run = tmp_path_factory.mktemp("whole") / "run"
    res = _simulate(
        "--backend", "logical", "--steps", str(STEPS), "--out", str(run), text_file=text_file
    )
    assert res.exit_code == 0, res.output
    return run


def test_a_shorter_run_resumed_to_the_end_equals_the_uninterrupted_run(
    uninterrupted, tmp_path, text_file
):
    run = tmp_path / "run"
    res = _simulate("--backend", "logical", "--steps", "6", "--out", str(run), text_file=text_file)
    assert res.exit_code == 0, res.output
    # rounds launched after updates 4 and 5 are in flight at step 6 (tau 2): saved with it
    state = torch.load(checkpoint_path(run, 1, 0, 6), weights_only=True)
    assert len(state["simulator"]["rounds"]) == 2 and state["simulator"]["sentinel"]
    res = CliRunner().invoke(main, ["simulate", "--resume", str(run), "--steps", str(STEPS)])
    assert res.exit_code == 0, res.output  # the backend read from the checkpoints
    _assert_same_state(_cells(uninterrupted, STEPS), _cells(run, STEPS))
    whole = json.loads((uninterrupted / "summary.json").read_text())
    resumed = json.loads((run / "summary.json").read_text())
    for key in (
        "val_loss",
        "val_loss_replicas",
        "val_loss_avg_model",
        "tokens",
        "steps",
        "pp_bytes_per_replica_step",
        "dp_bytes_per_replica_step",
        "rejects",
    ):
        assert resumed[key] == whole[key], key
    assert resumed["curve"] == [c for c in whole["curve"] if c["step"] > 6]
    assert whole["rejects"]["poison"] > 0  # the sentinel did drop tensors


def test_a_stopped_run_saves_every_cell_and_resumes_to_the_same_end(
    uninterrupted, tmp_path, text_file
):
    """A stop (SIGTERM, SIGHUP, Ctrl-C: run_grid's StopRequest) ends the run after the update
    under way with every cell saved at that step, whatever the checkpoint interval."""
    from cli.logical import simulate_logical
    from cli.preflight import check_data
    from mesh.config import load_config
    from mesh.runtime.launch import StopRequest

    cfg = load_config([], [*SETS, f"data.path='{text_file}'", f"run.steps={STEPS}"])
    stop = StopRequest()
    stop.request("SIGTERM")  # before the first update: it stops after it
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        simulate_logical(cfg, run, check_data(cfg, False), stop=stop)
    assert e.value.code == 0
    assert sorted(p.name for p in (run / "checkpoints" / "0-1").iterdir()) == ["step-00000001.pt"]
    res = CliRunner().invoke(main, ["simulate", "--resume", str(run)])
    assert res.exit_code == 0, res.output
    _assert_same_state(_cells(uninterrupted, STEPS), _cells(run, STEPS))


def test_a_pooled_logical_run_is_refused_resume_in_one_line_saying_why(tmp_path, text_file):
    run = tmp_path / "run"
    res = _simulate(
        "--backend",
        "logical",
        "--steps",
        "4",
        "--out",
        str(run),
        "--set=pipeline.routing='pools'",
        text_file=text_file,
    )
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(main, ["simulate", "--resume", str(run), "--steps", "6"])
    assert res.exit_code == 2, res.output
    (line,) = res.output.strip().splitlines()
    assert "pipeline.routing = 'pools' does not resume" in line and "--backend torch" in line


def test_resume_refuses_a_damaged_simulator_state_in_one_line(tmp_path, text_file):
    run = tmp_path / "run"
    res = _simulate("--backend", "logical", "--steps", "4", "--out", str(run), text_file=text_file)
    assert res.exit_code == 0, res.output
    damaged = 0
    for j, i in ((0, 0), (1, 0), (0, 1), (1, 1)):  # every cell's: no older step to fall back on
        path = checkpoint_path(run, j, i, 4)
        state = torch.load(path, weights_only=True)
        if not state["simulator"]["rounds"]:  # a cell that sat its round out has none
            continue
        state["simulator"]["rounds"][0]["indices"] = torch.tensor([10**9])  # off the stage
        with path.open("wb") as f:  # its digest made anew: bad values, not damaged bytes
            write_digested(state, f)
        damaged += 1
    assert damaged
    res = CliRunner().invoke(main, ["simulate", "--resume", str(run), "--steps", "6"])
    assert res.exit_code == 2 and "malformed round in flight" in res.output, res.output
    assert "Traceback" not in res.output


def test_ctrl_c_stops_a_logical_run_saved_and_resume_finishes_it(tmp_path, text_file):
    """A real SIGINT to a running `simulate --backend logical`: it ends after the update under
    way, every cell saved at that step, exit 130 with one line; --resume then finishes it."""
    import re
    import signal
    import subprocess

    from mesh.testing.local_peers import meshtrain, wait_for

    run = tmp_path / "run"
    # the default sentinel bound: at 0.5 a cell's every microbatch can be dropped from the start
    # (1 run in 5), so it never reaches the checkpoint this test waits for
    sets = [s for s in SETS if not s.startswith("sentinel.z=")]
    sets = [f"--set={s}" for s in [*sets, f"data.path='{text_file}'"]]
    proc = meshtrain(
        "simulate",
        "--backend",
        "logical",
        "--steps",
        "100000",
        "--out",
        str(run),
        *sets,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        # training is under way: a cell has saved (the oldest saves rotate out within a second,
        # so the wait is for any, not for step 4's)
        saved = checkpoint_path(run, 1, 1, 4).parent
        wait_for(lambda: any(saved.glob("step-*.pt")), 120, "the first checkpoint")
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, out
    step = int(re.search(r"stopped \(SIGINT\) at step (\d+): every cell saved", out).group(1))
    assert all(checkpoint_path(run, j, i, step).is_file() for j in (0, 1) for i in (0, 1))
    res = CliRunner().invoke(main, ["simulate", "--resume", str(run), "--steps", str(step + 2)])
    assert res.exit_code == 0, res.output
    state = torch.load(checkpoint_path(run, 0, 0, step + 2), weights_only=True)
    assert state["step"] == step + 2
