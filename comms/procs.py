"""Processes of this machine, read from /proc (Linux): the one place that parses it.

A peer is a process tree (the cell, its forked hivemind DHT process and that one's p2pd). The
DHT's start and close find and kill what a stuck DHT process started (comms/p2p/dht.py), a
stopped cell kills its descendants (mesh/runtime/stop.py), the run lock and the dashboard tell
a live holder from a dead or zombie one, checkpoint saves and `data prepare` tell a writer at
work from a dead one's litter, and the benches' leak sampler walks the tree
(mesh/testing/procstat.py). A process that exits while it is read counts as gone.

imports: stdlib only.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

PROC = Path("/proc")


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (another user's counts; a zombie counts too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _stat(pid: int | str) -> tuple[str, list[str]] | None:
    """(comm, the fields after it) of /proc/PID/stat; None when there is no such process. The
    comm is cut at the last ")": it may itself hold spaces and parentheses."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
        return text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
    except (OSError, ValueError):
        return None


def state(pid: int) -> str | None:
    """The process's (its main thread's) state letter: R running, S sleeping, Z zombie, ...;
    None when there is no such process."""
    stat = _stat(pid)
    return stat[1][0] if stat and stat[1] else None


def parent(pid: int) -> int | None:
    """The pid of the process's parent now (init's, or a subreaper's, once its own died)."""
    stat = _stat(pid)
    try:
        return int(stat[1][1]) if stat else None
    except (IndexError, ValueError):
        return None


def running(pid: int) -> bool:
    """Exists and is not a zombie waiting for its parent (nor dead): what "alive" means for a
    process we started, whose parent may not have reaped it yet."""
    return state(pid) not in (None, "Z", "X")


def comm(pid: int) -> str:
    """The process's name (/proc/PID/comm); "" once it is gone."""
    try:
        return (PROC / str(pid) / "comm").read_text().strip()
    except OSError:
        return ""


def start_ticks(pid: int) -> int | None:
    """When the process started, in clock ticks since boot (stat field 22): with the pid, it
    names one process for good (a pid is reused). None when there is no such process."""
    stat = _stat(pid)
    try:
        return int(stat[1][19]) if stat else None
    except (IndexError, ValueError):
        return None


def started_unix_s(pid: int) -> float | None:
    """When the process started, in Unix seconds (boot time + start_ticks; to within about a
    second: /proc/stat's btime is whole seconds). None when there is no such process."""
    ticks = start_ticks(pid)
    if ticks is None:
        return None
    try:
        btime = next(
            int(line.split()[1])
            for line in (PROC / "stat").read_text().splitlines()
            if line.startswith("btime ")
        )
    except (OSError, StopIteration, ValueError):
        return None
    return btime + ticks / os.sysconf("SC_CLK_TCK")


def _parents() -> dict[int, list[int]]:
    """parent pid -> its children's pids, of every process now."""
    kids: dict[int, list[int]] = {}
    for d in PROC.iterdir():
        if d.name.isdigit():
            stat = _stat(d.name)
            with contextlib.suppress(IndexError, ValueError):
                if stat is not None:
                    kids.setdefault(int(stat[1][1]), []).append(int(d.name))
    return kids


def children(parent: int, name: str | None = None) -> list[int]:
    """The pids of the processes whose parent is `parent` (named `name`, if given)."""
    pids = _parents().get(parent, [])
    return [p for p in pids if name is None or comm(p) == name]


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants (pid first)."""
    kids, out, todo = _parents(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def named_with(arg: bytes, name: str) -> list[int]:
    """The processes named `name` with `arg` in their command line, whoever their parent is
    now (a child whose parent died is re-parented)."""
    found = []
    for cmdline in PROC.glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError, ValueError):
            if comm(int(cmdline.parent.name)) == name and arg in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
    return found


def bound_sockets() -> set[str]:
    """The paths of the unix sockets bound now, in every network namespace: a socket file no
    process has bound is a dead process's leftover. /proc/net/unix lists only the reader's
    namespace, and a peer started in a test's namespace (tests/throttled) binds its p2pd's
    sockets in its own: a sweep beside such a test deleted them, and its peer lost p2pd."""
    spaces = {os.readlink("/proc/self/ns/net"): PROC / "net" / "unix"}
    for pid in PROC.glob("[0-9]*"):
        with contextlib.suppress(OSError):
            spaces.setdefault(os.readlink(pid / "ns" / "net"), pid / "net" / "unix")
    bound: set[str] = set()
    for table in spaces.values():
        with contextlib.suppress(OSError):  # its only process just exited
            lines = table.read_text().splitlines()[1:]
            bound.update(parts[-1] for parts in map(str.split, lines) if len(parts) >= 8)
    return bound


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
