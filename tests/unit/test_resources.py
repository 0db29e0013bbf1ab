"""A grid this machine cannot hold is refused before any cell starts (`simulate` on torch and
hivemind, `train` per node), in one line naming the memory and threads its cells need against
what the machine has; --skip-resource-check starts it anyway (cli/resources.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

import cli.resources as resources
from cli.main import main
from cli.resources import (
    CELL_PROCESS_BYTES,
    GB,
    LAUNCH_ONCE_BYTES,
    Machine,
    check_simulate,
    check_train,
    grid_needs,
    node_cells,
    read_machine,
    siblings_private_bytes,
)
from mesh.config import ConfigError, load_config
from mesh.engine.plan import plan_cell
from mesh.runtime.cluster import Place, cell_of_rank
from mesh.runtime.launch import grid_cells

# a 2-core box with 23.4 GB free, as a user's laptop or this project's CI box
SMALL = Machine(23.4 * GB, "MemAvailable", 32_000, "the kernel's pid_max", 2)


@pytest.fixture
def small_machine(monkeypatch):
    monkeypatch.setattr(resources, "read_machine", lambda: SMALL)


def _no_cells(*args, **kwargs):
    raise AssertionError("a cell process was started")


def _cfg(*sets):
    return load_config([], list(sets))


def test_simulate_refuses_a_grid_this_machine_cannot_hold_before_anything_starts(
    small_machine, monkeypatch, tmp_path, text_file
):
    """`simulate --grid 2x300` began 600 cell processes; it is one line and exit 2, naming
    what the grid needs and what the machine has, and nothing is started or written."""
    monkeypatch.setattr("cli.simulate.run_grid", _no_cells)
    for backend in ("torch", "hivemind"):
        out = tmp_path / backend
        res = CliRunner().invoke(
            main,
            ["simulate", "--grid", "2x300", "--backend", backend, "--out", str(out)]
            + ["--set", f"data.path='{text_file}'"],
        )
        assert res.exit_code == 2, res.output
        lines = res.output.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in res.output, res.output
        line = lines[0]
        assert line.startswith("error: a 2x300 grid starts 600 cell processes on this machine")
        assert "23.4 GB of memory available (MemAvailable)" in line
        assert "room for 32,000 more threads" in line and "2 cores" in line
        assert "--skip-resource-check" in line
        assert not out.exists()


def test_skip_resource_check_starts_the_grid_anyway(small_machine, monkeypatch, tmp_path):
    def started(*args, **kwargs):
        raise ConfigError("the grid's cells start here")

    monkeypatch.setattr("cli.simulate.run_grid", started)
    args = ["simulate", "--grid", "2x300", "--set", "emulation.compute='emulated'"]
    res = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "r")])
    assert res.exit_code == 2 and "--skip-resource-check" in res.output, res.output
    res = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "r"), "--skip-resource-check"])
    assert "the grid's cells start here" in res.output, res.output


def test_the_logical_backend_one_process_is_not_checked(small_machine, monkeypatch, tmp_path):
    def ran(*args, **kwargs):
        raise ConfigError("the logical grid runs")

    monkeypatch.setattr("cli.logical.simulate_logical", ran)
    res = CliRunner().invoke(
        main, ["simulate", "--grid", "2x300", "--backend", "logical", "--out", str(tmp_path)]
    )
    assert "the logical grid runs" in res.output, res.output


def test_the_rule_a_cells_plan_and_its_process_and_threads_by_link():
    """Memory: each cell's plan (host memory: CPU or emulated compute) + its process (0.15 GB
    on torch, 0.35 GB on hivemind) + what simulate starts once; threads: 6 a torch cell and 4
    a link (4x2: the end stages 2 links, the middle ones 3), 32 a hivemind cell."""
    cfg = _cfg("runtime.device='cpu'")  # the demo, 4x2
    cells = grid_cells(cfg)
    plans = sum(plan_cell(cfg, j).total_bytes for j, _ in cells)
    needs = grid_needs(cfg, cells, CELL_PROCESS_BYTES["torch"], LAUNCH_ONCE_BYTES["torch"])
    assert needs.cells == 8 and needs.state == plans
    assert needs.memory == pytest.approx(plans + 8 * 0.15 * GB + 0.25 * GB)
    assert needs.threads == 6 * 8 + 4 * (2 * (2 + 3 + 3 + 2))
    hive = grid_needs(
        _cfg("transport.backend='hivemind'", "runtime.device='cpu'"), cells, 0.35 * GB
    )
    assert hive.threads == 32 * 8
    # on a GPU the cells' state is the GPU's: only their processes count here
    gpu = grid_needs(_cfg("runtime.device='cuda'"), cells, CELL_PROCESS_BYTES["torch"])
    assert gpu.state == 0 and gpu.memory == pytest.approx(8 * 0.15 * GB)
    check_simulate(cfg, cells, SMALL)  # the demo fits a small box with room to spare
    tight = Machine(1.0 * GB, "MemAvailable", 32_000, "pid_max", 2)
    with pytest.raises(ConfigError, match=r"about 1\.\d+ GB of memory"):
        check_simulate(cfg, cells, tight)
    few_threads = Machine(100 * GB, "MemAvailable", 100, "RLIMIT_NPROC", 2)
    with pytest.raises(ConfigError, match=r"128 threads.*room for 100 more threads"):
        check_simulate(cfg, cells, few_threads)
    unknown = Machine(None, "", None, "", 2)  # nothing readable (not Linux): not checked
    check_simulate(_cfg("grid.stages=2", "grid.replicas=300"), [(0, 0)] * 600, unknown)


def test_the_machine_is_read_from_meminfo_the_cgroup_and_the_kernels_limits(tmp_path):
    proc, cg = tmp_path / "proc", tmp_path / "sys/fs/cgroup"
    (proc / "sys/kernel").mkdir(parents=True)
    cg.mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal: 24000000 kB\nMemAvailable: 20000000 kB\n")
    (proc / "loadavg").write_text("0.5 0.4 0.3 2/150 999\n")
    (proc / "sys/kernel/threads-max").write_text("190000\n")
    (proc / "sys/kernel/pid_max").write_text("1150\n")
    have = read_machine(tmp_path)
    assert have.memory == 20000000 * 1024 and have.memory_from == "MemAvailable"
    assert have.threads == 1000 and have.threads_from == "the kernel's pid_max"
    # a container's memory limit that leaves less than MemAvailable says so
    (cg / "memory.max").write_text(f"{8 * 2**30}\n")
    (cg / "memory.current").write_text(f"{2 * 2**30}\n")
    (cg / "pids.max").write_text("500\n")
    (cg / "pids.current").write_text("100\n")
    have = read_machine(tmp_path)
    assert have.memory == 6 * 2**30 and "cgroup" in have.memory_from
    assert have.threads == 400 and have.threads_from == "the cgroup's pids.max"
    (cg / "memory.max").write_text("max\n")  # no limit
    assert read_machine(tmp_path).memory == 20000000 * 1024


def test_train_checks_the_cells_of_its_own_node():
    """A node of 8 ranks starts 8 cells: the ones cell_of_rank gives its ranks."""
    cfg = _cfg("grid.stages=4", "grid.replicas=4")
    place = Place("torchrun", 9, 16, 1, 8, 2, "127.0.0.1", 29500, True)
    assert node_cells(cfg, place) == [cell_of_rank(r, 4, 4, 8) for r in range(8, 16)]
    uneven = Place("slurm", 3, 16, 3, None, 3, "127.0.0.1", 29500, False)
    assert len(node_cells(cfg, uneven)) == 6  # the largest node's share: ceil(16 / 3)
    big = _cfg("grid.stages=2", "grid.replicas=300", "runtime.device='cpu'")
    one_node = Place("torchrun", 0, 600, 0, 600, 1, "127.0.0.1", 29500, True)
    with pytest.raises(ConfigError, match="starts 600 cell processes on this node"):
        check_train(big, one_node, SMALL)
    eight = Place("torchrun", 0, 600, 0, 8, 75, "127.0.0.1", 29500, True)
    check_train(big, eight, SMALL)  # 8 cells a node fit


def test_train_refuses_a_node_it_cannot_hold_in_one_line(small_machine, monkeypatch, tmp_path):
    monkeypatch.setattr("cli.train._run_cell_process", _no_cells)
    env = {
        "RANK": "0",
        "WORLD_SIZE": "600",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "600",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }
    args = ["train", "--grid", "2x300", "--set", "emulation.compute='emulated'"]
    res = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "r")], env=env)
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and "600 cell processes on this node" in lines[0], res.output
    assert not (tmp_path / "r").exists()


@pytest.mark.skipif(
    not Path("/proc/self/smaps_rollup").exists(), reason="reads Linux's /proc/PID/smaps_rollup"
)
def test_a_train_process_counts_what_its_running_siblings_hold():
    """The launcher's other children already hold part of what the check predicts: their
    private memory counts as the run's (here: this process's own, at least)."""
    held = siblings_private_bytes()
    assert held and all(b >= 0 for b in held) and max(held) > 10e6
