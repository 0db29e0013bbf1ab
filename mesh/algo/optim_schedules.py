"""The optimizer's schedules over a run, pure functions of the step: the warmup-then-cosine lr,
the averaging's EMA lambda (AsyncMesh), NAdam's momentum cache mu_t and its psi scaled to a run's
horizon, and AsyncPP's adaptive beta1 per stage. mesh/algo/optim.py's rules and the cells read
them; each has a hand-computed unit test (tests/unit/test_optim.py, test_depth_levers.py).

imports: stdlib only.
"""

from __future__ import annotations

import math

# where AsyncPP's adaptive momentum takes the most delayed stage's beta1 towards
ADAPTIVE_BETA1_TOP = 0.99


def lr_at(
    step: int, total_steps: int, base_lr: float, warmup_steps: int, min_lr_ratio: float = 0.1
) -> float:
    """Learning rate at 0-based `step`: linear warmup, then cosine to min_lr_ratio * base_lr.

    Warmup: base_lr * (step + 1) / warmup_steps for step < warmup_steps (base_lr / W at step 0,
    base_lr at step W - 1). Then
    lr = min + (base - min) * 0.5 * (1 + cos(pi * (step - W) / (total_steps - W))), which is
    base_lr at step W and min at step >= total_steps.
    """
    if step < 0 or warmup_steps < 0:
        raise ValueError(f"step and warmup_steps must be >= 0, got {step}, {warmup_steps}")
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    lo = min_lr_ratio * base_lr
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return lo + (base_lr - lo) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lambda_at(
    step: int,
    total_steps: int,
    initial: float = 0.5,
    final: float = 0.01,
    hold_steps: int = 1000,
) -> float:
    """AsyncMesh EMA coefficient lambda: `initial` while step < hold_steps, then
    final + (initial - final) * 0.5 * (1 + cos(pi * (step - hold) / (total - hold))), clamped at
    `final` past total_steps. Constant `initial` if hold_steps >= total_steps."""
    if step < hold_steps or hold_steps >= total_steps:
        return initial
    progress = min(1.0, (step - hold_steps) / (total_steps - hold_steps))
    return final + (initial - final) * 0.5 * (1.0 + math.cos(math.pi * progress))


# The AsyncMesh paper's run: 30k updates with NAdam's psi = 0.004. A setting it gives in steps
# is a share of that run here (the brief), so a 1,600-update run follows the same mu_t curve.
PAPER_STEPS = 30_000
PAPER_MOMENTUM_DECAY = 0.004


def momentum_decay_for(horizon_steps: int) -> float:
    """psi that makes mu_t over `horizon_steps` follow the paper's curve over its 30k updates:
    mu(t; psi) depends on t x psi only, so psi scales with 30k / horizon (0.075 at 1,600, where
    mu reaches the paper's final 0.986 instead of 0.61)."""
    if horizon_steps < 1:
        raise ValueError(f"the schedule horizon must be >= 1 step, got {horizon_steps}")
    return PAPER_MOMENTUM_DECAY * PAPER_STEPS / horizon_steps


def nadam_mu(step: int, beta1: float, momentum_decay: float, cap: float | None = None) -> float:
    """NAdam momentum cache mu_t = beta1 (1 - 0.5 * 0.96^(t psi)), t 1-based (torch's NAdam),
    at most `cap` when given (optim.mu_cap: the look-ahead's weight on the momentum stops
    growing there, so the fresh gradient keeps a share 1 - cap of the step late in a run).

    With beta1 0.99, psi 0.004: ~0.495 at t=1, 0.57 at 1k, 0.69 at 3k, -> 0.99. psi=0 gives beta1/2.
    """
    mu = beta1 * (1.0 - 0.5 * 0.96 ** (step * momentum_decay))
    return mu if cap is None else min(mu, cap)


def adaptive_beta1(beta1: float, delay: int, stages: int, top: float = ADAPTIVE_BETA1_TOP) -> float:
    """AsyncPP's adaptive momentum (`--adaptive_momentum`): beta1_j = beta1 + delta_j (top -
    beta1) / P for a stage whose gradients are delta_j updates stale, top = 0.99. The freshest
    stage keeps beta1; stage 0 of an async pipeline (delta = P - 1) gets (P-1)/P of the way to
    top. A base at or above top is kept (the formula would lower it: AsyncPP's runs use 0.9)."""
    if delay < 0 or stages < 1:
        raise ValueError(f"adaptive momentum needs delay >= 0 and stages >= 1: {delay}, {stages}")
    if beta1 >= top:
        return beta1
    return beta1 + delay * (top - beta1) / stages
