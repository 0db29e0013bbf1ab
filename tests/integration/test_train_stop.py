"""`meshtrain train` stopped mid-run: each replica's cells agree on one step in the rendezvous
store (mesh/runtime/cluster_stop.py), every cell trains up to it and saves it, each says that
step, and the same command continues from there, losing nothing any cell completed. A node
lost: the survivors say so in one line each, not in c10d's warnings."""

from __future__ import annotations

import os
import re
import signal
import subprocess

import helpers
import pytest
from train_nodes import Node, events, final_step, leftover, lives, sets, step, updates

from comms.build import free_port
from mesh.runtime.checkpoint import saved_steps
from mesh.testing.local_peers import finish, meshtrain

pytestmark = pytest.mark.integration

RUN_S = 300  # a hang guard for one launch, far above the ~40 s one takes on a loaded 2-core box
STEPS = 80
CELLS = [(0, 0), (1, 0), (0, 1), (1, 1)]  # (stage, replica): replica 0 on node 0, 1 on node 1


@pytest.mark.timeout(3 * RUN_S)
def test_sigterm_stops_each_replica_at_one_step_and_the_command_continues(tmp_path, text_file):
    """Two torchrun nodes (127.0.0.1, 127.0.0.2) train a 2x2 grid, no periodic checkpoint;
    both torchruns SIGTERMed mid-run (as a job is stopped, or torchelastic restarts it): each
    replica's cells name one stop step, newer than any step either had logged, each saves it
    and prints it; launched again with the same command, every cell resumes from its
    replica's step and trains to the end."""
    keys = [
        *helpers.TINY,
        f"data.path='{text_file}'",
        f"run.steps={STEPS}",
        "checkpoint.every=1000",
        "emulation.compute='emulated'",
        "emulation.forward_ms=80",
        "emulation.backward_ms=160",
        "transport.recv_timeout_s=60",
        "transport.round_timeout_s=60",
    ]
    args = ["--grid", "2x2", *sets(*keys)]
    n0 = Node(0, "127.0.0.1", tmp_path / "n0", tmp_path / "n0.log")
    n1 = Node(1, "127.0.0.2", tmp_path / "n1", tmp_path / "n1.log")
    node = {0: n0, 1: n1}
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

    def first(j: int, i: int) -> list[dict]:
        got = lives(node[i].rows(j, i))
        return got[0] if got else []

    try:
        for n in (n0, n1):
            n.start(endpoint, args, env)
        helpers.wait_for(
            lambda: all(step(first(j, i)) >= 10 for j, i in CELLS), RUN_S, "every cell training"
        )
        before = {(j, i): step(first(j, i)) for j, i in CELLS}
        for n in (n0, n1):
            os.kill(n.proc.pid, signal.SIGTERM)
        for n in (n0, n1):
            n.wait(RUN_S)
        stopped_log = n0.log.read_text() + n1.log.read_text()
        at = {}
        for i in (0, 1):
            saved = {(j, i): saved_steps(node[i].out, j, i) for j in (0, 1)}
            assert saved[(0, i)] == saved[(1, i)] and len(saved[(0, i)]) == 1, saved
            at[i] = saved[(0, i)][0]
        for n in (n0, n1):
            n.start(endpoint, args, env)
        codes = [n0.wait(RUN_S), n1.wait(RUN_S)]
    finally:
        n0.kill(), n1.kill()
    logs = n0.log.read_text() + n1.log.read_text()
    assert codes == [0, 0], logs[-3000:]
    assert not leftover(n0, n1)
    for j, i in CELLS:
        old, new = lives(node[i].rows(j, i))
        # one step per replica, past every update any of its cells completed before the stop
        assert max(before[(k, i)] for k in (0, 1)) < at[i] < STEPS, (at, before)
        assert step(old) == final_step(old) == at[i], (at, old[-3:])  # none lost, none past
        assert [e["at"] for e in events(old, "stop_step")] == [at[i]], old[-3:]
        said = re.findall(rf"cell s{j}r{i}: stopped at step (\d+), checkpoint saved", stopped_log)
        assert said == [str(at[i])], stopped_log[-3000:]
        # the same command: from that step (a replica behind then takes its stage peer's state)
        assert events(new, "resumed")[0]["step"] == at[i], new[:3]
        loaded = events(new, "state_loaded")
        start = loaded[0]["step"] if loaded else at[i]
        assert updates(new) == list(range(start + 1, STEPS + 1)), updates(new)[:3]
        assert final_step(new) == STEPS
        assert f"cell s{j}r{i}: trained to step {STEPS} of {STEPS}" in logs


@pytest.mark.timeout(3 * RUN_S)
def test_a_lost_store_host_is_one_line_of_ours_not_c10d_frames(tmp_path, text_file):
    """Four `meshtrain train` processes as srun starts them (fresh interpreters: c10d's log
    level is read when torch loads); the two of node 0, whose rank 0 serves the store,
    SIGKILLed: each survivor says so in one line that names the store and what to do, and
    prints none of c10d's warnings with their C++ frames (recvValue failed ... Broken pipe)."""
    keys = [
        *helpers.TINY,
        f"data.path='{text_file}'",
        f"run.steps={STEPS}",
        "emulation.compute='emulated'",
        "emulation.forward_ms=80",
        "emulation.backward_ms=160",
        "transport.recv_timeout_s=60",
        "transport.round_timeout_s=60",
    ]
    out = tmp_path / "shared"
    base = {
        "SLURM_NTASKS": "4",
        "SLURM_NNODES": "2",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        "SLURM_JOB_NODELIST": "localhost",
        "MASTER_PORT": str(free_port()),
    }
    procs = []
    try:
        for rank in range(4):
            place = {"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % 2)}
            procs.append(
                meshtrain(
                    "train",
                    *["--grid", "2x2", "--out", str(out), "--host", f"127.0.0.{1 + rank // 2}"],
                    *sets(*keys),
                    key=None,
                    env_extra={**base, **place, "SLURM_NODEID": str(rank // 2)},
                    fresh=True,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                )
            )
        cell = Node(1, "", out, tmp_path / "unused")
        helpers.wait_for(lambda: step(cell.rows(1, 1)) >= 10, RUN_S, "replica 1 training")
        for p in procs[:2]:
            p.kill()
        outputs = [finish(p, RUN_S)[0] for p in procs[2:]]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    assert [p.returncode for p in procs[2:]] == [0, 0], outputs
    for j, text in enumerate(outputs):
        lost = [ln for ln in text.splitlines() if "rendezvous store at localhost:" in ln]
        assert len(lost) == 1 and lost[0].startswith(f"cell s{j}r1: "), text
        assert "launch every node again" in lost[0], lost
        assert "[c10d]" not in text and "frame #" not in text, text[-3000:]
