"""`meshtrain simulate` on a disk that fills up: one line naming the cell, the file and "no
space left on device", exit 2, nothing torn left behind (no partial checkpoint, no torn
metrics row), and `--resume` finishes the run once space is freed, even when the disk filled
before the first checkpoint (the run directory and its config are kept, and the next line says
what to do). The disk is a small tmpfs this test mounts (root only) and fills with a ballast
file."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import helpers
import pytest

pytestmark = pytest.mark.integration

DISK_BYTES = 20 << 20
FREE_BYTES = 600 << 10  # room for one round of checkpoints of the 2x1 grid, not two
NO_CHECKPOINT_BYTES = 64 << 10  # room for the config and a few rows, not one checkpoint (~180 KB)
RUN = [*helpers.TINY, "checkpoint.every=2", "transport.recv_timeout_s=30", "run.steps=8"]


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _meshtrain(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return helpers.cli(*args, cwd=cwd, timeout_s=300)


def _fill(disk: Path, leave_bytes: int) -> Path:
    ballast = disk / "ballast"
    st = os.statvfs(disk)
    with ballast.open("wb") as f:
        os.posix_fallocate(f.fileno(), 0, st.f_bavail * st.f_frsize - leave_bytes)
    return ballast


def test_a_full_disk_is_one_line_leaves_nothing_torn_and_resumes(small_disk, text_file, tmp_path):
    run_dir = small_disk / "run"
    sets = [a for s in [*RUN, f"data.path='{text_file}'"] for a in ("--set", s)]
    ballast = _fill(small_disk, FREE_BYTES)
    full = _meshtrain("simulate", "--grid", "2x1", "--out", str(run_dir), *sets, cwd=tmp_path)
    assert full.returncode == 2, full.stderr
    assert "Traceback" not in full.stderr + full.stdout, full.stderr
    errors = [ln for ln in full.stderr.splitlines() if ln.startswith("error")]
    assert len(errors) == 1, full.stderr
    assert re.match(rf"error: cell s[01]r0: {run_dir}/\S+: no space left on device", errors[0])

    # nothing torn: no partial checkpoint, every metrics line a whole row
    assert not list(run_dir.glob("checkpoints/*/.*")), list(run_dir.glob("checkpoints/*/*"))
    for path in run_dir.glob("metrics/*.jsonl"):
        data = path.read_bytes()
        assert data.endswith(b"\n"), path
        assert all(isinstance(json.loads(ln), dict) for ln in data.splitlines()), path

    ballast.unlink()
    resumed = _meshtrain("simulate", "--resume", str(run_dir), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 8


def test_a_full_disk_before_the_first_checkpoint_keeps_the_run_and_resumes(
    small_disk, text_file, tmp_path
):
    """No room for even one checkpoint: the error line, then one that says exactly what to do;
    the run directory and its config.toml are kept (they were removed with nothing saved, and
    `--resume` then had no directory); once there is space `--resume` runs the whole run, each
    replica from step 0 (said), and its summary counts the updates of both lives."""
    run_dir = small_disk / "run"
    sets = [a for s in [*RUN, f"data.path='{text_file}'"] for a in ("--set", s)]
    ballast = _fill(small_disk, NO_CHECKPOINT_BYTES)
    full = _meshtrain("simulate", "--grid", "2x1", "--out", str(run_dir), *sets, cwd=tmp_path)
    assert full.returncode == 2, full.stderr
    assert "Traceback" not in full.stderr + full.stdout, full.stderr
    errors = [ln for ln in full.stderr.splitlines() if ln.startswith("error")]
    assert len(errors) == 1 and "no space left on device" in errors[0], full.stderr
    assert not list(run_dir.glob("checkpoints/*/step-*.pt")), "before the first checkpoint"
    assert (run_dir / "config.toml").is_file(), list(run_dir.rglob("*"))
    told = [ln for ln in full.stderr.splitlines() if "the run directory is kept" in ln]
    assert len(told) == 1 and told[0].endswith(
        f"then continue with: meshtrain simulate --resume {run_dir}"
    ), full.stderr

    ballast.unlink()
    resumed = _meshtrain("simulate", "--resume", str(run_dir), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "replica 0 starts again from step 0" in resumed.stderr, resumed.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["lives"] == {"s0r0": 2, "s1r0": 2}, summary
