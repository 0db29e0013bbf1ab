"""`plan --uplink-mbit`: both axes sized to an uplink (mesh/engine/uplink.py)."""

import json
from pathlib import Path

from click.testing import CliRunner

from cli.main import main
from mesh.config import load_config, with_overrides
from mesh.engine import uplink as up
from mesh.engine.plan import link_mbps, plan_cell

LLAMA_20M = ["configs/models/llama-20m.toml"]


def cfg():
    return load_config(LLAMA_20M, ["grid.stages=4", "grid.replicas=2"])


def test_every_setting_needs_what_plan_says_at_its_overrides():
    c = cfg()
    cands = up.settings(c, 20_000)
    assert {s.interval_steps for s in cands} == set(up.INTERVALS)
    for s in cands[:: max(1, len(cands) // 9)]:  # a spread of options and intervals
        other = with_overrides(c, s.overrides())
        want = [sum(link_mbps(plan_cell(other, j), other, 20_000)) for j in range(4)]
        assert all(abs(a - b) <= 1e-6 * b for a, b in zip(s.needs_mbps, want, strict=True))


def test_the_choice_fits_and_is_the_cheapest_measured():
    c = cfg()
    # unmeasured: the least compressed boundary, then the shortest interval, that fits
    cands = up.settings(c, 20_000)
    uplink = sorted(s.busiest_mbps for s in cands)[len(cands) // 2]
    best = up.choose(cands, uplink)
    assert best is not None and best.busiest_mbps <= uplink
    fits = [s for s in cands if s.busiest_mbps <= uplink]
    assert best.option.compression == min(s.option.compression for s in fits)
    # measured: a cheaper, more compressed boundary wins over a costly lighter one
    costs = {o.label: 0.05 for o in up.boundary_options(c)} | {"learned 32x": 0.004}
    measured = up.settings(c, 20_000, costs, {h: 0.0 for h in up.INTERVALS})
    best = up.choose(measured, 1e9)  # everything fits: the cost alone decides
    assert best.option.label == "full bf16"  # the reference costs nothing
    best = up.choose([s for s in measured if s.option.label != "full bf16"], 1e9)
    assert best.option.label == "learned 32x" and best.interval_steps == 1


def test_a_gap_below_zero_counts_as_none():
    c = cfg()
    cands = up.settings(c, 20_000, {"learned 8x": -0.01}, {h: 0.0 for h in up.INTERVALS})
    s = next(s for s in cands if s.option.label == "learned 8x")
    assert s.cost == 0.0


def test_plan_picks_a_setting_that_fits_and_says_how_to_set_it(tmp_path):
    res = CliRunner().invoke(
        main,
        [
            "plan",
            "--config",
            *LLAMA_20M,
            "--uplink-mbit",
            "20",
            "--tokens-per-s",
            "20000",
            "--results",
            str(tmp_path),
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    chosen = out["chosen"]
    assert chosen["pipeline.boundary"] != "full"  # full boundaries need more than 20 Mbit/s
    row = next(
        r
        for r in out["options"]
        if r["interval_steps"] == chosen["dp.interval_steps"]
        and r["rank"] == chosen.get("pipeline.boundary_rank")
        and r["fits"]
    )
    assert max(row["needs_mbps"]) <= 20


def test_plan_refuses_with_a_clear_line_when_nothing_fits(tmp_path):
    res = CliRunner().invoke(
        main, ["plan", "--config", *LLAMA_20M, "--uplink-mbit", "0.01", "--results", str(tmp_path)]
    )
    assert res.exit_code == 2
    assert "no pipeline boundary and averaging interval fit --uplink-mbit 0.01" in res.output
    assert "lower --tokens-per-s to" in res.output and "Traceback" not in res.output


def test_plan_reads_the_studies_measured_costs(tmp_path):
    (tmp_path / "boundary").mkdir()
    rows = [
        {"P": 4, "arm": "learned 16x", "loss_gap": 0.003},
        {"P": 8, "arm": "learned 16x", "loss_gap": 0.2},  # another P: not this grid's
    ]
    (tmp_path / "boundary" / "summary.json").write_text(json.dumps({"rows": rows}))
    (tmp_path / "convergence" / "interval").mkdir(parents=True)
    iv = [{"interval_steps": 4, "loss_gap": 0.001}, {"interval_steps": 16, "loss_gap": 0.01}]
    (tmp_path / "convergence" / "interval" / "summary.json").write_text(json.dumps({"rows": iv}))
    res = CliRunner().invoke(
        main, ["plan", "--config", *LLAMA_20M, "--uplink-mbit", "1000", "--results", str(tmp_path)]
    )
    assert res.exit_code == 0, res.output
    line = next(ln for ln in res.output.splitlines() if ln.startswith("| learned 16x"))
    assert "+0.30%" in line


def test_4bit_boundaries_are_options_with_their_measured_cost():
    c = cfg()
    opts = {o.label: o for o in up.boundary_options(c)}
    for ratio in up.INT4_RATIOS:
        o = opts[f"learned {ratio}x int4"]
        assert o.codec == "int4_hadamard" and o.compression >= ratio
        # the largest rank at that ratio: one more coordinate would not make it
        assert (
            up.rank_for_compression(
                c.tokens_per_microbatch, c.model.d_model, ratio, "int4_hadamard"
            )
            == o.rank
        )
    # 4 bits carry about twice the coordinates of fp8 in the same bytes
    assert opts["learned 32x int4"].rank >= 1.9 * opts["learned 32x"].rank
    # measured cheaper than fp8 at a similar ratio and fitting where fp8's 16x does not:
    # chosen, and its overrides name the codec
    costs = {o: 0.05 for o in opts} | {"learned 32x int4": 0.002}
    cands = up.settings(c, 20_000, costs, {h: 0.0 for h in up.INTERVALS})
    tight = next(
        s for s in cands if s.option.label == "learned 32x int4" and s.interval_steps == 64
    )
    best = up.choose(cands, tight.busiest_mbps * 1.01)
    assert best is not None and best.option.label == "learned 32x int4"
    assert best.overrides()["pipeline.codec"] == "int4_hadamard"


def test_plan_lists_4bit_for_the_pipeline_only():
    from mesh.engine.plan import uplink_by_codec

    rows = {codec: (pp, dp) for codec, pp, dp in uplink_by_codec(cfg(), 20_000)}
    pp, dp = rows["int4_hadamard"]
    assert dp is None and pp is not None  # averaging payloads stay at 8 bits or more
    assert 0.5 < pp / rows["fp8_e4m3"][0] < 0.53  # 0.53 bytes a value against fp8's 1.03


def test_plan_outside_the_repository_reads_the_shipped_costs_and_says_so(tmp_path, monkeypatch):
    from mesh.engine import measured

    config = str(Path(LLAMA_20M[0]).resolve())
    monkeypatch.chdir(tmp_path)  # no results/ here: a new user's directory
    res = CliRunner().invoke(main, ["plan", "--config", config, "--uplink-mbit", "1000"])
    assert res.exit_code == 0, res.output
    said = [ln for ln in res.output.splitlines() if ln.startswith("measured costs: ")]
    assert len(said) == 1 and str(measured.SHIPPED) in said[0] and "boundary: " in said[0]
    shipped = measured.read_shipped()
    assert shipped["boundary"]["gaps_by_P"]  # the package holds measured costs
    assert "+" in next(ln for ln in res.output.splitlines() if ln.startswith("| learned 16x "))
    # a results folder without studies: said in one line, every row unmeasured
    res = CliRunner().invoke(
        main, ["plan", "--config", config, "--uplink-mbit", "1000", "--results", str(tmp_path)]
    )
    assert res.exit_code == 0, res.output
    assert f"measured costs: none in --results {tmp_path}" in res.output


def test_plan_keeps_the_memory_answer_beside_the_uplink_one():
    args = ["plan", "--config", *LLAMA_20M, "--uplink-mbit", "1000", "--memory-gb", "0.05"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert "memory: --memory-gb 0.05" in res.output and "with 0.05 GB" in res.output
    assert "chosen: " in res.output
    out = json.loads(CliRunner().invoke(main, [*args, "--json"]).output)
    assert out["memory"]["memory_source"] == "--memory-gb 0.05"
    assert "take_stage" in out["memory"] and out["chosen"] is not None


def test_a_tie_says_why_the_chosen_setting_wins():
    from cli.plan import tie_note

    c = cfg()
    costs = {o.label: 0.05 for o in up.boundary_options(c)}
    costs |= {"learned 8x": -0.01, "learned 16x": 0.0, "learned 32x int4": -0.002}
    cands = up.settings(c, 20_000, costs, {h: 0.0 for h in up.INTERVALS})
    cands = [s for s in cands if s.option.method != "full"]
    best = up.choose(cands, 1e9)
    assert best.option.label == "learned 8x"  # the least compressed of the three at 0
    note = tie_note(best, cands, 1e9)
    assert "learned 16x" in note and "learned 32x int4" in note and "least compressed" in note
    assert tie_note(best, [best], 1e9) is None


def test_plan_says_when_the_boundary_costs_were_measured_with_another_optimizer(tmp_path):
    """A 4-stage run trains with Muon (optim.depth_rule); costs from a NAdamW boundary study
    are said to be NAdamW's, those of a shipped-optimizer study are not, nor are NAdamW's for a
    run that trains with NAdamW."""
    (tmp_path / "boundary").mkdir()
    rows = [{"P": 4, "arm": "learned 16x", "loss_gap": 0.003}]
    study = tmp_path / "boundary" / "summary.json"

    def said(*sets: str) -> str:
        args = ["plan", "--config", *LLAMA_20M, "--uplink-mbit", "1000", "--results", str(tmp_path)]
        res = CliRunner().invoke(main, [*args, *(x for s in sets for x in ("--set", s))])
        assert res.exit_code == 0, res.output
        return next(ln for ln in res.output.splitlines() if ln.startswith("measured costs: "))

    study.write_text(json.dumps({"rows": rows}))
    assert "measured with NAdamW, and this run trains with muon" in said("grid.stages=4")
    assert "measured with NAdamW" not in said("grid.stages=4", "optim.depth_rule=off")
    study.write_text(json.dumps({"rows": rows, "optimizer": "shipped"}))
    assert "measured with NAdamW" not in said("grid.stages=4")
