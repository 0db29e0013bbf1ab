"""Whether this machine can hold the cell processes a launcher is about to start (`simulate` on
torch or hivemind: the whole grid; `train`: this node's cells). A grid it cannot hold is
refused before any cell starts, in one line naming the memory and threads the cells need
against what the machine has (exit 2); --skip-resource-check starts it anyway.

What the cells need (measured on a 2-core x86 box, CPU, the demo's model: 0.01-0.02 GB of plan
a cell):
- each cell's state, `meshtrain plan`'s bytes for its stage (mesh/engine/plan.py), when it
  lives in host memory (runtime.device = cpu, auto without a GPU, or emulated compute); a
  cell on a GPU holds it there, which this check does not count;
- each cell's process beyond that state: a cell forked from simulate's fork server (torch
  loaded once, its pages shared) 0.10-0.15 GB, counted as 0.15 GB; on hivemind a cell is four
  processes (the cell, its DHT process, that one's p2pd and torch's shared-memory manager),
  0.30-0.34 GB, counted as 0.35 GB; a `train` process (its own interpreter and torch) 0.27-0.34
  GB, counted as 0.3 GB;
- what `simulate` starts once: the fork server (0.22 GB), on hivemind the bootstrap DHT's
  processes too (0.68 GB in all), and validation's copy of one replica's weights;
- threads (the process limits count every thread): a torch cell 6 and 4 a link (each link's
  receiver and validator threads and its gloo group's two; 12-17 measured in a 4x2 grid), a
  hivemind cell's processes 20-30, counted as 32.

What the machine has: /proc/meminfo's MemAvailable (less where a cgroup's memory limit leaves
less), and room for threads under RLIMIT_NPROC (counted over this user's threads; not for
root), the cgroup's pids.max and the kernel's threads-max and pid_max. Where none can be read
(not Linux) that side is not checked.
"""

from __future__ import annotations

import math
import os
import resource
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mesh.config import Config, ConfigError

if TYPE_CHECKING:
    from mesh.runtime.cluster import Place

GB = 1e9
CELL_PROCESS_BYTES = {"torch": 0.15 * GB, "hivemind": 0.35 * GB}
TRAIN_PROCESS_BYTES = 0.3 * GB
LAUNCH_ONCE_BYTES = {"torch": 0.25 * GB, "hivemind": 0.7 * GB}
THREADS_BASE, THREADS_PER_LINK, HIVEMIND_THREADS = 6, 4, 32
SKIP_FLAG = "--skip-resource-check"


@dataclass(frozen=True)
class Machine:
    """What this machine has for new processes: memory available (bytes) and room for threads,
    each with where it was read (None: not known, not checked); its cores, said beside them."""

    memory: float | None
    memory_from: str
    threads: int | None
    threads_from: str
    cores: int


@dataclass(frozen=True)
class Needs:
    """What the cells about to start need: memory (bytes) and threads."""

    cells: int
    memory: float
    state: float  # of memory: the cells' own state in host memory (their plans)
    threads: int


def read_machine(root: Path = Path("/")) -> Machine:
    """This machine as its /proc and cgroup files and rlimits say (root: for tests)."""
    memory, memory_from = _memory(root)
    threads, threads_from = _thread_room(root)
    return Machine(memory, memory_from, threads, threads_from, os.cpu_count() or 1)


def _memory(root: Path) -> tuple[float | None, str]:
    meminfo = _read(root / "proc/meminfo")
    avail = None
    for line in (meminfo or "").splitlines():
        if line.startswith("MemAvailable:"):
            avail = int(line.split()[1]) * 1024
    found = [] if avail is None else [(float(avail), "MemAvailable")]
    cg = root / "sys/fs/cgroup"
    for limit, usage in (
        ("memory.max", "memory.current"),  # cgroup v2
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),  # v1
    ):
        lim, used = _int_file(cg / limit), _int_file(cg / usage)
        if lim is not None and used is not None and lim < 2**60:
            found.append((float(max(0, lim - used)), "under the cgroup's memory limit"))
    return min(found) if found else (None, "")


def _thread_room(root: Path) -> tuple[int | None, str]:
    room: list[tuple[int, str]] = []
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft != resource.RLIM_INFINITY and os.geteuid() != 0:  # root is not held to it
        mine = _user_threads(root, os.getuid())
        if mine is not None:
            room.append((soft - mine, "RLIMIT_NPROC"))
    cg = root / "sys/fs/cgroup"
    for limit, current in (("pids.max", "pids.current"), ("pids/pids.max", "pids/pids.current")):
        lim, cur = _int_file(cg / limit), _int_file(cg / current)
        if lim is not None and cur is not None:
            room.append((lim - cur, "the cgroup's pids.max"))
    loadavg = _read(root / "proc/loadavg")  # "0.1 0.2 0.3 RUNNING/TASKS LASTPID"
    tasks = int(loadavg.split()[3].split("/")[1]) if loadavg else None
    for name in ("threads-max", "pid_max"):
        lim = _int_file(root / "proc/sys/kernel" / name)
        if lim is not None and tasks is not None:
            room.append((lim - tasks, f"the kernel's {name}"))
    return min(room) if room else (None, "")


def _user_threads(root: Path, uid: int) -> int | None:
    """Threads of every process whose real uid is `uid` (what RLIMIT_NPROC counts)."""
    total = 0
    try:
        pids = [p for p in (root / "proc").iterdir() if p.name.isdigit()]
    except OSError:
        return None
    for p in pids:
        status = _read(p / "status") or ""
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        try:
            if int(fields["Uid"].split()[0]) == uid:
                total += int(fields["Threads"])
        except (KeyError, ValueError, IndexError):
            continue
    return total


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _int_file(path: Path) -> int | None:
    text = _read(path)
    return int(text) if text is not None and text.strip().isdigit() else None


def on_host(cfg: Config) -> bool:
    """Whether the cells keep their state in host memory (mesh.runtime.wiring.cell_device)."""
    if cfg.emulation.compute == "emulated" or cfg.runtime.device == "cpu":
        return True
    if cfg.runtime.device == "cuda":
        return False
    import torch

    return not torch.cuda.is_available()


def grid_needs(
    cfg: Config, cells: Sequence[tuple[int, int]], process_bytes: float, once_bytes: float = 0.0
) -> Needs:
    """What `cells` ((stage, replica) each) need: each its plan's bytes in host memory (or none
    on a GPU) and its process's, `once_bytes` beside them; threads by backend and links."""
    from mesh.engine.plan import plan_cell
    from mesh.runtime.wiring import cell_links

    stages = sorted({j for j, _ in cells})
    plans = {j: plan_cell(cfg, j) for j in stages}
    host = on_host(cfg)
    state = sum(plans[j].total_bytes for j, _ in cells) if host else 0.0
    if cfg.transport.backend == "hivemind":
        threads = HIVEMIND_THREADS * len(cells)
    else:
        links = sum(len(cell_links(cfg, j, i).links or ()) for j, i in cells)
        threads = THREADS_BASE * len(cells) + THREADS_PER_LINK * links
    memory = state + process_bytes * len(cells) + once_bytes
    return Needs(len(cells), memory, state, threads)


def check_needs(needs: Needs, have: Machine, what: str, here: str) -> None:
    """ConfigError, one line, when the needs exceed what the machine has (a side it could not
    read is not checked)."""
    short_memory = have.memory is not None and needs.memory > have.memory
    short_threads = have.threads is not None and needs.threads > have.threads
    if not (short_memory or short_threads):
        return
    split = (
        f"the cells' state {_gb(needs.state)} GB as `meshtrain plan` counts it, "
        f"the processes {_gb(needs.memory - needs.state)} GB"
        if needs.state
        else "the processes; the cells' state is on the GPU"
    )
    memory = (
        "memory not known"
        if have.memory is None
        else f"{_gb(have.memory)} GB of memory available ({have.memory_from})"
    )
    threads = (
        ""
        if have.threads is None
        else f", room for {have.threads:,} more threads ({have.threads_from})"
    )
    raise ConfigError(
        f"{what} starts {needs.cells} cell processes on {here}: about {_gb(needs.memory)} GB "
        f"of memory ({split}) and {needs.threads:,} threads, where {here} has {memory}{threads} "
        f"and {have.cores} cores; run fewer cells here (a smaller grid, or more machines), or "
        f"pass {SKIP_FLAG} to start them anyway"
    )


def _gb(n: float) -> str:
    gb = n / GB
    return f"{gb:,.0f}" if gb >= 100 else f"{gb:.3g}"


def check_simulate(
    cfg: Config, cells: Sequence[tuple[int, int]], have: Machine | None = None
) -> None:
    """`simulate` on torch or hivemind: the grid's cell processes on this machine, and what it
    starts once (the fork server, the bootstrap DHT, validation's weights)."""
    backend = cfg.transport.backend
    once = LAUNCH_ONCE_BYTES[backend]
    if cfg.emulation.compute == "real":  # validation loads one replica's weights here
        from mesh.engine.plan import plan_cell

        once += sum(plan_cell(cfg, j).weights_bytes for j in range(cfg.grid.stages))
    needs = grid_needs(cfg, cells, CELL_PROCESS_BYTES[backend], once)
    grid = f"a {cfg.grid.stages}x{cfg.grid.replicas} grid"
    check_needs(needs, have or read_machine(), grid, "this machine")


def node_cells(cfg: Config, place: Place) -> list[tuple[int, int]]:
    """The cells `train` starts on this process's node: its ranks' (cluster.cell_of_rank);
    nodes of different sizes: the largest node's share of ranks, each taken as the grid's
    largest stage (its cells are not known here)."""
    from mesh.runtime.cluster import cell_of_rank

    P, m, L = cfg.grid.stages, cfg.grid.replicas, place.ranks_per_node
    if L:
        node = place.rank // L
        ranks = range(node * L, min((node + 1) * L, P * m))
        return [cell_of_rank(r, P, m, L) for r in ranks]
    from mesh.engine.plan import plan

    largest = max(plan(cfg), key=lambda c: c.total_bytes).stage
    return [(largest, i) for i in range(math.ceil(P * m / max(1, place.nodes)))]


def check_train(cfg: Config, place: Place, have: Machine | None = None) -> None:
    """`train`: this node's cells, each its own process that the launcher starts at once: the
    memory those already running hold (this process and its siblings, the launcher's other
    children) is the run's, so it counts as available beside MemAvailable."""
    cells = node_cells(cfg, place)
    have = have or read_machine()
    if have.memory is not None:
        held = sum(sorted(siblings_private_bytes(), reverse=True)[: len(cells)])
        said = f"{have.memory_from} + {_gb(held)} GB its running cell processes hold"
        have = Machine(have.memory + held, said, have.threads, have.threads_from, have.cores)
    needs = grid_needs(cfg, cells, TRAIN_PROCESS_BYTES)
    grid = f"the {cfg.grid.stages}x{cfg.grid.replicas} grid"
    check_needs(needs, have, grid, "this node")


def siblings_private_bytes(proc: Path = Path("/proc")) -> list[float]:
    """The private memory (pages no other process shares) of this process and of the other
    children of its parent (torchrun's agent or srun's step daemon start every cell of a node
    as its children); this process's alone where the parent's children cannot be read."""
    me = os.getpid()
    pids = {me}
    for task in _listdir(proc / str(os.getppid()) / "task"):
        pids.update(int(c) for c in (_read(task / "children") or "").split() if c.isdigit())
    out = []
    for pid in sorted(pids):
        text = _read(proc / str(pid) / "smaps_rollup") or ""
        kb = sum(
            int(line.split()[1])
            for line in text.splitlines()
            if line.startswith(("Private_Clean:", "Private_Dirty:"))
        )
        out.append(kb * 1024.0)
    return out


def _listdir(path: Path) -> list[Path]:
    try:
        return list(path.iterdir())
    except OSError:
        return []
