"""The throughput study's protocol: the grids, the settings every cell runs with, the methods."""

from __future__ import annotations

import json
from dataclasses import dataclass

from mesh.config import Config, with_overrides
from mesh.methods import apply_method
from mesh.runtime.emulate import resolve_window

METHODS = {"FullSync": "FullSync", "AsyncMesh": "AsyncMesh-fp8"}  # label -> mesh.methods name


@dataclass(frozen=True)
class Grid:
    id: str
    stages: int
    replicas: int
    link: str  # transport.link profile name
    slowdowns: tuple[str, ...] = ()


GRIDS = (
    Grid("A1", 2, 2, "wan100"),
    Grid("A2", 4, 2, "wan100"),
    Grid("A3", 4, 2, "wan10"),
    Grid("A4", 4, 2, "wan100", ("s2r0=2.0",)),
)


BENCH = {  # the model and timings of every grid (the module docstring of mesh.bench.throughput)
    "model.d_model": 128,
    "model.n_layers": 4,
    "model.n_heads": 4,
    "model.seq_len": 128,
    "pipeline.microbatch_size": 8,
    "pipeline.microbatches": 4,
    "pipeline.window": "auto",
    "emulation.compute": "emulated",
    "emulation.forward_ms": 10.0,
    "emulation.backward_ms": 20.0,
    "transport.backend": "torch",
    "checkpoint.every": 0,
    "transport.recv_timeout_s": 120.0,  # a recv may wait out a slow window start on 10 Mbit
    "transport.round_timeout_s": 60.0,  # A4: the fast replica's rounds wait for the slow one
    "run.threads": 1,
    "run.steps": 1_000_000,  # only lr / lambda schedules read it; windows set their own length
}


# as --set items: the CLI puts them after --config files and before the user's --set (which win)
BENCH_SETS = [f"{k}={json.dumps(v)}" for k, v in BENCH.items()]


SKIP_FRAC = 0.2  # warm-up rows left out of each window


MIN_SYNC_STEPS = 4  # FullSync windows: at least 3 measured intervals


def grid_config(base: Config, g: Grid) -> Config:
    """base (the protocol's settings, BENCH_SETS, plus the user's) with the grid's shape."""
    return with_overrides(
        base,
        {
            "grid.stages": g.stages,
            "grid.replicas": g.replicas,
            "transport.link": g.link,
            "emulation.slowdowns": list(g.slowdowns),
        },
    )


def method_configs(cfg: Config) -> dict[str, Config]:
    return {label: resolve_window(apply_method(cfg, name)) for label, name in METHODS.items()}
