"""The convergence study's bookkeeping: specs at equal tokens, tables, targets, plots."""

import json

import pytest

from mesh.bench.convergence import build_specs
from mesh.bench.convergence_table import DP_METHODS, targets, write_outputs
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
        specs = build_specs([seed])  # losses rise in the order of DP_METHODS, then pp
        order = [s for m in DP_METHODS for s in specs if s.method == m]
        for i, s in enumerate(order + [s for s in specs if s.study == "pp"]):
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
        "seeds": {"dp": [0, 1], "pp": [0, 1]},
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
        {
            "study": "dp",
            "method": "FullSync",
            "seed": 0,
            "microbatches": 64,
            "config_fingerprint": fp_am,
        },  # another config's run under FullSync's name
        {
            "study": "dp",
            "method": "AsyncMesh",
            "seed": 0,
            "microbatches": 32,
            "config_fingerprint": fp_am,
        },  # another budget
        {
            "study": "dp",
            "method": "AsyncMesh",
            "seed": 0,
            "microbatches": 64,
            "config_fingerprint": fp_am,
        },
    ]
    partial = tmp_path / "runs.partial.jsonl"
    partial.write_text("".join(json.dumps(r) + "\n" for r in rows))
    found = reuse(read_runs(partial), specs, base, {"dp": 64, "pp": 64})
    assert [r for r in found if r is not None] == [rows[2]]


@pytest.mark.slow
def test_a_second_study_stage_keeps_the_first_stages_runs_for_a_resume(text_file, tmp_path):
    """run_specs called twice on one directory (an lr sweep, then the rows at its best): the
    second call's rewrite of runs.partial.jsonl keeps the first call's runs."""
    from mesh.bench.simruns import Spec, run_specs

    base = load_config(
        [],
        [
            f"data.path='{text_file}'",
            "model.n_layers=2",
            "grid.stages=2",
            "model.d_model=16",
            "model.n_heads=2",
            "model.seq_len=16",
            "pipeline.microbatch_size=2",
            "data.val_batches=1",
        ],
    )
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
    assert "-3.00% +- 0.00%" in table and "+5.00% +- 0.00%" in table
    assert "earlier tuning" not in table
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


def test_seeds_options_take_lists_and_ranges_and_refuse_the_rest():
    from cli.options import parse_seeds
    from mesh.config import ConfigError

    assert parse_seeds(None) is None and parse_seeds("") is None
    assert parse_seeds("10-17") == list(range(10, 18))
    assert parse_seeds("3,0,10-12,3") == [0, 3, 10, 11, 12]  # sorted, no repeats
    for bad in ("a", "5-2", "-1", "1,,2", "1-"):
        with pytest.raises(ConfigError, match="--tune-seeds"):
            parse_seeds(bad, "--tune-seeds")


def test_evaluation_seeds_that_tuned_are_refused(tmp_path):
    from mesh.bench.convergence import run_convergence
    from mesh.bench.tuning import check_held_out, tuning_seeds
    from mesh.config import ConfigError

    check_held_out([10, 11], [0, 1])  # disjoint: fine
    with pytest.raises(ConfigError, match=r"seeds 0,1 also tuned"):
        check_held_out([0, 1, 10], [0, 1])
    tuning = {
        "seeds": [0],
        "confirm_seeds": [1],
        "quick": False,
        "runs": [],
        "best": {
            "FullSync": {"settings": {"optim.lr": 9e-3}},
            "AsyncMesh-fp8": {"settings": {"optim.lr": 3e-3}},
        },
    }
    (tmp_path / "tuning.json").write_text(json.dumps(tuning))
    assert tuning_seeds(tmp_path / "tuning.json") == [0, 1]
    # refused before any run starts (no runs.partial.jsonl is written)
    with pytest.raises(ConfigError, match="seed 1 also tuned"):
        run_convergence(load_config(), tmp_path, False, 1, pipeline=False, seeds=[1, 10])
    assert not (tmp_path / "runs.partial.jsonl").exists()
    # a --quick tuning's seeds pick nothing the study uses
    (tmp_path / "tuning.json").write_text(json.dumps(tuning | {"quick": True}))
    assert tuning_seeds(tmp_path / "tuning.json") == []


@pytest.mark.parametrize(
    "args, says",
    [
        (["--seeds", "1,10-12"], "seed 1 also tuned"),
        (["--tune", "--tune-seeds", "10", "--seeds", "10-17"], "seed 10 also tuned"),
        (["--tune", "--confirm-seeds", "12"], "seed 12 also tuned"),  # the default 10-17
        (["--tune-seeds", "5"], "go with --tune"),
        (["--interval", "--seeds", "10"], "--seeds goes with"),
        (["--seeds", "x"], "expected integers"),
    ],
)
def test_bench_convergence_refuses_overlapping_seeds_in_one_line(tmp_path, args, says):
    from click.testing import CliRunner

    from cli.main import main

    tuning = {
        "seeds": [0],
        "confirm_seeds": [1],
        "quick": False,
        "runs": [],
        "best": {
            "FullSync": {"settings": {"optim.lr": 9e-3}},
            "AsyncMesh-fp8": {"settings": {"optim.lr": 3e-3}},
        },
    }
    (tmp_path / "tuning.json").write_text(json.dumps(tuning))
    res = CliRunner().invoke(main, ["bench", "convergence", "--out", str(tmp_path), *args])
    assert res.exit_code == 2, res.output
    assert says in res.output and len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "runs.partial.jsonl").exists()


def test_paired_interval_is_the_t_interval_of_the_per_seed_differences():
    from mesh.bench.report import fmt_interval, paired_interval, t_quantile

    # Student's t quantiles (tables: 12.7062, 4.3027, 2.3646, 2.0423)
    for df, t in ((1, 12.7062), (2, 4.3027), (7, 2.3646), (30, 2.0423)):
        assert t_quantile(0.975, df) == pytest.approx(t, abs=1e-4)
    assert t_quantile(0.025, 7) == pytest.approx(-2.3646, abs=1e-4)
    with pytest.raises(ValueError):
        t_quantile(1.0, 3)
    ref = {0: 2.0, 1: 2.0, 2: 2.0, 3: 2.0, 9: 5.0}
    vals = {0: 3.0, 1: 4.0, 2: 5.0, 3: 6.0, 7: 1.0}  # seeds 7 and 9 are not paired
    iv = paired_interval(vals, ref)
    assert iv.diffs == {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0}
    se = (5 / 3) ** 0.5 / 2  # sample sd of 1..4 over sqrt(4)
    assert (iv.mean, iv.se) == (2.5, pytest.approx(se))
    half = 3.18245 * se  # t(0.975, 3)
    assert (iv.low, iv.high) == (
        pytest.approx(2.5 - half, abs=1e-4),
        pytest.approx(2.5 + half, abs=1e-4),
    )
    rel = paired_interval(vals, ref, relative=True)
    assert rel.mean == pytest.approx(0.5 * 2.5)  # (3/2 - 1 + ... + 6/2 - 1) / 4
    assert fmt_interval(rel, pct=True).startswith("+125.00% +- ")
    one = paired_interval({0: 2.1}, {0: 2.0})
    assert one.mean == pytest.approx(0.1) and fmt_interval(one) == "+0.1000"
    assert paired_interval({0: float("nan")}, {0: 2.0}) is None
    assert paired_interval({1: 2.0}, {0: 2.0}) is None


def test_the_table_gives_the_headline_out_of_sample_first(tmp_path):
    runs = []
    for seed in (10, 11, 12):
        for s in build_specs([seed]):
            loss = {"FullSync": 2.0, "AsyncMesh-fp8": 2.0 * (1 + 0.01 * (seed - 9))}.get(s.method)
            dpb = 1000.0 if s.method == "FullSync" else 10.0
            runs.append(
                {
                    "study": s.study,
                    "method": s.method,
                    "seed": seed,
                    "val_loss": 2.1 if loss is None else loss,
                    "tokens": 100,
                    "dp_bytes_per_replica_step": dpb,
                    "curve": [],
                }
            )
    tuned = {"FullSync": {"optim.lr": 9e-3}, "AsyncMesh-fp8": {"optim.lr": 3e-3}}
    tuning = {
        "seeds": [0],
        "confirm_seeds": [1],
        "quick": False,
        "best": {arm: {"settings": st} for arm, st in tuned.items()},
        "runs": [
            {
                "method": f"{arm} | lr",
                "seed": seed,
                "settings": tuned[arm],
                "val_loss": 2.0 if arm == "FullSync" else 2.002,
            }
            for arm in tuned
            for seed in (0, 1)
        ],
    }
    (tmp_path / "tuning.json").write_text(json.dumps(tuning))
    summary = _summary(runs) | {
        "seeds": {"dp": [10, 11, 12], "pp": [0, 1]},
        "tuned": tuned,
        "tuning_seeds": [0, 1],
    }
    write_outputs(summary, tmp_path)
    table = (tmp_path / "table.md").read_text()
    first = table.split("\n\n")[1]
    assert first.startswith("**Headline: AsyncMesh-fp8 ends +2.00% from FullSync**")
    assert "on seeds 10-12, which no tuning used (the settings were tuned on seeds 0, 1)" in first
    assert "On the tuning seeds themselves (0, 1) the same settings end +0.10%" in first
    assert "| 12   | 2.0000   | 2.0600" in table  # the per-seed rows
    # the per-seed gaps are 1, 2, 3%: mean 2%, t(0.975, 2) x SE = 4.303 x 0.577%
    assert "+2.00% +- 0.58% [-0.48%, +4.48%]" in table
    verdicts = {name: ok for name, _, ok in targets(runs)}
    assert verdicts["AsyncMesh-fp8 within 1% of FullSync"] is False


def test_the_committed_studys_runs_keep_their_configs():
    """Every committed DP run's config is the one the study builds today (same fingerprint), so
    the run cache reuses it; a new default that changes the numbers must not slip past it (the
    pipeline sentinel is a local section, outside the fingerprint: the studies pin it off)."""
    from pathlib import Path

    from mesh.bench.convergence import _dp_spec
    from mesh.bench.tuning import load_tuned

    out = Path(__file__).resolve().parents[2] / "results" / "convergence"
    tuned, is_tuned = load_tuned(out / "tuning.json")
    assert is_tuned
    base = load_config()
    summary = json.loads((out / "summary.json").read_text())
    # the study's runs and those it keeps of methods it has not re-run on its seeds
    runs = [r for r in summary["runs"] if r["study"] == "dp"]
    runs += summary.get("kept", {}).get("runs", [])
    assert runs
    for r in runs:
        cfg = spec_config(base, _dp_spec(r["method"], r["seed"], tuned=tuned), r["microbatches"])
        assert cfg.fingerprint() == r["config_fingerprint"], (r["method"], r["seed"])
        assert cfg.sentinel.enabled is False


def test_a_study_stopped_part_way_reports_what_it_has(tmp_path):
    runs = [r for r in _fake_runs() if r["method"] in ("FullSync", "AsyncMesh-fp8")]
    write_outputs(_summary(runs), tmp_path)
    verdicts = {name: ok for name, _, ok in targets(runs)}
    assert verdicts["AsyncMesh-fp8 within 1% of FullSync"] is False  # 2.05 against 2.00
    assert verdicts["AsyncMesh better than the delta rule"] is None  # no result
    assert "**Headline: AsyncMesh-fp8 ends" in (tmp_path / "table.md").read_text()


def test_a_study_of_some_methods_keeps_the_others_runs_on_their_seeds_and_says_so(tmp_path):
    from mesh.bench.convergence import kept_runs

    def run(method, seed, loss):
        return {
            "study": "dp",
            "method": method,
            "seed": seed,
            "val_loss": loss,
            "tokens": 100,
            "dp_bytes_per_replica_step": 1000.0 if method == "FullSync" else 10.0,
            "curve": [],
        }

    # the previous study: every method on seeds 0-3 (0 and 1 tuned), before the seeds were split
    previous = {
        "tuned": {"FullSync": {}},
        "runs": [
            run(m, seed, 2.0 + 0.01 * k) for k, m in enumerate(DP_METHODS) for seed in range(4)
        ]
        + [{"study": "pp", "method": "P4 async adamw", "seed": 0, "val_loss": 2.5}],
    }
    run_now = ["FullSync", "AsyncMesh-fp8", "AsyncMesh"]
    kept = kept_runs(previous, [10, 11], run_now, [0, 1])
    assert kept["seeds"] == [0, 1, 2, 3] and kept["tuning_seeds"] == [0, 1]
    assert {r["method"] for r in kept["runs"]} == set(DP_METHODS)  # to compare with there
    assert len(kept["runs"]) == 4 * len(DP_METHODS)  # not the pipeline study's
    # a second partial study passes the kept runs on as they were
    again = kept_runs({"kept": kept, "runs": []}, [10, 11], [*run_now, "DeltaRule"], [5])
    assert again["runs"] == kept["runs"]
    assert again["tuning_seeds"] == [0, 1]  # as the kept runs said, not the caller's
    assert kept_runs(previous, [10], DP_METHODS, [0])["runs"] == []  # all run: none kept
    assert kept_runs(None, [10], run_now, [0])["runs"] == []

    # the table: the study's rows on its seeds, the kept ones on theirs, marked in sample
    runs = [
        run(m, seed, 2.0 + 0.02 * (m != "FullSync") + 0.001 * seed)
        for m in run_now
        for seed in (10, 11)
    ]
    summary = _summary(runs) | {"seeds": {"dp": [10, 11], "pp": [0, 1]}, "kept": kept}
    write_outputs(summary, tmp_path)
    table = (tmp_path / "table.md").read_text()
    row = next(ln for ln in table.splitlines() if ln.startswith("| AsyncSPARTA "))
    assert "0-3: tuning seeds 0, 1 among them, in sample" in row and "+0.0300" in row
    row = next(ln for ln in table.splitlines() if ln.startswith("| AsyncMesh "))
    assert "| 10, 11 " in row and "in sample" not in row
    verdicts = {name: (said, ok) for name, said, ok in targets(runs, kept)}
    # AsyncSPARTA was not run on the study's seeds: judged on the kept runs, which it says
    said, ok = verdicts["AsyncSPARTA > AsyncMesh + 0.03 nats"]
    assert "(seeds 0-3, tuning seeds 0, 1 among them, in sample)" in said and ok is False
    said, ok = verdicts["AsyncMesh better than the delta rule"]
    assert "in sample" in said and ok is True  # AsyncMesh 2.04 < DeltaRule 2.06 on seeds 0-3
    # without kept runs such a target has no result (rather than a cross-seed comparison)
    verdicts = {name: ok for name, _, ok in targets(runs)}
    assert verdicts["AsyncSPARTA > AsyncMesh + 0.03 nats"] is None
    assert verdicts["AsyncMesh-fp8 within 1% of FullSync"] is True


@pytest.mark.parametrize(
    "methods, says",
    [
        ("FullSync,AsyncMesh-fp8,Nope", "Nope is not a data-parallel method"),
        ("FullSync,AsyncSPARTA", "add AsyncMesh-fp8"),
    ],
)
def test_bench_convergence_refuses_unknown_or_headless_methods_in_one_line(tmp_path, methods, says):
    from click.testing import CliRunner

    from cli.main import main

    res = CliRunner().invoke(
        main, ["bench", "convergence", "--out", str(tmp_path), "--methods", methods]
    )
    assert res.exit_code == 2, res.output
    assert says in res.output and len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "runs.partial.jsonl").exists()


def test_an_optimizer_candidate_is_also_judged_like_for_like(tmp_path):
    """A candidate measured on the study's seeds is listed with its gap to FullSync's AdamW;
    with like_for_like.json, also with its gap to FullSync on the same optimizer, and only
    when that ran on the study's seeds."""
    runs = _fake_runs()
    summary = _summary(runs)
    am8 = {r["seed"]: r["val_loss"] for r in runs if r["method"] == "AsyncMesh-fp8"}
    better = {s: v - 0.1 for s, v in am8.items()}
    cands = {"candidates": {"rotated_adam": {"change": {}, "tuning": {}, "evaluation": better}}}
    (tmp_path / "candidates.json").write_text(json.dumps(cands))
    write_outputs(summary, tmp_path)
    assert "- rotated_adam: -0.1000 +- 0.0000" in (tmp_path / "table.md").read_text()
    assert "both arms with rotated_adam" not in (tmp_path / "table.md").read_text()
    fs_rotated = {s: v * 1.02 for s, v in better.items()}  # the candidate 1/1.02 - 1 from it
    chosen = {"FullSync": {"optim.lr": 0.006}, "AsyncMesh-fp8": {"optim.lr": 0.003}}
    saved = {
        "chosen": chosen,
        "evaluation": {"FullSync rotated_adam": fs_rotated, "AsyncMesh-fp8 rotated_adam": better},
    }
    (tmp_path / "like_for_like.json").write_text(json.dumps(saved))
    write_outputs(summary, tmp_path)
    table = (tmp_path / "table.md").read_text()
    assert "both arms with rotated_adam, each tuned with the same budget" in table
    assert "'FullSync': 0.006" in table and "AsyncMesh-fp8 ends -1.96% +- 0.00%" in table
    # a result marked withdrawn is said to be, its gap never shown
    (tmp_path / "like_for_like.json").write_text(json.dumps({**saved, "withdrawn": "4x tokens"}))
    write_outputs(summary, tmp_path)
    table = (tmp_path / "table.md").read_text()
    assert "withdrawn, 4x tokens" in table and "-1.96%" not in table
    saved["evaluation"]["FullSync rotated_adam"] = {0: 2.0}  # not the study's seeds
    (tmp_path / "like_for_like.json").write_text(json.dumps(saved))
    write_outputs(summary, tmp_path)
    assert "both arms with rotated_adam" not in (tmp_path / "table.md").read_text()
