"""mesh.testing.prefork: `meshtrain ARGS` forked from the preloaded fork server is the process a
fresh `python -m cli.main ARGS` is (same output, exit code, environment, working directory,
session, signals), and answers as subprocess.Popen does where the benches and tests use it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import helpers
import pytest
from helpers import wait_for

from comms.procs import process_tree, running
from mesh.testing.local_peers import kill, meshtrain, start_dht, stop

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _both(*args: str, **kw) -> list[tuple[int, str]]:
    """(exit code, stdout+stderr) of `meshtrain ARGS`, forked and fresh."""
    out = []
    for fresh in (False, True):
        p = meshtrain(*args, fresh=fresh, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw)
        text, _ = p.communicate(timeout=120)
        # the installed entry point's name (click names `python -m` by its module)
        out.append((p.returncode, text.replace("python -m cli.main", "meshtrain")))
    return out


def test_a_forked_command_says_and_exits_as_a_fresh_one():
    forked, fresh = _both("show-config", "--set", "dp.tau=7")
    assert forked == fresh and forked[0] == 0 and "tau = 7" in forked[1]
    forked, fresh = _both("show-config", "--set", "dp.fraction=2")  # a user error: one line, 2
    assert forked == fresh and forked[0] == 2 and "dp.fraction" in forked[1]
    assert "Traceback" not in forked[1]


def test_the_callers_environment_and_directory_and_its_own_session(tmp_path):
    """The config file named relative to the caller's directory is read; the environment is the
    caller's at each start, not the fork server's (click wraps its help at $COLUMNS)."""
    narrow, _ = _both("--help", env_extra={"COLUMNS": "50"})
    wide, fresh_wide = _both("--help", env_extra={"COLUMNS": "200"})
    assert narrow[0] == wide[0] == 0 and wide == fresh_wide
    assert max(map(len, narrow[1].splitlines())) <= 50 < max(map(len, wide[1].splitlines()))
    (tmp_path / "mine.toml").write_text("[dp]\ntau = 9\n")
    p = meshtrain(
        "show-config",
        "--config",
        "mine.toml",
        cwd=str(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    text, _ = p.communicate(timeout=120)
    assert p.returncode == 0 and "tau = 9" in text, text
    dht, _ = start_dht()
    try:
        assert os.getpgid(dht.pid) == dht.pid  # its own session: killpg reaches its helpers
        assert os.getpgid(dht.pid) != os.getpgid(0)
    finally:
        stop(dht, 30)
    assert not running(dht.pid)


def test_signals_wait_and_timeouts_as_popen(tmp_path):
    dht, _ = start_dht()
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            dht.wait(0.2)
        assert dht.poll() is None and running(dht.pid)
        # the node alone (its DHT process sees it go, stops p2pd and removes its sockets)
        dht.send_signal(signal.SIGKILL)
        assert dht.wait(30) == -signal.SIGKILL
        assert dht.returncode == -signal.SIGKILL and not running(dht.pid)
        dht.kill()  # reaped: a no-op, as Popen's
    finally:
        kill(dht)
    log = tmp_path / "log.txt"
    with log.open("w") as f:
        p = meshtrain("show-config", stdout=f, stderr=subprocess.STDOUT)
    assert p.wait(120) == 0 and "[dp]" in log.read_text()


def test_kill_takes_the_whole_group_and_removes_its_socket_files():
    """local_peers.kill, a machine dying under a test: the node, its DHT process and p2pd are
    gone at once, and so are the socket files none of them lived to remove."""
    started = time.time() - 1.0
    dht, _ = start_dht()
    try:
        # (torch's shared-memory manager runs in a session of its own, and goes when its
        # clients have gone)
        group = [pid for pid in process_tree(dht.pid) if os.getpgid(pid) == dht.pid]
        files = helpers.hivemind_files(group, started)
        assert len(group) == 3 and files, (group, files)
        kill(dht)
        assert not [f for f in files if f.exists()], files
        wait_for(lambda: not any(running(pid) for pid in group), 10, "the group to be gone")
    finally:
        kill(dht)


CALLER = """
from mesh.testing.local_peers import start_dht

if __name__ == "__main__":
    dht, _ = start_dht()
    print(dht.pid, flush=True)
"""  # exits with its node still running


def test_a_node_its_caller_left_running_is_stopped_when_the_caller_exits(tmp_path):
    (tmp_path / "caller.py").write_text(CALLER)
    caller = subprocess.run(
        [sys.executable, "caller.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert caller.returncode == 0, caller.stderr
    pid = int(caller.stdout.split()[0])
    try:
        wait_for(lambda: not running(pid), 30, "the node to stop with its caller")
    finally:
        if running(pid):
            os.killpg(pid, signal.SIGKILL)
