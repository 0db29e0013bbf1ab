"""A local grid the long benches (soak, scale) own: a bootstrap `meshtrain dht` and named
`meshtrain join` processes on 127.0.0.1, killed, replaced and stopped by the bench, with every
process tree it ever saw remembered so the end can say what outlived it.

Closing (also after a failure): every join is asked to stop (SIGTERM, in parallel), waited for,
killed with its process group if it hangs; then any process of a tree seen during the run that
is still alive is an orphan (reported, then SIGKILLed), and socket files left in /tmp by this
grid's processes are reported and removed (a live socket is never touched).
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from comms.procs import bound_sockets, comm, process_tree, started_unix_s
from comms.procs import running as alive
from mesh.testing.local_peers import LOOPBACK, meshtrain, start_dht, stop, wait_for
from mesh.testing.procstat import hivemind_sockets

# one torch/OpenMP thread per peer process: on a 2-core box more only contend
LIGHT_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class LocalGrid:
    """Use as a context manager; `leftovers` (filled by close) says what outlived the grid."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.joins: dict[str, subprocess.Popen] = {}
        self.started: dict[str, float] = {}  # time.monotonic() of each join's start
        self.seen: dict[int, str] = {}  # pid -> comm of every process of a peer's tree seen
        self.started_s: dict[int, float] = {}  # pid -> when that process started (Unix s)
        self.sockets: set[str] = set()  # socket files our processes held
        self.dht: subprocess.Popen | None = None
        self.maddr = ""
        self.leftovers: dict[str, Any] = {}
        # a bench's sampler thread remembers trees while the bench's own thread kills, replaces
        # and closes: the records change under one lock and are read as copies
        self._seen_lock = threading.Lock()

    def __enter__(self) -> LocalGrid:
        self.dht, self.maddr = start_dht()
        if not self.maddr.startswith("/ip4/127.0.0.1/"):
            raise RuntimeError(f"the bootstrap node printed {self.maddr!r}, not its address")
        self.remember(self.dht.pid)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def join(self, name: str, *extra: str) -> subprocess.Popen:
        """Start `meshtrain join` as peer `name` (run dir tmp/name, log tmp/name.log)."""
        log = (self.tmp / f"{name}.log").open("w")
        self.started[name] = time.monotonic()
        p = meshtrain(
            "join",
            "--initial-peers",
            self.maddr,
            *LOOPBACK,
            "--out",
            str(self.out(name)),
            *extra,
            stdout=log,
            stderr=subprocess.STDOUT,
            env_extra=LIGHT_ENV,
        )
        log.close()  # the child holds its own copy
        self.joins[name] = p
        return p

    def out(self, name: str) -> Path:
        return self.tmp / name

    def log(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def live(self) -> dict[str, subprocess.Popen]:
        return {n: p for n, p in self.joins.items() if p.poll() is None}

    def remember(self, root: int) -> list[int]:
        """Note every process of root's tree and the sockets it holds; returns the tree."""
        tree = process_tree(root)
        names = {p: comm(p) for p in tree if p not in self.seen}
        started = {p: started_unix_s(p) or 0.0 for p in names}
        held = hivemind_sockets(tree)
        with self._seen_lock:
            for p in names:
                self.seen.setdefault(p, names[p])
                self.started_s.setdefault(p, started[p])
            self.sockets |= held
        return tree

    def _seen_copy(self) -> tuple[dict[int, str], dict[int, float], set[str]]:
        with self._seen_lock:
            return dict(self.seen), dict(self.started_s), set(self.sockets)

    def wait_joined(self, name: str, timeout_s: float) -> None:
        def joined() -> bool:
            if self.joins[name].poll() is not None:
                raise RuntimeError(
                    f"{name} exited {self.joins[name].returncode}: {self.log(name)[-1500:]}"
                )
            return "joined run" in self.log(name)

        wait_for(joined, timeout_s, f"{name} to join", 0.2)

    def crash(self, name: str, helpers_timeout_s: float = 60.0) -> dict[str, Any]:
        """SIGKILL peer `name`'s own process only (a crash: its DHT process and p2pd must
        notice and go by themselves); how long its helpers took to exit and which of its socket
        files were left (the helpers are killed and the files removed after helpers_timeout_s,
        so one failure does not pile up)."""
        p = self.joins[name]
        tree = self.remember(p.pid)
        socks = hivemind_sockets(tree)
        t0 = time.monotonic()
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        helpers = [q for q in tree if q != p.pid]
        deadline = t0 + helpers_timeout_s
        while time.monotonic() < deadline:
            if not any(map(alive, helpers)) and not any(map(os.path.exists, socks)):
                break
            time.sleep(0.1)
        outlived = [q for q in helpers if alive(q)]
        left = sorted(s for s in socks if os.path.exists(s))
        for q in outlived:
            _kill_pid(q, self.seen.get(q, ""))
        for s in left:
            _unlink_unbound(s)
        return {
            "helpers_exit_s": round(time.monotonic() - t0, 2),
            "helpers_outlived": [f"{q} ({self.seen.get(q, '?')})" for q in outlived],
            "sockets_left": left,
        }

    def own_socket_files(self) -> list[str]:
        """Socket files of ours that still exist: those our processes were seen holding, and
        those named after the pid of one of our processes (a peer's DHT process names its
        p2pd's files hivemind-PID-*). Other files in /tmp may be other programs' (and a socket
        bound in another network namespace does not show in our /proc/net/unix): never
        guessed to be ours. Pids wrap at 32768 and a long test run reuses them, so a file named
        after a pid of ours is not ours when it is older than our process of that pid (an
        earlier one's leftover; 2 s of slack for the start time's precision) or a live process
        has it bound (a later one's; a process of ours that outlived the grid is reported as an
        orphan, its files with it)."""
        seen, started_s, sockets = self._seen_copy()
        named = {
            str(f)
            for p in seen
            for f in Path("/tmp").glob(f"hivemind-{p}-*.sock")
            if _made_s(f) >= started_s.get(p, 0.0) - 2.0
        }
        named -= bound_sockets() - sockets
        return sorted({s for s in sockets if os.path.exists(s)} | named)

    def close(self) -> None:
        for p in self.live().values():  # remember the trees first: their p2pd pids
            self.remember(p.pid)
        for p in self.live().values():  # ask all first: they stop in parallel
            p.terminate()
        for p in self.joins.values():
            stop(p)
        if self.dht is not None:
            stop(self.dht)
        seen = self._seen_copy()[0]
        deadline = time.monotonic() + 15  # helpers of a clean stop exit within seconds
        while time.monotonic() < deadline and any(alive(p) for p in seen):
            time.sleep(0.2)
        orphans = [p for p in seen if alive(p)]
        self.leftovers = {
            "orphan_processes": [f"{p} ({seen[p]})" for p in orphans],
            "orphan_p2pd": sum(1 for p in orphans if seen[p] == "p2pd"),
            "socket_files_left": self.own_socket_files(),
        }
        for p in orphans:
            _kill_pid(p, seen[p])
        for s in self.leftovers["socket_files_left"]:
            _unlink_unbound(s)


def _made_s(path: Path) -> float:
    """When a socket file was made (its mtime: a socket file is never written as a file)."""
    try:
        return path.stat().st_mtime
    except OSError:  # removed meanwhile: nobody's leftover
        return -math.inf


def _kill_pid(pid: int, name: str) -> None:
    """SIGKILL a process of ours, unless its pid now names another program."""
    if comm(pid) != name:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def _unlink_unbound(path: str) -> None:
    if path not in bound_sockets():
        Path(path).unlink(missing_ok=True)


def record_failure(grid: LocalGrid, meta: dict[str, Any], out: Path, e: BaseException) -> None:
    """A bench's failure into meta["error"] and out/error.txt (traceback and each join's log
    tail); an interrupt (not an Exception) is raised again once recorded."""
    tails = "\n".join(f"--- {n}.log\n{grid.log(n)[-1500:]}" for n in grid.joins)
    meta["error"] = f"{type(e).__name__}: {e}"
    (out / "error.txt").write_text(traceback.format_exc() + "\n" + tails)
    if not isinstance(e, Exception):
        raise e
