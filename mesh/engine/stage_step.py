"""One stage's step on one microbatch, the math every engine runs: the fixed grid's and the pools'
workers (mesh/runtime/stage.py, pool.py) and the two simulators (mesh/engine/sim.py, pools.py)
call it through their Cell (Cell.forward_pass, Cell.backward; Cell.forward is the no-grad
forward a worker sends on), so the engines compute the same numbers by construction.

A stage's forward reads a stashed weight version as autograd leaves (the live weights may move
meanwhile) and, past stage 0, its input as a leaf too, so the backward yields dL/d(input), the
gradient that goes back across the link. The last stage's backward starts from the loss, divided
by the microbatches of its update (their gradients are summed into one update: GradSum).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mesh.model.build import lm_loss, stage_forward


@dataclass(frozen=True)
class StageGrads:
    """What one stage's backward of one microbatch yields."""

    inputs: torch.Tensor | None  # dL/d(input): goes back across the link (None on stage 0)
    weights: list[torch.Tensor]  # dL/d(weights), in the module's parameter order
    loss: float | None  # the microbatch's loss (the last stage alone; undivided)


@dataclass(frozen=True)
class StagePass:
    """One microbatch's forward through one stage with autograd on: what its backward reads."""

    leaves: list[torch.Tensor]  # [input (past stage 0), *weights]
    output: torch.Tensor
    takes_input: bool  # the input is a leaf: its gradient goes back across the link

    def backward(
        self,
        grad_out: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        share: int = 1,
    ) -> StageGrads:
        """The gradients of this pass: from the gradient of its output (grad_out) or, on the
        last stage, from the loss on `targets`, divided by `share` (an update's microbatches)."""
        loss = None
        if targets is not None:
            value = lm_loss(self.output, targets)
            grads = torch.autograd.grad(value / share, self.leaves)
            loss = value.item()
        else:
            assert grad_out is not None, "a stage before the last needs its output's gradient"
            grads = torch.autograd.grad(self.output, self.leaves, grad_outputs=grad_out)
        if self.takes_input:
            return StageGrads(grads[0], list(grads[1:]), loss)
        return StageGrads(None, list(grads), loss)


def stage_pass(
    module: nn.Module,
    weights: dict[str, torch.Tensor],
    inputs: torch.Tensor,
    precision: str,
    tokens: torch.Tensor | None,
    first: bool,
) -> StagePass:
    """The forward of `module` on `weights` (detached into fresh leaves) with autograd on; the
    input is a leaf too unless this is the first stage (token ids have no gradient)."""
    params = {n: t.detach().requires_grad_() for n, t in weights.items()}
    leaves = list(params.values())
    x = inputs
    if not first:
        x = x.detach().requires_grad_()
        leaves = [x, *leaves]
    out = stage_forward(module, params, x, precision, tokens)
    return StagePass(leaves, out, not first)


def update_loss(total: float, used: int, microbatches: int) -> float | None:
    """An update's loss from `total`, the sum of its microbatches' losses each divided by
    `microbatches`, of which `used` reached the loss: their mean (None: none reached it)."""
    if used == microbatches:
        return total
    return total * microbatches / used if used else None


class GradSum:
    """An update's weight gradients summed over its microbatches. The first microbatch's
    tensors become the sum (no add into zeros, no clone and zeroing per update); `tensors`
    holds the last sum until a new one starts (a FullSync mean reads and writes it in place)."""

    def __init__(self, like: list[torch.Tensor]) -> None:
        self.tensors = [torch.zeros_like(p) for p in like]
        self.empty = True

    def add(self, grads: list[torch.Tensor]) -> None:
        if self.empty:
            self.tensors, self.empty = list(grads), False
            return
        for acc, g in zip(self.tensors, grads, strict=True):
            acc.add_(g)

    def take(self) -> list[torch.Tensor] | None:
        """This update's sum (None: no microbatch reached this stage); the next add starts a
        new one."""
        grads = None if self.empty else self.tensors
        self.empty = True
        return grads
