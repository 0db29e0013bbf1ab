"""scripts/gpu_check.sh's plumbing with GPU_CHECK_DRY=1: every part on the CPU with tiny models
and a few steps, results and what the device tool's $OUT takes back."""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PARTS = ["setup", "model", "codecs", "grid-bf16", "grid-fp8", "export", "generate", "hivemind"]


@pytest.mark.timeout(3600)  # the script's own budgets (x8 when dry) catch a hang first
def test_gpu_check_dry_run_passes_every_part_and_packs_what_comes_back(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # our python3
        "GPU_CHECK_DRY": "1",
        "GPU_CHECK_RESULTS": str(tmp_path / "results"),
        "GPU_CHECK_RUNS": str(tmp_path / "runs"),
        "GPU_WHEELS": str(tmp_path / "no-wheels"),  # the packages are here: nothing to install
        "OUT": str(out),
    }
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    res = tmp_path / "results" / "gpu"
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    parts = [line.split("\t") for line in (res / "parts.tsv").read_text().splitlines()[1:]]
    assert [p[0] for p in parts] == PARTS and all(p[3] == "0" for p in parts), parts
    assert json.loads((res / "summary.json").read_text())["parts"][-1]["part"] == "hivemind"

    model = json.loads((tmp_path / "results" / "model-cuda" / "summary.json").read_text())
    assert [(r["preset"], r["precision"]) for r in model["rows"]] == [
        ("tiny", p) for p in ("fp32", "bf16") for _ in range(4)
    ]
    codecs = {r["name"]: r for r in json.loads((res / "codecs.json").read_text())["codecs"]}
    assert codecs["bf16"]["bytes_per_value"] == 2 and codecs["fp8_e4m3"]["rel_err_median"] < 0.1
    for grid in ("grid-bf16", "grid-fp8", "grid-hivemind"):
        assert "run directory" in (res / f"{grid}.md").read_text(), grid
    assert (res / "sample.txt").read_text().startswith("ROMEO:")

    assert sorted(p.name for p in out.iterdir()) == ["log.txt", "results.tgz", "summary.md"]
    with tarfile.open(out / "results.tgz") as tar:
        names = tar.getnames()
    assert any(n.endswith("gpu/summary.json") for n in names)
    assert any(n.endswith("model-cuda/table.md") for n in names)
    assert any("gpu-160m-bf16/metrics/" in n for n in names)
    assert not any("checkpoints" in n or n.endswith(".safetensors") for n in names)
    assert "## " in (out / "summary.md").read_text()
