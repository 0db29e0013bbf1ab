"""The convergence study's report (`meshtrain bench convergence`): summary.json, table.md with
the targets and their measured reasons, and the plots. The data-parallel study reports its
evaluation seeds, which no tuning used; each gap is paired by seed, with a 95% t interval."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from mesh.bench.convergence_targets import (
    _by_method,
    _in_sample,
    _mean,
    _seeds,
    targets,
)
from mesh.bench.report import PairedInterval, fmt_gap, fmt_interval, paired_gap, paired_interval
from mesh.bench.tuning import DEFAULT_TUNED, _fmt
from mesh.methods import METHODS
from mesh.report import format_table, plot_curves

DP_METHODS = list(METHODS)


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
    seeds = summary["seeds"]
    kept = summary.get("kept") or {"runs": []}
    old = _by_method(kept["runs"], "dp")
    dpb.update({r["method"]: r["dp_bytes_per_replica_step"] for r in kept["runs"]} | dpb)
    rows = []
    for method in [m for m in DP_METHODS if m in dp or m in old]:
        # a method the study did not run: its kept runs, against FullSync on their seeds
        vals, ref = (dp[method], fs) if method in dp else (old[method], old.get("FullSync", {}))
        on = _seeds(seeds["dp"]) if method in dp else f"{_seeds(list(vals))}: {_in_sample(kept)}"
        ratio = dpb[method] / dpb["FullSync"] if dpb.get("FullSync") else math.nan
        rows.append(
            [
                method,
                on,
                f"{_mean(vals):.4f}",
                fmt_interval(paired_interval(vals, ref)),
                fmt_interval(paired_interval(vals, ref, relative=True), pct=True),
                f"{dpb[method]:,.0f}",
                f"{ratio:.4f}",
            ]
        )
    lines = [
        "# Convergence at equal tokens",
        "",
        *_headline(summary, out),
        f"Microbatches per replica: {summary['microbatches_per_replica']} (of "
        f"{summary['tokens_per_microbatch']} tokens); data-parallel study on seeds "
        f"{_seeds(seeds['dp'])}{_held_out(summary)}; pipeline study on seeds "
        f"{_seeds(seeds['pp'])}; quick={summary['quick']}; {summary['wall_s']:.0f} s in all. "
        f"{_settings(summary)}",
        "",
        *_headline_by_seed(dp),
        f"## Data-parallel baselines, 4x2 grid, seeds {_seeds(seeds['dp'])}",
        "",
        "Gaps are paired by seed: the mean of the per-seed differences to FullSync, +- its "
        "standard error, [its 95% t interval]."
        + (
            " A method not yet run on the evaluation seeds gives its runs on the seeds they were "
            "run on, against FullSync's there, and says so: those figures are not out of sample."
            if old
            else ""
        ),
        "",
        format_table(
            [
                "method",
                "seeds",
                "val loss (mean)",
                "gap to FullSync, nats",
                "gap to FullSync, %",
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
                for n, s, ok in targets(runs, summary.get("kept"))
            ],
        )
    )
    lines += _missed_reason(runs, out) + _candidates(dp, out)
    lines += _sparta_at_tau(summary, out)
    (out / "table.md").write_text("\n".join(lines) + "\n")
    _plot(runs, "dp", out / "loss.png", "Validation loss at equal tokens, 4x2 grid")
    _plot(runs, "pp", out / "pipeline.png", "Pipeline axis (1 replica): validation loss")


def _held_out(summary: dict[str, Any]) -> str:
    tuned_on = summary.get("tuning_seeds")
    if not summary.get("tuned"):
        return " (untuned settings)"
    if tuned_on is None:  # a summary from before the seeds were split
        return " (the tuning's seeds are not recorded)"
    return f", which no tuning used (the settings were tuned on seeds {_seeds(tuned_on)})"


def _loss_by_seed(path: Path) -> dict[str, dict[int, float]]:
    """A study part's {"loss": {row: {seed: loss}}} (json keys are strings)."""
    return {
        row: {int(seed): v for seed, v in vals.items()}
        for row, vals in json.loads(path.read_text())["loss"].items()
    }


def _headline(summary: dict[str, Any], out: Path) -> list[str]:
    """The headline out of sample, first: the per-seed gap's mean and 95% interval on the
    study's seeds, and the same settings on the seeds that tuned them (tuning.json)."""
    dp = _by_method(summary["runs"], "dp")
    iv = paired_interval(dp.get("AsyncMesh-fp8", {}), dp.get("FullSync", {}), relative=True)
    if iv is None:
        return []
    where = _held_out(summary).removeprefix(", ")
    line = (
        f"**Headline: AsyncMesh-fp8 ends {100 * iv.mean:+.2f}% from FullSync** (validation loss, "
        f"mean of the per-seed gaps, 95% t interval [{100 * iv.low:+.2f}%, {100 * iv.high:+.2f}%]"
        f") on seeds {_seeds(list(iv.diffs))}, {where}."
    )
    own = _on_tuning_seeds(out / "tuning.json") if summary.get("tuned") else None
    if own is not None:
        line += (
            f" On the tuning seeds themselves ({_seeds(list(own.diffs))}) the same settings end "
            f"{100 * own.mean:+.2f}% (in sample, flattered by the choice)."
        )
    return [line, ""]


def _on_tuning_seeds(path: Path) -> PairedInterval | None:
    """AsyncMesh-fp8's relative gap to FullSync at the tuned settings on the tuning's seeds."""
    if not path.is_file():
        return None
    tuning = json.loads(path.read_text())
    loss: dict[str, dict[int, float]] = {}
    for arm, best in tuning["best"].items():
        for r in tuning["runs"]:
            if r["method"].startswith(arm + " |") and r["settings"] == best["settings"]:
                loss.setdefault(arm, {})[r["seed"]] = r["val_loss"]
    return paired_interval(loss.get("AsyncMesh-fp8", {}), loss.get("FullSync", {}), relative=True)


def _headline_by_seed(dp: dict[str, dict[int, float]]) -> list[str]:
    fs, am8 = dp.get("FullSync", {}), dp.get("AsyncMesh-fp8", {})
    seeds = sorted(set(fs) & set(am8))
    if not seeds:
        return []
    rows = [
        [
            str(s),
            f"{fs[s]:.4f}",
            f"{am8[s]:.4f}",
            f"{am8[s] - fs[s]:+.4f}",
            f"{100 * (am8[s] / fs[s] - 1):+.2f}%",
        ]
        for s in seeds
    ]
    nats, pct = paired_interval(am8, fs), paired_interval(am8, fs, relative=True)
    rows.append(
        [
            "mean",
            f"{_mean(fs):.4f}",
            f"{_mean(am8):.4f}",
            fmt_interval(nats),
            fmt_interval(pct, pct=True),
        ]
    )
    return [
        "## The headline seed by seed",
        "",
        format_table(["seed", "FullSync", "AsyncMesh-fp8", "difference, nats", "gap %"], rows),
        "",
    ]


def _candidates(dp: dict[str, dict[int, float]], out: Path) -> list[str]:
    """The staleness candidates measured on this study's seeds (scripts/staleness_candidates.py
    writes candidates.json): each one's paired effect on AsyncMesh-fp8 and the gap it leaves."""
    path = out / "candidates.json"
    am8, fs = dp.get("AsyncMesh-fp8", {}), dp.get("FullSync", {})
    if not path.is_file() or not am8:
        return []
    lines = []
    for name, c in json.loads(path.read_text())["candidates"].items():
        loss = {int(seed): v for seed, v in c.get("evaluation", {}).items()}
        effect = paired_interval(loss, am8)
        if effect is None or set(loss) != set(am8):
            continue
        gap = paired_interval(loss, fs, relative=True)
        lines.append(
            f"- {name}: {fmt_interval(effect)} nats on AsyncMesh-fp8, which then ends "
            f"{fmt_interval(gap, pct=True)} from FullSync."
        )
    if not lines:
        return []
    return [
        "",
        "Candidates against the staleness, tuned on the tuning seeds and measured on this "
        "study's seeds ([candidates.md](candidates.md)), paired by seed, mean +- SE [95% t "
        "interval]. A candidate changes the asynchronous arm alone: FullSync keeps its tuned "
        "AdamW, so an optimizer candidate's gap to FullSync is not the headline's like for like:",
        "",
        *lines,
        *_like_for_like(out, set(am8)),
    ]


def _like_for_like(out: Path, seeds: set[int]) -> list[str]:
    """Both arms with rotated_adam on this study's seeds, each tuned with the same budget
    (mesh/bench/like_for_like.py); nothing from a result marked withdrawn."""
    path = out / "like_for_like.json"
    saved = json.loads(path.read_text()) if path.is_file() else {"evaluation": {}}
    if saved.get("withdrawn"):
        return [
            f"- like for like ([like_for_like.md](like_for_like.md)): withdrawn, "
            f"{saved['withdrawn']}"
        ]
    ev = {k: {int(s): v for s, v in d.items()} for k, d in saved["evaluation"].items()}
    fs = ev.get("FullSync rotated_adam", {})
    gap = paired_interval(ev.get("AsyncMesh-fp8 rotated_adam", {}), fs, relative=True)
    if gap is None or set(fs) != seeds:
        return []
    lrs = {arm: c.get("optim.lr") for arm, c in saved.get("chosen", {}).items()}
    return [
        f"- like for like ([like_for_like.md](like_for_like.md)): both arms with rotated_adam, "
        f"each tuned with the same budget on the tuning seeds (lrs {lrs}): AsyncMesh-fp8 ends "
        f"{fmt_interval(gap, pct=True)} from FullSync."
    ]


def _missed_reason(runs: list[dict[str, Any]], out: Path) -> list[str]:
    """Where the headline target is missed, its measured reason under the targets: the gap of
    the tuned AsyncMesh-fp8 with the pipeline's delay removed (scripts/headline_gap.py writes
    decomposition.json beside the table), said to be stale when its runs are not this study's."""
    dp = _by_method(runs, "dp")
    fs, am8 = dp.get("FullSync", {}), dp.get("AsyncMesh-fp8", {})
    path = out / "decomposition.json"
    if not fs or not am8 or _mean(am8) <= _mean(fs) * 1.01 or not path.is_file():
        return []
    loss = _loss_by_seed(path)
    # the decomposition's own FullSync and AsyncMesh-fp8 where it has them (its seeds may be
    # another study's), else this study's
    fs = loss.get("FullSync", fs)
    am8 = loss.get("AsyncMesh-fp8 (the study's)", am8)
    free = loss.get("delay-free pipeline", {})
    gap = paired_interval(am8, fs, relative=True)
    free_gap = paired_interval(free, fs, relative=True)
    if gap is None or free_gap is None:
        return []
    ours = dp["AsyncMesh-fp8"]
    if am8 == ours:
        where = ""
    elif set(am8).isdisjoint(ours):
        where = f", on seeds {_seeds(list(am8))}: re-run scripts/headline_gap.py for this study's"
    else:
        where = ", from runs at an earlier tuning: re-run scripts/headline_gap.py"
    return [
        "",
        f"Why the headline is missed (measured, [decomposition.md](decomposition.md){where}):"
        f" the same AsyncMesh-fp8 with a delay-free pipeline (gpipe, one microbatch per update)"
        f" ends {fmt_interval(free_gap, pct=True)} from FullSync against"
        f" {fmt_interval(gap, pct=True)} asynchronous: the gap is the asynchronous pipeline's"
        " staleness, not the averaging.",
    ]


def _sparta_at_tau(summary: dict[str, Any], out: Path) -> list[str]:
    """Where AsyncSPARTA trails AsyncMesh by less than the target's 0.03 nats (on the study's
    seeds, else on the kept runs'), the same two at another averaging delay
    (scripts/orderings_at_tau.py writes orderings_tau<N>.json): the margin is what a stale
    mean costs without the correction, so it grows with tau. Each says its seeds."""
    dp = _by_method(summary["runs"], "dp")
    kept = summary.get("kept")
    if "AsyncSPARTA" not in dp and kept:
        dp = _by_method(kept["runs"], "dp")
    sparta, am8 = dp.get("AsyncSPARTA", {}), dp.get("AsyncMesh-fp8", {})
    if not sparta or not am8 or _mean(sparta) > _mean(am8) + 0.03:
        return []
    tuned_on = set(summary.get("tuning_seeds") or (kept or {}).get("tuning_seeds", []))
    lines = []
    for path in sorted(out.glob("orderings_tau*.json")):
        loss = _loss_by_seed(path)
        gap = paired_interval(loss.get("AsyncSPARTA", {}), loss.get("AsyncMesh-fp8", {}))
        if gap is not None:
            tau = path.stem.removeprefix("orderings_tau")
            seeds = sorted(gap.diffs)
            if seeds == sorted(summary["seeds"]["dp"]):
                on = "the evaluation seeds"
            elif tuned_on & set(seeds):
                on = f"tuning seeds {_seeds(sorted(tuned_on & set(seeds)))} among them, in sample"
            else:
                on = "not the evaluation seeds"
            lines.append(
                f"AsyncSPARTA minus AsyncMesh-fp8 at tau {tau}, all else as this study "
                f"([{path.stem}.md]({path.stem}.md), seeds {_seeds(seeds)}: {on}): "
                f"{fmt_interval(gap)} nats."
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
            f"Data-parallel study (untuned): FullSync's AdamW at lr "
            f"{DEFAULT_TUNED['FullSync']['optim.lr']:g}, every async method's NAdamW at "
            f"{DEFAULT_TUNED['AsyncMesh-fp8']['optim.lr']:g}."
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
