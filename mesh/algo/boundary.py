"""Compressed stage boundaries: the math, as small pure functions (pipeline.boundary).

What crosses the link between stage j and j+1 is, per token, `width` values in the pipeline
codec, forward (the activation) and backward (its gradient) alike:
- full: the d_model-wide residual stream h.
- subspace (Subspace Networks, arXiv 2506.01260): c = U^T (h - E0[x]) with one fixed orthonormal
  U (d x r) shared by every boundary and E0 the token embedding's initial table; the receiver
  rebuilds h = U c + E0[x]. Every write into the residual stream (the embedding's trainable part,
  each block's o_proj and down_proj) is projected onto span(U) after every change of the weights,
  so h always lies in E0[x] + span(U) and the rebuild is exact: the model is a plain Llama whose
  residual stream has r free dimensions.
- learned (after MAPL, arXiv 2606.05484): the sender keeps an orthonormal encoder U_j (a point
  on the Stiefel manifold: gradient projected onto its tangent space, QR retraction after each
  change) and a token anchor a_s(x) = A_s[x] B_s; it sends c = U_j^T (h - a_s(x)). The receiver
  keeps a decoder D_j (initialised to U_j) and its own anchor; it rebuilds D_j c + a_r(x). Each
  side's parameters get their exact gradients from what that side holds (c and dL/dc cross the
  link), so nothing else is exchanged; the rebuild is exact for h - a_s(x) in span(U_j) while
  D_j = U_j (at initialisation).

Token ids never cross the link: every stage reads the microbatch's tokens from its own copy of
the data (the last stage already does, for the targets). Imports: torch. What a boundary
costs in bytes through a codec is mesh.engine.plan's (boundary_bytes, rank_for_compression).
"""

from __future__ import annotations

import hashlib

import torch

from mesh.choices import BOUNDARIES


def width(d_model: int, method: str, rank: int) -> int:
    """Values per token that cross a boundary."""
    assert method in BOUNDARIES, method
    return d_model if method == "full" else rank


def payload_shape(batch: int, seq_len: int, d_model: int, method: str, rank: int) -> tuple:
    """The (B, T, width) tensor an activation message (and its gradient) carries."""
    return (batch, seq_len, width(d_model, method, rank))


# ---- orthonormal bases --------------------------------------------------------------------


def _seed(seed: int, key: str) -> int:
    digest = hashlib.sha256(f"meshtrain-boundary/{seed}/{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def initial_basis(seed: int, key: str, d: int, r: int) -> torch.Tensor:
    """A seeded orthonormal d x r basis (QR of a Gaussian): the same on every peer for a key."""
    gen = torch.Generator().manual_seed(_seed(seed, key))
    return retract(torch.randn(d, r, generator=gen, dtype=torch.float64)).float()


def retract(u: torch.Tensor) -> torch.Tensor:
    """The QR retraction onto the Stiefel manifold: the Q factor with a non-negative R diagonal
    (so a basis that is already orthonormal maps to itself)."""
    q, rr = torch.linalg.qr(u.double() if u.dtype != torch.float64 else u)
    signs = torch.sign(torch.diagonal(rr))
    signs[signs == 0] = 1
    return (q * signs).to(u.dtype)


def tangent(u: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """A Euclidean gradient's projection onto the Stiefel tangent space at u (orthonormal):
    g - u sym(u^T g), the Riemannian gradient for the embedded metric."""
    ug = u.T @ g
    return g - u @ ((ug + ug.T) / 2)


def orthonormality_error(u: torch.Tensor) -> float:
    """max |u^T u - I|: 0 for a point on the manifold."""
    eye = torch.eye(u.shape[1], dtype=u.dtype, device=u.device)
    return float((u.T @ u - eye).abs().max())


# ---- the fixed subspace's constraint ------------------------------------------------------


def project_out_dim(u: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """u u^T w for a weight whose rows write the residual stream (nn.Linear(k, d).weight: d x k)."""
    return u @ (u.T @ w)


def project_embedding(u: torch.Tensor, e: torch.Tensor, e0: torch.Tensor) -> torch.Tensor:
    """e0 + (e - e0) u u^T for a token table (V x d) whose trainable part must lie in span(u)."""
    return e0 + ((e - e0) @ u) @ u.T


# ---- encode / decode ----------------------------------------------------------------------


def encode(h: torch.Tensor, basis: torch.Tensor, anchor: torch.Tensor | None) -> torch.Tensor:
    """(B, T, d) -> (B, T, r): the coordinates of h - anchor in the basis."""
    return (h if anchor is None else h - anchor) @ basis


def decode(c: torch.Tensor, basis: torch.Tensor, anchor: torch.Tensor | None) -> torch.Tensor:
    """(B, T, r) -> (B, T, d): basis c (+ anchor)."""
    h = c @ basis.T
    return h if anchor is None else h + anchor
