"""The convergence study's bookkeeping: specs at equal tokens, tables, targets, plots."""

import json

import pytest

from mesh.bench.convergence import build_specs, targets, write_outputs
from mesh.bench.simruns import read_runs, reuse, spec_config
from mesh.config import load_config


def test_specs_cover_every_method_and_read_equal_tokens():
    specs = build_specs([0, 1])
    dp = {s.method for s in specs if s.study == "dp"}
    assert dp == {
        "FullSync",
        "DPAvg",
        "SPARTA",
        "AsyncSPARTA",
        "AsyncMesh",
        "AsyncMesh-fp8",
        "DeltaRule",
        "NoComm",
    }
    base = load_config()
    for s in specs:
        cfg = spec_config(base, s, 64)
        from mesh.algo.schedule import microbatches_per_update

        mpu = microbatches_per_update(cfg.pipeline.schedule, cfg.pipeline.microbatches)
        assert cfg.run.steps * mpu == 64, s.method
        assert cfg.run.seed == s.seed


def _fake_runs():
    runs = []
    for seed in (0, 1):
        for i, s in enumerate(build_specs([seed])):
            loss = 2.0 + 0.01 * i + 0.001 * seed
            dpb = 1000.0 if s.method == "FullSync" else 10.0
            runs.append(
                {
                    "study": s.study,
                    "method": s.method,
                    "seed": seed,
                    "val_loss": loss,
                    "tokens": 100,
                    "dp_bytes_per_replica_step": dpb,
                    "curve": [
                        {"tokens": 50, "val_loss": loss + 1},
                        {"tokens": 100, "val_loss": loss},
                    ],
                }
            )
    return runs


def _summary(runs):
    return {
        "microbatches_per_replica": {"dp": 1, "pp": 1},
        "seeds": [0, 1],
        "quick": True,
        "wall_s": 1.0,
        "tokens_per_microbatch": 512,
        "runs": runs,
    }


def test_outputs_are_written_and_targets_judged(tmp_path):
    runs = _fake_runs()
    summary = _summary(runs)
    write_outputs(summary, tmp_path)
    assert json.loads((tmp_path / "summary.json").read_text())["runs"][0]["method"]
    table = (tmp_path / "table.md").read_text()
    assert "gap to FullSync" in table and "## Targets" in table
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert (tmp_path / "pipeline.png").stat().st_size > 1000
    verdicts = {name: ok for name, _, ok in targets(runs)}
    assert verdicts["AsyncMesh-fp8 averaging bytes <= 1/64 of FullSync"] is True
    assert len(verdicts) == 8


def test_a_stopped_study_keeps_only_runs_of_the_same_config_and_budget(tmp_path):
    base = load_config()
    specs = [s for s in build_specs([0]) if s.method in ("FullSync", "AsyncMesh")]
    want = {(s.study, s.method, s.seed): spec_config(base, s, 64).fingerprint() for s in specs}
    fp_fs, fp_am = want[("dp", "FullSync", 0)], want[("dp", "AsyncMesh", 0)]
    assert fp_fs != fp_am
    rows = [
        {"study": "dp", "method": "FullSync", "seed": 0, "microbatches": 64,
         "config_fingerprint": fp_am},  # another config's run under FullSync's name
        {"study": "dp", "method": "AsyncMesh", "seed": 0, "microbatches": 32,
         "config_fingerprint": fp_am},  # another budget
        {"study": "dp", "method": "AsyncMesh", "seed": 0, "microbatches": 64,
         "config_fingerprint": fp_am},
    ]  # fmt: skip
    partial = tmp_path / "runs.partial.jsonl"
    partial.write_text("".join(json.dumps(r) + "\n" for r in rows))
    found = reuse(read_runs(partial), specs, base, {"dp": 64, "pp": 64})
    assert [r for r in found if r is not None] == [rows[2]]


@pytest.mark.slow
def test_a_second_study_stage_keeps_the_first_stages_runs_for_a_resume(text_file, tmp_path):
    """run_specs called twice on one directory (an lr sweep, then the rows at its best): the
    second call's rewrite of runs.partial.jsonl keeps the first call's runs."""
    from mesh.bench.simruns import Spec, run_specs

    base = load_config([], [f"data.path='{text_file}'", "model.n_layers=2", "grid.stages=2",
                            "model.d_model=16", "model.n_heads=2", "model.seq_len=16",
                            "pipeline.microbatch_size=2", "data.val_batches=1"])  # fmt: skip
    a = Spec("dp", "a", 0, 1, (("grid.stages", 2), ("optim.lr", 1e-3)))
    b = Spec("dp", "b", 0, 1, (("grid.stages", 2), ("optim.lr", 2e-3)))
    run_specs(base, [a], {"dp": 16}, tmp_path, 1, "first")
    run_specs(base, [b], {"dp": 16}, tmp_path, 1, "second")
    kept = read_runs(tmp_path / "runs.partial.jsonl")
    assert sorted(r["method"] for r in kept) == ["a", "b"]
    # and a resume of the first finds its run without running it again
    assert reuse(kept, [a], base, {"dp": 16})[0]["method"] == "a"


def test_tuned_settings_of_any_type_are_reported(tmp_path):
    summary = _summary(_fake_runs())
    summary["tuned"] = {
        "FullSync": {"optim.lr": 9e-3},
        "AsyncMesh-fp8": {"optim.lr": 3e-3, "dp.tau": 2, "dp.lambda_clock": "steps"},
    }
    write_outputs(summary, tmp_path)
    table = (tmp_path / "table.md").read_text()
    assert "dp.lambda_clock steps" in table and "dp.tau 2" in table


def test_a_missed_headline_carries_its_measured_reason(tmp_path):
    runs = _fake_runs()
    for r in runs:  # AsyncMesh-fp8 5% above FullSync: the headline is missed
        if r["method"] == "AsyncMesh-fp8":
            fs = next(f for f in runs if f["method"] == "FullSync" and f["seed"] == r["seed"])
            r["val_loss"] = fs["val_loss"] * 1.05
    summary = _summary(runs)
    write_outputs(summary, tmp_path)
    assert "Why the headline is missed" not in (tmp_path / "table.md").read_text()
    am8 = {r["seed"]: r["val_loss"] for r in runs if r["method"] == "AsyncMesh-fp8"}
    fs = {r["seed"]: r["val_loss"] for r in runs if r["method"] == "FullSync"}
    free = {s: v * 0.97 for s, v in fs.items()}
    loss = {"AsyncMesh-fp8 (the study's)": am8, "delay-free pipeline": free}
    (tmp_path / "decomposition.json").write_text(json.dumps({"loss": loss, "runs": []}))
    write_outputs(summary, tmp_path)
    table = (tmp_path / "table.md").read_text()
    assert "Why the headline is missed" in table
    assert "(-3.0%)" in table and "(+5.0%)" in table and "earlier tuning" not in table
    # the decomposition of another tuning's arm is named stale
    loss["AsyncMesh-fp8 (the study's)"] = {s: v + 0.01 for s, v in am8.items()}
    (tmp_path / "decomposition.json").write_text(json.dumps({"loss": loss, "runs": []}))
    write_outputs(summary, tmp_path)
    assert "earlier tuning" in (tmp_path / "table.md").read_text()


def test_a_narrow_asyncsparta_margin_points_at_the_orderings_at_another_tau(tmp_path):
    runs = _fake_runs()  # AsyncSPARTA within 0.03 of AsyncMesh-fp8 here
    summary = _summary(runs)
    write_outputs(summary, tmp_path)
    assert "at tau 5" not in (tmp_path / "table.md").read_text()
    loss = {"AsyncMesh-fp8": {0: 2.0, 1: 2.1}, "AsyncSPARTA": {0: 2.05, 1: 2.17}}
    (tmp_path / "orderings_tau5.json").write_text(json.dumps({"loss": loss}))
    write_outputs(summary, tmp_path)
    table = (tmp_path / "table.md").read_text()
    assert "AsyncSPARTA minus AsyncMesh-fp8 at tau 5" in table and "+0.0600" in table
