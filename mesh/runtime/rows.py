"""JSONL files that several readers follow while one process appends (a cell's metrics, the
run's val.jsonl): a row is appended whole or not at all, a torn tail is cut before a resumed
writer appends, and readers skip a line that is not a whole row.

imports: stdlib, mesh.errors.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import IO, Any

from mesh.errors import disk_full

_APPEND_LOCK = threading.Lock()  # a cell's rows and its event rows come from two threads


def append_row(target: Path | IO[Any], row: dict[str, Any]) -> None:
    """Append one JSON line whole or not at all: a single write of the line (repeated only
    for what a short write left), and on an error (a full disk) the file cut back to its size
    before, so a reader never meets a torn row, and a resumed run does not glue its first row
    onto one. target: the file's path, or a file open for appending. A full disk raises
    DiskFull naming the file."""
    data = (json.dumps(row) + "\n").encode()
    own = not hasattr(target, "fileno")
    with _APPEND_LOCK:
        if own:
            fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        else:
            target.flush()  # anything buffered goes first, in order
            fd = target.fileno()
        try:
            start = os.fstat(fd).st_size
            try:
                done = 0
                while done < len(data):
                    done += os.write(fd, data[done:])
            except OSError as e:
                try:
                    os.ftruncate(fd, start)
                except OSError:
                    pass  # the error that matters is the write's
                full = disk_full(e, target if own else getattr(target, "name", None))
                if full is not None:
                    raise full from None
                raise
        finally:
            if own:
                os.close(fd)


def cut_torn_tail(path: Path) -> None:
    """Cut a line without its newline off the end of a JSONL file (a writer killed mid-row),
    before a resumed writer appends: its first row would be glued onto the torn one."""
    try:
        with open(path, "r+b") as f:
            size = f.seek(0, os.SEEK_END)
            tail = b""
            while size > 0 and b"\n" not in tail:
                back = min(size, 4096)
                f.seek(size - back)
                tail = f.read(back) + tail
                size -= back
            keep = size + tail.rfind(b"\n") + 1
            if keep < size + len(tail):
                f.truncate(keep)
    except FileNotFoundError:
        pass


def parse_rows(data: bytes) -> list[dict[str, Any]]:
    """The JSON object rows of a JSONL file's bytes; a line that is not one (torn by a crash
    or a full disk, or still being written) is skipped."""
    rows = []
    for line in data.splitlines():
        if not line.strip().endswith(b"}"):
            continue
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


class WrittenSince:
    """What a cell's life adds under a run directory, to take back when the cell turns out to
    be another peer's (a join that lost its claim: its rows would pass for the owner's): marks
    the rows file's length (its torn tail cut first) and the files a folder holds now;
    `take_back` cuts the rows to that length and removes the files the folder gained."""

    def __init__(self, rows: Path, folder: Path) -> None:
        cut_torn_tail(rows)
        self.rows, self.folder, self.existed = rows, folder, rows.exists()
        self.size = rows.stat().st_size if self.existed else 0
        self.files = set(folder.iterdir()) if folder.is_dir() else set()

    def take_back(self) -> None:
        if not self.existed:  # no empty file left behind to pass for a cell with no rows
            self.rows.unlink(missing_ok=True)
        elif self.rows.exists() and self.rows.stat().st_size > self.size:
            with open(self.rows, "r+b") as f:
                f.truncate(self.size)
        for path in set(self.folder.iterdir()) - self.files if self.folder.is_dir() else ():
            if path.is_file():
                path.unlink(missing_ok=True)
