"""What a cell is wired to: the grid's names and averaging groups, its links on the torch
backend, its transport and its device, all from the config (mesh/runtime/trainer.py builds a
cell with them; `train` and the throughput bench use them too)."""

from __future__ import annotations

from typing import Any

import torch

from comms.build import make_transport
from comms.p2p.auth import Auth
from comms.transport import Transport
from mesh.algo import routing
from mesh.algo.topology import cell_name
from mesh.config import Config, ConfigError
from mesh.runtime.emulate import cell_shaping
from mesh.runtime.rounds import group_name


def grid_names(cfg: Config) -> tuple[list[str], dict[str, list[str]]]:
    """All peer names in rank order (replica-major) and the averaging groups (one per stage)."""
    P, m = cfg.grid.stages, cfg.grid.replicas
    names = [cell_name(j, i) for i in range(m) for j in range(P)]
    gone = {cell_name(j, i) for j, i in absent_cells(cfg)}  # never started: in no group
    groups = {
        group_name(j): [cell_name(j, i) for i in range(m) if cell_name(j, i) not in gone]
        for j in range(P)
    }
    return names, groups


def absent_cells(cfg: Config) -> set[tuple[int, int]]:
    """The cells emulation.deaths takes out from the start (mesh.algo.routing.absent)."""
    g = cfg.grid
    spans = routing.parse_deaths(cfg.emulation.deaths, g.stages, g.replicas)
    return routing.absent(spans, g.stages, g.replicas, cfg.pipeline.routing)


def cell_links(cfg: Config, stage: int, replica: int) -> dict[str, list[str]]:
    """The torch transport's links of a cell: its pipeline neighbours and its stage's column
    (not every cell of the grid), of which the neighbours are needed at its start even when
    they closed before (a replica started again starts all its cells at once), while a column
    peer that is done is not waited for."""
    P, m = cfg.grid.stages, cfg.grid.replicas
    if cfg.pipeline.routing == "pools":  # every cell of the stages before and after
        nbrs = [cell_name(j, i) for j in (stage - 1, stage + 1) if 0 <= j < P for i in range(m)]
    else:
        nbrs = [cell_name(j, replica) for j in (stage - 1, stage + 1) if 0 <= j < P]
    column = [cell_name(stage, i) for i in range(m) if i != replica]
    gone = {cell_name(j, i) for j, i in absent_cells(cfg)}  # never started: no link to wait on
    nbrs = [c for c in nbrs if c not in gone]
    return {"links": nbrs + [c for c in column if c not in gone], "needed": nbrs}


def backend_options(cfg: Config, run_key: str | None) -> dict[str, Any]:
    """What the config asks of a cell's transport beyond names and links: on hivemind, the
    membership token of (run key, config fingerprint) and the DHT mode."""
    if cfg.transport.backend != "hivemind":
        return {}
    return {
        "auth": Auth.of(run_key, cfg.fingerprint()),
        "dht_client": cfg.transport.dht_mode == "client",
    }


def cell_transport(
    cfg: Config,
    stage: int,
    replica: int,
    options: dict[str, Any],
    run_key: str | None = None,
) -> Transport:
    """This cell's transport: the grid's names and groups, the configured links shaped; on
    hivemind, records carry the membership token of (run key, config fingerprint)."""
    names, groups = grid_names(cfg)
    extra = backend_options(cfg, run_key)
    if cfg.transport.backend == "torch":
        extra.update(cell_links(cfg, stage, replica))
    return make_transport(
        cfg.transport.backend,
        cell_name(stage, replica),
        names,
        groups,
        host=cfg.transport.host,
        timeout_s=cfg.transport.start_timeout_s,
        **{"shaping": cell_shaping(cfg, stage, replica), **extra, **options},
    )


def cell_device(
    cfg: Config, stage: int, replica: int, local_rank: int | None = None
) -> torch.device:
    """runtime.device: "cpu"; "cuda": GPU (cell index mod the visible GPUs, so a simulated
    grid spreads over them; a process a cluster launcher started: its LOCAL_RANK mod the
    visible GPUs); "auto": cuda when this machine has one. Emulated compute: cpu."""
    want = cfg.runtime.device
    if cfg.emulation.compute == "emulated" or want == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        if want == "cuda":
            raise ConfigError("runtime.device = cuda, but torch sees no GPU; use auto or cpu")
        return torch.device("cpu")
    place = replica * cfg.grid.stages + stage if local_rank is None else local_rank
    return torch.device("cuda", place % torch.cuda.device_count())
