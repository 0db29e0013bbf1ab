"""The real-size throughput grid's protocol: compute from plan's FLOPs, real boundary shapes."""

import json

import pytest

from mesh.bench.throughput import real_size as rs
from mesh.config import load_config
from mesh.runtime.emulate import activation_frame_bytes, emulated_op_s


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
    cfg, _ = grid
    assert cfg.boundary_shape == (8, 1024, 2304)
    assert (cfg.runtime.link_bandwidth_mbps, cfg.runtime.link_latency_ms) == (100.0, 50.0)
    sizes = {}
    for label, method, ratio in rs.ARMS:
        c = rs.arm_config(cfg, method, ratio)
        sizes[label] = activation_frame_bytes(c)
        assert c.pipeline.codec == "fp8_e4m3" and isinstance(c.pipeline.window, list)
    assert sizes["full fp8"] > 8 * 1024 * 2304  # one byte a value plus scales and header
    assert sizes["full fp8"] / sizes["learned 16x"] > 16 / 2.1  # fp8 is ~2x of bf16 already
    assert sizes["full fp8"] / sizes["learned 64x"] > 64 / 2.1


def test_the_entry_merges_into_the_throughput_summary(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({"configs": [{"id": "A1"}]}))
    (tmp_path / "table.md").write_text("grids A1-A4\n")
    entry = {
        "grid": "4x2", "shapes": {"d_model": 2304, "seq_len": 1024, "microbatch_size": 8},
        "link": {"bandwidth_mbps": 100.0, "latency_ms": 50.0}, "compute_formula": "f",
        "stage_compute_ms": [34.0, 43.2], "compute_bound_tokens_per_s": 1.0,
        "arms": [{"arm": "full fp8", "rank": 2304, "compression": 1.9, "frame_bytes": 1,
                  "link_s_per_message": 1.5, "tokens_per_s": 10.0,
                  "fraction_of_compute_ideal": 0.03, "predicted_link_model_share": 0.03,
                  "fraction_of_ideal": 0.9, "staleness": [1, 0]}],
    }  # fmt: skip
    for _ in range(2):  # a second run replaces the first's section
        rs.merge_into(tmp_path, entry)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["configs"] == [{"id": "A1"}] and summary["real_size"]["grid"] == "4x2"
    text = (tmp_path / "table.md").read_text()
    assert text.startswith("grids A1-A4") and text.count("## Real-size grid") == 1
