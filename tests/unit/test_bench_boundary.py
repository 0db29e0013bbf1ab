"""The boundary study's arms, rows and frontier (synthetic runs: the machinery, not the claim)."""

import pytest

from mesh.bench import boundary as study
from mesh.bench.simruns import spec_config
from mesh.config import load_config


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return load_config([], [*study.STUDY_DEFAULTS, "data.path=null"])


def test_arms_are_the_baselines_and_each_method_at_each_ratio(base):
    arms = dict(study.arms(base, 4))
    assert list(arms)[:3] == [study.REFERENCE, "full fp8", "FullSync"]
    for method in study.COMPRESSED:
        for ratio in study.RATIOS:
            ov = arms[f"{method} {ratio}x"]
            assert ov["sentinel.enabled"] is False  # a defence's drops are no boundary's cost
            assert ov["pipeline.boundary"] == method and ov["grid.stages"] == 4
            cfg = spec_config(base, study._spec(f"{method} {ratio}x", ov, 0, 1e-3), 300)
            assert cfg.pipeline.boundary_rank == ov["pipeline.boundary_rank"] <= 64
            assert (cfg.grid.replicas, cfg.run.steps, cfg.optim.lr) == (1, 300, 1e-3)
    # 4-bit coordinates: learned boundaries at 16-128x, about twice fp8's rank at a ratio
    for ratio in (16, 32, 64, 128):
        ov = arms[f"learned {ratio}x int4"]
        assert ov["pipeline.codec"] == "int4_hadamard" and ov["pipeline.boundary"] == "learned"
    assert arms["learned 32x int4"]["pipeline.boundary_rank"] == 7  # fp8's 16x rank, 34x
    assert arms["learned 16x int4"]["pipeline.boundary_rank"] == 15  # fp8's 8x rank
    sync = spec_config(base, study._spec("FullSync", arms["FullSync"], 0, 2e-3), 300)
    assert (sync.pipeline.schedule, sync.run.steps) == ("gpipe", 75)  # equal tokens: 4 a step


def test_rows_pair_the_gap_by_seed_and_the_frontier_is_the_most_compressed_within_1pct(base):
    runs = []
    for seed, ref in ((0, 6.0), (1, 5.0)):
        for arm, _ in study.arms(base, 4):
            gap = {"learned 16x": 0.005, "learned 32x": 0.02}.get(arm, 0.0)
            runs.append({"method": f"P4 {arm}", "seed": seed, "val_loss": ref * (1 + gap),
                         "val_bpb": 2.0, "diverged": False})  # fmt: skip
    rows = {r["arm"]: r for r in study.summarize_rows(base, runs, 4)}
    assert rows[study.REFERENCE]["loss_gap"] == 0 and rows[study.REFERENCE]["compression"] == 1
    assert rows["learned 16x"]["loss_gap"] == pytest.approx(0.005)
    assert rows["learned 16x"]["compression"] >= 16 and rows["learned 16x"]["seeds"] == [0, 1]
    best = study.frontier(list(rows.values()))
    assert best[4]["arm"] == "learned 128x int4"  # gap 0 in this synthetic set, 241x
    for r in rows.values():
        if r["method"] == "subspace" or r["arm"] == "learned 64x" or "int4" in r["arm"]:
            r["loss_gap"] = 0.5
    assert study.frontier(list(rows.values()))[4]["arm"] == "learned 16x"
    rows["learned 32x int4"]["loss_gap"] = 0.004
    assert study.frontier(list(rows.values()))[4]["arm"] == "learned 32x int4"


def test_a_rerun_reuses_the_runs_its_summary_holds(base, tmp_path):
    import json

    assert study.earlier_runs(tmp_path) == []
    sweep, runs = [{"method": "P4 full bf16 lr=0.004"}], [{"method": "P4 learned 16x"}]
    (tmp_path / "summary.json").write_text(json.dumps({"lr_sweep": sweep, "runs": runs}))
    assert study.earlier_runs(tmp_path) == sweep + runs


def test_outputs_are_written(base, tmp_path):
    runs = [{"method": f"P4 {a}", "seed": 0, "val_loss": 6.0, "val_bpb": 2.0, "diverged": False}
            for a, _ in study.arms(base, 4)]  # fmt: skip
    rows = study.summarize_rows(base, runs, 4)
    summary = {"model": {"arch": "llama", "d_model": 64, "n_layers": 8, "vocab_size": 4096,
                         "seq_len": 64}, "data": "x", "tokens_per_run": 1, "seeds": [0],
               "tune_seed": 100, "lrs": {}, "anchor_rank": 16, "rows": rows,
               "best_within_1pct": {"4": None}}  # fmt: skip
    study.write_outputs(summary, tmp_path)
    assert "learned 16x" in (tmp_path / "table.md").read_text()
    assert (tmp_path / "tradeoff.png").stat().st_size > 10_000


def test_a_run_of_some_depths_keeps_the_others_rows():
    def run(label, mbs=300):
        return {"method": label, "microbatches": mbs}

    old = {
        "lrs": {"4": {"full bf16": 4e-3}, "8": {"full bf16": 2e-3}, "16": {"full bf16": 1e-3}},
        "lr_sweep": [run("P4 full bf16 lr=0.004"), run("P8 full bf16 lr=0.002")],
        "runs": [run("P4 learned 16x"), run("P8 learned 16x"), run("P8 full bf16", mbs=24),
                 run("P16 full bf16", mbs=24)],
    }  # fmt: skip
    lrs, sweep, runs = study.held_depths(old, (4,), 300)
    # P = 8 is kept whole; P = 16 holds no run at this budget (a --quick one), so it goes
    assert lrs == {8: {"full bf16": 2e-3}}
    assert sweep == [run("P8 full bf16 lr=0.002")] and runs == [run("P8 learned 16x")]
    assert study.held_depths(old, (4, 8, 16), 300) == ({}, [], [])
    assert study.held_depths({}, (4,), 300) == ({}, [], [])
