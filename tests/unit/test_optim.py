"""Unit tests for mesh.algo.optim / mesh.algo.muon: schedules, torch parity, Muon, error feedback,
state."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.algo.optim import (
    OPTIMIZERS,
    OptimSpec,
    StageOptimizer,
    is_hidden_matrix,
    newton_schulz,
    register_optimizer,
)
from mesh.algo.optim_schedules import PAPER_STEPS, lambda_at, lr_at, momentum_decay_for, nadam_mu
from mesh.algo.staleness import delay_lr_factor
from mesh.config import load_config
from mesh.engine.cell import optim_spec

LRS = [1e-2 * (0.5 + 0.5 * math.sin(i)) + 1e-3 for i in range(30)]  # changing lr per step


def make_params(seed: int = 0) -> list[tuple[str, torch.nn.Parameter]]:
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "tok_emb.weight": (11, 8),
        "blocks.0.ln1.weight": (8,),
        "blocks.0.attn.qkv.weight": (24, 8),  # tall: exercises transpose and sqrt(rows/cols)
        "blocks.0.attn.qkv.bias": (24,),
        "blocks.0.mlp.fc.weight": (8, 32),  # wide
        "head.weight": (11, 8),
    }
    return [(n, torch.nn.Parameter(torch.randn(s, generator=g))) for n, s in shapes.items()]


def clone_params(
    named: list[tuple[str, torch.nn.Parameter]],
) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, torch.nn.Parameter(p.detach().clone())) for n, p in named]


def grads_for(named: list[tuple[str, torch.nn.Parameter]], step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=g) for _, p in named]


def set_grads(named: list[tuple[str, torch.nn.Parameter]], grads: list[torch.Tensor]) -> None:
    for (_, p), gr in zip(named, grads):
        p.grad = gr.clone()


# ------------------------------------------------------------------------------------ schedules


def test_lr_at_hand_values() -> None:
    # W=10, T=110: warmup base*(s+1)/W, cosine over steps 10..110 to 0.1*base.
    assert lr_at(0, 110, 1.0, 10) == pytest.approx(0.1)
    assert lr_at(4, 110, 1.0, 10) == pytest.approx(0.5)
    assert lr_at(9, 110, 1.0, 10) == pytest.approx(1.0)  # end of warmup
    assert lr_at(10, 110, 1.0, 10) == pytest.approx(1.0)  # cosine start
    assert lr_at(60, 110, 1.0, 10) == pytest.approx(0.55)  # midpoint: 0.1 + 0.9 * 0.5
    assert lr_at(110, 110, 1.0, 10) == pytest.approx(0.1)
    assert lr_at(500, 110, 1.0, 10) == pytest.approx(0.1)  # clamped past the end
    assert lr_at(0, 100, 3e-4, 0) == pytest.approx(3e-4)  # no warmup
    assert lr_at(50, 100, 3e-4, 0, min_lr_ratio=0.0) == pytest.approx(1.5e-4)
    with pytest.raises(ValueError):
        lr_at(-1, 100, 1.0, 10)


def test_lambda_at_hand_values() -> None:
    assert lambda_at(0, 3000) == 0.5
    assert lambda_at(999, 3000) == 0.5
    assert lambda_at(1000, 3000) == pytest.approx(0.5)
    assert lambda_at(2000, 3000) == pytest.approx(0.01 + 0.49 * 0.5)  # cosine midpoint
    assert lambda_at(3000, 3000) == pytest.approx(0.01)
    assert lambda_at(9000, 3000) == pytest.approx(0.01)
    assert lambda_at(5000, 800, hold_steps=1000) == 0.5  # hold >= total: constant
    assert lambda_at(50, 100, initial=1.0, final=0.0, hold_steps=0) == pytest.approx(0.5)


@settings(max_examples=60, deadline=None)
@given(
    step=st.integers(0, 5000),
    total=st.integers(1, 4000),
    warm=st.integers(0, 500),
    hold=st.integers(0, 2000),
)
def test_schedules_stay_in_range(step: int, total: int, warm: int, hold: int) -> None:
    lr = lr_at(step, total, 2.0, warm)
    assert 0.0 < lr <= 2.0 + 1e-12
    if step >= warm:
        assert lr >= 0.2 - 1e-12
    lam = lambda_at(step, total, hold_steps=hold)
    assert 0.01 - 1e-12 <= lam <= 0.5 + 1e-12


def test_nadam_mu_ramp() -> None:
    assert nadam_mu(1, 0.99, 0.004) == pytest.approx(0.99 * (1 - 0.5 * 0.96**0.004))
    assert nadam_mu(1, 0.99, 0.004) == pytest.approx(0.495, abs=1e-3)
    assert nadam_mu(100, 0.99, 0.004) == pytest.approx(0.503, abs=1e-3)
    assert nadam_mu(1000, 0.99, 0.004) == pytest.approx(0.570, abs=1e-3)
    assert nadam_mu(3000, 0.99, 0.004) == pytest.approx(0.687, abs=1e-3)
    assert nadam_mu(30000, 0.99, 0.004) == pytest.approx(0.986, abs=1e-3)
    assert nadam_mu(10**6, 0.99, 0.004) == pytest.approx(0.99)
    assert nadam_mu(5000, 0.99, 0.0) == pytest.approx(0.495)  # psi = 0: beta1 / 2 forever


# ------------------------------------------------------------------------------- torch parity


def _run_vs_torch(spec: OptimSpec, torch_opt_fn) -> None:
    ours_p, ref_p = make_params(), make_params()
    ours = StageOptimizer(ours_p, spec)
    ref = torch_opt_fn([p for _, p in ref_p])
    for t, lr in enumerate(LRS):
        grads = grads_for(ours_p, t)
        set_grads(ours_p, grads)
        set_grads(ref_p, grads)
        ours.step(lr / spec.lr)
        for group in ref.param_groups:
            group["lr"] = lr
        ref.step()
        for (n, a), (_, b) in zip(ours_p, ref_p):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"{n} at step {t + 1}")


def test_nadamw_equals_torch_nadam() -> None:
    spec = OptimSpec("nadamw", lr=1e-2, weight_decay=0.1, grad_clip=0.0)
    assert spec.resolved_beta1() == 0.99

    def ref(ps):
        return torch.optim.NAdam(
            ps,
            lr=1e-2,
            betas=(0.99, 0.999),
            eps=1e-8,
            weight_decay=0.1,
            momentum_decay=0.004,
            decoupled_weight_decay=True,
        )

    _run_vs_torch(spec, ref)


def test_nadamw_large_psi_equals_torch() -> None:
    # The "no ramp" ablation (mu_t ~ beta1 from step 1) must also match torch.
    spec = OptimSpec("nadamw", lr=1e-2, beta1=0.9, momentum_decay=50.0, grad_clip=0.0)

    def ref(ps):
        return torch.optim.NAdam(
            ps,
            lr=1e-2,
            betas=(0.9, 0.999),
            weight_decay=0.01,
            momentum_decay=50.0,
            decoupled_weight_decay=True,
        )

    _run_vs_torch(spec, ref)


def test_adamw_equals_torch_adamw() -> None:
    spec = OptimSpec("adamw", lr=1e-2, weight_decay=0.1, grad_clip=0.0)
    assert spec.resolved_beta1() == 0.9

    def ref(ps):
        return torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)

    _run_vs_torch(spec, ref)


# ------------------------------------------------------------------------------------ Muon


def test_is_hidden_matrix() -> None:
    m, v = torch.zeros(4, 4), torch.zeros(4)
    assert is_hidden_matrix("blocks.3.attn.qkv.weight", m)
    assert is_hidden_matrix("blocks.3.attn.proj.weight", m)
    assert is_hidden_matrix("blocks.3.mlp.fc.weight", m)
    assert is_hidden_matrix("blocks.3.mlp.proj.weight", m)
    assert is_hidden_matrix("stage.blocks.12.mlp.fc.weight", m)  # a prefixed name
    assert not is_hidden_matrix("blocks.3.ln1.weight", v)
    assert not is_hidden_matrix("blocks.3.attn.qkv.bias", v)
    assert not is_hidden_matrix("blocks.3.ln1.weight", m)  # a norm, even if 2-D
    for name in ("tok_emb.weight", "pos_emb.weight", "head.weight", "ln_f.weight"):
        assert not is_hidden_matrix(name, m)


@pytest.mark.parametrize("shape", [(32, 64), (64, 32), (48, 48)])
def test_newton_schulz_is_near_orthogonal(shape: tuple[int, int]) -> None:
    G = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    O = newton_schulz(G)
    assert O.shape == G.shape and O.dtype == G.dtype
    s = torch.linalg.svdvals(O)
    assert s.min() > 0.5 and s.max() < 1.5, s
    k = min(shape)
    gram = O @ O.T if shape[0] <= shape[1] else O.T @ O
    assert (gram - torch.eye(k)).abs().max() < 0.6
    # Same singular vectors as G: O ~ U S' V^T, so U^T O V is diagonal-dominant and positive.
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    core = U.T @ O @ Vh.T
    assert torch.all(torch.diagonal(core) > 0.5)
    assert (core - torch.diag(torch.diagonal(core))).abs().max() < 1e-3
    # Tall inputs are handled by transposing: NS(G^T) = NS(G)^T.
    torch.testing.assert_close(newton_schulz(G.T), O.T, rtol=1e-5, atol=1e-5)


def test_newton_schulz_rejects_non_matrix() -> None:
    with pytest.raises(ValueError):
        newton_schulz(torch.randn(3, 4, 5))


def _hand_ns(G: torch.Tensor) -> torch.Tensor:
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G.T if G.shape[0] > G.shape[1] else G
    X = X / (X.norm() + 1e-7)
    for _ in range(5):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if G.shape[0] > G.shape[1] else X


def test_muon_matches_hand_reference() -> None:
    spec = OptimSpec("muon", lr=3e-3, muon_lr=0.02, weight_decay=0.1, grad_clip=0.0)
    named = make_params()
    opt = StageOptimizer(named, spec)
    kinds = opt.kinds()
    assert kinds["blocks.0.attn.qkv.weight"] == "muon" and kinds["blocks.0.mlp.fc.weight"] == "muon"
    for n in ("tok_emb.weight", "head.weight", "blocks.0.ln1.weight", "blocks.0.attn.qkv.bias"):
        assert kinds[n] == "adamw"
    ref = {n: p.detach().clone() for n, p in named}
    buf = {n: torch.zeros_like(p) for n, p in ref.items()}
    m = {n: torch.zeros_like(p) for n, p in ref.items()}
    v = {n: torch.zeros_like(p) for n, p in ref.items()}
    for t in range(1, 4):
        scale = 1.0 / t
        grads = grads_for(named, t)
        set_grads(named, grads)
        opt.step(scale)
        for (n, _), g in zip(named, grads):
            W = ref[n]
            if kinds[n] == "muon":
                lr, beta = 0.02 * scale, 0.95
                buf[n] = beta * buf[n] + (1 - beta) * g
                U = (1 - beta) * g + beta * buf[n]
                rows, cols = W.shape
                O = _hand_ns(U) * math.sqrt(max(1.0, rows / cols))
                ref[n] = W * (1 - lr * 0.1) - lr * O
            else:  # AdamW, beta1 0.9, lr = spec.lr
                lr = 3e-3 * scale
                m[n] = 0.9 * m[n] + 0.1 * g
                v[n] = 0.999 * v[n] + 0.001 * g * g
                mh, vh = m[n] / (1 - 0.9**t), v[n] / (1 - 0.999**t)
                ref[n] = W * (1 - lr * 0.1) - lr * mh / (vh.sqrt() + 1e-8)
        for n, p in named:
            torch.testing.assert_close(p.detach(), ref[n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch without optim.Muon")
def test_muon_close_to_torch_muon_bf16() -> None:
    # torch.optim.Muon runs Newton-Schulz in bf16, so only a loose match is expected.
    W = torch.nn.Parameter(torch.randn(24, 8, generator=torch.Generator().manual_seed(5)))
    W2 = torch.nn.Parameter(W.detach().clone())
    ours = StageOptimizer([("blocks.0.attn.qkv.weight", W)], OptimSpec("muon", lr=1e-3))
    ref = torch.optim.Muon([W2], lr=0.02, weight_decay=0.01, adjust_lr_fn="original")
    W0 = W.detach().clone()
    for t in range(3):
        g = torch.randn(24, 8, generator=torch.Generator().manual_seed(t))
        W.grad, W2.grad = g.clone(), g.clone()
        ours.step(1.0)
        ref.step()
    rel = (W - W2).norm() / (W - W0).norm()
    assert rel < 0.05, rel


# ---------------------------------------------------------------------------- error feedback


@pytest.mark.parametrize("name", ["adamw", "nadamw", "muon"])
def test_error_feedback_hand_formula(name: str) -> None:
    spec = OptimSpec(name, lr=1e-2, weight_decay=0.1, grad_clip=0.0)
    ef_spec = OptimSpec(name, lr=1e-2, weight_decay=0.1, grad_clip=0.0, error_feedback=True)
    named = make_params()
    opt = StageOptimizer(named, ef_spec)
    # Inner optimizer whose position is reset to x_t each step: its u_t is the update the inner
    # rule would apply at x_t (moments depend on grads only, so they are unaffected by EF).
    inner_p = clone_params(named)
    inner = StageOptimizer(inner_p, spec)
    x = {n: p.detach().clone() for n, p in named}
    u_prev: dict[str, torch.Tensor] = {}
    for t in range(1, 5):
        grads = grads_for(named, t)
        for (n, p), g in zip(inner_p, grads):
            p.data.copy_(x[n])
            p.grad = g.clone()
        inner.step(1.0)
        set_grads(named, grads)
        opt.step(1.0)
        for n, p in inner_p:
            u = x[n] - p.detach()
            prev = u_prev.get(n, u)  # first correction is zero
            x[n] = x[n] - 2 * u + prev
            u_prev[n] = u
            if t == 1:  # first step is exactly the plain inner step
                torch.testing.assert_close(x[n], p.detach())
        for n, p in named:
            torch.testing.assert_close(p.detach(), x[n], rtol=1e-5, atol=1e-6, msg=f"{n} t={t}")
    assert opt.state_bytes() == inner.state_bytes() + sum(p.numel() * 4 for _, p in named)


# ---------------------------------------------------------------------- clip, state, registry


def test_grad_clip_matches_torch() -> None:
    named = [("a", torch.nn.Parameter(torch.zeros(3))), ("b", torch.nn.Parameter(torch.zeros(4)))]
    named[0][1].grad = torch.tensor([3.0, 0.0, 0.0])
    named[1][1].grad = torch.tensor([0.0, 4.0, 0.0, 0.0])
    opt = StageOptimizer(named, OptimSpec("adamw", lr=0.0, weight_decay=0.0, grad_clip=1.0))
    assert opt.clip_grads() == pytest.approx(5.0)
    total = torch.cat([p.grad for _, p in named]).norm()
    assert total == pytest.approx(1.0, abs=1e-5)
    ref = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))]
    ref[0].grad = torch.tensor([3.0, 0.0, 0.0])
    ref[1].grad = torch.tensor([0.0, 4.0, 0.0, 0.0])
    torch.nn.utils.clip_grad_norm_(ref, 1.0)
    for (_, p), r in zip(named, ref):
        assert torch.equal(p.grad, r.grad)
    # Below the threshold, or disabled: grads untouched, norm still reported; step returns it.
    named[0][1].grad = torch.tensor([3.0, 0.0, 0.0])
    named[1][1].grad = torch.tensor([0.0, 4.0, 0.0, 0.0])
    off = StageOptimizer(named, OptimSpec("adamw", lr=0.0, grad_clip=0.0))
    assert off.step(1.0) == pytest.approx(5.0)
    assert named[0][1].grad[0] == 3.0
    assert StageOptimizer(named, OptimSpec("adamw", lr=0.0, grad_clip=10.0)).step(1.0) == 5.0


@pytest.mark.parametrize(
    "spec",
    [
        OptimSpec("nadamw", lr=1e-2, grad_clip=1.0),
        OptimSpec("nadamw", lr=1e-2, error_feedback=True),
        OptimSpec("muon", lr=1e-2, error_feedback=True),
    ],
    ids=["nadamw", "nadamw-ef", "muon-ef"],
)
def test_state_dict_round_trip(spec: OptimSpec) -> None:
    _check_round_trip(spec)


def _check_round_trip(spec: OptimSpec, n_before: int = 4, n_after: int = 4) -> None:
    named = make_params()
    a = StageOptimizer(named, spec)
    for t in range(n_before):
        set_grads(named, grads_for(named, t))
        a.step(1.0)
    sd = a.state_dict()
    assert all(isinstance(k, str) for k in sd)
    assert all(isinstance(v, torch.Tensor | int | float) for v in sd.values())
    named_b = clone_params(named)
    b = StageOptimizer(named_b, spec)
    b.load_state_dict(sd)
    for t in range(n_before, n_before + n_after):
        grads = grads_for(named, t)
        set_grads(named, grads)
        set_grads(named_b, grads)
        assert a.step(0.7) == b.step(0.7)
    for (n, p), (_, q) in zip(named, named_b):
        assert torch.equal(p, q), n
    with pytest.raises(ValueError, match="mismatch"):
        b.load_state_dict({k: v for k, v in sd.items() if not k.endswith("/step")})


def test_skips_params_without_grad_and_zero_grad() -> None:
    named = make_params()
    opt = StageOptimizer(named, OptimSpec("nadamw", lr=1e-2))
    set_grads(named, grads_for(named, 0))
    named[0][1].grad = None
    before = named[0][1].detach().clone()
    opt.step(1.0)
    assert torch.equal(named[0][1].detach(), before)
    sd = opt.state_dict()
    assert sd["tok_emb.weight/step"] == 0 and sd["head.weight/step"] == 1
    opt.zero_grad()
    assert all(p.grad is None for _, p in named)


def test_spec_validation_and_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="optim.beta2"):
        OptimSpec("adamw", lr=1e-3, beta2=1.0)
    with pytest.raises(ValueError, match="optim.name"):
        StageOptimizer(make_params(), OptimSpec("sgd", lr=1e-3))  # type: ignore[arg-type]
    assert OptimSpec("muon", lr=1e-3).resolved_beta1() == 0.9

    # Extension point: a new optimizer is one registered planner, no edit of the update code.
    class SignRule:
        kind = "sign"
        quantized: dict[str, bool] = {}

        def init_state(self, p):
            return {}

        def apply(self, p, g, state, step, lr_scale):
            p.sub_(torch.sign(g), alpha=0.1 * lr_scale)

    monkeypatch.setitem(OPTIMIZERS, "sign_test", lambda n, p, s: SignRule())
    named = make_params()
    before = [p.detach().clone() for _, p in named]
    grads = grads_for(named, 0)
    set_grads(named, grads)
    StageOptimizer(named, OptimSpec("sign_test", lr=1.0)).step(2.0)  # type: ignore[arg-type]
    for (_, p), b, g in zip(named, before, grads):
        torch.testing.assert_close(p.detach(), b - 0.2 * torch.sign(g))
    assert register_optimizer("sign_test2")(lambda n, p, s: SignRule()) is not None
    monkeypatch.delitem(OPTIMIZERS, "sign_test2")


# ------------------------------------------------------------------------------ 8-bit states


def test_state_8bit_without_bitsandbytes_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "bitsandbytes.functional", None)
    with pytest.raises(ValueError, match="state_8bit=false"):
        StageOptimizer(make_params(), OptimSpec("adamw", lr=1e-3, state_8bit=True))


@pytest.mark.parametrize("name", ["adamw", "nadamw"])
def test_state_8bit_close_to_fp32(name: str) -> None:
    pytest.importorskip("bitsandbytes")
    g = torch.Generator().manual_seed(7)
    big = torch.randn(64, 128, generator=g)  # >= 4096 elements: 8-bit moments
    named32 = [("blocks.0.mlp.fc.weight", torch.nn.Parameter(big.clone()))]
    named32.append(("blocks.0.ln1.weight", torch.nn.Parameter(torch.ones(128))))  # stays fp32
    named8 = clone_params(named32)
    o32 = StageOptimizer(named32, OptimSpec(name, lr=1e-2))
    o8 = StageOptimizer(named8, OptimSpec(name, lr=1e-2, state_8bit=True))
    # m, v: 8 B/elt fp32 -> 2 B/elt + fp32 absmax per 256-block for the big tensor.
    assert o8.state_bytes() == 2 * 8192 + 2 * 32 * 4 + 2 * 128 * 4
    assert o32.state_bytes() == 2 * 4 * (8192 + 128)
    for t in range(20):
        grads = grads_for(named32, t)
        set_grads(named32, grads)
        set_grads(named8, grads)
        o32.step(1.0)
        o8.step(1.0)
    p32, p8 = named32[0][1].detach(), named8[0][1].detach()
    rel = (p8 - p32).norm() / (p32 - big).norm()
    assert rel < 0.02, rel
    sd = o8.state_dict()
    assert sd["blocks.0.mlp.fc.weight/m.q"].dtype == torch.uint8
    assert "blocks.0.ln1.weight/m" in sd
    if name == "nadamw":
        _check_round_trip(OptimSpec(name, lr=1e-2, state_8bit=True, error_feedback=True))


@pytest.mark.parametrize("horizon", [300, 1600, 6400, 30_000])
def test_auto_momentum_decay_follows_the_papers_mu_curve_over_any_horizon(horizon) -> None:
    """psi = 'auto' maps the paper's 30k-update ramp onto the run: at the same share of the run
    mu_t is the paper's, ending at its 0.986 (psi 0.004 over 1,600 updates reached only 0.61)."""
    psi = momentum_decay_for(horizon)
    for share in (0.01, 0.1, 0.5, 1.0):
        ours = nadam_mu(round(share * horizon), 0.99, psi)
        paper = nadam_mu(round(share * PAPER_STEPS), 0.99, 0.004)
        assert ours == pytest.approx(paper, abs=2e-3)
    assert nadam_mu(horizon, 0.99, psi) == pytest.approx(0.9863, abs=1e-4)
    assert momentum_decay_for(1600) == pytest.approx(0.075)
    cfg = load_config([], ["optim.momentum_decay=auto", f"run.steps={horizon}"])
    assert optim_spec(cfg.optim, 0, cfg.schedule_horizon).momentum_decay == pytest.approx(psi)
    assert optim_spec(load_config([], []).optim).momentum_decay == 0.004  # the default: fixed
    with pytest.raises(ValueError):
        momentum_decay_for(0)


def test_delay_lr_factor_rises_from_lr_over_delay_to_lr() -> None:
    """AsyncPP's lr_correction: lr / delta at the start, the full lr from `share` of the run."""
    assert delay_lr_factor(3, 0, 1000, 0.5) == pytest.approx(1 / 3)
    assert delay_lr_factor(4, 250, 1000, 0.5) == pytest.approx(4**-0.5)  # halfway: 1/sqrt(d)
    assert delay_lr_factor(3, 500, 1000, 0.5) == 1.0
    # a share above 1 never releases it whole: share 2 ends at 1/sqrt(d), halfway at d^-0.75
    assert delay_lr_factor(4, 1000, 1000, 2.0) == pytest.approx(0.5)
    assert delay_lr_factor(16, 500, 1000, 2.0) == pytest.approx(16**-0.75)
    assert delay_lr_factor(16, 0, 1000, 2.0) == pytest.approx(1 / 16)
    assert delay_lr_factor(3, 900, 1000, 0.5) == 1.0
    factors = [delay_lr_factor(3, s, 1000, 0.5) for s in range(0, 1001, 50)]
    assert factors == sorted(factors)  # never falls
    assert delay_lr_factor(1, 0, 1000, 0.5) == 1.0  # one step of delay: nothing to correct
    assert delay_lr_factor(0, 0, 1000, 0.5) == 1.0
    assert delay_lr_factor(3, 0, 1000, 0.0) == 1.0  # off
    with pytest.raises(ValueError):
        delay_lr_factor(3, 0, 1000, -0.1)


def test_cells_scale_their_lr_by_their_own_delay(text_file) -> None:
    from mesh.engine.cell import Cell
    from mesh.model.build import build_stages

    sets = ["model.n_layers=4", "model.d_model=16", "model.n_heads=2", "model.seq_len=16"]
    sets += [f"data.path='{text_file}'", "grid.stages=4", "grid.replicas=1", "run.steps=100"]
    sets += ["optim.warmup_steps=0", "pipeline.schedule=async"]
    plain = load_config([], [*sets, "optim.depth_rule=off"])  # (the P = 4 rule corrects too)
    cfg = load_config([], [*sets, "optim.delay_lr_share=0.5"])
    for j, module in enumerate(build_stages(cfg.model, 4, 0)):
        corrected, base = (
            Cell.build(cfg, j, 0, module).lr_scale(),
            Cell.build(plain, j, 0, module).lr_scale(),
        )
        assert corrected == pytest.approx(base / max(1, 3 - j))  # delays 3, 2, 1, 0


def test_a_compressed_boundary_trains_at_its_own_lr_and_weight_decay() -> None:
    """optim.boundary_lr_scale and boundary_weight_decay: a learned boundary's encoder, decoder
    and anchors (the stage module's `boundary.*`) take lr x the scale and their own decay; the
    rest of the stage the model's. One AdamW step by hand: from theta with gradient g the first
    step is theta (1 - lr wd) - lr g / (|g| + eps) (bias-corrected m / sqrt(v) = g / |g|)."""
    import helpers

    from mesh.engine.cell import Cell
    from mesh.model.build import build_cell_stage

    sets = [
        *helpers.TINY,
        "model.arch='llama'",
        "grid.stages=2",
        "pipeline.boundary='learned'",
        "pipeline.boundary_rank=4",
        "optim.name='adamw'",
        "optim.lr=0.01",
        "optim.weight_decay=0.1",
        "optim.grad_clip=0",
    ]
    plain = load_config([], sets)
    own = load_config([], [*sets, "optim.boundary_lr_scale=0.25", "optim.boundary_weight_decay=0"])
    assert plain.fingerprint() != own.fingerprint()
    assert (
        plain.fingerprint() == load_config([], [*sets, "optim.boundary_lr_scale=1.0"]).fingerprint()
    )  # the default hashes away: earlier runs keep their fingerprints
    for cfg in (plain, own):
        cell = Cell.build(cfg, 1, 0, build_cell_stage(cfg, 1))
        params = dict(cell.module.named_parameters())
        names = [n for n in params if n.startswith("boundary.")]
        assert {"boundary.dec0.basis", "boundary.dec0.anchor_emb"} <= set(names)
        before = {n: p.detach().clone() for n, p in params.items()}
        torch.manual_seed(0)
        grads = {n: torch.randn_like(p) for n, p in params.items()}
        for n, p in params.items():
            p.grad = grads[n].clone()
        cell.optimizer.step(1.0)
        scaled = cfg is own
        for n, p in params.items():
            in_boundary = n.startswith("boundary.")
            lr = 0.01 * (0.25 if scaled and in_boundary else 1.0)
            wd = 0.0 if scaled and in_boundary else 0.1
            g = grads[n]
            want = before[n] * (1 - lr * wd) - lr * g / (g.abs() + 1e-8)
            torch.testing.assert_close(p.detach(), want, rtol=1e-5, atol=1e-7, msg=n)
