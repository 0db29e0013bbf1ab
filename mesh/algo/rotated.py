"""`rotated_adam`: Adam in an estimated Hessian eigenbasis (SOAP-like), with stage-aware rotation.

Why (arXiv 2602.03515): a coordinate-wise adaptive optimizer fed
stale gradients oscillates when the Hessian eigenbasis is not the coordinate basis, and that
penalty grows with the delay, i.e. with pipeline depth. Rotating Adam's coordinates into an
estimate of that eigenbasis (a Kronecker-factored one, as Shampoo/SOAP) keeps delayed updates
useful.

Per 2-D hidden matrix W (r x c, `is_hidden_matrix`), gradient G, 1-based step t, bases Q_L,
Q_R (identity until the first refresh):

    G' = Q_L^T G Q_R                                         (rotate into the current basis)
    m <- b1 m + (1 - b1) G';   v <- b2 v + (1 - b2) G' * G'  (Adam's moments, rotated coords)
    N  = (m / (1 - b1^t)) / (sqrt(v) / sqrt(1 - b2^t) + eps)
    W  <- W (1 - lr wd) - lr Q_L N Q_R^T                      (rotate the update back)
    L <- b2 L + (1 - b2) G G^T  (r x r);   R <- b2 R + (1 - b2) G^T G  (c x c)
    if t is a refresh step: Q_L, Q_R <- eigenvectors of L, R  (torch.linalg.eigh, fp32), and with
        A = Q_L,new^T Q_L,old, B = Q_R,old^T Q_R,new:   m <- A m B,   v <- (A*A) v (B*B)

Choices (SOAP = Vyas et al. 2024, "SOAP: improving and stabilizing Shampoo using Adam"):
- Refreshes at the end of steps t = 1, 1 + k, 1 + 2k, ..., k the refresh period (below); they come
  after the step, so a gradient is never rotated by a basis built from itself (as SOAP). This
  matters: in the eigenbasis of G G^T and G^T G, G itself is diagonal (its SVD), so with the
  current gradient in the factors at t = 1 every off-diagonal coordinate of G' is rounding noise
  and Adam's normalisation turns that noise into +-lr steps. SOAP skips step 1 instead; here
  step 1 runs in the identity basis, i.e. it is exactly an AdamW step.
- The first moment is rotated exactly into a new basis (as SOAP). The second moment is a
  diagonal in the old basis and cannot be rotated exactly; we replace it by the diagonal of the
  rotated second-moment matrix under Adam's own independence assumption, (A*A) v (B*B) (squares
  elementwise). It keeps sum(v), is exact when the new basis is a signed permutation of the old,
  and costs two small matmuls. (SOAP keeps v and only re-sorts it; our choice, documented.)
- The factor EMA uses beta2 (SOAP's shampoo_beta defaults to its beta2); the factors need no
  bias correction because eigenvectors do not depend on scale.
- Embeddings, head, norms and biases (everything that is not a hidden matrix) use plain AdamW
  with the same lr, betas, eps and weight decay, as in muon.

Stage-aware rotation (design choice, from seed 004 and the paper's bound): the delay penalty is
amplified by basis misalignment, and a basis goes stale as training moves; stage j sees gradients
delta_j steps old, so its penalty per unit of misalignment scales with about (1 + delta_j).
Keeping the product (age of basis) x (1 + delta_j) equal across stages gives the refresh period

    k_j = max(1, rotate_every // (1 + delta_j))     (stage_aware = true; else k_j = rotate_every)

so the last stage (delta = 0) keeps `rotate_every` and the deepest stages refresh every step.
The seed lists "rotation estimated too rarely accumulates error" as the method's limitation and
"adaptive rotation frequency" as the way forward; the frequency is the knob we spend on the
stages that are hurt most. The cost is one eigh per factor per refresh, paid only where stale.

State (flat, per parameter): m, v (rotated coordinates, W's shape), L, R, QL, QR (fp32); the
refresh period is derived from the spec (RotatedAdamRule.period), not stored.
StageOptimizer.state_bytes() counts all of them; the extra memory over AdamW is
4 (2 r^2 + 2 c^2) bytes per hidden matrix. Error feedback, 8-bit m/v storage and the schedules
compose through StageOptimizer unchanged (EF acts on the applied update, whatever produced it).
"""

from __future__ import annotations

import math

import torch

from mesh.algo.muon import is_hidden_matrix
from mesh.algo.optim import AdamWRule, OptimSpec, State, UpdateRule, register_optimizer


def refresh_period(rotate_every: int, delay: int, stage_aware: bool) -> int:
    """Steps between eigenbasis refreshes of a stage with gradient delay `delay`."""
    if rotate_every < 1 or delay < 0:
        raise ValueError(f"need rotate_every >= 1 and delay >= 0, got {rotate_every}, {delay}")
    return max(1, rotate_every // (1 + delay)) if stage_aware else rotate_every


def refresh_due(step: int, period: int) -> bool:
    """True at steps 1, 1 + period, 1 + 2 period, ... (1-based step)."""
    return (step - 1) % period == 0


def eigenbasis(factor: torch.Tensor) -> torch.Tensor:
    """Orthonormal eigenvectors (columns, ascending eigenvalues) of a symmetric factor, in fp32."""
    f = factor.to(torch.float32)
    return torch.linalg.eigh(0.5 * (f + f.T)).eigenvectors


class RotatedAdamRule:
    """Adam's moments in the eigenbasis of the EMA Kronecker factors of one matrix's gradient."""

    kind = "rotated_adam"
    # m and v may be stored in 8 bits between steps; the factors and bases never are.
    quantized: dict[str, bool] = {"m": True, "v": False}

    def __init__(
        self,
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        period: int,
    ) -> None:
        self.lr, self.beta1, self.beta2 = lr, beta1, beta2
        self.eps, self.weight_decay = eps, weight_decay
        self.period = period

    def init_state(self, p: torch.Tensor) -> State:
        rows, cols = p.shape
        f32 = {"dtype": torch.float32, "device": p.device}
        return {
            "m": torch.zeros(rows, cols, **f32),
            "v": torch.zeros(rows, cols, **f32),
            "L": torch.zeros(rows, rows, **f32),
            "R": torch.zeros(cols, cols, **f32),
            "QL": torch.eye(rows, **f32),
            "QR": torch.eye(cols, **f32),
        }

    def apply(
        self, p: torch.Tensor, g: torch.Tensor, state: State, step: int, lr_scale: float
    ) -> None:
        m, v, L, R = state["m"], state["v"], state["L"], state["R"]
        QL, QR = state["QL"], state["QR"]
        assert isinstance(m, torch.Tensor) and isinstance(v, torch.Tensor)
        assert isinstance(L, torch.Tensor) and isinstance(R, torch.Tensor)
        assert isinstance(QL, torch.Tensor) and isinstance(QR, torch.Tensor)
        g32 = g.to(torch.float32)
        gr = QL.T @ g32 @ QR  # G' in the current basis
        m.lerp_(gr, 1.0 - self.beta1)  # m = b1 m + (1 - b1) G'
        v.mul_(self.beta2).addcmul_(gr, gr, value=1.0 - self.beta2)  # v = b2 v + (1 - b2) G'^2
        bc1 = 1.0 - self.beta1**step
        bc2 = 1.0 - self.beta2**step
        # Same operation order as AdamWRule: with identity bases the step is AdamW's.
        denom = (v.sqrt() / math.sqrt(bc2)).add_(self.eps)
        update = QL @ (m / denom) @ QR.T  # rotate back to W's coordinates
        lr = self.lr * lr_scale
        p.mul_(1.0 - lr * self.weight_decay)
        p.add_(update.to(p.dtype), alpha=-lr / bc1)
        L.addmm_(g32, g32.T, beta=self.beta2, alpha=1.0 - self.beta2)  # b2 L + (1 - b2) G G^T
        R.addmm_(g32.T, g32, beta=self.beta2, alpha=1.0 - self.beta2)  # b2 R + (1 - b2) G^T G
        if refresh_due(step, self.period):
            new_QL, new_QR = eigenbasis(L), eigenbasis(R)
            A, B = new_QL.T @ QL, QR.T @ new_QR
            m.copy_(A @ m @ B)  # exact change of basis of the first moment
            v.copy_((A * A) @ v @ (B * B))  # diagonal of the rotated second moment
            QL.copy_(new_QL)
            QR.copy_(new_QR)


@register_optimizer("rotated_adam")
def plan_rotated_adam(name: str, p: torch.Tensor, spec: OptimSpec) -> UpdateRule:
    """Rotated Adam for hidden matrices, AdamW (same hyper-parameters) for everything else."""
    b1 = spec.resolved_beta1()
    if not is_hidden_matrix(name, p):
        return AdamWRule(spec.lr, b1, spec.beta2, spec.eps, spec.weight_decay)
    period = refresh_period(spec.rotate_every, spec.delay, spec.stage_aware)
    return RotatedAdamRule(spec.lr, b1, spec.beta2, spec.eps, spec.weight_decay, period)
