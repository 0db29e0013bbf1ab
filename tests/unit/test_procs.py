"""comms/procs.py: the one reader of /proc. Real processes of our own (sleep, a Python child
named by prctl), never anyone else's."""

import os
import signal
import socket
import subprocess
import sys
import time

from comms import procs

# a child whose name (prctl PR_SET_NAME) holds a space and a parenthesis, as comm may
_NAMED = (
    "import ctypes, subprocess, sys, time; ctypes.CDLL(None).prctl(15, b'odd) na me'); "
    "k = subprocess.Popen(['sleep', '3600']); print(k.pid, flush=True); time.sleep(3600)"
)


def _wait(cond, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_running_tells_a_zombie_from_a_live_process() -> None:
    child = subprocess.Popen(["sleep", "3600"])
    try:
        assert procs.running(child.pid) and procs.pid_alive(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        # not reaped yet: it exists (pid_alive) but does not run
        _wait(lambda: not procs.running(child.pid), "the killed child still runs")
        assert procs.pid_alive(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not procs.running(child.pid) and not procs.pid_alive(child.pid)


def test_the_tree_its_names_and_a_search_by_argument() -> None:
    mark = f"--procs-test-{os.getpid()}"
    parent = subprocess.Popen([sys.executable, "-c", _NAMED, mark], stdout=subprocess.PIPE)
    try:
        grandchild = int(parent.stdout.readline())
        assert procs.comm(parent.pid) == "odd) na me"
        assert procs.children(parent.pid) == [grandchild]
        assert procs.children(parent.pid, "sleep") == [grandchild]
        assert procs.children(parent.pid, "p2pd") == []
        assert procs.process_tree(parent.pid) == [parent.pid, grandchild]
        assert parent.pid in procs.process_tree(os.getpid())
        assert procs.named_with(mark.encode(), "odd) na me") == [parent.pid]
        assert procs.named_with(mark.encode(), "sleep") == []
        assert procs.start_ticks(parent.pid) <= procs.start_ticks(grandchild)
        assert procs.parent(grandchild) == parent.pid and procs.parent(parent.pid) == os.getpid()
        assert procs.state(grandchild) == "S"  # sleep 3600
    finally:
        parent.kill()
        parent.wait()
        os.kill(grandchild, signal.SIGKILL)  # re-parented, and reaped, elsewhere


def test_a_gone_process_has_no_name_start_or_children() -> None:
    child = subprocess.Popen(["true"])
    child.wait()
    assert procs.comm(child.pid) == "" and procs.start_ticks(child.pid) is None
    assert procs.children(child.pid) == [] and not procs.running(child.pid)
    assert procs.state(child.pid) is None and procs.parent(child.pid) is None


def test_bound_sockets_name_a_bound_unix_socket_and_not_a_leftover(tmp_path) -> None:
    path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        assert str(path) in procs.bound_sockets()
    assert path.exists() and str(path) not in procs.bound_sockets()  # left behind


def test_a_process_start_time_is_now_for_a_new_child_and_none_once_reaped():
    import subprocess
    import time

    from comms.procs import started_unix_s

    before = time.time()
    child = subprocess.Popen(["sleep", "30"])
    try:
        started = started_unix_s(child.pid)
        assert started is not None and before - 2 <= started <= time.time() + 2
    finally:
        child.kill()
        child.wait()
    assert started_unix_s(child.pid) is None
