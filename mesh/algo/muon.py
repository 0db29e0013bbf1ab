"""Muon for one pipeline stage: which parameters are hidden matrices, Newton-Schulz, the update.

Pure tensor math with no import of mesh.algo.optim (which registers the "muon" optimizer and pairs
this rule with AdamW for everything else). The update is KellerJordan/Muon's.
"""

from __future__ import annotations

import math
import re

import torch

NS_COEFFS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)

# A transformer block's own sub-module: "blocks.<i>." anywhere in the name (a stage may prefix it).
_BLOCK = re.compile(r"(^|\.)blocks\.\d+\.")
# 2-D tensors inside a block that are still not "hidden matrices" (4.3: embeddings, norms).
_NOT_HIDDEN = ("emb", "ln", "norm")


def is_hidden_matrix(name: str, p: torch.Tensor) -> bool:
    """True for 2-D weights inside transformer blocks (qkv, attn proj, mlp fc/proj): Muon's domain.

    Embeddings, the head, norm gains, biases and scalars go to AdamW.
    """
    if p.ndim != 2 or not name.endswith(".weight") or not _BLOCK.search(name):
        return False
    leaf = name.rsplit(".", 2)[-2]  # the module owning ".weight", e.g. "qkv", "ln1"
    return not any(tag in leaf for tag in _NOT_HIDDEN)


def newton_schulz(
    G: torch.Tensor,
    steps: int = 5,
    coeffs: tuple[float, float, float] = NS_COEFFS,
    eps: float = 1e-7,
) -> torch.Tensor:
    """Approximate U V^T of G = U S V^T by the quintic Newton-Schulz iteration.

    Runs in fp32 (bf16 matmuls are slow or missing on many CPU builds); returns G's dtype. The
    singular values of the result land in about (0.5, 1.5), not exactly 1, by design of the
    coefficients (they maximise the slope at 0 so that 5 steps suffice).
    """
    if G.ndim != 2:
        raise ValueError(f"newton_schulz needs a 2-D matrix, got shape {tuple(G.shape)}")
    a, b, c = coeffs
    X = G.to(torch.float32)
    tall = X.shape[0] > X.shape[1]
    if tall:  # iterate on the smaller Gram matrix X X^T
        X = X.T
    X = X / (X.norm() + eps)  # Frobenius norm >= spectral norm, so all singular values <= 1
    for _ in range(steps):
        A = X @ X.T
        B = b * A + c * (A @ A)
        X = a * X + B @ X  # X <- a X + b (X X^T) X + c (X X^T)^2 X
    if tall:
        X = X.T
    return X.to(G.dtype)


class MuonRule:
    """Muon on one hidden matrix, KJ form with decoupled weight decay.

    B <- beta B + (1 - beta) G;  U <- (1 - beta) G + beta B (nesterov) else B;
    O <- NS(U) sqrt(max(1, rows / cols));  W <- W (1 - lr wd) - lr O.
    """

    kind = "muon"
    # State key -> signed (for optional 8-bit storage between steps).
    quantized: dict[str, bool] = {"b": True}

    def __init__(
        self, lr: float, momentum: float, nesterov: bool, weight_decay: float, ns_steps: int
    ) -> None:
        self.lr = lr
        self.momentum = momentum
        self.nesterov = nesterov
        self.weight_decay = weight_decay
        self.ns_steps = ns_steps

    def init_state(self, p: torch.Tensor) -> dict[str, torch.Tensor | int | float]:
        return {"b": torch.zeros_like(p, memory_format=torch.preserve_format)}

    def apply(
        self,
        p: torch.Tensor,
        g: torch.Tensor,
        state: dict[str, torch.Tensor | int | float],
        step: int,
        lr_scale: float,
    ) -> None:
        lr = self.lr * lr_scale
        beta = self.momentum
        buf = state["b"]
        assert isinstance(buf, torch.Tensor)
        buf.lerp_(g, 1.0 - beta)  # B = beta B + (1 - beta) G
        u = g.lerp(buf, beta) if self.nesterov else buf  # (1 - beta) G + beta B
        rows, cols = p.shape
        o = newton_schulz(u, self.ns_steps) * math.sqrt(max(1.0, rows / cols))
        p.mul_(1.0 - lr * self.weight_decay)
        p.add_(o.to(p.dtype), alpha=-lr)
