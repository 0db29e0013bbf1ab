"""Sparse averaging: shared index sets, the drift-correction rule per arrival, byte formulas."""

from __future__ import annotations

import pytest
import torch

from mesh.algo import sparse
from mesh.algo.optim import lambda_at
from mesh.algo.sparse import (
    apply_arrival,
    arrivals_before,
    arrivals_per_coordinate,
    clear_index_cache,
    dp_bytes_per_replica_step,
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
    clear_index_cache()
    want = [[3, 4, 10, 15, 18], [0, 8, 13, 14, 19], [1, 5, 9, 11, 17], [2, 6, 7, 12, 16]]
    assert [subset_indices(1234, 1, 2, r, 20, 0.25).tolist() for r in range(4)] == want
    assert subset_indices(1234, 1, 2, 4, 20, 0.25).tolist() == want[0]  # the next cycle repeats
    assert subset_indices(1234, 1, 2, 0, 20, 0.25, "bernoulli").tolist() == [2, 12, 19]


def test_two_replicas_agree_and_keys_differ() -> None:
    a = subset_indices(7, 2, 3, 11, 5000, 0.05)
    clear_index_cache()  # the other replica computes it from scratch
    b = subset_indices(7, 2, 3, 11, 5000, 0.05)
    assert a.dtype == torch.int64 and torch.equal(a, b)
    assert torch.equal(a, a.sort().values)
    for other in [(8, 2, 3, 11), (7, 1, 3, 11), (7, 2, 4, 11), (7, 2, 3, 12), (7, 2, 3, 30)]:
        assert not torch.equal(subset_indices(*other, 5000, 0.05), a)
    for sel in ("bernoulli",):
        x = subset_indices(7, 2, 3, 11, 5000, 0.05, sel)
        assert torch.equal(x, subset_indices(7, 2, 3, 11, 5000, 0.05, sel))
        assert not torch.equal(x, subset_indices(7, 2, 3, 12, 5000, 0.05, sel))


@pytest.mark.parametrize("numel, fraction", [(1000, 0.05), (1003, 0.05), (7, 0.3), (3, 0.05)])
def test_partition_covers_each_coordinate_once_per_cycle(numel: int, fraction: float) -> None:
    k = num_parts(fraction)
    for cycle in range(2):
        rounds = range(cycle * k, (cycle + 1) * k)
        parts = [subset_indices(5, 0, 1, r, numel, fraction) for r in rounds]
        assert torch.equal(torch.cat(parts).sort().values, torch.arange(numel))
        assert [len(p) for p in parts] == [subset_sizes([numel], fraction, r)[0] for r in rounds]
        assert max(map(len, parts)) - min(map(len, parts)) <= 1


@pytest.mark.parametrize("fraction, interval", [(0.05, 1), (0.25, 1), (0.25, 3), (0.3, 2)])
def test_no_coordinate_is_in_flight_twice_while_tau_fits_a_cycle(fraction, interval) -> None:
    """Design 1.3: a round launched at step s lands at s + tau; with tau <= K x interval no
    coordinate of it is launched again before it lands, across many cycles (the seams too)."""
    numel, k = 997, num_parts(fraction)
    launches: dict[int, list[int]] = {}  # coordinate -> launch steps
    for r in range(5 * k + 3):
        for c in subset_indices(11, 2, 0, r, numel, fraction).tolist():
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


def test_bernoulli_size_is_about_p() -> None:
    n = subset_indices(3, 0, 0, 0, 100_000, 0.05, "bernoulli").numel()
    assert abs(n - 5000) < 5 * (100_000 * 0.05 * 0.95) ** 0.5


def test_cache_is_reused_bounded_and_not_aliased() -> None:
    clear_index_cache()
    a = subset_indices(9, 0, 0, 0, 1000, 0.1)
    a[:] = -1  # a caller mutating its result must not corrupt the next round
    assert (subset_indices(9, 0, 0, 1, 1000, 0.1) >= 0).all()
    subset_indices(9, 0, 0, 10, 1000, 0.1)  # the next cycle
    assert len(sparse._CACHE) == 1  # every round of a tensor shares its one permutation
    for t in range(sparse._CACHE_MAX_ENTRIES + 5):
        subset_indices(9, 0, t, 0, 10, 0.1)
    assert len(sparse._CACHE) == sparse._CACHE_MAX_ENTRIES
    clear_index_cache()


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
        drift = ref_live - snapshot  # design 1.3 step 3, written out
        ref_d = (1 - lam) * ref_d + lam * drift
        ref_live = mean + ref_d
        assert torch.allclose(live, ref_live, atol=1e-12) and torch.allclose(d, ref_d, atol=1e-12)


def test_lambda_one_is_delta_and_replace_keeps_d() -> None:
    live, snap, mean, d = _vals(1), _vals(2), _vals(3), _vals(4)
    ema_live, ema_d = apply_arrival(live, snap, mean, d, "ema", 1.0)
    delta_live, delta_d = apply_arrival(live, snap, mean, d, "delta", 0.3)
    assert torch.equal(ema_live, delta_live)  # bit for bit (algorithms.md 3.3)
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
    assert dp_bytes_per_replica_step(n, 2, 4) == 4 * n  # fp32 full, m=2 (bench 3.2)
    assert dp_bytes_per_replica_step(n, 4, 4) == 6 * n  # m=4
    assert dp_bytes_per_replica_step(n, 1, 4, 0.05) == 0.0
    assert dp_bytes_per_replica_step(n, 2, 4, 0.05, 5) == pytest.approx(0.05 * 4 * n / 5)
    assert dp_bytes_per_replica_step(236_928, 2, 4) == 947_712  # bench 3.5 measured counter
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
    cell = Cell(cfg, 0, 0, build_stages(cfg.model, 1, 0)[0])
    # rounds 0..199 are arrivals 0..9: held; the cosine then runs over arrivals 10..80
    assert cell.lambda_for(0) == cell.lambda_for(199) == 0.5
    assert cell.lambda_for(20 * 45) == pytest.approx(0.01 + 0.49 * 0.5)  # midway: 45 of 10..80
    assert cell.lambda_for(1599) == pytest.approx(0.01, abs=2e-3)
    steps = Cell(load_config([], base), 0, 0, build_stages(cfg.model, 1, 0)[0])
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
