"""Sparse data-parallel averaging, the pure parts: which indices, how an arrival is applied, bytes.

Role: every replica of stage j calls `subset_indices` with the same (seed, stage, tensor, round)
and gets the same index set, so only values cross the wire, never indices (design 1.3 step 1,
algorithms.md 3.1). `apply_arrival` is the per-arrival drift correction of design 1.3 step 3
(algorithms.md 3.3); the byte formulas are algorithms.md 7.5 and bench-and-reliability.md 3.2.
Tensors in, tensors out; the only state is a small cache of permutations.
"""

from __future__ import annotations

import hashlib
import math
import operator
from collections import OrderedDict

import torch

SELECTORS = ("partition", "bernoulli")
CORRECTIONS = ("ema", "delta", "replace")

# Permutation cache: every round of a tensor reuses its one permutation (randperm of 10M
# elements costs ~0.3 s). Bounded by entries and by elements; stored as int32 where it fits.
_CACHE: OrderedDict[tuple[int, int, int, int], torch.Tensor] = OrderedDict()
_CACHE_MAX_ENTRIES = 256
_CACHE_MAX_ELEMENTS = 1 << 27  # 512 MiB of int32


def stable_seed(*ints: int) -> int:
    """A 63-bit seed from integers, identical in every process (never the salted hash())."""
    text = ",".join(str(operator.index(i)) for i in ints).encode("ascii")
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def num_parts(fraction: float) -> int:
    """K = ceil(1/p): rounds per cycle of the partition selector; each round averages 1/K."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"dp.fraction must be in (0, 1], got {fraction}")
    # The tolerance keeps p = 0.05 at K = 20 even if 1/p rounds to 20.000000000000004.
    return max(1, math.ceil(1.0 / fraction - 1e-9))


def _part_bounds(numel: int, k: int, part: int) -> tuple[int, int]:
    # floor(g*n/K): parts differ by at most one element and tile 0..n exactly once.
    return part * numel // k, (part + 1) * numel // k


def _permutation(seed: int, stage: int, tensor_index: int, numel: int) -> torch.Tensor:
    key = (seed, stage, tensor_index, numel)
    perm = _CACHE.get(key)
    if perm is not None:
        _CACHE.move_to_end(key)
        return perm
    gen = torch.Generator(device="cpu").manual_seed(stable_seed(seed, stage, tensor_index))
    perm = torch.randperm(numel, generator=gen, dtype=torch.int64)
    if numel < 2**31:
        perm = perm.to(torch.int32)
    if numel <= _CACHE_MAX_ELEMENTS:
        _CACHE[key] = perm
        while len(_CACHE) > _CACHE_MAX_ENTRIES or (
            sum(t.numel() for t in _CACHE.values()) > _CACHE_MAX_ELEMENTS
        ):
            _CACHE.popitem(last=False)
    return perm


def clear_index_cache() -> None:
    """Drop the cached permutations (tests, or to free memory)."""
    _CACHE.clear()


def subset_indices(
    seed: int,
    stage: int,
    tensor_index: int,
    round_index: int,
    numel: int,
    fraction: float,
    selector: str = "partition",
) -> torch.Tensor:
    """Sorted int64 flat indices of round `round_index` for one tensor of one stage.

    partition: one permutation per (seed, stage, tensor) for the whole run, cut into K parts;
    round r takes part r % K. Every coordinate is averaged exactly once in any K consecutive
    rounds, always K rounds apart, so none is in flight twice while tau <= K x
    dp.interval_steps (algorithms.md 3.3 overlap caveat). A permutation re-drawn every cycle
    would break that at the seams: a coordinate late in cycle c can come early in cycle c+1
    while its first round is still in flight (about 2% of launches at p = 0.05, tau = 5), and
    its measured drift would then include that round's jump.
    bernoulli: each coordinate independently with probability `fraction` (variable size).
    fraction 1.0 selects everything.
    """
    k = num_parts(fraction)
    if numel < 0 or round_index < 0:
        raise ValueError(f"numel and round_index must be >= 0, got {numel}, {round_index}")
    if selector not in SELECTORS:
        raise ValueError(f"dp.selector = {selector!r} is unknown; use one of {SELECTORS}")
    if fraction >= 1.0:
        return torch.arange(numel, dtype=torch.int64)
    if selector == "bernoulli":
        gen = torch.Generator(device="cpu").manual_seed(
            stable_seed(seed, stage, tensor_index, round_index, 1)  # not a permutation seed
        )
        mask = torch.rand(numel, generator=gen) < fraction
        return mask.nonzero().flatten()
    perm = _permutation(seed, stage, tensor_index, numel)
    lo, hi = _part_bounds(numel, k, round_index % k)
    return perm[lo:hi].sort().values.to(torch.int64)


def subset_sizes(numels: list[int], fraction: float, round_index: int = 0) -> list[int]:
    """Exact per-tensor payload sizes of a partition round (sizes differ by <= 1 over rounds)."""
    k = num_parts(fraction)
    lo_hi = [_part_bounds(n, k, round_index % k) for n in numels]
    return [hi - lo for lo, hi in lo_hi]


def arrivals_before(round_index: int, fraction: float, selector: str = "partition") -> float:
    """Averages a coordinate of round `round_index` has received before this one lands: exactly
    round // K for the partition selector (each coordinate once per K rounds), the expected
    round x p for bernoulli. lambda's arrivals clock (dp.lambda_clock = 'arrivals')."""
    if round_index < 0:
        raise ValueError(f"round_index must be >= 0, got {round_index}")
    if selector == "bernoulli":
        return round_index * fraction
    return float(round_index // num_parts(fraction))


def arrivals_per_coordinate(horizon_steps: int, fraction: float, interval_steps: int = 1) -> int:
    """Averages each coordinate receives over the schedule horizon: rounds / K (>= 1)."""
    if horizon_steps < 1 or interval_steps < 1:
        raise ValueError(
            f"horizon and interval must be >= 1, got {horizon_steps}, {interval_steps}"
        )
    rounds = -(-horizon_steps // interval_steps)  # a round is launched at steps 0, H, 2H, ...
    return max(1, rounds // num_parts(fraction))


def apply_arrival(
    live: torch.Tensor,
    snapshot: torch.Tensor,
    mean: torch.Tensor,
    drift_ema: torch.Tensor,
    correction: str,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(new live values, new drift EMA values) on the subset S of an arrived round.

    live = w_i[S] now, snapshot = w_i[S] at launch, mean = the decoded all-replica mean of the
    snapshots, drift_ema = d[S]. Design 1.3 step 3 / algorithms.md 3.3:
      ema:     drift = live - snapshot; d = (1-lam) d + lam drift; live = mean + d
      delta:   live = mean + (live - snapshot), d unchanged   (= ema with lam = 1 for live)
      replace: live = mean, d unchanged                        (AsyncSPARTA, SPARTA)
    Pure: inputs are not modified.
    """
    if correction not in CORRECTIONS:
        raise ValueError(f"dp.correction = {correction!r} is unknown; use one of {CORRECTIONS}")
    if not (live.shape == snapshot.shape == mean.shape == drift_ema.shape) or live.dim() != 1:
        raise ValueError(
            f"apply_arrival needs 1-D tensors of one shape, got {live.shape}, "
            f"{snapshot.shape}, {mean.shape}, {drift_ema.shape}"
        )
    mean_v = mean.to(live.dtype)
    if correction == "replace":
        return mean_v.clone(), drift_ema.clone()
    drift = live.to(drift_ema.dtype) - snapshot.to(drift_ema.dtype)
    if correction == "delta":
        return (mean_v + drift.to(live.dtype)), drift_ema.clone()
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lambda must be in [0, 1], got {lam}")
    # lerp(d, drift, lam) = d + lam (drift - d) = (1-lam) d + lam drift, and exactly drift at
    # lam = 1, so the delta rule is the lam = 1 special case bit for bit.
    d = torch.lerp(drift_ema, drift, lam)
    return mean_v + d.to(live.dtype), d


def relative_mean(mean: torch.Tensor, snapshot: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """The mean as this replica applies it with dp.payload_error_feedback: its own snapshot plus
    how far the decoded mean is from its own decoded payload, mean + (snapshot - own). The
    codec's error on its own payload cancels: where every replica sent the same values the
    result is the exact snapshot, not its rounding (which, written into the weights every K
    rounds, would random-walk). Only the difference of the members' rounding errors is left."""
    return mean + (snapshot.to(mean.dtype) - own.to(mean.dtype))


def ring_allreduce_bytes(payload_bytes: float, num_replicas: int) -> float:
    """Bytes each replica sends in a ring all-reduce of a payload: 2(m-1)/m * payload."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    return 2.0 * (num_replicas - 1) / num_replicas * payload_bytes


def dp_bytes_per_replica_step(
    numel: int,
    num_replicas: int,
    bytes_per_value: float,
    fraction: float = 1.0,
    interval_steps: int = 1,
) -> float:
    """Averaging bytes one replica sends per step: 2(m-1)/m * p * N * b / H (algorithms 7.5).

    bytes_per_value includes codec overhead, e.g. fp8 with fp32 scales per 128: 1 + 4/128.
    Indices are never sent. 0 for m = 1.
    """
    if interval_steps < 1:
        raise ValueError(f"dp.interval_steps must be >= 1, got {interval_steps}")
    payload = fraction * numel * bytes_per_value
    return ring_allreduce_bytes(payload, num_replicas) / interval_steps
