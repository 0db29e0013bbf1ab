"""The depth study's outputs (mesh/bench/depth.py): summary.json, table.md, and the plots of the
gap to FullSync against the depth and against the tokens."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from mesh.bench.depth_arms import (
    FULLSYNC,
    LONG_FACTOR,
    LONG_SEEDS,
    RECOMMENDED,
    REFERENCE,
    SCREEN_P,
    TUNE_SEED,
    WIDTH,
    WIDTH_LAYERS,
    WIDTH_PREFIX,
    Arm,
    label,
    same_optimizer_of,
    settings_of,
)
from mesh.bench.regime import rule_line
from mesh.bench.report import fmt_interval, paired_interval, study_scale
from mesh.config import Config
from mesh.report import format_table, pyplot


def summarize(
    base: Config,
    study: Any,
    screen_p: int,
    stages: tuple[int, ...],
    seeds: list[int],
    tuned: dict[str, dict[str, Any]],
    best_at: dict[int, Arm],
    finals_at: dict[int, list[Arm]],
    microbatches: int,
    long_arms: list[Arm] | None = None,
    width: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What the runs so far say: the screen, the picks, the finals' rows and the settings that
    reproduce the recommended candidate and FullSync at each depth (best_at: each depth's
    recommended candidate; finals_at: the arms its report seeds run)."""
    best = best_at.get(screen_p)
    rows: list[dict[str, Any]] = []
    recommended: dict[str, Any] = {}
    fullsync: dict[str, Any] = {}
    by_tokens: dict[str, Any] = {}
    for p in stages:
        here = finals_at.get(p, [])
        rec = best_at.get(p)
        losses = {a.name: _seed_losses(study, label(p, a.name), seeds) for a in here}
        for a in here:
            lr = tuned.get(label(p, a.name), {}).get("best_lr")
            is_best = rec is not None and a.name == rec.name
            rows.append(_final_row(p, a, losses, lr, is_best))
            if lr is not None and (is_best or a.name == FULLSYNC):
                where = recommended if is_best else fullsync
                where[str(p)] = {
                    "candidate": a.name,
                    "lr": lr,
                    "set": settings_of(base, a, p, lr, microbatches),
                }
        curves = {
            name: _gap_curve(study, label(p, name), label(p, FULLSYNC), seeds)
            for name in ([rec.name] if rec else []) + [REFERENCE]
        }
        by_tokens[str(p)] = {
            (RECOMMENDED if rec and name == rec.name else name): c
            for name, c in curves.items()
            if c
        }
    long = _long(study, screen_p, seeds, best, long_arms or [])
    wide = _width(study, seeds, best, width or {})
    screen = [
        {**row, "label": key}
        for key, row in tuned.items()
        if row["P"] == screen_p and not key.startswith("d")
    ]
    complete = (
        bool(rows)
        and all(r["seeds"] == sorted(seeds) for r in rows)
        and set(stages) == {r["P"] for r in rows}
    )
    return {
        **study_scale(base),
        "microbatches_per_run": microbatches,
        "tokens_per_run": microbatches * base.tokens_per_microbatch,
        "seeds": seeds,
        "tune_seed": TUNE_SEED,
        "screen_P": screen_p,
        "stages": list(stages),
        "screen": screen,
        "picks": [a.name for a in finals_at.get(screen_p, []) if a.lever],
        "recommended_candidate": best.name if best else None,
        "recommended_by_depth": {str(p): a.name for p, a in best_at.items()},
        "rows": rows,
        "recommended": recommended,
        "fullsync": fullsync,
        "gap_vs_tokens": by_tokens,
        "long": long,
        "width": wide,
        "sweeps": {k: v for k, v in tuned.items()},
        "complete": complete,
        "cpu_s_of_runs": round(sum(r.get("wall_s", 0) for r in study.runs.values()), 1),
        "runs": study.all_runs(),
    }


def _final_row(
    p: int, a: Arm, losses: dict[str, dict[int, float]], lr: float | None, is_best: bool
) -> dict[str, Any]:
    """One arm's row of the finals at depth p: its seeds' losses and its gap paired by seed
    against FullSync (and against FullSync with its optimizer, where the finals have it)."""
    iv = paired_interval(losses[a.name], losses.get(FULLSYNC, {}), relative=True)
    opt = a.lever.get("optim.name")
    same = losses.get(f"{FULLSYNC} {opt}") if opt else None
    iv_same = None if not same else paired_interval(losses[a.name], same, relative=True)
    return {
        "P": p,
        "arm": RECOMMENDED if is_best else a.name,
        "candidate": a.name,
        "lr": lr,
        "seeds": sorted(losses[a.name]),
        "val_loss": _mean(list(losses[a.name].values())),
        "per_seed": {str(s): round(v, 5) for s, v in losses[a.name].items()},
        "gap_pct": None if iv is None else round(100 * iv.mean, 3),
        "gap_se_pct": None if iv is None or not math.isfinite(iv.se) else round(100 * iv.se, 3),
        "gap_ci95_pct": None
        if iv is None or not math.isfinite(iv.low)
        else [round(100 * iv.low, 3), round(100 * iv.high, 3)],
        "gap": fmt_interval(iv, pct=True),
        "gap_same_optimizer_pct": None if iv_same is None else round(100 * iv_same.mean, 3),
        "gap_same_optimizer": None if iv_same is None else fmt_interval(iv_same, pct=True),
    }


def _long(
    study: Any, p: int, seeds: list[int], best: Arm | None, arms: list[Arm]
) -> dict[str, Any] | None:
    """The recommended arm against FullSync at LONG_FACTOR x the tokens, on the first LONG_SEEDS
    report seeds (paired by seed; an interval from two)."""
    if best is None or not arms:
        return None
    seeds = seeds[:LONG_SEEDS]
    rec = _losses_of(study.get_long, label(p, best.name), seeds)
    sync = _losses_of(study.get_long, label(p, FULLSYNC), seeds)
    iv = paired_interval(rec, sync, relative=True)
    # FullSync with the arm's optimizer, where the long run has it
    same = same_optimizer_of(p, best)
    ran = same is not None and any(a.name == same.name for a in arms)
    held = _losses_of(study.get_long, label(p, same.name), seeds) if ran and same else {}
    iv_same = paired_interval(rec, held, relative=True) if held else None
    both = sorted(set(rec) & set(sync))
    return {
        "P": p,
        "seeds": sorted(rec),  # the recommended arm's; each baseline's gap pairs the seeds it has
        "FullSync_seeds": both,
        "FullSync_same_optimizer_seeds": sorted(set(rec) & set(held)),
        "tokens_factor": LONG_FACTOR,
        "recommended": _mean([rec[s] for s in sorted(rec)]),
        "FullSync": _mean([sync[s] for s in both]),
        "per_seed": {str(s): [rec.get(s), sync.get(s), held.get(s)] for s in seeds},
        "gap_pct": None if iv is None else round(100 * iv.mean, 3),
        "gap": fmt_interval(iv, pct=True),
        "FullSync_same_optimizer": _mean([held[s] for s in sorted(held)]),
        "gap_same_optimizer_pct": None if iv_same is None else round(100 * iv_same.mean, 3),
        "gap_same_optimizer": fmt_interval(iv_same, pct=True),
        "gap_vs_tokens": _gap_curve(study, label(p, best.name), label(p, FULLSYNC), both, "long"),
    }


def _width(
    study: Any, seeds: list[int], best: Arm | None, width: dict[str, Any]
) -> dict[str, Any] | None:
    """The recommended arm, the reference and FullSync at d 192 x 8, P = 8, paired by seed."""
    if best is None or not width:
        return None
    losses = {
        name: _losses_of(study.get, WIDTH_PREFIX + label(SCREEN_P, name), seeds)
        for name in (best.name, REFERENCE, FULLSYNC)
    }
    rows = []
    for name, got in losses.items():
        iv = paired_interval(got, losses[FULLSYNC], relative=True)
        rows.append(
            {
                "arm": RECOMMENDED if name == best.name else name,
                "candidate": name,
                "lr": width["lrs"].get(name),
                "val_loss": _mean(list(got.values())),
                "seeds": sorted(got),
                "gap_pct": None if iv is None else round(100 * iv.mean, 3),
                "gap": fmt_interval(iv, pct=True),
            }
        )
    return {"d_model": WIDTH, "n_layers": WIDTH_LAYERS, "P": SCREEN_P, "rows": rows}


def _losses_of(get: Any, name: str, seeds: list[int]) -> dict[int, float]:
    out = {}
    for s in seeds:
        r = get(name, s)
        if r is not None and not r.get("diverged") and r.get("val_loss") is not None:
            out[s] = float(r["val_loss"])
    return out


def _seed_losses(study: Any, name: str, seeds: list[int]) -> dict[int, float]:
    return _losses_of(study.get, name, seeds)


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if math.isfinite(x)]
    return round(sum(xs) / len(xs), 5) if xs else None


def interpolate(curve: list[dict[str, Any]], tokens: float) -> float | None:
    """A run's validation loss at `tokens`, linear between its evaluations (None outside)."""
    pts = sorted((c["tokens"], c["val_loss"]) for c in curve if c.get("val_loss") is not None)
    for (t0, v0), (t1, v1) in zip(pts, pts[1:]):
        if t0 <= tokens <= t1:
            return v0 if t1 == t0 else v0 + (v1 - v0) * (tokens - t0) / (t1 - t0)
    if pts and pts[-1][0] == tokens:
        return pts[-1][1]
    return None


def _gap_curve(
    study: Any, name: str, sync: str, seeds: list[int], kind: str = ""
) -> list[list[float]]:
    """[tokens, gap %] at FullSync's evaluations, the mean over the seeds both have of the
    arm's loss (interpolated there) against FullSync's (kind "long": the long runs')."""
    get = study.get_long if kind == "long" else study.get
    per_seed = []
    for s in seeds:
        a, f = get(name, s), get(sync, s)
        if a is None or f is None:
            continue
        gaps = {}
        for c in f.get("curve", []):
            v = interpolate(a.get("curve", []), c["tokens"])
            if v is not None and c.get("val_loss"):
                gaps[c["tokens"]] = 100 * (v / c["val_loss"] - 1)
        per_seed.append(gaps)
    if not per_seed:
        return []
    common = sorted(set.intersection(*(set(g) for g in per_seed)))
    return [[t, round(sum(g[t] for g in per_seed) / len(per_seed), 3)] for t in common]


def table(summary: dict[str, Any]) -> str:
    m = summary["model"]
    head = (
        f"# Depth at parity: the async pipeline against FullSync at equal tokens\n\n"
        f"Model: {m['arch']} d {m['d_model']} x {m['n_layers']} ({summary['params'] / 1e6:.2f}M "
        f"parameters), vocab {m['vocab_size']}, seq_len {m['seq_len']}; "
        f"{summary['tokens_per_run']:,} tokens a run ({summary['microbatches_per_run']} "
        f"microbatches of {summary['microbatch_tokens']}), one replica (grid P x 1), the logical "
        f"simulator. Screen at P = {summary['screen_P']} on seed {summary['tune_seed']} (never "
        f"reported); finals on seeds {summary['seeds']}.\n"
    )
    parts = [head, rule_line(summary), ""]
    if summary["rows"]:
        parts += [
            "## Finals: gap to FullSync (paired by seed, share of FullSync's loss)",
            "",
            _finals_table(summary["rows"]),
            "",
        ]
    long = summary.get("long")
    if long and long.get("gap_pct") is not None:
        parts += [
            f"## {long['tokens_factor']}x the tokens, P = {long['P']}, "
            f"{_seeds(long['seeds'])} (paired by seed)",
            "",
            f"recommended {_per_seed(long, 0)} against FullSync {_per_seed(long, 1)} "
            f"({_seeds(long['FullSync_seeds'])}): {long['gap']}."
            + (
                f" FullSync with its optimizer {_per_seed(long, 2)} "
                f"({_seeds(long['FullSync_same_optimizer_seeds'])}): "
                f"{long['gap_same_optimizer']}."
                if long.get("gap_same_optimizer_pct") is not None
                else ""
            ),
            "",
        ]
    wide = summary.get("width")
    if wide and wide.get("rows"):
        parts += [
            f"## Width: d {wide['d_model']} x {wide['n_layers']} at P = {wide['P']}, gap to "
            "FullSync",
            "",
            format_table(
                ["arm", "candidate", "lr", "val loss", "gap (mean +- SE [95% t])", "seeds"],
                [
                    [
                        r["arm"],
                        r["candidate"],
                        "n/a" if r["lr"] is None else f"{r['lr']:g}",
                        "not run" if r["val_loss"] is None else f"{r['val_loss']:.4f}",
                        r["gap"],
                        len(r["seeds"]),
                    ]
                    for r in wide["rows"]
                ],
            ),
            "",
        ]
    parts += [
        f"## Screen at P = {summary['screen_P']} (seed {summary['tune_seed']}): each arm's lr "
        "sweep",
        "",
        _sweep_table(summary["screen"]),
    ]
    for p in summary["stages"]:
        rows = [r for r in summary.get("sweeps", {}).values() if r["P"] == p]
        if p != summary["screen_P"] and rows:
            parts += [
                "",
                f"## Tuning at P = {p} (seed {summary['tune_seed']}): the finals' lr sweeps "
                f"and the depth's own candidates (recommended: "
                f"{summary.get('recommended_by_depth', {}).get(str(p), 'not yet')})",
                "",
                _sweep_table(rows),
            ]
    parts.append("")
    if summary.get("levers_left_out"):
        parts.append(
            f"Screened so far without: {', '.join(summary['levers_left_out'])} (the picks are "
            "made among the arms screened; `meshtrain bench depth` screens every arm)."
        )
        parts.append("")
    pick = summary.get("study_pick_by_depth", {}).get(str(summary["screen_P"]))
    parts.append(
        f"Picks: {', '.join(summary['picks']) or 'not yet'}; the study's pick at P = "
        f"{summary['screen_P']}: {pick or 'not yet'}; recommended (what `optim.depth_rule` "
        f"ships): {summary['recommended_candidate'] or 'not yet'}. The complete study: "
        f"{'yes' if summary['complete'] else 'no (runs missing: `meshtrain bench depth` resumes)'}."
    )
    return "\n".join(parts) + "\n"


def _seeds(seeds: list[int]) -> str:
    return f"seed{'s' if len(seeds) != 1 else ''} {', '.join(map(str, seeds))}"


def _per_seed(long: dict[str, Any], k: int) -> str:
    """One arm's long-run losses by seed ("1.3963 / 1.3965"): k 0 the recommended arm, 1
    FullSync, 2 FullSync with its optimizer."""
    vals = [v[k] for _, v in sorted(long["per_seed"].items()) if v[k] is not None]
    return " / ".join(f"{v:.4f}" for v in vals)


def _finals_table(rows: list[dict[str, Any]]) -> str:
    return format_table(
        [
            "P",
            "arm",
            "candidate",
            "lr",
            "val loss",
            "gap (mean +- SE [95% t])",
            "vs FullSync, same optimizer",
            "seeds",
        ],
        [
            [
                r["P"],
                r["arm"],
                r["candidate"],
                "n/a" if r["lr"] is None else f"{r['lr']:g}",
                "not run" if r["val_loss"] is None else f"{r['val_loss']:.4f}",
                r["gap"],
                r["gap_same_optimizer"] or "",
                len(r["seeds"]),
            ]
            for r in rows
        ],
    )


def _sweep_table(rows: list[dict[str, Any]]) -> str:
    """Each arm's lr sweep on the tuning seed, best first, against FullSync's best there."""
    sync = next((r["best_loss"] for r in rows if r["arm"] == FULLSYNC and r["best_loss"]), None)
    return format_table(
        ["arm", "lr: val loss", "best lr", "inside its grid", "best loss", "vs FullSync"],
        [
            [
                r["arm"],
                ", ".join(
                    f"{lr}: {'...' if v is None else f'{v:.4f}'}" for lr, v in r["lrs"].items()
                ),
                "n/a" if r["best_lr"] is None else f"{r['best_lr']:g}",
                {True: "yes", False: "no", None: "fixed lrs"}[r["inside"]],
                "n/a" if r["best_loss"] is None else f"{r['best_loss']:.4f}",
                "n/a"
                if not (sync and r["best_loss"])
                else f"{100 * (r['best_loss'] / sync - 1):+.2f}%",
            ]
            for r in sorted(rows, key=lambda r: r["best_loss"] or math.inf)
        ],
    )


def write_outputs(summary: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "table.md").write_text(table(summary))
    plot(summary, out)


def plot(summary: dict[str, Any], out: Path) -> None:
    """gap.png: the gap to FullSync against P (recommended and reference, with each one's 95%
    interval where it has one) and, beside it, against the tokens at each depth."""
    plt = pyplot()
    if plt is None or not summary["rows"]:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=110)
    for arm in (RECOMMENDED, REFERENCE):
        pts = sorted(
            (r["P"], r["gap_pct"], r["gap_ci95_pct"])
            for r in summary["rows"]
            if r["arm"] == arm and r["gap_pct"] is not None
        )
        if pts:
            xs = [p for p, _, _ in pts]
            ys = [g for _, g, _ in pts]
            err = [
                [g - (ci[0] if ci else g) for _, g, ci in pts],
                [(ci[1] if ci else g) - g for _, g, ci in pts],
            ]
            left.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=arm)
    left.set_xscale("log", base=2)
    _gap_axes(left, "pipeline stages P", "gap against depth (paired seeds, 95% t interval)")
    for p, arms in summary["gap_vs_tokens"].items():
        for arm, curve in arms.items():
            if curve:
                xs, ys = zip(*curve, strict=True)
                style = "-" if arm == RECOMMENDED else "--"
                right.plot(xs, ys, style, marker=".", label=f"P = {p} {arm}")
    _gap_axes(right, "tokens", "gap against tokens")
    fig.tight_layout()
    fig.savefig(out / "gap.png")
    plt.close(fig)


def _gap_axes(ax: Any, xlabel: str, title: str) -> None:
    """A gap plot's zero line, labels and grid, and a legend where something is drawn."""
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("val loss gap to FullSync (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
