"""glibc malloc tuning for long-lived cell processes (a peer of a run trains for days).

Why: a cell runs many short-lived threads (one per averaging round, a sender per link, the
state server's replies) and glibc gives threads their own malloc arenas, up to 8 per core. Each
arena keeps the memory its thread freed; fragmented, little of it goes back to the OS. The soak
(results/soak) saw a cell's RSS grow in steps of tens of MB after each neighbour's replacement
(new threads, new arenas) while the DHT process and p2pd stayed flat; hivemind#264 reports the
same growth. The fix a serving system uses is MALLOC_ARENA_MAX; `limit_arenas` sets it from
inside the process (before the threads start), and `trim` hands freed heap back to the OS.
On a libc without these calls (musl, macOS) both are no-ops that return False.

imports: stdlib only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_ARENA_MAX = -8  # glibc's mallopt parameter number (malloc.h)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    if not (hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim")):
        return None
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return libc


def limit_arenas(n: int) -> bool:
    """At most n malloc arenas from now on (0: glibc's default, 8 per core). Call it before the
    process starts its threads: arenas already made stay. True if the libc took it."""
    if n < 0:
        raise ValueError(f"runtime.malloc_arenas must be >= 0, got {n}")
    libc = _libc()
    return bool(n) and libc is not None and libc.mallopt(M_ARENA_MAX, n) == 1


def trim() -> bool:
    """Give the heap's free pages back to the OS (every arena's); True if any were."""
    libc = _libc()
    return libc is not None and libc.malloc_trim(0) == 1
