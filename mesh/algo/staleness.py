"""Corrections for stale pipeline gradients, the pure parts: AsyncPP's per-stage lr correction
(`optim.delay_lr_share`) and weight prediction (`pipeline.weight_prediction`).

In the asynchronous pipeline stage j's gradient is computed on weights delta_j updates old and
lands on the newest ones. NAdamW's look-ahead absorbs part of that; at the short
horizons we study, the rest is the whole of AsyncMesh's gap to FullSync
(results/convergence/decomposition.md). Weight prediction (PipeMare, arXiv 1910.05124; SpecTrain,
arXiv 1809.02839) removes more of it: the version a forward reads (and its backward recomputes on,
weight stashing unchanged) is the live weights moved `scale x delta_j` of the stage's recent
update velocity ahead, so with scale 1 the gradient is taken about where it will be applied.

The velocity is an EMA of the stage's own optimizer displacements (weight decay and error
feedback included, averaging arrivals not: a round's jump is a one-off, not a trend), kept per
parameter in the optimizer's state so checkpoints and state downloads carry it. It works for any
optimizer, unlike a look-ahead that reads one optimizer's moments.
"""

from __future__ import annotations

import torch


def update_velocity(velocity: torch.Tensor, displacement: torch.Tensor, beta: float) -> None:
    """velocity <- beta velocity + (1 - beta) displacement, in place."""
    velocity.lerp_(displacement, 1.0 - beta)


def velocity_estimate(velocity: torch.Tensor, beta: float, updates: int) -> torch.Tensor:
    """The per-update displacement the EMA says, bias-corrected as Adam's moments are (an EMA
    started at zero under-reads its first 1/(1 - beta) updates); zero before any update."""
    if updates <= 0:
        return torch.zeros_like(velocity)
    return velocity / (1.0 - beta**updates)


def prediction_distance(scale: float, delay: int) -> float:
    """How many updates ahead a stage's stashed version is extrapolated: `scale` of its gradient
    delay (0 for the last stage of an async pipeline, and for every flushed schedule)."""
    if scale < 0 or delay < 0:
        raise ValueError(f"weight prediction needs scale >= 0 and delay >= 0, got {scale}, {delay}")
    return scale * delay


def predicted(weights: torch.Tensor, velocity: torch.Tensor, distance: float) -> torch.Tensor:
    """weights + distance x velocity (a new tensor; the live weights are never changed)."""
    return weights.add(velocity, alpha=distance)


def delay_lr_factor(delay: int, step: int, total_steps: int, share: float) -> float:
    """A delayed stage's lr multiplier (AsyncPP's `--lr_correction`, PipeMare's lr
    rescheduling): 1 / delay^(1 - progress / share) while progress = step / total_steps < share,
    1 after; so stage j starts at lr / delta_j and reaches the full lr at `share` of the run.
    A share above 1 never releases it whole: the run ends at lr / delta_j^(1 - 1 / share)
    (share 2: lr / sqrt(delta_j)), so the least delayed stages can take a larger lr than the
    most delayed ones keep. A fresh stage (delay 0 or 1), or share 0, keeps the full lr."""
    if share < 0 or delay < 0:
        raise ValueError(f"delay lr correction needs share >= 0, delay >= 0: {share}, {delay}")
    if share == 0 or delay <= 1:
        return 1.0
    progress = step / max(1, total_steps)
    return float(delay) ** -(1.0 - min(1.0, progress / share))
