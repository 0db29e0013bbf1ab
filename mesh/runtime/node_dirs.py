"""The run directories of one `meshtrain train` run, as one.

Each node of a cluster run writes the cells it runs under its own `--out` (its node directory:
config.toml, metrics/J-I.jsonl, checkpoints/J-I/, logs/); on a shared filesystem they are one
directory. `merge_into` builds a run directory of symbolic links into a set of node directories
(copies, mounts or rsyncs of them), which every reader of one run directory (export, the
dashboard, a resume) reads as it is: config.toml of the first directory that has one; each
cell's checkpoint files, from every directory that holds some (a cell that ran on two nodes in
two lives has files in both); each cell's metrics file and failure report, from the directory
whose copy was written last; val.jsonl likewise. Linking again adds what appeared since (a
running grid's new files), and never replaces a link it made.

imports: stdlib, mesh.config.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from mesh.config import ConfigError


def check_dirs(dirs: Sequence[Path], what: str) -> list[Path]:
    """The directories, each once, in order; ConfigError naming a missing one, or when none
    holds a config.toml (not a run)."""
    out: list[Path] = []
    for d in dirs:
        if not d.is_dir():
            raise ConfigError(f"{what} {d}: no such directory")
        if d.resolve() not in [o.resolve() for o in out]:
            out.append(d)
    if not any((d / "config.toml").is_file() for d in out):
        names = " ".join(str(d) for d in out)
        raise ConfigError(f"{what} {names}: not a run directory (no config.toml in any)")
    return out


def merge_into(dirs: Sequence[Path], view: Path) -> Path:
    """Link the node directories' files into `view` (module docstring); returns view."""
    view.mkdir(parents=True, exist_ok=True)
    config = next((d / "config.toml" for d in dirs if (d / "config.toml").is_file()), None)
    if config is not None:
        _link(config, view / "config.toml")
    for sub, pattern in (("metrics", "*.jsonl"), ("logs", "*.err")):
        newest: dict[str, Path] = {}
        for d in dirs:
            for f in sorted((d / sub).glob(pattern)):
                if f.name not in newest or _mtime(f) > _mtime(newest[f.name]):
                    newest[f.name] = f
        for name, f in newest.items():
            _link(f, view / sub / name)
    val = [d / "val.jsonl" for d in dirs if (d / "val.jsonl").is_file()]
    if val:
        _link(max(val, key=_mtime), view / "val.jsonl")
    for d in dirs:
        for cell in sorted((d / "checkpoints").glob("*-*")):
            for f in sorted(cell.glob("step-*.pt")):
                _link(f, view / "checkpoints" / cell.name / f.name)
    return view


@contextlib.contextmanager
def one_run_dir(dirs: Sequence[Path], what: str) -> Iterator[Path]:
    """The run directory a reader reads: the one given (as it is: the reader says what is
    wrong with it), or a merged view of several (linked into a temporary directory that lives
    as long as the context)."""
    if len(dirs) == 1:
        yield dirs[0]
        return
    dirs = check_dirs(dirs, what)
    if len(dirs) == 1:
        yield dirs[0]
        return
    tmp = Path(tempfile.mkdtemp(prefix="meshtrain-run-"))
    try:
        yield merge_into([d.resolve() for d in dirs], tmp / "run")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _link(target: Path, link: Path) -> None:
    if link.is_symlink() or link.exists():
        return
    link.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.symlink(target.resolve(), link)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
