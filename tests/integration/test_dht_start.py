"""A DHT start that hangs (its forked process never says it is ready) is killed and retried,
instead of waiting for ever: hivemind itself waits without a deadline; killing one leaves no
process and no socket file behind."""

import os
import subprocess
import sys
import time
from pathlib import Path

import helpers
import pytest

from comms.p2p import dht as dht_mod

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not alive
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_stuck_start_is_killed_and_the_next_attempt_starts(monkeypatch, tmp_path) -> None:
    marker = tmp_path / "hang"
    marker.touch()
    real_run, real_start = dht_mod.PeerDHT.run, dht_mod.PeerDHT.start
    started: list = []

    def hang_once(self) -> None:  # runs in the forked DHT process
        if marker.exists():
            marker.unlink()
            time.sleep(3600)
        real_run(self)

    def start(self) -> None:
        started.append(self)
        real_start(self)

    monkeypatch.setattr(dht_mod.PeerDHT, "run", hang_once)
    monkeypatch.setattr(dht_mod.PeerDHT, "start", start)
    monkeypatch.setattr(dht_mod, "READY_SLACK_S", 1.0)
    node = dht_mod.start_dht([], 60.0, host_maddrs=[LOOPBACK])
    try:
        assert not marker.exists() and len(started) == 2  # one stuck start, then a good one
        assert not _alive(started[0].pid)  # the stuck process is gone
        assert node.get_visible_maddrs()
    finally:
        node.shutdown()


def test_a_stuck_start_leaves_time_for_a_second_within_the_deadline(tmp_path, monkeypatch) -> None:
    """A start that hangs is given up after half the time start_dht has, not after the whole
    READY_SLACK_S (which alone exceeds a 30 s deadline), so the retry comes before the deadline."""
    marker = tmp_path / "hang-once"
    marker.touch()
    real_run = dht_mod.PeerDHT.run

    def hang_once(self) -> None:  # runs in the forked DHT process
        if marker.exists():
            marker.unlink()
            time.sleep(3600)
        real_run(self)

    monkeypatch.setattr(dht_mod.PeerDHT, "run", hang_once)
    t0 = time.monotonic()
    node = dht_mod.start_dht([], 30.0, host_maddrs=[LOOPBACK])
    try:
        assert not marker.exists() and node.get_visible_maddrs()
        assert time.monotonic() - t0 < 30.0 + 15.0  # the retry's own start, under load
    finally:
        node.shutdown()


def test_a_start_not_ready_by_its_deadline_is_a_start_timeout_and_leaves_nothing(
    monkeypatch,
) -> None:
    """Every attempt's wait ends at start_dht's deadline (the first one alone waited at least
    10 s, so a deadline under that was not kept), and a DHT process not ready by then is our
    StartTimeout, not hivemind's bare TimeoutError: a caller tells "this machine is too loaded
    to start in time" from a neighbour's timeout. A 1 ms deadline: no start is ready that soon."""
    from comms.errors import StartTimeout

    real_start = dht_mod.PeerDHT.start
    started: list = []

    def start(self) -> None:
        started.append(self)
        real_start(self)

    monkeypatch.setattr(dht_mod.PeerDHT, "start", start)
    since = time.time() - 1.0
    with pytest.raises(StartTimeout, match=r"not ready within its start deadline of 0\.001 s"):
        node = dht_mod.start_dht([], 0.001, host_maddrs=[LOOPBACK])
        node.shutdown()  # only without the fix: it waited for a ready DHT
    assert len(started) == 1 and not _alive(started[0].pid)
    assert not helpers.hivemind_files([started[0].pid], since)


class _AbortsInAChild:
    """Garbage whose finalizer aborts any process but its creator's, as a C++ object whose
    destructor joins threads or takes locks that only exist in the process that made it."""

    def __init__(self) -> None:
        self.creator, self.me = os.getpid(), self  # a cycle: only the collector frees it

    def __del__(self) -> None:
        if os.getpid() != self.creator:
            os.abort()


def test_a_dht_process_never_collects_the_garbage_it_inherited(monkeypatch) -> None:
    """A cycle that was garbage in our process when the DHT forked is not collected in the DHT
    process (its finalizer would run there): the start succeeds. Collections are off here until
    the fork, so the cycle is still there; the DHT process collects at once (patched run)."""
    import gc

    real_run = dht_mod.PeerDHT.run

    def collect_first(self) -> None:  # runs in the forked DHT process
        gc.enable()
        gc.collect()
        real_run(self)

    monkeypatch.setattr(dht_mod.PeerDHT, "run", collect_first)
    gc.disable()
    try:
        _AbortsInAChild()  # unreachable at once, freed only by a collection
        node = dht_mod.start_dht([], 20.0, host_maddrs=[LOOPBACK])
    finally:
        gc.enable()
        gc.collect()  # here: its finalizer does nothing
    try:
        assert node.get_visible_maddrs()
    finally:
        node.shutdown()


def test_a_start_stuck_after_it_started_a_child_is_killed_with_the_child(monkeypatch) -> None:
    real_run = dht_mod.PeerDHT.run
    children: list[int] = []

    def hang_with_a_child(self) -> None:  # runs in the forked DHT process: never ready
        subprocess.Popen(["sleep", "3600"])
        time.sleep(3600)
        real_run(self)

    monkeypatch.setattr(dht_mod.PeerDHT, "run", hang_with_a_child)
    monkeypatch.setattr(dht_mod, "READY_SLACK_S", 10.0)
    real_kill = dht_mod._kill_stuck

    def kill(pid):
        children.extend(dht_mod.procs.children(pid))
        real_kill(pid)

    monkeypatch.setattr(dht_mod, "_kill_stuck", kill)
    with pytest.raises(TimeoutError, match="not ready in 15 s"):
        dht_mod._started([], 5.0, host_maddrs=[LOOPBACK])
    assert len(children) == 1
    deadline = time.monotonic() + 30  # re-parented to init, which reaps it
    while _alive(children[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(children[0])


def test_killing_a_stuck_start_kills_its_p2pd_wherever_it_went_and_removes_its_sockets() -> None:
    """A p2pd still being exec'd when its DHT process was stopped is not yet named p2pd: it is
    found afterwards by the socket named after that process, in its command line."""
    stuck = subprocess.Popen(["sleep", "3600"])
    listen = f"-listen=/unix/tmp/hivemind-{stuck.pid}-p2pd-test.sock"
    as_p2pd = (  # prctl(PR_SET_NAME): what /proc/PID/comm says
        "import ctypes, time; ctypes.CDLL(None).prctl(15, b'p2pd'); print(1, flush=True); "
        "time.sleep(3600)"
    )
    daemon = subprocess.Popen([sys.executable, "-c", as_p2pd, listen], stdout=subprocess.PIPE)
    files = [Path(f"/tmp/hivemind-{stuck.pid}-{k}-test.sock") for k in ("p2pd", "p2pclient")]
    try:
        assert daemon.stdout.readline() == b"1\n"  # named p2pd by now
        for f in files:
            f.touch()
        dht_mod._kill_stuck(stuck.pid)
        assert stuck.wait(10) == -9 and daemon.wait(10) == -9
        assert not any(f.exists() for f in files)
    finally:
        for proc in (stuck, daemon):
            proc.kill()
            proc.wait()
        for f in files:
            f.unlink(missing_ok=True)


@pytest.mark.timeout(120)
def test_local_rendezvous_dht_starts_with_a_deadline() -> None:
    from comms.build import local_rendezvous

    with local_rendezvous("hivemind") as rz:
        assert rz.initial_peers and all("127.0.0.1" in a for a in rz.initial_peers)


def test_a_dht_that_did_not_shut_down_is_killed_with_its_p2pd_and_sockets() -> None:
    """P2PTransport.close's last step: a DHT process that ignored its shutdown (it ignores
    SIGTERM, so hivemind's hard way does nothing) would otherwise run as long as we do."""
    since = time.time() - 1.0
    node = dht_mod.start_dht([], 60.0, host_maddrs=[LOOPBACK])
    daemons = dht_mod._p2pd_children(node.pid)
    assert len(daemons) == 1
    assert helpers.hivemind_files([node.pid], since)
    dht_mod.kill_unstopped(node)  # no shutdown asked: as one stuck in it
    assert not node.is_alive()
    deadline = time.monotonic() + 30  # the p2pd, re-parented to init, is reaped there
    while _alive(daemons[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(daemons[0])
    assert not helpers.hivemind_files([node.pid], since)


_DIES_IN_A_SEND = """
import os, signal
from hivemind.utils.mpfuture import MPFuture
from comms.p2p import dht as dht_mod
pid = os.fork()
if pid == 0:  # a DHT process of ours, killed while it sends a result to its origin
    MPFuture._update_lock.acquire()
    os.kill(os.getpid(), signal.SIGKILL)
os.waitpid(pid, 0)
node = dht_mod._started([], 10.0, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
try:  # a value under a subkey: our nodes store no plain value (comms/p2p/bounds.py)
    assert node.store("k", 1, dht_mod.get_dht_time() + 60, subkey="s")
    assert node.get("k").value["s"].value == 1
finally:
    node.shutdown()
print("ok")
"""


def test_a_dht_process_killed_in_a_send_does_not_hang_the_next_one() -> None:
    """hivemind's process-shared locks are ours (comms/p2p/locks.py): with its semaphores, the
    next DHT process never says ready ("DHT process not ready in 40 s"). In a process of its
    own, so that a failure cannot hang this one's later DHTs."""
    done = subprocess.run(
        [sys.executable, "-c", _DIES_IN_A_SEND], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
