"""Where a `meshtrain train` process sits in a cluster: its launcher's environment (torchrun or
SLURM) -> its rank, its node, its cell (stage, replica), its GPU and the rendezvous store its
links are built on. Pure functions of the environment's strings, except `node_address`.

Launchers.
- torchrun (and anything that sets the same variables): RANK, WORLD_SIZE, LOCAL_RANK,
  LOCAL_WORLD_SIZE, GROUP_WORLD_SIZE (nodes), MASTER_ADDR and MASTER_PORT. With torchrun's c10d
  rendezvous and its store shared with the workers (TORCHELASTIC_USE_AGENT_STORE=True, torch's
  default), MASTER_ADDR:MASTER_PORT is a store the agent of node rank 0 serves: the links use it.
  Otherwise (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which a node that rejoins needs: docs/
  cluster.md) rank 0's process serves the store there itself.
- SLURM (srun): SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NNODES, the tasks per node
  (SLURM_STEP_TASKS_PER_NODE or SLURM_TASKS_PER_NODE, e.g. "4(x2)") and the first node of
  SLURM_STEP_NODELIST / SLURM_JOB_NODELIST / SLURM_NODELIST (e.g. "node[01-04]" -> "node01"),
  where rank 0's process serves the store on MASTER_PORT (default DEFAULT_PORT). MASTER_ADDR or
  MASTER_PORT set in the environment win.
torchrun's variables win over SLURM's (torchrun started by srun inside an allocation).

Rank -> cell (`cell_of_rank`). Ranks fill nodes in blocks (torchrun numbers a node's workers
together; srun's default block distribution does too): node n holds ranks [n L, (n+1) L) of
L = ranks per node. Each node first takes floor(L / P) whole replicas (stage j of its k-th
replica at slot k P + j), so a replica's pipeline never leaves its node when P divides L; the
slots left over on every node (L mod P of them) take the remaining replicas in node order, each
laid over as few nodes as it can. With P > L a replica spans P / L nodes, in stage order. Nodes
of different sizes (L unknown): replica-major, rank r -> (r mod P, r div P). Rank 0 is always
stage 0 of replica 0. `meshtrain train --placement` prints the table (placement_table).

imports: stdlib, mesh.config (ConfigError), mesh.algo.topology.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from mesh.algo.topology import cell_name
from mesh.config import ConfigError

DEFAULT_PORT = 29500  # the store's port under SLURM when MASTER_PORT is not set (torch's own)
NODELIST_KEYS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
TASKS_KEYS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")


@dataclass(frozen=True)
class Place:
    """One process's place as its launcher says it."""

    launcher: str  # "torchrun" or "slurm"
    rank: int
    world_size: int
    local_rank: int
    ranks_per_node: int | None  # None: nodes of different sizes
    nodes: int
    store_host: str
    store_port: int
    launcher_serves_store: bool  # True: torchrun's agent serves it; else rank 0 does

    @property
    def serves_store(self) -> bool:
        """This process serves the rendezvous store its links are built on."""
        return self.rank == 0 and not self.launcher_serves_store


def place_from_env(env: Mapping[str, str]) -> Place:
    """The Place the environment describes; ConfigError (one line, the variable named) when
    no launcher's variables are there or one is malformed."""
    if "RANK" in env or "WORLD_SIZE" in env:
        return _torchrun_place(env)
    if "SLURM_PROCID" in env:
        return _slurm_place(env)
    raise ConfigError(
        "no launcher environment: `meshtrain train` runs under torchrun or srun (RANK and "
        "WORLD_SIZE, or SLURM_PROCID, are not set); to run a whole grid on this machine use "
        "`meshtrain simulate` (docs/cluster.md)"
    )


def _torchrun_place(env: Mapping[str, str]) -> Place:
    world = _int(env, "WORLD_SIZE", minimum=1)
    rank = _int(env, "RANK", below=world)
    local_size = _int(env, "LOCAL_WORLD_SIZE", 1, minimum=1) if "LOCAL_WORLD_SIZE" in env else None
    local_rank = _int(env, "LOCAL_RANK", 0, below=local_size or world)
    nodes = _int(env, "GROUP_WORLD_SIZE", minimum=1) if "GROUP_WORLD_SIZE" in env else None
    if local_size is None or world % local_size:
        local_size = None  # the nodes' sizes differ (or are unknown): replica-major
    if nodes is None:
        nodes = world // local_size if local_size else 1
    host = env.get("MASTER_ADDR") or "127.0.0.1"
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return Place("torchrun", rank, world, local_rank, local_size, nodes, host, _port(env), agent)


def _slurm_place(env: Mapping[str, str]) -> Place:
    world = _int(env, "SLURM_NTASKS", minimum=1)
    rank = _int(env, "SLURM_PROCID", below=world)
    local_rank = _int(env, "SLURM_LOCALID", 0, minimum=0)
    per_node = next((tasks_per_node(env[k]) for k in TASKS_KEYS if env.get(k)), None)
    if per_node is None and env.get("SLURM_NTASKS_PER_NODE", "").isdigit():
        per_node = int(env["SLURM_NTASKS_PER_NODE"])
    if per_node is not None and (per_node < 1 or world % per_node):
        per_node = None
    nodes = int(env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES") or 0) or (
        world // per_node if per_node else 1
    )
    host = env.get("MASTER_ADDR")
    if not host:
        nodelist = next((env[k] for k in NODELIST_KEYS if env.get(k)), None)
        if nodelist is None:
            raise ConfigError(
                "SLURM_PROCID is set but no SLURM_JOB_NODELIST (nor MASTER_ADDR): run under "
                "srun inside an allocation, or set MASTER_ADDR to the first node"
            )
        host = first_node(nodelist)
    return Place(
        "slurm", rank, world, local_rank, per_node, nodes, host, _port(env, DEFAULT_PORT), False
    )


def _int(
    env: Mapping[str, str],
    key: str,
    default: int | None = None,
    *,
    minimum: int = 0,
    below: int | None = None,
) -> int:
    raw = env.get(key)
    if raw is None or raw == "":
        if default is None:
            raise ConfigError(f"{key} is not set; the launcher sets it (torchrun or srun)")
        return default
    if not raw.strip().isdigit() or int(raw) < minimum or (below is not None and int(raw) >= below):
        bound = f" below {below}" if below is not None else ""
        raise ConfigError(f"{key}={raw!r}: expected an integer >= {minimum}{bound}")
    return int(raw)


def _port(env: Mapping[str, str], default: int | None = None) -> int:
    raw = env.get("MASTER_PORT")
    if not raw:
        if default is None:
            raise ConfigError("MASTER_PORT is not set; torchrun sets it (or set it yourself)")
        return default
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise ConfigError(f"MASTER_PORT={raw!r}: expected a TCP port (1..65535)")
    return int(raw)


# ---- SLURM's compact lists ---------------------------------------------------------------------

_TOP_COMMA = re.compile(r",(?![^\[]*\])")  # a comma outside brackets separates host expressions


def first_node(nodelist: str) -> str:
    """The first host of a SLURM hostlist: "node01", "node[01-04]", "node[07,01-03]",
    "gpu[1-2]-ib,cpu3", "rack[1-2]-n[01-02]" -> node01, node01, node07, gpu1-ib, rack1-n01
    (each bracket's first number, its zero padding kept). ConfigError when malformed."""
    first = _TOP_COMMA.split(nodelist.strip())[0]
    out, rest = "", first
    while rest:
        head, bracket, tail = rest.partition("[")
        out += head
        if not bracket:
            break
        body, closed, rest = tail.partition("]")
        number = body.split(",")[0].split("-")[0]
        if not closed or not number.isdigit():
            raise ConfigError(f"SLURM node list {nodelist!r}: cannot read its first node")
        out += number
    if not out or "]" in out:
        raise ConfigError(f"SLURM node list {nodelist!r}: cannot read its first node")
    return out


def tasks_per_node(spec: str) -> int | None:
    """SLURM_TASKS_PER_NODE ("4(x2)", "4,4", "2(x3),1") -> the tasks of every node when they
    are all the same, else None."""
    counts = set()
    for part in spec.split(","):
        found = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if found is None:
            return None
        counts.add(int(found.group(1)))
    return counts.pop() if len(counts) == 1 else None


# ---- ranks and cells ---------------------------------------------------------------------------


def check_world(stages: int, replicas: int, world_size: int) -> None:
    """ConfigError, one line naming both numbers, when the grid's cells are not the world."""
    if stages * replicas != world_size:
        raise ConfigError(
            f"the grid {stages}x{replicas} has {stages * replicas} cells but WORLD_SIZE is "
            f"{world_size}: one process is one cell; launch {stages * replicas} processes or set "
            "--grid to match"
        )


def cell_of_rank(
    rank: int, stages: int, replicas: int, ranks_per_node: int | None
) -> tuple[int, int]:
    """(stage, replica) of `rank` in a world of stages x replicas ranks (module docstring)."""
    world = stages * replicas
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    L = ranks_per_node
    if L is None or L < 1 or world % L:
        return rank % stages, rank // stages
    whole = L // stages  # whole replicas on each node
    node, slot = divmod(rank, L)
    if slot < whole * stages:
        return slot % stages, node * whole + slot // stages
    spare = L - whole * stages  # leftover slots per node, filled in node order
    q = node * spare + slot - whole * stages
    return q % stages, (world // L) * whole + q // stages


def placement_table(stages: int, replicas: int, ranks_per_node: int | None) -> list[list[str]]:
    """Rows (rank, node, cell) of the whole world, for the docs and a user's check."""
    L = ranks_per_node
    rows = []
    for rank in range(stages * replicas):
        node = str(rank // L) if L and (stages * replicas) % L == 0 else "?"
        rows.append([str(rank), node, cell_name(*cell_of_rank(rank, stages, replicas, L))])
    return rows


def gpu_index(local_rank: int, device_count: int) -> int | None:
    """The GPU of a process: LOCAL_RANK, modulo the GPUs it sees (a task that sees one GPU,
    as srun --gpus-per-task gives it, takes that one); None without a GPU."""
    return local_rank % device_count if device_count > 0 else None


# ---- this node's address -----------------------------------------------------------------------


def node_address(place: Place, given: str | None) -> str:
    """The address this process's links listen on and announce: `given` (--host), else the
    address of this machine on the route to the store's host. ConfigError when a job of
    several nodes would announce a loopback address (the other nodes could not reach it)."""
    if given:
        return given
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((place.store_host, place.store_port))  # UDP: no packet is sent
            addr = s.getsockname()[0]
    except OSError as e:
        raise ConfigError(
            f"cannot find this node's address on the route to {place.store_host} ({e}); "
            "pass --host ADDR (or MESHTRAIN_HOST)"
        ) from None
    if place.nodes > 1 and ipaddress.ip_address(addr).is_loopback and not on_loopback(place):
        raise ConfigError(
            f"this node's address came out as {addr} (the route to the store's host "
            f"{place.store_host}), which the other {place.nodes - 1} node(s) cannot reach: pass "
            "--host ADDR (or MESHTRAIN_HOST) with this node's address on the nodes' network"
        )
    return addr


def on_loopback(place: Place) -> bool:
    """Whether the store was named by a loopback address (127.0.0.1, ::1, localhost): then every
    node reaches it on its own loopback, so every node is on this machine and loopback addresses
    reach them all. A host name that merely resolves to loopback here (Debian maps the machine's
    own name to 127.0.1.1) says nothing of where the other nodes are: not counted."""
    host = place.store_host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def describe(place: Place, stage: int, replica: int) -> str:
    """One line for the process's log: who it is."""
    return (
        f"rank {place.rank} of {place.world_size} ({place.launcher}, local rank "
        f"{place.local_rank}): cell {cell_name(stage, replica)}"
    )
