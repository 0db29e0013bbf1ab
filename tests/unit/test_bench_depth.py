"""`meshtrain bench depth`: its lr grids, picks and combinations, the settings it says reproduce
an arm, the gap against tokens, and a whole (tiny) study that resumes from its own runs."""

from __future__ import annotations

import json
import math

import pytest

from mesh.bench import depth, depth_arms
from mesh.bench.depth_report import _gap_curve, _long, interpolate
from mesh.bench.simruns import spec_config
from mesh.config import load_config


def test_a_grid_widens_past_the_edge_its_best_sits_on() -> None:
    lrs = (1e-3, 2e-3, 4e-3)
    assert depth.wider(lrs, {1e-3: 2.0, 2e-3: 1.9, 4e-3: 2.1}) is None  # inside
    assert depth.wider(lrs, {1e-3: 1.8, 2e-3: 1.9, 4e-3: 2.1}) == 5e-4
    assert depth.wider(lrs, {1e-3: 2.0, 2e-3: 1.9, 4e-3: 1.8}) == 8e-3
    assert depth.wider(lrs, {1e-3: 2.0, 2e-3: 1.9, 4e-3: math.inf}) is None  # a diverged edge
    assert depth.wider(lrs, {1e-3: 2.0}) is None  # not enough finished to say


def test_levers_combine_unless_they_set_one_key_two_ways() -> None:
    arms = {a.name: a for a in depth_arms.screen_arms(8)}
    assert depth_arms.combine(8, arms["muon"], arms["rotated"]) is None
    both = depth_arms.combine(8, arms["lr correction"], arms["muon"])
    assert both is not None and both.muon
    assert both.at(2e-3)["optim.delay_lr_share"] == 0.5
    assert both.at(2e-3)["optim.name"] == "muon"
    assert both.at(2e-3)["optim.muon_lr"] == pytest.approx(0.02)
    # 2BW updates every M microbatches: it does not combine with a per-microbatch lever
    assert depth_arms.combine(8, arms["2bw muon EF M=8"], arms["lr correction"]) is None


def _screen(losses: dict[str, float]) -> dict[str, dict]:
    return {
        depth.label(8, name): {"arm": name, "P": 8, "best_loss": v, "best_lr": 1e-3}
        for name, v in losses.items()
    }


def test_picks_are_the_two_best_levers_and_their_combination() -> None:
    screen = _screen(
        {"reference": 1.7, "FullSync": 1.5, "muon": 1.55, "rotated": 1.6, "lr correction": 1.65}
    )
    assert [a.name for a in depth.picks(screen)] == ["muon", "rotated"]
    both = depth.combination(screen)  # muon and rotated clash: the next pair
    # named in the screen's order, whichever ranked first: one combination, one name
    assert both is not None and both.name == "lr correction + muon"
    # FullSync at 2BW's M is a baseline, not a lever
    screen = _screen({"FullSync M=8": 1.0, "muon": 1.55, "rotated": 1.6})
    assert [a.name for a in depth.picks(screen)] == ["muon", "rotated"]


class _Sweeps:
    """A study whose sweeps return set losses (each arm's first lr its best)."""

    def __init__(self, losses: dict[str, float]) -> None:
        self.losses, self.swept = losses, []

    def sweep(self, grids, desc):
        self.swept += [a.name for a, _, _ in grids]
        return {
            depth.label(p, a.name): {
                "arm": a.name,
                "P": p,
                "best_lr": lrs[0],
                "best_loss": self.losses.get(a.name),
            }
            for a, p, lrs in grids
        }


def test_a_deep_pipeline_recommends_its_own_best_candidate() -> None:
    arms = {a.name: a for a in depth_arms.screen_arms(8)}
    finals = [arms["lr correction"], arms["reference"], arms["FullSync"]]
    own = {a.name for a in depth_arms.depth_candidates(16)}
    assert "2bw muon EF M=16" in own and "lr correction + muon" in own
    assert depth_arms.depth_candidates(8) == []  # P = 8's candidates are its screen's
    losses = {
        "reference": 2.2,
        "FullSync": 1.8,
        "lr correction": 1.9,
        "FullSync M=16": 1.7,
        "lr correction + muon": 1.85,
        "lr correction + beta1 0.95": 1.88,
    }
    study, tuned = _Sweeps(losses), {}
    best, report = depth.finals_at_depth(study, 16, 8, finals, tuned)
    # FullSync at 2BW's M is a baseline, never recommended; Muon meets FullSync with Muon
    assert best.name == "lr correction + muon"
    assert [a.name for a in report] == [
        "lr correction",
        "reference",
        "FullSync",
        "lr correction + muon",
        "FullSync muon",
    ]
    assert own <= set(study.swept) and depth.label(16, "FullSync muon") in tuned
    # where none of the depth's own beats a pick, the pick stays recommended; at the screen's
    # depth, the screen's best is
    losses["lr correction"] = 1.8
    best, report = depth.finals_at_depth(_Sweeps(losses), 16, 8, finals, {})
    assert best.name == "lr correction" and len(report) == 3
    best, _ = depth.finals_at_depth(_Sweeps(losses), 8, 8, finals, {})
    assert best.name == "lr correction"


class _Ran(_Sweeps):
    """_Sweeps whose report-seed runs are those in `ran` (label -> seeds), and records what
    it was asked to run."""

    def __init__(self, losses: dict[str, float], ran: dict[str, list[int]]) -> None:
        super().__init__(losses)
        self.ran, self.asked = ran, []

    def run(self, specs, desc):
        self.asked += [(s.method, s.seed) for s in specs]

    def get(self, name: str, seed: int):
        return {"val_loss": 1.0} if seed in self.ran.get(name, []) else None


def test_the_recommended_arm_is_the_one_the_depth_rule_ships() -> None:
    M09 = "muon momentum 0.9"  # noqa: N806 - the shipped arm at P = 8
    # each rule of mesh/depth_rule.py is one of the study's arms, its lr aside
    assert depth.shipped_arm(2) is None  # no rule below P = 4: the plain pipeline
    assert depth.shipped_arm(4).name == "muon"
    assert depth.shipped_arm(8).name == "muon momentum 0.9"
    assert depth.shipped_arm(15).name == "muon momentum 0.9"
    assert depth.shipped_arm(16).name == "lr correction + muon momentum 0.9"
    arms = {a.name: a for a in depth_arms.screen_arms(8)}
    # the study picks another arm, whose finals have not run: the shipped arm, with its report
    # seeds, stays `recommended` (and joins the finals' rows where the picks left it out)
    finals = [arms["rotated"], arms["reference"], arms["FullSync"]]
    tuned = {depth.label(8, M09): {"best_lr": 1e-3}}
    study = _Ran({}, {f"P8 {M09}": [0, 1]})
    ship, rows = depth.with_shipped(study, 8, [0, 1], finals, tuned, run=False)
    assert ship.name == M09 and [a.name for a in rows][-1] == M09
    assert study.asked == [] and study.swept == []  # a report runs nothing
    # a seed missing: not yet recommended (the pick stays); run: swept where untuned, then run
    study = _Ran({M09: 1.8}, {f"P8 {M09}": [0]})
    ship, _ = depth.with_shipped(study, 8, [0, 1], finals, {}, run=False)
    assert ship is None
    tuned = {depth.label(8, M09): {"best_lr": 1e-3}}  # tuned at the rule's lr
    ship, _ = depth.with_shipped(study, 8, [0, 1], finals, tuned, run=True)
    assert study.swept == [] and (f"P8 {M09}", 1) in study.asked


def test_an_arm_moves_to_another_depth() -> None:
    arms = {a.name: a for a in depth_arms.screen_arms(8)}
    two_bw = depth.at_depth(arms["2bw muon EF M=8"], 16)
    assert two_bw.overrides["grid.stages"] == 16
    assert two_bw.overrides["pipeline.microbatches"] == 16  # M >= P
    assert two_bw.microbatches_per_update == 16
    assert depth.at_depth(arms["muon"], 4).overrides["grid.stages"] == 4
    assert depth.around(2e-3, (1.0,)) == (1e-3, 2e-3, 4e-3)


def test_the_settings_a_row_names_reproduce_its_run() -> None:
    base = load_config([], depth_arms.STUDY_DEFAULTS)
    for arm in (depth_arms.reference(8), depth_arms.fullsync(8), depth_arms.two_bw(8, 8)):
        sets = depth.settings_of(base, arm, 8, 2e-3, 1600)
        run = spec_config(base, depth.spec(arm, 8, 0, 2e-3, False), 1600)
        again = load_config([], [*sets, "run.seed=0"])
        assert again.fingerprint() == run.fingerprint(), arm.name
        assert "model.n_layers=16" in sets and "grid.stages=8" in sets
        assert not any(s.startswith("run.seed=") for s in sets)


def test_gap_against_tokens_is_read_at_fullsyncs_evaluations() -> None:
    curve = [{"tokens": 0, "val_loss": 3.0}, {"tokens": 100, "val_loss": 2.0}]
    assert interpolate(curve, 50) == pytest.approx(2.5)
    assert interpolate(curve, 100) == 2.0
    assert interpolate(curve, 150) is None

    class Runs:
        runs = {
            "P8 a|0": {"curve": curve},
            "P8 FullSync|0": {"curve": [{"tokens": 50, "val_loss": 2.0}]},
        }

        def get(self, name: str, seed: int):
            return self.runs.get(f"{name}|{seed}")

    assert _gap_curve(Runs(), "P8 a", "P8 FullSync", [0, 1]) == [[50, 25.0]]


def test_the_long_run_meets_fullsync_with_its_optimizer_too() -> None:
    """Muon's long run is held against FullSync (AdamW) and against FullSync with Muon."""
    muon = next(a for a in depth_arms.screen_arms(8) if a.name == "muon")
    arms = [muon, depth_arms.fullsync(8), depth.same_optimizer_fullsync(8, muon, "muon")]
    curve = [{"tokens": 100, "val_loss": 2.0}]

    class Runs:
        runs = {
            "P8 muon|0": {"val_loss": 1.8, "curve": curve},
            "P8 FullSync|0": {"val_loss": 2.0, "curve": curve},
            "P8 FullSync muon|0": {"val_loss": 1.5, "curve": curve},
        }

        def get_long(self, name: str, seed: int):
            return self.runs.get(f"{name}|{seed}")

    long = _long(Runs(), 8, [0, 1], muon, arms)
    assert long["gap_pct"] == pytest.approx(-10.0) and long["seeds"] == [0]
    assert long["FullSync_seeds"] == long["FullSync_same_optimizer_seeds"] == [0]
    assert long["FullSync_same_optimizer"] == 1.5
    assert long["gap_same_optimizer_pct"] == pytest.approx(20.0)
    plain = _long(Runs(), 8, [0], muon, arms[:2])  # an arm that keeps FullSync's optimizer
    assert plain["gap_same_optimizer_pct"] is None
    # a second seed: the gaps are paired by seed, with their interval
    Runs.runs.update(
        {
            "P8 muon|1": {"val_loss": 1.9, "curve": curve},
            "P8 FullSync|1": {"val_loss": 2.0, "curve": curve},
            "P8 FullSync muon|1": {"val_loss": 1.9, "curve": curve},
        }
    )
    two = _long(Runs(), 8, [0, 1, 2], muon, arms)  # the third report seed is not a long one
    assert two["seeds"] == [0, 1] and two["recommended"] == pytest.approx(1.85)
    assert two["gap_pct"] == pytest.approx(-7.5)  # mean of -10% and -5%
    assert two["gap_same_optimizer_pct"] == pytest.approx(10.0)  # mean of +20% and 0%
    assert "[" in two["gap"] and "[" in two["gap_same_optimizer"]
    # a baseline with one long seed: its gap pairs that seed, the others both
    del Runs.runs["P8 FullSync|1"]
    part = _long(Runs(), 8, [0, 1], muon, arms)
    assert part["seeds"] == [0, 1] and part["FullSync_seeds"] == [0]
    assert part["FullSync_same_optimizer_seeds"] == [0, 1]
    assert part["gap_pct"] == pytest.approx(-10.0) and part["gap_same_optimizer_pct"] == 10.0


@pytest.mark.slow
def test_a_tiny_study_runs_every_phase_and_resumes(tmp_path, text_file) -> None:
    """The whole study on a tiny model: the screen widens, the picks and their combination
    run, the finals give each depth a recommended row and the settings that reproduce it; a
    second call runs nothing new."""
    base = load_config(
        [],
        [
            *depth_arms.STUDY_DEFAULTS,
            f"data.path='{text_file}'",
            "model.n_layers=4",
            "model.d_model=16",
            "model.n_heads=2",
            "model.n_kv_heads=1",
            "model.intermediate_size=32",
            "model.seq_len=16",
            "pipeline.microbatch_size=2",
            "data.val_batches=1",
        ],
    )
    out = tmp_path / "depth"
    s = depth.run_depth(base, out, quick=True, workers=2, stages=(2, 4))
    assert s["screen_P"] == 2 and s["recommended_candidate"] in s["picks"]
    assert {r["P"] for r in s["rows"]} == {2, 4}
    rec = [r for r in s["rows"] if r["arm"] == "recommended"]
    assert len(rec) == 2 and all(r["gap_pct"] is not None for r in rec)
    for p in ("2", "4"):
        sets = s["recommended"][p]["set"]
        assert f"grid.stages={p}" in sets and s["fullsync"][p]["set"]
    assert s["complete"] and (out / "table.md").is_file()
    # the long run: the recommended arm and FullSync at 4x the tokens, one seed (quick)
    assert s["long"]["gap_pct"] is not None and s["long"]["seeds"] == [0]
    long_runs = [r for r in s["runs"] if r["study"] == "depth-long"]
    assert {r["microbatches"] for r in long_runs} == {depth.LONG_FACTOR * 24}
    assert "4x the tokens" in (out / "table.md").read_text()
    # a tuned arm's best is inside its grid, or the grid was widened WIDEN times past its edge
    first = {a.name: len(a.lrs) for a in depth_arms.screen_arms(2)}
    for r in s["screen"]:
        if r["arm"] in first and r["inside"] is not None:
            best = f"{r['best_lr']:g}"
            edge = best in (min(r["lrs"], key=float), max(r["lrs"], key=float))
            assert r["inside"] != edge, r
            assert r["inside"] or len(r["lrs"]) == first[r["arm"]] + depth.WIDEN, r
    runs = len(s["runs"])
    again = depth.run_depth(base, out, quick=True, workers=2, stages=(2, 4))
    assert len(again["runs"]) == runs
    assert json.loads((out / "summary.json").read_text())["rows"] == again["rows"]
    # a call for one depth reports that depth and keeps every other run the folder held
    # (quick: the screen runs at the first depth given, here 2 as above)
    one = depth.run_depth(base, out, quick=True, workers=2, stages=(2,))
    assert {r["P"] for r in one["rows"]} == {2}
    assert len(one["runs"]) == runs
    assert not one["complete"]  # one depth of two: not the whole study, whatever it ran
    partial = depth.run_depth(base, out, quick=True, workers=2, stages=(2, 4), phase="long")
    assert not partial["complete"] and partial["rows"] == again["rows"]
    both = depth.run_depth(base, out, quick=True, workers=2, stages=(2, 4), report_only=True)
    assert both["rows"] == again["rows"]


def test_the_width_check_reuses_the_boundary_studys_d192_runs() -> None:
    """d 192 x 8's reference and FullSync at P = 8 are the boundary study's runs (the same
    configs: their fingerprints match the committed summary's), so only the recommended arm
    runs there."""
    base = depth.width_base(load_config([], depth_arms.STUDY_DEFAULTS))
    assert (base.model.d_model, base.model.n_layers, base.model.n_heads) == (192, 8, 6)
    boundary = json.loads(depth.WIDTH_KNOWN.read_text())
    have = {(r["config_fingerprint"], r["seed"]) for r in boundary["runs"]}
    for arm in (depth_arms.reference(8), depth_arms.fullsync(8)):
        lr = depth.WIDTH_TUNED[arm.name]
        for seed in (0, 1):
            cfg = spec_config(base, depth.spec(arm, 8, seed, lr, False), depth.MICROBATCHES)
            assert (cfg.fingerprint(), seed) in have, (arm.name, seed)


def test_an_unknown_lever_is_one_line_and_exit_2(tmp_path) -> None:
    from click.testing import CliRunner

    from cli.main import main

    res = CliRunner().invoke(
        main, ["bench", "depth", "--quick", "--out", str(tmp_path), "--levers", "warp drive"]
    )
    assert res.exit_code == 2, res.output
    assert "--levers: no arm named warp drive" in res.output
    assert len(res.output.strip().splitlines()) == 1


def test_the_finals_run_their_depths_in_the_order_given(tmp_path) -> None:
    from click.testing import CliRunner

    from cli.main import main

    args = ["bench", "depth", "--report-only", "--out", str(tmp_path), "--stages", "16,4"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "summary.json").read_text())["stages"] == [16, 4]


def test_the_recommended_arm_runs_at_the_lr_a_user_gets() -> None:
    """Where the study tuned the shipped arm to another lr than the rule gives (a user's
    default, Muon's matrices at the rule's muon_lr), `recommended` is the arm at the rule's lr,
    named so; tuned at the rule's lr it is the arm itself."""
    M09 = "muon momentum 0.9"  # noqa: N806 - the shipped arm at P = 8
    assert depth.rule_lr(8) == depth.rule_lr(16) == 1e-3  # Muon's matrices at 0.01
    ship = depth.shipped_arm(8)
    assert depth.at_rule_lr(ship, 8, {depth.label(8, M09): {"best_lr": 1e-3}}) is ship
    assert depth.at_rule_lr(ship, 8, {}) is ship  # not tuned yet
    moved = depth.at_rule_lr(ship, 8, {depth.label(8, M09): {"best_lr": 2e-3}})
    assert moved.name == f"{M09} at lr 0.001" and moved.lrs == (1e-3,)
    assert moved.at(1e-3)["optim.muon_lr"] == 0.01 and moved.lever == ship.lever
    # with_shipped: the tuned arm swept first, then the one at the rule's lr, whose report seeds
    # run and which is `recommended`
    arms = {a.name: a for a in depth_arms.screen_arms(8)}
    finals = [arms["reference"], arms["FullSync"]]
    study = _Ran({}, {})
    study.sweep = lambda grids, desc: {  # the arm's tuning put its best at 2e-3
        depth.label(p, a.name): {"best_lr": 2e-3 if a.name == M09 else lrs[0]}
        for a, p, lrs in grids
    }
    tuned: dict = {}
    ship, rows = depth.with_shipped(study, 8, [0, 1], finals, tuned, run=True)
    assert rows[-1].name == f"{M09} at lr 0.001" and depth.label(8, M09) in tuned
    assert tuned[depth.label(8, rows[-1].name)]["best_lr"] == 1e-3
    assert (f"P8 {M09} at lr 0.001", 0) in study.asked
