"""The depth study's arms (what each candidate against the async pipeline's staleness sets), their
runs' labels and specs, and the settings that reproduce a run.

An arm is a set of overrides on one replica's pipeline (grid P x 1: the depth is the
pipeline's; the averaging axis has its own studies) plus how its lr knob maps to keys. Each
candidate is one lever the seeds name (docs/depth.md):

- the reference: the async pipeline as it ships (AsyncPP's NAdamW, beta1 0.99, weight stashing);
- FullSync: the synchronous pipeline (GPipe, AdamW, M microbatches an update);
- AsyncPP's per-stage lr correction (`optim.delay_lr_share`) and adaptive momentum
  (`optim.adaptive_momentum`, which needs a base beta1 below 0.99 to do anything);
- the decay phase: a cosine floor of 0 (`optim.min_lr_ratio`), a cap on NAdam's mu_t
  (`optim.mu_cap`);
- basis rotation (`rotated_adam`, with and without `stage_aware`) and Muon;
- the constant one-step delay (2BW, M microbatches an update) with Muon and error feedback;
- weight prediction (PipeMare) along the update velocity.

A candidate's lr grid is centred where the lever's own scale puts it; the study widens a grid
whose best sits on its edge (depth.py), so every pick is inside its grid. The arm
`optim.depth_rule` ships at a depth (`shipped_arm`) is measured at the lr the rule gives a user
(`at_rule_lr`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from mesh.bench.boundary import WIDTHS
from mesh.bench.simruns import MUON_LR_FACTOR, Spec, spec_config
from mesh.config import Config, load_config
from mesh.depth_rule import rule_for
from mesh.methods import METHODS

# the depth study's model: a Llama of 16 blocks, so that P = 16 holds one a stage, on bytes
STUDY_DEFAULTS = [
    "model.arch=llama",
    "model.vocab_size=256",
    "model.n_layers=16",
    "model.seq_len=128",
    "pipeline.microbatch_size=8",
    "data.val_batches=16",
    *WIDTHS[64],
]
REFERENCE = "reference"
FULLSYNC = "FullSync"
RECOMMENDED = "recommended"


@dataclass(frozen=True)
class Arm:
    """One candidate: its overrides (no lr), its lr grid on the tuning seed, the microbatches
    one update takes (FullSync's and 2BW's M), and whether Muon's lr follows the lr knob."""

    name: str
    overrides: dict[str, Any]
    lrs: tuple[float, ...]
    microbatches_per_update: int = 1
    muon: bool = False
    # what it adds to the reference (the settings a combination merges)
    lever: dict[str, Any] = field(default_factory=dict)
    # False: a screen at the lrs given only (a lever that is a refinement of another arm, run
    # at that arm's lr: it is picked only if it helps there), no widening
    tune: bool = True

    def at(self, lr: float) -> dict[str, Any]:
        """Its overrides at lr (and Muon's matrices at MUON_LR_FACTOR x lr)."""
        ov = {**self.overrides, "optim.lr": lr}
        if self.muon:
            ov["optim.muon_lr"] = round(lr * MUON_LR_FACTOR, 10)
        return ov


def _async(stages: int) -> dict[str, Any]:
    """The reference pipeline at depth `stages`: AsyncMesh-fp8's optimizer, full bf16
    boundaries, one replica, the sentinel off (its drops are a defence's cost, not depth's)."""
    return {
        **METHODS["AsyncMesh-fp8"],
        "grid.stages": stages,
        "grid.replicas": 1,
        "pipeline.boundary": "full",
        "pipeline.codec": "bf16",
        "sentinel.enabled": False,
        # the arms are the settings they name, whatever optim.depth_rule ships (it is what
        # the study picks; hashed away, so the fingerprints are the same either way)
        "optim.depth_rule": "off",
    }


# The first grids (seed 100, P = 8): the 16-block model wants lower lrs than the boundary
# study's 8 blocks (the reference 1.898 at 1e-3 against 1.915 at 2e-3 and 2.017 at 4e-3;
# FullSync 1.791 at 4e-3 against 1.844 at 8e-3 and 1.911 at 1.6e-2; the lr correction 1.798 at
# 2e-3 against 1.834 at 4e-3), so each also starts one factor of 2 lower than it first did
REFERENCE_LRS = (5e-4, 1e-3, 2e-3, 4e-3)
FULLSYNC_LRS = (2e-3, 4e-3, 8e-3, 1.6e-2)


def fullsync(
    stages: int,
    m: int = 4,
    lrs: tuple[float, ...] = FULLSYNC_LRS,
    optimizer: str | None = None,
) -> Arm:
    """FullSync (GPipe, M microbatches an update), with AdamW or, to hold the optimizer fixed
    against an async arm that changes it, with that arm's optimizer ("FullSync muon")."""
    ov = {
        **METHODS["FullSync"],
        "grid.stages": stages,
        "grid.replicas": 1,
        "pipeline.microbatches": m,
        "pipeline.codec": "bf16",
        "sentinel.enabled": False,
        "optim.depth_rule": "off",
    }
    name = FULLSYNC if m == 4 else f"{FULLSYNC} M={m}"
    if optimizer is not None:
        ov["optim.name"] = optimizer
        name = f"{name} {optimizer}"
    return Arm(name, ov, lrs, microbatches_per_update=m, muon=optimizer == "muon")


# each lever: (name, what it sets on the reference, its lr grid, Muon's lr follows, tuned)
LEVERS: list[tuple[str, dict[str, Any], tuple[float, ...], bool, bool]] = [
    ("lr correction", {"optim.delay_lr_share": 0.5}, (1e-3, 2e-3, 4e-3), False, True),
    # beta1 0.99 is a setting counted in updates (a memory of ~100 of the paper's 30k); at our
    # horizons the convergence study's async arm gained most from 0.95 (results/convergence)
    ("beta1 0.95", {"optim.beta1": 0.95}, (1e-3, 2e-3, 4e-3), False, True),
    ("muon", {"optim.name": "muon"}, (1e-3, 2e-3, 4e-3), True, True),
    # a lower momentum for stale gradients (Mitliagkas et al. 2016: asynchrony acts as momentum
    # of its own); screened at Muon's best lr and either side of it
    (
        "muon momentum 0.9",
        {"optim.name": "muon", "optim.muon_momentum": 0.9},
        (5e-4, 1e-3, 2e-3),
        True,
        True,
    ),
    ("rotated", {"optim.name": "rotated_adam"}, (2e-3, 4e-3, 8e-3), False, True),
    (
        "adaptive momentum",
        {"optim.beta1": 0.9, "optim.adaptive_momentum": True},
        (1e-3, 2e-3, 4e-3),
        False,
        True,
    ),
    # the decay phase and weight prediction refine the reference: screened at its lrs (its
    # best at P = 8 and the next one up: 1e-3 and 2e-3 on the 16-block model)
    ("cosine to 0", {"optim.min_lr_ratio": 0.0}, (1e-3, 2e-3), False, False),
    ("mu cap 0.9", {"optim.mu_cap": 0.9}, (1e-3, 2e-3), False, False),
    ("prediction", {"pipeline.weight_prediction": 1.0}, (1e-3,), False, False),
    (
        "rotated SA",
        {"optim.name": "rotated_adam", "optim.stage_aware": True},
        (2e-3,),
        False,
        False,
    ),
]


def reference(stages: int) -> Arm:
    return Arm(REFERENCE, _async(stages), REFERENCE_LRS)


def lever_arm(
    stages: int, name: str, lever: dict[str, Any], lrs: tuple[float, ...], muon: bool, tune: bool
) -> Arm:
    return Arm(name, {**_async(stages), **lever}, lrs, muon=muon, lever=dict(lever), tune=tune)


def two_bw(stages: int, m: int) -> Arm:
    """PipeDream-2BW: one update every M >= P microbatches, every stage one update stale, with
    Muon and error feedback (arXiv 2606.30634's recipe)."""
    lever = {
        "pipeline.schedule": "2bw",
        "pipeline.microbatches": m,
        "optim.name": "muon",
        "optim.error_feedback": True,
    }
    return Arm(
        f"2bw muon EF M={m}",
        {**_async(stages), **lever},
        (4e-3, 8e-3),
        microbatches_per_update=m,
        muon=True,
        lever=lever,
    )


def screen_arms(stages: int) -> list[Arm]:
    """Every arm of the screen at depth `stages` in the order they run (a screen stopped part
    way has the likeliest ones): the baselines, the levers, then 2BW and its FullSync at the same
    M (M >= P: it halves the updates against FullSync's 4 at P = 8) and FullSync with Muon."""
    m = max(8, stages)
    return [
        reference(stages),
        fullsync(stages),
        *(lever_arm(stages, *lv) for lv in LEVERS),
        two_bw(stages, m),
        fullsync(stages, m, (8e-3, 1.6e-2)),
        # the optimizer held fixed: Muon on the synchronous pipeline too (the async arm's
        # Muon gains at P = 1 as much as at depth: results/optimizers)
        fullsync(stages, 4, (2e-3, 4e-3), "muon"),
    ]


def fixed_lrs(arm: Arm, lrs: tuple[float, ...]) -> Arm:
    """The arm screened at these lrs only (no widening: a refinement run where its parts are
    tuned)."""
    return Arm(
        arm.name, arm.overrides, lrs, arm.microbatches_per_update, arm.muon, arm.lever, False
    )


def depth_candidates(stages: int) -> list[Arm]:
    """Candidates screened at their own depth beside the P = 8 picks (none below P = 16). At
    P = 16 stage 0 applies gradients 15 updates stale, and P = 8's best (the lr correction)
    ends 8% behind FullSync on the tuning seed: a longer correction (to the run's end, or
    never released whole at a larger lr), the levers P = 8 ranked
    next on top of it, the one-step delay (2BW with Muon and error feedback, M = P) and
    FullSync at that M (2BW's update count)."""
    if stages < 16:
        return []
    by = {name: lever_arm(stages, name, *rest) for name, *rest in LEVERS}
    lrc = by["lr correction"]
    longer = lever_arm(
        stages, "lr correction share 1", {"optim.delay_lr_share": 1.0}, (1e-3,), False, False
    )
    # never released whole (stage j ends at lr / delta_j^0.5): a larger lr for the fresh
    # stages than the stale ones keep
    kept = lever_arm(
        stages, "lr correction share 2", {"optim.delay_lr_share": 2.0}, (2e-3, 4e-3), False, False
    )
    on_lrc = [combine(stages, lrc, by[n]) for n in ("beta1 0.95", "prediction")]
    # Muon on top of the correction: level with FullSync at 1e-3 on the tuning seed (1.785
    # against 1.782), so its lr is tuned inside its grid like a pick's
    with_muon = combine(stages, lrc, by["muon"])
    assert with_muon is not None
    return [
        longer,
        kept,
        *(fixed_lrs(a, (1e-3,)) for a in on_lrc if a is not None),
        Arm(with_muon.name, with_muon.overrides, (5e-4, 1e-3, 2e-3), 1, True, with_muon.lever),
        fixed_lrs(two_bw(stages, stages), (4e-3,)),
        fixed_lrs(fullsync(stages, stages, (8e-3,)), (8e-3,)),
    ]


# a recommended arm with one of these optimizers also meets FullSync running it
SAME_OPTIMIZER_BASELINE = ("muon", "rotated_adam")


def same_optimizer_of(p: int, arm: Arm) -> Arm | None:
    """FullSync with `arm`'s optimizer where the arm changes it (None: it keeps NAdamW, and
    FullSync's AdamW is its baseline)."""
    optimizer = arm.lever.get("optim.name")
    if optimizer not in SAME_OPTIMIZER_BASELINE:
        return None
    return same_optimizer_fullsync(p, arm, optimizer)


def same_optimizer_fullsync(p: int, arm: Arm, optimizer: str) -> Arm:
    """FullSync with the arm's optimizer, its lr grid the arm's and twice each (FullSync takes
    a quarter of the updates, each of 4 microbatches: it wants larger lrs, as AdamW's grid is
    4x the reference's; with Muon at P = 16 its best sat at twice the async arm's grid top)."""
    lrs = tuple(sorted({*arm.lrs, *(2 * lr for lr in arm.lrs)}))
    return fullsync(p, 4, lrs, optimizer)


def combine(stages: int, a: Arm, b: Arm) -> Arm | None:
    """The two levers together (None when they set one key two ways, muon and rotated_adam, or
    when one holds the other),
    named in the screen's order whichever ranked first, so one combination has one name."""
    order = [name for name, *_ in LEVERS]
    if a.name in order and b.name in order and order.index(b.name) < order.index(a.name):
        a, b = b, a
    clash = {k for k in a.lever.keys() & b.lever.keys() if a.lever[k] != b.lever[k]}
    if clash or a.microbatches_per_update != b.microbatches_per_update:
        return None
    lever = {**a.lever, **b.lever}
    if lever in (a.lever, b.lever):  # one holds the other (muon, muon at momentum 0.9)
        return None
    lrs = tuple(sorted({*a.lrs, *b.lrs}))
    return Arm(
        f"{a.name} + {b.name}",
        {**_async(stages), **lever},
        lrs,
        microbatches_per_update=a.microbatches_per_update,
        muon=a.muon or b.muon,
        lever=lever,
    )


SCREEN_P = 8
TUNE_SEED = 100
LONG_FACTOR = 4  # the long run's tokens against a study run's (6.5M tokens)
LONG_SEEDS = 2  # the report seeds the long run takes (the first of them)
# the width check: the boundary study's d 192 x 8 Llama at P = 8, whose reference and FullSync
# lrs are tuned there (results/boundary-d192: its runs are reused by their fingerprints)
WIDTH = 192
WIDTH_LAYERS = 8
WIDTH_PREFIX = "d192 "


def label(stages: int, arm: str, lr: float | None = None) -> str:
    """A run's label: "P8 muon lr=0.002" (a sweep's) or "P8 muon" (a reported seed's)."""
    return f"P{stages} {arm}" + ("" if lr is None else f" lr={lr:g}")


def shipped_arm(p: int) -> Arm | None:
    """The arm `optim.depth_rule` ships at depth p: the lever, or two levers combined, whose
    settings are the rule's, its lr aside (the study tunes it); None where no rule holds."""
    rule = rule_for(p, "async")
    if rule is None:
        return None
    want = {f"optim.{k}": v for k, v in rule.settings.items() if k not in ("lr", "muon_lr")}
    levers = [lever_arm(p, *lv) for lv in LEVERS]
    pairs = [combine(p, a, b) for i, a in enumerate(levers) for b in levers[i + 1 :]]
    return next((a for a in [*levers, *pairs] if a is not None and a.lever == want), None)


def rule_lr(p: int) -> float:
    """The lr a user's async pipeline of depth p trains at without flags: the rule's where it
    sets one, else the schema's (Muon's matrices at the rule's muon_lr, which the study's
    arms tie to it: MUON_LR_FACTOR x lr)."""
    from mesh.config_sections import OptimConfig

    rule = rule_for(p, "async")
    default = OptimConfig.model_fields["lr"].default
    lr = float(rule.settings.get("lr", default)) if rule is not None else default
    if rule is not None and "muon_lr" in rule.settings:
        assert math.isclose(rule.settings["muon_lr"], MUON_LR_FACTOR * lr), rule
    return lr


def at_rule_lr(ship: Arm, p: int, tuned: dict[str, dict[str, Any]]) -> Arm:
    """The shipped arm as a user gets it: where the study tuned it to another lr than the
    rule's (rule_lr), the same settings at the rule's lr alone, named so ("... at lr 0.001"),
    so that the arm named `recommended` is what ships and the tuned one keeps its own row."""
    lr = rule_lr(p)
    best = tuned.get(label(p, ship.name), {}).get("best_lr")
    if best is None or math.isclose(best, lr):
        return ship
    return replace(fixed_lrs(ship, (lr,)), name=f"{ship.name} at lr {lr:g}")


def spec(
    arm: Arm, stages: int, seed: int, lr: float, sweep: bool, prefix: str = "", study: str = "depth"
) -> Spec:
    """A run of `arm` at depth `stages` (prefix: "d192 " for the width check; study
    "depth-long": the run at LONG_FACTOR x the tokens)."""
    return Spec(
        study,
        prefix + label(stages, arm.name, lr if sweep else None),
        seed,
        arm.microbatches_per_update,
        tuple(arm.at(lr).items()),
    )


def at_depth(arm: Arm, stages: int) -> Arm:
    """The same candidate at another depth (its overrides rebuilt for P = stages)."""
    if arm.name == REFERENCE:
        return reference(stages)
    if arm.name.startswith(FULLSYNC):
        name = arm.overrides.get("optim.name", "adamw")
        optimizer = None if name == "adamw" else name
        return fullsync(stages, arm.microbatches_per_update, arm.lrs, optimizer)
    ov = {**arm.overrides, "grid.stages": stages}
    if arm.overrides.get("pipeline.schedule") == "2bw":  # M >= P
        m = max(arm.microbatches_per_update, stages)
        ov["pipeline.microbatches"] = m
        return Arm(arm.name, ov, arm.lrs, m, arm.muon, {**arm.lever, "pipeline.microbatches": m})
    return Arm(arm.name, ov, arm.lrs, arm.microbatches_per_update, arm.muon, arm.lever)


def settings_of(base: Config, arm: Arm, stages: int, lr: float, microbatches: int) -> list[str]:
    """The `key=value` settings that reproduce an arm with `meshtrain simulate --backend
    logical --set ...`: every key the run's config holds away from the defaults, the seed
    aside (model, data, grid, steps, the schedules' shares, optimizer, lr)."""
    run = spec_config(base, spec(arm, stages, 0, lr, False), microbatches)
    default = load_config([], []).model_dump(mode="json")
    have = run.model_dump(mode="json")
    out = []
    for section, values in have.items():
        for key, value in values.items():
            if section == "run" and key == "seed":
                continue
            if f"{section}.{key}" in ALWAYS_SAID or default.get(section, {}).get(key) != value:
                out.append(f"{section}.{key}={_toml(value)}")
    return sorted(out)


# said even at their defaults: what a reader looks for first in an arm's settings
ALWAYS_SAID = {
    "grid.stages",
    "grid.replicas",
    "run.steps",
    "pipeline.schedule",
    "optim.name",
    "optim.lr",
    "model.d_model",
    "model.n_layers",
}


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "[" + ", ".join(_toml_item(v) for v in value) + "]"
    return repr(value)


def _toml_item(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else _toml(value)
