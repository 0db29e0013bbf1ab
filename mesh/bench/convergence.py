"""`meshtrain bench convergence`: every baseline at equal tokens on the simulator, 2+ seeds.

Two studies share one run:
- dp: the data-parallel baselines of design.md 1.3 on a 4x2 grid (async nadamw pipelines, except
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
import statistics
import time
from pathlib import Path
from typing import Any

from mesh.bench.report import fmt_gap, format_table, paired_gap, plot_curves
from mesh.bench.simruns import Spec, reuse, run_one, run_specs, worker_pool
from mesh.bench.tuning import DEFAULT_TUNED, _fmt, known_runs, load_tuned, method_overrides
from mesh.config import Config
from mesh.methods import METHODS, NADAMW_LR

DP_METHODS = list(METHODS)
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
    out: Path, label: str, variants: list[tuple[str, str, dict[str, Any]]]
) -> tuple[dict[str, Any], list[Spec], dict[str, int]]:
    """A study's DP methods with changes (name, method, overrides), on the seeds and budget of
    the study in `out` at its tuned settings: (the study's summary, the specs, their budget).
    For the scripts that take the study apart (scripts/headline_gap.py, orderings_at_tau.py)."""
    study = json.loads((out / "summary.json").read_text())
    tuned, _ = load_tuned(out / "tuning.json")
    specs = []
    for seed in study["seeds"]["dp"]:
        for name, method, change in variants:
            ov = {**dict(_dp_spec(method, seed, tuned=tuned).overrides), **change}
            specs.append(Spec(label, name, seed, 1, tuple(ov.items())))
    return study, specs, {label: study["microbatches_per_replica"]["dp"]}


def _dp_spec(
    method: str, seed: int, lr: float | None = None, tuned: dict[str, Any] | None = None
) -> Spec:
    mpu = 4 if method == "FullSync" else 1
    ov = method_overrides(method, tuned or DEFAULT_TUNED)
    ov.update({"grid.stages": 4, "grid.replicas": 2, "pipeline.microbatches": 4})
    if lr is not None:
        ov["optim.lr"] = lr
    return Spec("dp", method, seed, mpu, tuple(ov.items()))


def build_specs(
    seeds: list[int], pp_seeds: list[int] | None = None, tuned: dict[str, Any] | None = None
) -> list[Spec]:
    """Every run of both studies; the pipeline study on pp_seeds (default: the same seeds)."""
    specs = []
    for seed in seeds:
        specs += [_dp_spec(method, seed, tuned=tuned) for method in DP_METHODS]
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


def run_convergence(
    base: Config, out: Path, quick: bool, workers: int, pipeline: bool = True
) -> dict[str, Any]:
    """Both studies (pipeline=False: the DP study alone; the pipeline study's runs of the last
    summary.json are kept as they were, and the table says so)."""
    # the DP methods differ by a few hundredths of a nat, about their seed-to-seed spread: 4 seeds
    seeds = {"dp": [0, 1], "pp": [0, 1]} if quick else {"dp": [0, 1, 2, 3], "pp": [0, 1]}
    # microbatches per replica per study; the pipeline study has 2x the runs, so it is shorter
    budget = {"dp": 160, "pp": 100} if quick else {"dp": 1600, "pp": 800}
    tuned, is_tuned = load_tuned(out / "tuning.json") if not quick else (DEFAULT_TUNED, False)
    specs = build_specs(seeds["dp"], seeds["pp"] if pipeline else [], tuned)
    # longest first so the pool's tail is short
    specs.sort(key=lambda s: -(2 if s.study == "dp" else 1))
    kept: list[dict[str, Any]] = []
    old = out / "summary.json"
    if not pipeline and old.is_file():
        kept = [r for r in json.loads(old.read_text())["runs"] if r["study"] == "pp"]
    start = time.perf_counter()
    known = known_runs(out / "tuning.json")
    if not quick:  # a run whose config did not change is not run again
        known += [r for r in known_runs(old) if r["study"] == "dp"]
    runs = run_specs(base, specs, budget, out, workers, "convergence", known) + kept
    summary = {
        "microbatches_per_replica": budget,
        "seeds": seeds,
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
    write_outputs(summary, out)
    (out / "runs.partial.jsonl").unlink()
    return summary


def _by_method(runs: list[dict[str, Any]], study: str) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for r in runs:
        if r["study"] == study:
            v = r["val_loss"]
            out.setdefault(r["method"], {})[r["seed"]] = math.nan if v is None else v
    return out


def _mean(vals: dict[int, float]) -> float:
    return statistics.mean(vals.values()) if vals else math.nan


def targets(runs: list[dict[str, Any]]) -> list[tuple[str, str, bool | None]]:
    """The issue's convergence targets: (name, measured, met)."""
    dp, pp = _by_method(runs, "dp"), _by_method(runs, "pp")
    m = {k: _mean(v) for k, v in {**dp, **pp}.items()}
    out: list[tuple[str, str, bool | None]] = []

    def check(name: str, measured: str, ok: bool) -> None:
        out.append((name, measured, ok))

    fs, am8, am = m.get("FullSync"), m.get("AsyncMesh-fp8"), m.get("AsyncMesh")
    check("AsyncMesh-fp8 within 1% of FullSync", f"{am8:.4f} vs {fs:.4f}", am8 <= fs * 1.01)
    check(
        "AsyncSPARTA > AsyncMesh + 0.03 nats",
        f"{m['AsyncSPARTA']:.4f} vs {am8:.4f}",
        m["AsyncSPARTA"] > min(am8, am) + 0.03,
    )
    check(
        "AsyncMesh better than the delta rule",
        f"{am:.4f} vs {m['DeltaRule']:.4f}",
        am < m["DeltaRule"],
    )
    b = {r["method"]: r["dp_bytes_per_replica_step"] for r in runs if r["study"] == "dp"}
    check(
        "AsyncMesh-fp8 averaging bytes <= 1/64 of FullSync",
        f"1/{b['FullSync'] / b['AsyncMesh-fp8']:.1f}",
        b["AsyncMesh-fp8"] * 64 <= b["FullSync"],
    )
    best_sync8 = min(m["P8 gpipe adamw"], m["P8 gpipe nadamw"])
    check(
        "P=8: async nadamw <= gpipe (M=P)",
        f"{m['P8 async nadamw']:.4f} vs {best_sync8:.4f}",
        m["P8 async nadamw"] <= best_sync8,
    )
    gap_n = m["P8 async nadamw"] - m["delay-free nadamw"]
    gap_a = m["P8 async adamw"] - m["delay-free adamw"]
    check(
        "P=8: async nadamw gap <= half of async adamw gap (vs delay-free)",
        f"{gap_n:+.4f} vs {gap_a:+.4f}",
        gap_n <= 0.5 * gap_a,
    )
    g = {
        o: (m[f"2bw {o}"] - m[f"P4 gpipe {o}"], m[f"2bw {o} +EF"] - m[f"P4 gpipe {o}"])
        for o in ("adamw", "muon")
    }
    check(
        "2bw: muon gap < adamw gap",
        f"{g['muon'][0]:+.4f} vs {g['adamw'][0]:+.4f}",
        g["muon"][0] < g["adamw"][0],
    )
    check(
        "2bw: error feedback shrinks both gaps",
        f"adamw {g['adamw'][0]:+.4f}->{g['adamw'][1]:+.4f}, "
        f"muon {g['muon'][0]:+.4f}->{g['muon'][1]:+.4f}",
        g["adamw"][1] < g["adamw"][0] and g["muon"][1] < g["muon"][0],
    )
    return [(n, s, None if "nan" in s else ok) for n, s, ok in out]


def _pp_reference(method: str) -> str:
    """The delay-free run a pipeline run is compared with (same optimizer, same updates)."""
    opt = method.replace(" +EF", "").split()[-1]
    return f"P4 gpipe {opt}" if method.startswith("2bw") else f"delay-free {opt}"


def write_outputs(summary: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    runs = summary["runs"]
    dp, pp = _by_method(runs, "dp"), _by_method(runs, "pp")
    fs = dp.get("FullSync", {})
    dpb = {r["method"]: r["dp_bytes_per_replica_step"] for r in runs if r["study"] == "dp"}
    rows = []
    for method in [m for m in DP_METHODS if m in dp]:
        ratio = dpb[method] / dpb["FullSync"] if dpb.get("FullSync") else math.nan
        rows.append(
            [
                method,
                f"{_mean(dp[method]):.4f}",
                fmt_gap(paired_gap(dp[method], fs)),
                f"{dpb[method]:,.0f}",
                f"{ratio:.4f}",
            ]
        )
    lines = [
        "# Convergence at equal tokens",
        "",
        f"Microbatches per replica: {summary['microbatches_per_replica']} (of "
        f"{summary['tokens_per_microbatch']} tokens); seeds {summary['seeds']}; "
        f"quick={summary['quick']}; {summary['wall_s']:.0f} s in all. {_settings(summary)}",
        "",
        "## Data-parallel baselines, 4x2 grid",
        "",
        format_table(
            [
                "method",
                "val loss (mean)",
                "gap to FullSync (paired, +- SE)",
                "DP bytes/replica/step",
                "x FullSync bytes",
            ],
            rows,
        ),
        "",
        "## Pipeline axis, 1 replica",
        "",
    ]
    prow = []
    for method in sorted(pp):
        base = pp.get(_pp_reference(method))
        gap = (
            "(reference)"
            if base is None or base is pp[method]
            else fmt_gap(paired_gap(pp[method], base))
        )
        prow.append([method, f"{_mean(pp[method]):.4f}", gap])
    lines += [
        format_table(["run", "val loss (mean)", "gap to its reference"], prow),
        "",
        "2bw runs are compared with gpipe at the same M (same updates, same batch); the "
        "others with one microbatch per update and no delay.",
        "",
        "## Targets",
        "",
    ]
    lines.append(
        format_table(
            ["target", "measured", "verdict"],
            [
                [n, s, "no result" if ok is None else ("met" if ok else "MISSED")]
                for n, s, ok in targets(runs)
            ],
        )
    )
    lines += _missed_reason(runs, out) + _sparta_at_tau(runs, out)
    (out / "table.md").write_text("\n".join(lines) + "\n")
    _plot(runs, "dp", out / "loss.png", "Validation loss at equal tokens, 4x2 grid")
    _plot(runs, "pp", out / "pipeline.png", "Pipeline axis (1 replica): validation loss")


def _missed_reason(runs: list[dict[str, Any]], out: Path) -> list[str]:
    """Where the headline target is missed, its measured reason under the targets: the gap of
    the tuned AsyncMesh-fp8 with the pipeline's delay removed (scripts/headline_gap.py writes
    decomposition.json beside the table), said to be stale when its runs are not this study's."""
    dp = _by_method(runs, "dp")
    fs, am8 = dp.get("FullSync", {}), dp.get("AsyncMesh-fp8", {})
    path = out / "decomposition.json"
    if not fs or not am8 or _mean(am8) <= _mean(fs) * 1.01 or not path.is_file():
        return []
    loss = {
        row: {int(seed): v for seed, v in vals.items()}
        for row, vals in json.loads(path.read_text())["loss"].items()
    }
    free = loss.get("delay-free pipeline", {})
    gap, free_gap = paired_gap(am8, fs), paired_gap(free, fs)
    if gap is None or free_gap is None:
        return []
    same = loss.get("AsyncMesh-fp8 (the study's)") == am8
    return [
        "",
        f"Why the headline is missed (measured, [decomposition.md](decomposition.md)"
        f"{'' if same else ', from runs at an earlier tuning: re-run scripts/headline_gap.py'}):"
        f" the same AsyncMesh-fp8 with a delay-free pipeline (gpipe, one microbatch per update)"
        f" ends {fmt_gap(free_gap)} from FullSync ({100 * free_gap[0] / _mean(fs):+.1f}%) against"
        f" {fmt_gap(gap)} ({100 * gap[0] / _mean(fs):+.1f}%) asynchronous: the gap is the"
        " asynchronous pipeline's staleness, not the averaging.",
    ]


def _sparta_at_tau(runs: list[dict[str, Any]], out: Path) -> list[str]:
    """Where AsyncSPARTA trails AsyncMesh by less than the target's 0.03 nats, the same two at
    another averaging delay (scripts/orderings_at_tau.py writes orderings_tau<N>.json): the
    margin is what a stale mean costs without the correction, so it grows with tau."""
    dp = _by_method(runs, "dp")
    sparta, am8 = dp.get("AsyncSPARTA", {}), dp.get("AsyncMesh-fp8", {})
    if not sparta or not am8 or _mean(sparta) > _mean(am8) + 0.03:
        return []
    lines = []
    for path in sorted(out.glob("orderings_tau*.json")):
        loss = {
            row: {int(seed): v for seed, v in vals.items()}
            for row, vals in json.loads(path.read_text())["loss"].items()
        }
        gap = paired_gap(loss.get("AsyncSPARTA", {}), loss.get("AsyncMesh-fp8", {}))
        if gap is not None:
            tau = path.stem.removeprefix("orderings_tau")
            lines.append(
                f"AsyncSPARTA minus AsyncMesh-fp8 at tau {tau}, all else as this study "
                f"([{path.stem}.md]({path.stem}.md)): {fmt_gap(gap)} nats."
            )
    return ["", *lines] if lines else []


def _settings(summary: dict[str, Any]) -> str:
    tuned = summary.get("tuned")
    if tuned:
        fs = ", ".join(f"{k} {_fmt(v)}" for k, v in tuned["FullSync"].items())
        am = ", ".join(f"{k} {_fmt(v)}" for k, v in tuned["AsyncMesh-fp8"].items())
        dp = (
            f"Data-parallel study: each arm's best of the same tuning budget (tuning.md): "
            f"FullSync (AdamW) {fs}; every async method (NAdamW) AsyncMesh-fp8's {am}, where "
            "the method does not pin it (SPARTA and DPAvg keep tau 0)."
        )
    else:
        dp = (
            f"Data-parallel study (untuned): FullSync's AdamW at lr {DP_LR['adamw']:g}, every "
            f"async method's NAdamW at {DP_LR['nadamw']:g}."
        )
    pp = (
        " Pipeline study: kept from the previous summary.json (not re-run)."
        if summary.get("pipeline_study_kept")
        else " Pipeline study: adamw 2e-3, nadamw 1e-3, muon 0.02 with AdamW 2e-3 for the rest."
    )
    return (
        dp + pp + " Per-stage gradient clip 1.0 unless tuned; warmup 10% of updates, cosine to "
        "10%; lambda on the arrivals clock (dp.lambda_clock = arrivals) and NAdam's momentum "
        "ramp as the paper's share of the run (optim.momentum_decay = auto) unless the tuning "
        "chose otherwise (mesh/bench/simruns.py)."
    )


def _plot(runs: list[dict[str, Any]], study: str, path: Path, title: str) -> None:
    curves: dict[str, list[tuple[float, float]]] = {}
    grouped: dict[str, list[list[dict[str, float]]]] = {}
    for r in runs:
        if r["study"] == study and r["curve"]:
            grouped.setdefault(r["method"], []).append(r["curve"])
    for method, cs in grouped.items():
        n = min(len(c) for c in cs)
        curves[method] = [
            (cs[0][k]["tokens"], statistics.mean(c[k]["val_loss"] for c in cs)) for k in range(n)
        ]
    plot_curves(curves, path, "tokens (all replicas)", "validation loss (nats/byte)", title)
