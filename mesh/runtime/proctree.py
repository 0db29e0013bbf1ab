"""A process and the processes it started, read from /proc (Linux): a cell is a tree (the cell,
its forked hivemind DHT process and that one's p2pd), and both the benches' leak sampler
(mesh/bench/procstat.py) and a cell stopped while its transport starts (mesh/runtime/trainer.py)
walk it.

imports: stdlib only.
"""

from __future__ import annotations

import contextlib
import os
import signal
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
    """pid and all its descendants (pid first)."""
    kids, out, todo = _children(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def kill_descendants() -> list[int]:
    """SIGKILL every process this one started and theirs, by PID, and remove the hivemind
    sockets they had bound (/tmp/hivemind-PID-*.sock: a killed p2pd cannot). Returns the PIDs."""
    pids = process_tree(os.getpid())[1:]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in pids:
        for sock in Path("/tmp").glob(f"hivemind-{pid}-*.sock"):
            with contextlib.suppress(OSError):
                sock.unlink()
    return pids
