"""The real-size throughput grid's protocol: compute from plan's FLOPs, real boundary shapes."""

import json

import pytest

from mesh.bench.throughput import real_size as rs
from mesh.config import load_config, with_overrides
from mesh.runtime.emulate import (
    activation_frame_bytes,
    emulated_op_s,
    link_profile,
    resolve_window,
)


@pytest.fixture(scope="module")
def grid():
    return rs.real_size_config(load_config([], []))


def test_compute_is_plans_flops_at_40pct_of_an_h100(grid):
    cfg, compute = grid
    real = load_config([rs.REAL_MODEL], ["grid.stages=4"])
    from mesh.bench.model import stage_flops_per_token

    for j, c in enumerate(compute):
        flops = stage_flops_per_token(real, j) * 8 * 1024
        assert c == pytest.approx(flops / (0.4 * 989e12))
        # each cell sleeps exactly its real stage's time: forward a third, backward two thirds
        f, b = emulated_op_s(cfg, j, 1)
        assert f + b == pytest.approx(c, rel=1e-3) and b == pytest.approx(2 * f)
    assert compute[3] > compute[1]  # the last stage holds the 32k-token head


def test_arms_carry_the_real_payloads(grid):
    cfg, compute = grid
    assert cfg.boundary_shape == (8, 1024, 2304)
    assert (cfg.transport.link_bandwidth_mbps, cfg.transport.link_latency_ms) == (100.0, 50.0)
    assert cfg.transport.link_shared == "pipeline" and cfg.dp.subset_block == 64  # the preset's
    sizes, shares = {}, {}
    for method, ratio, codec in rs.ARMS:
        c = rs.arm_config(cfg, method, ratio, codec)
        label = rs.arm_name(method, ratio, codec)
        sizes[label] = activation_frame_bytes(c)
        shares[label] = max(compute) / rs.predicted_period_s(c, compute)
        assert c.pipeline.codec == codec and isinstance(c.pipeline.window, list)
    assert list(sizes) == [
        "full fp8",
        "learned 16x",
        "learned 32x int4",
        "learned 64x",
        "learned 128x int4",
    ]
    assert sizes["full fp8"] > 8 * 1024 * 2304  # one byte a value plus scales and header
    assert sizes["full fp8"] / sizes["learned 16x"] > 16 / 2.1  # fp8 is ~2x of bf16 already
    assert sizes["full fp8"] / sizes["learned 64x"] > 64 / 2.1
    assert sizes["full fp8"] / sizes["learned 128x int4"] > 128 / 2.1
    # the link model: a middle stage's uplink carries two frames a microbatch, so only the
    # ~110x arm leaves the slowest stage's compute >= 0.8 of the period
    bw = 100e6 / 8
    assert shares["full fp8"] == pytest.approx(max(compute) / (2 * sizes["full fp8"] / bw))
    assert shares["learned 128x int4"] >= 0.8 > shares["learned 64x"]


def test_time_dilation_scales_every_duration_and_keeps_the_fractions(grid):
    cfg, compute = grid
    c = rs.arm_config(cfg, "learned", 64, "fp8_e4m3")
    k = 7.5
    d = rs.dilated(c, k)
    emu, link, d_emu, d_link = c.emulation, c.transport, d.emulation, d.transport
    assert d_emu.forward_ms == pytest.approx(k * emu.forward_ms)
    assert d_emu.backward_ms == pytest.approx(k * emu.backward_ms)
    assert d_link.link_latency_ms == pytest.approx(k * link.link_latency_ms)
    assert d_link.link_bandwidth_mbps == pytest.approx(link.link_bandwidth_mbps / k)
    assert d_link.recv_timeout_s == pytest.approx(k * link.recv_timeout_s)
    assert d_link.round_timeout_s == pytest.approx(k * link.round_timeout_s)
    assert d.pipeline.window == c.pipeline.window and d.emulation.slowdowns == c.emulation.slowdowns
    # the window a dilated arm would size for itself is the same: every time scaled alike
    auto = {"pipeline.window": "auto"}
    assert resolve_window(with_overrides(d, auto)).pipeline.window == c.pipeline.window
    # the link model's share is the same at any k
    dilated_compute = [k * x for x in compute]
    assert max(dilated_compute) / rs.predicted_period_s(d, dilated_compute) == pytest.approx(
        max(compute) / rs.predicted_period_s(c, compute)
    )
    # the calibration arm: no sleeps to speak of, no shaping
    u = rs.unconstrained(c)
    assert u.emulation.forward_ms < 0.01 and link_profile(u) is None
    # k: the host gets MARGIN x its own time an update, never less than real time
    assert rs.dilation(0.2, 0.05) == pytest.approx(rs.MARGIN * 4)
    assert rs.dilation(0.01, 3.0) == 1.0
    # a slow arm runs fewer updates, never fewer than MIN_STEPS
    assert rs.arm_steps(60, 0.5) == 60
    assert rs.arm_steps(60, 30.0) == rs.MIN_STEPS


def test_host_pace_reads_the_steady_part_of_a_window():
    def cell(period, cpu):
        return [{"step": s, "time_s": s * period, "cpu_s": s * cpu} for s in range(1, 21)] + [
            {"final": True}
        ]

    # the last stage's pace of the slower replica; the busiest cell's CPU an update
    rows = {(0, 0): cell(0.1, 0.05), (1, 0): cell(0.2, 0.03), (1, 1): cell(0.25, 0.02)}
    wall, cpu = rs.host_pace(rows)
    assert wall == pytest.approx(0.25) and cpu == pytest.approx(0.05)


def test_the_entry_merges_into_the_throughput_summary(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({"configs": [{"id": "A1"}]}))
    (tmp_path / "table.md").write_text("grids A1-A4\n")
    entry = {
        "grid": "4x2",
        "shapes": {"d_model": 2304, "seq_len": 1024, "microbatch_size": 8},
        "link": {"bandwidth_mbps": 100.0, "latency_ms": 50.0},
        "compute_formula": "f",
        "stage_compute_ms": [34.0, 43.2],
        "compute_bound_tokens_per_s": 1.0,
        "arms": [
            {
                "arm": "full fp8",
                "rank": 2304,
                "compression": 1.9,
                "frame_bytes": 1,
                "link_s_per_message": 1.5,
                "tokens_per_s": 10.0,
                "fraction_of_compute_ideal": 0.03,
                "predicted_link_model_share": 0.03,
                "fraction_of_ideal": 0.9,
                "staleness": [1, 0],
            }
        ],
    }
    for _ in range(2):  # a second run replaces the first's section
        rs.merge_into(tmp_path, entry)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["configs"] == [{"id": "A1"}] and summary["real_size"]["grid"] == "4x2"
    text = (tmp_path / "table.md").read_text()
    assert text.startswith("grids A1-A4") and text.count("## Real-size grid") == 1
