"""`meshtrain train`: one process is one cell of a grid launched by torchrun or srun.

Each process reads its place from its launcher's environment (mesh/runtime/cluster.py: rank ->
cell, its GPU, the rendezvous store), checks the config as `simulate` does, writes the run's
config.toml into this node's --out, and runs its cell there (mesh/runtime/trainer.py run_cell),
started as mesh/runtime/cluster_start.py says: from the newest checkpoint its replica shares,
brought up to its stage's most advanced peer by a state download. It says who it is in one line
on stderr, and how it ended in one more: trained to the last step, stopped and saved, or the
error (exit 2 for a user error: the message says the fix; 3 when a peer it needs was lost, so
the launcher starts the grid again; 1 for a bug, its traceback in DIR/logs/sJrI.err).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from pathlib import Path
from typing import Any

import click

from cli.options import (
    config_options,
    grid_run_options,
    shorthand_overrides,
    skip_resource_check_option,
    user_errors,
    with_method,
)
from mesh.algo.topology import Grid, cell_name
from mesh.config import Config, ConfigError, load_config, with_overrides
from mesh.runtime.cluster import (
    Place,
    cell_of_rank,
    check_world,
    describe,
    node_address,
    place_from_env,
    placement_table,
)

STORE_LOST = (
    "cell {cell}: the rendezvous store at {addr} is gone (its node was lost, or rank 0's process "
    "ended): the cells train on over the links they have, but no node can rejoin this job; to "
    "go on after it ends, launch every node again (each cell continues from its checkpoints)"
)
SHARED_STORE_NOTE = (
    "note: torchrun shares its rendezvous store with the workers (torch's default); a node "
    "relaunched later cannot rejoin this job (torch's c10d rendezvous does not publish that "
    "store to a new node): export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun on every "
    "node to allow it (docs/cluster.md)"
)


def train_config(cfg: Config, place: Place) -> Config:
    """The config every cell of the grid runs: checked against the world, its window and
    horizon resolved (the same on every node: nothing here is measured), the torch backend."""
    if cfg.transport.backend != "torch":
        raise ConfigError(
            f"transport.backend = {cfg.transport.backend!r}: `train` runs the torch backend "
            "inside a cluster; over the internet use `meshtrain join` (docs/cluster.md)"
        )
    check_world(cfg.grid.stages, cfg.grid.replicas, place.world_size)
    from cli.preflight import check_deaths

    check_deaths(cfg, "train")
    if cfg.pipeline.window == "auto":
        if cfg.emulation.compute != "emulated":
            raise ConfigError(
                "pipeline.window = 'auto' is sized by timing the stages on one machine, which "
                "every node would do differently; give it as a list (`meshtrain plan` prints "
                "one) or 'none'"
            )
        from mesh.runtime.emulate import resolve_window

        cfg = resolve_window(cfg)
    if cfg.run.schedule_steps is None:  # as simulate: a longer resume keeps this horizon
        cfg = with_overrides(cfg, {"run.schedule_steps": cfg.run.steps})
    return cfg


def check_out(cfg: Config, out: Path) -> None:
    """--out may hold this run (a node started again continues it), never another one."""
    toml = out / "config.toml"
    if not toml.is_file():
        return
    stored = load_config([toml])
    if stored.state_fingerprint() != cfg.state_fingerprint():
        from cli.preflight import RESUMABLE, changed_keys

        changed = [k for k in changed_keys(stored, cfg) if not k.startswith(RESUMABLE)]
        raise ConfigError(
            f"--out {out} holds a run of another config ({', '.join(changed[:4]) or 'its math'}"
            f" differs); pick another --out, or continue that run with --resume {out}"
        )


def write_config(cfg: Config, out: Path) -> None:
    """config.toml, atomically; every process of a node writes the same text."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".config.toml.{os.getpid()}.tmp"
    tmp.write_text(cfg.to_toml())
    os.replace(tmp, out / "config.toml")


def run_train(
    cfg: Config,
    out: Path,
    dirs: list[Path],
    host: str | None,
    verify_data: bool,
    check_resources: bool = True,
) -> None:
    """Everything `train` does in this process; never returns (the cell's exit code).
    check_resources: refuse when this node cannot hold its cells (cli/resources.py)."""
    place = place_from_env(os.environ)
    cfg = train_config(cfg, place)
    stage, replica = cell_of_rank(
        place.rank, cfg.grid.stages, cfg.grid.replicas, place.ranks_per_node
    )
    cfg = with_overrides(cfg, {"transport.host": node_address(place, host)})
    from cli.preflight import check_data, check_machine

    if cfg.emulation.compute != "emulated":
        check_data(cfg, verify_data)
    check_machine(cfg)
    if check_resources:
        from cli.resources import check_train

        check_train(cfg, place)
    check_out(cfg, out)
    write_config(cfg, out)
    say = f"{describe(place, stage, replica)} on {cfg.transport.host}, writing {out}"
    click.echo(say, err=True)
    if place.launcher_serves_store and place.rank == 0 and place.nodes > 1:
        click.echo(SHARED_STORE_NOTE, err=True)
    _run_cell_process(cfg, place, stage, replica, out, dirs)


def _run_cell_process(
    cfg: Config, place: Place, stage: int, replica: int, out: Path, dirs: list[Path]
) -> None:
    """The cell, in this process; one line on how it ended, then exit at once with its code
    (as mesh.runtime.trainer.cell_process_main: daemon threads may sit in C++ waits)."""
    from comms.build import TorchMeeting
    from mesh.runtime.cluster_start import ClusterStart
    from mesh.runtime.cluster_stop import StoreStop
    from mesh.runtime.cluster_store import hold_store, serve_store, watch_store
    from mesh.runtime.trainer import cell_life, run_cell

    # served for the process's life (rank 0 without a launcher's store): every link meets there
    store = serve_store(place, cfg.transport.start_timeout_s) if place.serves_store else None
    meeting = TorchMeeting(f"tcp://{place.store_host}:{place.store_port}", serve_store=False)
    search = [out, *[d for d in dirs if d.resolve() != out.resolve()]]

    def coordinator(cfg: Config, worker: Any, transport: Any, event: Any) -> ClusterStart:
        # a signal stops the replica's cells at one step, agreed in the store the links share
        stop = StoreStop(cfg, replica, place.store_host, place.store_port, event)
        return ClusterStart(cfg, worker, transport, event, search, str(out), stop)

    ended = threading.Event()  # the cell is done: a store that goes now is no news
    addr = f"{place.store_host}:{place.store_port}"
    lost = STORE_LOST.format(cell=cell_name(stage, replica), addr=addr)
    watch_store(place, cell_name(stage, replica), ended, lambda: click.echo(lost, err=True))
    tree = cfg.model_dump(mode="json")
    run = functools.partial(
        run_cell,
        tree,
        stage,
        replica,
        str(out),
        meeting,
        local_rank=place.local_rank,
        coordinator=coordinator,
    )
    code = cell_life(out, stage, replica, run)
    ended.set()
    click.echo(ending(out, stage, replica, code, cfg.run.steps), err=True)
    if store is not None and code == 0:  # cells still finishing (or stopping) need it
        hold_store(store, Grid(cfg.grid.stages, cfg.grid.replicas).names())
    sys.stdout.flush()
    sys.stderr.flush()
    del store  # served the links until here
    os._exit(code)


def ending(out: Path, stage: int, replica: int, code: int, steps: int) -> str:
    """The process's last line: how its cell ended (from its metrics rows and failure report);
    a stop at one step ends as the run's end does (a final row), short of `steps`."""
    from mesh.runtime.failure import failure_path
    from mesh.runtime.rows import parse_rows

    name = cell_name(stage, replica)
    path = out / "metrics" / f"{stage}-{replica}.jsonl"
    rows = parse_rows(path.read_bytes()) if path.is_file() else []
    starts = [k for k, r in enumerate(rows) if r.get("event") == "started"]
    last = rows[starts[-1] :] if starts else []  # this process's rows
    step = max((r["step"] for r in last if isinstance(r.get("step"), int)), default=0)
    if code == 0 and step >= steps and any(r.get("final") for r in last):
        return f"cell {name}: trained to step {step} of {steps} ({out})"
    if code == 0:
        return (
            f"cell {name}: stopped at step {step}, checkpoint saved in {out}; the same "
            "command continues it"
        )
    report = failure_path(out, stage, replica)
    why = report.read_text().splitlines()[0] if report.is_file() else f"exit {code}"
    if code == 2:
        return f"error: cell {name}: {why}"
    return f"error: cell {name} failed at step {step}: {why} (report: {report})"


def print_placement(cfg: Config, ranks_per_node: int) -> None:
    """--placement: the rank -> node -> cell table this grid gets."""
    from cli.report import print_table

    if ranks_per_node < 1:
        raise ConfigError(f"--placement {ranks_per_node}: give the processes per node (>= 1)")
    world = cfg.grid.stages * cfg.grid.replicas
    print_table(
        ["rank", "node", "cell"],
        placement_table(cfg.grid.stages, cfg.grid.replicas, ranks_per_node),
    )
    if world % ranks_per_node:
        click.echo(f"({world} ranks do not fill nodes of {ranks_per_node}: replica-major)")


@click.command()
@config_options
@grid_run_options
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    default=None,
    help="This node's run directory (the same path on every node, or one shared directory); "
    "a node started again with it continues its cells.",
)
@click.option(
    "--resume",
    multiple=True,
    metavar="DIR",
    help="Continue a run with its stored config: its node directories (repeat the option) or "
    "its one shared directory; cells read their checkpoints from any of them and write to "
    "--out (default: the first).",
)
@click.option(
    "--host",
    envvar="MESHTRAIN_HOST",
    default=None,
    help="This node's address the other nodes reach (or MESHTRAIN_HOST; default: this "
    "machine's address on the route to MASTER_ADDR).",
)
@click.option(
    "--placement",
    type=int,
    default=None,
    metavar="PER_NODE",
    help="Print which cell each rank takes with PER_NODE processes a node, and exit.",
)
@click.option(
    "--verify-data",
    is_flag=True,
    help="Hash every shard of a prepared dataset against its manifest first.",
)
@skip_resource_check_option
@user_errors
def train(
    config_files: tuple[str, ...],
    overrides: tuple[str, ...],
    grid: str | None,
    steps: int | None,
    method: str | None,
    init_from: str | None,
    out: str | None,
    resume: tuple[str, ...],
    host: str | None,
    placement: int | None,
    verify_data: bool,
    skip_resource_check: bool,
) -> None:
    """Run this process's cell of a grid launched by torchrun or srun (one process per cell,
    WORLD_SIZE = stages x replicas; docs/cluster.md). Rank r takes a cell so that a replica's
    stages share a node where the grid allows (--placement shows the table); the cell runs on
    cuda:LOCAL_RANK when there is a GPU, its links meet at the launcher's rendezvous store. It
    continues from the newest checkpoint its replica shares, and downloads its stage's state
    from the most advanced live peer when more than elastic.max_lag_steps behind. Before its
    cell starts, a node that cannot hold its cells (their memory and threads against what it
    has) is refused in one line; --skip-resource-check starts them anyway."""
    # before torch loads (it reads this once): a store or link whose peer is gone is said in
    # one line of ours (the cell's ending, STORE_LOST), not c10d's warnings with C++ frames
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    extra = shorthand_overrides(grid, steps, init_from)
    dirs = [Path(d) for d in resume]
    if dirs:
        if method:
            raise ConfigError("--resume keeps the run's method (its config.toml); drop --method")
        from cli.preflight import resume_config
        from mesh.runtime.node_dirs import check_dirs

        dirs = check_dirs(dirs, "--resume")
        first = next(d for d in dirs if (d / "config.toml").is_file())
        _, cfg = resume_config(first, list(config_files), [*overrides, *extra])
    else:
        cfg = load_config(list(config_files), [*overrides, *extra])
    cfg = with_method(cfg, method)
    if placement is not None:
        print_placement(cfg, placement)
        return
    if out is None and not dirs:
        raise ConfigError("give --out DIR (this node's run directory), or --resume DIR")
    run_train(
        cfg,
        Path(out) if out else dirs[0],
        dirs,
        host,
        verify_data,
        check_resources=not skip_resource_check,
    )
