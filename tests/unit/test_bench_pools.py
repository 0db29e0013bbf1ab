"""`meshtrain bench pools`' report without its grids: the scenarios' speeds, the capacity
model's bounds (fixed, pools, pools that rebalance), the targets' verdicts and the outputs that
--report-only writes again from a summary.json."""

from __future__ import annotations

import json

import pytest

from mesh.bench import pools


def _arm(tps: float) -> dict:
    return {
        "ok": True,
        "wall_s": 60.0,
        "tokens_per_s": tps,
        "tokens_per_s_to_the_end": 1000.0,
        "staleness_mean": 1.2,
        "voided": 0,
        "lives": 8,
    }


def test_scenarios_are_seeded_and_the_dead_spare_the_streams():
    assert pools.scenario_speeds("gpu-mix", 4, 8) == pools.scenario_speeds("gpu-mix", 4, 8)
    assert {v for stage in pools.scenario_speeds("gpu-mix", 4, 8) for v in stage} <= set(
        pools.SPEEDS
    )
    dead = pools.scenario_speeds("dead-10", 4, 8)
    assert [stage.count(0.0) for stage in dead] == [0, 1, 1, 1]  # 10% of 32, none in stage 0
    assert pools.scenario_speeds("equal", *pools.SCENARIOS["equal"]) == [[1.0] * 3] * 3


def test_report_only_recomputes_the_bounds_and_the_verdicts(tmp_path):
    speeds = {name: pools.scenario_speeds(name, *pools.SCENARIOS[name]) for name in pools.SCENARIOS}
    cfg = pools.arm_config("gpu-mix", "pools", speeds["gpu-mix"], 60, pools.BASE)
    scale = cfg.tokens_per_microbatch / 0.45  # forward 150 ms + backward 300 ms at speed 1
    scenarios = {}
    for name, (P, m) in pools.SCENARIOS.items():
        bound = min(sum(stage) for stage in speeds[name]) * scale
        scenarios[name] = {
            "grid": f"{P}x{m}",
            "speeds": speeds[name],
            "fixed": _arm(0.6 * bound),
            "pools": _arm(0.9 * bound),
            "pools_vs_fixed": 1.5,
            "pools_of_bound": 0.9,
        }
    (tmp_path / "summary.json").write_text(
        json.dumps({"steps": 60, "quick": False, "scenarios": scenarios})
    )
    summary = pools.report_only(tmp_path)
    mix = summary["scenarios"]["gpu-mix"]
    assert mix["pool_bound_tps"] == pytest.approx(3.25 * scale, rel=1e-3)
    # every cell taken: a rebalancing grid has no move to make, its bound is the pools' own
    assert mix["rebalancing_moves"] == 0 and mix["rebalanced_bound_tps"] == mix["pool_bound_tps"]
    assert all(t["met"] for t in summary["targets"].values()), summary["targets"]
    table = (tmp_path / "table.md").read_text()
    assert "rebalanced bound (moves)" in table and "MISSED" not in table
    assert "| 1,000 / 1,000 " in table  # the whole run's rates beside the steady window's
    assert json.loads((tmp_path / "summary.json").read_text())["targets"] == summary["targets"]
    # equal peers: pools at 0.9x fixed miss their own target (0.95x), whatever the GPU mix did
    assert summary["targets"]["pools_vs_fixed_equal_peers"]["met"]
    scenarios["equal"]["pools_vs_fixed"] = 0.9
    (tmp_path / "summary.json").write_text(
        json.dumps({"steps": 60, "quick": False, "scenarios": scenarios})
    )
    equal = pools.report_only(tmp_path)["targets"]["pools_vs_fixed_equal_peers"]
    assert equal == {"target": 0.95, "measured": 0.9, "met": False}
    # a summary from before the scenario: no verdict for it, the others as they were
    del scenarios["equal"]
    (tmp_path / "summary.json").write_text(
        json.dumps({"steps": 60, "quick": False, "scenarios": scenarios})
    )
    assert "pools_vs_fixed_equal_peers" not in pools.report_only(tmp_path)["targets"]


def test_only_adds_to_a_study_of_the_same_settings(tmp_path):
    (tmp_path / "summary.json").write_text(
        json.dumps({"steps": 60, "quick": False, "overrides": [], "scenarios": {"churn": {}}})
    )
    assert pools._kept(tmp_path, 60, ()) == {"churn": {}}
    with pytest.raises(ValueError, match="same settings"):
        pools._kept(tmp_path, 80, ())
    with pytest.raises(ValueError, match="same settings"):
        pools._kept(tmp_path, 60, ("pipeline.pool_window=8",))
    # a folder with no study yet: --only starts one with just its scenarios
    assert pools._kept(tmp_path / "fresh", 60, ()) == {}


def test_steady_rates_while_every_stream_is_live_and_to_the_end():
    """Stream a does 10 steps a second for 10 s; stream b 2.5 a second for 40 s. The steady
    window starts at a quarter of the 200 steps (t = 4: 40 + 10) and, while both are live, ends
    at t = 10 (a done: 100 + 25); to the end, at t = 40. A restart's replayed steps (b falling
    back to 20 at t = 12) add nothing until they pass its best."""
    samples = []
    for t in range(41):
        b = 25 * t // 10
        if t == 12:
            b = 20  # a restarted life replays from its checkpoint
        samples.append((float(t), {"a": min(10 * t, 100), "b": b}))
    live, to_end = pools.steady_rates(samples, 1)
    assert live == pytest.approx((125 - 50) / 6, abs=0.05)  # rounded to 0.1
    assert to_end == pytest.approx((200 - 50) / 36, abs=0.05)
    assert pools.steady_rates([], 1) == (0.0, 0.0)


def test_the_convergence_control_is_pools_without_the_slow_cell_and_kept_apart():
    from mesh.bench import pools_convergence as pc

    arms = pc.specs((10,))
    ov = {arm: dict(s[0].overrides) for arm, s in arms.items()}
    assert ov["pools"]["emulation.slowdowns"] == pc.SLOW and ov["even"]["emulation.slowdowns"] == []
    assert ov["pools"]["pipeline.routing"] == ov["even"]["pipeline.routing"] == "pools"
    # both pools arms keep a microbatch on its replica unless its next cell is clearly slower
    assert ov["pools"]["pipeline.pool_affinity"] == ov["even"]["pipeline.pool_affinity"] == 1.5
    assert "pipeline.pool_affinity" not in ov["fixed"]
    assert {k: v for k, v in ov["pools"].items() if k != "emulation.slowdowns"} == {
        k: v for k, v in ov["even"].items() if k != "emulation.slowdowns"
    }
    # speeds are a local setting, out of the config's fingerprint: runs are told apart by arm
    assert arms["pools"][0].method != arms["even"][0].method
    assert pc._key(arms["pools"][0].method, "fp") != pc._key(arms["even"][0].method, "fp")
