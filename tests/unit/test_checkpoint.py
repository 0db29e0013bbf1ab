"""Checkpoints: atomic, refused when torn or foreign, and a resume replays the same numbers."""

import multiprocessing as mp
import os
import random
import signal
import time

import helpers
import pytest
import torch

from mesh.config import load_config
from mesh.engine.cell import Cell
from mesh.model.build import build_stage
from mesh.runtime.checkpoint import (
    CheckpointError,
    check_checkpoint,
    checkpoint_path,
    common_step,
    load_cell,
    resume_point,
    save_cell,
    saved_steps,
)

TINY = helpers.TINY_MODEL


def _cell(stage=0, *extra):
    cfg = load_config([], [*TINY, "grid.stages=2", *extra])
    return cfg, Cell(cfg, stage, 0, build_stage(cfg.model, 2, stage, cfg.run.seed))


def _train(cell, steps):
    for _ in range(steps):
        grads = [torch.randn_like(p) * 0.01 for p in cell.params]
        cell.apply_update(grads)
        cell.push_version()


def test_roundtrip_restores_everything(tmp_path):
    cfg, a = _cell()
    torch.manual_seed(0)
    _train(a, 3)
    save_cell(a, cfg.fingerprint(), tmp_path)
    _, b = _cell()
    load_cell(b, cfg.fingerprint(), checkpoint_path(tmp_path, 0, 0, 3))
    assert b.step == 3 and torch.equal(a.flat, b.flat) and torch.equal(a.drift, b.drift)
    assert list(a.history) == list(b.history)
    torch.manual_seed(1)
    _train(a, 2)
    torch.manual_seed(1)
    _train(b, 2)
    assert torch.equal(a.flat, b.flat), "the optimizer state came back too"


def test_foreign_torn_and_mismatched_checkpoints_are_refused(tmp_path):
    cfg, a = _cell()
    path = save_cell(a, cfg.fingerprint(), tmp_path)
    with pytest.raises(CheckpointError, match="another config"):
        load_cell(a, "0" * 16, path)
    _, other_stage = _cell(1)
    with pytest.raises(CheckpointError):
        load_cell(other_stage, cfg.fingerprint(), path)
    torn = tmp_path / "torn.pt"
    torn.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    before = a.flat.clone()
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        load_cell(a, cfg.fingerprint(), torn)
    assert torch.equal(a.flat, before), "a refused checkpoint changes nothing"
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_cell(a, cfg.fingerprint(), tmp_path / "missing.pt")


def test_old_checkpoints_are_pruned_and_common_step_found(tmp_path):
    cfg, a = _cell()
    for _ in range(5):
        _train(a, 1)
        save_cell(a, cfg.fingerprint(), tmp_path)
    assert saved_steps(tmp_path, 0, 0) == [3, 4, 5]
    _, b = _cell(1)
    for _ in range(3):
        _train(b, 1)
        save_cell(b, cfg.fingerprint(), tmp_path)
    assert common_step(tmp_path, [(0, 0), (1, 0)]) == 3


KILLS = 20
BIG = ["model.d_model=64"]  # ~3 MB of state: a save lasts milliseconds, room to land inside


def _resume_and_save_forever(run_dir, conn, saving, saved):
    """A cell's checkpoint life with nothing else in it: resume as `simulate --resume` and
    run_cell do (the newest intact checkpoint: resume_point, then load_cell), say from which
    step, then train and save forever; `saving` is 1 exactly while save_cell runs, `saved`
    counts the saves it finished."""
    cfg, cell = _cell(0, *BIG)
    point = resume_point(run_dir, [(0, 0)], cfg.state_fingerprint())
    if point.step is not None:
        load_cell(cell, cfg.state_fingerprint(), checkpoint_path(run_dir, 0, 0, point.step))
    else:  # a first save before the kills: then a cell always has one to lose
        save_cell(cell, cfg.state_fingerprint(), run_dir)
    conn.send((point.step, point.damaged))
    while True:
        _train(cell, 1)
        saving.value = 1
        save_cell(cell, cfg.state_fingerprint(), run_dir)
        saving.value = 0
        saved.value += 1


def test_sigkill_at_random_points_inside_saves_never_costs_a_valid_checkpoint(tmp_path):
    """Item 6 of issue 16: a cell process is SIGKILLed 20 times at random points inside
    save_cell (found by waiting for it to enter a save, then a random part of a save's length);
    after each kill every checkpoint on disk is intact, and the restarted process resumes from
    the newest one. The processes fork from a server that imported torch once (seconds, not
    minutes)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "mesh.runtime.checkpoint", "mesh.model.build"])
    cfg, fresh = _cell(0, *BIG)
    fp, rng, run_dir = cfg.state_fingerprint(), random.Random(16), tmp_path / "run"
    inside, resumed = 0, []
    for _ in range(KILLS + 1):
        newest = max(saved_steps(run_dir, 0, 0), default=None)
        parent, child = ctx.Pipe()
        saving, saved = ctx.Value("i", 0, lock=False), ctx.Value("i", 0, lock=False)
        args = (run_dir, child, saving, saved)
        proc = ctx.Process(target=_resume_and_save_forever, args=args)
        proc.start()
        try:
            assert parent.poll(120), "the cell did not start"
            step, damaged = parent.recv()
            assert (step, damaged) == (newest, []), "it resumes from the newest checkpoint"
            resumed.append(step)
            if len(resumed) > KILLS:
                break
            k = rng.randrange(3)  # in its first, second or third save after the restart ...

            def in_save(k=k, saving=saving, saved=saved):
                return saving.value == 1 and saved.value >= k

            helpers.wait_for(in_save, 60, "a save", period_s=0.0002)
            time.sleep(rng.uniform(0.0, 0.01))  # ... at a random point of it
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)
            inside += saving.value  # still 1: it died inside save_cell
        finally:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        steps = saved_steps(run_dir, 0, 0)
        assert steps, "a kill never leaves a cell without a checkpoint"
        for s in steps:  # every checkpoint present is whole and loads
            path = checkpoint_path(run_dir, 0, 0, s)
            assert check_checkpoint(path, fp, 0, 0) is None, path
            load_cell(fresh, fp, path)
        # what a kill tore is only a temporary file, and the next save sweeps it
        assert len(list(run_dir.glob("checkpoints/0-0/.step-*.tmp"))) <= 1
    assert resumed[0] is None and all(a <= b for a, b in zip(resumed[1:], resumed[2:]))
    assert resumed[-1] > resumed[1], "the restarted cells went on training and saving"
    # the kills did land inside saves (a busy box may let a few saves finish first)
    assert inside >= KILLS // 2, f"only {inside} of {KILLS} kills landed inside save_cell"


@pytest.mark.parametrize("extra", [[], ["optim.state_8bit=true"], ["optim.name=rotated_adam"]])
def test_state_vector_moves_a_live_cell_exactly(extra):
    """A joiner adopting a peer's state (mesh/runtime/state_sync.py) trains on exactly as the
    peer."""
    from mesh.runtime.checkpoint import load_state_vector, state_numel, state_vector

    _, a = _cell(0, *extra)
    torch.manual_seed(0)
    _train(a, 3)
    vec = state_vector(a)
    assert vec.dtype == torch.float32 and vec.shape == (state_numel(a),)
    _, b = _cell(0, *extra)
    load_state_vector(b, vec.clone(), a.step)
    assert b.step == 3 and torch.equal(a.flat, b.flat) and list(b.history) == [3]
    torch.manual_seed(1)
    _train(a, 2)
    torch.manual_seed(1)
    _train(b, 2)
    assert torch.equal(a.flat, b.flat)


def test_state_vector_that_does_not_fit_is_refused():
    from mesh.runtime.checkpoint import load_state_vector, state_vector

    _, a = _cell()
    vec = state_vector(a)
    before = a.flat.clone()
    with pytest.raises(CheckpointError, match="does not fit"):
        load_state_vector(a, vec[:-1], 5)
    bad = vec.clone()
    bad[0] = float("nan")
    with pytest.raises(CheckpointError, match="non-finite"):
        load_state_vector(a, bad, 5)
    assert torch.equal(a.flat, before) and a.step == 0


def test_resume_point_passes_over_a_truncated_newest_file(tmp_path):
    """The newest step where every cell's file is intact; damaged newer files are named."""
    from mesh.runtime.checkpoint import check_checkpoint, resume_point

    cfg = load_config([], [*TINY, "grid.stages=2"])
    fp = cfg.state_fingerprint()
    cells = []
    for stage in (0, 1):
        _, cell = _cell(stage)
        for _ in range(3):
            _train(cell, 2)
            save_cell(cell, fp, tmp_path)
        cells.append((stage, 0))
    assert resume_point(tmp_path, cells, fp).step == 6
    newest = checkpoint_path(tmp_path, 1, 0, 6)
    newest.write_bytes(newest.read_bytes()[:1000])
    assert "unreadable" in check_checkpoint(newest, fp, 1, 0)
    assert check_checkpoint(checkpoint_path(tmp_path, 0, 0, 6), fp, 0, 0) is None
    point = resume_point(tmp_path, cells, fp)
    assert point.step == 4 and point.foreign == []
    assert [d[:3] for d in point.damaged] == [(1, 0, 6)]
    for step in (2, 4):  # every older file of one cell torn too: no common step is left
        path = checkpoint_path(tmp_path, 0, 0, step)
        path.write_bytes(b"not a checkpoint")
    assert resume_point(tmp_path, cells, fp).step is None


def test_resume_point_tells_another_config_from_damage(tmp_path):
    from mesh.runtime.checkpoint import resume_point

    cfg, cell = _cell(0)
    _train(cell, 2)
    save_cell(cell, cfg.state_fingerprint(), tmp_path)
    other = load_config([], [*TINY, "grid.stages=2", "dp.tau=7"]).state_fingerprint()
    point = resume_point(tmp_path, [(0, 0)], other)
    assert point.step is None and point.damaged == []
    assert [d[:3] for d in point.foreign] == [(0, 0, 2)]


def test_a_longer_run_keeps_its_schedule_horizon():
    """run.steps only says where a run stops: the checkpoints' state fingerprint and the lr
    and lambda schedules follow run.schedule_steps, so extending a run changes no past update,
    and the extra updates run at the schedules' floors."""
    short = [*TINY, "grid.stages=2", "optim.warmup_steps=2"]
    base = load_config([], [*short, "run.steps=8", "run.schedule_steps=8"])
    longer = load_config([], [*short, "run.steps=12", "run.schedule_steps=8"])
    assert base.state_fingerprint() == longer.state_fingerprint()
    assert base.fingerprint() != longer.fingerprint()  # peers of one run agree on its end
    restretched = load_config([], [*short, "run.steps=12"])
    assert restretched.state_fingerprint() != base.state_fingerprint()
    # unset schedule_steps hashes as run.steps spelled out: fingerprints of old runs stand
    assert load_config([], [*short, "run.steps=8"]).fingerprint() == base.fingerprint()
    a = Cell(base, 0, 0, build_stage(base.model, 2, 0, 0))
    b = Cell(longer, 0, 0, build_stage(longer.model, 2, 0, 0))
    for step in (0, 3, 7, 8, 11):
        a.step = b.step = step
        assert a.lr_scale() == b.lr_scale()
    b.step = 11
    assert b.lr_scale() == pytest.approx(base.optim.min_lr_ratio)


def test_a_save_sweeps_dead_writers_temporary_files_only(tmp_path):
    cfg, cell = _cell()
    folder = checkpoint_path(tmp_path, 0, 0, 0).parent
    folder.mkdir(parents=True)
    dead = mp.get_context("fork").Process(target=int)
    dead.start()
    dead.join()
    torn, live = (
        folder / f".step-00000000.pt.{dead.pid}.tmp",
        folder / f".step-1.pt.{os.getppid()}.tmp",
    )
    torn.write_bytes(b"half")
    live.write_bytes(b"being written")
    save_cell(cell, cfg.state_fingerprint(), tmp_path)
    assert not torn.exists() and live.exists()
