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
from mesh.runtime.launch import cell_context

TINY = helpers.TINY_MODEL


def _cell(stage=0, *extra):
    cfg = load_config([], [*TINY, "grid.stages=2", *extra])
    return cfg, Cell.build(cfg, stage, 0, build_stage(cfg.model, 2, stage, cfg.run.seed))


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


@pytest.mark.slow
def test_sigkill_at_random_points_inside_saves_never_costs_a_valid_checkpoint(tmp_path):
    """Item 6 of issue 16: a cell process is SIGKILLed 20 times at random points inside
    save_cell (found by waiting for it to enter a save, then a random part of a save's length);
    after each kill every checkpoint on disk is intact, and the restarted process resumes from
    the newest one. The processes fork from the cells' server, which imported torch once
    (seconds, not minutes)."""
    ctx = cell_context()
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


def _flip_middle(path, n=4096):
    """n bytes in the middle of the file, each one's bits inverted (what a bad sector or a
    bad copy does): the file still unpickles, with other numbers."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + n] = bytes(b ^ 0xFF for b in data[mid : mid + n])
    path.write_bytes(bytes(data))


def test_a_checkpoint_with_bytes_flipped_in_the_middle_is_passed_over(tmp_path):
    """4 KB flipped in the middle of a cell's newest checkpoint: the file still loads with
    the right shapes (what let it be resumed from before the digest), but its digest does not
    match: passed over like a truncated one, and the resume is from the step before."""
    from mesh.runtime.checkpoint import DAMAGED, MappedCheckpoint, newest_intact

    cfg = load_config([], [*TINY, "grid.stages=2"])
    fp = cfg.state_fingerprint()
    for stage in (0, 1):
        _, cell = _cell(stage)
        for _ in range(3):
            _train(cell, 2)
            save_cell(cell, fp, tmp_path)
    newest = checkpoint_path(tmp_path, 1, 0, 6)
    _flip_middle(newest)
    assert MappedCheckpoint(newest).state["step"] == 6, "still loads: only the digest tells"
    assert check_checkpoint(newest, fp, 1, 0) == f"unreadable ({DAMAGED})"
    point = resume_point(tmp_path, [(0, 0), (1, 0)], fp)
    assert point.step == 4 and [d[:3] for d in point.damaged] == [(1, 0, 6)]
    assert newest_intact(tmp_path, 1, 0, fp) == 4 and newest_intact(tmp_path, 0, 0, fp) == 6


def test_the_digest_trails_the_file_and_covers_every_byte(tmp_path):
    """The file is torch.save's bytes, then one line: the SHA-256 of those bytes. Any
    byte changed (the pickle at the start, a tensor, the zip's directory at the end) or the
    line cut off is refused; a file of an earlier format (no digest) still resumes."""
    import hashlib

    from mesh.runtime.checkpoint_digest import DIGEST_TAG, TRAILER_BYTES, digest_problem

    cfg, cell = _cell(0)
    fp = cfg.state_fingerprint()
    _train(cell, 2)
    path = save_cell(cell, fp, tmp_path)
    data = path.read_bytes()
    body, trailer = data[:-TRAILER_BYTES], data[-TRAILER_BYTES:]
    assert trailer == DIGEST_TAG + hashlib.sha256(body).hexdigest().encode() + b"\n"
    assert digest_problem(path) is None and check_checkpoint(path, fp, 0, 0) is None
    assert torch.load(path, weights_only=True)["step"] == 2  # torch reads past the trailer
    for at in (100, len(body) // 3, len(body) - 30):
        bad = bytearray(data)
        bad[at] ^= 0x01
        path.write_bytes(bytes(bad))
        assert check_checkpoint(path, fp, 0, 0).startswith("unreadable"), at
    path.write_bytes(body)  # the digest cut off: format 3 must carry one
    assert digest_problem(path) == "no digest"
    assert check_checkpoint(path, fp, 0, 0).startswith("unreadable")
    state = torch.load(io_bytes(body), weights_only=True)
    state["format"] = 2  # an earlier run's file: no digest to check
    torch.save(state, path)
    assert check_checkpoint(path, fp, 0, 0) is None


def test_large_writes_are_hashed_beside_the_write_in_order():
    """Records over PARALLEL_BYTES are hashed on a second thread while written: the digest is
    still the SHA-256 of the file's bytes in order."""
    import hashlib
    import io

    from mesh.runtime.checkpoint_digest import DIGEST_TAG, PARALLEL_BYTES, write_digested

    big = [torch.randn(PARALLEL_BYTES // 2 + k) for k in range(3)]  # 2 MB each, and headers
    out = io.BytesIO()
    write_digested({"a": big, "b": torch.zeros(3)}, out)
    data = out.getvalue()
    body, line = data.rsplit(DIGEST_TAG, 1)
    assert line == hashlib.sha256(body).hexdigest().encode() + b"\n"
    assert all(torch.equal(a, b) for a, b in zip(torch.load(io_bytes(data))["a"], big))


def io_bytes(data):
    import io

    return io.BytesIO(data)


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
    a = Cell.build(base, 0, 0, build_stage(base.model, 2, 0, 0))
    b = Cell.build(longer, 0, 0, build_stage(longer.model, 2, 0, 0))
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


def _state_tensors(cell):
    out = {"flat": cell.flat, "drift": cell.drift}
    out.update((f"version {v}", t) for v, t in cell.history.items())
    out.update((k, v) for k, v in cell.optimizer.state_dict().items())
    return out


def test_a_save_writes_the_cells_own_tensors_and_a_list_of_versions(tmp_path):
    """Format 2: nothing of the stage is copied to be saved (llama-1b's stage 0 holds 10.5 GB
    of state), and the stashed versions are a list instead of a stacked copy."""
    from mesh.runtime.checkpoint import FORMAT, cell_state

    cfg, cell = _cell(0, "pipeline.schedule='async'")
    _train(cell, 3)
    state = cell_state(cell, cfg.state_fingerprint())
    own = [cell.flat, cell.drift, *cell.history.values()]
    own += [v for st in cell.optimizer.state.values() for v in st.values()]
    saved = [state["flat"], state["drift"], *state["stashes"], *state["optimizer"].values()]
    assert [t.data_ptr() for t in saved if isinstance(t, torch.Tensor)] == [
        t.data_ptr() for t in own if isinstance(t, torch.Tensor)
    ], "the cell's own storage, not copies"
    path = save_cell(cell, cfg.state_fingerprint(), tmp_path)
    on_disk = torch.load(path, weights_only=True)
    assert on_disk["format"] == FORMAT == 3 and len(cell.history) == 2  # P - j versions
    assert on_disk["versions"].tolist() == list(cell.history)
    assert isinstance(on_disk["stashes"], list)
    assert all(torch.equal(a, b) for a, b in zip(on_disk["stashes"], cell.history.values()))
    sd = cell.optimizer.state_dict()  # what the optimizer's own format holds, key for key
    assert on_disk["optimizer"].keys() == sd.keys()
    for k, v in sd.items():
        assert (
            torch.equal(on_disk["optimizer"][k], v)
            if isinstance(v, torch.Tensor)
            else (on_disk["optimizer"][k] == v)
        )


def _save_format_1(cell, fingerprint, path):
    """A checkpoint as format 1 wrote it (before issue 27): copies, the versions stacked."""
    versions = sorted(cell.history)
    state = {
        "format": 1,
        "fingerprint": fingerprint,
        "stage": cell.stage,
        "replica": cell.replica,
        "step": cell.step,
        "flat": cell.flat.clone(),
        "drift": cell.drift.clone(),
        "versions": torch.tensor(versions, dtype=torch.int64),
        "stashes": torch.stack([cell.history[v] for v in versions]),
        "optimizer": cell.optimizer.state_dict(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)


@pytest.mark.parametrize("extra", [[], ["optim.name=rotated_adam"]])
def test_format_1_checkpoints_still_resume_and_train_on_the_same(tmp_path, extra):
    cfg, a = _cell(0, *extra)
    fp = cfg.state_fingerprint()
    torch.manual_seed(0)
    _train(a, 3)
    a.drift.normal_()
    path = checkpoint_path(tmp_path, 0, 0, 3)
    _save_format_1(a, fp, path)
    assert check_checkpoint(path, fp, 0, 0) is None
    assert resume_point(tmp_path, [(0, 0)], fp).step == 3
    _, b = _cell(0, *extra)
    load_cell(b, fp, path)
    assert b.step == 3 and list(b.history) == list(a.history)
    for (k, x), y in zip(_state_tensors(a).items(), _state_tensors(b).values(), strict=True):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, k
    torch.manual_seed(1)
    _train(a, 2)
    torch.manual_seed(1)
    _train(b, 2)
    assert torch.equal(a.flat, b.flat)
    # and its next save is of format 2, which loads the same
    _, c = _cell(0, *extra)
    load_cell(c, fp, save_cell(b, fp, tmp_path))
    assert torch.equal(c.flat, a.flat) and list(c.history) == list(a.history)


def _rewritten(path, tmp_path, change):
    """A copy of the checkpoint at `path` with `change` applied to its content, its digest
    made anew (what a program that writes wrong values would leave)."""
    from mesh.runtime.checkpoint import write_digested

    state = torch.load(path, weights_only=True)
    change(state)
    out = tmp_path / "changed" / path.name
    out.parent.mkdir(exist_ok=True)
    with out.open("wb") as f:
        write_digested(state, f)
    return out


def test_a_refused_checkpoint_changes_nothing_in_the_cell(tmp_path):
    """Every check (shapes, optimizer state, finite weights) comes before the first copy."""
    cfg, a = _cell()
    fp = cfg.state_fingerprint()
    _train(a, 2)
    path = save_cell(a, fp, tmp_path)
    _, b = _cell()
    _train(b, 1)
    before = {
        k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in _state_tensors(b).items()
    }

    def nan_in_stash(s):
        s["stashes"][-1][5] = float("nan")

    def optimizer_key_lost(s):
        s["optimizer"].pop(sorted(s["optimizer"])[-1])

    def optimizer_shape(s):
        key = next(k for k, v in s["optimizer"].items() if isinstance(v, torch.Tensor))
        s["optimizer"][key] = torch.zeros(3)

    def stash_short(s):
        s["stashes"][0] = s["stashes"][0][:-1]

    def versions_mismatch(s):
        s["versions"] = torch.tensor([1, 2, 3])

    cases = [
        (nan_in_stash, "non-finite weights"),
        (optimizer_key_lost, "optimizer state does not fit"),
        (optimizer_shape, "optimizer state does not fit"),
        (stash_short, "parameter count does not match"),
        (versions_mismatch, "stashed versions do not match"),
    ]
    for change, why in cases:
        with pytest.raises(CheckpointError, match=why):
            load_cell(b, fp, _rewritten(path, tmp_path, change))
        assert b.step == 1 and list(b.history) == [0, 1], change.__name__
        for (k, x), y in zip(before.items(), _state_tensors(b).values(), strict=True):
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, (change, k)
    flat_nan = _rewritten(path, tmp_path, lambda s: s["flat"].__setitem__(0, float("inf")))
    assert check_checkpoint(flat_nan, fp, 0, 0) == "non-finite weights"


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="pages are released on Linux")
def test_a_mapped_read_hands_its_pages_back_and_touches_nothing_else(tmp_path):
    from mesh.runtime.checkpoint import MappedCheckpoint

    def file_pages():
        with open("/proc/self/status") as f:
            return next(int(x.split()[1]) for x in f if x.startswith("RssFile:")) * 1024

    big = torch.randn(16_000_000)  # 64 MB
    torch.save({"flat": big, "other": [big[:10].clone()]}, tmp_path / "x.pt")
    mapped = MappedCheckpoint(tmp_path / "x.pt")
    flat = mapped.state["flat"]
    before = file_pages()
    assert torch.equal(flat, big)  # read: its pages are this process's now
    assert file_pages() - before > 50e6
    mapped.release(flat)
    assert file_pages() - before < 10e6
    assert torch.equal(flat, big), "released pages read the file again"
    copy = flat.clone()
    mapped.release(copy)  # not of the file's map: left alone (releasing would zero it)
    mapped.release(big)
    assert torch.equal(copy, big) and mapped.all_finite(flat)
    into = torch.empty_like(big)
    mapped.copy_into(into, flat)
    assert torch.equal(into, big) and file_pages() - before < 10e6


def test_pruning_keeps_the_steps_a_resume_needs(tmp_path):
    """A replica that trains on while another is down keeps the newest step the whole run
    shares (--resume) and the newest its own replica shares (a restarted replica), besides its
    newest KEEP; everything else goes."""
    from mesh.runtime.checkpoint import KEEP, checkpoint_path, prune, saved_steps

    def put(stage, replica, *steps):
        for step in steps:
            path = checkpoint_path(tmp_path, stage, replica, step)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"x")

    put(0, 0, 50, 100, 150, 200, 250, 300)  # trained on
    put(1, 0, 50, 100, 150, 190, 240, 290)  # its replica's other stage: shares 150 last
    put(0, 1, 50, 100)  # the replica that died after its step-100 save
    put(1, 1, 50, 100)
    assert KEEP == 3
    assert prune(tmp_path, 0, 0) == [50]  # 100: the run's shared step; 150: the replica's
    assert saved_steps(tmp_path, 0, 0) == [100, 150, 200, 250, 300]
    assert prune(tmp_path, 0, 1) == []  # fewer than KEEP
    put(0, 0, 350)
    assert prune(tmp_path, 0, 0) == [200]
