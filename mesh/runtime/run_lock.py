"""One launcher per run directory: DIR/run.lock holds the owner's pid and its start time.

A second `simulate` (a `--resume` of a directory a grid still runs in) would start a second grid
beside the first: two cells per name appending to one metrics file, each saving over the
other's checkpoints. The lock refuses it in one line. A lock whose process is gone, or whose
pid now belongs to another process (a pid reused after a reboot or a long time: the start time
differs), is stale and taken over. Taking a free lock is atomic (a hard link to a new name:
of two launchers racing for one directory one wins); taking over a stale one is a rename over
it, which two launchers racing over the same dead one's lock could both do.

imports: stdlib, comms.procs, mesh.config (its ConfigError).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from comms.procs import start_ticks
from mesh.config import ConfigError

LOCK_NAME = "run.lock"


def holder(run_dir: Path) -> dict | None:
    """The live process holding run_dir's lock ({"pid", "start"}), or None (no lock, a torn
    one, or one whose process is gone)."""
    try:
        held = json.loads((run_dir / LOCK_NAME).read_text())
        pid, start = int(held["pid"]), int(held["start"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return held if start_ticks(pid) == start else None


@contextlib.contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Hold run_dir's lock for the block (see the module docstring); ConfigError (exit 2) when
    a live launcher holds it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    me = {"pid": os.getpid(), "start": start_ticks(os.getpid()) or 0}
    body = json.dumps(me).encode()
    tmp = path.with_name(f".{LOCK_NAME}.{os.getpid()}")
    tmp.write_bytes(body)
    try:
        try:
            os.link(tmp, path)  # atomic: fails if a lock file exists
        except FileExistsError:
            live = holder(run_dir)
            if live is not None and live["pid"] != os.getpid():
                raise ConfigError(
                    f"{run_dir} is in use by a running grid (pid {live['pid']}); stop it first "
                    f"(kill -TERM {live['pid']}: every cell saves) or pick another --out"
                ) from None
            os.replace(tmp, path)  # stale: taken over
    finally:
        tmp.unlink(missing_ok=True)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            if json.loads(path.read_text()).get("pid") == os.getpid():
                path.unlink()
