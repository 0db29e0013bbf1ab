"""DIR/run.lock: one launcher per run directory, stale locks taken over."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from comms.procs import start_ticks
from mesh.config import ConfigError
from mesh.runtime.run_lock import LOCK_NAME, holder, run_lock


def test_a_live_holder_refuses_a_second_launcher(tmp_path):
    # another live process holds it (a child that sleeps), written as run_lock writes it
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = start_ticks(child.pid)
        (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": child.pid, "start": start}))
        assert holder(tmp_path) == {"pid": child.pid, "start": start}
        with pytest.raises(ConfigError, match=f"in use by a running grid \\(pid {child.pid}\\)"):
            with run_lock(tmp_path):
                pass
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == child.pid  # untouched
    finally:
        child.kill()
        child.wait()
    # the holder is gone now: its lock is stale and taken over, and released at the end
    with run_lock(tmp_path):
        assert holder(tmp_path)["pid"] == os.getpid()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_reused_pid_or_a_torn_lock_is_stale(tmp_path):
    # our own pid with another start time: a pid the kernel reused, not the launcher that wrote it
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": os.getpid(), "start": 1}))
    assert holder(tmp_path) is None
    (tmp_path / LOCK_NAME).write_text('{"pid": ')
    assert holder(tmp_path) is None
    with run_lock(tmp_path):
        assert holder(tmp_path)["pid"] == os.getpid()
    assert not list(tmp_path.glob(".run.lock.*"))  # no temporary left
