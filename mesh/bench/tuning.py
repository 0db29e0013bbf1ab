"""`meshtrain bench convergence --tune`: the same tuning budget for both arms of the headline
claim (AsyncMesh-fp8 within 1% of FullSync), picked by the same rule.

Every arm goes through the same stages, each run at the study's own budget (1,600 microbatches
per replica) on TUNE_SEEDS: learning rates (FullSync 5; AsyncMesh-fp8 2, then at the better one
tau 2 and tau 10 and clip 10: a coordinate search over the issue's tau {2, 5, 10} x clip {1, 10},
and the schedule-clock probe), then beta1 and the lr again (x0.75, x1.5, and on while the best
lr is the edge of those tried) for both arms, and for the async arm the pipeline's staleness
corrections (AsyncPP's per-stage lr correction, at the lr and x1.5; weight prediction). The
rule: lowest mean final validation loss over the seeds; a diverged run counts as infinite. Last,
each arm's CONFIRM_TOP best settings run on CONFIRM_SEEDS as well and the pick is the best mean
over both seeds among them. The other async
methods are AsyncMesh with one thing changed, so they share its setting. The stages run on one
seed, because a run costs about 2 core-minutes here.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from mesh.bench import simruns
from mesh.bench.simruns import Spec, run_specs
from mesh.config import Config, ConfigError
from mesh.methods import METHODS
from mesh.report import format_table

# Where the studies read the tuned settings (written by --tune; committed with the results)
TUNING_FILE = Path("results/convergence/tuning.json")
# What a study uses without a tuning file (a --quick run, a fresh checkout's tests): the
# untuned lrs of the earlier sweep (lr_sweep.md), tau 5 and clip 1
DEFAULT_TUNED: dict[str, dict[str, Any]] = {
    "FullSync": {"optim.lr": 6e-3},
    "AsyncMesh-fp8": {"optim.lr": 2e-3},
}
TUNE_SEEDS = [0]
FULLSYNC_LRS = [3e-3, 4e-3, 6e-3, 8e-3, 1e-2]
ASYNC_LRS = [1e-3, 2e-3]
# the second stage, each at the async arm's best lr
ASYNC_STAGE2 = [{"dp.tau": 2}, {"dp.tau": 10}, {"optim.grad_clip": 10.0}]
# the third stage, at the async arm's best so far: the paper's settings as it counts them (psi
# 0.004 per update, lambda on the steps clock) against their shares of the run (the studies'
# default, mesh/bench/simruns.py). Which the study uses is this stage's answer.
SCHEDULE_PROBE = [
    {"optim.momentum_decay": 0.004},
    {"dp.lambda_clock": "steps"},
    {"optim.momentum_decay": 0.004, "dp.lambda_clock": "steps"},
]
# the fourth stage, for both arms at their best so far: beta1, the momentum's memory. It is a
# setting counted in updates too: NAdamW's 0.99 remembers ~100 updates, 0.3% of the paper's 30k
# but 6% of this study's 1,600, so a look-ahead built for long runs points where the weights were
# long ago (AdamW's default 0.9 is FullSync's, which takes 400 updates)
MOMENTUM_PROBE = {"FullSync": [0.8, 0.95], "AsyncMesh-fp8": [0.9, 0.95]}
# the fifth stage, for both arms: the lr again, x0.75 and x1.5, at the best momentum
LR_REFINE = [0.75, 1.5]
# the sixth stage, for the async arm at its best so far: the pipeline's staleness corrections
# (FullSync's flushed pipeline has no delay for them to correct). AsyncPP's lr correction (a
# stage with delay d starts at lr / d, full lr from half the run) at the lr and at x1.5, since
# what it buys is stability at a larger lr; and weight prediction over half the delay.
STALENESS_PROBE = [
    {"optim.delay_lr_share": 0.5},
    {"optim.delay_lr_share": 0.5, "lr_factor": 1.5},
    {"pipeline.weight_prediction": 0.5},
]
EDGE_STEPS = 2
# the last stage: each arm's CONFIRM_TOP best settings on one seed more; the pick is the lowest
# mean over both seeds among them (a single seed's ranking of settings 0.01-0.03 apart is noise:
# the seeds of one setting differ by as much)
CONFIRM_TOP = 3
CONFIRM_SEEDS = [1]
ARMS = ("FullSync", "AsyncMesh-fp8")
# What every run of the study and its tuning pins: the partition selector's coordinate map the
# tuning was run with (dp.index_map's default became "keyed" after it; the two maps pick other
# coordinates, so a keyed run is another run: the tuned settings and the study's run cache are
# the permutation map's)
STUDY_PINS: dict[str, Any] = {"dp.index_map": "permutation"}


def check_held_out(evaluation: list[int], tuning: list[int], what: str = "--seeds") -> None:
    """The evaluation seeds must be seeds the tuning never used: a ConfigError naming the
    seeds both sets hold (a tuned setting scored on its own tuning seeds is flattered)."""
    both = sorted(set(evaluation) & set(tuning))
    if both:
        raise ConfigError(
            f"{what} {','.join(map(str, evaluation))}: seed{'s' * (len(both) > 1)} "
            f"{','.join(map(str, both))} also tuned the settings (tuning seeds "
            f"{','.join(map(str, sorted(set(tuning))))}); evaluate on seeds the tuning never used"
        )


def tuning_seeds(path: Path = TUNING_FILE) -> list[int]:
    """The seeds a committed tuning ran on (its stages' and its confirmation's); none without a
    tuning file or with a --quick one (the study then runs untuned)."""
    if not path.is_file():
        return []
    summary = json.loads(path.read_text())
    if summary.get("quick"):
        return []
    return sorted({*summary.get("seeds", []), *summary.get("confirm_seeds", [])})


def _spec(arm: str, settings: dict[str, Any], seed: int) -> Spec:
    ov = dict(METHODS[arm])
    ov.update({"grid.stages": 4, "grid.replicas": 2, "pipeline.microbatches": 4, **STUDY_PINS})
    ov.update(settings)
    label = ", ".join(f"{k.split('.')[-1]}={_fmt(v)}" for k, v in sorted(settings.items()))
    return Spec("tune", f"{arm} | {label}", seed, 4 if arm == "FullSync" else 1, tuple(ov.items()))


def _fmt(value: Any) -> str:
    return f"{value:g}" if isinstance(value, int | float) else str(value)


def mean_loss(runs: list[dict[str, Any]]) -> float:
    """The rule's score: mean final validation loss; any diverged run makes it infinite."""
    vals = [r["val_loss"] for r in runs]
    if any(v is None or not math.isfinite(v) for v in vals):
        return math.inf
    return statistics.mean(vals)


def ranked(runs: list[dict[str, Any]], arm: str, seeds: list[int] | None = None) -> list[str]:
    """The arm's settings (run names), best first by the rule; with `seeds`, only the settings
    run on every one of them, scored on those seeds alone."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        if r["method"].startswith(arm + " |") and (seeds is None or r["seed"] in seeds):
            groups.setdefault(r["method"], []).append(r)
    if seeds is not None:
        groups = {k: g for k, g in groups.items() if {r["seed"] for r in g} >= set(seeds)}
    return sorted(groups, key=lambda k: mean_loss(groups[k]))


def best_settings(
    runs: list[dict[str, Any]], arm: str, seeds: list[int] | None = None
) -> tuple[dict[str, Any], float]:
    """The arm's best settings by the rule (on `seeds` only, when given) and their score."""
    name = ranked(runs, arm, seeds)[0]
    group = [r for r in runs if r["method"] == name and (seeds is None or r["seed"] in seeds)]
    return group[0]["settings"], mean_loss(group)


def _run(
    base: Config,
    specs: list[tuple[Spec, dict[str, Any]]],
    out: Path,
    workers: int,
    budget: int,
    known: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    runs = run_specs(base, [s for s, _ in specs], {"tune": budget}, out, workers, "tuning", known)
    settings = {s.method: st for s, st in specs}
    for r in runs:
        r["settings"] = settings[r["method"]]
    return runs


def _specs(
    settings: list[tuple[str, dict[str, Any]]], seeds: list[int]
) -> list[tuple[Spec, dict[str, Any]]]:
    """(arm, settings) on every tuning seed: each spec with the settings it carries."""
    return [(_spec(arm, st, seed), st) for arm, st in settings for seed in seeds]


def _momentum_stage(arm: str, so_far: dict[str, Any]) -> list[dict[str, Any]]:
    return [{**so_far, "optim.beta1": b} for b in MOMENTUM_PROBE[arm]]


def _lr_stage(arm: str, so_far: dict[str, Any]) -> list[dict[str, Any]]:
    return [{**so_far, "optim.lr": round(so_far["optim.lr"] * f, 6)} for f in LR_REFINE]


def _staleness_stage(so_far: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for change in STALENESS_PROBE:
        st = {**so_far, **{k: v for k, v in change.items() if k != "lr_factor"}}
        if "lr_factor" in change:
            st["optim.lr"] = round(so_far["optim.lr"] * change["lr_factor"], 6)
        out.append(st)
    return out


def _edge_step(runs: list[dict[str, Any]], arm: str, seeds: list[int]) -> dict[str, Any] | None:
    """The next lr to try for the arm when its best lr so far lies at the edge of those tried
    at the same other settings on the tuning seeds (None: it does not)."""
    best, _ = best_settings(runs, arm, seeds)
    others = {k: v for k, v in best.items() if k != "optim.lr"}
    lrs = {
        r["settings"]["optim.lr"]
        for r in runs
        if r["method"].startswith(arm + " |")
        and {k: v for k, v in r["settings"].items() if k != "optim.lr"} == others
    }
    lr = best["optim.lr"]
    if lr == max(lrs):
        return {**best, "optim.lr": round(lr * LR_REFINE[-1], 6)}
    if lr == min(lrs):
        return {**best, "optim.lr": round(lr * LR_REFINE[0], 6)}
    return None


def run_tuning(
    base: Config,
    out: Path,
    quick: bool,
    workers: int,
    seeds: list[int] | None = None,
    confirm_seeds: list[int] | None = None,
) -> dict[str, Any]:
    """The stages on `seeds` (default TUNE_SEEDS), the confirmation on `confirm_seeds` (default
    CONFIRM_SEEDS); tuning.json and tuning.md go to `out` (the convergence study's)."""
    seeds = TUNE_SEEDS if seeds is None else seeds
    confirm_seeds = CONFIRM_SEEDS if confirm_seeds is None else confirm_seeds
    budget = simruns.QUICK_MICROBATCHES if quick else 1600
    path = out / "tuning.json"
    # an earlier tuning's runs, and the study's own (its arms at the tuned settings on the
    # tuning seeds), are reused wherever their config is the same
    known = [*known_runs(path), *known_runs(out / "summary.json")]
    work = out / "tuning"
    stage1 = [("FullSync", {"optim.lr": lr}) for lr in FULLSYNC_LRS]
    stage1 += [("AsyncMesh-fp8", {"optim.lr": lr}) for lr in ASYNC_LRS]
    specs = _specs(stage1, seeds)
    runs = _run(base, specs, work, workers, budget, known)
    # stages 2 and 3, each on top of the async arm's best so far
    for changes in (ASYNC_STAGE2, SCHEDULE_PROBE):
        so_far, _ = best_settings(runs, "AsyncMesh-fp8", seeds)
        specs += _specs([("AsyncMesh-fp8", {**so_far, **ov}) for ov in changes], seeds)
        runs = _run(base, specs, work, workers, budget, known)
    # stages 4 and 5, for both arms on top of each one's best so far
    for stage in (_momentum_stage, _lr_stage):
        tried = [(arm, st) for arm in ARMS for st in stage(arm, best_settings(runs, arm, seeds)[0])]
        have = {s.method for s, _ in specs}  # an lr x1.5 may be one stage 1 tried already
        specs += [(s, st) for s, st in _specs(tried, seeds) if s.method not in have]
        runs = _run(base, specs, work, workers, budget, known)
    # stage 6: the async arm's staleness corrections
    so_far, _ = best_settings(runs, "AsyncMesh-fp8", seeds)
    have = {s.method for s, _ in specs}
    tried = _specs([("AsyncMesh-fp8", st) for st in _staleness_stage(so_far)], seeds)
    specs += [(s, st) for s, st in tried if s.method not in have]
    runs = _run(base, specs, work, workers, budget, known)
    # an arm whose best lr is the largest (smallest) it tried at its other settings steps on
    # (x1.5, x0.75) until it is not, at most EDGE_STEPS times: a best at the range's edge
    # says the range was too short, for either arm
    for _ in range(EDGE_STEPS):
        tried = [(arm, st) for arm in ARMS if (st := _edge_step(runs, arm, seeds)) is not None]
        if not tried:
            break
        specs += _specs(tried, seeds)
        runs = _run(base, specs, work, workers, budget, known)
    # the last stage: the top settings of each arm on the confirmation seeds too
    settings = {s.method: st for s, st in specs}
    top = [name for arm in ARMS for name in ranked(runs, arm, seeds)[:CONFIRM_TOP]]
    specs += [
        (_spec(name.split(" | ")[0], settings[name], seed), settings[name])
        for name in top
        for seed in confirm_seeds
    ]
    runs = _run(base, specs, work, workers, budget, known)
    best = {arm: best_settings(runs, arm, seeds + confirm_seeds) for arm in ARMS}
    summary = {
        "microbatches_per_replica": budget,
        "seeds": seeds,
        "confirm_seeds": confirm_seeds,
        "confirm_top": CONFIRM_TOP,
        "quick": quick,
        "best": {arm: {"settings": st, "val_loss": v} for arm, (st, v) in best.items()},
        "runs": runs,
    }
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1))
    (work / "runs.partial.jsonl").unlink()
    work.rmdir()
    write_table(summary, out / "tuning.md")
    return summary


def write_table(summary: dict[str, Any], path: Path) -> None:
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in summary["runs"]:
        groups.setdefault(r["method"], []).append(r)
    rows = []
    for name, rs in groups.items():
        arm, label = name.split(" | ")
        loss = mean_loss(rs)
        per_seed = " / ".join("div" if r["diverged"] else f"{r['val_loss']:.4f}" for r in rs)
        clip = statistics.mean(r.get("clip_rate", math.nan) for r in rs)
        shown = "diverged" if math.isinf(loss) else f"{loss:.4f}"
        rows.append([arm, label, shown, per_seed, f"{clip:.1%}"])
    best = summary["best"]
    lines = [
        "# Tuning the two arms of the headline claim",
        "",
        f"4x2 grid, {summary['microbatches_per_replica']} microbatches per replica, seeds "
        f"{summary['seeds']}, each arm's best {summary.get('confirm_top', 0)} also on seeds "
        f"{summary.get('confirm_seeds', [])} (the pick: the best mean over all seeds among "
        "those); "
        + ", ".join(
            f"{arm} {sum(n.startswith(arm + ' |') for n in groups)} settings" for arm in ARMS
        )
        + " (the same lr, momentum and lr-refine stages for both; the async arm also its tau, "
        "clip, schedule-clock and staleness-correction stages); best = lowest mean final "
        "validation loss (mesh/bench/tuning.py). Clip rate: share of the cells' updates whose "
        "gradient norm was above the clip.",
        "",
        format_table(["arm", "setting", "val loss (mean)", "per seed", "clip rate"], rows),
        "",
        "Best: "
        + "; ".join(
            f"{arm} {', '.join(f'{k}={_fmt(v)}' for k, v in b['settings'].items())} "
            f"({b['val_loss']:.4f})"
            for arm, b in best.items()
        ),
    ]
    path.write_text("\n".join(lines) + "\n")


def load_tuned(path: Path = TUNING_FILE) -> tuple[dict[str, dict[str, Any]], bool]:
    """(each arm's best settings, whether they come from a full tuning run); DEFAULT_TUNED
    where there is no tuning file or only a --quick one."""
    if not path.is_file():
        return DEFAULT_TUNED, False
    summary = json.loads(path.read_text())
    if summary.get("quick"):
        return DEFAULT_TUNED, False
    return {arm: b["settings"] for arm, b in summary["best"].items()}, True


def method_overrides(method: str, tuned: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A DP method's settings with its arm's tuned ones: FullSync's for FullSync, AsyncMesh-
    fp8's for every async method (each is AsyncMesh with one thing changed). What the method
    pins itself wins (SPARTA's and DPAvg's tau = 0), except the lr, which is the arm's."""
    own = METHODS[method]
    ov = dict(own)
    for key, value in tuned["FullSync" if method == "FullSync" else "AsyncMesh-fp8"].items():
        if key == "optim.lr" or key not in own:
            ov[key] = value
    return ov


def known_runs(path: Path = TUNING_FILE) -> list[dict[str, Any]]:
    """The runs of a tuning.json or a study's summary.json (none if it is not there), for a
    study to reuse where their config is the same."""
    return json.loads(path.read_text())["runs"] if path.is_file() else []
