"""`meshtrain bench model --quick`: every stage of llama-20m, fp32 and bf16, on this CPU."""

import json

import pytest
from click.testing import CliRunner

from cli.main import main


@pytest.mark.slow
def test_quick_model_bench_writes_its_results_and_memory_meets_the_plan(tmp_path):
    res = CliRunner().invoke(
        main, ["bench", "model", "--quick", "--out", str(tmp_path), "--device", "cpu"]
    )
    assert res.exit_code == 0, res.output
    summary = json.loads((tmp_path / "summary.json").read_text())
    rows = summary["rows"]
    assert [(r["stage"], r["precision"]) for r in rows] == [
        (j, p) for p in ("fp32", "bf16") for j in range(4)
    ]
    for r in rows:
        # timings on a shared CI machine are reported, not judged; memory is deterministic
        assert r["cell_ms"] > 0 and r["plain_ms"] > 0 and r["tokens_per_s"] > 0
        assert abs(r["peak_vs_plan"]) <= 0.15, r
    assert "peak vs plan" in (tmp_path / "table.md").read_text()
