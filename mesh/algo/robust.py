"""Averaging that a poisoning replica cannot steer, the pure parts (issue 16 item 4).

A peer that sends finite but wrong values (weights scaled by 1e3, sign-flipped, another stage's)
passes every wire check. Two defences, both on the DEQUANTIZED payloads of one round, in the
round's member order (so every member that sees the same payloads computes the same numbers):

- `aggregate`: the coordinate-wise combination, dp.aggregate. "mean" is the plain mean
  (comms.transport.mean_in_member_order: sum in order, then divide); "trimmed_mean" drops the
  `trim_count(n)` largest and smallest values of every coordinate and averages the rest;
  "median" takes the middle value (the mean of the two middle ones for an even count). With one
  poisoner among n >= 3 the last two stay between honest values.
- `outliers`: the deviation bound, dp.outlier_k, for any n. A payload whose RMS distance to this
  replica's own payload exceeds k times a reference distance is rejected. The reference is the
  lower median of the recent accepted distances together with this round's (the LOWER median,
  so with two other members, one honest and one poisoner, the honest distance is the reference
  from the first round on); 0 (identical replicas) gives no scale to judge by and rejects
  nothing.

Tensors in, tensors and names out; the running window is the caller's (mesh/engine/cell.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from comms.transport import mean_in_member_order
from mesh.choices import AGGREGATES

ROBUST_MIN_MEMBERS = 3  # trimmed_mean / median need an honest majority around a poisoner
OUTLIER_WINDOW = 16  # accepted distances the reference remembers: a few rounds, so the scale
# follows the replicas' spread as it grows in early training


def screened(aggregate: str, outlier_k: float) -> bool:
    """Whether each member combines a round itself (dp.aggregate other than the plain mean, or
    the deviation bound dp.outlier_k on): it measures the others' payloads against its own, so
    it needs every payload, its own included, and no shared mean serves it."""
    return aggregate != "mean" or outlier_k > 0


def trim_count(n: int) -> int:
    """Values trimmed at EACH end of a coordinate by trimmed_mean over n payloads: a quarter,
    at least one (n = 3: the median; n = 4: the mean of the middle two)."""
    if n < ROBUST_MIN_MEMBERS:
        raise ValueError(f"trimmed_mean needs >= {ROBUST_MIN_MEMBERS} payloads, got {n}")
    return max(1, n // 4)


def aggregate(parts: Sequence[torch.Tensor], how: str) -> torch.Tensor:
    """Coordinate-wise combination of equally shaped payloads (see the module docstring)."""
    if how not in AGGREGATES:
        raise ValueError(f"aggregate must be one of {AGGREGATES}, got {how!r}")
    if not parts:
        raise ValueError("no payloads to aggregate")
    n = len(parts)
    if how == "mean" or n < ROBUST_MIN_MEMBERS:  # with 1 or 2 values every rule is the mean
        return mean_in_member_order(parts)
    ranked = torch.stack([p.to(torch.float32) for p in parts]).sort(dim=0).values
    if how == "median":
        lo, hi = ranked[(n - 1) // 2], ranked[n // 2]
        return lo.clone() if n % 2 else (lo + hi).div_(2)
    t = trim_count(n)
    return mean_in_member_order(list(ranked[t : n - t]))


def rms_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Root-mean-square difference of two payloads (comparable across round sizes)."""
    diff = a.to(torch.float32) - b.to(torch.float32)
    return math.sqrt(float(diff.square().mean())) if diff.numel() else 0.0


def lower_median(values: Sequence[float]) -> float:
    ranked = sorted(values)
    return ranked[(len(ranked) - 1) // 2]


def outliers(distances: dict[str, float], history: Sequence[float], k: float) -> set[str]:
    """Members whose distance exceeds k x the reference (see the module docstring); none when
    k is 0 (the bound is off) or the reference is 0."""
    if k <= 0 or not distances:
        return set()
    ref = lower_median([*history, *distances.values()])
    if ref <= 0:
        return set()
    return {name for name, d in distances.items() if d > k * ref}
