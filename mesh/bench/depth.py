"""`meshtrain bench depth`: what the async pipeline loses to FullSync with depth, and which lever
closes it, at equal tokens (docs/depth.md).

Every run is one replica's pipeline (grid P x 1) of a 16-block d 64 Llama on the Shakespeare
bytes (depth_arms.STUDY_DEFAULTS), 1,600 microbatches of 1,024 tokens (1.64M tokens), on the
logical simulator. The study runs in phases, each resumable (a finished run is kept in
out/runs.partial.jsonl and reused by its config's fingerprint):

1. the screen, at P = 8 on the tuning seed (TUNE_SEED, never reported): every arm of
   depth_arms.screen_arms at each lr of its grid; a grid whose best sits on an edge is widened
   by a factor of 2 past that edge (WIDEN times at most), so each pick is inside its grid;
2. the picks: the two levers with the lowest screen loss, and their combination (the next
   compatible pair where the best two set one key two ways), its lr swept the same way; the
   candidate with the lowest screen loss of the three is `recommended`;
3. the finals: at each P of STAGES (8 first, then 16, then 4), the recommended candidate, the
   reference and FullSync, then the other two picks, each swept on the tuning seed at that P
   (around its P = 8 lr) and run on the report seeds. Gaps are paired by seed against FullSync,
   as a share of FullSync's loss, with their t intervals.

4. the long run: the recommended arm and FullSync at LONG_FACTOR x the tokens, P = 8, the first
   LONG_SEEDS report seeds;
5. the width check: the recommended arm at d 192 x 8, P = 8, its lr swept on the tuning seed,
   against the reference and FullSync at the lrs the boundary study tuned there (its runs are
   reused from results/boundary-d192 by their fingerprints).

--phase stops after a phase, so the next invocation goes on from there.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from mesh.bench import depth_arms
from mesh.bench.boundary import WIDTHS
from mesh.bench.depth_arms import (  # noqa: F401 - the study's names, used by its tests
    FULLSYNC,
    LONG_FACTOR,
    LONG_SEEDS,
    REFERENCE,
    SCREEN_P,
    TUNE_SEED,
    WIDTH,
    WIDTH_LAYERS,
    WIDTH_PREFIX,
    Arm,
    at_depth,
    at_rule_lr,
    label,
    rule_lr,
    same_optimizer_fullsync,
    same_optimizer_of,
    settings_of,
    shipped_arm,
    spec,
)
from mesh.bench.regime import data_reference, rule_fields
from mesh.bench.simruns import Spec, read_runs, run_specs
from mesh.config import Config, ConfigError

STAGES = (8, 16, 4)  # the order the finals run in: the target's depth first
QUICK_STAGES = (2, 4)
REPORT_SEEDS = [0, 1]
MICROBATCHES = 1600  # per run: 1.64M tokens of 1,024 a microbatch
QUICK_MICROBATCHES = 24
WIDEN = 2  # how many times a grid whose best is on its edge is widened past it
PHASES = ("screen", "picks", "finals", "long", "width")
WIDTH_TUNED = {REFERENCE: 5e-4, FULLSYNC: 1e-3}
WIDTH_KNOWN = Path("results/boundary-d192/summary.json")


def _loss(r: dict[str, Any]) -> float:
    v = r.get("val_loss")
    return math.inf if r.get("diverged") or v is None or not math.isfinite(v) else float(v)


def wider(lrs: tuple[float, ...], losses: dict[float, float]) -> float | None:
    """The lr to try next when the best of `losses` sits on an edge of the grid tried (half the
    lowest, twice the highest); None when the best is inside (or nothing finished)."""
    tried = sorted(lr for lr in lrs if lr in losses)
    if len(tried) < 2 or not any(math.isfinite(v) for v in losses.values()):
        return None
    best = min(tried, key=lambda lr: losses[lr])
    if best == tried[0]:
        return tried[0] / 2
    if best == tried[-1]:
        return tried[-1] * 2
    return None


class Study:
    """One invocation's runs: where they go, how many at once, what is reused."""

    def __init__(
        self, base: Config, out: Path, workers: int, microbatches: int, report_only: bool
    ) -> None:
        self.base, self.out, self.workers = base, out, workers
        self.budget = {"depth": microbatches, "depth-long": LONG_FACTOR * microbatches}
        self.report_only = report_only
        self.runs: dict[str, dict[str, Any]] = {}  # by label and seed
        # the runs an earlier invocation's summary holds (its runs.partial.jsonl is gone once
        # the study completed)
        old = out / "summary.json"
        self.known = json.loads(old.read_text()).get("runs", []) if old.is_file() else []

    def run(self, specs: list[Spec], desc: str, base: Config | None = None) -> list[dict[str, Any]]:
        done = run_specs(
            base or self.base,
            specs,
            self.budget,
            self.out,
            self.workers,
            desc,
            self.known,
            report_only=self.report_only,
        )
        for r in done:
            self.runs[f"{r['study']}|{r['method']}|{r['seed']}"] = r
        return done

    def all_runs(self) -> list[dict[str, Any]]:
        """Every run the study's folder knows: this call's, its summary's and its partial
        file's, once each. The summary keeps them all: a call for some depths (--stages 4)
        must not drop the others' runs, which it then finds neither there nor in the partial
        file it removes."""
        out: dict[tuple[Any, Any], dict[str, Any]] = {}
        partial = read_runs(self.out / "runs.partial.jsonl")
        ours = [r for r in [*self.known, *partial] if r.get("study") in self.budget]
        for r in [*ours, *self.runs.values()]:  # (another study's runs a sweep reused: theirs)
            out[(r.get("study"), r.get("microbatches"), r.get("config_fingerprint"))] = r
        return sorted(out.values(), key=lambda r: (r["method"], r["seed"]))

    def get(self, name: str, seed: int) -> dict[str, Any] | None:
        return self.runs.get(f"depth|{name}|{seed}")

    def get_long(self, name: str, seed: int) -> dict[str, Any] | None:
        return self.runs.get(f"depth-long|{name}|{seed}")

    def sweep(
        self,
        arms: list[tuple[Arm, int, tuple[float, ...]]],
        desc: str,
        base: Config | None = None,
        prefix: str = "",
    ) -> dict[str, Any]:
        """Each (arm, P, lrs) on the tuning seed, widened where the best sits on an edge:
        {"P8 arm": {"lrs": {lr: loss}, "best_lr": lr, "best_loss": loss}} (best_lr None where
        nothing has finished)."""
        grids = {(a.name, p): (a, p, list(lrs)) for a, p, lrs in arms}
        for widened in range(WIDEN + 1):
            specs = [
                spec(a, p, TUNE_SEED, lr, True, prefix)
                for a, p, lrs in grids.values()
                for lr in lrs
            ]
            self.run(specs, desc, base)
            if widened == WIDEN:
                break
            grown = False
            for a, p, lrs in grids.values():
                more = wider(tuple(lrs), self._losses(a, p, lrs, prefix)) if a.tune else None
                if more is not None and more not in lrs:
                    lrs.append(more)
                    grown = True
            if not grown:
                break
        out = {}
        for a, p, lrs in grids.values():
            losses = self._losses(a, p, lrs, prefix)
            finite = {lr: v for lr, v in losses.items() if math.isfinite(v)}
            best = min(finite, key=finite.__getitem__) if finite else None
            out[prefix + label(p, a.name)] = {
                "arm": a.name,
                "P": p,
                "lrs": {f"{lr:g}": losses.get(lr) for lr in sorted(lrs)},
                "best_lr": best,
                "best_loss": None if best is None else finite[best],
                # None: screened at fixed lrs (Arm.tune off), no claim of an optimum
                "inside": (
                    best is not None
                    and len(losses) == len(lrs)
                    and wider(tuple(lrs), losses) is None
                )
                if a.tune
                else None,
            }
        return out

    def _losses(self, a: Arm, p: int, lrs: list[float], prefix: str = "") -> dict[float, float]:
        got = {lr: self.get(prefix + label(p, a.name, lr), TUNE_SEED) for lr in lrs}
        return {lr: _loss(r) for lr, r in got.items() if r is not None}


def picks(screen: dict[str, Any], stages: int = SCREEN_P) -> list[Arm]:
    """The two levers with the lowest screen loss (baselines aside), best first."""
    baseline = {REFERENCE, FULLSYNC}
    arms = {a.name: a for a in depth_arms.screen_arms(stages)}
    ranked = sorted(
        (row["best_loss"], row["arm"])
        for row in screen.values()
        if row["best_loss"] is not None
        and row["arm"] in arms
        and row["arm"] not in baseline
        and arms[row["arm"]].lever  # not FullSync at 2BW's M
    )
    return [arms[name] for _, name in ranked[:2]]


def combination(screen: dict[str, Any], stages: int = SCREEN_P) -> Arm | None:
    """The combination of the two best levers that can be combined (in screen order)."""
    baseline = {REFERENCE, FULLSYNC}
    arms = {a.name: a for a in depth_arms.screen_arms(stages)}
    ranked = [
        arms[name]
        for _, name in sorted(
            (row["best_loss"], row["arm"])
            for row in screen.values()
            if row["best_loss"] is not None
            and row["arm"] in arms
            and row["arm"] not in baseline
            and arms[row["arm"]].lever
        )
    ]
    for i, a in enumerate(ranked):
        for b in ranked[i + 1 :]:
            both = depth_arms.combine(stages, a, b)
            if both is not None:
                return both
    return None


def screen_arms_of(screen_p: int, levers: list[str] | None) -> list[Arm]:
    """The screen's arms: every one, or the baselines and `levers` (a user error names the
    arms there are)."""
    arms = depth_arms.screen_arms(screen_p)
    if levers is None:
        return arms
    unknown = set(levers) - {a.name for a in arms}
    if unknown:
        known = ", ".join(a.name for a in arms if a.name not in (REFERENCE, FULLSYNC))
        raise ConfigError(
            f"--levers: no arm named {', '.join(sorted(unknown))}; the screen's arms: {known}"
        )
    return [a for a in arms if a.name in (REFERENCE, FULLSYNC) or a.name in levers]


def picked(
    study: Study, screen_p: int, tuned: dict[str, dict[str, Any]]
) -> tuple[Arm | None, list[Arm]]:
    """The picks from the screen (`tuned` holds it; it gains the combination's sweep): the
    recommended candidate (None before any lever finished) and the finals' arms: it, the
    reference, FullSync (with its optimizer too where it changes it), then the other picks."""
    chosen = picks(tuned, screen_p)
    both = combination(tuned, screen_p)
    if both is not None:
        tuned.update(study.sweep([(both, screen_p, both.lrs)], "depth: the combination's lr"))
        chosen.append(both)
    ranked = sorted(
        (tuned[label(screen_p, a.name)]["best_loss"] or math.inf, a.name) for a in chosen
    )
    best = next((a for a in chosen if ranked and a.name == ranked[0][1]), None)
    if best is None:
        return None, []
    finals = [best, depth_arms.reference(screen_p), depth_arms.fullsync(screen_p)]
    # an arm that changes the optimizer meets FullSync with that optimizer too
    same = same_optimizer_of(screen_p, best)
    if same is not None:
        finals.append(same)
    return best, finals + [a for a in chosen if a is not best]


def _seed_specs(
    arm: Arm, p: int, seeds: list[int], tuned: dict[str, dict[str, Any]], study: str = "depth"
) -> list[Spec]:
    """The arm's runs on `seeds` at its tuned lr at depth p (none before it is tuned)."""
    lr = tuned.get(label(p, arm.name), {}).get("best_lr")
    return [] if lr is None else [spec(arm, p, s, lr, False, study=study) for s in seeds]


def finals_at_depth(
    study: Study, p: int, screen_p: int, finals: list[Arm], tuned: dict[str, dict[str, Any]]
) -> tuple[Arm, list[Arm]]:
    """At depth p: the finals' arms swept on the tuning seed (around their screen lr), the
    depth's own candidates screened beside them (depth_arms.depth_candidates), and the
    recommended one: at the screen's depth the screen's best, elsewhere the candidate with
    the lowest tuning-seed loss there. Returns it and the arms the report seeds run (the
    finals, and the recommended one with its same-optimizer FullSync where it is a depth's
    own). `tuned` gains the sweeps."""
    here = [at_depth(a, p) for a in finals]
    names = {a.name for a in here}
    own = [a for a in depth_arms.depth_candidates(p) if a.name not in names]
    untuned = [a for a in here if label(p, a.name) not in tuned]
    grids = [
        (a, p, around(tuned.get(label(screen_p, a.name), {}).get("best_lr"), a.lrs))
        for a in untuned
    ]
    grids += [(a, p, a.lrs) for a in own if label(p, a.name) not in tuned]
    if grids:
        tuned.update(study.sweep(grids, f"depth P={p}: lr sweeps"))
    if p == screen_p:
        return here[0], here
    candidates = [a for a in [*here, *own] if a.lever]  # the baselines aside
    ranked = sorted(
        (tuned.get(label(p, a.name), {}).get("best_loss") or math.inf, i)
        for i, a in enumerate(candidates)
    )
    best = candidates[ranked[0][1]] if ranked and math.isfinite(ranked[0][0]) else here[0]
    report = list(here)
    if best.name not in names:
        report.append(best)
        same = same_optimizer_of(p, best)
        if same is not None and same.name not in names:
            report.append(same)
    missing = [(a, p, a.lrs) for a in report if label(p, a.name) not in tuned]
    if missing:
        tuned.update(study.sweep(missing, f"depth P={p}: lr sweeps"))
    return best, report


def with_shipped(
    study: Study,
    p: int,
    seeds: list[int],
    finals: list[Arm],
    tuned: dict[str, dict[str, Any]],
    run: bool,
) -> tuple[Arm | None, list[Arm]]:
    """Depth p's shipped arm among its finals (swept and run on `seeds` too where `run`), and
    it if every report seed has it: the arm named `recommended` is what a user gets, whatever
    the study now picks (a pick that beats it is reported under its own name until the rule
    ships it)."""
    ship = shipped_arm(p)
    if ship is None:
        return None, finals
    if run and label(p, ship.name) not in tuned:
        tuned.update(study.sweep([(ship, p, ship.lrs)], f"depth P={p}: the shipped arm's lr"))
    ship = at_rule_lr(ship, p, tuned)  # tuned elsewhere: the same settings at the rule's lr
    if run and label(p, ship.name) not in tuned:
        tuned.update(study.sweep([(ship, p, ship.lrs)], f"depth P={p}: the shipped arm's lr"))
    if ship.name not in {a.name for a in finals}:
        finals = [*finals, ship]
    if run:
        study.run(_seed_specs(ship, p, seeds, tuned), f"depth P={p}: the shipped arm")
    have = label(p, ship.name) in tuned and all(
        study.get(label(p, ship.name), s) is not None for s in seeds
    )
    return (ship if have else None), finals


def around(lr: float | None, fallback: tuple[float, ...]) -> tuple[float, ...]:
    """A depth's first grid for an arm tuned at another: its lr there, half and twice it."""
    return fallback if lr is None else (lr / 2, lr, lr * 2)


def width_base(base: Config) -> Config:
    """The width check's model: d 192 x 8 blocks, the rest of the study's config as it is."""
    from mesh.config import with_overrides

    ov = dict(kv.split("=", 1) for kv in WIDTHS[WIDTH])
    ov["model.n_layers"] = str(WIDTH_LAYERS)
    return with_overrides(base, {k: int(v) for k, v in ov.items()})


def width_check(study: Study, best: Arm, seeds: list[int], lr_d64: float) -> dict[str, Any]:
    """The recommended arm at d 192 x 8, P = 8, against the reference and FullSync at their lrs
    tuned there: its own lr swept on the tuning seed around its d 64 lr moved as the reference's
    moved (d 192's reference takes half d 64's 8-block lr), then the report seeds."""
    base = width_base(study.base)
    old = json.loads(WIDTH_KNOWN.read_text()) if WIDTH_KNOWN.is_file() else {}
    study.known = [*study.known, *old.get("runs", []), *old.get("lr_sweep", [])]
    p = SCREEN_P
    tuned = study.sweep(
        [(best, p, around(lr_d64 / 2, best.lrs))],
        "depth d192: the recommended arm's lr",
        base,
        WIDTH_PREFIX,
    )
    lrs = {**WIDTH_TUNED, best.name: tuned[WIDTH_PREFIX + label(p, best.name)]["best_lr"]}
    arms = [best, depth_arms.reference(p), depth_arms.fullsync(p)]
    specs = [
        spec(a, p, s, lrs[a.name], False, WIDTH_PREFIX)
        for a in arms
        if lrs.get(a.name) is not None
        for s in seeds
    ]
    study.run(specs, "depth d192: report seeds", base)
    return {"lrs": lrs, "sweep": tuned}


def run_depth(
    base: Config,
    out: Path,
    quick: bool,
    workers: int,
    seeds: list[int] | None = None,
    stages: tuple[int, ...] | None = None,
    phase: str = "width",
    report_only: bool = False,
    levers: list[str] | None = None,
) -> dict[str, Any]:
    """The study up to and including `phase`, resumed from what out/ holds; writes summary.json,
    table.md and the plots from whatever has finished. levers: screen only these of the
    screen's arms (the baselines always; None: every arm): the picks are then made among them,
    and the summary says which were left out."""
    from mesh.bench.depth_report import summarize, write_outputs

    start = time.perf_counter()
    seeds = seeds or ([0] if quick else REPORT_SEEDS)
    stages = stages or (QUICK_STAGES if quick else STAGES)
    screen_p = stages[0] if quick else SCREEN_P
    mbs = QUICK_MICROBATCHES if quick else MICROBATCHES
    study = Study(base, out, workers, mbs, report_only)
    arms = screen_arms_of(screen_p, levers)
    screen = study.sweep([(a, screen_p, a.lrs) for a in arms], f"depth screen P={screen_p}")
    tuned: dict[str, dict[str, Any]] = dict(screen)
    best, finals_arms = picked(study, screen_p, tuned) if PHASES.index(phase) >= 1 else (None, [])
    best_at: dict[int, Arm] = {} if best is None else {screen_p: best}
    finals_at: dict[int, list[Arm]] = {}
    for p in stages if best is not None else ():
        if PHASES.index(phase) >= 2:
            best_at[p], finals_at[p] = finals_at_depth(study, p, screen_p, finals_arms, tuned)
            study.run(
                [s for a in finals_at[p] for s in _seed_specs(a, p, seeds, tuned)],
                f"depth P={p}: report seeds",
            )
        else:  # the finals' rows, not run yet
            best_at[p], finals_at[p] = at_depth(best, p), [at_depth(a, p) for a in finals_arms]
    picked_at = {str(p): a.name for p, a in best_at.items()}
    for p in finals_at:
        run = PHASES.index(phase) >= 2
        ship, finals_at[p] = with_shipped(study, p, seeds, finals_at[p], tuned, run)
        best_at[p] = ship or best_at[p]
    # the long run and the width check measure the recommended arm, the one that ships
    best = best_at.get(screen_p, best)
    long_arms: list[Arm] = []
    if PHASES.index(phase) >= 3 and best is not None:
        # the recommended arm and FullSync at 4x the tokens, P = 8, two seeds: does the gap
        # close, hold or grow with a longer run?
        # (and FullSync with its optimizer: the gap with the optimizer held fixed)
        same = same_optimizer_of(screen_p, best)
        long_arms = [best, depth_arms.fullsync(screen_p), *([same] if same else [])]
        study.run(
            [
                s
                for a in long_arms
                for s in _seed_specs(a, screen_p, seeds[:LONG_SEEDS], tuned, "depth-long")
            ],
            f"depth P={screen_p}: {LONG_FACTOR}x the tokens",
        )
    width: dict[str, Any] = {}
    if PHASES.index(phase) >= 4 and best is not None and not quick:
        width = width_check(study, best, seeds, tuned[label(screen_p, best.name)]["best_lr"])
    summary = summarize(
        base,
        study,
        screen_p,
        stages,
        seeds,
        tuned,
        best_at,
        finals_at,
        mbs,
        long_arms,
        width,
    )
    left_out = [a.name for a in depth_arms.screen_arms(screen_p) if a not in arms]
    # the whole study, not one call's part of it (a lever left out, an earlier phase, a depth)
    every_depth = set(QUICK_STAGES if quick else STAGES) <= set(stages)
    whole = not left_out and phase == PHASES[-1] and every_depth
    summary.update(
        study_pick_by_depth=picked_at,
        quick=quick,
        phase=phase,
        levers_left_out=left_out,
        complete=bool(summary["complete"]) and whole,
        wall_s=round(time.perf_counter() - start, 1),
    )
    fields = rule_fields("depth", summary, data_reference(base))
    summary.update(fields)
    write_outputs(summary, out)
    if summary.get("complete"):
        (out / "runs.partial.jsonl").unlink(missing_ok=True)
    return summary
