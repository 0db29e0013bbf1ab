"""Process hygiene of the hivemind tests (tests/integration/test_p2p.py): the process tree of
a peer, the /tmp/hivemind-*.sock files it bound, and checks that a killed peer's helpers (its
DHT process and p2pd) exited and removed them. Reads /proc through comms/procs.py and
mesh/testing/procstat.py.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from comms.procs import bound_sockets, comm, process_tree
from comms.procs import running as alive
from mesh.testing.procstat import hivemind_sockets


def assert_gone(pids: list[int], sockets: set[str], timeout_s: float = 10.0) -> None:
    """Each pid exited (or is a zombie waiting for init) and each socket file is gone."""

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids) and not any(map(os.path.exists, sockets)):
            return
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)], "helpers of a killed peer outlived it"
    assert not [s for s in sockets if os.path.exists(s)], "a killed peer left socket files"


def p2pd_descendants() -> set[int]:
    return {p for p in process_tree(os.getpid())[1:] if comm(p) == "p2pd"}


def sockets_of(pids: list[int]) -> set[str]:
    """The /tmp/hivemind-*.sock files these processes have bound."""
    return hivemind_sockets(pids)


def sweep_sockets(existing: set[Path]) -> None:
    """Remove hivemind socket files that appeared during the test and that no process has
    bound any more (left by a peer this test killed; a live socket is never touched)."""
    bound = bound_sockets()
    for path in set(Path("/tmp").glob("hivemind-*.sock")) - existing:
        if str(path) not in bound:
            path.unlink(missing_ok=True)
