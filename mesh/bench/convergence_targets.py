"""The convergence study's targets (mesh/bench/convergence_table.py reports them): each one's
verdict and its measured figures, from the study's runs and the kept earlier ones."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Any

from mesh.bench.report import fmt_interval, paired_interval


def _by_method(runs: list[dict[str, Any]], study: str) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for r in runs:
        if r["study"] == study:
            v = r["val_loss"]
            out.setdefault(r["method"], {})[r["seed"]] = math.nan if v is None else v
    return out


def _mean(vals: dict[int, float]) -> float:
    return statistics.mean(vals.values()) if vals else math.nan


def targets(
    runs: list[dict[str, Any]], kept: dict[str, Any] | None = None
) -> list[tuple[str, str, bool | None]]:
    """The issue's convergence targets: (name, measured, met). The DP ones are judged on the
    means over the study's seeds, as the targets read, and carry the paired 95% interval. A DP
    target whose methods the study did not run is judged on the kept runs (kept_runs in
    convergence.py), its measured figure saying on which seeds and that they are in sample."""
    dp, pp = _by_method(runs, "dp"), _by_method(runs, "pp")
    old = _by_method(kept["runs"], "dp") if kept else {}
    # a method not run (a study stopped part way) is nan: its targets read "no result"
    m = defaultdict(lambda: math.nan, {k: _mean(v) for k, v in {**dp, **pp}.items()})
    out: list[tuple[str, str, bool | None]] = []

    def check(name: str, measured: str, ok: bool) -> None:
        out.append((name, measured, ok))

    def interval(
        a: str, b: str, pct: bool = False, on: dict[str, dict[int, float]] | None = None
    ) -> str:
        on = dp if on is None else on
        iv = paired_interval(on.get(a, {}), on.get(b, {}), relative=pct)
        return f"{fmt_interval(iv, pct)}, {len(iv.diffs)} seeds" if iv else "n/a"

    fs, am8 = m["FullSync"], m["AsyncMesh-fp8"]
    check(
        "AsyncMesh-fp8 within 1% of FullSync",
        f"{am8:.4f} vs {fs:.4f}: {interval('AsyncMesh-fp8', 'FullSync', pct=True)}",
        am8 <= fs * 1.01,
    )

    def where(*methods: str) -> dict[str, dict[int, float]] | None:
        """The study's runs where it has all of `methods`, else the kept runs where they do."""
        return next((on for on in (dp, old) if all(k in on for k in methods)), None)

    def said(on: dict[str, dict[int, float]], a: str, b: str) -> str:
        if on is dp:
            return interval(a, b)
        return f"{interval(a, b, on=on)} (seeds {_seeds(list(on[a]))}, {_in_sample(kept)})"

    on = where("AsyncSPARTA", "AsyncMesh-fp8")
    if on is None:
        check("AsyncSPARTA > AsyncMesh + 0.03 nats", "nan", False)
    else:  # the margin to the better AsyncMesh (fp8 or fp32, where it ran beside them)
        best = min(_mean(on[k]) for k in ("AsyncMesh-fp8", "AsyncMesh") if k in on)
        sparta = _mean(on["AsyncSPARTA"])
        check(
            "AsyncSPARTA > AsyncMesh + 0.03 nats",
            f"{sparta:.4f} vs {_mean(on['AsyncMesh-fp8']):.4f}: "
            + said(on, "AsyncSPARTA", "AsyncMesh-fp8"),
            sparta > best + 0.03,
        )
    on = where("AsyncMesh", "DeltaRule")
    if on is None:
        check("AsyncMesh better than the delta rule", "nan", False)
    else:
        am, delta = _mean(on["AsyncMesh"]), _mean(on["DeltaRule"])
        check(
            "AsyncMesh better than the delta rule",
            f"{am:.4f} vs {delta:.4f}: {said(on, 'AsyncMesh', 'DeltaRule')}",
            am < delta,
        )
    b = defaultdict(lambda: math.nan)
    b.update({r["method"]: r["dp_bytes_per_replica_step"] for r in runs if r["study"] == "dp"})
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


def _seeds(seeds: list[int]) -> str:
    """10-17 for a run of consecutive seeds, else 0, 1, 5."""
    seeds = sorted(seeds)
    if len(seeds) > 2 and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}-{seeds[-1]}"
    return ", ".join(map(str, seeds))


def _in_sample(kept: dict[str, Any] | None) -> str:
    """How the kept runs' seeds stand to the tuning: `tuning seeds 0, 1 among them`."""
    tuned_on = sorted(set((kept or {}).get("tuning_seeds", [])) & set(_kept_seeds(kept)))
    if not tuned_on:
        return "not the evaluation seeds"
    return f"tuning seeds {_seeds(tuned_on)} among them, in sample"


def _kept_seeds(kept: dict[str, Any] | None) -> list[int]:
    return sorted({r["seed"] for r in (kept or {}).get("runs", [])})
