"""`meshtrain bench fidelity STUDY`: the AsyncMesh paper's claims beyond its headline, on the
simulator, at the convergence study's tuned settings (results/convergence/tuning.json) and
schedule shares. Each study writes results/fidelity/STUDY/{summary.json, table.md, a plot} and
resumes where it stopped; runs the convergence study already has (same config) are reused.

- precision: DPAvg with fp32, bf16 and fp8 payloads against AsyncMesh-fp8 at tau 10 (the paper:
  DPAvg degrades at bf16 and diverges at fp8, AsyncMesh stays stable); and why fp8 payloads beat
  fp32: fp8 against fp32 for AsyncMesh, SPARTA and the delta rule, and fp32 payloads with fp8's
  noise added (dp.noise_codec: the codec's error on a shuffled payload).
- horizon: AsyncMesh-fp8 and FullSync at 400, 1,600 and 6,400 microbatches per replica: which way
  the gap moves with length (the paper's parity is at 30k updates).
- scaling: AsyncMesh-fp8's gap to DPAvg at m in {2, 4, 8} (P = 4) and P in {4, 8} (m = 2).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

from mesh.bench import simruns
from mesh.bench.regime import data_reference, stamp
from mesh.bench.report import fmt_gap, paired_gap
from mesh.bench.simruns import Spec, run_specs
from mesh.bench.tuning import DEFAULT_TUNED, known_runs, load_tuned, method_overrides
from mesh.config import Config
from mesh.report import format_table, plot_curves

STUDIES = ("precision", "horizon", "scaling")
CONVERGENCE = Path("results/convergence")
ABLATIONS = Path("results/ablations")

# the papers' apply rule: a round's decoded mean written as it is (dp.payload_error_feedback
# off); the rows without "+ feedback" ask the papers' questions, so they run it
PAPER_RULE = {"dp.payload_error_feedback": False}
# (row, DP method, change): the precision study
PRECISION_ROWS: list[tuple[str, str, dict[str, Any]]] = [
    ("DPAvg fp32", "DPAvg", {}),
    ("DPAvg bf16", "DPAvg", {"dp.codec": "bf16", **PAPER_RULE}),
    ("DPAvg fp8", "DPAvg", {"dp.codec": "fp8_e4m3", **PAPER_RULE}),
    ("DPAvg fp8 + feedback", "DPAvg", {"dp.codec": "fp8_e4m3"}),
    ("AsyncMesh-fp8 tau 10", "AsyncMesh-fp8", {"dp.tau": 10, **PAPER_RULE}),
    ("AsyncMesh-fp8 tau 10 + feedback", "AsyncMesh-fp8", {"dp.tau": 10}),
    ("AsyncMesh fp32", "AsyncMesh", {}),
    ("AsyncMesh fp8", "AsyncMesh-fp8", PAPER_RULE),
    ("AsyncMesh fp8 + feedback", "AsyncMesh-fp8", {}),
    ("AsyncMesh fp32 + fp8 noise", "AsyncMesh", {"dp.noise_codec": "fp8_e4m3"}),
    ("SPARTA fp32", "SPARTA", {}),
    ("SPARTA fp8", "SPARTA", {"dp.codec": "fp8_e4m3", **PAPER_RULE}),
    ("DeltaRule fp32", "DeltaRule", {}),
    ("DeltaRule fp8", "DeltaRule", {"dp.codec": "fp8_e4m3", **PAPER_RULE}),
]
HORIZONS = [400, 1600, 6400]
GRIDS = [(4, 2), (4, 4), (4, 8), (8, 2)]


def _spec(
    study: str, row: str, method: str, seed: int, tuned: dict[str, Any], **change: Any
) -> Spec:
    ov = method_overrides(method, tuned)
    ov.update({"grid.stages": 4, "grid.replicas": 2, "pipeline.microbatches": 4})
    ov.update({k.replace("__", "."): v for k, v in change.items()})
    mpu = 4 if method == "FullSync" else 1
    return Spec(study, row, seed, mpu, tuple(ov.items()))


def build_specs(
    study: str, seeds: list[int], tuned: dict[str, Any], deep_lr: float | None = None
) -> list[Spec]:
    """A study's runs; horizon specs carry their budget in the study name (h400, ...). deep_lr:
    the async lr of the 8-stage grids (the ablation study's 8x2 sweep; 8 stages want less)."""
    specs = []
    for seed in seeds:
        if study == "precision":
            for row, method, change in PRECISION_ROWS:
                ch = {k.replace(".", "__"): v for k, v in change.items()}
                specs.append(_spec("precision", row, method, seed, tuned, **ch))
        elif study == "horizon":
            for mbs in HORIZONS:
                for method in ("FullSync", "AsyncMesh-fp8"):
                    specs.append(_spec(f"h{mbs}", method, method, seed, tuned))
        elif study == "scaling":
            for p, m in GRIDS:
                for method in ("DPAvg", "AsyncMesh-fp8"):
                    g: dict[str, Any] = {"grid__stages": p, "grid__replicas": m}
                    if p == 8 and deep_lr is not None:
                        g["optim__lr"] = deep_lr
                    specs.append(_spec(f"{p}x{m}", method, method, seed, tuned, **g))
        else:
            raise ValueError(f"unknown study {study!r}; choose one of {', '.join(STUDIES)}")
    return specs


def run_fidelity(base: Config, study: str, out: Path, quick: bool, workers: int) -> dict[str, Any]:
    # the horizon study is the headline's length question: enough seeds to tell 1% from 2%
    seeds = {"precision": [0, 1], "horizon": [0, 1, 2, 3], "scaling": [0]}.get(study, [0, 1])
    if quick:
        seeds = [0]
    mbs = simruns.QUICK_MICROBATCHES if quick else 1600
    tuned, is_tuned = (DEFAULT_TUNED, False) if quick else load_tuned(CONVERGENCE / "tuning.json")
    ablations = ABLATIONS / "summary.json"
    deep_lr = None
    if study == "scaling" and not quick and ablations.is_file():
        deep_lr = float(json.loads(ablations.read_text())["settings"]["optim.lr"])
    specs = build_specs(study, seeds, tuned, deep_lr)
    budget = {s.study: mbs for s in specs}
    if study == "horizon":
        budget = {f"h{h}": (h // 10 if quick else h) for h in HORIZONS}
    specs.sort(key=lambda s: -budget[s.study] * int(dict(s.overrides)["grid.replicas"]))
    known = known_runs(CONVERGENCE / "tuning.json")
    # runs whose config did not change are not run again: the convergence study's, and this
    # study's own last summary
    if not quick:
        known += known_runs(CONVERGENCE / "summary.json") + known_runs(out / "summary.json")
    start = time.perf_counter()
    runs = run_specs(base, specs, budget, out, workers, study, known)
    summary = {
        "study": study,
        "seeds": seeds,
        "quick": quick,
        "microbatches_per_replica": budget,
        "settings": tuned["AsyncMesh-fp8"] if is_tuned else None,
        "deep_lr": deep_lr,
        "wall_s": round(time.perf_counter() - start, 1),
        "base_config_fingerprint": base.fingerprint(),
        "runs": runs,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    WRITERS[study](summary, out)
    summary.update(stamp(out, study, data_reference(base)))  # the rule (bench/regime.py)
    (out / "runs.partial.jsonl").unlink()
    return summary


def _losses(runs: list[dict[str, Any]], study: str | None = None) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for r in runs:
        if study is None or r["study"] == study:
            v = r["val_loss"]
            out.setdefault(r["method"], {})[r["seed"]] = math.nan if v is None else v
    return out


def _mean(vals: dict[int, float]) -> float:
    return statistics.mean(vals.values()) if vals else math.nan


def _show(vals: dict[int, float]) -> str:
    if not vals:
        return "not run"  # a stopped study's table, written from its runs so far
    m = _mean(vals)
    return "diverged" if not math.isfinite(m) else f"{m:.4f}"


def _header(summary: dict[str, Any], title: str, what: str) -> list[str]:
    s = summary["settings"]
    settings = ", ".join(f"{k} {v:g}" for k, v in s.items()) if s else "untuned defaults"
    return [
        f"# {title}",
        "",
        f"{what} Seeds {summary['seeds']}, quick={summary['quick']}; async settings: {settings}"
        f"; {summary['wall_s']:.0f} s this invocation (mesh/bench/fidelity.py).",
        "",
    ]


def _write_precision(summary: dict[str, Any], out: Path) -> None:
    loss = _losses(summary["runs"])
    rows = [
        [
            r,
            _show(loss.get(r, {})),
            fmt_gap(paired_gap(loss.get(r, {}), loss.get("DPAvg fp32", {}))),
        ]
        for r in (
            "DPAvg fp32",
            "DPAvg bf16",
            "DPAvg fp8",
            "DPAvg fp8 + feedback",
            "AsyncMesh-fp8 tau 10",
            "AsyncMesh-fp8 tau 10 + feedback",
        )
    ]
    pairs = [
        ("AsyncMesh", "AsyncMesh fp8", "AsyncMesh fp32"),
        ("AsyncMesh + feedback (ours)", "AsyncMesh fp8 + feedback", "AsyncMesh fp32"),
        ("AsyncMesh, fp8's noise only", "AsyncMesh fp32 + fp8 noise", "AsyncMesh fp32"),
        ("SPARTA", "SPARTA fp8", "SPARTA fp32"),
        ("delta rule", "DeltaRule fp8", "DeltaRule fp32"),
    ]
    prow = [
        [
            name,
            _show(loss.get(a, {})),
            _show(loss.get(b, {})),
            fmt_gap(paired_gap(loss.get(a, {}), loss.get(b, {}))),
        ]
        for name, a, b in pairs
    ]
    lines = _header(
        summary,
        "Payload precision",
        f"4x2 grid, {summary['microbatches_per_replica']['precision']} microbatches per replica.",
    )
    lines += [
        "## DPAvg at low precision against AsyncMesh-fp8 at tau 10",
        "",
        'Rows without "+ feedback" apply a round\'s decoded mean as the papers do '
        '(dp.payload_error_feedback = false); "+ feedback" is this project\'s default, the '
        "mean applied relative to the replica's own decoded payload.",
        "",
        format_table(["run", "val loss", "gap to DPAvg fp32"], rows),
        "",
        "## What fp8 payloads do (negative: fp8 or its noise is better)",
        "",
        format_table(["method", "fp8 (or + noise)", "fp32", "gap (paired)"], prow),
    ]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    _plot_rows(summary, out / "loss.png", "Payload precision, 4x2 grid")


def _write_horizon(summary: dict[str, Any], out: Path) -> None:
    rows, pts = [], []
    for h in HORIZONS:
        loss = _losses(summary["runs"], f"h{h}")
        fs, am = loss.get("FullSync", {}), loss.get("AsyncMesh-fp8", {})
        gap = paired_gap(am, fs)
        rel = gap[0] / _mean(fs) if gap else math.nan
        tokens = [r["tokens"] for r in summary["runs"] if r["study"] == f"h{h}"]
        rows.append(
            [
                summary["microbatches_per_replica"][f"h{h}"],
                _show(fs),
                _show(am),
                fmt_gap(gap),
                f"{rel:+.2%}",
            ]
        )
        if gap and tokens:
            pts.append((float(tokens[0]), 100 * rel))
    lines = _header(
        summary, "The gap against the horizon", "4x2 grid, same settings at every length."
    )
    lines += [
        format_table(["microbatches/replica", "FullSync", "AsyncMesh-fp8", "gap", "gap %"], rows)
    ]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    plot_curves(
        {"AsyncMesh-fp8 - FullSync": pts},
        out / "gap.png",
        "tokens (all replicas)",
        "gap to FullSync (% of its loss)",
        "The gap against the horizon",
        logx=True,
    )


def _write_scaling(summary: dict[str, Any], out: Path) -> None:
    rows = []
    curves: dict[str, list[tuple[float, float]]] = {"m (P = 4)": [], "P (m = 2)": []}
    for p, m in GRIDS:
        loss = _losses(summary["runs"], f"{p}x{m}")
        dp, am = loss.get("DPAvg", {}), loss.get("AsyncMesh-fp8", {})
        gap = paired_gap(am, dp)
        rows.append([f"{p}x{m}", _show(dp), _show(am), fmt_gap(gap)])
        if gap:
            if p == 4:
                curves["m (P = 4)"].append((m, gap[0]))
            if m == 2:
                curves["P (m = 2)"].append((p, gap[0]))
    lines = _header(
        summary,
        "Grid scaling: AsyncMesh-fp8 against DPAvg",
        f"{summary['microbatches_per_replica'][f'{GRIDS[0][0]}x{GRIDS[0][1]}']} microbatches "
        "per replica on every grid (a larger m reads more tokens in all)."
        + (
            f" The 8-stage grid runs both methods at lr {summary['deep_lr']:g}, the ablation "
            "study's sweep on 8x2 (the 4x2 lr is too high for 8 stages)."
            if summary.get("deep_lr")
            else ""
        ),
    )
    lines += [
        format_table(["grid (PxM)", "DPAvg", "AsyncMesh-fp8", "gap (AsyncMesh - DPAvg)"], rows)
    ]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    plot_curves(
        curves, out / "gap.png", "m or P", "AsyncMesh-fp8 - DPAvg (nats)", "Grid scaling", logx=True
    )


def _plot_rows(summary: dict[str, Any], path: Path, title: str) -> None:
    grouped: dict[str, list[list[dict[str, float]]]] = {}
    for r in summary["runs"]:
        if r["curve"]:
            grouped.setdefault(r["method"], []).append(r["curve"])
    curves = {}
    for row, cs in grouped.items():
        n = min(map(len, cs))
        curves[row] = [
            (cs[0][k]["tokens"], statistics.mean(c[k]["val_loss"] for c in cs)) for k in range(n)
        ]
    plot_curves(curves, path, "tokens (all replicas)", "validation loss (nats/byte)", title)


WRITERS = {"precision": _write_precision, "horizon": _write_horizon, "scaling": _write_scaling}
