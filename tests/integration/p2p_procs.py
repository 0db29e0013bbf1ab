"""Process hygiene of the hivemind tests (tests/integration/test_p2p.py): the process tree of
a peer, the /tmp/hivemind-*.sock files it bound, and checks that a killed peer's helpers (its
DHT process and p2pd) exited and removed them. Reads /proc only.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    return kids


def process_tree(pid: int) -> list[int]:
    kids, out, todo = _children(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def assert_gone(pids: list[int], sockets: set[str], timeout_s: float = 10.0) -> None:
    """Each pid exited (or is a zombie waiting for init) and each socket file is gone."""

    def alive(p: int) -> bool:
        try:
            return Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids) and not any(map(os.path.exists, sockets)):
            return
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)], "helpers of a killed peer outlived it"
    assert not [s for s in sockets if os.path.exists(s)], "a killed peer left socket files"


def p2pd_descendants() -> set[int]:
    found = set()
    for p in process_tree(os.getpid())[1:]:
        try:
            if Path(f"/proc/{p}/comm").read_text().strip() == "p2pd":
                found.add(p)
        except OSError:
            pass
    return found


def sockets_of(pids: list[int]) -> set[str]:
    """The /tmp/hivemind-*.sock files these processes have bound."""
    inodes = set()
    for p in pids:
        try:
            for fd in Path(f"/proc/{p}/fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    found = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 8 and parts[6] in inodes and parts[7].startswith("/tmp/hivemind-"):
            found.add(parts[7])
    return found


def sweep_sockets(existing: set[Path]) -> None:
    """Remove hivemind socket files that appeared during the test and that no process has
    bound any more (left by a peer this test killed; a live socket is never touched)."""
    bound = {line.split()[-1] for line in Path("/proc/net/unix").read_text().splitlines()[1:]}
    for path in set(Path("/tmp").glob("hivemind-*.sock")) - existing:
        if str(path) not in bound:
            path.unlink(missing_ok=True)
