"""emulation.deaths on the process backends: a cell out from the start ("sJrI@0") is left
unstarted; any span a process grid cannot act out (a death mid-run, a cell coming back) is
refused in one line before anything starts, and `train` / `join` refuse the setting."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from cli.main import main
from cli.preflight import check_deaths
from mesh.algo import routing
from mesh.config import ConfigError, load_config


def test_only_a_death_from_the_start_for_good_is_a_process_grids():
    spans = routing.parse_deaths(["s1r1@0", "s2r0@100-200", "s0r1@0-50", "s1r0@7"], 4, 2)
    assert routing.mid_run_deaths(spans) == ["s0r1@0-50", "s1r0@7", "s2r0@100-200"]
    assert routing.mid_run_deaths(routing.parse_deaths(["s1r1@0"], 4, 2)) == []


@pytest.mark.parametrize("backend", ["torch", "hivemind"])
def test_simulate_refuses_a_mid_run_death_in_one_line(backend, text_file, tmp_path):
    out = tmp_path / "r"
    args = [
        "simulate",
        "--backend",
        backend,
        "--grid",
        "2x2",
        "--steps",
        "20",
        "--out",
        str(out),
        "--set",
        f"data.path='{text_file}'",
        "--set",
        'emulation.deaths=["s1r1@100-200"]',
    ]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1, lines
    assert "emulation.deaths" in lines[0] and "'s1r1@100-200'" in lines[0]
    assert "--backend logical" in lines[0] and '"s1r1@0"' in lines[0]
    assert not out.exists(), "refused before a run directory was made"


def test_the_refusal_is_one_line_on_stderr_and_exit_2(tmp_path):
    """As a user sees it: a real process, nothing read or started before the refusal (the data
    path does not even exist)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli.main",
            "simulate",
            "--grid",
            "2x2",
            "--out",
            str(tmp_path / "r"),
            "--set",
            f"data.path='{tmp_path / 'missing.txt'}'",
            "--set",
            'emulation.deaths=["s0r1@5"]',
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in proc.stderr, err
    assert err[0].startswith("error: emulation.deaths 's0r1@5'"), err[0]
    assert "--backend logical only" in err[0]


def test_a_cell_out_from_the_start_passes_and_train_and_join_refuse_any(text_file):
    cfg = load_config([], ["grid.stages=2", "grid.replicas=2", 'emulation.deaths=["s1r1@0"]'])
    check_deaths(cfg, "simulate")  # never started: what a process grid does with it
    check_deaths(load_config([], ["grid.stages=2"]), "train")  # no deaths: nothing to refuse
    for command in ("train", "join"):
        with pytest.raises(ConfigError, match="emulation.deaths") as e:
            check_deaths(cfg, command)
        assert f"`{command}` runs real peers" in str(e.value)
        assert "emulation.deaths=[]" in str(e.value) and "\n" not in str(e.value)
