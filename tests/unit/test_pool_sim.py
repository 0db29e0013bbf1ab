"""Stage pools on the simulator (mesh/engine/pools.py): deterministic for a seed, routing by
speed, deaths taken out and brought back, and fixed wiring's stall under the same deaths."""

from __future__ import annotations

import helpers
import torch

from mesh.config import load_config
from mesh.engine.pools import PoolSim, make_sim
from mesh.engine.sim import GridSim


def _cfg(text_file, *extra: str):
    return load_config(
        [],
        [
            *helpers.TINY,
            f"data.path='{text_file}'",
            "grid.stages=2",
            "grid.replicas=3",
            "model.n_layers=2",
            "run.steps=12",
            "run.eval_every=100",
            *extra,
        ],
    )


def _flats(sim: PoolSim) -> list[torch.Tensor]:
    return [c.flat.clone() for row in sim.cells for c in row]


def test_pools_are_deterministic_for_a_seed_and_fixed_stays_the_grid_sim(text_file):
    # routed by load (affinity off), so that microbatches cross replicas
    cfg = _cfg(text_file, "pipeline.routing='pools'", "pipeline.pool_affinity=0")
    a, b = make_sim(cfg), make_sim(cfg)
    assert isinstance(a, PoolSim)
    for _ in range(cfg.run.steps):
        a.step()
        b.step()
    assert all(torch.equal(x, y) for x, y in zip(_flats(a), _flats(b), strict=True))
    assert a.routed == b.routed and a.cross_replica > 0
    assert type(make_sim(_cfg(text_file))) is GridSim  # fixed without deaths: as it always was


def test_a_slow_cell_takes_less_of_its_stage(text_file):
    cfg = _cfg(text_file, "pipeline.routing='pools'", 'emulation.slowdowns=["s1r0=4.0"]')
    sim = make_sim(cfg)
    for _ in range(cfg.run.steps):
        sim.step()
    slow, fast = sim.routed[(1, 0)], min(sim.routed[(1, 1)], sim.routed[(1, 2)])
    assert slow < fast, sim.routed
    assert sum(sim.routed[(1, i)] for i in range(3)) == 3 * cfg.run.steps  # nothing lost


def test_the_delay_choice_sends_a_slow_cell_less_than_one_draw_does(text_file):
    routed = {}
    for choice in ("load", "delay"):
        slow = 'emulation.slowdowns=["s1r0=4.0"]'
        cfg = _cfg(text_file, "pipeline.routing='pools'", slow, f"pipeline.pool_choice='{choice}'")
        sim = make_sim(cfg)
        for _ in range(cfg.run.steps):
            sim.step()
        assert sum(sim.routed[(1, i)] for i in range(3)) == 3 * cfg.run.steps  # nothing lost
        routed[choice] = sim.routed[(1, 0)]
    # a fast cell with two queued is done sooner (3 of its units) than the idle slow one (4)
    assert routed["delay"] < routed["load"], routed


def test_deaths_route_around_and_a_revived_cell_takes_its_stages_state(text_file):
    cfg = _cfg(text_file, "pipeline.routing='pools'", 'emulation.deaths=["s1r2@3-8"]')
    sim = make_sim(cfg)
    assert isinstance(sim, PoolSim)
    for _ in range(8):
        sim.step()
    assert sim.voided == 0 and sim.streamed == 3 * 8  # every stream went on through s1r0/s1r1
    assert sim.routed[(1, 2)] <= 3 * 3  # only its ticks before the death
    revived = sim.cells[2][1]
    donor = max((sim.cells[r][1] for r in (0, 1)), key=lambda c: (c.step, -c.replica))
    sim._revive(1, 2, set())  # what tick 8 does first: s1r2 is back
    assert torch.equal(revived.flat, donor.flat) and revived.step == donor.step
    sim.step()
    assert sim.streamed == 3 * 9


def test_fixed_wiring_stalls_a_replica_whose_cell_is_dead(text_file):
    cfg = _cfg(text_file, 'emulation.deaths=["s1r2@0-6"]')
    sim = make_sim(cfg)
    assert isinstance(sim, PoolSim)  # deaths need the pool engine, fixed routing
    for _ in range(cfg.run.steps):
        sim.step()
    assert sim.voided == 6 and sim.cross_replica == 0
    assert sim.cells[2][0].step == cfg.run.steps - 6  # replica 2 trained only once back
    assert sim.cells[0][0].step == cfg.run.steps


def test_a_pooled_cells_schedules_follow_the_data_not_its_own_update_count(text_file):
    """A slow cell takes fewer microbatches, so fewer updates, but its lr follows the position
    of the microbatches it applies: at the end every cell of a stage is at the same point of
    the cosine, whatever its share of the work: between ticks, the ticks done (as a fixed
    grid's cell reads its update count)."""
    cfg = _cfg(text_file, "pipeline.routing='pools'", 'emulation.slowdowns=["s1r0=4.0"]')
    sim = make_sim(cfg)
    for _ in range(cfg.run.steps):
        sim.step()
    stage1 = [sim.cells[i][1] for i in range(3)]
    assert len({c.step for c in stage1}) > 1  # different numbers of updates
    assert {c.progress for c in stage1} == {cfg.run.steps}
    assert len({c.lr_scale() for c in stage1}) == 1
    assert sim.cells[0][0].schedule_step == cfg.run.steps


def _trained(sim: GridSim, steps: int) -> list[torch.Tensor]:
    losses = [sim.step() for _ in range(steps)]
    return [torch.tensor(losses), *_flats(sim)]  # type: ignore[arg-type]


def test_equal_peers_with_affinity_and_fixed_routing_train_the_grid_sims_numbers(text_file):
    """The pool engine adds nothing of its own: with replica affinity and equal speeds every
    microbatch keeps to its replica (one a cell a tick, as a fixed chain), versions are stored
    after the tick's averaging arrivals and the rounds read the tick's clock, so the losses and
    every cell's weights equal GridSim's bit for bit; PoolSim with fixed routing too. Averaging
    every update, its rounds landing within the run."""
    avg = ("dp.interval_steps=1", "dp.tau=2", "dp.lambda_hold_steps=3")
    grid = _trained(GridSim(_cfg(text_file, *avg)), 12)
    engine = _trained(PoolSim(_cfg(text_file, *avg)), 12)
    affine = PoolSim(_cfg(text_file, *avg, "pipeline.routing='pools'", "pipeline.pool_affinity=2"))
    pooled = _trained(affine, 12)
    assert affine.cross_replica == 0 and set(affine.routed.values()) == {12}
    for other in (engine, pooled):
        assert all(torch.equal(x, y) for x, y in zip(grid, other, strict=True))


def test_a_window_makes_pooled_stages_read_older_weights_as_the_grid_sims_do(text_file):
    """pipeline.window's extra in-flight microbatches (what a process grid's cell windows add)
    delay each stage as on the fixed grid: PoolSim with fixed routing and a window trains
    GridSim's numbers with it bit for bit, and pools under a window train other numbers than
    without it."""
    win = "pipeline.window=[1, 0]"
    grid = _trained(GridSim(_cfg(text_file, win)), 12)
    engine = PoolSim(_cfg(text_file, win))
    assert engine.delays == [2, 0]  # stage 0: P-1-0 = 1, plus the window's 1
    assert all(torch.equal(x, y) for x, y in zip(grid, _trained(engine, 12), strict=True))
    assert not all(
        torch.equal(x, y) for x, y in zip(grid, _trained(GridSim(_cfg(text_file)), 12), strict=True)
    )
    pools = ("pipeline.routing='pools'", "pipeline.pool_affinity=0")
    windowed = _trained(PoolSim(_cfg(text_file, *pools, win)), 12)
    plain = _trained(PoolSim(_cfg(text_file, *pools)), 12)
    assert not all(torch.equal(x, y) for x, y in zip(windowed, plain, strict=True))


def test_affinity_still_routes_around_a_clearly_slower_own_cell(text_file):
    """A cell 4x slower than its peers is clearly worse than the best of them (affinity 2): its
    stream's microbatches go elsewhere, and the equal cells keep their own streams."""
    slow = 'emulation.slowdowns=["s1r0=4.0"]'
    cfg = _cfg(text_file, "pipeline.routing='pools'", "pipeline.pool_affinity=2", slow)
    sim = make_sim(cfg)
    for _ in range(cfg.run.steps):
        sim.step()
    assert sim.routed[(1, 0)] < cfg.run.steps and sim.cross_replica > 0
    assert sum(sim.routed[(1, i)] for i in range(3)) == 3 * cfg.run.steps


def test_the_paired_control_routes_across_replicas_one_microbatch_a_cell_a_tick(text_file):
    """bench pools --controls' routing alone: every cell takes exactly one microbatch a tick
    (as on a fixed grid), and hops cross replicas."""
    from mesh.bench.pools_convergence import PairedPoolSim

    sim = PairedPoolSim(_cfg(text_file, "pipeline.routing='pools'"))
    for _ in range(6):
        sim.step()
        assert all(c.step == sim.update for row in sim.cells for c in row)
    assert sim.cross_replica > 0 and set(sim.routed.values()) == {6}
