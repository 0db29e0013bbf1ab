"""`meshtrain train`'s place in a cluster: torchrun's and SLURM's environments -> rank, node,
cell, GPU and store (mesh/runtime/cluster.py), and the refusals, each in one line."""

from __future__ import annotations

import ipaddress
import socket

import pytest
from click.testing import CliRunner

from cli.main import main
from mesh.config import ConfigError
from mesh.runtime.cluster import (
    DEFAULT_PORT,
    Place,
    cell_of_rank,
    check_world,
    first_node,
    gpu_index,
    node_address,
    place_from_env,
    placement_table,
    tasks_per_node,
)
from mesh.runtime.cluster_start import donors_ahead


def torchrun_env(rank: int, world: int = 8, per_node: int = 4, **extra: str) -> dict[str, str]:
    """What torchrun --nnodes world/per_node --nproc-per-node per_node gives rank `rank`."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank % per_node),
        "LOCAL_WORLD_SIZE": str(per_node),
        "GROUP_RANK": str(rank // per_node),
        "GROUP_WORLD_SIZE": str(world // per_node),
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "41234",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        **extra,
    }


def slurm_env(procid: int, ntasks: int = 8, nodes: int = 2, **extra: str) -> dict[str, str]:
    """What srun -N nodes -n ntasks (block distribution) gives task `procid`."""
    per = ntasks // nodes
    return {
        "SLURM_PROCID": str(procid),
        "SLURM_NTASKS": str(ntasks),
        "SLURM_LOCALID": str(procid % per),
        "SLURM_NODEID": str(procid // per),
        "SLURM_NNODES": str(nodes),
        "SLURM_STEP_TASKS_PER_NODE": f"{per}(x{nodes})",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        **extra,
    }


def test_torchrun_env_gives_rank_node_and_the_agents_store():
    place = place_from_env(torchrun_env(5))
    assert place == Place("torchrun", 5, 8, 1, 4, 2, "10.0.0.1", 41234, True)
    assert not place.serves_store  # torchrun's agent serves it
    # torchrun with its store not shared (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): rank 0 serves
    own = torchrun_env(0, TORCHELASTIC_USE_AGENT_STORE="False")
    assert (
        place_from_env(own).serves_store and not place_from_env({**own, "RANK": "1"}).serves_store
    )


def test_slurm_env_gives_the_first_node_and_rank_0_serves_the_store():
    place = place_from_env(slurm_env(6))
    assert place == Place("slurm", 6, 8, 2, 4, 2, "gpu07", DEFAULT_PORT, False)
    assert place_from_env(slurm_env(0)).serves_store
    # MASTER_ADDR / MASTER_PORT set by the user win; torchrun's variables win over SLURM's
    mine = place_from_env(slurm_env(1, MASTER_ADDR="head", MASTER_PORT="3000"))
    assert (mine.store_host, mine.store_port) == ("head", 3000)
    both = place_from_env({**slurm_env(1), **torchrun_env(3)})
    assert (both.launcher, both.rank) == ("torchrun", 3)


@pytest.mark.parametrize(
    "nodelist, first",
    [
        ("node01", "node01"),
        ("node[01-04]", "node01"),
        ("node[07,01-03]", "node07"),
        ("gpu[1-2]-ib,cpu3", "gpu1-ib"),
        ("rack[1-2]-n[01-02]", "rack1-n01"),
        ("a,b[3-4]", "a"),
        ("10.0.0.5", "10.0.0.5"),
    ],
)
def test_first_node_of_slurm_node_lists(nodelist, first):
    assert first_node(nodelist) == first


@pytest.mark.parametrize("bad", ["", "node[", "node[x-2]", "node[]"])
def test_a_node_list_that_cannot_be_read_is_refused(bad):
    with pytest.raises(ConfigError, match="SLURM node list"):
        first_node(bad)


def test_tasks_per_node_when_every_node_has_the_same():
    assert tasks_per_node("4(x2)") == 4
    assert tasks_per_node("4,4") == 4
    assert tasks_per_node("2(x3),2") == 2
    assert tasks_per_node("4,3") is None  # nodes of different sizes: replica-major
    assert tasks_per_node("four") is None
    assert place_from_env(slurm_env(0, SLURM_STEP_TASKS_PER_NODE="5,3")).ranks_per_node is None


@pytest.mark.parametrize(
    "env, key",
    [
        ({}, "torchrun or srun"),
        ({"RANK": "0"}, "WORLD_SIZE is not set"),
        (torchrun_env(0, RANK="8"), "RANK='8'"),
        (torchrun_env(0, WORLD_SIZE="x"), "WORLD_SIZE='x'"),
        (torchrun_env(0, MASTER_PORT="99999"), "MASTER_PORT='99999'"),
        ({k: v for k, v in slurm_env(0).items() if k != "SLURM_JOB_NODELIST"}, "NODELIST"),
    ],
)
def test_a_missing_or_malformed_variable_is_named(env, key):
    with pytest.raises(ConfigError, match=key.replace("(", r"\(").replace("?", r"\?")) as e:
        place_from_env(env)
    assert "\n" not in str(e.value)


def test_every_rank_takes_one_cell_and_rank_0_is_s0r0():
    for P in range(1, 7):
        for m in range(1, 7):
            for L in {None, 1, 2, 3, 4, 6, 8, P * m}:
                cells = [cell_of_rank(r, P, m, L) for r in range(P * m)]
                assert sorted(cells) == [(j, i) for j in range(P) for i in range(m)], (P, m, L)
                assert cells[0] == (0, 0)


def test_a_replica_stays_on_its_node_when_the_stages_divide_the_node():
    # 4x4 on nodes of 8: two whole replicas per node, stages in order
    for P, m, L in [(4, 4, 8), (2, 4, 4), (4, 2, 4), (2, 2, 2), (3, 4, 6)]:
        for r in range(P * m):
            j, i = cell_of_rank(r, P, m, L)
            assert r // L == (i * P) // L, (P, m, L, r)  # the replica's node
            assert (j, i) == (r % P, r // P)  # and the same as replica-major here


def test_replicas_fill_whole_nodes_first_when_the_stages_do_not_divide_them():
    # 3 stages, 4 replicas, nodes of 4 (the --placement table in docs/cluster.md): three whole
    # replicas, one on each node, and the fourth over the spare slot of every node
    rows = placement_table(3, 4, 4)
    assert [r[2] for r in rows] == [
        "s0r0",
        "s1r0",
        "s2r0",
        "s0r3",
        "s0r1",
        "s1r1",
        "s2r1",
        "s1r3",
        "s0r2",
        "s1r2",
        "s2r2",
        "s2r3",
    ]
    assert [r[1] for r in rows] == [str(n) for n in range(3) for _ in range(4)]
    # replica-major would split three replicas; this splits one
    by_node = {}
    for r in range(12):
        by_node.setdefault(cell_of_rank(r, 3, 4, 4)[1], set()).add(r // 4)
    assert sorted(len(nodes) for nodes in by_node.values()) == [1, 1, 1, 3]


def test_a_pipeline_deeper_than_a_node_spans_consecutive_nodes_in_stage_order():
    # 8 stages on nodes of 4: stages 0-3 of replica 0 on node 0, 4-7 on node 1
    assert [cell_of_rank(r, 8, 2, 4) for r in range(8)] == [(j, 0) for j in range(8)]
    assert cell_of_rank(8, 8, 2, 4) == (0, 1)


def test_slurm_ranks_map_to_cells_as_documented():
    """A 4x2 grid under srun -N 2 -n 8: task k of node n is stage k of replica n; each task
    reads its place from SLURM's variables alone."""
    cells = {}
    for procid in range(8):
        place = place_from_env(slurm_env(procid))
        cells[procid] = cell_of_rank(place.rank, 4, 2, place.ranks_per_node)
        assert place.local_rank == procid % 4
    assert cells == {k: (k % 4, k // 4) for k in range(8)}
    # 2 stages x 3 replicas on 2 nodes of 3 tasks: one whole replica per node, the third split
    odd = {
        p: cell_of_rank(p, 2, 3, place_from_env(slurm_env(p, 6)).ranks_per_node) for p in range(6)
    }
    assert odd == {0: (0, 0), 1: (1, 0), 2: (0, 2), 3: (0, 1), 4: (1, 1), 5: (1, 2)}


def test_a_grid_that_is_not_the_world_is_refused_in_one_line_naming_both():
    with pytest.raises(ConfigError) as e:
        check_world(2, 2, 3)
    msg = str(e.value)
    assert "2x2 has 4 cells" in msg and "WORLD_SIZE is 3" in msg and "\n" not in msg


def test_train_refuses_a_mismatched_grid_with_exit_2_and_one_line():
    env = {**torchrun_env(0, world=6, per_node=3), "TORCHELASTIC_USE_AGENT_STORE": "False"}
    res = CliRunner().invoke(main, ["train", "--grid", "2x2", "--out", "unused"], env=env)
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and "4 cells" in lines[0] and "WORLD_SIZE is 6" in lines[0], lines


def test_train_without_a_launcher_says_so_and_the_placement_table_needs_none():
    res = CliRunner().invoke(
        main,
        ["train", "--grid", "2x2", "--out", "x"],
        env={"RANK": None, "WORLD_SIZE": None, "SLURM_PROCID": None},
    )
    assert res.exit_code == 2 and "torchrun or srun" in res.output
    res = CliRunner().invoke(main, ["train", "--grid", "3x4", "--placement", "4"])
    assert res.exit_code == 0, res.output
    assert "| 3    | 0    | s0r3 |" in res.output and "| 11   | 2    | s2r3 |" in res.output


def test_the_gpu_is_local_rank_modulo_the_visible_ones():
    assert gpu_index(3, 8) == 3
    assert gpu_index(3, 1) == 0  # srun --gpus-per-task: the one it sees
    assert gpu_index(5, 4) == 1
    assert gpu_index(0, 0) is None


def test_this_nodes_address_is_the_route_to_the_store_and_never_loopback_across_nodes():
    one = place_from_env(torchrun_env(0, world=4, per_node=4, MASTER_ADDR="127.0.0.1"))
    assert node_address(one, None) == "127.0.0.1"
    assert node_address(one, "10.1.2.3") == "10.1.2.3"
    # a store on loopback: every node reaches it on its own loopback, so every node is here
    two = place_from_env(torchrun_env(0, world=4, per_node=2, MASTER_ADDR="127.0.0.1"))
    assert node_address(two, None) == "127.0.0.1"
    local = place_from_env(torchrun_env(0, world=4, per_node=2, MASTER_ADDR="localhost"))
    assert node_address(local, None) == "127.0.0.1"
    # a host name that resolves to loopback here (Debian's 127.0.1.1 for the machine's own
    # name) may be a real address elsewhere: the other nodes could not reach loopback
    named = place_from_env(torchrun_env(0, world=4, per_node=2, MASTER_ADDR=socket.gethostname()))
    if ipaddress.ip_address(socket.gethostbyname(socket.gethostname())).is_loopback:
        with pytest.raises(ConfigError, match="--host ADDR") as e:
            node_address(named, None)
        assert "\n" not in str(e.value)
    assert node_address(named, "127.0.0.2") == "127.0.0.2"  # said by the user: trusted


def test_donors_are_the_peers_ahead_by_more_than_the_lag_most_advanced_first():
    steps = {"s1r0": 70, "s1r2": 70, "s1r3": 40, "s1r4": 12}
    assert donors_ahead(steps, 10, 20) == ["s1r0", "s1r2", "s1r3"]
    assert donors_ahead(steps, 10, 29) == ["s1r0", "s1r2", "s1r3"]
    assert donors_ahead(steps, 10, 30) == ["s1r0", "s1r2"]
    assert donors_ahead(steps, 70, 0) == []
