"""Update rules of ONE pipeline stage: NAdamW / AdamW / Muon, error feedback.

Each stage owns a StageOptimizer over its own parameters only (no state, norm or step shared):
torch's NAdam (decoupled weight decay, the mu_t ramp) and AdamW written out, a per-stage clip,
error feedback on the inner update, and Muon (mesh/algo/muon.py); a compressed boundary's
parameters at their own lr and decay (OptimSpec.for_boundary). The schedules over a run (lr,
the averaging's lambda, mu_t, adaptive beta1) are mesh/algo/optim_schedules.py. State is a flat
dict of tensors and numbers.

Extension point: OPTIMIZERS maps OptimSpec.name to a planner (param name, param, spec) -> rule.
A new optimizer lives in its own module that calls register_optimizer; list that module in
_PLUGIN_MODULES (one line) so it is imported on first use.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from mesh.algo.muon import MuonRule, is_hidden_matrix
from mesh.algo.muon import newton_schulz as newton_schulz  # re-exported: part of this API
from mesh.algo.optim_schedules import adaptive_beta1, nadam_mu
from mesh.algo.staleness import update_velocity, velocity_estimate
from mesh.algo.state8bit import _Blockwise8bit as _Blockwise8bit  # re-exported: plan counts it
from mesh.choices import OPTIMIZERS

OptimName = Literal[OPTIMIZERS]
State = dict[str, torch.Tensor | int | float]

# beta1 when OptimSpec.beta1 is None; muon's value is for its AdamW part.
DEFAULT_BETA1: dict[str, float] = {"nadamw": 0.99, "adamw": 0.9, "muon": 0.9}
# a compressed boundary's parameters in a stage module (mesh/model/boundary.py: the module's
# `boundary` ModuleDict); the learned ends train with OptimSpec.for_boundary()
BOUNDARY_PREFIX = "boundary."


# ------------------------------------------------------------------------------------- the spec


@dataclass(frozen=True)
class OptimSpec:
    """What one stage's optimizer does; built by the run config (keys `optim.*`)."""

    name: OptimName
    lr: float
    beta1: float | None = None  # None -> DEFAULT_BETA1[name]
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    momentum_decay: float = 0.004  # NAdam psi
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    ns_steps: int = 5
    rotate_every: int = 10  # rotated_adam: eigenbasis refresh period (steps)
    stage_aware: bool = False  # rotated_adam: refresh period shrinks with the stage's delay
    delay: int = 0  # this stage's gradient delay delta_j (filled in by the cell)
    stages: int = 1  # the pipeline's depth P (adaptive momentum reads it; filled in by the cell)
    adaptive_momentum: bool = False  # AsyncPP: beta1 grows with the stage's delay
    mu_cap: float | None = None  # nadamw: mu_t at most this (None: torch's ramp to beta1)
    grad_clip: float = 10.0  # per-stage global norm; <= 0 disables
    error_feedback: bool = False
    state_8bit: bool = False
    velocity_beta: float | None = None  # weight prediction's EMA of updates (set by the cell)
    # a compressed boundary's parameters (BOUNDARY_PREFIX): their lr (and muon_lr) x this, and
    # their own weight decay (None: weight_decay)
    boundary_lr_scale: float = 1.0
    boundary_weight_decay: float | None = None

    def __post_init__(self) -> None:
        checks = [
            ("lr", self.lr >= 0),
            ("beta1", self.beta1 is None or 0 <= self.beta1 < 1),
            ("beta2", 0 <= self.beta2 < 1),
            ("eps", self.eps > 0),
            ("weight_decay", self.weight_decay >= 0),
            ("momentum_decay", self.momentum_decay >= 0),
            ("muon_lr", self.muon_lr >= 0),
            ("muon_momentum", 0 <= self.muon_momentum < 1),
            ("ns_steps", self.ns_steps >= 1),
            ("rotate_every", self.rotate_every >= 1),
            ("delay", self.delay >= 0),
            ("stages", self.stages >= 1),
            ("mu_cap", self.mu_cap is None or 0 <= self.mu_cap < 1),
            ("velocity_beta", self.velocity_beta is None or 0 <= self.velocity_beta < 1),
            ("boundary_lr_scale", self.boundary_lr_scale > 0),
            ("boundary_weight_decay", (self.boundary_weight_decay or 0) >= 0),
        ]
        for key, ok in checks:
            if not ok:
                raise ValueError(f"optim.{key} out of range: {getattr(self, key)!r}")

    def for_boundary(self) -> OptimSpec:
        """The spec a compressed boundary's parameters train with: lr and muon_lr scaled by
        boundary_lr_scale, weight decay boundary_weight_decay where set; the rest the model's."""
        wd = self.boundary_weight_decay
        return dataclasses.replace(
            self,
            lr=self.lr * self.boundary_lr_scale,
            muon_lr=self.muon_lr * self.boundary_lr_scale,
            weight_decay=self.weight_decay if wd is None else wd,
            boundary_lr_scale=1.0,
            boundary_weight_decay=None,
        )

    def resolved_beta1(self) -> float:
        """beta1 with the per-optimizer default filled in, and with adaptive momentum this
        stage's own (AsyncPP: more momentum the staler its gradients)."""
        b1 = self.beta1 if self.beta1 is not None else DEFAULT_BETA1.get(self.name, 0.9)
        if self.adaptive_momentum:
            b1 = adaptive_beta1(b1, self.delay, self.stages)
        return b1


# ---------------------------------------------------------------------------------- update rules


class UpdateRule(Protocol):
    """One parameter's update: state layout plus an in-place step (called under no_grad)."""

    kind: str
    quantized: dict[str, bool]  # state key -> signed, for optional 8-bit storage between steps

    def init_state(self, p: torch.Tensor) -> State: ...

    def apply(
        self, p: torch.Tensor, g: torch.Tensor, state: State, step: int, lr_scale: float
    ) -> None: ...


class AdamWRule:
    """torch.optim.AdamW, single-tensor path, decoupled weight decay."""

    kind = "adamw"
    quantized: dict[str, bool] = {"m": True, "v": False}

    def __init__(
        self, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float
    ) -> None:
        self.lr, self.beta1, self.beta2 = lr, beta1, beta2
        self.eps, self.weight_decay = eps, weight_decay

    def init_state(self, p: torch.Tensor) -> State:
        z = torch.zeros_like
        return {"m": z(p, memory_format=torch.preserve_format), "v": z(p)}

    def _moments(self, g: torch.Tensor, state: State) -> tuple[torch.Tensor, torch.Tensor]:
        m, v = state["m"], state["v"]
        assert isinstance(m, torch.Tensor) and isinstance(v, torch.Tensor)
        m.lerp_(g, 1.0 - self.beta1)  # m = b1 m + (1 - b1) g
        v.mul_(self.beta2).addcmul_(g, g, value=1.0 - self.beta2)  # v = b2 v + (1 - b2) g^2
        return m, v

    def apply(
        self, p: torch.Tensor, g: torch.Tensor, state: State, step: int, lr_scale: float
    ) -> None:
        lr = self.lr * lr_scale
        p.mul_(1.0 - lr * self.weight_decay)
        m, v = self._moments(g, state)
        bc1 = 1.0 - self.beta1**step
        bc2 = 1.0 - self.beta2**step
        # Same operation order as torch (denom = sqrt(v) / sqrt(bc2) + eps) for ~bitwise equality.
        denom = (v.sqrt() / math.sqrt(bc2)).add_(self.eps)
        p.addcdiv_(m, denom, value=-lr / bc1)


class NAdamWRule(AdamWRule):
    """torch.optim.NAdam(decoupled_weight_decay=True), single-tensor path:

    theta <- theta (1 - lr wd);  Pi_t = Pi_{t-1} mu_t;  denom = sqrt(v_t / (1 - b2^t)) + eps;
    theta <- theta - lr (1 - mu_t) / (1 - Pi_t) g / denom
                   - lr mu_{t+1} / (1 - Pi_t mu_{t+1}) m / denom.
    """

    kind = "nadamw"

    def __init__(
        self,
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        momentum_decay: float,
        mu_cap: float | None = None,
    ) -> None:
        super().__init__(lr, beta1, beta2, eps, weight_decay)
        self.momentum_decay = momentum_decay
        self.mu_cap = mu_cap

    def init_state(self, p: torch.Tensor) -> State:
        # Pi_0 = 1. Kept as a Python float (torch keeps an fp32 tensor: differences ~1e-7 rel).
        return {**super().init_state(p), "mu_product": 1.0}

    def apply(
        self, p: torch.Tensor, g: torch.Tensor, state: State, step: int, lr_scale: float
    ) -> None:
        lr = self.lr * lr_scale
        p.mul_(1.0 - lr * self.weight_decay)
        mu = nadam_mu(step, self.beta1, self.momentum_decay, self.mu_cap)
        mu_next = nadam_mu(step + 1, self.beta1, self.momentum_decay, self.mu_cap)
        mu_product = float(state["mu_product"]) * mu
        state["mu_product"] = mu_product
        m, v = self._moments(g, state)
        denom = v.div(1.0 - self.beta2**step).sqrt().add_(self.eps)
        p.addcdiv_(g, denom, value=-lr * (1.0 - mu) / (1.0 - mu_product))
        p.addcdiv_(m, denom, value=-lr * mu_next / (1.0 - mu_product * mu_next))


# ------------------------------------------------------------------------------------- registry

Planner = Callable[[str, torch.Tensor, OptimSpec], UpdateRule]
OPTIMIZERS: dict[str, Planner] = {}
# name -> module that registers it on import, e.g. "rotated_adam": "mesh.rotated_adam".
_PLUGIN_MODULES: dict[str, str] = {"rotated_adam": "mesh.algo.rotated"}


def register_optimizer(name: str) -> Callable[[Planner], Planner]:
    """Decorator: make `name` a valid OptimSpec.name, planned per parameter by the function."""

    def deco(fn: Planner) -> Planner:
        OPTIMIZERS[name] = fn
        return fn

    return deco


def get_planner(name: str) -> Planner:
    """The planner for an optimizer name, importing its plugin module on first use."""
    if name not in OPTIMIZERS and name in _PLUGIN_MODULES:
        importlib.import_module(_PLUGIN_MODULES[name])
    if name not in OPTIMIZERS:
        known = sorted(set(OPTIMIZERS) | set(_PLUGIN_MODULES))
        raise ValueError(f"optim.name: unknown optimizer {name!r}; choose one of {known}")
    return OPTIMIZERS[name]


@register_optimizer("adamw")
def _plan_adamw(name: str, p: torch.Tensor, spec: OptimSpec) -> UpdateRule:
    return AdamWRule(spec.lr, spec.resolved_beta1(), spec.beta2, spec.eps, spec.weight_decay)


@register_optimizer("nadamw")
def _plan_nadamw(name: str, p: torch.Tensor, spec: OptimSpec) -> UpdateRule:
    b1 = spec.resolved_beta1()
    return NAdamWRule(
        spec.lr, b1, spec.beta2, spec.eps, spec.weight_decay, spec.momentum_decay, spec.mu_cap
    )


@register_optimizer("muon")
def _plan_muon(name: str, p: torch.Tensor, spec: OptimSpec) -> UpdateRule:
    # Muon for hidden matrices, AdamW (lr = spec.lr) for embeddings, head, norms, biases (4.3).
    if not is_hidden_matrix(name, p):
        return _plan_adamw(name, p, spec)
    return MuonRule(
        spec.muon_lr, spec.muon_momentum, spec.muon_nesterov, spec.weight_decay, spec.ns_steps
    )


# ---------------------------------------------------------------------------------- the optimizer


class StageOptimizer:
    """One stage's optimizer over its own named parameters; see OptimSpec and the rules above."""

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], spec: OptimSpec) -> None:
        names = [n for n, _ in named_params]
        if len(set(names)) != len(names):
            raise ValueError("StageOptimizer: duplicate parameter names")
        if any("/" in n for n in names):
            raise ValueError("StageOptimizer: '/' is reserved in parameter names (state keys)")
        self.spec = spec
        self.params: dict[str, torch.nn.Parameter] = dict(named_params)
        planner = get_planner(spec.name)
        boundary = spec.for_boundary()
        self.rules: dict[str, UpdateRule] = {
            n: planner(n, p, boundary if n.startswith(BOUNDARY_PREFIX) else spec)
            for n, p in named_params
        }
        self._q8 = _Blockwise8bit() if spec.state_8bit else None
        # Eager state: state_bytes() and state_dict() keys are stable from the start.
        self.state: dict[str, State] = {n: self._init_state(n, p) for n, p in named_params}

    def _is_8bit(self, key: str, rule: UpdateRule, p: torch.Tensor) -> bool:
        return self._q8 is not None and key in rule.quantized and p.numel() >= self._q8.MIN_NUMEL

    def _init_state(self, name: str, p: torch.nn.Parameter) -> State:
        rule = self.rules[name]
        st: State = {"step": 0}
        for key, val in rule.init_state(p.detach()).items():
            if self._q8 is not None and self._is_8bit(key, rule, p):
                self._q8.probe(p.device)
                assert isinstance(val, torch.Tensor)
                st[key + ".q"], st[key + ".absmax"] = self._q8.encode(val, rule.quantized[key])
            else:
                st[key] = val
        if self.spec.error_feedback:
            st["u_prev"] = torch.zeros_like(p.detach())
        if self.spec.velocity_beta is not None:
            st["velocity"] = torch.zeros_like(p.detach())
        return st

    def kinds(self) -> dict[str, str]:
        """Parameter name -> update rule kind ("nadamw", "adamw", "muon", ...), for logs/tests."""
        return {n: r.kind for n, r in self.rules.items()}

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None

    @torch.no_grad()
    def clip_grads(self) -> float:
        """Per-stage global L2 norm of the grads (as torch.nn.utils.clip_grad_norm_), scaled down
        to spec.grad_clip when above it. Returns the pre-clip norm."""
        grads = [p.grad for p in self.params.values() if p.grad is not None]
        if not grads:
            return 0.0
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        if self.spec.grad_clip > 0:
            coef = torch.clamp(self.spec.grad_clip / (total + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef.to(g.device, g.dtype))
        return float(total)

    @torch.no_grad()
    def step(self, lr_scale: float) -> float:
        """Clip, then update every parameter with a grad in place: lr = spec.lr * lr_scale (Muon
        matrices: spec.muon_lr * lr_scale). Parameters without .grad are skipped (their step
        counter does not advance, as in torch). Returns the pre-clip gradient norm."""
        norm = self.clip_grads()
        for name, p in self.params.items():
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise ValueError(f"StageOptimizer: sparse gradient for {name} is not supported")
            st, rule = self.state[name], self.rules[name]
            step = int(st["step"]) + 1
            st["step"] = step
            work = self._unpack(st, rule, p)
            ef, velocity_on = self.spec.error_feedback, self.spec.velocity_beta is not None
            x_before = p.detach().clone() if ef or velocity_on else None
            # error feedback reuses x_before's buffer: the velocity needs its own copy then
            x_start = x_before.clone() if ef and velocity_on else x_before
            rule.apply(p, p.grad, work, step, lr_scale)
            self._pack(st, work, rule, p)
            if self.spec.error_feedback:
                assert x_before is not None
                self._error_feedback(p, x_before, st, step)
            if self.spec.velocity_beta is not None:
                assert x_start is not None
                velocity = st["velocity"]
                assert isinstance(velocity, torch.Tensor)
                update_velocity(velocity, p.detach() - x_start, self.spec.velocity_beta)
        return norm

    def velocity(self, name: str) -> torch.Tensor:
        """Parameter `name`'s update velocity, bias-corrected (weight prediction)."""
        beta, st = self.spec.velocity_beta, self.state[name]
        velocity = st["velocity"]
        assert beta is not None and isinstance(velocity, torch.Tensor), "prediction is off"
        return velocity_estimate(velocity, beta, int(st["step"]))

    def _unpack(self, st: State, rule: UpdateRule, p: torch.Tensor) -> State:
        if self._q8 is None:
            return st  # the rule mutates the stored tensors in place
        work: State = {}
        for key, val in st.items():
            if key.endswith(".q"):
                base = key[:-2]
                absmax = st[base + ".absmax"]
                assert isinstance(val, torch.Tensor) and isinstance(absmax, torch.Tensor)
                work[base] = self._q8.decode(val, absmax, rule.quantized[base])
            elif not key.endswith(".absmax"):
                work[key] = val
        return work

    def _pack(self, st: State, work: State, rule: UpdateRule, p: torch.Tensor) -> None:
        if work is st:
            return
        assert self._q8 is not None
        for key, val in work.items():
            if key + ".q" in st:
                assert isinstance(val, torch.Tensor)
                st[key + ".q"], st[key + ".absmax"] = self._q8.encode(val, rule.quantized[key])
            else:
                st[key] = val

    @staticmethod
    def _error_feedback(p: torch.Tensor, x_before: torch.Tensor, st: State, step: int) -> None:
        # error feedback: with u_t = x_t - (x_t after the inner step, weight decay included),
        # x_{t+1} = x_t - u_t - (u_t - u_{t-1}). u_prev := first u, so the first correction is 0.
        u_prev = st["u_prev"]
        assert isinstance(u_prev, torch.Tensor)
        u = x_before.sub_(p)  # reuse the snapshot buffer for u_t
        if step > 1:
            p.sub_(u - u_prev)
        u_prev.copy_(u)

    def state_views(self) -> dict[str, torch.Tensor | int | float]:
        """state_dict() without copies (a checkpoint writes the optimizer's own tensors)."""
        items = ((f"{n}/{k}", v) for n, st in self.state.items() for k, v in st.items())
        return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in items}

    def state_dict(self) -> dict[str, torch.Tensor | int | float]:
        """Flat copy: "<param name>/<key>" -> tensor (cloned) or number. No nested objects."""
        views = self.state_views().items()
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in views}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Load a state_dict() of an optimizer with the same parameters and spec."""
        mine = {f"{n}/{k}" for n, st in self.state.items() for k in st}
        if set(sd) != mine:
            missing, extra = sorted(mine - set(sd)), sorted(set(sd) - mine)
            raise ValueError(f"optimizer state mismatch: missing {missing[:5]}, extra {extra[:5]}")
        for full, val in sd.items():
            name, key = full.split("/", 1)
            old = self.state[name][key]
            if isinstance(old, torch.Tensor):
                if not isinstance(val, torch.Tensor) or val.shape != old.shape:
                    raise ValueError(f"optimizer state {full}: expected tensor {tuple(old.shape)}")
                self.state[name][key] = val.detach().to(old.device, old.dtype).clone()
            else:
                self.state[name][key] = type(old)(val)

    def state_bytes(self) -> int:
        """Bytes held by optimizer state tensors (moments, 8-bit codes and scales, EF buffer)."""
        return sum(
            v.numel() * v.element_size()
            for st in self.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor)
        )
