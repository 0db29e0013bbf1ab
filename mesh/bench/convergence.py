"""`meshtrain bench convergence`: every baseline at equal tokens on the simulator.

Seeds: the DP study's settings are tuned on the tuning seeds (tuning.json, `--tune`) and the
study reports other seeds (EVAL_SEEDS, `--seeds`), refused where a seed is in both, so its
figures are out of sample; gaps are paired by seed with a 95% t interval (convergence_table.py).

Two studies share one run:
- dp: the data-parallel baselines (mesh/methods.py) on a 4x2 grid (async nadamw pipelines, except
  FullSync which is gpipe + blocking fp32 gradient all-reduce).
- pp: the pipeline axis alone (1 replica): sync (gpipe, M = P) vs async at P = 4 and 8 with adamw
  and nadamw, delay-free references with one microbatch per update (the same number of updates
  as async), and 2bw (one-step delay) with adamw and muon, with and without error feedback.

Equal tokens: every run of a study reads the same number of microbatches per replica; a schedule
that takes M microbatches per update makes 1/M as many updates. Runs go to a pool of worker
processes (one thread each), then summary.json, table.md and the plots are written.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from mesh.bench.convergence_table import DP_METHODS, write_outputs
from mesh.bench.regime import data_reference, stamp
from mesh.bench.simruns import Spec, read_runs, reuse, run_one, run_specs, worker_pool
from mesh.bench.tuning import (
    DEFAULT_TUNED,
    STUDY_PINS,
    check_held_out,
    known_runs,
    load_tuned,
    method_overrides,
    tuning_seeds,
)
from mesh.config import Config, ConfigError
from mesh.methods import NADAMW_LR
from mesh.report import format_table

# the headline claim's two arms: run first (a stopped study has its headline on every seed)
HEADLINE = ("FullSync", "AsyncMesh-fp8")
# The DP study's evaluation seeds: none of them tuned anything (the tuning's are 0 and 1) and no
# other committed study used them (seeds 0-3 are the earlier studies'), so the table's figures
# are out of sample. 8 seeds: the headline's per-seed gaps spread by ~2%, and the 95% interval
# of their mean must be narrower than the 1% the target is about.
EVAL_SEEDS = list(range(10, 18))
# The DP study's learning rates before tuning.md (`--lr-sweep`, seed 0; lr_sweep.md). The
# study now reads each arm's tuned settings (mesh/bench/tuning.py); these stay for --lr-sweep.
DP_LR = {"adamw": 6e-3, "nadamw": 2e-3}
SWEEP_LRS = {
    "FullSync": [1e-3, 2e-3, 3e-3, 4e-3, 6e-3, 8e-3, 1.2e-2],
    "AsyncMesh-fp8": [1e-3, 2e-3, 2.5e-3, 3e-3, 3.5e-3, 4e-3, 5e-3],
}


def _pp_specs(seed: int) -> list[Spec]:
    specs = []

    def add(name: str, mpu: int, **ov: Any) -> None:
        base = {"grid.replicas": 1, "dp.mode": "none", "optim.error_feedback": False}
        base.update({k.replace("__", "."): v for k, v in ov.items()})
        base["optim.lr"] = NADAMW_LR if base.get("optim.name") == "nadamw" else 2e-3
        specs.append(Spec("pp", name, seed, mpu, tuple(base.items())))

    for p in (4, 8):
        for opt in ("adamw", "nadamw"):
            add(
                f"P{p} gpipe {opt}",
                p,
                grid__stages=p,
                pipeline__schedule="gpipe",
                pipeline__microbatches=p,
                optim__name=opt,
            )
            add(f"P{p} async {opt}", 1, grid__stages=p, pipeline__schedule="async", optim__name=opt)
    for opt in ("adamw", "nadamw", "muon"):
        add(
            f"delay-free {opt}",
            1,
            grid__stages=4,
            pipeline__schedule="gpipe",
            pipeline__microbatches=1,
            optim__name=opt,
        )
    add(
        "P4 gpipe muon",
        4,
        grid__stages=4,
        pipeline__schedule="gpipe",
        pipeline__microbatches=4,
        optim__name="muon",
    )
    for opt in ("adamw", "muon"):
        for ef in (False, True):
            add(
                f"2bw {opt}" + (" +EF" if ef else ""),
                4,
                grid__stages=4,
                pipeline__schedule="2bw",
                pipeline__microbatches=4,
                optim__name=opt,
                optim__error_feedback=ef,
            )
    return specs


def study_variants(
    out: Path,
    label: str,
    variants: list[tuple[str, str, dict[str, Any]]],
    seeds: list[int] | None = None,
) -> tuple[dict[str, Any], list[Spec], dict[str, int]]:
    """A study's DP methods with changes (name, method, overrides), on the seeds (default: the
    study's evaluation seeds) and budget of the study in `out` at its tuned settings: (the
    study's summary, the specs, their budget). For the scripts that take the study apart
    (scripts/headline_gap.py, orderings_at_tau.py, staleness_candidates.py) and the like for
    like (mesh/bench/like_for_like.py)."""
    study = json.loads((out / "summary.json").read_text())
    tuned, _ = load_tuned(out / "tuning.json")
    specs = []
    for seed in study["seeds"]["dp"] if seeds is None else seeds:
        for name, method, change in variants:
            own = _dp_spec(method, seed, tuned=tuned)
            ov = {**dict(own.overrides), **change}
            # the method's microbatches per update (FullSync's 4): equal tokens, not 4x them
            mpu = own.microbatches_per_update
            specs.append(Spec(label, name, seed, mpu, tuple(ov.items())))
    return study, specs, {label: study["microbatches_per_replica"]["dp"]}


def cached_losses(base: Config, out: Path, method: str, seeds: list[int]) -> dict[int, float]:
    """The study's `method` at its tuned settings on `seeds`, where the study's run cache (its
    summary.json, a study under way's runs.partial.jsonl, tuning.json) has the run: seed ->
    final validation loss. Runs nothing (for the scripts that compare against the study)."""
    tuned, _ = load_tuned(out / "tuning.json")
    known = [*known_runs(out / "summary.json"), *known_runs(out / "tuning.json")]
    known += read_runs(out / "runs.partial.jsonl")
    specs = [_dp_spec(method, seed, tuned=tuned) for seed in seeds]
    budget = json.loads((out / "summary.json").read_text())["microbatches_per_replica"]
    found = reuse(known, specs, base, budget)
    return {s.seed: r["val_loss"] for s, r in zip(specs, found, strict=True) if r is not None}


def _dp_spec(
    method: str, seed: int, lr: float | None = None, tuned: dict[str, Any] | None = None
) -> Spec:
    mpu = 4 if method == "FullSync" else 1
    ov = method_overrides(method, tuned or DEFAULT_TUNED)
    ov.update({"grid.stages": 4, "grid.replicas": 2, "pipeline.microbatches": 4, **STUDY_PINS})
    if lr is not None:
        ov["optim.lr"] = lr
    return Spec("dp", method, seed, mpu, tuple(ov.items()))


def build_specs(
    seeds: list[int],
    pp_seeds: list[int] | None = None,
    tuned: dict[str, Any] | None = None,
    methods: list[str] | None = None,
) -> list[Spec]:
    """Every run of both studies, the headline's two arms on every seed first; the pipeline
    study on pp_seeds (default: the same seeds); the DP study's `methods` (default: all)."""
    order = [*HEADLINE, *(m for m in DP_METHODS if m not in HEADLINE)]
    order = [m for m in order if methods is None or m in methods]
    specs = [_dp_spec(method, seed, tuned=tuned) for method in order for seed in seeds]
    for seed in seeds if pp_seeds is None else pp_seeds:
        specs += _pp_specs(seed)
    return specs


def run_lr_sweep(base: Config, out: Path, quick: bool, workers: int) -> list[dict[str, Any]]:
    """The DP study's two optimizer arms over SWEEP_LRS, seed 0, the study's own budget:
    writes lr_sweep.json and lr_sweep.md (what DP_LR was chosen from)."""
    from tqdm import tqdm

    budget = 160 if quick else 1600
    specs = [_dp_spec(m, 0, lr) for m, lrs in SWEEP_LRS.items() for lr in lrs]
    # points of an earlier sweep with the same config and budget are kept
    path = out / "lr_sweep.json"
    runs = reuse(
        json.loads(path.read_text()) if path.is_file() else [], specs, base, {"dp": budget}
    )
    todo = [(base.model_dump(mode="json"), s, budget) for s, r in zip(specs, runs) if r is None]
    with worker_pool(workers) as pool:
        new = iter(tqdm(pool.imap(run_one, todo), total=len(todo), desc="lr sweep"))
        runs = [r if r is not None else next(new) for r in runs]
    for spec, r in zip(specs, runs, strict=True):
        r["lr"] = dict(spec.overrides)["optim.lr"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "lr_sweep.json").write_text(json.dumps(runs, indent=1))
    rows = [
        [r["method"], f"{r['lr']:g}", "diverged" if r["diverged"] else f"{r['val_loss']:.4f}"]
        for r in runs
    ]
    best = {
        m: min((r for r in runs if r["method"] == m), key=lambda r: r["val_loss"] or math.inf)
        for m in SWEEP_LRS
    }
    lines = [
        "# Learning rates of the data-parallel study",
        "",
        f"Seed 0, 4x2 grid, {budget} microbatches per replica (the study's budget); the other "
        "async methods share AsyncMesh-fp8's optimizer (NAdamW) and use its lr.",
        "",
        format_table(["method", "lr", "val loss"], rows),
        "",
        "Best: " + ", ".join(f"{m} {b['lr']:g}" for m, b in best.items()) + ". Used by the "
        f"study (DP_LR in mesh/bench/convergence.py): adamw {DP_LR['adamw']:g}, nadamw "
        f"{DP_LR['nadamw']:g}, the largest NAdamW lr below the onset of loss spikes.",
    ]
    (out / "lr_sweep.md").write_text("\n".join(lines) + "\n")
    return runs


def check_methods(methods: list[str]) -> None:
    """--methods: known DP methods, the headline's two arms among them (the study's reference
    and its claim); a ConfigError naming the fix otherwise."""
    unknown = [m for m in methods if m not in DP_METHODS]
    if unknown:
        raise ConfigError(
            f"--methods {','.join(methods)}: {', '.join(unknown)} is not a data-parallel "
            f"method (one of {', '.join(DP_METHODS)})"
        )
    missing = [m for m in HEADLINE if m not in methods]
    if missing:
        raise ConfigError(
            f"--methods {','.join(methods)}: add {', '.join(missing)} (every gap is to "
            "FullSync, and the headline is AsyncMesh-fp8's)"
        )


def kept_runs(
    old: dict[str, Any] | None, seeds: list[int], run: list[str], tuned_on: list[int]
) -> dict[str, Any]:
    """The DP runs a study of some of the methods (`run`, on `seeds`) keeps from the previous
    summary.json, for the methods it did not run: all of that study's DP runs on its own seeds,
    so a kept method is compared with FullSync and the others there, never across seeds (the
    table marks them as not on the study's seeds). A previous study of all methods gives its
    runs on other seeds than `seeds`; one that kept runs passes them on. tuned_on: the seeds
    that tuned them where the previous summary does not say (it predates the split)."""
    if old is None or not set(DP_METHODS) - set(run):
        return {"seeds": [], "tuning_seeds": [], "runs": []}
    if "kept" in old:
        runs = old["kept"]["runs"]
        said = old["kept"].get("tuning_seeds")
    else:
        runs = [r for r in old["runs"] if r["study"] == "dp" and r["seed"] not in seeds]
        said = old.get("tuning_seeds")
    return {
        "seeds": sorted({r["seed"] for r in runs}),
        "tuning_seeds": tuned_on if said is None else said,
        "runs": runs,
    }


def run_convergence(
    base: Config,
    out: Path,
    quick: bool,
    workers: int,
    pipeline: bool = True,
    seeds: list[int] | None = None,
    methods: list[str] | None = None,
) -> dict[str, Any]:
    """Both studies, the DP study on `seeds` (default EVAL_SEEDS; a ConfigError where one of
    them tuned the settings the study reads) (pipeline=False: the DP study alone; the pipeline
    study's runs of the last summary.json are kept as they were, and the table says so).
    methods: the DP methods to run (default all); the others' runs of the last summary.json
    are kept on their own seeds, with FullSync's there (kept_runs), and the table says so."""
    # the DP methods differ by a few hundredths of a nat, about their seed-to-seed spread
    dp_seeds = seeds or (EVAL_SEEDS[:2] if quick else EVAL_SEEDS)
    if methods is not None:
        check_methods(methods)
    # the pipeline study is not tuned (its lrs are fixed, _pp_specs): its seeds stay 0 and 1
    seeds_of = {"dp": dp_seeds, "pp": [0, 1]}
    # microbatches per replica per study; the pipeline study has 2x the runs, so it is shorter
    budget = {"dp": 160, "pp": 100} if quick else {"dp": 1600, "pp": 800}
    tuned, is_tuned = load_tuned(out / "tuning.json") if not quick else (DEFAULT_TUNED, False)
    tuned_on = tuning_seeds(out / "tuning.json") if is_tuned else []
    check_held_out(dp_seeds, tuned_on)
    specs = build_specs(dp_seeds, seeds_of["pp"] if pipeline else [], tuned, methods)
    # longest first so the pool's tail is short
    specs.sort(key=lambda s: -(2 if s.study == "dp" else 1))
    kept: list[dict[str, Any]] = []
    old = out / "summary.json"
    previous = json.loads(old.read_text()) if old.is_file() else None
    if not pipeline and previous is not None:
        kept = [r for r in previous["runs"] if r["study"] == "pp"]
    start = time.perf_counter()
    known = known_runs(out / "tuning.json")
    if not quick:  # a run whose config did not change is not run again
        known += [r for r in known_runs(old) if r["study"] == "dp"]
    runs = run_specs(base, specs, budget, out, workers, "convergence", known) + kept
    summary = {
        "microbatches_per_replica": budget,
        "seeds": seeds_of,
        # the seeds that picked the settings (tuning.json): never among seeds["dp"]
        "tuning_seeds": tuned_on,
        "quick": quick,
        "tuned": tuned if is_tuned else None,
        "pipeline_study_kept": bool(kept),
        # this invocation's time; runs resumed from a stopped study carry their own wall_s
        "wall_s": round(time.perf_counter() - start, 1),
        "cpu_s_of_runs": round(sum(r["wall_s"] for r in runs), 1),
        "base_config_fingerprint": base.fingerprint(),
        "tokens_per_microbatch": base.tokens_per_microbatch,
        "runs": runs,
    }
    if methods is not None:
        # outside "runs": the targets and every reader of the study's runs see its seeds only
        summary["kept"] = kept_runs(previous, dp_seeds, methods, tuned_on)
    write_outputs(summary, out)
    summary.update(stamp(out, "convergence", data_reference(base)))  # the rule (bench/regime.py)
    (out / "runs.partial.jsonl").unlink()
    return summary
