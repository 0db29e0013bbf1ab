"""A cell's failure report: the one line a user sees (and, for a bug, the traceback), written
into room reserved at the cell's start so that a full disk still gets it; the exit codes a
launcher reads (2: a user error, LOST_NEIGHBOUR: a peer it needs is gone, 1: a bug).

imports: stdlib, comms (errors, procs), mesh (config, errors, topology).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from comms.errors import StartTimeout
from comms.procs import pid_alive
from mesh.algo.topology import cell_name
from mesh.config import ConfigError
from mesh.errors import CheckpointError, DataError, DiskFull, disk_full

LOST_NEIGHBOUR = 3  # exit code of a cell that stopped because a peer it needs is gone
# the message says the fix: exit 2 (StartTimeout: raise transport.start_timeout_s)
USER_ERRORS = (ConfigError, DataError, CheckpointError, DiskFull, StartTimeout)
REPORT_RESERVE_BYTES = 4096  # room kept for a failure report's first line on a full disk


def failure_path(out_dir: str | Path, stage: int, replica: int) -> Path:
    return Path(out_dir) / "logs" / f"{cell_name(stage, replica)}.err"


def drop_dead_processes_files(path: Path) -> None:
    """Remove the hidden per-process files beside `path` (.NAME.PID) whose process is gone."""
    for old in path.parent.glob(f".{path.name}.*"):
        pid = old.name.rsplit(".", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            old.unlink(missing_ok=True)


def reserve_failure_report(out_dir: str | Path, stage: int, replica: int) -> Path | None:
    """Room for this cell's failure report, taken while there is some: a hidden file of zeros
    beside the report (DIR/logs/.sJrI.err.PID) that write_failure writes into and renames, so
    a full disk still gets its one line. Reserves of dead processes are removed. None when
    not even this fits."""
    path = failure_path(out_dir, stage, replica)
    drop_dead_processes_files(path)
    reserve = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with reserve.open("wb") as f:
            f.write(bytes(REPORT_RESERVE_BYTES))
            f.flush()
            os.fsync(f.fileno())
        return reserve
    except OSError:
        reserve.unlink(missing_ok=True)
        return None


def write_failure(
    out_dir: str | Path,
    stage: int,
    replica: int,
    error: BaseException,
    reserve: Path | None = None,
) -> int:
    """A failed cell's report: its first line is the one line a user sees (a user error's
    message, or a bug's exception), then the traceback for a bug. A full disk anywhere in the
    error's chain is the user error DiskFull. Written into `reserve` (reserve_failure_report)
    when there is one, so that it fits on a full disk; when nothing can be written, the line
    goes to stderr. Returns the exit code."""
    import traceback

    error = disk_full(error) or error
    user = isinstance(error, USER_ERRORS)
    head = str(error) if user else f"{type(error).__name__}: {error}"
    line = (" ".join(head.split())[: REPORT_RESERVE_BYTES // 2] + "\n").encode()
    body = b"" if user else ("\n" + "".join(traceback.format_exception(error))).encode()
    path = failure_path(out_dir, stage, replica)
    try:
        if reserve is None or not reserve.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            reserve = path.with_name(f".{path.name}.{os.getpid()}")
            reserve.write_bytes(b"")
        fd = os.open(reserve, os.O_RDWR)
        try:
            size = _write_all(fd, line)  # inside the reserved bytes: needs no new space
            try:
                size += _write_all(fd, body)
            except OSError:  # no room for the traceback: the line alone
                pass
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        os.replace(reserve, path)
    except OSError:
        sys.stderr.write(f"cell {cell_name(stage, replica)}: {line.decode()}")
    return 2 if user else 1


def _write_all(fd: int, data: bytes) -> int:
    done = 0
    while done < len(data):
        done += os.write(fd, data[done:])
    return done


def failure_report(out_dir: str | Path, stage: int, replica: int) -> tuple[float, str, Path | None]:
    """(when, one line, report path) of a failed cell; a cell that died without writing one
    (killed, or out of memory) gets a generic line."""
    path = failure_path(out_dir, stage, replica)
    try:
        text = path.read_text()
        return path.stat().st_mtime, text.splitlines()[0] if text else "failed", path
    except OSError:
        return float("inf"), "exited without a report (killed, or out of memory?)", None
