"""A cell's stop (SIGTERM) while its transport starts exits at once, exit 0, and takes the
processes it had started with it: the main thread may be blocked in C++ (a TCPStore connect)
where no Python handler runs, and the start would hold the process for up to
transport.start_timeout_s (60 s by default), past a launcher's grace period (mesh/runtime/stop.py,
StopSignal.immediate). A cell whose launcher was SIGKILLed stops (watch_parent)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from comms import procs
from comms.procs import running as alive
from tests.helpers import wait_for

STORE_TIMEOUT_S = 120  # what the child would wait without the fix
HANG_S = 30  # well under it, with room for a loaded box

CHILD = """
import signal, subprocess, sys
from datetime import timedelta
import torch.distributed as dist
from mesh.runtime.stop import STOP
signal.signal(signal.SIGTERM, STOP.handler)
with STOP.{window}():
    helper = subprocess.Popen(["sleep", "300"])  # as a DHT process would be, half-started
    print(helper.pid, flush=True)
    print("ready", flush=True)
    dist.TCPStore("127.0.0.1", {port}, 2, False, timedelta(seconds={timeout}))
print("connected", flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _main_thread_sleeping(pid: int) -> bool:
    # field 3 of /proc/PID/stat: the main thread's state; S once it waits inside the connect
    return procs.state(pid) == "S"


def _stop_while_connecting(window: str, wait_s: float) -> tuple[int | None, float, int]:
    code = CHILD.format(window=window, port=_free_port(), timeout=STORE_TIMEOUT_S)
    root = Path(__file__).resolve().parents[2]
    child = subprocess.Popen(
        [sys.executable, "-c", code], cwd=root, stdout=subprocess.PIPE, text=True
    )
    helper = 0
    try:
        helper = int(child.stdout.readline())
        assert child.stdout.readline().strip() == "ready"
        wait_for(lambda: _main_thread_sleeping(child.pid), HANG_S, "the connect to block")
        sent = time.monotonic()
        child.send_signal(signal.SIGTERM)
        try:
            rc = child.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return None, time.monotonic() - sent, helper
        return rc, time.monotonic() - sent, helper
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
            if helper and alive(helper):
                os.kill(helper, signal.SIGKILL)


@pytest.mark.slow
def test_stop_inside_a_blocking_rendezvous_exits_at_once():
    rc, took_s, helper = _stop_while_connecting("immediate", HANG_S)
    assert rc == 0, f"exit {rc} after {took_s:.1f}s"
    # the process it had started went with it (reaped by init once its parent was gone)
    wait_for(lambda: not alive(helper), HANG_S, "the helper process to be gone")


@pytest.mark.slow
def test_a_deferred_stop_waits_out_the_connect():
    """The control: the same stop in the window that defers it (a checkpoint write's) is not
    seen until the call returns."""
    rc, took_s, _ = _stop_while_connecting("deferred", wait_s=5)
    assert rc is None, f"the deferred stop exited ({rc}) after {took_s:.1f}s"


LAUNCHER = """
import sys, time
from pathlib import Path
from mesh.config import Config
from comms.build import TorchMeeting
from mesh.runtime.launch import LocalGrid
from tests.unit.test_stop_signal import cell_that_waits
grid = LocalGrid(Config(), Path(sys.argv[1]), TorchMeeting("tcp://127.0.0.1:1"))
grid.start((0, 0), target=cell_that_waits)
print(grid.pid((0, 0)), flush=True)
time.sleep({hang})
"""


def cell_that_waits(*run_cell_args: object) -> None:
    """A cell process reduced to its stop: SIGTERM is a clean exit, the launcher is watched."""
    from mesh.runtime.stop import STOP, watch_parent

    signal.signal(signal.SIGTERM, STOP.handler)
    watch_parent(poll_s=0.2)
    time.sleep(HANG_S)


def _parent_of(pid: int) -> int | None:
    return procs.parent(pid)


@pytest.mark.slow
def test_a_cell_whose_launcher_was_killed_stops_and_leaves_nothing(tmp_path):
    """The launcher SIGKILLed (it cannot stop its cells): the cell stops on its own, and so
    does the process it was forked from (LocalGrid's fork server, which outlives the launcher
    while a cell holds it)."""
    root = Path(__file__).resolve().parents[2]
    code = LAUNCHER.format(hang=3 * HANG_S)
    launcher = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], cwd=root, stdout=subprocess.PIPE, text=True
    )
    cell = server = 0
    try:
        cell = int(launcher.stdout.readline())
        server = _parent_of(cell)
        launcher.kill()
        launcher.wait()
        wait_for(lambda: not alive(cell), HANG_S, "the orphaned cell to stop")
        wait_for(lambda: not alive(server), HANG_S, "its fork server to exit")
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid in (cell, server):
            if pid and alive(pid):
                os.kill(pid, signal.SIGKILL)


POOL_LAUNCHER = """
import os, time
from mesh.bench.simruns import worker_pool
with worker_pool(2) as pool:
    runs = [pool.apply_async(time.sleep, ({hang},)) for _ in range(2)]  # two long runs under way
    print(*sorted({{p.pid for p in pool._pool}}), flush=True)
    time.sleep({hang})
"""


@pytest.mark.slow
def test_a_studys_workers_end_when_the_study_is_killed():
    """A study SIGKILLed (a timeout's kill, the OOM killer) cannot end its pool: its workers
    stop the runs under way and end on their own, and so does the fork server they came
    from (without the watch, each ran its run to the end first: a study's run is minutes)."""
    root = Path(__file__).resolve().parents[2]
    study = subprocess.Popen(
        [sys.executable, "-c", POOL_LAUNCHER.format(hang=3 * HANG_S)],
        cwd=root,
        stdout=subprocess.PIPE,
        text=True,
    )
    workers: list[int] = []
    try:
        workers = [int(p) for p in study.stdout.readline().split()]
        assert len(workers) == 2
        server = _parent_of(workers[0])
        workers.append(server)
        study.kill()
        study.wait()
        for pid in workers:
            wait_for(lambda pid=pid: not alive(pid), HANG_S, f"process {pid} to end")
    finally:
        if study.poll() is None:
            study.kill()
            study.wait()
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_study_with_nothing_to_run_ends():
    """A study whose every run was cached opens its pool and is done at once: it ends (its
    workers were still starting, SIGTERM ignored, when terminate's SIGTERM came: it hung)."""
    root = Path(__file__).resolve().parents[2]
    code = "from mesh.bench.simruns import worker_pool\nwith worker_pool(2):\n    pass\n"
    study = subprocess.run([sys.executable, "-c", code], cwd=root, timeout=HANG_S * 4)
    assert study.returncode == 0
