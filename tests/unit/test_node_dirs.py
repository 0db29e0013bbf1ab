"""A `train` run's node directories read as one run directory (mesh/runtime/node_dirs.py):
export and the dashboard of cells spread over several --out directories."""

from __future__ import annotations

import json
import os

from click.testing import CliRunner
from helpers import TINY

from cli.dashboard import run_dir_source
from cli.main import main
from mesh.config import load_config
from mesh.engine.sim import GridSim
from mesh.runtime.checkpoint import save_cell
from mesh.runtime.node_dirs import merge_into, one_run_dir
from mesh.runtime.rows import append_row

LLAMA = [
    "model.arch='llama'",
    "model.n_layers=2",
    "model.d_model=16",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.intermediate_size=24",
    "model.seq_len=16",
]


def spread_run(tmp_path, text_file):
    """A 2x2 llama grid trained 3 updates in the simulator, saved twice: all cells in one
    directory, and stage j's cells under node directory n<j> (a replica over two nodes)."""
    cfg = load_config(
        [],
        [
            *TINY,
            *LLAMA,
            "grid.stages=2",
            "grid.replicas=2",
            "run.steps=3",
            f"data.path='{text_file}'",
        ],
    )
    sim = GridSim(cfg)
    for _ in range(3):
        sim.step()
    whole, nodes = tmp_path / "whole", [tmp_path / "n0", tmp_path / "n1"]
    for d in (whole, *nodes):
        d.mkdir()
        (d / "config.toml").write_text(cfg.to_toml())
    for row in sim.cells:
        for cell in row:
            save_cell(cell, cfg.state_fingerprint(), whole)
            save_cell(cell, cfg.state_fingerprint(), nodes[cell.stage])
            for d in (whole, nodes[cell.stage]):
                metrics = d / "metrics" / f"{cell.stage}-{cell.replica}.jsonl"
                metrics.parent.mkdir(exist_ok=True)
                append_row(metrics, {"event": "started", "step": 0, "pid": 1, "host": "other"})
                append_row(
                    metrics,
                    {
                        "stage": cell.stage,
                        "replica": cell.replica,
                        "step": 3,
                        "time_s": 1.0,
                        "loss": 5.0,
                    },
                )
    return cfg, whole, nodes


def test_the_merged_view_links_config_checkpoints_and_the_newest_metrics(tmp_path, text_file):
    _, _, nodes = spread_run(tmp_path, text_file)
    stale = nodes[1] / "metrics" / "0-0.jsonl"  # an older copy of a cell's rows elsewhere
    stale.write_text("")
    os.utime(stale, (1, 1))
    view = merge_into(nodes, tmp_path / "view")
    assert (view / "config.toml").resolve() == (nodes[0] / "config.toml").resolve()
    assert sorted(p.name for p in (view / "checkpoints").iterdir()) == ["0-0", "0-1", "1-0", "1-1"]
    assert (view / "checkpoints/1-0/step-00000003.pt").resolve().parent.parent.parent == nodes[1]
    assert (view / "metrics/0-0.jsonl").resolve() == (nodes[0] / "metrics/0-0.jsonl").resolve()
    merge_into(nodes, view)  # again: nothing replaced, nothing fails
    with one_run_dir([nodes[0]], "export") as one:
        assert one == nodes[0]  # one directory is read as it is


def test_export_of_node_directories_equals_the_export_of_one(tmp_path, text_file):
    _, whole, nodes = spread_run(tmp_path, text_file)
    runner = CliRunner()
    for args, out in (([str(whole)], "a"), ([str(n) for n in nodes], "b")):
        res = runner.invoke(main, ["export", *args, "--out", str(tmp_path / out), "--replica", "1"])
        assert res.exit_code == 0, res.output
    a, b = tmp_path / "a", tmp_path / "b"
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    meta = json.loads((b / "meshtrain.json").read_text())
    assert meta["node_dirs"] == [str(n.resolve()) for n in nodes] and meta["step"] == 3
    # a node directory alone lacks a stage: refused in one line, as a run missing a stage is
    res = runner.invoke(main, ["export", str(nodes[0]), "--out", str(tmp_path / "c")])
    assert res.exit_code == 2 and "stage 1 of replica 0 has no checkpoint" in res.output


def test_the_dashboard_shows_every_cell_of_the_node_directories(tmp_path, text_file):
    _, _, nodes = spread_run(tmp_path, text_file)
    source = run_dir_source(nodes)
    cells = {c["cell"]: c for c in source()["cells"]}
    assert sorted(cells) == ["s0r0", "s0r1", "s1r0", "s1r1"]
    assert all(c["step"] == 3 for c in cells.values()), cells


def test_a_cell_finds_its_intact_checkpoints_in_any_node_directory(tmp_path, text_file):
    """What `train --resume n0 --resume n1` reads: each step from the first directory holding
    it intact; a torn file or another run's is passed over."""
    from mesh.runtime.checkpoint import checkpoint_path
    from mesh.runtime.cluster_start import intact_steps

    cfg, _, nodes = spread_run(tmp_path, text_file)
    fp = cfg.state_fingerprint()
    assert intact_steps(nodes, 1, 0, fp) == {3: checkpoint_path(nodes[1], 1, 0, 3)}
    assert intact_steps(nodes[:1], 1, 0, fp) == {}  # stage 1 ran on node 1
    torn = checkpoint_path(nodes[0], 1, 0, 3)
    torn.parent.mkdir(parents=True)
    torn.write_bytes(checkpoint_path(nodes[1], 1, 0, 3).read_bytes()[:1000])
    assert intact_steps(nodes, 1, 0, fp) == {3: checkpoint_path(nodes[1], 1, 0, 3)}
    assert intact_steps(nodes, 1, 0, "another run") == {}


def test_train_resume_reads_the_runs_config_from_its_node_directories(tmp_path, text_file):
    """`train --resume n0 --resume n1` keeps the run's config (its grid here, for the table)
    and refuses what a resume refuses, before any launcher is needed."""
    _, _, nodes = spread_run(tmp_path, text_file)
    runner = CliRunner()
    args = ["train", "--resume", str(nodes[1]), "--resume", str(nodes[0]), "--placement", "2"]
    res = runner.invoke(main, args)
    assert res.exit_code == 0, res.output
    assert "| 3    | 1    | s1r1 |" in res.output  # the run's 2x2 grid, not the default
    res = runner.invoke(main, [*args, "--set", "model.d_model=32"])
    assert res.exit_code == 2 and "model.d_model" in res.output, res.output
    res = runner.invoke(main, ["train", "--resume", str(tmp_path)])
    assert res.exit_code == 2 and "not a run directory" in res.output, res.output
