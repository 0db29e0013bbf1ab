"""Sparse averaging: shared index sets, the drift-correction rule per arrival, byte formulas."""

from __future__ import annotations

import time

import pytest
import torch

from mesh.algo import sparse
from mesh.algo.optim_schedules import lambda_at
from mesh.algo.sparse import (
    apply_arrival,
    arrivals_before,
    arrivals_per_coordinate,
    clear_index_cache,
    dp_bytes_per_replica_step,
    feistel_grid,
    feistel_keys,
    feistel_permute,
    keyed_bijection,
    num_parts,
    ring_allreduce_bytes,
    stable_seed,
    subset_indices,
    subset_sizes,
)
from mesh.config import load_config
from mesh.engine.cell import Cell
from mesh.model.build import build_stages


def test_stable_seed_is_fixed_and_63_bit() -> None:
    # Hard-coded: any process, any PYTHONHASHSEED, must produce these.
    assert stable_seed(0, 1, 2, 3) == 4019600915400777878
    assert stable_seed(1234) == 7608735672164080697
    assert stable_seed(1, 2) != stable_seed(2, 1) != stable_seed(12)
    assert all(0 <= stable_seed(i, -i) < 2**63 for i in range(50))
    with pytest.raises(TypeError):
        stable_seed(1.5)  # type: ignore[arg-type]


def test_partition_indices_are_pinned() -> None:
    # Replicas in other processes must get exactly these (seed 1234, stage 1, tensor 2, p=1/4).
    want = [[13, 15, 16, 17, 18], [0, 4, 8, 11, 12], [2, 5, 6, 7, 10], [1, 3, 9, 14, 19]]
    assert [subset_indices(1234, 1, 2, r, 20, 0.25).tolist() for r in range(4)] == want
    assert subset_indices(1234, 1, 2, 4, 20, 0.25).tolist() == want[0]  # the next cycle repeats
    big = subset_indices(5, 0, 3, 1, 1_000_003, 0.05)  # int32 grid, cycle-walked
    assert big[:6].tolist() == [18, 20, 33, 46, 56, 70] and big.numel() == 50_000
    # the old map, kept for the runs from before dp.index_map, still draws what it drew
    clear_index_cache()
    old = [[3, 4, 10, 15, 18], [0, 8, 13, 14, 19], [1, 5, 9, 11, 17], [2, 6, 7, 12, 16]]
    got = [subset_indices(1234, 1, 2, r, 20, 0.25, index_map="permutation") for r in range(4)]
    assert [g.tolist() for g in got] == old
    assert subset_indices(1234, 1, 2, 0, 20, 0.25, "bernoulli").tolist() == [2, 12, 19]


@pytest.mark.parametrize("index_map", sparse.INDEX_MAPS)
def test_two_replicas_agree_and_keys_differ(index_map: str) -> None:
    a = subset_indices(7, 2, 3, 11, 5000, 0.05, index_map=index_map)
    clear_index_cache()  # the other replica computes it from scratch
    b = subset_indices(7, 2, 3, 11, 5000, 0.05, index_map=index_map)
    assert a.dtype == torch.int64 and torch.equal(a, b)
    assert torch.equal(a, a.sort().values)
    for other in [(8, 2, 3, 11), (7, 1, 3, 11), (7, 2, 4, 11), (7, 2, 3, 12), (7, 2, 3, 30)]:
        assert not torch.equal(subset_indices(*other, 5000, 0.05, index_map=index_map), a)
    other_map = [m for m in sparse.INDEX_MAPS if m != index_map][0]
    assert not torch.equal(subset_indices(7, 2, 3, 11, 5000, 0.05, index_map=other_map), a)
    for sel in ("bernoulli",):
        x = subset_indices(7, 2, 3, 11, 5000, 0.05, sel)
        assert torch.equal(x, subset_indices(7, 2, 3, 11, 5000, 0.05, sel))
        assert not torch.equal(x, subset_indices(7, 2, 3, 12, 5000, 0.05, sel))


@pytest.mark.parametrize("index_map", sparse.INDEX_MAPS)
@pytest.mark.parametrize(
    "numel, fraction",
    [(1000, 0.05), (1003, 0.05), (7, 0.3), (3, 0.05), (1, 0.05), (2, 0.5), (4, 0.3), (65_537, 0.1)],
)
def test_partition_covers_each_coordinate_once_per_cycle(
    numel: int, fraction: float, index_map: str
) -> None:
    k = num_parts(fraction)
    for cycle in range(2):
        rounds = range(cycle * k, (cycle + 1) * k)
        parts = [subset_indices(5, 0, 1, r, numel, fraction, index_map=index_map) for r in rounds]
        assert torch.equal(torch.cat(parts).sort().values, torch.arange(numel))
        assert [len(p) for p in parts] == [subset_sizes([numel], fraction, r)[0] for r in rounds]
        assert max(map(len, parts)) - min(map(len, parts)) <= 1


@pytest.mark.parametrize("index_map", sparse.INDEX_MAPS)
@pytest.mark.parametrize("fraction, interval", [(0.05, 1), (0.25, 1), (0.25, 3), (0.3, 2)])
def test_no_coordinate_is_in_flight_twice_while_tau_fits_a_cycle(
    fraction, interval, index_map
) -> None:
    """A round launched at step s lands at s + tau; with tau <= K x interval no
    coordinate of it is launched again before it lands, across many cycles (the seams too)."""
    numel, k = 997, num_parts(fraction)
    launches: dict[int, list[int]] = {}  # coordinate -> launch steps
    for r in range(5 * k + 3):
        for c in subset_indices(11, 2, 0, r, numel, fraction, index_map=index_map).tolist():
            launches.setdefault(c, []).append(r * interval)
    assert sorted(launches) == list(range(numel))
    for tau in range(k * interval + 1):
        twice = sum(b < a + tau for steps in launches.values() for a, b in zip(steps, steps[1:]))
        assert twice == 0, (tau, twice)
    gaps = {b - a for steps in launches.values() for a, b in zip(steps, steps[1:])}
    assert gaps == {k * interval}  # every coordinate exactly one cycle apart


def test_sizes_and_parts() -> None:
    assert num_parts(0.05) == 20 and num_parts(0.1) == 10 and num_parts(0.3) == 4
    assert num_parts(1.0) == 1
    assert subset_sizes([1000, 40, 19], 0.05, 3) == [50, 2, 1]
    assert sum(subset_sizes([19], 0.05, r)[0] for r in range(20)) == 19
    assert torch.equal(subset_indices(1, 0, 0, 9, 10, 1.0), torch.arange(10))
    with pytest.raises(ValueError, match="dp.fraction"):
        num_parts(0.0)
    with pytest.raises(ValueError, match="dp.selector"):
        subset_indices(1, 0, 0, 0, 10, 0.5, "topk")
    with pytest.raises(ValueError, match="dp.index_map"):
        subset_indices(1, 0, 0, 0, 10, 0.5, index_map="shuffled")
    assert subset_indices(1, 0, 0, 3, 0, 0.05).numel() == 0  # an empty tensor


def test_bernoulli_size_is_about_p() -> None:
    n = subset_indices(3, 0, 0, 0, 100_000, 0.05, "bernoulli").numel()
    assert abs(n - 5000) < 5 * (100_000 * 0.05 * 0.95) ** 0.5


def test_cache_is_reused_bounded_and_not_aliased() -> None:
    clear_index_cache()
    a = subset_indices(9, 0, 0, 0, 1000, 0.1, index_map="permutation")
    a[:] = -1  # a caller mutating its result must not corrupt the next round
    assert (subset_indices(9, 0, 0, 1, 1000, 0.1, index_map="permutation") >= 0).all()
    subset_indices(9, 0, 0, 10, 1000, 0.1, index_map="permutation")  # the next cycle
    assert len(sparse._CACHE) == 1  # every round of a tensor shares its one permutation
    for t in range(sparse._CACHE_MAX_ENTRIES + 5):
        subset_indices(9, 0, t, 0, 10, 0.1, index_map="permutation")
    assert len(sparse._CACHE) == sparse._CACHE_MAX_ENTRIES
    clear_index_cache()
    for t in range(20):  # the keyed map keeps nothing between rounds
        subset_indices(9, 0, t, t, 1000 + t, 0.1)
    assert len(sparse._CACHE) == 0


@pytest.mark.parametrize("numel", [*range(1, 40), 63, 64, 65, 1000, 1003, 4099, 65_537])
def test_keyed_bijection_is_a_permutation_exhaustively(numel: int) -> None:
    keys = feistel_keys(3, 1, 4)
    a, b = feistel_grid(numel)
    assert numel <= a * b < numel + a  # near-square: fewer than a cells to walk past
    by_dtype = {}
    for dtype in (torch.int32, torch.int64):
        y = keyed_bijection(torch.arange(numel, dtype=dtype), numel, keys)
        assert torch.equal(y.sort().values, torch.arange(numel, dtype=dtype))
        grid = feistel_permute(torch.arange(a * b, dtype=dtype), a, b, keys)
        assert torch.equal(grid.sort().values, torch.arange(a * b, dtype=dtype))
        by_dtype[dtype] = y.to(torch.int64)
    ys = by_dtype[torch.int64]
    assert torch.equal(by_dtype[torch.int32], ys)  # the map's two working dtypes draw alike
    if numel >= 6:  # other keys, another permutation, and neither is the identity
        other = keyed_bijection(torch.arange(numel), numel, feistel_keys(3, 1, 5))
        assert not torch.equal(other, ys) and not torch.equal(ys, torch.arange(numel))


def test_cycle_walking_is_bounded(monkeypatch) -> None:
    """A map that never comes back into range (not a bijection) stops with an error after at
    most a*b - numel passes instead of looping forever."""
    passes = []

    def stuck(x: torch.Tensor, a: int, b: int, keys: list[int]) -> torch.Tensor:
        passes.append(x.numel())
        return torch.full_like(x, a * b - 1)

    monkeypatch.setattr(sparse, "feistel_permute", stuck)
    with pytest.raises(RuntimeError, match="cycle-walking"):
        keyed_bijection(torch.arange(1003), 1003, feistel_keys(0, 0, 0))
    a, b = feistel_grid(1003)
    assert len(passes) == 1 + (a * b - 1003)


@pytest.mark.parametrize("rows, cols", [(1000, 1000), (2304, 600), (600, 2304), (5000, 37)])
def test_keyed_parts_spread_like_a_random_sample(rows: int, cols: int) -> None:
    """A round's coordinates of a rows x cols matrix fall into each row and each column about
    p x width times, with the spread of a random sample: not in blocks (counts of 0 and full
    rows) nor on a lattice (counts all equal), either of which would average some weights'
    neighbours together every round and others never."""
    numel, p = rows * cols, 0.05
    for r in (0, 7, 19):
        idx = subset_indices(3, 1, 0, r, numel, p)
        for counts, width in [
            (torch.bincount(idx // cols, minlength=rows), cols),
            (torch.bincount(idx % cols, minlength=cols), rows),
        ]:
            mean, var = p * width, p * (1 - p) * width  # binomial
            assert counts.double().mean().item() == pytest.approx(mean, rel=0.01)
            assert 0.6 < counts.double().var().item() / var < 1.6
            assert (counts - mean).abs().max().item() < 6 * var**0.5


def _vals(seed: int, n: int = 6) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_ema_matches_hand_written_recurrence_over_arrivals() -> None:
    lams = [0.5, 0.5, 0.3, 0.1, 0.01]
    live, d = _vals(0), torch.zeros(6, dtype=torch.float64)
    ref_live, ref_d = live.clone(), d.clone()
    for a, lam in enumerate(lams):
        snapshot, mean = live + 0.1 * _vals(10 + a), _vals(20 + a)
        live = live + 0.05 * _vals(30 + a)  # local steps while the round was in flight
        ref_live = ref_live + 0.05 * _vals(30 + a)
        args = (live, snapshot, mean, d)
        copies = [t.clone() for t in args]
        live, d = apply_arrival(*args, "ema", lam)
        assert all(torch.equal(a, c) for a, c in zip(args, copies))  # inputs untouched
        drift = ref_live - snapshot  # the drift correction, written out
        ref_d = (1 - lam) * ref_d + lam * drift
        ref_live = mean + ref_d
        assert torch.allclose(live, ref_live, atol=1e-12) and torch.allclose(d, ref_d, atol=1e-12)


def test_lambda_one_is_delta_and_replace_keeps_d() -> None:
    live, snap, mean, d = _vals(1), _vals(2), _vals(3), _vals(4)
    ema_live, ema_d = apply_arrival(live, snap, mean, d, "ema", 1.0)
    delta_live, delta_d = apply_arrival(live, snap, mean, d, "delta", 0.3)
    assert torch.equal(ema_live, delta_live)  # bit for bit
    assert torch.equal(ema_d, live - snap) and torch.equal(delta_d, d)
    rep_live, rep_d = apply_arrival(live, snap, mean, d, "replace", 0.3)
    assert torch.equal(rep_live, mean) and torch.equal(rep_d, d)
    # lambda = 0: the stale mean rolled forward by the old drift estimate only.
    z_live, z_d = apply_arrival(live, snap, mean, d, "ema", 0.0)
    assert torch.equal(z_d, d) and torch.allclose(z_live, mean + d)


def test_apply_arrival_dtypes_and_errors() -> None:
    live = torch.randn(5, dtype=torch.bfloat16)
    new_live, new_d = apply_arrival(live, live.clone(), torch.zeros(5), torch.zeros(5), "ema", 0.5)
    assert new_live.dtype == torch.bfloat16 and new_d.dtype == torch.float32
    with pytest.raises(ValueError, match="dp.correction"):
        apply_arrival(live, live, live, live, "average", 0.5)
    with pytest.raises(ValueError, match="1-D"):
        apply_arrival(live, live[:4], live, live, "ema", 0.5)
    with pytest.raises(ValueError, match="lambda"):
        apply_arrival(live, live, live, live, "ema", 1.5)


def test_byte_formulas() -> None:
    n = 1_000_000
    fp8 = 1 + 4 / 128  # fp8 values plus one fp32 scale per 128-value block
    assert dp_bytes_per_replica_step(n, 2, fp8, 0.05) == pytest.approx(0.05 * n * (1 + 4 / 128))
    assert dp_bytes_per_replica_step(n, 2, 4) == 4 * n  # fp32 full, m=2
    assert dp_bytes_per_replica_step(n, 4, 4) == 6 * n  # m=4
    assert dp_bytes_per_replica_step(n, 1, 4, 0.05) == 0.0
    assert dp_bytes_per_replica_step(n, 2, 4, 0.05, 5) == pytest.approx(0.05 * 4 * n / 5)
    assert dp_bytes_per_replica_step(236_928, 2, 4) == 947_712  # a counter measured so
    assert ring_allreduce_bytes(1000, 2) == 1000 and ring_allreduce_bytes(1000, 5) == 1600
    with pytest.raises(ValueError, match="interval_steps"):
        dp_bytes_per_replica_step(n, 2, 4, 0.05, 0)


def test_arrivals_clock_counts_the_averages_a_coordinate_has_had() -> None:
    """K = 1/p rounds make one arrival per coordinate: the paper's 1,000-step hold at p = 5% is 50
    arrivals, and a 1,600-update run gives each coordinate 80 of them."""
    k = num_parts(0.05)
    assert [arrivals_before(r, 0.05) for r in (0, k - 1, k, 2 * k + 3)] == [0, 0, 1, 2]
    assert arrivals_before(40, 0.05, "bernoulli") == pytest.approx(2.0)
    assert arrivals_per_coordinate(30_000, 0.05) == 1500
    assert arrivals_per_coordinate(1600, 0.05) == 80
    assert arrivals_per_coordinate(1600, 0.05, interval_steps=4) == 20
    assert arrivals_per_coordinate(10, 0.05) == 1  # never a zero horizon
    # every coordinate of round r has had exactly arrivals_before(r) earlier rounds
    seen = torch.zeros(400, dtype=torch.int64)
    for r in range(3 * 8):
        idx = subset_indices(3, 0, 0, r, 400, 1 / 8)
        assert (seen[idx] == arrivals_before(r, 1 / 8)).all()
        seen[idx] += 1
    with pytest.raises(ValueError):
        arrivals_before(-1, 0.05)


def test_cell_lambda_on_the_arrivals_clock() -> None:
    base = ["grid.stages=1", "grid.replicas=2", "run.steps=1600", "dp.fraction=0.05"]
    cfg = load_config([], [*base, "dp.lambda_clock=arrivals", "dp.lambda_hold_arrivals=10"])
    cell = Cell.build(cfg, 0, 0, build_stages(cfg.model, 1, 0)[0])
    # rounds 0..199 are arrivals 0..9: held; the cosine then runs over arrivals 10..80
    assert cell.lambda_for(0) == cell.lambda_for(199) == 0.5
    assert cell.lambda_for(20 * 45) == pytest.approx(0.01 + 0.49 * 0.5)  # midway: 45 of 10..80
    assert cell.lambda_for(1599) == pytest.approx(0.01, abs=2e-3)
    steps = Cell.build(load_config([], base), 0, 0, build_stages(cfg.model, 1, 0)[0])
    steps.step = 1200  # the steps clock reads the cell's update count, not the round
    assert steps.lambda_for(0) == pytest.approx(lambda_at(1200, 1600, 0.5, 0.01, 1000))


def test_relative_mean_gives_agreeing_replicas_their_own_values_back_exactly():
    """fp8's rounding of a payload never enters the weights with dp.payload_error_feedback:
    replicas that sent the same values get the exact snapshot back (the plain mean is the
    rounded one), and the mean of different snapshots keeps only the difference of errors."""
    from comms import codecs
    from mesh.algo.sparse import relative_mean

    g = torch.Generator().manual_seed(0)
    snap = torch.randn(4096, generator=g)
    dec = codecs.decode(codecs.encode(snap, "fp8_e4m3"))
    plain = (dec + dec) / 2  # two replicas that agree, averaged as the codec delivers them
    assert not torch.equal(plain, snap)  # the rounding the plain mean writes into the weights
    assert torch.equal(relative_mean(plain, snap, dec), snap)
    other = snap + 0.01 * torch.randn(4096, generator=g)
    dec_o = codecs.decode(codecs.encode(other, "fp8_e4m3"))
    exact = (snap + other) / 2
    rel = relative_mean((dec + dec_o) / 2, snap, dec)
    err_rel = (rel - exact).abs().mean()
    err_plain = ((dec + dec_o) / 2 - exact).abs().mean()
    assert err_rel < 0.5 * err_plain  # close snapshots round alike: their errors mostly cancel


REAL_NUMEL = 300_000_000  # a llama-1b stage's flat parameter vector holds 255M to 330M


def first_round_cost_ratio(index_map: str, numel: int = REAL_NUMEL, fraction: float = 0.05):
    """Seconds of a subset_indices round from an empty cache (any build included) over seconds
    of gathering the round's k values from a float32 vector, each the best of a few tries: a
    ratio of two O(k) costs for an O(k) selection, so it holds on a slow or loaded machine; an
    O(numel) selection's is ~1/p times larger. Returns (ratio, indices)."""

    def best(f, tries: int) -> float:
        seconds = []
        for _ in range(tries):
            start = time.perf_counter()
            f()
            seconds.append(time.perf_counter() - start)
        return min(seconds)

    def first_round() -> None:
        clear_index_cache()
        subset_indices(21, 1, 0, 3, numel, fraction, index_map=index_map)

    select = best(first_round, 2)
    idx = subset_indices(21, 1, 0, 3, numel, fraction, index_map=index_map)
    x = torch.empty(numel).fill_(1.0)  # touched: no lazily zeroed pages in the timing
    return select / best(lambda: x[idx], 3), idx


@pytest.mark.slow
def test_keyed_partition_at_a_real_stage_size_costs_o_k_per_round() -> None:
    """300M coordinates, p = 0.05: a whole cycle of K = 20 rounds covers each exactly once
    (counted in a uint8 per coordinate, 300 MB), each round costs a small multiple of
    gathering its k values (the old randperm map costs ~70x: O(numel)), and nothing is built
    or kept between rounds: each call's memory is its k indices."""
    numel, p, k = REAL_NUMEL, 0.05, num_parts(0.05)
    ratio, idx = first_round_cost_ratio("keyed", numel, p)
    assert ratio < 30, f"one round costs {ratio:.1f}x the gather of its k values"
    assert idx.numel() == subset_sizes([numel], p, 3)[0] and len(sparse._CACHE) == 0
    seen = torch.zeros(numel, dtype=torch.uint8)
    for r in range(k, 2 * k):  # the second cycle: a part is a function of r % K only
        idx = subset_indices(21, 1, 0, r, numel, p)
        assert idx.dtype == torch.int64 and idx.numel() == subset_sizes([numel], p, r)[0]
        assert 0 <= idx[0].item() and idx[-1].item() < numel
        assert bool((idx[1:] > idx[:-1]).all())  # sorted, no coordinate twice in a round
        seen[idx] += 1
    assert len(sparse._CACHE) == 0
    assert bool((seen == 1).all())


@pytest.mark.slow
def test_runs_at_a_real_stage_size_land_where_value_by_value_would() -> None:
    """A llama-1b stage's flat vector (300M values and a short last run), runs of 64: the
    round holding the short run is scattered and gathered back whole, and nothing else moves."""
    numel, block = REAL_NUMEL + 37, 64
    r = next(  # the round that holds the tensor's short last run
        r
        for r in range(num_parts(0.05))
        if int(subset_indices(9, 2, 0, r, numel, 0.05, block=block)[-1]) == numel - 1
    )
    idx = subset_indices(9, 2, 0, r, numel, 0.05, block=block)
    x = torch.zeros(numel)
    values = torch.rand(idx.numel()) + 1.0  # none zero
    runs = sparse.runs_of(numel, idx, block)
    sparse.scatter_runs_(x, runs, values)
    assert int(torch.count_nonzero(x)) == idx.numel()
    assert torch.equal(x.index_select(0, idx), values)
    assert torch.equal(sparse.gather_runs(x, runs), values)


@pytest.mark.parametrize(
    ("numel", "block"), [(1000, 64), (1024, 64), (65, 64), (10, 64), (4099, 7)]
)
def test_runs_of_a_block_partition_the_tensor_and_stay_contiguous(numel, block):
    """subset_block: every coordinate exactly once per K rounds, a round's indices whole runs of
    `block` values (the tensor's last run may be shorter), every round within the planned k."""
    k = sparse.num_parts(0.05)
    seen = torch.zeros(numel, dtype=torch.int64)
    for r in range(k):
        idx = sparse.subset_indices(3, 1, 0, r, numel, 0.05, block=block)
        assert idx.numel() <= sparse.max_subset_size(numel, 0.05, block)
        assert bool((idx[1:] > idx[:-1]).all())  # sorted, no repeats
        starts = idx[(idx % block) == 0]
        for s in starts.tolist():  # each selected run is whole
            assert torch.equal(
                idx[(idx >= s) & (idx < s + block)], torch.arange(s, min(s + block, numel))
            )
        assert bool((idx % block == 0).sum() == -(-idx.numel() // block) or numel % block)
        seen[idx] += 1
    assert bool((seen == 1).all())
    again = sparse.subset_indices(3, 1, 0, k + 2, numel, 0.05, block=block)
    assert torch.equal(again, sparse.subset_indices(3, 1, 0, 2, numel, 0.05, block=block))


@pytest.mark.parametrize(
    ("numel", "block"), [(1000, 64), (1024, 64), (65, 64), (10, 64), (4099, 7), (4099, 1)]
)
def test_runs_are_gathered_and_scattered_as_value_by_value(numel, block):
    """gather_runs / scatter_runs_ give index_select / index_copy_'s values in every round of a
    cycle (the tensor's short last run included), and in slices that start where a run starts
    (as Cell.apply_round takes them)."""
    x = torch.randn(numel)
    for r in range(sparse.num_parts(0.05)):
        idx = sparse.subset_indices(5, 0, 0, r, numel, 0.05, block=block)
        for part in (
            slice(None),
            *(slice(lo, lo + 3 * block) for lo in range(0, idx.numel(), 3 * block)),
        ):
            i = idx[part]
            runs = sparse.runs_of(numel, i, block)
            assert torch.equal(sparse.gather_runs(x, runs), x.index_select(0, i))
            values = torch.randn(i.numel())
            a, b = x.clone(), x.clone()
            sparse.scatter_runs_(a, runs, values)
            b.index_copy_(0, i, values)
            assert torch.equal(a, b)


def test_a_cell_round_in_runs_is_the_round_taken_value_by_value(monkeypatch) -> None:
    """dp.subset_block: Cell.open_round and apply_round (in slices not a multiple of the block,
    rounded down to whole runs) give what index_select / index_copy_ and apply_arrival give
    value by value, bit for bit."""
    import mesh.engine.cell as cell_mod

    monkeypatch.setattr(cell_mod, "APPLY_SLICE", 100)  # -> slices of 96 values: 12 runs of 8
    cfg = load_config([], ["grid.stages=1", "grid.replicas=2", "dp.subset_block=8"])
    cell = Cell.build(cfg, 0, 0, build_stages(cfg.model, 1, 0)[0])
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        cell.drift.copy_(torch.randn(cell.drift.shape, generator=gen) * 1e-3)
        flat0, drift0 = cell.flat.clone(), cell.drift.clone()
        rnd, decoded = cell.open_round(3)
        assert rnd.indices.numel() > 96 and rnd.indices.numel() % 96
        assert torch.equal(rnd.snapshot, flat0.index_select(0, rnd.indices))
        rnd.mean, _ = cell.combine_round(["a", "b"], [decoded, decoded + 0.01], "a")
        cell.flat.add_(torch.randn(cell.flat.shape, generator=gen) * 1e-3)  # trained meanwhile
        live0 = cell.flat.clone()
        cell.apply_round(rnd)
    idx = rnd.indices
    mean = sparse.relative_mean(rnd.mean, rnd.snapshot, rnd.own)
    live, d = sparse.apply_arrival(
        live0.index_select(0, idx),
        rnd.snapshot,
        mean,
        drift0.index_select(0, idx),
        cfg.dp.correction,
        cell.lambda_for(3),
    )
    assert torch.equal(cell.flat, live0.index_copy_(0, idx, live))
    assert torch.equal(cell.drift, drift0.index_copy_(0, idx, d))


def test_values_that_are_not_whole_runs_are_refused():
    idx = sparse.subset_indices(5, 0, 0, 1, 100_000, 0.05, block=64)
    assert idx.numel() >= 128
    for cut in (idx[:-1], idx[1:65]):  # a value short; a run's worth, not starting on a run
        with pytest.raises(AssertionError, match="whole runs"):
            sparse.runs_of(100_000, cut, 64)


def test_a_block_needs_the_keyed_partition():
    with pytest.raises(ValueError, match="subset_block"):
        sparse.subset_indices(0, 0, 0, 0, 1000, 0.05, "bernoulli", block=64)
    with pytest.raises(ValueError, match="subset_block"):
        sparse.subset_indices(0, 0, 0, 0, 1000, 0.05, index_map="permutation", block=64)
    one = sparse.subset_indices(0, 0, 0, 0, 1000, 0.05, block=1)
    assert torch.equal(one, sparse.subset_indices(0, 0, 0, 0, 1000, 0.05))
