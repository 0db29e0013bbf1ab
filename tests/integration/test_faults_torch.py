"""The fault matrix of the torch backend (`simulate`'s default), as a user meets it: the CLI in
its own process, real cells, real signals. A slow replica with a short round deadline keeps
averaging; a killed cell's replica is restarted while the other trains on, and the run
finishes; past elastic.max_restarts the grid stops saved and `--resume` finishes it; SIGTERM
to the launcher stops and saves every cell, exit 0, nothing left running, and the run resumes;
a stop at a random step (SIGTERM or Ctrl-C) keeps every step any cell completed and `--resume`
starts there; a damaged checkpoint is passed over and the resumed run's summary counts every
life; a second launcher on a live directory is refused in one line."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import helpers
import pytest

from comms.procs import pid_alive
from mesh.runtime.checkpoint import checkpoint_path, saved_steps
from mesh.runtime.metrics import read_metrics
from mesh.runtime.rows import parse_rows

pytestmark = pytest.mark.integration

GRID = ["--backend", "torch", "--grid", "2x2"]
TINY = [*helpers.TINY, "checkpoint.every=5", "transport.recv_timeout_s=30"]
RUN_S = 300  # a hang guard for one simulate, far above the ~30 s one takes on a loaded box


def _sets(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def _cmd(out: Path, steps: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "cli.main",
        "simulate",
        *GRID,
        "--steps",
        str(steps),
        "--out",
        str(out),
        *_sets(*TINY),
        *extra,
    ]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_S)


def _rows(out: Path, cell: str) -> list[dict]:
    path = out / "metrics" / f"{cell}.jsonl"
    return parse_rows(path.read_bytes()) if path.exists() else []


def _pids(out: Path) -> list[int]:
    """Every cell process any life of the run started (their `started` events)."""
    return [
        r["pid"]
        for path in sorted((out / "metrics").glob("*.jsonl"))
        for r in parse_rows(path.read_bytes())
        if r.get("event") == "started"
    ]


def _starts(out: Path, cell: str) -> list[dict]:
    return [r for r in _rows(out, cell) if r.get("event") == "started"]


def _trained(out: Path, cell: str, life: int) -> int:
    """Updates the cell's `life`-th process made (0 before it started)."""
    rows, lives, first, last = _rows(out, cell), 0, None, None
    for r in rows:
        if r.get("event") == "started":
            lives += 1
        elif lives == life and "event" not in r and not r.get("final"):
            first = r["step"] if first is None else first
            last = r["step"]
    return 0 if first is None else last - first + 1


def _running(proc: subprocess.Popen) -> bool:
    """True while the launcher runs; its exit fails the test at once with what it printed (a
    wait for a step it will never log would only time out, saying nothing)."""
    if proc.poll() is None:
        return True
    out, err = proc.communicate()
    raise AssertionError(f"the launcher exited early ({proc.returncode}): {(out + err)[-3000:]}")


def _step(out: Path, cell: str) -> int:
    steps = [r["step"] for r in _rows(out, cell) if "event" not in r and not r.get("final")]
    return max(steps, default=0)


def _saved_at(out: Path) -> int:
    """The newest step any cell saved at."""
    return max(
        r["step"]
        for path in (out / "metrics").glob("*.jsonl")
        for r in parse_rows(path.read_bytes())
        if r.get("event") == "saved"
    )


def _final_steps(out: Path) -> dict[tuple[int, int], int]:
    rows = read_metrics(out)
    return {
        cell: max(r["step"] for r in cell_rows if r.get("final"))
        for cell, cell_rows in rows.items()
        if any(r.get("final") for r in cell_rows)
    }


def test_a_slow_replica_with_a_short_round_deadline_keeps_averaging(tmp_path):
    """s1r1 3x slower (emulated compute: the slowdown is real time, not CPU), rounds due in 1 s:
    the fast replica averages at the column's pace, failed rounds stay under 10% of started
    (a late round used to turn averaging off for the rest of the run)."""
    out = tmp_path / "run"
    res = _run(
        _cmd(
            out,
            120,
            *_sets(
                "emulation.compute='emulated'",
                'emulation.slowdowns=["s1r1=3.0"]',
                "transport.round_timeout_s=1",
            ),
        )
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rounds = json.loads((out / "summary.json").read_text())["rounds"]
    started, failed = rounds["rounds_started"], rounds["rounds_failed"]
    assert started >= 4 * 120 // 4, rounds  # each cell averaged at least every 4th update
    assert failed <= 0.10 * started, rounds
    assert rounds["rounds_applied"] >= 0.8 * started, rounds


def _lives(out: Path, cell: str) -> list[list[dict]]:
    """The update rows of each process of the cell, in order."""
    lives: list[list[dict]] = []
    for r in _rows(out, cell):
        if r.get("event") == "started":
            lives.append([])
        elif lives and "event" not in r and not r.get("final"):
            lives[-1].append(r)
    return lives


@pytest.mark.timeout(3 * RUN_S)  # two lives of one replica back to back: a hang guard
def test_a_killed_cell_restarts_its_replica_alone_and_the_other_trains_on(tmp_path):
    """SIGKILL of s1r1 past a checkpoint of its replica: replica 1 alone starts again from its
    newest shared checkpoint (said on the console) while replica 0 trains on in the same
    processes, its steps never going back; once replica 1 is back, rounds between the replicas
    are applied again on both sides; every cell reaches the last step, exit 0. Emulated compute
    8x slower than the default, so replica 0 is still training when replica 1 is back (its
    start took 25 s on a 2-core box at load 20; replica 0 has about twice that left)."""
    out = tmp_path / "run"
    steps = 200
    pace = ("emulation.compute='emulated'", "emulation.forward_ms=80", "emulation.backward_ms=160")
    proc = subprocess.Popen(
        _cmd(out, steps, *_sets(*pace)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        helpers.wait_for(
            lambda: _running(proc) and _step(out, "1-1") >= 6 and _step(out, "0-1") >= 6,
            RUN_S,
            "replica 1 past a checkpoint",
        )
        os.kill(_starts(out, "1-1")[-1]["pid"], signal.SIGKILL)
        helpers.wait_for(
            lambda: _running(proc) and len(_lives(out, "1-1")) == 2 and _lives(out, "1-1")[1],
            RUN_S,
            "replica 1's second life training",
        )
        # rounds replica 0 applied so far: any later one has a payload of replica 1's new life
        # (a round needs another member's payload; those launched before the kill are long
        # applied or failed: the restart takes seconds, a round lands tau = 5 updates late)
        applied_at_back = {c: _lives(out, c)[0][-1]["rounds_applied"] for c in ("0-0", "1-0")}
        _, err = proc.communicate(timeout=2 * RUN_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    notes = [ln for ln in err.replace("\r", "\n").splitlines() if "died" in ln]
    assert (
        len(notes) == 1
        and notes[0].startswith("cell s1r1 died (SIGKILL); replica 1 starts again from step ")
        and notes[0].endswith(", restart 1 of 3")
    ), notes
    resumed_at = int(notes[0].split("from step ")[1].split(",")[0])
    assert resumed_at >= 5, notes  # from its checkpoint, not from the start
    for cell in ("0-0", "1-0"):  # one process, steps 1..300 in order, rounds applied again
        (life,) = _lives(out, cell)
        assert [r["step"] for r in life] == list(range(1, steps + 1)), cell
        assert life[-1]["rounds_applied"] - applied_at_back[cell] >= 10, (cell, applied_at_back)
    for cell in ("0-1", "1-1"):  # a second process from the replica's checkpoint to the end
        first, second = _lives(out, cell)
        assert second[0]["step"] == resumed_at + 1 and second[-1]["step"] == steps, cell
        assert second[-1]["rounds_applied"] >= 10, (cell, second[-1])
        resumed = [r for r in _rows(out, cell) if r.get("event") == "resumed"]
        assert len(resumed) == 1 and resumed[0]["step"] == resumed_at, resumed
    assert set(_final_steps(out).values()) == {steps}


def test_sigterm_while_a_replica_restarts_stops_saved_and_resumes(tmp_path):
    """SIGTERM to the launcher as soon as it said it starts a killed cell's replica again (its
    new cells are still starting: SIGTERM is ignored until their handler is in): exit 0, the
    stop said, no process of any life left, and `--resume` finishes the run (each replica
    from its own cut)."""
    out, log = tmp_path / "run", tmp_path / "err.txt"
    with log.open("w") as err_file:
        proc = subprocess.Popen(_cmd(out, 400), stdout=subprocess.PIPE, stderr=err_file, text=True)
    try:
        helpers.wait_for(
            lambda: _running(proc) and _step(out, "1-1") >= 6, RUN_S, "s1r1 past a checkpoint"
        )
        os.kill(_starts(out, "1-1")[-1]["pid"], signal.SIGKILL)
        helpers.wait_for(
            lambda: "replica 1 starts again" in log.read_text(), RUN_S, "the restart's notice"
        )
        proc.send_signal(signal.SIGTERM)
        stdout, _ = proc.communicate(timeout=RUN_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = log.read_text()
    assert proc.returncode == 0, err[-3000:]
    assert f"stopped (SIGTERM): every cell saved; continue with --resume {out}" in stdout
    assert "Traceback" not in err and "error:" not in err, err[-3000:]
    assert not [p for p in _pids(out) if pid_alive(p)]
    end = _saved_at(out) + 10
    res = _run([*_cmd(out, end), "--resume", str(out)])
    assert res.returncode == 0, res.stderr[-3000:]
    assert set(_final_steps(out).values()) == {end}


@pytest.mark.timeout(3 * RUN_S)  # two lives of one replica and a resume: a hang guard
def test_a_killed_cell_is_restarted_and_past_the_limit_the_grid_stops_resumable(tmp_path):
    """SIGKILL of s1r1: its replica starts again from its newest shared checkpoint. With
    elastic.max_restarts = 1, a second kill stops the grid, every other cell saved, in one
    line; `--resume` finishes it."""
    out = tmp_path / "run"
    steps = 400
    # the kills are seen as process deaths; a restarted replica's cells can take over TINY's
    # 30 s to meet again on a loaded box, which its neighbour would count as a second failure
    limits = ("elastic.max_restarts=1", "transport.recv_timeout_s=120")
    proc = subprocess.Popen(
        _cmd(out, steps, *_sets(*limits, 'emulation.slowdowns=["s1r1=2.0"]')),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for life in (1, 2):  # each life: the victim trains past a checkpoint of its own
            helpers.wait_for(
                lambda n=life: _running(proc) and _trained(out, "1-1", n) >= 6,
                RUN_S,
                f"life {life} of s1r1 past a checkpoint",
            )
            os.kill(_starts(out, "1-1")[-1]["pid"], signal.SIGKILL)
        _, err = proc.communicate(timeout=RUN_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, err[-3000:]
    assert "cell s1r1 died (SIGKILL); replica 1 starts again from step " in err
    assert ", restart 1 of 1" in err
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "after 1 restarts" in errors[0] and "resume" in errors[0], err
    assert "Traceback" not in err
    assert not [p for p in _pids(out) if pid_alive(p)]  # every life of every cell reaped
    # the cut is resumable: the other cells saved, pruning kept what every cell shares (a few
    # updates past the newest save are enough to show it; the whole run would only cost time)
    end = _saved_at(out) + 10
    res = _run([*_cmd(out, end), "--resume", str(out)])
    assert res.returncode == 0, res.stderr[-3000:]
    assert set(_final_steps(out).values()) == {end}


def test_sigterm_to_the_launcher_stops_and_saves_and_a_second_launcher_is_refused(tmp_path):
    """While the grid trains, a second `simulate --resume` on its directory is refused in one
    line (exit 2, the grid untouched); SIGTERM to the launcher: exit 0, every cell saved and
    reaped; `--resume` finishes the run."""
    out = tmp_path / "run"
    steps = 400
    proc = subprocess.Popen(
        _cmd(out, steps), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        helpers.wait_for(
            lambda: _running(proc) and _step(out, "1-0") >= 8, RUN_S, "the grid training"
        )
        second = _run([*_cmd(out, steps), "--resume", str(out)])
        assert second.returncode == 2, second.stderr
        lines = [ln for ln in second.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and f"in use by a running grid (pid {proc.pid})" in lines[0], lines
        assert proc.poll() is None  # the first grid runs on
        proc.send_signal(signal.SIGTERM)
        stdout, err = proc.communicate(timeout=RUN_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert f"stopped (SIGTERM): every cell saved; continue with --resume {out}" in stdout
    assert not [p for p in _pids(out) if pid_alive(p)]
    assert not (out / "run.lock").exists()
    cells = ("0-0", "1-0", "0-1", "1-1")
    saved = [r for c in cells for r in _rows(out, c) if r.get("event") == "saved"]
    assert len(saved) == 4, saved
    end = _saved_at(out) + 10
    res = _run([*_cmd(out, end), "--resume", str(out)])
    assert res.returncode == 0, res.stderr[-3000:]
    assert set(_final_steps(out).values()) == {end}


def _resumed_at(out: Path, cell: str) -> int:
    """The step the cell's latest life resumed from (its `resumed` event)."""
    return [r for r in _rows(out, cell) if r.get("event") == "resumed"][-1]["step"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "ctrl-c"])
def test_a_stop_at_a_random_step_keeps_every_step_and_resume_starts_there(tmp_path, sig):
    """SIGTERM or Ctrl-C to the launcher at a random step, far from a periodic checkpoint
    (checkpoint.every = 50): each replica's cells finish their update and save one step, at or
    past every step any of them had logged when the signal came (nothing completed is lost;
    a resume used to fall back to the last periodic checkpoint, 16-37 updates back); the
    table, summary.json and the resume line are printed (exit 0, 130 for Ctrl-C), and
    `--resume` starts each cell from its replica's step."""
    at = random.randint(8, 40)
    print(f"stop once every cell is at step {at}")  # the seed of a failure, with -s
    out = tmp_path / "run"
    cells = ("0-0", "1-0", "0-1", "1-1")
    proc = subprocess.Popen(
        _cmd(out, 4000, *_sets("checkpoint.every=50")),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        helpers.wait_for(
            lambda: _running(proc) and min(_step(out, c) for c in cells) >= at,
            RUN_S,
            f"step {at}",
        )
        seen = {c: _step(out, c) for c in cells}
        proc.send_signal(sig)
        stdout, err = proc.communicate(timeout=RUN_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == (130 if sig == signal.SIGINT else 0), err[-3000:]
    name = signal.Signals(sig).name
    assert f"stopped ({name}): every cell saved; continue with --resume {out}" in stdout
    assert "| rejects" in stdout.splitlines()[0] and (out / "summary.json").is_file(), stdout
    assert "Traceback" not in err and "error:" not in err, err[-3000:]
    assert not [p for p in _pids(out) if pid_alive(p)]
    line = re.search(r"saved one step: replica 0 at step (\d+), replica 1 at step (\d+)", stdout)
    assert line, stdout
    stop_at = {0: int(line[1]), 1: int(line[2])}
    print(f"steps logged at the signal {seen}, saved at {stop_at}")
    for cell in cells:
        j, i = (int(x) for x in cell.split("-"))
        assert saved_steps(out, j, i)[-1] == stop_at[i], (cell, saved_steps(out, j, i), stop_at)
        assert stop_at[i] >= seen[cell], (cell, stop_at, seen)  # not one completed step lost
    end = max(stop_at.values()) + 5
    res = _run([*_cmd(out, end, *_sets("checkpoint.every=50")), "--resume", str(out)])
    assert res.returncode == 0, res.stderr[-3000:]
    assert "passed over" not in res.stderr, res.stderr[-3000:]
    for cell in cells:
        assert _resumed_at(out, cell) == stop_at[int(cell[-1])], cell
    assert set(_final_steps(out).values()) == {end}


def _flip_middle(path: Path, n: int = 4096) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + n] = bytes(b ^ 0xFF for b in data[mid : mid + n])
    path.write_bytes(bytes(data))


def _lives_raw(out: Path, cell: str) -> list[list[dict]]:
    """The cell's rows (events too) cut at its `started` events, straight from the file."""
    lives: list[list[dict]] = []
    for r in _rows(out, cell):
        if r.get("event") == "started":
            lives.append([])
        lives[-1].append(r)
    return lives


def test_a_damaged_checkpoint_is_passed_over_and_the_summary_counts_every_life(tmp_path):
    """4 KB flipped in the middle of s1r0's newest checkpoint (12): `--resume` passes it over
    like a torn one, named, and replica 0 resumes from the step before (8), replica 1 from 12,
    said under the table. Its metrics files then hold steps 9-12 of replica 0 twice; read back,
    each step is there once (the life the run went on from); summary.json's rounds, rejects
    and bytes are the sums over every life of every cell, bytes per replica step over every
    update those lives trained."""
    out = tmp_path / "run"
    every = _sets("checkpoint.every=4")
    assert _run(_cmd(out, 12, *every)).returncode == 0
    damaged = checkpoint_path(out, 1, 0, 12)
    _flip_middle(damaged)
    res = _run([*_cmd(out, 16, *every), "--resume", str(out)])
    assert res.returncode == 0, res.stderr[-3000:]
    assert (
        "passed over damaged checkpoints (renamed *.pt.bad): s1r0 step 12: unreadable (its "
        "bytes do not match the digest saved with it" in res.stderr
    ), res.stderr[-3000:]
    assert damaged.with_name(damaged.name + ".bad").exists()
    assert {c: _resumed_at(out, c) for c in ("0-0", "1-0", "0-1", "1-1")} == {
        "0-0": 8,
        "1-0": 8,
        "0-1": 12,
        "1-1": 12,
    }
    assert (
        "replicas resumed from different steps (replica 0 from step 8, replica 1 from "
        "step 12" in res.stdout
    ), res.stdout
    raw = [r["step"] for r in _rows(out, "1-0") if "event" not in r and not r.get("final")]
    assert sorted(raw) == sorted([*range(1, 13), *range(9, 17)])  # 9-12 twice in the file
    for cell, rows in read_metrics(out).items():
        steps = [r["step"] for r in rows if not r.get("final")]
        assert steps == list(range(1, 17)), (cell, steps)  # once each, in order
    summary = json.loads((out / "summary.json").read_text())
    want_rounds, sent, rejects, updates = {}, {}, 0, 0
    for cell in ("0-0", "1-0", "0-1", "1-1"):
        lives = _lives_raw(out, cell)
        assert len(lives) == 2, cell
        for life in lives:
            ups = [r for r in life if "event" not in r and not r.get("final")]
            final = [r for r in life if r.get("final")][-1]  # both lives ran to their end
            updates += len(ups)
            for k in ("rounds_started", "rounds_applied", "rounds_failed"):
                want_rounds[k] = want_rounds.get(k, 0) + ups[-1][k]
            for kind, n in final["bytes_sent"].items():
                sent[kind] = sent.get(kind, 0) + n
            rejects += sum(final["rejects"].values())
    assert updates == 2 * (12 + 8) + 2 * (12 + 4)  # replica 0 trained 9-12 again
    assert {k: summary["rounds"][k] for k in want_rounds} == want_rounds
    assert summary["bytes"]["sent"] == sent and summary["rejects"] == rejects
    pp = (sent["activation"] + sent["gradient"]) / (updates / 2)
    assert summary["bytes"]["pp_per_replica_step"] == pytest.approx(pp)
    assert summary["lives"] == dict.fromkeys(["s0r0", "s0r1", "s1r0", "s1r1"], 2)
