"""The end-of-run table of a process grid counts what trained: a replica that never ran (a cell
dead from the start on a fixed grid) is in neither the tokens nor the validation loss, a line
under the table says which and why, and stage pools add their routing counters."""

from __future__ import annotations

import json

import helpers
import pytest

from cli.logical import pool_counts, stalled_note
from cli.simulate import left_out_note, pool_cells, summary_table
from mesh.config import load_config
from mesh.engine.pools import make_sim
from mesh.runtime.emulate import compute_table
from mesh.runtime.metrics import summarize_run

TPM = 2 * 16  # pipeline.microbatch_size x model.seq_len below


def _cfg(text_file, *sets):
    return load_config(
        [],
        [
            f"data.path='{text_file}'",
            "grid.stages=2",
            "grid.replicas=2",
            "model.seq_len=16",
            "pipeline.microbatch_size=2",
            "emulation.compute='emulated'",
            "checkpoint.every=1000",
            *sets,
        ],
    )


def _write(run, cell, rows):
    (run / "metrics").mkdir(parents=True, exist_ok=True)
    with (run / "metrics" / f"{cell[0]}-{cell[1]}.jsonl").open("a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def _updates(start, end, **extra):
    return [
        {"step": s, "time_s": 0.1 * s, "microbatches": s - start, "busy_s": 0.0, **extra}
        for s in range(start + 1, end + 1)
    ]


def test_a_fixed_replica_that_never_ran_is_not_counted_and_the_table_says_why(text_file, tmp_path):
    """2x2 fixed, s1r1 dead from update 0: replica 1 never starts (its cells write nothing);
    replica 0 trains 20 updates. Tokens are replica 0's alone (20 x 1 microbatch x 32), not
    the grid's 2 x that; replica 0 saved no checkpoint here, so it has no loss either."""
    cfg = _cfg(text_file, 'emulation.deaths=["s1r1@0"]')
    run = tmp_path / "run"
    for j in range(2):
        _write(run, (j, 0), [{"event": "started", "step": 0}, *_updates(0, 20)])
    summary = summarize_run(cfg, run, wall_s=2.0)
    assert summary["tokens"] == 20 * TPM == summary["tokens_trained"]
    assert summary["tokens_per_s"] == 20 * TPM / 2.0
    assert summary["steps"] == 20 and summary["val_loss"] is None
    left = {d["replica"]: d for d in summary["replicas_left_out"]}
    assert left[1]["left_out_of"] == ["tokens", "val_loss"] and "s1r1" in left[1]["why"]
    assert left[0]["left_out_of"] == ["val_loss"] and "checkpoint.every = 1000" in left[0]["why"]
    assert "pools" not in summary
    # the emulated ideal is replica 0's alone, and its rate is measured: no n/a
    assert summary["ideal_tokens_per_s"] == pytest.approx(TPM / max(compute_table(cfg)[0]))
    assert summary["fraction_of_ideal"] is not None


def _summary(**more):
    """What summarize_run writes for a 4x2 fixed grid whose s2r1 is dead from the start."""
    return {
        "grid": "4x2",
        "steps": 100,
        "tokens": 102400,  # replica 0's 100 updates x 1024: replica 1 never ran
        "tokens_trained": 102400,
        "tokens_per_s": 900.0,
        "fraction_of_ideal": 0.4,
        "val_loss": 3.1,
        "val_bpb": 4.5,
        "val_loss_replicas": [3.1, None],
        "bytes": {"pp_per_replica_step": 1000, "dp_per_replica_step": 100},
        "rounds": {
            "rounds_started": 10,
            "rounds_applied": 8,
            "rounds_partial": 0,
            "rounds_failed": 1,
        },
        "rejects": 0,
        "rejects_by_reason": {},
        "replicas_left_out": [
            {
                "replica": 1,
                "left_out_of": ["tokens", "val_loss"],
                "why": "emulation.deaths takes s2r1 out from update 0, and a fixed replica "
                "trains only with all its stages: it never ran",
            }
        ],
        **more,
    }


def test_the_table_counts_trained_tokens_and_says_which_replica_is_left_out():
    headers, rows = summary_table(_summary())
    row = dict(zip(headers, rows[0], strict=True))
    assert row["tokens"] == "102400" and row["val loss"] == "3.1000"
    assert not any(h.startswith("pool") for h in headers), "fixed wiring: no pool columns"
    (line,) = left_out_note(_summary())
    assert line == (
        "replica 1 left out of the tokens and the validation loss (emulation.deaths takes s2r1 "
        "out from update 0, and a fixed replica trains only with all its stages: it never ran)"
    )
    assert left_out_note(_summary(replicas_left_out=[])) == []


def test_a_pooled_grids_table_has_its_routing_columns():
    pools = {"routed": 600, "cross_replica": 250, "refused": 12, "rerouted": 15, "voided": 3}
    summary = _summary(
        pools=pools,
        replicas_left_out=[
            {
                "replica": 1,
                "left_out_of": ["val_loss"],
                "why": "emulation.deaths takes s2r1 out from update 0: its stage's other cells "
                "took its work, and its replica's chain lacks it",
            }
        ],
    )
    headers, rows = summary_table(summary)
    row = dict(zip(headers, rows[0], strict=True))
    assert row["pool routed/across replicas"] == "600/250"
    assert row["pool refused/rerouted"] == "12/15" and row["pool voided"] == "3"
    assert left_out_note(summary)[0].startswith("replica 1 left out of the validation loss (")


def test_a_pooled_runs_counters_add_up_over_every_life(text_file, tmp_path):
    """Each life's last row counts from its process's start: a restarted cell's counters are
    the sum of its lives'. Tokens are what the streams got back."""
    cfg = _cfg(text_file, "pipeline.routing='pools'")
    run = tmp_path / "run"
    c = {"routed": {"s1r0": 6, "s1r1": 4}, "cross_replica": 4, "refused": 0, "rerouted": 2}
    for i in range(2):
        _write(run, (0, i), [{"event": "started", "step": 0}, *_updates(0, 10, **c, voided=1)])
        _write(run, (1, i), [{"event": "started", "step": 0}, *_updates(0, 10)])
    # s0r0 died at 10 and came back from step 5: its second life counts from 0 again
    again = {"routed": {"s1r0": 3}, "cross_replica": 0, "refused": 0, "rerouted": 1}
    _write(run, (0, 0), [{"event": "started", "step": 5}, *_updates(5, 12, **again, voided=0)])
    _write(run, (1, 1), [{"final": True, "step": 10, "refused": 2, "routed": {}, "voided": 0}])
    summary = summarize_run(cfg, run, wall_s=1.0)
    assert summary["pools"] == {
        "routed": 10 + 10 + 3,
        "cross_replica": 4 + 4,
        "refused": 2,
        "rerouted": 2 + 2 + 1,
        "voided": 2,
    }
    assert summary["tokens"] == (12 + 10) * TPM  # the streams' microbatches
    headers, rows = summary_table(summary)
    assert dict(zip(headers, rows[0], strict=True))["pool routed/across replicas"] == "23/8"


def test_the_logical_table_counts_a_stalled_replica_and_its_pools(text_file):
    """The simulator's counts: a fixed replica stalled by a death trains fewer updates, said in
    a line; with pools, the hops across replicas and the voided microbatches."""
    base = [*helpers.TINY, f"data.path='{text_file}'", "grid.stages=2", "grid.replicas=2"]
    sim = make_sim(load_config([], [*base, 'emulation.deaths=["s1r1@0-4"]']))
    for _ in range(6):
        sim.step()
    counts = pool_counts(sim)
    assert counts == {"replica_updates": [6, 2]}
    (line,) = stalled_note({**counts, "steps": 6})
    assert "replica 1 trained 2 of 6 updates" in line and "replica 0" not in line
    assert stalled_note({"replica_updates": [6, 6], "steps": 6}) == []

    sim = make_sim(
        load_config([], [*base, "pipeline.routing='pools'", 'emulation.deaths=["s1r1@0"]'])
    )
    for _ in range(6):
        sim.step()
    p = pool_counts(sim)["pools"]
    assert p == {"routed": 12, "cross_replica": 6, "voided": 0}  # 2 streams x 6, all to s1r0
    assert pool_cells({"pools": p}) == ["12/6", "n/a", "0"]


def test_updates_trained_are_whole_updates_every_stage_applied() -> None:
    """A replica's stages stopped a step apart (a hivemind stop) count the update they all
    finished: 384, not the mean 384.25; a cell that never ran leaves its replica at 0; a pool
    counts its stage-0 cells' updates."""
    from mesh.runtime.metrics import whole_updates

    steps = {(0, 0): 192, (1, 0): 193, (0, 1): 192, (1, 1): 192}
    assert whole_updates(steps, 2, 2, pools=False) == 384
    assert whole_updates({(0, 0): 10, (1, 0): 10, (0, 1): 7}, 2, 2, pools=False) == 10
    assert whole_updates({(0, 0): 30, (0, 1): 12, (1, 0): 25, (1, 1): 17}, 2, 2, pools=True) == 42


def test_a_hivemind_replicas_loss_is_of_its_cells_newest_saves(text_file, tmp_path):
    """A hivemind stop saves each cell where it finds it (here s0r0 at 9, s1r0 at 10), past
    the last step both saved (4, a periodic save): the summary's loss is of the newest saves,
    not of step 4 (a resumed run reported the loss of the step it had resumed from)."""
    import torch

    from mesh.engine.cell import Cell
    from mesh.model.build import build_cell_stage
    from mesh.runtime.checkpoint import save_cell
    from mesh.runtime.evaluate import replica_loss, validation_batches

    cfg = _cfg(text_file, *helpers.TINY, "grid.replicas=1", "transport.backend='hivemind'")
    run = tmp_path / "run"
    cells = [Cell.build(cfg, j, 0, build_cell_stage(cfg, j)) for j in range(2)]
    for cell in cells:
        cell.step = 4
        save_cell(cell, cfg.state_fingerprint(), run)
    for cell, step in zip(cells, (9, 10), strict=True):
        cell.step = step
        cell.flat.add_(torch.randn_like(cell.flat))  # somewhere else entirely
        save_cell(cell, cfg.state_fingerprint(), run)
    for j, end in ((0, 9), (1, 10)):
        _write(run, (j, 0), [{"event": "started", "step": 0}, *_updates(0, end)])
    from mesh.data.corpus import load_corpus

    corpus = load_corpus(cfg.data.path, cfg.data.val_fraction, cfg.model.seq_len, cfg.data.digest)
    batches = validation_batches(cfg, corpus)
    newest, old = (replica_loss(cfg, run, 0, at, batches) for at in ([9, 10], 4))
    assert newest != old
    assert summarize_run(cfg, run, wall_s=1.0)["val_loss_replicas"] == [newest]
