"""Weight prediction (pipeline.weight_prediction): the pure math, the optimizer's velocity, and
the versions a cell stashes."""

import helpers
import pytest
import torch

from mesh.algo.optim import OptimSpec, StageOptimizer
from mesh.algo.staleness import (
    predicted,
    prediction_distance,
    update_velocity,
    velocity_estimate,
)
from mesh.config import load_config
from mesh.engine.cell import Cell
from mesh.model.build import build_stages


def test_bias_corrected_velocity_reads_a_constant_displacement_exactly():
    d = torch.tensor([0.5, -2.0, 3.0])
    v = torch.zeros(3)
    for t in range(1, 7):
        update_velocity(v, d, 0.9)
        torch.testing.assert_close(velocity_estimate(v, 0.9, t), d)
    assert torch.equal(velocity_estimate(torch.ones(3), 0.9, 0), torch.zeros(3))


def test_velocity_is_the_ema_of_displacements():
    v = torch.zeros(2)
    update_velocity(v, torch.tensor([1.0, 0.0]), 0.5)
    update_velocity(v, torch.tensor([0.0, 4.0]), 0.5)
    # 0.5 * (0.5 * [1, 0]) + 0.5 * [0, 4]
    torch.testing.assert_close(v, torch.tensor([0.25, 2.0]))


def test_distance_is_a_share_of_the_delay():
    assert prediction_distance(1.0, 3) == 3.0
    assert prediction_distance(0.5, 3) == 1.5
    assert prediction_distance(1.0, 0) == 0.0  # the last async stage: its gradient is fresh
    with pytest.raises(ValueError):
        prediction_distance(-1.0, 2)
    w, v = torch.ones(3), torch.tensor([1.0, 2.0, 3.0])
    out = predicted(w, v, 2.0)
    torch.testing.assert_close(out, torch.tensor([3.0, 5.0, 7.0]))
    assert torch.equal(w, torch.ones(3))  # never in place


def _steps(spec: OptimSpec, grads: list[torch.Tensor]) -> tuple[StageOptimizer, list]:
    p = torch.nn.Parameter(torch.zeros(4))
    opt = StageOptimizer([("w", p)], spec)
    trajectory = [p.detach().clone()]
    for g in grads:
        p.grad = g.clone()
        opt.step(1.0)
        trajectory.append(p.detach().clone())
    return opt, trajectory


def test_optimizer_velocity_tracks_its_own_displacements():
    torch.manual_seed(0)
    grads = [torch.randn(4) for _ in range(5)]
    spec = OptimSpec("nadamw", lr=0.1, beta1=0.9, velocity_beta=0.8, grad_clip=0)
    opt, traj = _steps(spec, grads)
    ema = torch.zeros(4)
    for a, b in zip(traj, traj[1:]):
        ema = 0.8 * ema + 0.2 * (b - a)
    torch.testing.assert_close(opt.state["w"]["velocity"], ema)
    torch.testing.assert_close(opt.velocity("w"), ema / (1 - 0.8**5))
    # the same steps without prediction: same weights, no velocity state
    plain, traj_plain = _steps(OptimSpec("nadamw", lr=0.1, beta1=0.9, grad_clip=0), grads)
    assert "velocity" not in plain.state["w"]
    torch.testing.assert_close(traj_plain[-1], traj[-1], rtol=0, atol=0)


def test_velocity_includes_the_error_feedback_correction():
    torch.manual_seed(1)
    grads = [torch.randn(4) for _ in range(4)]
    spec = OptimSpec("adamw", lr=0.1, velocity_beta=0.0, error_feedback=True, grad_clip=0)
    opt, traj = _steps(spec, grads)
    # beta 0: the velocity is the last whole displacement, the feedback's correction included
    torch.testing.assert_close(opt.velocity("w"), traj[-1] - traj[-2])


def test_constant_steps_are_predicted_where_they_land():
    """With a steady displacement (Adam on a constant gradient, no decay) the version predicted
    at update n with distance delta is the weights the optimizer reaches at update n + delta."""
    g = torch.tensor([1.0, -2.0, 0.5, 3.0])
    spec = OptimSpec("adamw", lr=0.01, weight_decay=0.0, velocity_beta=0.9, grad_clip=0)
    opt, traj = _steps(spec, [g] * 10)
    velocity = opt.velocity("w")
    torch.testing.assert_close(predicted(traj[7], velocity, 3.0), traj[10], rtol=0, atol=1e-6)


def _cells(text_file, *sets):
    cfg = load_config(
        [],
        [
            *helpers.TINY,
            f"data.path='{text_file}'",
            "model.n_layers=3",
            "grid.stages=3",
            "grid.replicas=1",
            *sets,
        ],
    )
    return cfg, [Cell.build(cfg, j, 0, m) for j, m in enumerate(build_stages(cfg.model, 3, 0))]


def test_cells_stash_predicted_versions_by_their_delay(text_file):
    cfg, cells = _cells(text_file, "pipeline.schedule=async", "pipeline.weight_prediction=0.5")
    torch.manual_seed(2)
    for _ in range(3):
        for c in cells:
            c.apply_update([torch.randn_like(p) for p in c.params])
            c.push_version()
    for c in cells:
        delay = cfg.grid.stages - 1 - c.stage
        stashed = c.history[c.step]
        if delay == 0:  # the last stage: its gradients are fresh, no velocity kept
            assert torch.equal(stashed, c.flat)
            assert all("velocity" not in st for st in c.optimizer.state.values())
            continue
        velocity = torch.cat([c.optimizer.velocity(n).reshape(-1) for n, *_ in c._shapes])
        assert velocity.abs().sum() > 0
        torch.testing.assert_close(stashed, c.flat + 0.5 * delay * velocity)
        # the live weights are what the optimizer made them; only the stash is moved
        assert not torch.equal(stashed, c.flat)


def test_prediction_off_stashes_the_live_weights(text_file):
    _, cells = _cells(text_file, "pipeline.schedule=async")
    for c in cells:
        c.apply_update([torch.ones_like(p) for p in c.params])
        c.push_version()
        assert torch.equal(c.history[c.step], c.flat)
        assert all("velocity" not in st for st in c.optimizer.state.values())


def test_prediction_keys_leave_old_fingerprints_alone(text_file):
    base = [*helpers.TINY, f"data.path='{text_file}'", "grid.stages=2"]
    plain = load_config([], base).fingerprint()
    assert load_config([], [*base, "pipeline.weight_prediction=0"]).fingerprint() == plain
    assert load_config([], [*base, "pipeline.prediction_beta=0.9"]).fingerprint() == plain
    assert load_config([], [*base, "pipeline.weight_prediction=1"]).fingerprint() != plain


def test_a_new_version_reuses_the_evicted_ones_buffer(text_file):
    """The stash holds exactly the versions its schedule reads, each the weights of its step;
    the one that leaves gives its buffer to the next (no stage-sized allocation an update)."""
    _, cells = _cells(text_file, "pipeline.schedule=async")
    c = cells[0]  # delay 2: three versions
    torch.manual_seed(3)
    seen = {}
    for _ in range(6):
        c.apply_update([torch.randn_like(p) for p in c.params])
        evicted = next(iter(c.history.values())) if len(c.history) == 3 else None
        c.push_version()
        seen[c.step] = c.flat.clone()
        assert list(c.history) == sorted(c.history)[-3:] and c.step in c.history
        for step, version in c.history.items():
            if step in seen:
                assert torch.equal(version, seen[step])  # older versions untouched
            assert version is not c.flat
        if evicted is not None:
            assert c.history[c.step].data_ptr() == evicted.data_ptr()
    assert len(c.history) == c.versions_to_keep() == 3
    # emulated compute: the version is the live tensor, no copy; a later copy never writes it
    c.push_version(shared=True)
    assert c.history[c.step] is c.flat
    c.step += 1
    c.push_version()
    assert c.history[c.step - 1] is c.flat and c.history[c.step] is not c.flat
