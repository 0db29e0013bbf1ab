import subprocess
import sys
import tomllib

import pytest
from click.testing import CliRunner

from cli.main import main


def test_show_config_prints_resolved_toml():
    res = CliRunner().invoke(main, ["show-config", "--set", "grid.stages=2"])
    assert res.exit_code == 0, res.output
    body = "\n".join(line for line in res.output.splitlines() if not line.startswith("#"))
    assert tomllib.loads(body)["grid"]["stages"] == 2


def test_bad_config_exits_2_without_traceback():
    # a real process, so the exit code and stderr are what a user sees
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", "show-config", "--set", "dp.fraction=2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "dp.fraction" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_key_and_bad_grid_exit_2():
    runner = CliRunner()
    res = runner.invoke(main, ["show-config", "--set", "dp.tua=3"])
    assert res.exit_code == 2 and "did you mean dp.tau" in res.output
    res = runner.invoke(main, ["simulate", "--grid", "four-by-two"])
    assert res.exit_code == 2 and "--grid" in res.output
    # --steps 0 is a value like any other: refused, not taken for "not given" (300 steps)
    res = runner.invoke(main, ["simulate", "--steps", "0", "--out", "/nonexistent/never"])
    assert res.exit_code == 2 and "run.steps" in res.output, res.output


def test_the_simulators_noise_instrument_is_refused_by_the_processes(text_file, tmp_path):
    args = [
        "simulate",
        "--backend",
        "torch",
        "--steps",
        "1",
        "--out",
        str(tmp_path / "r"),
        "--set",
        f"data.path='{text_file}'",
        "--set",
        "dp.noise_codec=fp8_e4m3",
    ]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2 and "dp.noise_codec" in res.output and "logical" in res.output
    assert not (tmp_path / "r" / "config.toml").exists()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "hivemind", "logical"])
def test_simulate_runs_a_tiny_grid(text_file, tmp_path, backend):
    out = tmp_path / "run"
    res = CliRunner().invoke(
        main,
        [
            "simulate",
            "--backend",
            backend,
            "--grid",
            "2x2",
            "--steps",
            "4",
            "--out",
            str(out),
            "--set",
            f"data.path='{text_file}'",
            "--set",
            "model.n_layers=2",
            "--set",
            "model.d_model=16",
            "--set",
            "model.n_heads=2",
            "--set",
            "model.seq_len=16",
            "--set",
            "data.val_batches=2",
        ],
    )
    assert res.exit_code == 0, res.output
    assert (out / "summary.json").is_file() and (out / "config.toml").is_file()
    assert "val loss" in res.output
    if backend != "logical":  # every cell a process: per-cell metrics and the loss plot
        assert sorted(p.name for p in (out / "metrics").iterdir()) == [
            "0-0.jsonl",
            "0-1.jsonl",
            "1-0.jsonl",
            "1-1.jsonl",
        ]
        assert (out / "loss.png").stat().st_size > 0


def test_progress_bar_shows_no_eta_until_steps_were_timed():
    """The first steps' rate is mostly start-up: an ETA from it would be a wild promise."""
    from cli.report import ETA_AFTER_STEPS, progress_bar

    with progress_bar(100, "t", initial=40) as bar:  # a resumed run starts where it stopped
        assert bar.bar.n == 40
        bar.goto(40 + ETA_AFTER_STEPS - 1, 2.5)
        assert "remaining" not in bar.bar.bar_format
        bar.goto(40 + ETA_AFTER_STEPS)
        assert "remaining" in bar.bar.bar_format and bar.bar.n == 40 + ETA_AFTER_STEPS


def test_progress_bar_draws_its_last_step_once():
    """Every redraw is a line in a log: the 100% line was drawn by the last step and again by
    the close (with the whole run's rate)."""
    import io

    from cli.report import progress_bar

    log = io.StringIO()
    with progress_bar(10, "t", file=log) as bar:
        bar.bar.mininterval, bar.bar.miniters, bar.bar.dynamic_miniters = 0, 1, False
        for step in range(1, 11):
            bar.goto(step, 3.0 - step / 10)
        bar.goto(10)  # simulate's own goto(run.steps) after the grid finished
    lines = [line for line in log.getvalue().replace("\r", "\n").splitlines() if line.strip()]
    assert sum("10/10" in line for line in lines) == 1, lines
    assert any("9/10" in line for line in lines) and "loss=2.000" in lines[-1]


def test_summary_table_says_what_the_rounds_in_flight_are_and_what_was_refused():
    from cli.simulate import ROUNDS_NOTE, resumed_apart_note, summary_table

    summary = {
        "grid": "4x2",
        "steps": 300,
        "tokens": 307200,
        "tokens_per_s": 481.0,
        "fraction_of_ideal": 0.03,
        "val_loss": 2.7123,
        "val_bpb": 3.9131,
        "bytes": {"pp_per_replica_step": 393721, "dp_per_replica_step": 21124},
        "rounds": {
            "rounds_started": 2246,
            "rounds_applied": 2178,
            "rounds_partial": 3,
            "rounds_failed": 48,
        },
        "rejects": 90,
        "rejects_by_reason": {"stale": 7, "late": 83},
    }
    headers, rows = summary_table(summary)
    assert headers[-2:] == ["rounds started/applied/failed/in flight", "rejects"]
    assert rows[0][-2:] == ["2246/2178/48/20", "90 (late 83, stale 7)"]
    assert "in flight at the end" in ROUNDS_NOTE and "{tau}" in ROUNDS_NOTE
    no_rejects = {**summary, "rejects": 0, "rejects_by_reason": {}, "val_loss": None}
    row = summary_table(no_rejects)[1][0]
    assert row[-1] == "0" and row[headers.index("val loss")] == "n/a"
    note = resumed_apart_note({0: 102, 1: 121})
    assert "replica 0 from step 102, replica 1 from step 121" in note and "rounds_jumped" in note


def test_every_bench_command_comes_from_the_one_table():
    from cli.bench import COMMANDS, bench

    assert sorted(bench.commands) == sorted(c.name for c in COMMANDS)
    for entry in COMMANDS:
        cmd = bench.commands[entry.name]
        assert cmd.help == entry.run.__doc__ and cmd.help, entry.name
        names = {p.name for p in cmd.params}
        if entry.study is not None:  # a study's shared options, --out defaulting to its name
            assert {"config_files", "overrides", "quick", "out", "workers"} <= names
            out = next(p for p in cmd.params if p.name == "out")
            assert out.default == f"results/{entry.name}"
        elif entry.config:
            assert {"config_files", "overrides"} <= names


def test_a_bench_commands_user_error_is_one_line_and_exit_2():
    res = CliRunner().invoke(main, ["bench", "boundary", "--stages", "1", "--quick"])
    assert res.exit_code == 2
    assert res.output.strip() == "error: --stages 1: a pipeline needs P >= 2"
    res = CliRunner().invoke(main, ["bench", "boundary", "--arms", "learned 9x", "--quick"])
    assert res.exit_code == 2 and res.output.startswith("error: --arms 'learned 9x': choose from")
    res = CliRunner().invoke(main, ["bench", "convergence", "--tune-seeds", "0"])
    assert res.exit_code == 2 and "go with --tune" in res.output


def test_a_missing_resume_directory_is_one_line_naming_the_option(tmp_path):
    """Not click's four-line usage error: one line, exit 2, the option and what to give it."""
    missing = tmp_path / "no" / "such"
    res = CliRunner().invoke(main, ["simulate", "--resume", str(missing)])
    assert res.exit_code == 2
    lines = res.output.strip().splitlines()
    assert len(lines) == 1, res.output
    assert lines[0].startswith(f"error: --resume {missing}: no such directory")
    assert "stopped run" in lines[0]
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    res = CliRunner().invoke(main, ["train", "--resume", str(missing)], env=env)
    assert (
        res.exit_code == 2 and res.output.strip() == f"error: --resume {missing}: no such directory"
    )


def test_a_missing_init_from_directory_is_one_line_naming_the_key(tmp_path):
    missing = tmp_path / "no-model"
    res = CliRunner().invoke(main, ["simulate", "--init-from", str(missing), "--steps", "2"])
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and "model.init_from" in lines[0] and "config.json" in lines[0]


def test_an_emulated_runs_table_says_no_math_ran_and_its_plot_has_no_empty_legend(
    monkeypatch, tmp_path
):
    """Emulated compute: the loss under the table is the untrained model's, and a line says
    so; loss.png has no loss curve to label, so no legend (matplotlib warned of one)."""
    import json
    import warnings

    from cli.simulate import EMULATED_NOTE
    from mesh.runtime.launch import GridRun

    def fake_grid(cfg, out, **kwargs):  # the cells' rows as an emulated 2x1 grid writes them
        (out / "metrics").mkdir(parents=True, exist_ok=True)
        for j in range(2):
            rows = [{"event": "started", "step": 0}] + [
                {"step": s, "time_s": 0.1 * s, "microbatches": s, "busy_s": 0.0}
                for s in range(1, 6)
            ]
            text = "".join(json.dumps(r) + "\n" for r in rows)
            (out / "metrics" / f"{j}-0.jsonl").write_text(text)
        return GridRun({(0, 0): 0, (1, 0): 0}, wall_s=1.0, interrupted=False)

    monkeypatch.setattr("cli.simulate.run_grid", fake_grid)
    out = tmp_path / "run"
    args = ["simulate", "--grid", "2x1", "--steps", "5", "--out", str(out)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = CliRunner().invoke(main, [*args, "--set", "emulation.compute='emulated'"])
    assert res.exit_code == 0, res.output
    assert EMULATED_NOTE in res.output and EMULATED_NOTE in (out / "table.md").read_text()
    assert "untrained" in EMULATED_NOTE and "emulation.compute = emulated" in EMULATED_NOTE
    assert not [w for w in caught if "legend" in str(w.message)], [str(w.message) for w in caught]


def test_a_plot_with_no_points_draws_no_legend(tmp_path):
    pytest.importorskip("matplotlib")
    import warnings

    from mesh.report import plot_curves

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "No artists with labels found"
        plot_curves(
            {"replica 0 train": [], "replica 0 validation": []}, tmp_path / "a.png", "x", "y", "t"
        )
        plot_curves(
            {"replica 0 train": [(1.0, 2.0), (2.0, 1.5)]}, tmp_path / "b.png", "x", "y", "t"
        )
    assert (tmp_path / "a.png").stat().st_size > 0 and (tmp_path / "b.png").stat().st_size > 0
