"""Validation from checkpoints while a grid trains: each replica at its eval_every marks."""

import helpers
import torch

from mesh.config import load_config
from mesh.data.corpus import load_corpus
from mesh.engine.cell import Cell
from mesh.model.build import build_stage
from mesh.runtime.checkpoint import save_cell
from mesh.runtime.evaluate import ValTracker, read_val, replica_loss, validation_batches


def _saved_run(tmp_path, text_file, every: int):
    cfg = load_config(
        [],
        [
            *helpers.TINY,
            "grid.stages=2",
            "grid.replicas=1",
            f"run.eval_every={every}",
            f"data.path='{text_file}'",
        ],
    )
    cells = [Cell.build(cfg, j, 0, build_stage(cfg.model, 2, j, cfg.run.seed)) for j in range(2)]
    torch.manual_seed(0)
    for _ in range(3):  # saves at steps 2, 4 and 6
        for cell in cells:
            for _update in range(2):
                cell.apply_update([torch.randn_like(p) * 0.01 for p in cell.params])
                cell.push_version()
            save_cell(cell, cfg.state_fingerprint(), tmp_path)
    corpus = load_corpus(cfg.data.path, cfg.data.val_fraction, cfg.model.seq_len)
    return cfg, corpus


def test_a_late_poll_still_evaluates_every_mark_in_order(tmp_path, text_file):
    cfg, corpus = _saved_run(tmp_path, text_file, every=2)
    tracker = ValTracker(cfg, tmp_path, corpus)
    tracker.start()
    tracker.poll()  # steps 2, 4 and 6 are all saved by now: each one is a mark
    rows = read_val(tmp_path)
    assert [r["step"] for r in rows] == [0, 2, 4, 6]
    batches = validation_batches(cfg, corpus)
    assert rows[2]["val_loss"] == replica_loss(cfg, tmp_path, 0, 4, batches)
    assert rows[0]["val_loss"] != rows[3]["val_loss"]  # the weights did change


def test_final_poll_adds_the_last_step_between_marks(tmp_path, text_file):
    cfg, corpus = _saved_run(tmp_path, text_file, every=4)
    tracker = ValTracker(cfg, tmp_path, corpus)
    tracker.poll()
    assert [r["step"] for r in read_val(tmp_path)] == [4]
    tracker.poll(final=True)
    assert [r["step"] for r in read_val(tmp_path)] == [4, 6]


HANG_S = 60  # only a hang: a loaded 2-core box


def test_background_validation_leaves_the_launchers_thread_free(tmp_path, text_file):
    """simulate's watch loop draws the progress bar; an evaluation in it held the bar still
    for its length (then it jumped 34% to 77%). In background() the evaluation runs on its
    own thread: the caller's thread goes on while one is under way."""
    import threading

    cfg, corpus = _saved_run(tmp_path, text_file, every=2)
    entered, release = threading.Event(), threading.Event()
    threads = []

    class Held(ValTracker):
        def poll(self, final=False):
            threads.append(threading.current_thread())
            entered.set()
            assert release.wait(HANG_S)
            super().poll(final)

    tracker = Held(cfg, tmp_path, corpus)
    with tracker.background(period_s=0.01):
        assert entered.wait(HANG_S)  # an evaluation is under way, and this thread runs on
        assert threads[0] is not threading.main_thread()
        release.set()
    assert [r["step"] for r in read_val(tmp_path)] == [2, 4, 6]

    failed = threading.Event()

    class Broken(ValTracker):
        def poll(self, final=False):
            failed.set()
            raise OSError("disk full")

    import pytest

    with pytest.raises(OSError, match="disk full"):  # an evaluation's error is not lost
        with Broken(cfg, tmp_path, corpus).background(period_s=0.01):
            assert failed.wait(HANG_S)


def test_a_hivemind_runs_final_row_is_the_summarys_newest_saves(tmp_path, text_file):
    """hivemind saves each cell where a stop finds it (a cell that downloaded state, from the
    step it took): here both cells saved step 2, then stage 0 step 4 and stage 1 step 6. Their
    newest common step is still 2, which the final row evaluated (or, resumed from 2, skipped)
    while the summary reads each cell's newest save: the final row is that chain now."""
    from mesh.runtime.metrics import _replica_losses

    cfg = load_config(
        [],
        [
            *helpers.TINY,
            "grid.stages=2",
            "grid.replicas=1",
            "run.eval_every=2",
            "transport.backend='hivemind'",
            f"data.path='{text_file}'",
        ],
    )
    cells = [Cell.build(cfg, j, 0, build_stage(cfg.model, 2, j, cfg.run.seed)) for j in range(2)]
    torch.manual_seed(0)
    for j, saves in enumerate([(2, 4), (2, 6)]):
        for at in saves:
            while cells[j].step < at:
                cells[j].apply_update([torch.randn_like(p) * 0.01 for p in cells[j].params])
                cells[j].push_version()
            save_cell(cells[j], cfg.state_fingerprint(), tmp_path)
    corpus = load_corpus(cfg.data.path, cfg.data.val_fraction, cfg.model.seq_len)
    batches = validation_batches(cfg, corpus)
    summary_loss = _replica_losses(cfg, tmp_path, batches, {})[0]
    assert summary_loss == replica_loss(cfg, tmp_path, 0, [4, 6], batches)
    for start_step in (0, 2):  # a fresh run, and one resumed from the common save
        (tmp_path / "val.jsonl").unlink(missing_ok=True)
        tracker = ValTracker(cfg, tmp_path, corpus, start_step)
        tracker.poll()
        tracker.poll(final=True)
        rows = read_val(tmp_path)
        assert rows[-1]["val_loss"] == summary_loss, (start_step, rows)
        assert rows[-1]["stage_steps"] == [4, 6] and rows[-1]["step"] == 4, rows
        tracker.poll(final=True)  # once: the same chain is not evaluated again
        assert read_val(tmp_path) == rows
