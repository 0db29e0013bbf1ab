"""A cell's files under faults and hostile edits: a malformed checkpoint is passed over like a
torn one (the resume falls back to the older intact step), a save that fails leaves nothing
and keeps the older checkpoints, a metrics row is written whole or not at all and readers
skip a torn line, and a full disk is a user error in one line."""

from __future__ import annotations

import contextlib
import errno
import json
import resource
import signal
from pathlib import Path

import helpers
import pytest
import torch

from mesh.config import load_config
from mesh.engine.cell import Cell
from mesh.errors import DiskFull, disk_full
from mesh.model.build import build_stage
from mesh.runtime.checkpoint import (
    CheckpointError,
    check_checkpoint,
    checkpoint_path,
    load_cell,
    resume_point,
    save_cell,
    write_digested,
)
from mesh.runtime.metrics import RowTail, read_metrics
from mesh.runtime.rows import WrittenSince, append_row, cut_torn_tail


def _cell(stage=0):
    cfg = load_config([], [*helpers.TINY_MODEL, "grid.stages=2"])
    return cfg, Cell.build(cfg, stage, 0, build_stage(cfg.model, 2, stage, cfg.run.seed))


def _train(cell, steps):
    for _ in range(steps):
        cell.apply_update([torch.randn_like(p) * 0.01 for p in cell.params])
        cell.push_version()


@contextlib.contextmanager
def _file_size_limit(n_bytes):
    """Writes past n_bytes in any file fail (EFBIG) from here on: a disk that fills mid-write."""
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the error, not the signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (n_bytes, old_limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


def _rewrite(path, change):
    """The file's content changed, its digest made anew: bad values, not damaged bytes."""
    state = torch.load(path, weights_only=True)
    change(state)
    with path.open("wb") as f:
        write_digested(state, f)


MALFORMED = {
    "step as str": lambda s: s.__setitem__("step", str(s["step"])),
    "step as float": lambda s: s.__setitem__("step", float(s["step"])),
    "step as bool": lambda s: s.__setitem__("step", True),
    "drift missing": lambda s: s.pop("drift"),
    "versions as a list": lambda s: s.__setitem__("versions", s["versions"].tolist()),
    "stashes as a tensor": lambda s: s.__setitem__("stashes", s["flat"]),
    "optimizer as a list": lambda s: s.__setitem__("optimizer", [1, 2]),
    "stage as str": lambda s: s.__setitem__("stage", "1"),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_a_malformed_newest_checkpoint_falls_back_to_the_older_intact_step(tmp_path, name):
    cfg, cell = _cell(1)
    fp = cfg.state_fingerprint()
    for _ in range(2):
        _train(cell, 2)
        save_cell(cell, fp, tmp_path)
    newest = checkpoint_path(tmp_path, 1, 0, 4)
    _rewrite(newest, MALFORMED[name])
    why = check_checkpoint(newest, fp, 1, 0)
    assert why is not None, name
    point = resume_point(tmp_path, [(1, 0)], fp)
    assert point.step == 2 and [d[:3] for d in point.damaged] == [(1, 0, 4)], point
    _, fresh = _cell(1)
    with pytest.raises(CheckpointError, match="step-00000004.pt"):
        load_cell(fresh, fp, newest)
    assert fresh.step == 0, "a refused file changes nothing"
    load_cell(fresh, fp, checkpoint_path(tmp_path, 1, 0, 2))
    assert fresh.step == 2


def test_a_save_that_fails_mid_write_leaves_no_file_and_keeps_the_older_one(tmp_path):
    cfg, cell = _cell()
    fp = cfg.state_fingerprint()
    _train(cell, 2)
    older = save_cell(cell, fp, tmp_path)
    _train(cell, 2)
    with _file_size_limit(older.stat().st_size // 3), pytest.raises(Exception):  # noqa: B017
        save_cell(cell, fp, tmp_path)
    assert sorted(p.name for p in older.parent.iterdir()) == [older.name], "nothing torn"
    assert check_checkpoint(older, fp, 0, 0) is None


def test_a_full_disk_anywhere_in_an_errors_chain_is_one_line_naming_the_file():
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as e:
            raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos") from e
    except RuntimeError as wrapped:
        full = disk_full(wrapped, "/run/checkpoints/0-0/step-00000004.pt")
    assert isinstance(full, DiskFull)
    assert str(full).startswith("/run/checkpoints/0-0/step-00000004.pt: no space left on device")
    assert "\n" not in str(full)
    assert disk_full(OSError(errno.EACCES, "denied")) is None


# ---- metrics rows ------------------------------------------------------------------------------


def test_a_row_whose_write_fails_leaves_the_file_as_it_was(tmp_path):
    path = tmp_path / "metrics" / "0-0.jsonl"
    path.parent.mkdir()
    append_row(path, {"step": 1, "loss": 5.0})
    before = path.read_bytes()
    big = {"step": 2, "pad": "x" * 500}
    with _file_size_limit(len(before) + 100), pytest.raises(OSError):
        append_row(path, big)  # the first 100 bytes land (a short write), then the error
    assert path.read_bytes() == before
    with path.open("a") as f:  # the same through a file the writer keeps open
        with _file_size_limit(len(before) + 100), pytest.raises(OSError):
            append_row(f, big)
    assert path.read_bytes() == before
    append_row(path, {"step": 2})
    assert [r["step"] for r in read_metrics(tmp_path)[(0, 0)]] == [1, 2]


def test_a_full_disk_on_a_row_is_disk_full_naming_the_file():
    with pytest.raises(DiskFull, match="^/dev/full: no space left on device"):
        append_row(Path("/dev/full"), {"step": 1})


def test_readers_skip_a_torn_line_and_a_resumed_writer_starts_on_its_own(tmp_path):
    path = tmp_path / "metrics" / "1-0.jsonl"
    path.parent.mkdir()
    rows = [{"step": 1, "loss": 4.0, "rejects": {}}, {"step": 2, "loss": 3.0, "rejects": {}}]
    whole = "".join(json.dumps(r) + "\n" for r in rows)
    torn = json.dumps({"step": 3, "rejects": {"bad": 1}})[:-1]  # ends in "}": still torn
    path.write_text(whole + torn)
    assert read_metrics(tmp_path)[(1, 0)] == rows
    assert RowTail(path).read() == rows
    # a writer that resumed without cutting it would glue its first row on: still skipped
    path.write_text(whole + torn + json.dumps({"step": 3}) + "\n")
    assert read_metrics(tmp_path)[(1, 0)] == rows
    path.write_text(whole + torn)
    cut_torn_tail(path)
    assert path.read_text() == whole
    append_row(path, {"step": 3})
    assert [r["step"] for r in read_metrics(tmp_path)[(1, 0)]] == [1, 2, 3]
    cut_torn_tail(path)  # a whole file is left as it is
    assert [r["step"] for r in read_metrics(tmp_path)[(1, 0)]] == [1, 2, 3]


def test_a_lost_cells_rows_and_files_are_taken_back_to_what_was_there(tmp_path):
    """A join that lost its cell to an earlier claim takes back what the cell's life wrote:
    the rows after the mark (an earlier life's rows and a resumed file's whole rows stay, its
    torn tail is cut at the mark) and the files its TensorBoard folder gained."""
    rows, board = tmp_path / "metrics" / "1-0.jsonl", tmp_path / "tensorboard" / "s1r0"
    rows.parent.mkdir()
    board.mkdir(parents=True)
    earlier = json.dumps({"step": 1}) + "\n"
    rows.write_text(earlier + '{"step": 2, "lo')  # an earlier life, killed mid-row
    (board / "events.1").write_text("earlier")
    mark = WrittenSince(rows, board)
    assert rows.read_text() == earlier and mark.size == len(earlier)
    for step in (2, 3):
        append_row(rows, {"step": step, "loss": 4.0})
    (board / "events.2").write_text("this life")
    mark.take_back()
    assert rows.read_text() == earlier
    assert sorted(p.name for p in board.iterdir()) == ["events.1"]
    fresh = WrittenSince(tmp_path / "metrics" / "0-0.jsonl", tmp_path / "tensorboard" / "s0r0")
    append_row(tmp_path / "metrics" / "0-0.jsonl", {"step": 1})
    fresh.take_back()  # no file before: none after (an empty one would list a cell), no folder
    assert not (tmp_path / "metrics" / "0-0.jsonl").exists()
    assert not (tmp_path / "tensorboard" / "s0r0").exists()


def test_a_cells_failure_report_goes_into_its_reserved_room(tmp_path):
    """A cell takes room for its report at start; a full disk later is still one line, exit 2,
    and the room is the report (no hidden file left)."""
    from mesh.runtime.failure import failure_path, reserve_failure_report, write_failure

    reserve = reserve_failure_report(tmp_path, 1, 0)
    assert reserve is not None and reserve.stat().st_size > 0
    metrics = tmp_path / "metrics" / "1-0.jsonl"
    try:
        raise OSError(errno.ENOSPC, "No space left on device", str(metrics))
    except OSError as e:
        code = write_failure(tmp_path, 1, 0, e, reserve)
    lines = failure_path(tmp_path, 1, 0).read_text().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"{metrics}: no space left on device; free some space"), lines
    assert list((tmp_path / "logs").iterdir()) == [failure_path(tmp_path, 1, 0)]


def test_a_full_disk_under_a_commands_own_writes_is_one_line_exit_2(tmp_path, capsys):
    from cli.options import user_errors

    @user_errors
    def write_summary():
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "summary.json"))

    with pytest.raises(SystemExit) as stop:
        write_summary()
    err = capsys.readouterr().err.splitlines()
    assert stop.value.code == 2 and len(err) == 1
    assert err[0].startswith(f"error: {tmp_path}/summary.json: no space left on device")

    @user_errors
    def denied():
        raise PermissionError(errno.EACCES, "Permission denied")

    with pytest.raises(PermissionError):  # not a full disk: not ours to word
        denied()
