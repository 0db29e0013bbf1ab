"""glibc malloc tuning of cell processes (mesh/runtime/memory.py): the calls take, and they keep
the RSS of a process whose short-lived threads allocate and free (a cell's round threads) near
what it really holds, where glibc's default per-thread arenas keep tens of MB more."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from mesh.runtime import memory

GLIBC = platform.libc_ver()[0] == "glibc"

# 16 threads at a time, 6 times, each allocating ~24 MB in 3 KB blocks and keeping 1 in 50:
# the survivors pin each arena's pages, so freed memory stays in the process unless trimmed
CHURN = """
import sys, threading
from mesh.runtime import memory
tuned = sys.argv[1] == "tuned"
if tuned:
    assert memory.limit_arenas(2)
keep, lock = [], threading.Lock()
def work():
    blocks = [bytearray(3000) for _ in range(8000)]
    with lock:
        keep.extend(blocks[::50])
for _ in range(6):
    threads = [threading.Thread(target=work) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
if tuned:
    memory.trim()
rss = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS"))
print(rss // 1024)
"""


def _rss_mb(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", CHURN, mode], capture_output=True, text=True, check=True
    )
    return int(out.stdout)


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="malloc_arenas"):
        memory.limit_arenas(-1)
    assert memory.limit_arenas(0) is False  # glibc's default: nothing to set


@pytest.mark.slow
@pytest.mark.skipif(not GLIBC, reason="mallopt and malloc_trim are glibc's")
def test_arena_limit_and_trim_keep_rss_near_what_is_held():
    default, tuned = _rss_mb("default"), _rss_mb("tuned")
    # ~46 MB survive in both; the default's arenas keep 30-60 MB of freed blocks on top
    assert tuned + 15 < default, (tuned, default)
