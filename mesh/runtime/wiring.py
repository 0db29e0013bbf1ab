"""What a cell is wired to: the grid's names and averaging groups, its links on the torch
backend, its transport and its device, all from the config (mesh/runtime/trainer.py builds a
cell with them; `train` and the throughput bench use them too)."""

from __future__ import annotations

import torch

from comms.build import HivemindOptions, Meeting, Options, TorchOptions, make_transport
from comms.p2p.auth import Auth
from comms.transport import Transport
from mesh.algo import routes, routing
from mesh.algo.topology import Grid, cell_name
from mesh.config import Config, ConfigError
from mesh.runtime.emulate import cell_shaping


def grid_of(cfg: Config) -> Grid:
    """The run's grid, without the cells emulation.deaths takes out from the start (its
    routing's absent cells): they never start, so they are in no group and no link waits on
    them."""
    g = cfg.grid
    spans = routing.parse_deaths(cfg.emulation.deaths, g.stages, g.replicas)
    gone = routes.of(cfg.pipeline).absent(spans, g.stages, g.replicas)
    return Grid(g.stages, g.replicas, frozenset(gone))


def cell_links(cfg: Config, stage: int, replica: int) -> TorchOptions:
    """The torch transport's links of a cell: its pipeline neighbours and its stage's column
    (not every cell of the grid), of which the neighbours are needed at its start even when
    they closed before (a replica started again starts all its cells at once), while a column
    peer that is done is not waited for."""
    grid = grid_of(cfg)
    nbrs = grid.neighbours(stage, replica, routes.of(cfg.pipeline).pooled)
    return TorchOptions(links=tuple(nbrs + grid.column(stage, without=replica)), needed=tuple(nbrs))


def backend_options(cfg: Config, stage: int, replica: int, run_key: str | None) -> Options:
    """What the config asks of a cell's transport beyond names: on torch, its links; on
    hivemind, the membership token of (run key, config fingerprint) and the DHT mode."""
    if cfg.transport.backend == "torch":
        return cell_links(cfg, stage, replica)
    return HivemindOptions(
        auth=Auth.of(run_key, cfg.fingerprint()),
        dht_client=cfg.transport.dht_mode == "client",
    )


def cell_transport(
    cfg: Config,
    stage: int,
    replica: int,
    meeting: Meeting,
    run_key: str | None = None,
) -> Transport:
    """This cell's transport, meeting the others at `meeting`: the grid's names and groups, the
    configured links shaped; on hivemind, records carry the membership token of (run key,
    config fingerprint)."""
    grid = grid_of(cfg)
    return make_transport(
        cfg.transport.backend,
        cell_name(stage, replica),
        grid.names(),
        grid.groups(),
        meeting,
        host=cfg.transport.host,
        timeout_s=cfg.transport.start_timeout_s,
        shaping=cell_shaping(cfg, stage, replica),
        options=backend_options(cfg, stage, replica, run_key),
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
