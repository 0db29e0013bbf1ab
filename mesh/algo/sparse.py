"""Sparse data-parallel averaging, the pure parts: which indices, how an arrival is applied, bytes.

Role: every replica of stage j calls `subset_indices` with the same (seed, stage, tensor, round)
and gets the same index set, so only values cross the wire, never indices. `apply_arrival` is
the drift correction a round's mean gets when it lands (the updates made since its launch are
kept); `dp_bytes_per_replica_step` is what the averaging puts on the wire.
Tensors in, tensors out; the only state is the small cache of the old "permutation" index map.
"""

from __future__ import annotations

import hashlib
import math
import operator
from collections import OrderedDict
from dataclasses import dataclass

import torch

from mesh.choices import CORRECTIONS, INDEX_MAPS, SELECTORS

# How the partition selector maps a round's positions to coordinates (dp.index_map). keyed: a
# keyed bijection evaluated on the round's k positions only, O(k) per round. permutation: one
# torch.randperm per tensor, cached (the map of runs from before the key, whose numbers it keeps).

_MASK32 = 0xFFFFFFFF
# Four Feistel rounds: Luby-Rackoff's count for a pseudorandom permutation from pseudorandom
# round functions. Even, so the state ends on the a x b grid it started on.
_FEISTEL_ROUNDS = 4

# Permutation cache of index_map "permutation": every round of a tensor reuses its one permutation
# (randperm of 10M elements costs ~0.3 s). Bounded by entries and by elements; stored as int32
# where it fits. A tensor larger than the bound is drawn anew every round.
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


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """A fixed integer hash of int64 values in [0, 2^32) onto [0, 2^32) (hash-prospector's
    16/21f0aaad/15/735a2d97/15). Both multipliers are < 2^31, so no product leaves int64."""
    h = h ^ (h >> 16)
    h = (h * 0x21F0AAAD) & _MASK32
    h = h ^ (h >> 15)
    h = (h * 0x735A2D97) & _MASK32
    return h ^ (h >> 15)


def feistel_grid(numel: int) -> tuple[int, int]:
    """(a, b): the near-square grid a x b >= numel the keyed bijection permutes.

    a = ceil(sqrt(numel)) and b = ceil(numel / a), so a*b - numel < a: at most a (about
    sqrt(numel)) grid cells lie outside [0, numel), which keeps cycle-walking rare; a
    power-of-two domain would leave up to 3/4 of it outside.
    """
    if numel < 1:
        raise ValueError(f"numel must be >= 1, got {numel}")
    a = math.isqrt(numel - 1) + 1
    return a, -(-numel // a)


def feistel_keys(seed: int, stage: int, tensor_index: int) -> list[int]:
    """The round keys of one tensor's bijection, identical in every process. Tag 2 keeps them
    apart from the bernoulli selector's seeds (tag 1)."""
    return [stable_seed(seed, stage, tensor_index, 2, j) for j in range(_FEISTEL_ROUNDS)]


def feistel_round_table(key: int, size: int, modulus: int) -> torch.Tensor:
    """F(r) for every r in [0, size): the keyed round function of one Feistel round, as values
    in [0, modulus). A table because the right half takes only `size` (~sqrt(numel)) values:
    one small gather per round instead of hashing all k positions."""
    r = torch.arange(size, dtype=torch.int64)
    h = _mix32(_mix32(r ^ (key & _MASK32)) ^ (key >> 32))  # both halves of the 63-bit key
    return (h * modulus) >> 32  # multiply-shift onto [0, modulus): h < 2^32, modulus < 2^31


def feistel_permute(x: torch.Tensor, a: int, b: int, keys: list[int]) -> torch.Tensor:
    """A keyed bijection of [0, a*b), applied to each value of x (consumed: its storage is reused).

    Numeric Feistel network on Z_a x Z_b (the FF1 construction): x = L*b + R, and each round
    maps (L in Z_s, R in Z_t) to (R, (L + F(R)) mod s), which swaps the sides' sizes; inverting
    it needs only F, so every round is a bijection whatever F is. An even number of rounds ends
    on Z_a x Z_b again.
    """
    left = torch.div(x, b, rounding_mode="floor")
    right = x.sub_(left, alpha=b)  # x mod b, in x's storage
    gathered = torch.empty_like(left)
    s, t = a, b  # the moduli of left and right
    for key in keys:
        table = feistel_round_table(key, t, s).to(x.dtype)
        torch.index_select(table, 0, right, out=gathered)
        left.add_(gathered).remainder_(s)  # both < s: one remainder is the modular sum
        left, right, s, t = right, left, t, s
    return left.mul_(b).add_(right)


def keyed_bijection(x: torch.Tensor, numel: int, keys: list[int]) -> torch.Tensor:
    """pi(x) for each x in [0, numel): the Feistel permutation of the a x b grid restricted to
    [0, numel) by cycle-walking (a value that lands outside is permuted again until inside).

    x is consumed. A walk from an in-range value meets at most a*b - numel out-of-range values
    before it returns into range (its cycle leads back to where it started), so the loop ends
    within that many passes; each pass touches only the values still outside, and only ~1 in
    sqrt(numel) of them is outside after the first.
    """
    a, b = feistel_grid(numel)
    y = feistel_permute(x, a, b, keys)
    outside = (y >= numel).nonzero().flatten()
    for _ in range(a * b - numel):
        if outside.numel() == 0:
            break
        walked = feistel_permute(y[outside], a, b, keys)
        y[outside] = walked
        outside = outside[walked >= numel]
    if outside.numel():
        raise RuntimeError("cycle-walking did not end: the Feistel map is not a bijection")
    return y


def _keyed_part(
    seed: int, stage: int, tensor_index: int, numel: int, lo: int, hi: int
) -> torch.Tensor:
    """pi(lo), ..., pi(hi - 1) of the tensor's keyed bijection, sorted, as int64."""
    a, b = feistel_grid(numel)
    # int32 halves the memory traffic and sort time; every intermediate stays < 2 max(a, b)
    # or < a*b, so it suffices while the grid fits in int32.
    dtype = torch.int32 if a * b <= 2**31 else torch.int64
    x = torch.arange(lo, hi, dtype=dtype)
    y = keyed_bijection(x, numel, feistel_keys(seed, stage, tensor_index))
    return y.sort().values.to(torch.int64)


def _blocked_part(
    seed: int, stage: int, tensor_index: int, numel: int, block: int, parts: int, part: int
) -> torch.Tensor:
    """The indices of part `part` of `parts` when pi permutes runs of `block` values: the
    keyed bijection over the ceil(numel / block) runs, each selected run expanded in place."""
    runs = -(-numel // block)
    lo, hi = _part_bounds(runs, parts, part)
    if lo == hi:
        return torch.empty(0, dtype=torch.int64)
    starts = _keyed_part(seed, stage, tensor_index, runs, lo, hi) * block
    idx = (starts[:, None] + torch.arange(block, dtype=torch.int64)).reshape(-1)
    if numel % block and int(starts[-1]) + block > numel:  # the tensor's short last run
        idx = idx[: idx.numel() - (int(starts[-1]) + block - numel)]
    return idx


def clear_index_cache() -> None:
    """Drop the cached permutations of index_map "permutation" (tests, or to free memory)."""
    _CACHE.clear()


def subset_indices(
    seed: int,
    stage: int,
    tensor_index: int,
    round_index: int,
    numel: int,
    fraction: float,
    selector: str = "partition",
    index_map: str = "keyed",
    block: int = 1,
) -> torch.Tensor:
    """Sorted int64 flat indices of round `round_index` for one tensor of one stage.

    partition: one permutation pi per (seed, stage, tensor) for the whole run, cut into K parts;
    round r takes part r % K, pi of the positions lo..hi-1 of that part. Every coordinate is
    averaged exactly once in any K consecutive rounds, always K rounds apart, so none is in
    flight twice while tau <= K x dp.interval_steps (two rounds in flight on one coordinate
    would each see the other's jump as drift). A
    permutation re-drawn every cycle would break that at the seams: a coordinate late in cycle
    c can come early in cycle c+1 while its first round is still in flight (about 2% of
    launches at p = 0.05, tau = 5), and its measured drift would then include that round's
    jump.
    index_map (partition only) says what pi is. keyed: a keyed Feistel bijection evaluated on
    the part's k positions alone: O(k + sqrt(numel)) time and memory per round, no state.
    permutation: torch.randperm(numel) per tensor, cached while the cache holds it: O(numel)
    a round once a stage's tensors outgrow the cache (a llama-1b stage's flat vector does).
    block (keyed partition only): the unit pi permutes is a run of `block` contiguous values
    (the last run of the tensor may be shorter), so a round moves whole runs. At 5% of single
    coordinates nearly every 64-byte cache line of the stage holds one, and a round's gathers
    and scatters stream the whole stage through memory (~1 s a round at llama-1b on a CPU);
    runs of 64 touch 5% of the lines. Each coordinate still follows the same EMA on its own:
    only which coordinates share a round's phase changes.
    bernoulli: each coordinate independently with probability `fraction` (variable size); it
    draws numel uniforms, O(numel) a round by nature.
    fraction 1.0 selects everything.
    """
    k = num_parts(fraction)
    if numel < 0 or round_index < 0:
        raise ValueError(f"numel and round_index must be >= 0, got {numel}, {round_index}")
    if selector not in SELECTORS:
        raise ValueError(f"dp.selector = {selector!r} is unknown; use one of {SELECTORS}")
    if index_map not in INDEX_MAPS:
        raise ValueError(f"dp.index_map = {index_map!r} is unknown; use one of {INDEX_MAPS}")
    if block < 1 or (block > 1 and (selector, index_map) != ("partition", "keyed")):
        raise ValueError(
            f"dp.subset_block = {block} needs dp.selector = 'partition' and dp.index_map = "
            "'keyed' (or 1)"
        )
    if fraction >= 1.0:
        return torch.arange(numel, dtype=torch.int64)
    if block > 1:
        return _blocked_part(seed, stage, tensor_index, numel, block, k, round_index % k)
    if selector == "bernoulli":
        gen = torch.Generator(device="cpu").manual_seed(
            stable_seed(seed, stage, tensor_index, round_index, 1)  # not a permutation seed
        )
        mask = torch.rand(numel, generator=gen) < fraction
        return mask.nonzero().flatten()
    lo, hi = _part_bounds(numel, k, round_index % k)
    if index_map == "keyed":
        if lo == hi:  # an empty part (numel < K), or an empty tensor
            return torch.empty(0, dtype=torch.int64)
        return _keyed_part(seed, stage, tensor_index, numel, lo, hi)
    perm = _permutation(seed, stage, tensor_index, numel)
    return perm[lo:hi].sort().values.to(torch.int64)


@dataclass(frozen=True)
class Runs:
    """A round's indices idx into a tensor of numel values, as whole runs of `block` values
    (see runs_of): the rows of its full runs in the tensor viewed as (numel // block, block),
    and the length of the tensor's short last run if idx ends with it (0 if not). block 1:
    idx itself (rows None)."""

    numel: int
    idx: torch.Tensor
    block: int = 1
    rows: torch.Tensor | None = None
    tail: int = 0


def runs_of(numel: int, idx: torch.Tensor, block: int = 1) -> Runs:
    """idx (subset_indices with block > 1, or a slice of it that starts where a run starts) as
    Runs, worked out once for every gather and scatter of it. Refuses (assert, our invariant)
    an idx that is not whole runs, by the cheap checks: as many values as its runs hold, each
    run starting on a block."""
    if block == 1 or idx.numel() == 0:
        return Runs(numel, idx)
    starts = idx[::block]
    full = numel // block
    tail = numel - full * block if int(starts[-1]) == full * block else 0
    rows = starts[:-1] if tail else starts
    whole = idx.numel() == rows.numel() * block + tail and not bool((starts % block).any())
    assert whole, "idx is not whole runs of the block"
    return Runs(numel, idx, block, torch.div(rows, block, rounding_mode="floor"), tail)


def gather_runs(x: torch.Tensor, runs: Runs) -> torch.Tensor:
    """x.index_select(0, runs.idx) for a 1-D contiguous x, each run read as one row of x
    (numel // block, block) instead of value by value: a round's index tensor is 8 bytes a
    value to read, and each value a lookup (runs of 64 at a llama-1b stage on a CPU: ~3x
    faster). The same values in the same order."""
    assert x.numel() == runs.numel, "runs of another tensor's size"
    if runs.rows is None:
        return x.index_select(0, runs.idx)
    full = runs.numel // runs.block * runs.block
    out = x[:full].view(-1, runs.block).index_select(0, runs.rows).reshape(-1)
    return torch.cat([out, x[full:]]) if runs.tail else out


def scatter_runs_(x: torch.Tensor, runs: Runs, values: torch.Tensor) -> None:
    """x.index_copy_(0, runs.idx, values) in runs (gather_runs' inverse, in place)."""
    assert x.numel() == runs.numel, "runs of another tensor's size"
    if runs.rows is None:
        x.index_copy_(0, runs.idx, values)
        return
    full, n = runs.numel // runs.block * runs.block, runs.rows.numel() * runs.block
    x[:full].view(-1, runs.block).index_copy_(0, runs.rows, values[:n].view(-1, runs.block))
    if runs.tail:
        x[full:] = values[n:]


def subset_sizes(numels: list[int], fraction: float, round_index: int = 0) -> list[int]:
    """Exact per-tensor payload sizes of a partition round (sizes differ by <= 1 over rounds)."""
    k = num_parts(fraction)
    lo_hi = [_part_bounds(n, k, round_index % k) for n in numels]
    return [hi - lo for lo, hi in lo_hi]


def max_subset_size(numel: int, fraction: float, block: int = 1) -> int:
    """The largest payload any partition round of a tensor has (what plan reserves): ceil(n/K)
    values, or ceil(runs/K) whole runs of `block` values."""
    k = num_parts(fraction)
    if block <= 1:
        return math.ceil(numel / k)
    runs = math.ceil(numel / block)
    return min(numel, math.ceil(runs / k) * block)


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
    snapshots, drift_ema = d[S]:
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
    """Averaging bytes one replica sends per step: 2(m-1)/m * p * N * b / H (a ring all-reduce
    of fraction p of N values of b bytes among m replicas, every H steps).

    bytes_per_value includes codec overhead, e.g. fp8 with fp32 scales per 128: 1 + 4/128.
    Indices are never sent. 0 for m = 1.
    """
    if interval_steps < 1:
        raise ValueError(f"dp.interval_steps must be >= 1, got {interval_steps}")
    payload = fraction * numel * bytes_per_value
    return ring_allreduce_bytes(payload, num_replicas) / interval_steps
