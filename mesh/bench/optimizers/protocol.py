"""The optimizer study's protocol: model, learning rates, optimizers, plans, each run's config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mesh.config import Config, with_overrides
from mesh.methods import NADAMW_LR

# The study's model and batch, applied before the user's --set (which wins). 16 layers so that
# P = 16 is possible; d_model 32 keeps the whole study near 40 minutes on 2 cores.
STUDY_DEFAULTS: list[str] = [
    "model.n_layers=16",
    "model.d_model=32",
    "model.n_heads=4",
    "model.seq_len=64",
    "pipeline.microbatch_size=8",
    "data.val_batches=8",
    "optim.grad_clip=1.0",
]


# rotated_adam's lr from a small sweep (async, 400 updates, seed 0, final val loss): P = 1:
# 1e-3 2.630, 2e-3 2.464, 4e-3 2.413, 6e-3 2.410 (adamw 2e-3: 2.593); P = 16: 2e-3 2.907,
# 4e-3 2.838 (adamw 2e-3: 3.337). 4e-3 is best at both depths and inside the flat region. The
# others are the project's settings (mesh.methods), not swept here.
ROTATED_LR = 4e-3


LR = {"adamw": 2e-3, "nadamw": NADAMW_LR, "muon": 2e-3, "rotated_adam": ROTATED_LR}


MUON_LR = 0.02


ASYNC_OPTIMIZERS = [("adamw", False), ("nadamw", False), ("muon", False)]


ASYNC_OPTIMIZERS += [("rotated_adam", False), ("rotated_adam", True)]


TWO_BW_OPTIMIZERS = ["adamw", "muon", "rotated_adam"]


TWO_BW_P, TWO_BW_M = 4, 4


# Full: 68 runs x 1000 microbatches; ~45-60 ms per microbatch on one free core (more for
# rotated_adam+SA at P = 16) -> about 35-40 minutes with 2 workers.
FULL = {"stages": [1, 2, 4, 8, 16], "seeds": [0, 1], "microbatches": 1000, "evals": 30}


FULL["timed_steps"] = 30


QUICK = {"stages": [1, 4, 16], "seeds": [0, 1], "microbatches": 96, "evals": 12}


QUICK["timed_steps"] = 10


TIMING_WARMUP = 2  # updates before timing starts (the first eigh, allocator warm-up)


@dataclass(frozen=True)
class Spec:
    study: str  # "async" or "2bw"
    optimizer: str
    schedule: str
    stages: int
    seed: int
    error_feedback: bool = False
    stage_aware: bool = False

    @property
    def microbatches_per_update(self) -> int:
        return 1 if self.schedule == "async" else TWO_BW_M

    @property
    def label(self) -> str:
        """The optimizer as the tables name it: adamw, rotated_adam+SA, 2bw muon +EF, ..."""
        name = self.optimizer + ("+SA" if self.stage_aware else "")
        if self.study == "2bw":
            name = f"{self.schedule} {name}" + (" +EF" if self.error_feedback else "")
        return name

    def overrides(self) -> dict[str, Any]:
        return {
            "grid.stages": self.stages,
            "grid.replicas": 1,
            "dp.mode": "none",
            "pipeline.schedule": self.schedule,
            "pipeline.microbatches": self.microbatches_per_update,
            "optim.name": self.optimizer,
            "optim.lr": LR[self.optimizer],
            "optim.muon_lr": MUON_LR,
            "optim.error_feedback": self.error_feedback,
            "optim.stage_aware": self.stage_aware,
            "run.seed": self.seed,
        }


def build_specs(stages: list[int], seeds: list[int]) -> list[Spec]:
    specs = []
    for seed in seeds:
        for p in stages:
            for opt, sa in ASYNC_OPTIMIZERS:
                specs.append(Spec("async", opt, "async", p, seed, stage_aware=sa))
        for opt in TWO_BW_OPTIMIZERS:
            specs.append(Spec("2bw", opt, "gpipe", TWO_BW_P, seed))
            for ef in (False, True):
                specs.append(Spec("2bw", opt, "2bw", TWO_BW_P, seed, error_feedback=ef))
    return specs


def spec_config(base: Config, spec: Spec, microbatches: int, evals: int = 30) -> Config:
    """The run's config: equal tokens (microbatches per replica), `evals` evaluations, warmup
    5% of the updates."""
    steps = max(1, microbatches // spec.microbatches_per_update)
    ov = spec.overrides()
    ov.update(
        {
            "run.steps": steps,
            "run.eval_every": max(1, steps // evals),
            "run.threads": 1,
            "optim.warmup_steps": max(1, steps // 20),
            # each optimizer as it is at every depth (the depth rule is bench depth's pick)
            "optim.depth_rule": "off",
        }
    )
    return with_overrides(base, ov)
