"""The emulated hostile pipeline stage (faults.pipeline_poison): what a cell does to every
tensor it sends across a pipeline boundary, for tests and benchmarks of the receivers' sentinel
(mesh/algo/sentinel.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

POISON_MODES = ("scale", "flip", "random")


@dataclass(frozen=True)
class PipelinePoison:
    """What a hostile cell does to every tensor it sends across a pipeline boundary
    (activations forward, gradients backward) from update `start` on."""

    mode: str  # scale: times factor; flip: negated; random: noise of the same RMS
    factor: float = 1.0
    start: int | None = None  # None: twice the receivers' warm-up


def parse_pipeline_poison(
    items: list[str], stages: int, replicas: int, key: str = "faults.pipeline_poison"
) -> dict[tuple[int, int], PipelinePoison]:
    """["sJrI=MODE[@STEP]", ...] with MODE scale:F | flip | random -> {(stage, replica): ...};
    ValueError naming the key, the entry and the form when an entry is malformed."""
    from mesh.algo.topology import Place

    form = "expected 'sJrI=MODE[@STEP]' with MODE scale:F, flip or random, e.g. 's0r1=scale:100'"
    out: dict[tuple[int, int], PipelinePoison] = {}
    for item in items:
        name, eq, rest = str(item).partition("=")
        place = Place.parse(name.strip())
        body, at, start_text = rest.strip().partition("@")
        mode, colon, arg = body.strip().partition(":")
        poison: PipelinePoison | None = None
        try:
            start = int(start_text) if at else None
            if start is not None and start < 0:
                raise ValueError
            if mode == "scale" and colon:
                factor = float(arg)
                if math.isfinite(factor):
                    poison = PipelinePoison("scale", factor, start)
            elif mode in ("flip", "random") and not colon:
                poison = PipelinePoison(mode, 1.0, start)
        except ValueError:
            poison = None
        if place is None or not eq or poison is None:
            raise ValueError(f"{key} entry {item!r}: {form}")
        j, i = place.stage, place.replica
        if not (0 <= j < stages and 0 <= i < replicas):
            raise ValueError(
                f"{key} entry {item!r}: cell {place} is not in the {stages}x{replicas} grid"
            )
        if (j, i) in out:
            raise ValueError(f"{key} lists cell {place} twice")
        out[(j, i)] = poison
    return out


def poisoned(x: torch.Tensor, poison: PipelinePoison, seed: int) -> torch.Tensor:
    """The tensor a hostile sender sends instead of x (random: seeded noise, the same RMS)."""
    if poison.mode == "scale":
        return x * poison.factor
    if poison.mode == "flip":
        return -x
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(x.shape, generator=gen).to(device=x.device, dtype=x.dtype)
    rms = x.detach().to(torch.float32).square().mean().sqrt()
    return noise * (rms / noise.to(torch.float32).square().mean().sqrt()).to(x.dtype)
