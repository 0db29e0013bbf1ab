"""What a peer's processes hold, read from /proc: the benches' leak sampler.

A joined peer is a process tree: the `meshtrain join` process (the cell), its forked hivemind
DHT process and that one's p2pd. For each, RSS, open descriptors and threads
(/proc/PID/status, /proc/PID/fd), and the /tmp/hivemind-*.sock files the tree has bound
(/proc/net/unix). Linux only; a process that exits while it is read is skipped.
(tests/integration/p2p_procs.py reads the same files for the hygiene tests.)

imports: stdlib, comms.procs (the tree, a process's name).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from comms.procs import comm, process_tree


def proc_stats(pid: int) -> dict[str, float] | None:
    """{rss_mb, pss_mb, fds, threads} of one process; None once it is gone. PSS splits pages
    shared with other processes among them: the forked DHT process shares most of the cell's
    RSS, so a tree's RSS counts those pages twice and its PSS once."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    pss_kb = next((ln.split()[1] for ln in rollup.splitlines() if ln.startswith("Pss:")), "0")
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    try:
        return {
            "rss_mb": round(int(fields["VmRSS"].split()[0]) / 1024, 2),
            "pss_mb": round(int(pss_kb) / 1024, 2),
            "fds": fds,
            "threads": int(fields["Threads"]),
        }
    except (KeyError, ValueError, IndexError):  # a zombie has no VmRSS
        return None


def role(pid: int, root: int) -> str:
    """cell (the tree's root), p2pd, or dht (the forked DHT process, any other helper)."""
    if pid == root:
        return "cell"
    return "p2pd" if comm(pid) == "p2pd" else "dht"


def hivemind_sockets(pids: list[int]) -> set[str]:
    """The /tmp/hivemind-*.sock files these processes have bound or connected to, in whatever
    network namespace each runs (/proc/PID/net/unix: a process in a test's namespace binds its
    sockets there, and /proc/net/unix would not list them)."""
    inodes, tables = set(), {Path("/proc/net/unix")}
    for p in pids:
        try:
            for fd in Path(f"/proc/{p}/fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
            tables.add(Path(f"/proc/{p}/net/unix"))
        except OSError:
            continue
    found = set()
    for table in tables:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:  # the process exited meanwhile
            continue
        for parts in map(str.split, lines):
            if len(parts) >= 8 and parts[6] in inodes and parts[7].startswith("/tmp/hivemind-"):
                found.add(parts[7])
    return found


def tree_sample(root: int) -> dict[str, Any]:
    """One sample of a peer: per role {rss_mb, fds, threads} (summed if a role has several
    processes), the total, the pids by role and the socket files the tree holds."""
    pids = process_tree(root)
    roles: dict[str, dict[str, float]] = {}
    by_role: dict[str, list[int]] = {}
    for p in pids:
        st = proc_stats(p)
        if st is None:
            continue
        r = role(p, root)
        by_role.setdefault(r, []).append(p)
        acc = roles.setdefault(r, {"rss_mb": 0.0, "pss_mb": 0.0, "fds": 0, "threads": 0})
        for k, v in st.items():
            acc[k] = round(acc[k] + v, 2)
    keys = ("rss_mb", "pss_mb", "fds", "threads")
    total = {k: round(sum(r[k] for r in roles.values()), 2) for k in keys}
    socks = sorted(hivemind_sockets(pids))
    return {"roles": roles, "total": total, "pids": by_role, "sockets": socks}
