"""The ablation study's rows, report and orderings (a tiny budget: the machinery, not the claim)."""

import math
import statistics

import pytest

from mesh.bench import ablations, simruns
from mesh.bench.simruns import spec_config
from mesh.config import load_config


def test_rows_change_one_setting_of_asyncmesh_fp8():
    base = load_config([], [])
    cfgs = {s.method: spec_config(base, s, 64) for s in ablations.build_specs([0])}
    assert list(cfgs) == [row for row, _, _ in ablations.ROWS]
    full = cfgs[ablations.FULL]
    assert (full.grid.stages, full.grid.replicas) == (8, 2)
    assert (full.dp.correction, full.dp.codec, full.dp.fraction) == ("ema", "fp8_e4m3", 0.05)
    for row, change, _ in ablations.ROWS[1:]:
        dumped, ref = cfgs[row].model_dump(), full.model_dump()
        differ = {
            f"{sec}.{k}"
            for sec in ref
            if isinstance(ref[sec], dict)
            for k in ref[sec]
            if ref[sec][k] != dumped[sec][k]
        }
        assert differ == set(change), row


def test_rows_run_at_the_lr_the_sweep_chose_and_the_sweep_varies_only_the_lr():
    base = load_config([], [])
    rows = [spec_config(base, s, 64) for s in ablations.build_specs([0, 1], lr=5e-4)]
    assert len(rows) == 2 * len(ablations.ROWS) and {c.optim.lr for c in rows} == {5e-4}
    sweep = [spec_config(base, s, 64) for s in ablations.lr_specs(0, (1e-3, 2e-3))]
    assert [c.optim.lr for c in sweep] == [1e-3, 2e-3]
    full = spec_config(base, ablations.build_specs([0], lr=1e-3)[0], 64)
    assert sweep[0].fingerprint() == full.fingerprint()  # the sweep's run is the row's: reused


def test_best_lr_is_the_lowest_loss_and_never_a_diverged_run():
    runs = [
        {"method": "full AsyncMesh lr=0.001", "val_loss": 2.6, "diverged": False},
        {"method": "full AsyncMesh lr=0.0005", "val_loss": 2.5, "diverged": False},
        {"method": "full AsyncMesh lr=0.004", "val_loss": 1.0, "diverged": True},
        {"method": "full AsyncMesh lr=0.008", "val_loss": None, "diverged": False},
    ]
    assert ablations.best_lr(runs) == 0.0005


@pytest.mark.slow
def test_study_writes_the_table_beside_the_papers_numbers(text_file, tmp_path, monkeypatch):
    monkeypatch.setattr(simruns, "QUICK_MICROBATCHES", 64)  # the table's shape, not its numbers
    base = load_config(
        [],
        [
            f"data.path='{text_file}'",
            "model.n_layers=8",
            "model.d_model=16",
            "model.n_heads=2",
            "model.seq_len=16",
            "pipeline.microbatch_size=2",
            "data.val_batches=1",
        ],
    )
    summary = ablations.run_ablations(base, tmp_path, quick=True, workers=2)
    assert len(summary["runs"]) == len(ablations.ROWS)
    sweep = summary["lr_sweep"]
    assert len(sweep["runs"]) == 2 and sweep["best"] in sweep["lrs"]
    assert summary["settings"]["optim.lr"] == sweep["best"]
    assert all(not r["diverged"] and math.isfinite(r["val_loss"]) for r in summary["runs"])
    table = (tmp_path / "table.md").read_text()
    cells = {
        c[0]: c
        for c in (
            [x.strip() for x in line.strip("|").split("|")]
            for line in table.splitlines()
            if line.count("|") > 6
        )
    }
    for row, _, ppl in ablations.ROWS:
        # each row carries the paper's number beside the mean of this study's runs of it
        ours = statistics.mean(r["val_loss"] for r in summary["runs"] if r["method"] == row)
        assert cells[row][2] == f"{ppl:.2f}" and cells[row][4] == f"{ours:.4f}", cells[row]
    assert "## The lr" in table and "best" in table
    assert len(ablations.orderings(summary["runs"])) == len(ablations.ROWS) - 1
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert not (tmp_path / "runs.partial.jsonl").exists()
