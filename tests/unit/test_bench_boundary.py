"""The boundary study's arms, rows and frontier (synthetic runs: the machinery, not the claim)."""

import json

import pytest

from mesh.bench import boundary as study
from mesh.bench import boundary_report as report
from mesh.bench.regime import rule_fields
from mesh.bench.simruns import spec_config
from mesh.config import load_config


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return load_config([], [*study.STUDY_DEFAULTS, "data.path=null"])


def test_arms_are_the_baselines_and_each_method_at_each_ratio(base):
    arms = dict(study.arms(base, 4))
    assert list(arms)[:3] == [study.REFERENCE, "full fp8", "FullSync"]
    assert len(arms) == 3 + 5 + 2  # learned 8-32x, subspace 8-16x, learned int4 32x and 64x
    for method, ratios in study.FP8_RATIOS.items():
        for ratio in ratios:
            ov = arms[f"{method} {ratio}x"]
            assert ov["sentinel.enabled"] is False  # a defence's drops are no boundary's cost
            assert ov["pipeline.boundary"] == method and ov["grid.stages"] == 4
            cfg = spec_config(base, study._spec(f"{method} {ratio}x", ov, 0, 1e-3), 300)
            assert cfg.pipeline.boundary_rank == ov["pipeline.boundary_rank"] <= 64
            assert (cfg.grid.replicas, cfg.run.steps, cfg.optim.lr) == (1, 300, 1e-3)
    # 4-bit coordinates: learned boundaries at 32x and 64x, about twice fp8's rank at a ratio
    for ratio in study.INT4_STUDY_RATIOS:
        ov = arms[f"learned {ratio}x int4"]
        assert ov["pipeline.codec"] == "int4_hadamard" and ov["pipeline.boundary"] == "learned"
    assert arms["learned 32x int4"]["pipeline.boundary_rank"] == 7  # fp8's 16x rank
    assert arms["learned 16x"]["pipeline.boundary_rank"] == 7
    sync = spec_config(base, study._spec("FullSync", arms["FullSync"], 0, 2e-3), 300)
    assert (sync.pipeline.schedule, sync.run.steps) == ("gpipe", 75)  # equal tokens: 4 a step
    # the wider study: the same arms, ranks three times as wide
    wide = load_config([], [*study.STUDY_DEFAULTS, *study.WIDTHS[192]])
    assert dict(study.arms(wide, 4))["learned 16x"]["pipeline.boundary_rank"] == 23


def test_the_shipped_optimizer_gives_each_arm_what_its_depth_ships(base):
    """--optimizer shipped: the async arms resolve to the depth rule's settings (P = 8: Muon at
    momentum 0.9, its matrices at 0.01, the lr the rest's), FullSync to Muon with its matrices
    at 10x its lr; --arms keeps the baselines; a study of the other optimizer is refused."""
    arms = dict(study.arms(base, 8, "shipped"))
    ref = spec_config(base, study._spec(study.REFERENCE, arms[study.REFERENCE], 0, 1e-3), 300)
    learned = spec_config(base, study._spec("learned 8x", arms["learned 8x"], 0, 1e-3), 300)
    for cfg in (ref.effective(), learned.effective()):
        o = cfg.optim
        assert (o.name, o.muon_lr, o.muon_momentum, o.lr) == ("muon", 1e-2, 0.9, 1e-3)
    assert learned.pipeline.boundary == "learned"
    sync = spec_config(base, study._spec("FullSync", arms["FullSync"], 0, 4e-3), 300).effective()
    assert (sync.optim.name, sync.optim.muon_lr, sync.pipeline.schedule) == ("muon", 4e-2, "gpipe")
    # the default study is untouched: NAdamW as its cached runs were made
    plain = dict(study.arms(base, 8))[study.REFERENCE]
    assert (
        spec_config(base, study._spec(study.REFERENCE, plain, 0, 1e-3), 300).effective().optim.name
        == "nadamw"
    )
    specs = study.build_specs(
        base,
        8,
        [0, 1],
        {study.REFERENCE: 1e-3, "FullSync": 4e-3},
        optimizer="shipped",
        only=("learned 16x",),
    )
    assert {s.method for s in specs} == {"P8 full bf16", "P8 FullSync", "P8 learned 16x"}
    assert study.lr_grid(8, width=192, optimizer="shipped")[study.REFERENCE] == (1e-3,)
    with pytest.raises(ValueError):
        study.arms(base, 8, "adam")


def test_a_study_of_one_optimizer_is_not_resumed_as_the_other(base, tmp_path):
    from mesh.config_sections import ConfigError

    (tmp_path / "summary.json").write_text(json.dumps({"optimizer": "nadamw", "runs": []}))
    with pytest.raises(ConfigError, match="give this one its own --out"):
        study.run_boundary(base, tmp_path, True, 1, optimizer="shipped", report_only=True)


def test_rows_pair_the_gap_by_seed_and_the_frontier_is_the_most_compressed_within_1pct(base):
    runs = []
    for seed, ref in ((0, 6.0), (1, 5.0)):
        for arm, _ in study.arms(base, 4):
            gap = {"learned 16x": 0.005, "learned 32x": 0.02}.get(arm, 0.0)
            runs.append(
                {
                    "method": f"P4 {arm}",
                    "seed": seed,
                    "val_loss": ref * (1 + gap),
                    "val_bpb": 2.0,
                    "diverged": False,
                }
            )
    rows = {r["arm"]: r for r in study.summarize_rows(base, runs, 4)}
    assert rows[study.REFERENCE]["loss_gap"] == 0 and rows[study.REFERENCE]["compression"] == 1
    assert rows["learned 16x"]["loss_gap"] == pytest.approx(0.005)
    assert rows["learned 16x"]["compression"] >= 16 and rows["learned 16x"]["seeds"] == [0, 1]
    best = study.frontier(list(rows.values()))
    assert best[4]["arm"] == "learned 64x int4"  # gap 0 in this synthetic set, 80x
    for r in rows.values():
        if r["method"] == "subspace" or "int4" in r["arm"]:
            r["loss_gap"] = 0.5
    assert study.frontier(list(rows.values()))[4]["arm"] == "learned 16x"
    rows["learned 32x int4"]["loss_gap"] = 0.004
    assert study.frontier(list(rows.values()))[4]["arm"] == "learned 32x int4"


def test_a_rerun_reuses_the_runs_its_summary_holds(base, tmp_path):
    assert study.earlier_runs(tmp_path) == []
    sweep, runs = [{"method": "P4 full bf16 lr=0.004"}], [{"method": "P4 learned 16x"}]
    (tmp_path / "summary.json").write_text(json.dumps({"lr_sweep": sweep, "runs": runs}))
    assert study.earlier_runs(tmp_path) == sweep + runs


def _summary(base, ref_loss: float) -> dict:
    runs = [
        {"method": f"P4 {a}", "seed": 0, "val_loss": ref_loss, "val_bpb": 2.0, "diverged": False}
        for a, _ in study.arms(base, 4)
    ]
    rows = study.summarize_rows(base, runs, 4)
    return {
        "model": {"arch": "llama", "d_model": 64, "n_layers": 8, "vocab_size": 256, "seq_len": 128},
        "params": 420_000,
        "data": "x",
        "tokens_per_run": 1,
        "seeds": [0],
        "tune_seed": 100,
        "lrs": {},
        "anchor_rank": 16,
        "rows": rows,
        "best_within_1pct": {"4": None},
    }


# the data's reference points (as a manifest carries them): bigram 2.5 nats/token
ENTRY = {
    "unigram": {"nats_per_token": 3.3, "bits_per_byte": 4.8},
    "bigram": {"nats_per_token": 2.5, "bits_per_byte": 3.6},
}


def test_outputs_are_written(base, tmp_path):
    summary = _summary(base, 2.0)
    summary.update(rule_fields("boundary", summary, ENTRY))
    report.write_outputs(summary, tmp_path)
    text = (tmp_path / "table.md").read_text()
    assert "learned 16x" in text and "0.42M parameters" in text
    assert (tmp_path / "tradeoff.png").stat().st_size > 10_000


@pytest.mark.parametrize("ref_loss, early", [(2.0, False), (2.125, False), (2.2, True)])
def test_a_study_whose_reference_has_not_learned_says_so_in_its_report(
    base, tmp_path, ref_loss, early
):
    summary = _summary(base, ref_loss)
    summary.update(rule_fields("boundary", summary, ENTRY))
    assert summary["reference_to_bigram_ratio"] == pytest.approx(ref_loss / 2.5)
    assert summary["regime"] == ("early-training regime" if early else "passes the rule")
    report.write_outputs(summary, tmp_path)
    text = (tmp_path / "table.md").read_text()
    assert ("early-training regime" in text) is early
    assert "bigram 2.500 nats/token" in text
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["reference_to_bigram_ratio"] == summary["reference_to_bigram_ratio"]


def test_a_run_of_some_depths_keeps_the_others_rows():
    def run(label, mbs=300):
        return {"method": label, "microbatches": mbs}

    old = {
        "lrs": {"4": {"full bf16": 4e-3}, "8": {"full bf16": 2e-3}, "16": {"full bf16": 1e-3}},
        "lr_sweep": [run("P4 full bf16 lr=0.004"), run("P8 full bf16 lr=0.002")],
        "runs": [
            run("P4 learned 16x"),
            run("P8 learned 16x"),
            run("P8 full bf16", mbs=24),
            run("P16 full bf16", mbs=24),
        ],
    }
    lrs, sweep, runs = study.held_depths(old, (4,), 300)
    # P = 8 is kept whole; P = 16 holds no run at this budget (a --quick one), so it goes
    assert lrs == {8: {"full bf16": 2e-3}}
    assert sweep == [run("P8 full bf16 lr=0.002")] and runs == [run("P8 learned 16x")]
    assert study.held_depths(old, (4, 8, 16), 300) == ({}, [], [])
    assert study.held_depths({}, (4,), 300) == ({}, [], [])


def test_the_arms_the_frontier_turns_on_run_first_each_on_every_seed(base):
    lrs = {"full bf16": 4e-3, "FullSync": 8e-3}
    specs = study.build_specs(base, 4, [0, 1], lrs)
    order = [s.method for s in specs if s.seed == 0]
    assert order[:3] == ["P4 full bf16", "P4 learned 16x", "P4 learned 8x"]
    assert sorted(order) == sorted(f"P4 {a}" for a, _ in study.arms(base, 4))
    assert [s.seed for s in specs] == [0, 1] * 10  # arm by arm: a stopped study has whole rows
    async_, fullsync = (
        study.build_specs(base, 4, [0, 1], lrs, part) for part in ("async", "FullSync")
    )
    assert [s.method for s in fullsync] == ["P4 FullSync"] * 2
    assert async_ + fullsync == specs
    assert all(dict(s.overrides)["optim.lr"] == 4e-3 for s in async_)


def test_lr_grid_widens_downward_only_where_the_best_sat_on_its_edge():
    for p in (4, 8):  # both depths' bests sat on the low edge: each keeps its runs, tries lower
        for arm, lrs in study.lr_grid(p).items():
            assert list(lrs) == sorted(lrs) and set(study.LR_GRID[arm]) < set(lrs)
            assert min(lrs) <= min(study.LR_GRID[arm]) / 2
    assert study.lr_grid(8, quick=True) == study.QUICK_LRS
    # d 192 has its own grid, reaching below d 64's, at every depth; at P = 8 FullSync's
    # leaves out its top lr (what P = 4 found far past its best)
    for p in (4, 8):
        wide = study.lr_grid(p, width=192)
        assert wide["full bf16"] == study.LR_GRID_WIDTH[192]["full bf16"]
        assert all(min(wide[a]) < min(study.LR_GRID[a]) for a in wide)
    assert study.lr_grid(4, width=192)["FullSync"] == study.LR_GRID_WIDTH[192]["FullSync"]
    assert study.lr_grid(8, width=192)["FullSync"] == study.LR_GRID_WIDTH[192]["FullSync"][:-1]


def test_a_report_of_one_depth_keeps_the_other_depths_rows_and_grid(tmp_path):
    """--stages 4 over an --out whose summary also holds P = 8: P = 8's rows, lrs and the grid
    its sweep ran stay in the summary beside P = 4's (nothing runs: report_only)."""
    base = load_config([], study.STUDY_DEFAULTS)  # the default corpus: the rule's bigram
    mbs = study.MICROBATCHES
    runs = [
        {
            "method": f"P8 {arm}",
            "seed": seed,
            "val_loss": 2.0 + 0.01 * i,
            "val_bpb": 2.9,
            "diverged": False,
            "microbatches": mbs,
            "wall_s": 1.0,
        }
        for i, (arm, _) in enumerate(study.arms(base, 8))
        for seed in (0, 1)
    ]
    old = {
        "lrs": {"8": {study.REFERENCE: 2e-3, "FullSync": 8e-3}},
        "lr_grid": {"8": {study.REFERENCE: [1e-3, 2e-3], "FullSync": [8e-3]}},
        "lr_sweep": [],
        "runs": runs,
    }
    (tmp_path / "summary.json").write_text(json.dumps(old))
    summary = study.run_boundary(base, tmp_path, False, 1, stages=(4,), report_only=True)
    assert summary["lrs"] == {"8": old["lrs"]["8"]}
    assert summary["lr_grid"] == {"8": old["lr_grid"]["8"]}
    assert {r["P"] for r in summary["rows"]} == {8} and summary["runs"] == runs
