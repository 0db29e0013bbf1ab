"""A stage's ends for a compressed boundary (pipeline.boundary; the math: mesh/algo/boundary.py).

A stage module with compressed boundaries holds `boundary`, a ModuleDict of:
- `dec{j-1}` (every stage but the first): turns the coordinates that came over boundary j-1 back
  into the residual stream;
- `enc{j}` (every stage but the last): turns its residual stream into the coordinates it sends
  over boundary j;
- `fixed` (subspace only): the shared basis U and the initial token table E0, as buffers (no
  parameters, no state: every peer rebuilds them from the run seed).

Learned ends are ordinary parameters of their stage: stashed, averaged over replicas,
checkpointed, downloaded and counted like any other. Imports: torch, mesh.algo.boundary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from mesh.algo import boundary as bmath

SeedOf = Callable[[int, str], int]  # (run seed, global parameter name) -> generator seed
ANCHOR_STD = 0.02  # the anchor's token factor; its projection starts at zero (no anchor yet)


@dataclass(frozen=True)
class BoundarySpec:
    """What a stage needs to build its ends: pipeline.boundary's method and ranks."""

    method: str = "full"
    rank: int = 16
    anchor_rank: int = 16

    @property
    def compressed(self) -> bool:
        return self.method != "full"


class LearnedEnd(nn.Module):
    """One side of a learned boundary: a d x r basis and a factorised token anchor
    (vocab x q) x (q x d). The sender's basis is kept orthonormal (the encoder); the
    receiver's is free (the decoder), starting from the same basis."""

    def __init__(self, d: int, rank: int, vocab: int, anchor_rank: int, encoder: bool) -> None:
        super().__init__()
        self.encoder = encoder
        self.basis = nn.Parameter(torch.empty(d, rank))
        self.anchor_rank = anchor_rank
        if anchor_rank > 0:
            self.anchor_emb = nn.Parameter(torch.empty(vocab, anchor_rank))
            self.anchor_proj = nn.Parameter(torch.empty(anchor_rank, d))

    def anchor(self, tokens: torch.Tensor) -> torch.Tensor | None:
        if self.anchor_rank == 0:
            return None
        return self.anchor_emb[tokens] @ self.anchor_proj

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        a = self.anchor(tokens)
        if self.encoder:
            return bmath.encode(x, self.basis, a)
        return bmath.decode(x, self.basis, a)


class FixedSubspace(nn.Module):
    """The subspace method's shared basis U (d x r) and initial token table E0 (vocab x d)."""

    def __init__(self, d: int, rank: int, vocab: int) -> None:
        super().__init__()
        self.register_buffer("basis", torch.empty(d, rank), persistent=False)
        self.register_buffer("anchor", torch.empty(vocab, d), persistent=False)


def build_ends(
    spec: BoundarySpec, d: int, vocab: int, stage: int, first: bool, last: bool
) -> nn.ModuleDict | None:
    """The `boundary` ModuleDict of stage `stage` (None for full boundaries or one stage)."""
    if not spec.compressed or (first and last):
        return None
    ends = nn.ModuleDict()
    if spec.method == "subspace":
        ends["fixed"] = FixedSubspace(d, spec.rank, vocab)
        return ends
    if not first:
        ends[f"dec{stage - 1}"] = LearnedEnd(d, spec.rank, vocab, spec.anchor_rank, False)
    if not last:
        ends[f"enc{stage}"] = LearnedEnd(d, spec.rank, vocab, spec.anchor_rank, True)
    return ends


def _cross(
    ends: nn.ModuleDict, x: torch.Tensor, tokens: torch.Tensor, encode: bool
) -> torch.Tensor:
    if "fixed" in ends:
        f = ends["fixed"]
        op = bmath.encode if encode else bmath.decode
        return op(x, f.basis, f.anchor[tokens])
    (end,) = [m for m in ends.values() if m.encoder == encode]
    return end(x, tokens)


def receive(ends: nn.ModuleDict, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Coordinates from the previous stage -> this stage's residual stream."""
    return _cross(ends, x, tokens, encode=False)


def send(ends: nn.ModuleDict, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """This stage's residual stream -> the coordinates for the next stage."""
    return _cross(ends, h, tokens, encode=True)


# ---- initialisation and the constraints, on a whole stage module --------------------------


@torch.no_grad()
def init_end(name: str, p: torch.Tensor, seed: int, param_seed: SeedOf) -> bool:
    """Initialise a boundary parameter by its global name (True when `name` is one): a basis
    from its boundary's seeded orthonormal draw (so both ends of boundary j start equal), an
    anchor's token factor N(0, ANCHOR_STD) from its name's generator and its projection zero."""
    if not name.startswith("boundary."):
        return False
    _, end, leaf = name.split(".")
    if leaf == "basis":
        p.copy_(bmath.initial_basis(seed, f"boundary{end[3:]}", *p.shape))
    elif leaf == "anchor_proj":
        p.zero_()
    else:
        gen = torch.Generator(device=p.device).manual_seed(param_seed(seed, name))
        p.normal_(0.0, ANCHOR_STD, generator=gen)
    return True


@torch.no_grad()
def init_fixed(module: nn.Module, seed: int, embedding_std: float, param_seed: SeedOf) -> None:
    """Fill a subspace stage's buffers: U from the run seed, E0 exactly as stage 0's token
    embedding is initialised (its global name's generator: `param_seed`, build.py's)."""
    ends = getattr(module, "boundary", None)
    if ends is None or "fixed" not in ends:
        return
    f = ends["fixed"]
    f.basis.copy_(bmath.initial_basis(seed, "subspace", *f.basis.shape))
    gen = torch.Generator(device=f.anchor.device).manual_seed(param_seed(seed, "tok_emb.weight"))
    f.anchor.normal_(0.0, embedding_std, generator=gen)


def _residual_writes(module: nn.Module) -> list[torch.Tensor]:
    """The weights whose outputs are added into the residual stream (o_proj, down_proj)."""
    out = []
    for block in module.blocks.values():
        out += [block.attn.o_proj.weight, block.mlp.down_proj.weight]
    return out


@torch.no_grad()
def constrain_(module: nn.Module) -> None:
    """After any change of a stage's weights (an update, an averaging arrival, a load): the
    subspace method projects every residual write onto span(U) (and the embedding's trainable
    part), the learned method retracts each encoder basis onto the Stiefel manifold. In place,
    so a cell's flat vector (which the parameters view) changes with them."""
    ends = getattr(module, "boundary", None)
    if ends is None:
        return
    if "fixed" in ends:
        u, e0 = ends["fixed"].basis, ends["fixed"].anchor
        for w in _residual_writes(module):
            w.copy_(bmath.project_out_dim(u, w))
        if module.first:
            e = module.tok_emb.weight
            e.copy_(bmath.project_embedding(u, e, e0))
        return
    for end in ends.values():
        if end.encoder:
            end.basis.copy_(bmath.retract(end.basis))


def riemannian_grads_(module: nn.Module, grads: dict[str, torch.Tensor]) -> None:
    """Replace each encoder basis's gradient (by parameter name) with its projection onto the
    Stiefel tangent space: the optimizer then steps along the manifold and the retraction
    after the step only corrects the curvature."""
    ends = getattr(module, "boundary", None)
    if ends is None or "fixed" in ends:
        return
    for key, end in ends.items():
        name = f"boundary.{key}.basis"
        if end.encoder and name in grads:
            grads[name] = bmath.tangent(end.basis.detach(), grads[name])
