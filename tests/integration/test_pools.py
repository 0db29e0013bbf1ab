"""Stage pools on the torch backend: the processes against the one-process simulator (seeded
routing: the same numbers), and a killed cell that does not stop its replica."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import helpers
import pytest
import torch

from mesh.config import load_config
from mesh.engine.pools import PoolSim
from mesh.runtime.checkpoint import checkpoint_path, saved_steps
from mesh.runtime.launch import run_grid
from mesh.runtime.metrics import read_metrics
from mesh.runtime.rows import parse_rows

pytestmark = pytest.mark.integration

TINY = [*helpers.TINY, "transport.recv_timeout_s=30", "pipeline.routing='pools'"]
RUN_S = 300  # a hang guard for one simulate


def _newest_flat(out: Path, j: int, i: int) -> tuple[int, torch.Tensor]:
    step = saved_steps(out, j, i)[-1]
    state = torch.load(checkpoint_path(out, j, i, step), weights_only=True)
    return step, state["flat"]


def test_seeded_pools_processes_compute_the_simulators_numbers(text_file, tmp_path):
    """3 stages x 2 replicas, every path drawn by routing.seeded_path: each cell's final weights
    and step count in the processes equal the simulator's (no averaging: the processes' rounds
    run on each cell's own steps, the simulator's on its ticks)."""
    cfg = load_config(
        [],
        [
            *TINY,
            f"data.path='{text_file}'",
            "grid.stages=3",
            "grid.replicas=2",
            "run.steps=8",
            "dp.mode=none",
            "pipeline.pool_choice='seeded'",
            "model.n_layers=3",
        ],
    )
    run = run_grid(cfg, tmp_path, timeout_s=240)
    assert run.ok, run.exit_codes
    sim = PoolSim(cfg)
    for _ in range(cfg.run.steps):
        sim.step()
    crossed = 0
    for i in range(2):
        for j in range(3):
            step, flat = _newest_flat(tmp_path, j, i)
            cell = sim.cells[i][j]
            assert step == cell.step, (j, i, step, cell.step)
            torch.testing.assert_close(flat, cell.flat, rtol=1e-5, atol=1e-6)
            crossed += cell.step != cfg.run.steps
    assert crossed > 0  # some cell took more (or fewer) microbatches than its own stream had
    rows = read_metrics(tmp_path)
    assert sum(r["step"] for (j, _), v in rows.items() if j == 0 for r in v if r.get("final")) == 16


def _cmd(out: Path, steps: int, *sets: str) -> list[str]:
    sets = (*TINY, "model.n_layers=3", "checkpoint.every=5", *sets)
    args = [arg for item in sets for arg in ("--set", item)]
    return [
        sys.executable,
        "-m",
        "cli.main",
        "simulate",
        "--backend",
        "torch",
        "--grid",
        "3x2",
        "--steps",
        str(steps),
        "--out",
        str(out),
        *args,
    ]


def _rows(out: Path, cell: str) -> list[dict]:
    path = out / "metrics" / f"{cell}.jsonl"
    return parse_rows(path.read_bytes()) if path.exists() else []


def _step(out: Path, cell: str) -> int:
    steps = [r["step"] for r in _rows(out, cell) if "event" not in r and not r.get("final")]
    return max(steps, default=0)


@pytest.mark.timeout(3 * RUN_S)
def test_a_killed_cell_does_not_stop_its_replica(tmp_path):
    """SIGKILL of s1r1 in a pooled 3x2 grid (emulated compute) with elastic.max_restarts = 0:
    it stays dead, and both streams train on through s1r0 to their last microbatch (no replica
    restart, no stall); what s1r1 held is routed again or voided, and counted; exit 0."""
    out = tmp_path / "run"
    steps = 80
    pace = (
        "emulation.compute='emulated'",
        "emulation.forward_ms=40",
        "emulation.backward_ms=80",
        "elastic.pool_timeout_s=5",
        "elastic.max_restarts=0",
    )
    proc = subprocess.Popen(
        _cmd(out, steps, *pace), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        helpers.wait_for(
            lambda: proc.poll() is not None or _step(out, "1-1") >= 8,
            RUN_S,
            "s1r1 past a checkpoint",
        )
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        victim = [r for r in _rows(out, "1-1") if r.get("event") == "started"][-1]["pid"]
        os.kill(victim, signal.SIGKILL)
        at_kill = {c: _step(out, c) for c in ("0-0", "0-1", "1-0")}
        _, err = proc.communicate(timeout=2 * RUN_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    notes = [ln for ln in err.replace("\r", "\n").splitlines() if "died" in ln]
    assert len(notes) == 1 and "cell s1r1 died (SIGKILL); past elastic.max_restarts" in notes[0]
    for c in ("0-0", "0-1", "1-0", "1-1", "2-0", "2-1"):  # one life each: nobody restarted
        assert len([r for r in _rows(out, c) if r.get("event") == "started"]) == 1, c
    finals = {c: [r for r in _rows(out, c) if r.get("final")] for c in ("0-0", "0-1", "1-0")}
    assert all(finals.values()), finals
    streams = [finals[c][-1] for c in ("0-0", "0-1")]
    given_up = sum(f["voided"] for f in streams)
    assert all(f["step"] + f["voided"] >= steps - 4 for f in streams), streams
    assert given_up <= 8, streams  # at most what the window held at s1r1
    # s1r0 carried both streams alone after the kill: its updates grew past its share
    assert (
        finals["1-0"][-1]["step"] - at_kill["1-0"]
        >= sum(steps - at_kill[c] for c in ("0-0", "0-1")) - 16
    )
    assert sum(f["rerouted"] for f in streams) + given_up >= 1  # s1r1's work went somewhere
