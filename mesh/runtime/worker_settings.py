"""What a stage's worker reads of the config (mesh/runtime/stage.py StageWorker and the pools'
workers), parsed once for its cell: the sections it works with and the values derived for that
cell. A worker never holds the whole Config.

imports: mesh.config, mesh.algo, mesh.runtime.emulate / rounds / wiring (all pure).
"""

from __future__ import annotations

from dataclasses import dataclass

from mesh.algo import routes
from mesh.algo.routes import Routing
from mesh.algo.schedule import microbatches_per_update
from mesh.algo.topology import Grid
from mesh.config import Config
from mesh.config_local import ElasticConfig
from mesh.config_sections import DPConfig, PipelineConfig
from mesh.runtime.emulate import emulated_op_s, slowdown, window_of
from mesh.runtime.rounds import RoundSettings
from mesh.runtime.wiring import grid_of


@dataclass(frozen=True)
class WorkerSettings:
    stages: int
    replicas: int
    pipeline: PipelineConfig
    dp: DPConfig
    elastic: ElasticConfig
    seed: int  # run.seed: the data order and the pools' routing draws
    steps: int  # run.steps: a pool's stream ends there
    recv_timeout_s: float  # transport.recv_timeout_s: a fixed grid's neighbour deadline
    precision: str  # runtime.precision: autocast of forward and backward
    seq_len: int
    vocab_size: int
    boundary_shape: tuple[int, int, int]  # what crosses a stage link
    microbatches_per_update: int
    window: list[int] | None  # the resolved pipeline.window
    slowdown: float  # this cell's compute factor (emulation.slowdowns)
    min_op_s: float  # a real forward's or backward's least time (emulation.min_compute_ms)
    # (forward, backward) seconds per microbatch when emulation.compute = "emulated", else None
    emulated_op_s: tuple[float, float] | None
    grid: Grid  # the run's grid, less the cells emulation.deaths takes out
    rounds: RoundSettings
    routing: Routing  # pipeline.routing and pool_choice, chosen once: the worker asks it
    # the most microbatches this cell's `auto` window holds (a stream's pool_stream_window, a
    # later cell's pool_cell_window): what it fits in the memory it trains in
    # (mesh/engine/plan.auto_window)
    window_cap: int

    @property
    def tokens_per_microbatch(self) -> int:
        return self.pipeline.microbatch_size * self.seq_len

    @classmethod
    def of(cls, cfg: Config, stage: int, replica: int) -> WorkerSettings:
        emulated = cfg.emulation.compute == "emulated"
        return cls(
            stages=cfg.grid.stages,
            replicas=cfg.grid.replicas,
            pipeline=cfg.pipeline,
            dp=cfg.dp,
            elastic=cfg.elastic,
            seed=cfg.run.seed,
            steps=cfg.run.steps,
            recv_timeout_s=cfg.transport.recv_timeout_s,
            precision=cfg.runtime.precision,
            seq_len=cfg.model.seq_len,
            vocab_size=cfg.model.vocab_size,
            boundary_shape=cfg.boundary_shape,
            microbatches_per_update=microbatches_per_update(
                cfg.pipeline.schedule, cfg.pipeline.microbatches
            ),
            window=window_of(cfg),
            slowdown=slowdown(cfg, stage, replica),
            min_op_s=cfg.emulation.min_compute_ms / 1e3,
            emulated_op_s=emulated_op_s(cfg, stage, replica) if emulated else None,
            grid=grid_of(cfg),
            rounds=RoundSettings.of(cfg),
            routing=routes.of(cfg.pipeline),
            window_cap=_window_cap(cfg, stage),
        )


def _window_cap(cfg: Config, stage: int) -> int:
    p = cfg.pipeline
    auto = p.pool_stream_window if stage == 0 else p.pool_cell_window
    if not p.pooled or auto != "auto":
        return p.pool_window  # not read
    from mesh.engine.machine import training_memory_bytes
    from mesh.engine.plan import auto_window

    return auto_window(cfg, stage, training_memory_bytes(cfg.runtime.device))
