"""The like for like with equal budgets (mesh/bench/like_for_like.py): the same number of tuned
settings for each arm, the pick by the tuning's rule, the decomposition arm at FullSync's batch
and update count at equal tokens, and the report with the arms still to run."""

import json
import math

import pytest

from mesh.bench import like_for_like as lfl
from mesh.bench.simruns import Spec, spec_config
from mesh.config import load_config

# what every report carries besides its runs
_REPORT = {
    "tuning_seeds": [0, 1],
    "evaluation_seeds": [10, 11],
    "microbatches_per_replica": 1600,
    "tune_runs_per_seed": lfl.TUNE_RUNS,
}


def test_both_arms_get_the_same_tuning_budget():
    fs = lfl.fullsync_variants()
    async_ = lfl.async_lr_variants() + lfl.async_stage2_variants({"optim.lr": 3e-3})
    assert len(fs) == len(async_) == lfl.TUNE_RUNS
    assert all(c["optim.name"] == "rotated_adam" for _, _, c in fs + lfl.async_lr_variants())
    assert max(c["optim.lr"] for _, _, c in fs) > 9e-3  # past the earlier range's edge
    stage2 = lfl.async_stage2_variants({**lfl.ROTATED, "optim.lr": 3e-3})
    assert {tuple(sorted(set(c) - {"optim.lr", "optim.name"})) for _, _, c in stage2} == {
        ("dp.tau",),
        ("optim.grad_clip",),
    }
    assert all(c["optim.lr"] == 3e-3 for _, _, c in stage2)


def test_the_pick_is_the_lowest_mean_and_a_diverged_run_never_wins():
    runs = [
        {"method": "a", "seed": 0, "val_loss": 1.0},
        {"method": "a", "seed": 1, "val_loss": 1.2},
        {"method": "b", "seed": 0, "val_loss": 0.9},
        {"method": "b", "seed": 1, "val_loss": 1.2},
        {"method": "c", "seed": 0, "val_loss": 0.1, "diverged": True},
        {"method": "c", "seed": 1, "val_loss": 0.1},
    ]
    assert lfl.best_of(runs, ["a", "b", "c"]) == "b"
    assert lfl.best_of(runs, ["a", "d"]) == "a"  # a setting without runs never wins
    assert lfl._score([]) == math.inf


def test_the_decomposition_arm_reads_fullsyncs_batch_at_equal_tokens():
    base = load_config([], [])
    name, method, ov = lfl.batch_variant({"optim.lr": 3e-3}, base.pipeline.microbatch_size)
    spec = lfl._batched(Spec("like_for_like", name, 10, 1, tuple(ov.items())))
    batched = spec_config(base, spec, 1600)
    plain = spec_config(base, Spec("like_for_like", "x", 10, 1, (("optim.lr", 3e-3),)), 1600)
    assert batched.pipeline.microbatch_size == 4 * plain.pipeline.microbatch_size
    assert batched.run.steps * 4 == plain.run.steps  # FullSync's 400 updates
    tokens = lambda c: c.run.steps * c.tokens_per_microbatch  # noqa: E731
    assert tokens(batched) == tokens(plain)


def test_the_report_marks_arms_not_run_yet():
    summary = {
        **_REPORT,
        "tuning_runs": [{"method": "FullSync rotated_adam lr 0.009", "seed": 0, "val_loss": 1.5}],
        "evaluation": {
            "FullSync rotated_adam": {"10": 1.5, "11": 1.4},
            "AsyncMesh-fp8 rotated_adam": {"10": 1.65, "11": 1.54},
            "AsyncMesh-fp8 rotated_adam, microbatch x4": {},
        },
    }
    text = lfl.table(summary)
    assert "not run" in text and "+10.0" in text
    with pytest.raises(StopIteration):
        lfl._change([], "missing")


def test_a_fullsync_variant_reads_the_studys_tokens_not_four_times_them():
    from pathlib import Path

    from mesh.bench.convergence import _dp_spec, study_variants

    base = load_config([], [])
    _, specs, budget = study_variants(
        Path("results/convergence"), lfl.LABEL, lfl.fullsync_variants()[:1], [0]
    )
    variant = spec_config(base, specs[0], budget[lfl.LABEL])
    study = spec_config(base, _dp_spec("FullSync", 0), budget[lfl.LABEL])
    # FullSync takes 4 microbatches an update: as many updates as the study's own FullSync
    assert variant.run.steps == study.run.steps == budget[lfl.LABEL] // 4


def test_the_report_says_the_scale_and_where_the_reference_sits_against_the_bigram():
    from mesh.bench.regime import rule_fields

    summary = {
        **_REPORT,
        "tuning_runs": [],
        "evaluation": {"FullSync rotated_adam": {"10": 1.5, "11": 1.4}},
        "params": 396_352,
        "tokens_per_replica": 1_638_400,
    }
    entry = {
        "unigram": {"nats_per_token": 3.3, "bits_per_byte": 4.8},
        "bigram": {"nats_per_token": 2.5, "bits_per_byte": 3.6},
    }
    fields = rule_fields("like_for_like", summary, entry)
    assert fields["reference_val_loss"] == {"FullSync rotated_adam": 1.45}
    assert fields["reference_to_bigram_ratio"] == pytest.approx(1.45 / 2.5, abs=1e-3)
    summary.update(fields)
    text = lfl.table(summary)
    assert "0.40M parameters, 1.64M tokens a replica" in text
    assert "Passes the rule" in text


def test_the_report_names_the_picks_and_a_pick_on_its_grids_edge(tmp_path):
    summary = {
        **_REPORT,
        "tuning_runs": [],
        "evaluation": {},
        "chosen": {
            "FullSync": {"optim.name": "rotated_adam", "optim.lr": max(lfl.FULLSYNC_LRS)},
            "AsyncMesh-fp8": {"optim.name": "rotated_adam", "optim.lr": 3e-3, "dp.tau": 5},
        },
    }
    text = lfl.table(summary)
    assert "AsyncMesh-fp8: optim.name rotated_adam, optim.lr 0.003, dp.tau 5" in text
    assert "FullSync's pick sits on its grid's edge" in text
    summary["chosen"]["FullSync"]["optim.lr"] = 9e-3
    assert "edge" not in lfl.table(summary)


def test_a_clean_checkout_reports_the_like_for_like_from_its_committed_report(tmp_path):
    # runs.partial.jsonl is not committed: the report's own runs must be what a re-run reuses
    import shutil
    from pathlib import Path

    study = Path(__file__).resolve().parents[2] / "results" / "convergence"
    for name in ("summary.json", "tuning.json", "like_for_like.json"):
        shutil.copy(study / name, tmp_path / name)
    committed = json.loads((study / "like_for_like.json").read_text())
    got = lfl.run_like_for_like(load_config([], []), tmp_path, 1, report_only=True)
    assert got["chosen"] == committed["chosen"]
    ev = {k: {str(s): v for s, v in d.items()} for k, d in got["evaluation"].items()}
    assert {k: ev[k] for k in committed["evaluation"]} == committed["evaluation"]
    assert all(ev[k] == {} for k in set(ev) - set(committed["evaluation"]))  # not run yet
    assert not (tmp_path / "like_for_like" / "runs.partial.jsonl").exists()  # nothing ran


def test_the_decomposition_arm_is_tuned_at_its_own_batch_and_reported_beside_the_untuned():
    """Its lr over BATCH_LRS (up to FullSync's pick at that batch), the async arm's tau kept;
    its pick named, and a pick on the grid's edge said."""
    base = load_config([], [])
    change = {**lfl.ROTATED, "optim.lr": 3e-3, "dp.tau": 5}
    variants = lfl.batch_lr_variants(change, base.pipeline.microbatch_size)
    assert [c["optim.lr"] for _, _, c in variants] == list(lfl.BATCH_LRS)
    assert max(lfl.BATCH_LRS) >= max(lfl.FULLSYNC_LRS)
    assert all(c["dp.tau"] == 5 and "microbatch x4" in n for n, _, c in variants)
    mb = {c["pipeline.microbatch_size"] for _, _, c in variants}
    assert mb == {lfl.BATCH_FACTOR * base.pipeline.microbatch_size}
    summary = {
        **_REPORT,
        "tuning_runs": [],
        "evaluation": {"FullSync rotated_adam": {"10": 1.5, "11": 1.4}},
        "chosen": {lfl.BATCH_ARM: {"optim.lr": max(lfl.BATCH_LRS)}},
    }
    text = lfl.table(summary)
    assert f"{lfl.BATCH_ARM}: optim.lr 0.024" in text and f"{lfl.BATCH_ARM}'s pick sits" in text
