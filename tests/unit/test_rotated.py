"""Unit tests for mesh.algo.rotated: rotated-basis Adam against a dense hand computation, the
AdamW limit, stage-aware refresh periods, error feedback, state round trip, and the cell wiring."""

from __future__ import annotations

import pytest
import torch

from mesh.algo.optim import OptimSpec, StageOptimizer, get_planner
from mesh.algo.rotated import RotatedAdamRule, refresh_due, refresh_period
from mesh.config import load_config
from mesh.engine.cell import Cell, optim_spec
from mesh.model.build import build_stages

B1, B2, EPS, WD = 0.9, 0.999, 1e-8, 0.1
HIDDEN = "blocks.0.attn.proj.weight"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _spec(**kw: object) -> OptimSpec:
    base = {"lr": 1e-2, "weight_decay": WD, "grad_clip": 0.0}
    base.update(kw)
    return OptimSpec("rotated_adam", **base)  # type: ignore[arg-type]


def _params(seed: int = 0) -> list[tuple[str, torch.nn.Parameter]]:
    g = _gen(seed)
    shapes = {
        "tok_emb.weight": (11, 6),
        "blocks.0.ln1.weight": (6,),
        HIDDEN: (6, 6),
        "blocks.0.mlp.fc.weight": (12, 6),  # tall
        "blocks.0.mlp.proj.weight": (6, 12),  # wide
        "head.weight": (11, 6),
    }
    return [(n, torch.nn.Parameter(torch.randn(s, generator=g))) for n, s in shapes.items()]


def _clone(named: list[tuple[str, torch.nn.Parameter]]) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, torch.nn.Parameter(p.detach().clone())) for n, p in named]


def _grads(named: list[tuple[str, torch.nn.Parameter]], t: int) -> list[torch.Tensor]:
    g = _gen(100 + t)
    return [torch.randn(p.shape, generator=g) for _, p in named]


def _set(named: list[tuple[str, torch.nn.Parameter]], grads: list[torch.Tensor]) -> None:
    for (_, p), g in zip(named, grads, strict=True):
        p.grad = g.clone()


# ------------------------------------------------------------------------- dense hand reference


def _hand_rotated_adam(
    w0: torch.Tensor, grads: list[torch.Tensor], lrs: list[float], period: int
) -> torch.Tensor:
    """The update written out densely in float64, one formula per line (module docstring)."""
    f64 = torch.float64
    w = w0.double()
    rows, cols = w.shape
    L, R = torch.zeros(rows, rows, dtype=f64), torch.zeros(cols, cols, dtype=f64)
    QL, QR = torch.eye(rows, dtype=f64), torch.eye(cols, dtype=f64)
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    for t, (g, lr) in enumerate(zip(grads, lrs, strict=True), start=1):
        G = g.double()
        Gr = QL.T @ G @ QR
        m = B1 * m + (1 - B1) * Gr
        v = B2 * v + (1 - B2) * Gr * Gr
        mhat, vhat = m / (1 - B1**t), v / (1 - B2**t)
        U = QL @ (mhat / (vhat.sqrt() + EPS)) @ QR.T
        w = w * (1 - lr * WD) - lr * U
        L = B2 * L + (1 - B2) * G @ G.T
        R = B2 * R + (1 - B2) * G.T @ G
        if (t - 1) % period == 0:
            nQL, nQR = torch.linalg.eigh(L).eigenvectors, torch.linalg.eigh(R).eigenvectors
            A, B = nQL.T @ QL, QR.T @ nQR
            m = A @ m @ B
            v = (A**2) @ v @ (B**2)
            QL, QR = nQL, nQR
    return w


@pytest.mark.parametrize("steps", [1, 2, 5])
def test_matches_dense_hand_computation(steps: int) -> None:
    # float32 rule vs a float64 reference. period 2: refreshes after t = 1, 3, 5, so step 2 runs
    # in the eigenbasis of G_1 and step 4 in a new one (moments rotated into it at t = 3).
    g = _gen(3)
    w0 = torch.randn(6, 6, generator=g)
    grads = [torch.randn(6, 6, generator=g) for _ in range(steps)]
    lrs = [1e-2, 5e-3, 8e-3, 1e-2, 2e-3][:steps]
    p = torch.nn.Parameter(w0.clone())
    opt = StageOptimizer([(HIDDEN, p)], _spec(rotate_every=2))
    assert opt.kinds() == {HIDDEN: "rotated_adam"}
    for gr, lr in zip(grads, lrs, strict=True):
        p.grad = gr.clone()
        opt.step(lr / 1e-2)
    ref = _hand_rotated_adam(w0, grads, lrs, period=2)
    torch.testing.assert_close(p.detach().double(), ref, rtol=1e-4, atol=1e-5)
    QL = opt.state[HIDDEN]["QL"]
    assert isinstance(QL, torch.Tensor)
    torch.testing.assert_close(QL.T @ QL, torch.eye(6), atol=1e-5, rtol=0)  # orthonormal


def test_two_steps_by_hand_rectangular() -> None:
    # Step 1 is AdamW (identity basis). Then Q_L, Q_R = eigh(G1 G1^T), eigh(G1^T G1) (the
    # factors' scale 1 - b2 does not change eigenvectors), m1 = (1-b1) G1 and v1 = (1-b2) G1^2
    # move into that basis, and step 2 is Adam on G2' = Q_L^T G2 Q_R, rotated back.
    g = _gen(5)
    w0 = torch.randn(8, 3, generator=g).double()  # tall, R is full rank, L is rank 3
    G1, G2 = torch.randn(8, 3, generator=g).double(), torch.randn(8, 3, generator=g).double()
    lr = 1e-2
    w1 = w0 * (1 - lr * WD) - lr * G1 / (G1.abs() + EPS)  # AdamW step 1: m^/sqrt(v^) = G/|G|
    p = torch.nn.Parameter(w0.float().clone())
    name = "blocks.0.mlp.fc.weight"
    opt = StageOptimizer([(name, p)], _spec())
    p.grad = G1.float()
    opt.step(1.0)
    torch.testing.assert_close(p.detach().double(), w1, rtol=1e-5, atol=1e-6)
    # L = (1-b2) G1 G1^T has rank 3: its 5-dim null space has no unique basis, and Adam is not
    # rotation invariant inside it. So check that the optimizer's Q_L is AN orthonormal
    # eigenbasis of G1 G1^T (sorted ascending) and take it for the hand step; Q_R is unique.
    st = opt.state[name]
    QL, QR_opt = st["QL"], st["QR"]
    assert isinstance(QL, torch.Tensor) and isinstance(QR_opt, torch.Tensor)
    QL = QL.double()
    torch.testing.assert_close(QL.T @ QL, torch.eye(8, dtype=torch.float64), rtol=0, atol=1e-5)
    D = QL.T @ (G1 @ G1.T) @ QL
    torch.testing.assert_close(D, torch.diag(torch.diagonal(D)), rtol=0, atol=1e-4)
    assert torch.all(torch.diff(torch.diagonal(D)) >= -1e-4)
    QR = torch.linalg.eigh(G1.T @ G1).eigenvectors
    torch.testing.assert_close(QR_opt.double().abs(), QR.abs(), rtol=0, atol=1e-4)  # up to sign
    QR = QR_opt.double()
    m1 = QL.T @ ((1 - B1) * G1) @ QR
    v1 = (QL.T**2) @ ((1 - B2) * G1**2) @ (QR**2)
    G2r = QL.T @ G2 @ QR
    m2, v2 = B1 * m1 + (1 - B1) * G2r, B2 * v1 + (1 - B2) * G2r**2
    N = (m2 / (1 - B1**2)) / ((v2 / (1 - B2**2)).sqrt() + EPS)
    w2 = w1 * (1 - lr * WD) - lr * QL @ N @ QR.T
    p.grad = G2.float()
    opt.step(1.0)
    torch.testing.assert_close(p.detach().double(), w2, rtol=1e-4, atol=1e-5)


def test_identity_basis_reduces_to_adamw() -> None:
    # Gradients that are diagonal keep both factors diagonal with distinct entries, so eigh
    # returns a signed permutation basis; Adam in it acts coordinate by coordinate, i.e. AdamW.
    # (The cleaner case, rotate_every huge with the basis left at identity, is checked too.)
    n = 4
    w0 = torch.randn(n, n, generator=_gen(9))
    scales = torch.tensor([1.0, 2.0, 3.0, 4.0])
    grads = [torch.diag(scales * (1 + 0.1 * t)) for t in range(6)]
    p_rot = torch.nn.Parameter(w0.clone())
    p_adam = torch.nn.Parameter(w0.clone())
    rot = StageOptimizer([(HIDDEN, p_rot)], _spec())
    adam = StageOptimizer([(HIDDEN, p_adam)], OptimSpec("adamw", lr=1e-2, weight_decay=WD))
    for gr in grads:
        p_rot.grad, p_adam.grad = gr.clone(), gr.clone()
        rot.step(1.0)
        adam.step(1.0)
    torch.testing.assert_close(p_rot.detach(), p_adam.detach(), rtol=1e-5, atol=1e-6)

    # rotate_every huge: the only refresh is at t = 1, on a diagonal gradient with ascending
    # distinct entries, so Q_L = Q_R = I (up to signs, which Adam does not see) for good; after
    # that any gradient is handled exactly as AdamW on the raw coordinates.
    p_rot = torch.nn.Parameter(w0.clone())
    p_adam = torch.nn.Parameter(w0.clone())
    rot = StageOptimizer([(HIDDEN, p_rot)], _spec(rotate_every=10**9))
    adam = StageOptimizer([(HIDDEN, p_adam)], OptimSpec("adamw", lr=1e-2, weight_decay=WD))
    g = _gen(11)
    for t in range(8):
        gr = torch.diag(scales) if t == 0 else torch.randn(n, n, generator=g)
        p_rot.grad, p_adam.grad = gr.clone(), gr.clone()
        rot.step(1.0)
        adam.step(1.0)
        torch.testing.assert_close(p_rot.detach(), p_adam.detach(), rtol=1e-5, atol=1e-6)
    for key in ("QL", "QR"):
        q = rot.state[HIDDEN][key]
        assert isinstance(q, torch.Tensor)
        torch.testing.assert_close(q.abs(), torch.eye(n))


# ---------------------------------------------------------------------------- stage awareness


def test_refresh_periods_per_delay() -> None:
    assert refresh_period(10, 0, stage_aware=False) == 10
    assert refresh_period(10, 15, stage_aware=False) == 10  # off: delay ignored
    # on: max(1, rotate_every // (1 + delta))
    expected = {0: 10, 1: 5, 2: 3, 3: 2, 4: 2, 5: 1, 9: 1, 15: 1}
    assert {d: refresh_period(10, d, stage_aware=True) for d in expected} == expected
    assert refresh_period(1, 7, stage_aware=True) == 1
    with pytest.raises(ValueError):
        refresh_period(0, 0, stage_aware=True)
    assert [t for t in range(1, 12) if refresh_due(t, 5)] == [1, 6, 11]
    assert [t for t in range(1, 4) if refresh_due(t, 1)] == [1, 2, 3]


@pytest.mark.parametrize(
    ("schedule", "stages", "window", "expected"),
    [
        ("async", 4, "none", [2, 3, 5, 10]),  # delta = 3, 2, 1, 0 -> 10 // 4, 10 // 3, 10 // 2, 10
        # an in-flight window's extra warm-ups are extra delay: delta = 4, 3, 1, 0
        ("async", 4, [1, 1, 0, 0], [2, 2, 5, 10]),
        ("2bw", 4, "none", [5, 5, 5, 5]),  # delta = 1 everywhere
        ("gpipe", 2, "none", [10, 10]),
    ],
)
def test_cell_passes_stage_delay(schedule: str, stages: int, window, expected: list[int]) -> None:
    cfg = load_config(
        [],
        [
            "model.n_layers=4",
            "model.d_model=8",
            "model.n_heads=2",
            "model.seq_len=8",
            f"grid.stages={stages}",
            "grid.replicas=1",
            f"pipeline.schedule='{schedule}'",
            "pipeline.microbatches=4",
            "optim.name='rotated_adam'",
            "optim.stage_aware=true",
            f"pipeline.window={window!r}",
        ],
    )
    extra = [0] * stages if window == "none" else window
    periods = []
    for j, module in enumerate(build_stages(cfg.model, stages, 0)):
        cell = Cell.build(cfg, j, 0, module)
        assert cell.optimizer.spec.delay == (
            stages - 1 - j + extra[j] if schedule == "async" else int(schedule == "2bw")
        )
        rules = [r for r in cell.optimizer.rules.values() if isinstance(r, RotatedAdamRule)]
        assert rules and len({r.period for r in rules}) == 1
        periods.append(rules[0].period)
    assert periods == expected
    assert optim_spec(cfg.optim).delay == 0  # the config alone knows no stage


def test_stage_aware_refreshes_more_often() -> None:
    # Same grads, delay 4: period 2 instead of 10, so the bases differ after step 3.
    named_a, named_b = _params(), _params()
    a = StageOptimizer(named_a, _spec(delay=4))
    b = StageOptimizer(named_b, _spec(delay=4, stage_aware=True))
    for t in range(3):
        gr = _grads(named_a, t)
        _set(named_a, gr)
        _set(named_b, gr)
        a.step(1.0)
        b.step(1.0)
    qa, qb = a.state[HIDDEN]["QL"], b.state[HIDDEN]["QL"]
    assert isinstance(qa, torch.Tensor) and isinstance(qb, torch.Tensor)
    assert not torch.allclose(qa, qb)
    # 1-D and non-hidden parameters are identical (plain AdamW in both)
    assert torch.equal(named_a[1][1], named_b[1][1]) and torch.equal(named_a[0][1], named_b[0][1])


# ------------------------------------------------------------------ plan, memory, composition


def test_non_hidden_params_use_adamw() -> None:
    named = _params()
    opt = StageOptimizer(named, _spec())
    assert opt.kinds() == {
        "tok_emb.weight": "adamw",
        "blocks.0.ln1.weight": "adamw",
        HIDDEN: "rotated_adam",
        "blocks.0.mlp.fc.weight": "rotated_adam",
        "blocks.0.mlp.proj.weight": "rotated_adam",
        "head.weight": "adamw",
    }
    ref_named = _clone(named)
    ref = StageOptimizer(ref_named, OptimSpec("adamw", lr=1e-2, weight_decay=WD, grad_clip=0.0))
    for t in range(3):
        gr = _grads(named, t)
        _set(named, gr)
        _set(ref_named, gr)
        opt.step(0.5)
        ref.step(0.5)
    for (n, p), (_, q) in zip(named, ref_named, strict=True):
        if opt.kinds()[n] == "adamw":
            assert torch.equal(p, q), n  # bit-identical to the AdamW optimizer
        else:
            assert not torch.allclose(p, q), n
    # Extra memory over AdamW: factors and bases, 4 bytes x 2 (rows^2 + cols^2) per matrix.
    extra = sum(
        4 * 2 * (p.shape[0] ** 2 + p.shape[1] ** 2)
        for n, p in named
        if opt.kinds()[n] == "rotated_adam"
    )
    assert opt.state_bytes() == ref.state_bytes() + extra
    assert get_planner("rotated_adam") is not None


def test_error_feedback_formula() -> None:
    # error feedback: x_{t+1} = x_t - 2 u_t + u_{t-1}, u_t the inner rotated-Adam update at
    # x_t (its moments and factors depend on the grads only); first correction zero.
    named = _params()
    opt = StageOptimizer(named, _spec(error_feedback=True))
    inner_p = _clone(named)
    inner = StageOptimizer(inner_p, _spec())
    x = {n: p.detach().clone() for n, p in named}
    u_prev: dict[str, torch.Tensor] = {}
    for t in range(1, 6):
        gr = _grads(named, t)
        for (n, p), g in zip(inner_p, gr, strict=True):
            p.data.copy_(x[n])
            p.grad = g.clone()
        inner.step(1.0)
        _set(named, gr)
        opt.step(1.0)
        for n, p in inner_p:
            u = x[n] - p.detach()
            x[n] = x[n] - 2 * u + u_prev.get(n, u)
            u_prev[n] = u
        for n, p in named:
            torch.testing.assert_close(p.detach(), x[n], rtol=1e-5, atol=1e-6, msg=f"{n} t={t}")
    assert opt.state_bytes() == inner.state_bytes() + sum(p.numel() * 4 for _, p in named)


@pytest.mark.parametrize(
    "spec",
    [_spec(rotate_every=3), _spec(error_feedback=True, stage_aware=True, delay=2)],
    ids=["plain", "ef-stage-aware"],
)
def test_state_dict_round_trip(spec: OptimSpec) -> None:
    named = _params()
    a = StageOptimizer(named, spec)
    for t in range(4):  # the restore lands between refreshes (period 3: t = 1, 4, 7)
        _set(named, _grads(named, t))
        a.step(1.0)
    sd = a.state_dict()
    assert all(isinstance(v, torch.Tensor | int | float) for v in sd.values())
    assert {f"{HIDDEN}/{k}" for k in ("m", "v", "L", "R", "QL", "QR", "step")} <= set(sd)
    named_b = _clone(named)
    b = StageOptimizer(named_b, spec)
    b.load_state_dict(sd)
    for t in range(4, 9):
        gr = _grads(named, t)
        _set(named, gr)
        _set(named_b, gr)
        assert a.step(0.7) == b.step(0.7)
    for (n, p), (_, q) in zip(named, named_b, strict=True):
        assert torch.equal(p, q), n
    sd_b = b.state_dict()
    for k, v in a.state_dict().items():
        assert torch.equal(v, sd_b[k]) if isinstance(v, torch.Tensor) else v == sd_b[k], k


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="optim.rotate_every"):
        _spec(rotate_every=0)
    with pytest.raises(ValueError, match="optim.delay"):
        _spec(delay=-1)
    assert _spec().resolved_beta1() == 0.9


def test_sim_learns_with_averaging(text_file) -> None:
    # Composes with the sparse averaging axis and 2bw (the averaged quantity is the parameters):
    # every replica ends well below the untrained model's loss on the same validation set.
    from mesh.engine.sim import GridSim

    cfg = load_config(
        [],
        [
            "model.n_layers=2",
            "model.d_model=16",
            "model.n_heads=2",
            "model.seq_len=16",
            "pipeline.microbatch_size=2",
            "pipeline.schedule='2bw'",
            "pipeline.microbatches=2",
            "data.val_batches=1",
            f"data.path='{text_file}'",
            "grid.stages=2",
            "grid.replicas=2",
            "dp.tau=1",
            "optim.name='rotated_adam'",
            "optim.stage_aware=true",
            "optim.error_feedback=true",
            "run.steps=30",
            "run.eval_every=30",
            "optim.lr=0.01",
            "optim.warmup_steps=3",
        ],
    )
    sim = GridSim(cfg)
    untrained = sum(sim.evaluate()) / cfg.grid.replicas
    r = sim.run()
    assert not r.diverged and r.val_loss is not None
    assert max(r.val_loss_replicas) < untrained - 0.5, (untrained, r.val_loss_replicas)


# ------------------------------------------------------------- the depth study's bookkeeping


def test_steps_to_target_interpolates() -> None:
    from mesh.bench.optimizers.analysis import steps_to_target

    curve = [{"step": 10, "val_loss": 3.0}, {"step": 20, "val_loss": 2.0}]
    assert steps_to_target(curve, 2.5) == 15  # halfway between the two evaluations
    assert steps_to_target(curve, 3.0) == 10
    assert steps_to_target(curve, 1.0) is None
    assert steps_to_target([], 1.0) is None


def test_bench_outputs_from_a_synthetic_summary(tmp_path) -> None:
    import json

    from mesh.bench.optimizers import analysis, protocol, report

    runs = []
    for s in protocol.build_specs([1, 4], [0, 1]):
        steps = 40 // s.microbatches_per_update
        slow = 1 + (0.5 if s.optimizer == "adamw" else 0.1) * (s.stages - 1)
        curve = [
            {"step": k, "tokens": k, "val_loss": 3.0 - k / steps / slow + 0.01 * s.seed}
            for k in range(2, steps + 1, 2)
        ]
        runs.append(
            {
                **{k: getattr(s, k) for k in ("study", "optimizer", "schedule", "stages")},
                **{k: getattr(s, k) for k in ("seed", "error_feedback", "stage_aware")},
                "label": s.label,
                "steps": steps,
                "horizon_steps": steps,
                "val_loss": curve[-1]["val_loss"],
                "ms_per_step": 2.0 if s.optimizer == "rotated_adam" else 1.0,
                "opt_ms_per_step": 0.5,
                "state_bytes_per_stage": [100 * (3 if s.optimizer == "rotated_adam" else 1)],
                "refresh_period_per_stage": [10],
                "curve": curve,
            }
        )
    targets = {st: analysis.default_target(runs, st) for st in ("async", "2bw")}
    assert targets["async"] == pytest.approx(2.505)  # adamw P=1 at half the horizon, seed mean
    for r in runs:
        r["target_val_loss"] = targets[r["study"]]
        r["steps_to_target"] = analysis.steps_to_target(r["curve"], targets[r["study"]])
    summary = {
        "quick": True,
        "microbatches_per_replica": 40,
        "evals_per_run": 20,
        "tokens_per_microbatch": 512,
        "seeds": [0, 1],
        "stages": [1, 4],
        "targets": targets,
        "target_rule": "test",
        "lr": {**protocol.LR, "muon_lr": protocol.MUON_LR},
        "rotate_every": 10,
        "model": {"n_layers": 16, "d_model": 32, "n_heads": 4, "seq_len": 64},
        "wall_s": 1.0,
        "runs": runs,
    }
    report.write_outputs(summary, tmp_path)
    data = json.loads((tmp_path / "summary.json").read_text())
    keys = {"optimizer", "schedule", "stages", "seed", "error_feedback", "stage_aware"}
    assert all(keys | {"steps_to_target", "val_loss"} <= set(r) for r in data["runs"])
    table = (tmp_path / "table.md").read_text()
    assert "rotated_adam+SA" in table and "## Targets" in table
    assert "| rotated_adam time per update <= 1.5x adamw's" in table and "MISSED" in table
    assert (tmp_path / "depth.png").stat().st_size > 0
