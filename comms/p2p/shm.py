"""hivemind's shared bytes, made where a stop signal cannot hang the process.

hivemind keeps each MPFuture's state in a byte of a tensor in shared memory (SharedBytes),
under torch's file_system sharing strategy, which hivemind sets at import. The first such
tensor in a process starts torch's torch_shm_manager and reads the manager's socket name from a
pipe. torch (libshm, start_manager) retries a read that a signal interrupted (EINTR) by testing
the result it already has again, so a SIGTERM or a Ctrl-C that lands there spins the thread for
ever, holding the GIL: no handler and no other thread of the process runs again. A cell stopped
while its DHT started (its first MPFuture) hung that way until its launcher's SIGKILL.

`install()` runs SharedBytes.next with the stop signals blocked in the calling thread. A stop
that comes meanwhile is taken by another thread of the process (Python's C handler only notes
it, and wakes a wakeup fd), or waits until the call returns; either way its handler then runs
as usual. The manager, forked there, keeps them blocked: it starts its own session (no
terminal's Ctrl-C reaches it) and exits on its own once its last client is gone.

imports: hivemind, stdlib.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any

from hivemind.utils.mpfuture import SharedBytes

STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})


@contextlib.contextmanager
def stops_held() -> Iterator[None]:
    """Block the stop signals in this thread while inside; a signal that came meanwhile is
    handled on the way out (Python checks for it when the mask is restored)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


_installed = False


def install() -> None:
    """Make every SharedBytes.next (the only place hivemind shares a new tensor, and so the
    place a process starts torch's manager) run with the stop signals held. Once per process;
    a forked child keeps it."""
    global _installed
    if _installed:
        return
    unguarded = SharedBytes.next.__func__

    def next_with_stops_held(cls: Any) -> Any:
        with stops_held():
            return unguarded(cls)

    SharedBytes.next = classmethod(next_with_stops_held)
    _installed = True
