"""The depth levers' math against hand computations: AsyncPP's adaptive momentum, a cap on
NAdam's mu_t, and each cell of a pipeline getting its own (mesh.algo.optim, mesh.engine.cell)."""

from __future__ import annotations

import pytest
import torch

from mesh.algo.optim import OptimSpec, StageOptimizer
from mesh.algo.optim_schedules import adaptive_beta1, nadam_mu
from mesh.config import ConfigError, load_config
from mesh.config_sections import LATER_KEYS


def test_adaptive_beta1_is_asyncpps_formula() -> None:
    # beta1_j = beta1 + delta_j (0.99 - beta1) / P
    assert adaptive_beta1(0.9, 7, 8) == pytest.approx(0.9 + 7 * 0.09 / 8)  # 0.97875
    assert adaptive_beta1(0.9, 3, 4) == pytest.approx(0.9675)
    assert adaptive_beta1(0.9, 0, 8) == 0.9  # the last stage: fresh gradients
    assert adaptive_beta1(0.95, 15, 16) == pytest.approx(0.95 + 15 * 0.04 / 16)
    assert adaptive_beta1(0.99, 7, 8) == 0.99  # at the top already: kept
    assert adaptive_beta1(0.995, 7, 8) == 0.995  # above it: kept, not lowered
    with pytest.raises(ValueError):
        adaptive_beta1(0.9, -1, 8)


def test_spec_resolves_its_stages_beta1() -> None:
    plain = OptimSpec("nadamw", lr=1e-3, beta1=0.9, delay=3, stages=4)
    assert plain.resolved_beta1() == 0.9
    spec = OptimSpec("nadamw", lr=1e-3, beta1=0.9, delay=3, stages=4, adaptive_momentum=True)
    assert spec.resolved_beta1() == pytest.approx(0.9675)
    # muon's AdamW part and adamw take it too (their default beta1 0.9)
    muon = OptimSpec("muon", lr=1e-3, delay=1, stages=2, adaptive_momentum=True)
    assert muon.resolved_beta1() == pytest.approx(0.9 + 0.09 / 2)


def test_each_cell_of_a_pipeline_gets_its_own_beta1(text_file) -> None:
    from mesh.engine.cell import Cell
    from mesh.model.build import build_stages

    sets = ["model.n_layers=4", "model.d_model=16", "model.n_heads=2", "model.seq_len=16"]
    sets += [f"data.path='{text_file}'", "grid.stages=4", "grid.replicas=1"]
    sets += ["pipeline.schedule=async", "optim.beta1=0.9", "optim.adaptive_momentum=true"]
    sets += ["optim.name=nadamw", "optim.depth_rule=off"]  # NAdamW's own beta1, as given
    cfg = load_config([], sets)
    for j, module in enumerate(build_stages(cfg.model, 4, 0)):
        cell = Cell.build(cfg, j, 0, module)
        delay = 3 - j
        betas = [r.beta1 for r in cell.optimizer.rules.values()]
        assert betas == [pytest.approx(0.9 + delay * 0.09 / 4)] * len(betas), (j, betas)


def test_nadam_mu_cap() -> None:
    assert nadam_mu(1, 0.99, 0.004, cap=0.9) == nadam_mu(1, 0.99, 0.004)  # below the cap
    assert nadam_mu(10_000, 0.99, 1.0, cap=0.9) == 0.9
    assert nadam_mu(10_000, 0.99, 1.0) == pytest.approx(0.99)


def test_nadamw_with_a_mu_cap_matches_a_hand_computation() -> None:
    """Two steps of NAdamW with mu_t capped, written out in floats (one scalar parameter)."""
    lr, b1, b2, eps, wd, psi, cap = 0.1, 0.99, 0.999, 1e-8, 0.01, 50.0, 0.9
    p = torch.nn.Parameter(torch.tensor([1.0]))
    spec = OptimSpec("nadamw", lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd)
    capped = OptimSpec(**{**spec.__dict__, "momentum_decay": psi, "mu_cap": cap, "grad_clip": 0})
    opt = StageOptimizer([("w", p)], capped)
    x, m, v, pi = 1.0, 0.0, 0.0, 1.0
    for t, g in ((1, 0.5), (2, -0.25)):
        p.grad = torch.tensor([g])
        opt.step(1.0)
        mu = min(b1 * (1 - 0.5 * 0.96 ** (t * psi)), cap)
        mu_next = min(b1 * (1 - 0.5 * 0.96 ** ((t + 1) * psi)), cap)
        assert mu == mu_next == cap  # psi 50: the ramp is at beta1 from the first step
        pi *= mu
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        denom = (v / (1 - b2**t)) ** 0.5 + eps
        x = x * (1 - lr * wd)
        x -= lr * (1 - mu) / (1 - pi) * g / denom
        x -= lr * mu_next / (1 - pi * mu_next) * m / denom
        assert p.item() == pytest.approx(x, rel=1e-6), t


def test_the_levers_config_keys_check_their_values() -> None:
    with pytest.raises(ConfigError, match="mu_cap"):
        load_config([], ["optim.mu_cap=1.0"])
    cfg = load_config([], ["optim.mu_cap=0.9", "optim.adaptive_momentum=true"])
    assert cfg.optim.mu_cap == 0.9 and cfg.optim.adaptive_momentum
    # set, they change the run's numbers, so its fingerprint; left at their defaults they stay
    # out of it (LATER_KEYS), so the runs and checkpoints made before them keep theirs
    plain = load_config([], [])
    assert cfg.fingerprint() != plain.fingerprint()
    assert {"mu_cap", "adaptive_momentum"} <= set(LATER_KEYS["optim"])


def test_a_depth_rule_applies_from_its_depth_on_the_async_schedule() -> None:
    from mesh.depth_rule import DepthRule, describe, resolved_settings, rule_for

    rules = (
        DepthRule(8, {"delay_lr_share": 0.5}, "P8"),
        DepthRule(16, {"delay_lr_share": 0.5, "beta1": 0.95}, "P16"),
    )
    assert rule_for(4, "async", rules=rules) is None
    assert rule_for(8, "async", rules=rules).evidence == "P8"
    assert rule_for(12, "async", rules=rules).evidence == "P8"
    assert rule_for(32, "async", rules=rules).evidence == "P16"
    assert rule_for(16, "gpipe", rules=rules) is None  # no staleness to correct
    assert rule_for(16, "2bw", rules=rules) is None
    assert rule_for(16, "async", "muon", rules) is None  # measured with nadamw
    capped = (DepthRule(8, {"delay_lr_share": 0.5}, "P8", max_stages=15),)
    assert rule_for(15, "async", rules=capped) is not None
    assert rule_for(16, "async", rules=capped) is None
    defaults = {"delay_lr_share": 0.0, "beta1": None}
    # keys at their defaults take the rule's values; a key the user set keeps the user's
    got = resolved_settings({"delay_lr_share": 0.0, "beta1": None}, defaults, 16, "async", rules)
    assert got == {"delay_lr_share": 0.5, "beta1": 0.95}
    got = resolved_settings({"delay_lr_share": 0.25, "beta1": None}, defaults, 16, "async", rules)
    assert got == {"beta1": 0.95}
    assert resolved_settings({"delay_lr_share": 0.0}, defaults, 4, "async", rules) == {}
    # the lr only on models as narrow as the rule's lr_width
    lr_rules = (DepthRule(8, {"delay_lr_share": 0.5, "lr": 2e-3}, "P8", lr_width=64),)
    plain = {"delay_lr_share": 0.0, "lr": 1e-3}
    lr_defaults = {"delay_lr_share": 0.0, "lr": 1e-3}
    narrow = resolved_settings(plain, lr_defaults, 8, "async", lr_rules, d_model=64)
    assert narrow == {"delay_lr_share": 0.5, "lr": 2e-3}
    wide = resolved_settings(plain, lr_defaults, 8, "async", lr_rules, d_model=192)
    assert wide == {"delay_lr_share": 0.5}
    line = describe("auto", got, 16, "async", "nadamw", rules)
    assert "optim.beta1 = 0.95" in line and "P16" in line
    assert "nothing changed" in describe("auto", {}, 4, "async", "nadamw", rules)
    assert "off" in describe("off", {}, 16, "async", "nadamw", rules)
    # a flushed schedule says the rules are the async schedule's, and what trains instead
    flushed = describe("auto", {}, 8, "gpipe", "nadamw", rules)
    assert "async schedule only" in flushed and "gpipe" in flushed and "nadamw trains" in flushed


def test_a_config_resolves_its_depth_rule_when_read_not_when_written() -> None:
    cfg = load_config([], ["grid.stages=8", "model.n_layers=8"])
    off = load_config([], ["grid.stages=8", "model.n_layers=8", "optim.depth_rule=off"])
    assert off.effective() is off  # nothing resolves with the rule off
    rule = cfg.depth_rule_settings()
    assert rule, "the shipped rule sets something at P = 8"
    # the resolved config carries the rule's keys; the config itself keeps the defaults
    assert cfg.effective().optim.model_dump() == {**cfg.optim.model_dump(), **rule}
    assert cfg.optim.delay_lr_share == 0.0 and cfg.optim.depth_rule == "auto"
    # a config that spells the rule's keys out trains the same numbers: the same fingerprint
    spelled = load_config(
        [],
        ["grid.stages=8", "model.n_layers=8", "optim.depth_rule=off"]
        + [f"optim.{k}={v}" for k, v in rule.items()],
    )
    assert spelled.fingerprint() == cfg.fingerprint()
    # and a flushed pipeline takes none
    sync = load_config([], ["grid.stages=8", "model.n_layers=8", "pipeline.schedule=gpipe"])
    assert sync.depth_rule_settings() == {}


def test_a_deep_pipelines_cells_start_with_the_rules_settings(text_file) -> None:
    """The shipped rule at work in the cells both engines drive: a 4- or 8-stage async pipeline
    with the defaults is a Muon pipeline (its matrices at 10x the default lr), a 16-stage one
    Muon on the correction; with the rule off, the optimizer as given."""
    from mesh.engine.cell import Cell
    from mesh.model.build import build_stages

    sets = ["model.n_layers=8", "model.d_model=16", "model.n_heads=2", "model.seq_len=16"]
    sets += [f"data.path='{text_file}'", "grid.stages=4", "grid.replicas=1", "run.steps=100"]
    sets += ["optim.warmup_steps=0", "pipeline.schedule=async"]
    auto = load_config([], sets)
    off = load_config([], [*sets, "optim.depth_rule=off"])
    for stages in (4, 8):
        cfg = load_config([], [*sets, f"grid.stages={stages}"])
        # from 8 stages Muon's momentum falls to 0.9 (a stale pipeline wants less of it)
        deeper = {"muon_momentum": 0.9} if stages >= 8 else {}
        assert cfg.depth_rule_settings() == {"name": "muon", "muon_lr": 1e-2, **deeper}
        assert cfg.effective().optim.muon_momentum == (0.9 if stages >= 8 else 0.95)
        assert cfg.effective().optim.lr == 1e-3
        for j, module in enumerate(build_stages(cfg.model, stages, 0)):
            cell = Cell.build(cfg, j, 0, module)
            assert cell.optimizer.spec.muon_lr == 1e-2 and "muon" in cell.optimizer.kinds().values()
            assert cell.lr_scale() == 1.0, j
    plain = Cell.build(off, 0, 0, build_stages(off.model, 4, 0)[0])
    assert "muon" not in plain.optimizer.kinds().values() and plain.optimizer.spec.lr == 1e-3
    # a user's own lr is kept, and so is a model wider than d 64 (the rule names no lr)
    mine = load_config([], [*sets, "optim.lr=3e-3"])
    assert mine.depth_rule_settings() == {"name": "muon", "muon_lr": 1e-2}
    assert mine.effective().optim.lr == 3e-3
    assert auto.depth_rule_settings() == mine.depth_rule_settings()
    assert load_config([], [*sets, "grid.stages=2"]).depth_rule_settings() == {}  # none below 4
    # sixteen: Muon on top of the correction
    deep = load_config([], [*sets, "model.n_layers=16", "grid.stages=16"])
    assert deep.depth_rule_settings() == {
        "delay_lr_share": 0.5,
        "name": "muon",
        "muon_lr": 1e-2,
        "muon_momentum": 0.9,
    }
    assert deep.effective().optim.lr == 1e-3
    for j, module in enumerate(build_stages(deep.model, 16, 0)):
        cell = Cell.build(deep, j, 0, module)
        assert cell.optimizer.spec.muon_lr == 1e-2 and "muon" in cell.optimizer.kinds().values()
        assert cell.lr_scale() == pytest.approx(1 / max(1, 15 - j)), j  # 15 .. 0
    # a model wider than d 64 (where the rule's lrs were measured) keeps its lr
    wide = load_config([], [*sets, "model.d_model=192", "model.n_heads=4"])
    assert wide.depth_rule_settings() == {"name": "muon", "muon_lr": 1e-2}
    assert wide.effective().optim.lr == 1e-3
    # a user's own optimizer is kept, and then no rule applies (each is measured with nadamw)
    adamw = load_config([], [*sets, "model.n_layers=16", "grid.stages=16", "optim.name=adamw"])
    assert adamw.depth_rule_settings() == {}


def test_the_default_at_each_depth_the_study_measured_is_its_recommended_arm() -> None:
    """What a user gets without flags (the depth rule resolving the study's config with the
    rule's keys left out) is the optimizer the study measured as `recommended`, at every depth
    whose report seeds finished (results/depth/summary.json)."""
    import json
    from pathlib import Path

    from mesh.depth_rule import rule_for

    summary = json.loads((Path(__file__).parents[2] / "results/depth/summary.json").read_text())
    checked = []
    for p, rec in summary["recommended"].items():
        row = next(r for r in summary["rows"] if r["P"] == int(p) and r["arm"] == "recommended")
        if row["seeds"] != summary["seeds"]:
            continue  # not measured on the report seeds yet
        rule = rule_for(int(p), "async")
        ruled = {f"optim.{k}" for k in rule.settings} if rule else set()
        measured = load_config([], rec["set"]).effective().optim.model_dump()
        user = [kv for kv in rec["set"] if kv.split("=")[0] not in ruled | {"optim.depth_rule"}]
        default = load_config([], user).effective().optim.model_dump()
        for got in (measured, default):
            got.pop("depth_rule")
        assert default == measured, (p, rec["candidate"])
        checked.append(int(p))
    assert 8 in checked


def test_the_depth_rule_gives_the_convergence_headlines_async_arm_muon() -> None:
    """The headline's grid is 4 x 2, where the P = 4 rule applies: FullSync (flushed) takes
    nothing; AsyncMesh-fp8 as tuned (an lr and the correction of its own,
    results/convergence/tuning.json) takes Muon at the rule's matrix lr and keeps the rest.
    `scripts/convergence_muon.py --headline` measures that config on the headline's seeds
    (results/convergence/muon_headline.md)."""
    from pathlib import Path

    from mesh.bench.convergence import HEADLINE, _dp_spec
    from mesh.bench.simruns import spec_config
    from mesh.bench.tuning import load_tuned
    from mesh.config import with_overrides

    root = Path(__file__).parents[2]
    tuned, is_tuned = load_tuned(root / "results/convergence/tuning.json")
    assert is_tuned and tuned["AsyncMesh-fp8"]["optim.delay_lr_share"] == 0.5
    base = load_config([], [])
    for method in HEADLINE:
        off = spec_config(base, _dp_spec(method, 20, tuned=tuned), 1600)
        assert off.optim.depth_rule == "off" and off.grid.stages == 4
        auto = with_overrides(off, {"optim.depth_rule": "auto"})
        if method == "FullSync":
            assert auto.depth_rule_settings() == {}
            assert auto.fingerprint() == off.fingerprint()
            continue
        assert auto.depth_rule_settings() == {"name": "muon", "muon_lr": 1e-2}
        ruled = auto.effective().optim
        assert ruled.lr == off.optim.lr and ruled.delay_lr_share == 0.5
