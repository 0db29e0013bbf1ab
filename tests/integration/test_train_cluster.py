"""`meshtrain train` as a cluster runs it: two "nodes" as two torchrun launches on 127.0.0.1 and
127.0.0.2 (c10d rendezvous, two processes each) form a 2x2 grid, one replica per node; srun's
environment, set by hand, runs one too. A node killed whole mid-run: the other node's replica
trains on, and the node launched again rejoins with its cells' state downloaded from the live
peers of their stages. Under srun, the node of rank 0 (which serves the rendezvous store)
killed: the other replica trains to its end, and says that no node can rejoin."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import helpers
import pytest
import torch
from click.testing import CliRunner
from train_nodes import Node, events, final_step, leftover, lives, sets, step, updates

from cli.main import main
from comms.build import free_port
from mesh.config import load_config
from mesh.engine.sim import GridSim
from mesh.runtime.checkpoint import checkpoint_path
from mesh.testing.local_peers import finish, meshtrain

pytestmark = pytest.mark.integration

RUN_S = 300  # a hang guard for one grid, far above the ~30 s one takes on a loaded 2-core box
TIMEOUTS = ["transport.recv_timeout_s=60", "transport.round_timeout_s=60"]
TINY_LLAMA = [
    *helpers.TINY,
    "model.arch='llama'",
    "model.n_kv_heads=1",
    "model.intermediate_size=24",
]


def _nodes(tmp_path) -> tuple[Node, Node]:
    return (
        Node(0, "127.0.0.1", tmp_path / "n0", tmp_path / "n0.log"),
        Node(1, "127.0.0.2", tmp_path / "n1", tmp_path / "n1.log"),
    )


@pytest.mark.timeout(2 * RUN_S)
def test_two_torchrun_nodes_train_a_2x2_grid_as_the_simulator_does(tmp_path, text_file):
    """Each node runs one replica (ranks 0-1: s0r0 s1r0; 2-3: s0r1 s1r1) and writes only its
    cells; the replicas average across the nodes; with dp.strict_tau every cell ends with the
    weights the one-process simulator computes; the two node directories export as one."""
    keys = [
        *TINY_LLAMA,
        f"data.path='{text_file}'",
        "run.steps=6",
        "dp.strict_tau=true",
        "dp.tau=2",
        "dp.fraction=0.25",
        *TIMEOUTS,
    ]
    n0, n1 = _nodes(tmp_path)
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        for node in (n0, n1):
            node.start(endpoint, ["--grid", "2x2", *sets(*keys)], env)
        codes = [n0.wait(RUN_S), n1.wait(RUN_S)]
    finally:
        n0.kill(), n1.kill()
    logs = n0.log.read_text() + n1.log.read_text()
    assert codes == [0, 0], logs[-3000:]
    for cell in ("s0r0", "s1r0", "s0r1", "s1r1"):
        assert f"cell {cell}: trained to step 6 of 6" in logs, logs[-3000:]
    assert (n0.cells(), n1.cells()) == ({"0-0", "1-0"}, {"0-1", "1-1"})
    cfg = load_config([n0.out / "config.toml"])
    sim = GridSim(cfg)
    for _ in range(6):
        sim.step()
    for node, i in ((n0, 0), (n1, 1)):
        for j in range(2):
            (life,) = lives(node.rows(j, i))
            assert updates(life) == list(range(1, 7)) and final_step(life) == 6
            last = [r for r in life if "rounds_applied" in r][-1]
            assert last["rounds_applied"] >= 2 and last["bytes_sent"]["average"] > 0, last
            state = torch.load(checkpoint_path(node.out, j, i, 6), weights_only=True)
            torch.testing.assert_close(state["flat"], sim.cells[i][j].flat, rtol=1e-5, atol=1e-6)
    hf = tmp_path / "hf"
    res = CliRunner().invoke(
        main, ["export", str(n0.out), str(n1.out), "--out", str(hf), "--replica", "1"]
    )
    assert res.exit_code == 0, res.output
    assert json.loads((hf / "meshtrain.json").read_text())["step"] == 6


@pytest.mark.timeout(4 * RUN_S)
def test_a_dead_cell_and_a_lost_node_rejoin_from_state_their_stage_peers_send(tmp_path, text_file):
    """torchrun --max-restarts 1. First s1r1 alone SIGKILLed: its neighbour stops, and torchrun
    starts every worker of the job again (torchelastic's rule); each replica resumes from the
    newest step its cells share, and replica 1, behind, takes its stage peers' state: all four
    cells train on from one step. Then node 1 (replica 1) SIGKILLed whole, torchrun and cells:
    replica 0 trains on alone. Node 1 launched again (the same command): torchrun starts every
    worker again, replica 0 from its newest shared step, replica 1 from its own older
    checkpoint and then from the state each of its cells downloads from its stage's cell of
    replica 0: every cell trains from that one step to the last, and nothing is left running.
    Emulated compute (real payloads, sleeps for the math) keeps the replicas training through
    the restarts on a loaded 2-core box."""
    steps = 200
    keys = [
        *helpers.TINY,
        f"data.path='{text_file}'",
        f"run.steps={steps}",
        "checkpoint.every=5",
        "elastic.max_lag_steps=0",
        "emulation.compute='emulated'",
        "emulation.forward_ms=80",
        "emulation.backward_ms=160",
        *TIMEOUTS,
    ]
    args, restarts = ["--grid", "2x2", *sets(*keys)], ["--max-restarts", "1"]
    n0, n1 = _nodes(tmp_path)
    cells = [(n0, 0, 0), (n0, 1, 0), (n1, 0, 1), (n1, 1, 1)]
    endpoint = f"127.0.0.1:{free_port()}"
    # torch's shared rendezvous store cannot take a node that joins later (docs/cluster.md)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

    def life(node: Node, j: int, i: int, k: int) -> list[dict]:
        got = lives(node.rows(j, i))
        return got[k] if len(got) > k else []

    try:
        for node in (n0, n1):
            node.start(endpoint, args, env, launcher=restarts)
        helpers.wait_for(lambda: step(n1.rows(1, 1)) >= 8, RUN_S, "replica 1 past a checkpoint")
        os.kill(events(n1.rows(1, 1), "started")[-1]["pid"], signal.SIGKILL)
        helpers.wait_for(
            lambda: all(updates(life(*c, 1)) for c in cells), RUN_S, "every cell training again"
        )
        again = updates(life(n1, 1, 1, 1))[0]
        helpers.wait_for(
            lambda: step(life(n1, 1, 1, 1)) >= again + 8, RUN_S, "replica 1 past a checkpoint again"
        )
        n1.kill()
        killed_at = step(n0.rows(1, 0))
        helpers.wait_for(
            lambda: step(n0.rows(1, 0)) >= killed_at + 10, RUN_S, "replica 0 training on alone"
        )
        n1.start(endpoint, args, env, launcher=restarts)
        codes = [n0.wait(2 * RUN_S), n1.wait(2 * RUN_S)]
    finally:
        n0.kill(), n1.kill()
    logs = n0.log.read_text() + n1.log.read_text()
    assert codes == [0, 0], logs[-3000:]
    assert not leftover(n0, n1)
    # the dead cell: every worker started again, all four from replica 0's newest shared step
    starts = {updates(life(*c, 1))[0] - 1 for c in cells}
    assert len(starts) == 1, starts
    (start,) = starts
    for j in range(2):
        first = life(n0, j, 0, 0)
        assert step(first) - 5 <= start <= step(first)
        # the restart's stop: at one step with the run's end rows (cluster_stop.py), or where
        # it found the cell
        assert final_step(first) in (None, step(first))
        assert events(life(n0, j, 0, 1), "resumed")[0]["step"] == start
        (loaded,) = events(life(n1, j, 1, 1), "state_loaded")
        assert loaded["from_cell"] == f"s{j}r0" and loaded["step"] == start, loaded
        assert loaded["from_step"] < start  # replica 1 was behind: its killed cell's checkpoint
    # the lost node: replica 0 trained on alone, then all four from its newest shared step
    for j in range(2):
        second, third = life(n0, j, 0, 1), life(n0, j, 0, 2)
        assert step(second) >= killed_at + 10
        (resumed,) = events(third, "resumed")
        rejoin = resumed["step"]
        assert step(second) - 5 <= rejoin <= step(second), (rejoin, step(second))
        assert updates(third) == list(range(rejoin + 1, steps + 1)) and final_step(third) == steps
        old, new = life(n1, j, 1, 1), life(n1, j, 1, 2)
        assert step(old) < killed_at + 10 and final_step(old) is None  # killed: no last row
        (loaded,) = events(new, "state_loaded")
        assert loaded["from_cell"] == f"s{j}r0" and loaded["from_step"] <= step(old)
        assert loaded["step"] == rejoin, (loaded, rejoin)
        assert updates(new) == list(range(rejoin + 1, steps + 1)) and final_step(new) == steps


def _srun_env(tasks: int = 4) -> dict[str, str]:
    """What srun -N 2 -n 4 gives every task, with a node list whose first node is this
    machine; the port of the store rank 0 serves is free here."""
    return {
        "SLURM_NTASKS": str(tasks),
        "SLURM_NNODES": "2",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        "SLURM_JOB_NODELIST": "localhost",
        "MASTER_PORT": str(free_port()),
    }


def _srun_tasks(out, keys: list[str]) -> list:
    """The four tasks of a 2x2 grid, two on each "node" (127.0.0.1, 127.0.0.2), as srun
    starts them: task k is told only its SLURM_PROCID, SLURM_LOCALID and SLURM_NODEID."""
    base, procs = _srun_env(), []
    for rank in range(4):
        env = {
            **base,
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank % 2),
            "SLURM_NODEID": str(rank // 2),
        }
        host = f"127.0.0.{1 + rank // 2}"
        procs.append(
            meshtrain(
                "train",
                "--grid",
                "2x2",
                "--out",
                str(out),
                "--host",
                host,
                *sets(*keys),
                key=None,
                env_extra=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    return procs


@pytest.mark.timeout(2 * RUN_S)
def test_srun_environment_runs_the_grid_with_rank_0_serving_the_store(tmp_path, text_file):
    """Four processes given only what srun gives each task (SLURM_PROCID, SLURM_NTASKS,
    SLURM_LOCALID, the nodes and tasks per node, a node list whose first node is this machine):
    each takes the documented cell, rank 0 serves the store the links meet at, and the grid
    trains to its last step; a task of the wrong world is refused in one line."""
    keys = [*helpers.TINY, f"data.path='{text_file}'", "run.steps=10", *TIMEOUTS]
    procs = _srun_tasks(tmp_path / "shared", keys)  # one directory: a shared filesystem
    outputs = [finish(p, RUN_S)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, outputs
    for rank, text in enumerate(outputs):
        cell = f"s{rank % 2}r{rank // 2}"
        assert f"rank {rank} of 4 (slurm, local rank {rank % 2}): cell {cell}" in text, text
        assert f"cell {cell}: trained to step 10 of 10" in text, text
    bad = {**_srun_env(tasks=3), "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    p = meshtrain(
        "train",
        "--grid",
        "2x2",
        "--out",
        str(tmp_path / "bad"),
        *sets(*keys),
        key=None,
        env_extra=bad,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    text = finish(p, RUN_S)[0]
    assert p.returncode == 2 and text.strip().count("\n") == 0, text
    assert "4 cells but WORLD_SIZE is 3" in text


@pytest.mark.timeout(2 * RUN_S)
def test_losing_the_store_host_leaves_the_other_replica_training_and_says_so(tmp_path, text_file):
    """srun's node 0 (ranks 0-1: replica 0, and rank 0 serves the rendezvous store) SIGKILLed:
    node 1's replica trains to its last step over the links it has, and each of its cells says
    once, in one line, that the store is gone and that no node can rejoin."""
    steps = 80
    keys = [
        *helpers.TINY,
        f"data.path='{text_file}'",
        f"run.steps={steps}",
        "emulation.compute='emulated'",
        "emulation.forward_ms=80",
        "emulation.backward_ms=160",
        *TIMEOUTS,
    ]
    out = tmp_path / "shared"
    procs = _srun_tasks(out, keys)
    try:
        rows = lambda: Node(1, "", out, tmp_path / "unused").rows(1, 1)  # noqa: E731
        helpers.wait_for(lambda: step(rows()) >= 10, RUN_S, "replica 1 training")
        for p in procs[:2]:
            p.kill()
        killed_at = step(rows())
        outputs = [finish(p, RUN_S)[0] for p in procs[2:]]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert killed_at < steps - 20
    assert [p.returncode for p in procs[2:]] == [0, 0], outputs
    for j, text in enumerate(outputs):
        assert f"cell s{j}r1: trained to step {steps} of {steps}" in text, text
        lost = [ln for ln in text.splitlines() if ln.startswith(f"cell s{j}r1: the rendezvous")]
        assert len(lost) == 1 and "no node can rejoin this job" in lost[0], text
        (life,) = lives(Node(1, "", out, tmp_path / "unused").rows(j, 1))
        assert updates(life) == list(range(1, steps + 1))
