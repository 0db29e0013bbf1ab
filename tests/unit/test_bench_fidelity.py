"""The tuning and fidelity studies' machinery (tiny models and budgets: the bookkeeping, the
selection rule and the reports, not the claims)."""

import json
import math

import pytest

from mesh.bench import fidelity, simruns, tuning
from mesh.bench.simruns import spec_config
from mesh.config import load_config

SMALL = [
    "model.n_layers=4",
    "model.d_model=16",
    "model.n_heads=2",
    "model.seq_len=16",
    "pipeline.microbatch_size=2",
    "data.val_batches=1",
]


def test_study_runs_use_the_papers_settings_as_shares_of_the_run():
    base = load_config([], [])
    cfg = spec_config(base, fidelity.build_specs("precision", [0], tuning.DEFAULT_TUNED)[0], 1600)
    assert cfg.optim.warmup_steps == 160  # 10%, as the paper's 3k of 30k
    assert cfg.optim.momentum_decay == "auto"
    assert cfg.dp.lambda_clock == "arrivals"


def test_async_methods_share_the_tuned_setting_but_keep_what_they_pin():
    tuned = {"FullSync": {"optim.lr": 3e-3}, "AsyncMesh-fp8": {"optim.lr": 1.5e-3, "dp.tau": 2}}
    assert tuning.method_overrides("FullSync", tuned)["optim.lr"] == 3e-3
    am = tuning.method_overrides("AsyncMesh", tuned)
    assert (am["optim.lr"], am["dp.tau"], am["dp.codec"]) == (1.5e-3, 2, "fp32")
    sparta = tuning.method_overrides("SPARTA", tuned)
    assert (sparta["optim.lr"], sparta["dp.tau"]) == (1.5e-3, 0)  # blocking stays blocking


def test_the_rule_picks_the_lowest_mean_and_a_divergence_loses():
    def run(name, seed, loss, settings):
        return {
            "method": name,
            "seed": seed,
            "val_loss": loss,
            "settings": settings,
            "diverged": loss is None,
        }

    runs = [
        run("A | lr=1", 0, 2.0, {"optim.lr": 1}),
        run("A | lr=1", 1, 2.2, {"optim.lr": 1}),
        run("A | lr=2", 0, 1.0, {"optim.lr": 2}),
        run("A | lr=2", 1, None, {"optim.lr": 2}),
        run("A | lr=3", 0, 2.1, {"optim.lr": 3}),
        run("A | lr=3", 1, 2.0, {"optim.lr": 3}),
    ]
    settings, loss = tuning.best_settings(runs, "A")
    assert settings == {"optim.lr": 3} and loss == pytest.approx(2.05)
    # on one seed alone, lr=2 wins; a setting not run on every seed asked for is not ranked
    assert tuning.best_settings(runs, "A", [0]) == ({"optim.lr": 2}, 1.0)
    runs.append(run("A | lr=4", 0, 0.5, {"optim.lr": 4}))
    assert tuning.ranked(runs, "A", [0, 1]) == ["A | lr=3", "A | lr=1", "A | lr=2"]
    assert tuning.ranked(runs, "A", [0])[0] == "A | lr=4"


def test_an_lr_at_the_edge_of_those_tried_steps_on_and_an_inner_one_does_not():
    def run(lr, loss, **other):
        st = {"optim.lr": lr, **other}
        return {
            "method": f"A | {st}",
            "seed": 0,
            "val_loss": loss,
            "settings": st,
            "diverged": False,
        }

    runs = [run(1e-3, 2.3), run(2e-3, 2.2, b=1), run(3e-3, 2.1, b=1), run(9e-3, 2.5)]
    # the best (3e-3 at b=1) is the largest lr tried at b=1 (9e-3 was at other settings)
    assert tuning._edge_step(runs, "A", [0]) == {"optim.lr": 0.0045, "b": 1}
    runs.append(run(4.5e-3, 2.15, b=1))
    assert tuning._edge_step(runs, "A", [0]) is None  # now inside: 2e-3 < 3e-3 < 4.5e-3
    runs.append(run(1e-3, 2.0, b=1))  # the smallest at b=1 wins: step down
    assert tuning._edge_step(runs, "A", [0]) == {"optim.lr": 0.00075, "b": 1}


@pytest.mark.slow
def test_tuning_runs_both_stages_and_the_study_reads_its_choice(text_file, tmp_path, monkeypatch):
    # the study's own lists give both arms the same budget
    assert len(tuning.FULLSYNC_LRS) == len(tuning.ASYNC_LRS) + len(tuning.ASYNC_STAGE2)
    assert len({len(b) for b in tuning.MOMENTUM_PROBE.values()}) == 1
    # the study's stages with fewer settings, to keep the test short
    monkeypatch.setattr(tuning, "FULLSYNC_LRS", [3e-3, 6e-3, 1e-2])
    monkeypatch.setattr(tuning, "ASYNC_STAGE2", [{"dp.tau": 2}])
    monkeypatch.setattr(tuning, "SCHEDULE_PROBE", [{"dp.lambda_clock": "steps"}])
    monkeypatch.setattr(tuning, "MOMENTUM_PROBE", {"FullSync": [0.8], "AsyncMesh-fp8": [0.9]})
    monkeypatch.setattr(tuning, "LR_REFINE", [0.75])
    staleness = [{"optim.delay_lr_share": 0.5, "lr_factor": 1.5}]
    monkeypatch.setattr(tuning, "STALENESS_PROBE", staleness)
    monkeypatch.setattr(tuning, "CONFIRM_TOP", 2)
    monkeypatch.setattr(simruns, "QUICK_MICROBATCHES", 64)
    monkeypatch.setattr(tuning, "EDGE_STEPS", 0)  # test_an_lr_at_the_edge_of_those_tried...
    base = load_config([], [f"data.path='{text_file}'", *SMALL])
    summary = tuning.run_tuning(base, tmp_path, quick=True, workers=2)
    groups = {r["method"] for r in summary["runs"]}
    per_arm = {arm: sum(g.startswith(arm + " |") for g in groups) for arm in tuning.ARMS}
    # lrs, momentum, lr refined; the async arm also tau, the schedule probe and staleness
    assert per_arm == {"FullSync": 3 + 1 + 1, "AsyncMesh-fp8": 2 + 1 + 1 + 1 + 1 + 1}
    # the staleness stage: the lr correction at x1.5 the lr of the async arm's best before it
    corrected = [r for r in summary["runs"] if "optim.delay_lr_share" in r["settings"]]
    assert corrected and all(r["settings"]["optim.delay_lr_share"] == 0.5 for r in corrected)
    before = [
        r
        for r in summary["runs"]
        if r["method"].startswith("AsyncMesh-fp8 |")
        and r not in corrected
        and r["seed"] in tuning.TUNE_SEEDS
    ]
    so_far = min(before, key=lambda r: r["val_loss"])["settings"]
    expected = {
        **so_far,
        "optim.delay_lr_share": 0.5,
        "optim.lr": round(so_far["optim.lr"] * 1.5, 6),
    }
    assert corrected[0]["settings"] == expected
    # every setting on the tuning seeds; each arm's best two on the confirmation seed too, and
    # the pick is one of those, by its mean over all seeds
    seeds = len(tuning.TUNE_SEEDS)
    runs_of = {g: [r for r in summary["runs"] if r["method"] == g] for g in groups}
    confirmed = {g for g, rs in runs_of.items() if len(rs) == seeds + len(tuning.CONFIRM_SEEDS)}
    assert all(len(rs) == seeds for g, rs in runs_of.items() if g not in confirmed)
    for arm in tuning.ARMS:
        assert sum(g.startswith(arm + " |") for g in confirmed) == 2
        best = summary["best"][arm]
        pick = min(
            (g for g in confirmed if g.startswith(arm + " |")),
            key=lambda g: tuning.mean_loss(runs_of[g]),
        )
        assert best["settings"] == runs_of[pick][0]["settings"]
        assert best["val_loss"] == pytest.approx(tuning.mean_loss(runs_of[pick]))
    best_lr = summary["best"]["AsyncMesh-fp8"]["settings"]["optim.lr"]
    lr_only = [r for r in summary["runs"] if r["method"].startswith("AsyncMesh-fp8 | lr=")]
    stage1_lr = min(lr_only, key=lambda r: r["val_loss"])["settings"]["optim.lr"]
    # stage 2 builds on stage 1's best lr
    assert any(r["settings"] == {"optim.lr": stage1_lr, "dp.tau": 2} for r in summary["runs"])
    # the momentum stage builds on each arm's best of the stages before it
    beta = [r for r in summary["runs"] if "optim.beta1" in r["settings"]]
    assert {r["settings"]["optim.beta1"] for r in beta} >= {0.8, 0.9}
    assert all(0.0 <= r["clip_rate"] <= 1.0 for r in summary["runs"])
    table = (tmp_path / "tuning.md").read_text()
    assert "clip rate" in table and "Best: FullSync" in table
    # a --quick tuning is not a choice a study may use
    assert tuning.load_tuned(tmp_path / "tuning.json") == (tuning.DEFAULT_TUNED, False)
    full = json.loads((tmp_path / "tuning.json").read_text()) | {"quick": False}
    (tmp_path / "tuning.json").write_text(json.dumps(full))
    tuned, is_tuned = tuning.load_tuned(tmp_path / "tuning.json")
    assert is_tuned and tuned["AsyncMesh-fp8"]["optim.lr"] == best_lr


@pytest.mark.slow
def test_precision_study_writes_its_tables(text_file, tmp_path, monkeypatch):
    monkeypatch.setattr(simruns, "QUICK_MICROBATCHES", 64)  # the tables' shape, not their numbers
    base = load_config([], [f"data.path='{text_file}'", *SMALL])
    summary = fidelity.run_fidelity(base, "precision", tmp_path, quick=True, workers=2)
    assert {r["method"] for r in summary["runs"]} == {r for r, _, _ in fidelity.PRECISION_ROWS}
    assert all(math.isfinite(r["val_loss"]) for r in summary["runs"] if not r["diverged"])
    table = (tmp_path / "table.md").read_text()
    assert "gap to DPAvg fp32" in table and "fp8's noise only" in table
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert not (tmp_path / "runs.partial.jsonl").exists()


def test_horizon_and_scaling_specs():
    h = fidelity.build_specs("horizon", [0], tuning.DEFAULT_TUNED)
    assert {s.study for s in h} == {f"h{n}" for n in fidelity.HORIZONS}
    base = load_config([], [])
    grids = set()
    for s in fidelity.build_specs("scaling", [0], tuning.DEFAULT_TUNED):
        cfg = spec_config(base, s, 64)
        grids.add((cfg.grid.stages, cfg.grid.replicas))
        assert cfg.run.steps == 64  # equal microbatches per replica on every grid
    assert grids == set(fidelity.GRIDS)
    with pytest.raises(ValueError, match="unknown study"):
        fidelity.build_specs("nope", [0], tuning.DEFAULT_TUNED)
