"""Locks between a process and the processes it forks that die with their holder.

hivemind guards the pipe every forked DHT process writes its results to with class-level
multiprocessing locks (MPFuture._update_lock, _initialization_lock, SharedBytes._lock): POSIX
semaphores shared by the process that imported hivemind and every DHT process it ever forks.
A semaphore is never given back by a process that dies holding it, so one DHT process killed
(or exiting) in the middle of a send leaves every later DHT process of ours unable to say
"ready" or to answer a get, and the peer's own cancels blocked: for ever, and only on busy
hosts, where a kill lands inside a send more often.

`DeathSafeLock` is a thread lock (for the threads of one process) over an fcntl record lock
on an anonymous file (between processes): the kernel drops a record lock when its holder
exits, however it exits. `install()` puts one in place of each of hivemind's; it runs before
the first DHT process is forked (comms.p2p.dht imports this module).

imports: hivemind, stdlib.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import threading
from typing import Any

from hivemind.utils.mpfuture import MPFuture, SharedBytes


class DeathSafeLock:
    """Mutual exclusion between the threads of every process forked after it was made; a
    process that dies holding it releases it (the record lock is the kernel's). A forked
    child starts with it free: record locks are not inherited, and the thread lock is made
    anew in the child (a parent thread may have held it at the fork)."""

    def __init__(self) -> None:
        self._file = tempfile.TemporaryFile()  # unlinked: nothing left on disk
        self._threads = threading.Lock()
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        self._threads = threading.Lock()

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        # multiprocessing.Lock's signature; hivemind only uses `with`, which blocks
        if not block or timeout is not None:
            raise NotImplementedError("DeathSafeLock only blocks")
        self._threads.acquire()
        try:
            fcntl.lockf(self._file.fileno(), fcntl.LOCK_EX)
        except BaseException:
            self._threads.release()
            raise
        return True

    def release(self) -> None:
        fcntl.lockf(self._file.fileno(), fcntl.LOCK_UN)
        self._threads.release()

    def __enter__(self) -> DeathSafeLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


_installed = False


def install() -> None:
    """Replace hivemind's three process-shared locks with DeathSafeLocks (once per process; a
    forked child keeps its parent's, which is what sharing them needs)."""
    global _installed
    if _installed:
        return
    MPFuture._initialization_lock = DeathSafeLock()
    MPFuture._update_lock = DeathSafeLock()
    SharedBytes._lock = DeathSafeLock()
    _installed = True
