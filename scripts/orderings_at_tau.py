"""The convergence study's orderings (AsyncMesh against AsyncSPARTA and the delta rule) at
another averaging delay tau than the tuned one, everything else at the study's tuned settings,
seeds and budget (session 13: the re-tune chose tau 2, where a stale mean is two updates old and
the drift correction has little to correct; the paper's runs and session 12's used tau 5).

    python3 scripts/orderings_at_tau.py [--tau 5] [--workers 2] [--out results/convergence]
                                        [--seeds 10,11,...]  (default: the study's seeds)

Writes orderings_tau<N>.md and .json beside the study's table; about 10 minutes here with the
default two methods.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

METHODS = "AsyncMesh-fp8,AsyncSPARTA"  # the default --methods (AsyncMesh-fp8 is always run)


def main() -> None:
    from mesh.bench.convergence import cached_losses, study_variants
    from mesh.bench.report import fmt_interval, paired_interval
    from mesh.bench.simruns import run_specs
    from mesh.bench.tuning import load_tuned, tuning_seeds
    from mesh.config import load_config
    from mesh.report import format_table

    ap = argparse.ArgumentParser()
    ap.add_argument("--tau", type=int, default=5)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default="results/convergence")
    ap.add_argument("--methods", default=METHODS, help="comma-separated DP methods")
    ap.add_argument("--seeds", default="", help="comma-separated seeds (default: the study's)")
    a = ap.parse_args()
    methods = ["AsyncMesh-fp8", *(m for m in a.methods.split(",") if m != "AsyncMesh-fp8")]
    out = Path(a.out)
    variants = [(m, m, {"dp.tau": a.tau}) for m in methods]
    chosen = [int(s) for s in a.seeds.split(",")] if a.seeds else None
    study, specs, budget = study_variants(out, "orderings", variants, chosen)
    seeds = sorted({s.seed for s in specs})
    tuned, _ = load_tuned(out / "tuning.json")
    runs = run_specs(
        load_config([]),
        specs,
        budget,
        Path(f"runs/orderings_tau{a.tau}"),
        a.workers,
        f"tau {a.tau}",
    )
    loss: dict[str, dict[int, float]] = {}
    for r in runs:
        loss.setdefault(r["method"], {})[r["seed"]] = r["val_loss"]
    fs = cached_losses(load_config([]), out, "FullSync", seeds)  # the study's, where it has it
    rows = []
    for method in methods:
        vals = loss[method]
        mean = sum(vals.values()) / len(vals)
        rows.append(
            [
                method,
                f"{mean:.4f}",
                fmt_interval(paired_interval(vals, fs)),
                fmt_interval(paired_interval(vals, loss["AsyncMesh-fp8"])),
            ]
        )
    lines = [
        f"# The orderings at tau = {a.tau}",
        "",
        f"The convergence study's 4x2 grid, {budget['orderings']} microbatches per replica, seeds "
        f"{seeds} (tuned on {tuning_seeds(out / 'tuning.json')}); every async method at the "
        f"study's tuned settings except dp.tau = {a.tau} (tuned: "
        f"{tuned['AsyncMesh-fp8'].get('dp.tau', 5)}); FullSync is the study's. Gaps paired by "
        "seed: mean +- SE [95% t interval] (scripts/orderings_at_tau.py).",
        "",
        format_table(
            [
                "method",
                "val loss (mean)",
                "gap to FullSync (paired)",
                "gap to AsyncMesh-fp8 (paired)",
            ],
            rows,
        ),
        "",
    ]
    (out / f"orderings_tau{a.tau}.md").write_text("\n".join(lines))
    (out / f"orderings_tau{a.tau}.json").write_text(json.dumps({"loss": loss}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
