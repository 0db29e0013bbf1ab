"""Updates to target, the study's targets, and the per-configuration statistics the report reads."""

from __future__ import annotations

import math
import statistics
from typing import Any

from mesh.bench.optimizers.protocol import ASYNC_OPTIMIZERS, TWO_BW_P
from mesh.bench.report import fmt_gap, paired_gap


def steps_to_target(curve: list[dict[str, float]], target: float) -> int | None:
    """First update at which the validation loss is <= target, linearly interpolated between
    the evaluation before and the one that crossed; None when never reached."""
    prev: dict[str, float] | None = None
    for pt in curve:
        if pt["val_loss"] <= target:
            if prev is None or prev["val_loss"] == pt["val_loss"]:
                return int(pt["step"])
            frac = (prev["val_loss"] - target) / (prev["val_loss"] - pt["val_loss"])
            return int(round(prev["step"] + frac * (pt["step"] - prev["step"])))
        prev = pt
    return None


def _is_reference(r: dict[str, Any], study: str) -> bool:
    """The delay-free adamw runs that define a study's target."""
    if r["optimizer"] != "adamw" or r["error_feedback"] or r["study"] != study:
        return False
    return r["stages"] == 1 if study == "async" else r["schedule"] == "gpipe"


def default_target(runs: list[dict[str, Any]], study: str) -> float | None:
    """Mean over seeds of the delay-free adamw validation loss at half the horizon."""
    vals = []
    for r in runs:
        if _is_reference(r, study) and r["curve"]:
            half = r["horizon_steps"] / 2
            vals.append(min(r["curve"], key=lambda pt: abs(pt["step"] - half))["val_loss"])
    return statistics.mean(vals) if vals else None


def reachable_target(runs: list[dict[str, Any]], study: str) -> float | None:
    """The tightest loss every run of a study reaches within its horizon: the worst run's best
    evaluation, rounded up to 0.01. With it every run has an updates-to-target (the worst one
    at its horizon), so the depth trend is measured instead of censored."""
    best = [min(p["val_loss"] for p in r["curve"]) for r in runs if r["study"] == study]
    return math.ceil(max(best) * 100) / 100 if best else None


def _group(runs: list[dict[str, Any]], study: str) -> dict[tuple[str, int], list[dict[str, Any]]]:
    out: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in runs:
        if r["study"] == study:
            out.setdefault((r["label"], r["stages"]), []).append(r)
    return out


def _s2t(rs: list[dict[str, Any]]) -> tuple[float, bool]:
    """Mean updates to target over seeds; a seed that never reached it counts as its horizon,
    and the flag says the mean is then only a lower bound."""
    vals = [r["steps_to_target"] if r["steps_to_target"] is not None else r["steps"] for r in rs]
    return statistics.mean(vals), any(r["steps_to_target"] is None for r in rs)


def _loss(rs: list[dict[str, Any]] | None) -> float:
    if not rs or any(r["val_loss"] is None for r in rs):
        return math.nan
    return statistics.mean(r["val_loss"] for r in rs)


def _by_seed(rs: list[dict[str, Any]] | None, key: str = "val_loss") -> dict[int, float]:
    return {r["seed"]: (math.nan if r[key] is None else r[key]) for r in rs or []}


def _mean_field(rs: list[dict[str, Any]] | None, key: str) -> float:
    vals = [r[key] for r in rs or [] if r[key] is not None]
    return statistics.mean(vals) if vals else math.nan


def _async_labels(g: dict[tuple[str, int], list[dict[str, Any]]]) -> list[str]:
    order = [o + ("+SA" if sa else "") for o, sa in ASYNC_OPTIMIZERS]
    return [lab for lab in order if any(k[0] == lab for k in g)]


Target = tuple[str, str, bool | None, str]  # (name, measured, met or None, note)
Groups = dict[tuple[str, int], list[dict[str, Any]]]  # (label, P) -> its runs (_group)


def targets(summary: dict[str, Any]) -> list[tuple[str, str, bool | None, str]]:
    """The issue's targets: (name, measured, met or None when inconclusive, note)."""
    runs = summary["runs"]
    a, b = _group(runs, "async"), _group(runs, "2bw")
    stages = sorted({p for _, p in a})
    lo, hi = (stages[0], stages[-1]) if stages else (1, 1)
    out: list[Target] = [_growth_target(a, lo, hi)]
    rotation = _rotation_target(a, hi)
    if rotation is not None:
        out.append(rotation)
    out += _error_feedback_targets(b)
    out += _time_targets(summary, stages)
    out.append(_memory_target(a, stages))
    stage_aware = _stage_aware_info(a, hi)
    if stage_aware is not None:
        out.append(stage_aware)
    return out


def _growth(a: Groups, label: str, lo: int, hi: int) -> tuple[float, float, bool]:
    """(extra updates from P=lo to P=hi, their ratio, extra is only a lower bound)."""
    r_hi, r_lo = a.get((label, hi)), a.get((label, lo))
    if not r_hi or not r_lo or _s2t(r_lo)[1]:
        return math.nan, math.nan, False
    (s_hi, c_hi), (s_lo, _) = _s2t(r_hi), _s2t(r_lo)
    return s_hi - s_lo, s_hi / s_lo, c_hi


def _faster(x: tuple[float, float, bool], y: tuple[float, float, bool]) -> bool | None:
    """Does x grow more than y? None when the censoring leaves it open."""
    (ex, _, cx), (ey, _, cy) = x, y
    if not (math.isfinite(ex) and math.isfinite(ey)) or (cx and cy):
        return None
    if ex > ey:
        return None if cy else True
    return None if cx else False


def _growth_target(a: Groups, lo: int, hi: int) -> Target:
    """Whether adamw's updates-to-target grow with depth faster than the others'."""
    ga = _growth(a, "adamw", lo, hi)
    gr = _growth(a, "rotated_adam", lo, hi)
    gm = _growth(a, "muon", lo, hi)
    verdicts = [_faster(ga, gr), _faster(ga, gm)]
    ok = False if False in verdicts else (True if all(verdicts) else None)
    measured = f"P={lo}->{hi}: " + ", ".join(
        f"{n} {g[0]:+.0f}{'+' if g[2] else ''} ({g[1]:.2f}x)"
        for n, g in (("adamw", ga), ("rotated_adam", gr), ("muon", gm))
    )
    return (
        "adamw's updates-to-target grow with P faster than rotated_adam's and muon's",
        measured,
        ok,
        "growth = extra updates to target at the deepest P over P=1 (ratio in brackets); '+' "
        "= a seed never reached it, counted at the horizon, so the growth is a lower bound",
    )


def _rotation_target(a: Groups, hi: int) -> Target | None:
    """At the deepest P, whether rotated_adam needs >= 30% fewer updates than adamw (None
    without both)."""
    ra, rr = a.get(("adamw", hi)), a.get(("rotated_adam", hi))
    if not (ra and rr):
        return None
    (sa, csa), (sr, csr) = _s2t(ra), _s2t(rr)
    red = 1 - sr / sa
    if csr:
        ok = None if csa else False
    else:
        ok = red >= 0.3 if not csa or red >= 0.3 else None
    return (
        f"P={hi}: rotated_adam needs >= 30% fewer updates than adamw",
        f"{sr:.0f}{'+' if csr else ''} vs {sa:.0f}{'+' if csa else ''}: "
        f"{100 * red:.1f}% fewer{' (at least)' if csa and not csr else ''}",
        ok,
        "",
    )


def _error_feedback_targets(b: Groups) -> list[Target]:
    """For adamw and muon: whether error feedback narrows 2bw's loss gap to gpipe."""
    out: list[Target] = []
    for opt in ("adamw", "muon"):
        ref = _by_seed(b.get((f"gpipe {opt}", TWO_BW_P)))
        g0 = paired_gap(_by_seed(b.get((f"2bw {opt}", TWO_BW_P))), ref)
        g1 = paired_gap(_by_seed(b.get((f"2bw {opt} +EF", TWO_BW_P))), ref)
        out.append(
            (
                f"2bw: error feedback reduces {opt}'s gap to gpipe (val loss)",
                f"{fmt_gap(g0)} -> {fmt_gap(g1)}",
                None if g0 is None or g1 is None else g1[0] < g0[0],
                "",
            )
        )
    return out


def _time_targets(summary: dict[str, Any], stages: list[int]) -> list[Target]:
    """rotated_adam's time per update against adamw's, and (for information) the stage-aware
    variant's."""
    times = _timing(summary)
    ratios = {}
    for label in ("rotated_adam", "rotated_adam+SA"):
        rs = [times[(label, p)][0] / times[("adamw", p)][0] for p in stages if (label, p) in times]
        ratios[label] = [x for x in rs if math.isfinite(x)]
    rt, rt_sa = ratios["rotated_adam"], ratios["rotated_adam+SA"]
    return [
        (
            "rotated_adam time per update <= 1.5x adamw's",
            f"{statistics.mean(rt):.2f}x mean over P (max {max(rt):.2f}x)" if rt else "n/a",
            (max(rt) <= 1.5) if rt else None,
            "whole simulated update (all stages), same P, timed side by side",
        ),
        (
            "(info) rotated_adam+SA time per update vs adamw",
            f"{statistics.mean(rt_sa):.2f}x mean over P (max {max(rt_sa):.2f}x)"
            if rt_sa
            else "n/a",
            None,
            "stage-aware refreshes the deepest stages' bases every update",
        ),
    ]


def _memory_target(a: Groups, stages: list[int]) -> Target:
    """rotated_adam's largest extra state on a stage, reported."""
    mem = _memory_rows(a, stages)
    biggest = max(mem, key=lambda m: m[2], default=None)
    return (
        "rotated_adam's extra memory reported per stage",
        f"max +{biggest[2] / 1024:.1f} KiB on a stage at P={biggest[0]}" if biggest else "n/a",
        True if biggest else None,
        "see the cost table",
    )


def _stage_aware_info(a: Groups, hi: int) -> Target | None:
    """(info) at the deepest P, stage-aware rotation's updates against plain rotation's (None
    without both)."""
    rs_, rp = a.get(("rotated_adam+SA", hi)), a.get(("rotated_adam", hi))
    if not (rs_ and rp):
        return None
    (s1, c1), (s0, c0) = _s2t(rs_), _s2t(rp)
    return (
        f"(info) P={hi}: stage-aware vs plain rotation (paper: +29.2% speed)",
        f"{s1:.0f}{'+' if c1 else ''} vs {s0:.0f}{'+' if c0 else ''} updates "
        f"({100 * (1 - s1 / s0):+.1f}% fewer)",
        None,
        "",
    )


def _timing(summary: dict[str, Any]) -> dict[tuple[str, int], tuple[float, float]]:
    """(label, P) -> (ms per update, optimizer ms per update): the side-by-side timing when
    the summary has it, else the mean over each configuration's runs."""
    if summary.get("timing"):
        return {
            (t["label"], t["stages"]): (t["ms_per_step"], t["opt_ms_per_step"])
            for t in summary["timing"]
        }
    a = _group(summary["runs"], "async")
    return {
        k: (_mean_field(rs, "ms_per_step"), _mean_field(rs, "opt_ms_per_step"))
        for k, rs in a.items()
    }


def _memory_rows(
    a: dict[tuple[str, int], list[dict[str, Any]]], stages: list[int]
) -> list[tuple[int, int, int]]:
    """(P, adamw bytes of the largest stage, rotated_adam's largest extra bytes on a stage)."""
    rows = []
    for p in stages:
        ad, ro = a.get(("adamw", p)), a.get(("rotated_adam", p))
        if ad and ro:
            b_ad, b_ro = ad[0]["state_bytes_per_stage"], ro[0]["state_bytes_per_stage"]
            extra = [y - x for x, y in zip(b_ad, b_ro, strict=True)]
            rows.append((p, max(b_ad), max(extra)))
    return rows
