"""A unix socket bound by a process in another network namespace counts as bound
(comms.procs.bound_sockets): the leftover sweeps of tests beside a namespace test must not
delete the sockets of its peers' p2pd; and it is that process's socket
(mesh.testing.procstat.hivemind_sockets), so killing its group removes it. Root only; skipped
cleanly otherwise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from comms import procs
from comms.netns import netns_pair, unavailable
from mesh.testing.procstat import hivemind_sockets

pytestmark = [pytest.mark.throttled, pytest.mark.slow]

BIND = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1])
print("bound", flush=True)
sys.stdin.read()
"""


def test_a_socket_bound_in_another_network_namespace_is_bound():
    why = unavailable()
    if why:
        pytest.skip(f"network namespaces unavailable: {why}")
    path = Path(f"/tmp/hivemind-nstest-{os.getpid()}.sock")  # the name a p2pd's socket has
    path.unlink(missing_ok=True)
    with netns_pair() as pair:
        cmd = pair.cmd(pair.a, sys.executable, "-c", BIND, str(path))
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert p.stdout.readline().strip() == "bound"
            assert str(path) in procs.bound_sockets()
            assert hivemind_sockets([p.pid]) == {str(path)}
        finally:
            p.communicate("", timeout=10)
    try:
        assert path.exists() and str(path) not in procs.bound_sockets()  # its process is gone
    finally:
        path.unlink(missing_ok=True)
