"""Where the 4-stage default's gap to FullSync with Muon comes from: the convergence study's
AsyncMesh-fp8 with `optim.depth_rule = auto` (Muon at P = 4) with one ingredient removed at a
time, at the study's settings and budget, on its tuning seeds 0 and 1, against FullSync with Muon
at its tuned lr (scripts/convergence_muon.py). The NAdamW decomposition is headline_gap.py's.

    python3 scripts/muon_gap.py [--workers 2] [--out results/convergence] [--seeds 0 1]

- delay-free pipeline: gpipe with one microbatch per update instead of the asynchronous
  schedule, Muon as the rule gives it (the rule resolves on the async schedule only), still the
  sparse fp8 averaging;
- ... and exact data parallelism: FullSync's gradient all-reduce (fp32) instead;
- 2BW: one update every M = 4 microbatches (FullSync's), one update stale, with Muon and error
  feedback (arXiv 2606.30634's recipe), at a quarter of the updates;
- blocking averaging: the 5% rounds land at once (dp.tau = 0) instead of 5 steps late;
- dense averaging: every coordinate each round (dp.fraction = 1);
- the other rows are the levers screened: Muon's momentum and its matrices' lr, the share of
  the parameters a round averages.

Writes muon_gap.md and muon_gap.json there (runs/muon-gap keeps the runs). With `--length K`
the runs take K x the study's tokens (the lr schedules stretch with the run: warmup and decay
are shares of it) and the files are muon_gap_Kx.md/.json: does the gap close with length?
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

RULE = {"optim.depth_rule": "auto"}
# the rule resolves on the async schedule only: the other schedules name Muon as it gives it
MUON = {"optim.name": "muon", "optim.muon_lr": 1e-2}
GPIPE = {"pipeline.schedule": "gpipe", "pipeline.microbatches": 1}
EXACT_DP = {"dp.mode": "grad_allreduce", "dp.codec": "fp32"}
TWO_BW = {"pipeline.schedule": "2bw", "pipeline.microbatches": 4, "optim.error_feedback": True}
ROWS = {
    "depth rule (the default at P = 4)": RULE,
    "delay-free pipeline": {**MUON, **GPIPE},
    "delay-free pipeline, exact DP": {**MUON, **GPIPE, **EXACT_DP},
    "blocking averaging (tau 0)": {**RULE, "dp.tau": 0},
    "dense averaging (every coordinate each round)": {**RULE, "dp.fraction": 1.0},
    # the levers screened on the tuning seeds
    "Muon momentum 0.9": {**RULE, "optim.muon_momentum": 0.9},
    "Muon's matrices at lr 0.007": {**RULE, "optim.muon_lr": 0.007},
    "Muon's matrices at lr 0.014": {**RULE, "optim.muon_lr": 0.014},
    "averaging 10% a round": {**RULE, "dp.fraction": 0.1},
    "averaging 20% a round": {**RULE, "dp.fraction": 0.2},
    "averaging 10%, matrices at 0.014": {**RULE, "dp.fraction": 0.1, "optim.muon_lr": 0.014},
    "no lr correction": {**RULE, "optim.delay_lr_share": 0.0},
    # the rest (embeddings, head, norms: AdamW) at the tuned 3e-3 by default
    "the rest at lr 1e-3": {**RULE, "optim.lr": 1e-3},
    "the rest at lr 2e-3": {**RULE, "optim.lr": 2e-3},
    "the rest at lr 1e-3, matrices at 0.014": {**RULE, "optim.lr": 1e-3, "optim.muon_lr": 0.014},
    # without the averaging axis: is the pipeline's delay dearer with replicas than without?
    "one replica": {**RULE, "grid.replicas": 1},
    "one replica, delay-free pipeline": {**MUON, **GPIPE, "grid.replicas": 1},
    # weight prediction (PipeMare, SpecTrain): Muon's updates are orthogonalized momentum, of
    # a steady size and direction, so the velocity the stash extrapolates along is a good guess
    "prediction 1.0": {**RULE, "pipeline.weight_prediction": 1.0},
    "prediction 0.5": {**RULE, "pipeline.weight_prediction": 0.5},
    "prediction 1.0, velocity EMA 0.5": {
        **RULE,
        "pipeline.weight_prediction": 1.0,
        "pipeline.prediction_beta": 0.5,
    },
    # FullSync's update size: 2BW takes M = 4 microbatches an update, one update stale
    "2BW M=4, Muon, error feedback": {**MUON, **TWO_BW},
    "2BW M=4, Muon at 0.02, error feedback": {**MUON, **TWO_BW, "optim.muon_lr": 0.02},
    "2BW M=4, Muon at 0.04, error feedback": {**MUON, **TWO_BW, "optim.muon_lr": 0.04},
}
# the screen's best on the tuning seeds, read on the study's evaluation seeds (10-17) against
# the headline's FullSync with Muon and the depth rule (muon_headline.json: convergence_muon.py)
HEADLINE_ROWS = ("averaging 10%, matrices at 0.014",)
FULLSYNC_MUON_LR = 4e-3  # convergence_muon.py's FullSync pick (the depth study's best)
FULLSYNC_MUON_SWEEP = (2e-3, 8e-3)  # around it, on these seeds: the gaps are to the best


def main() -> None:
    from mesh.bench.convergence import study_variants
    from mesh.bench.report import fmt_interval, paired_interval
    from mesh.bench.simruns import run_specs
    from mesh.config import load_config
    from mesh.report import format_table

    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default="results/convergence")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--rows", nargs="*", default=None, help="row names to run (default: all)")
    ap.add_argument("--headline", action="store_true", help="HEADLINE_ROWS on the unseen seeds")
    ap.add_argument("--length", type=int, default=1, help="K x the study's tokens a run")
    a = ap.parse_args()
    out = Path(a.out)
    if a.headline:
        return headline(out, a.workers)
    from mesh.bench.simruns import MUON_LR_FACTOR

    def fs_muon(lr: float) -> dict[str, object]:
        return {
            "optim.name": "muon",
            "optim.lr": lr,
            "optim.muon_lr": round(MUON_LR_FACTOR * lr, 10),
        }

    rows = [(n, "AsyncMesh-fp8", c) for n, c in ROWS.items() if a.rows is None or n in a.rows]
    rows.append(("FullSync muon", "FullSync", fs_muon(FULLSYNC_MUON_LR)))
    if a.length == 1:  # the sweep around FullSync's lr, at the study's length
        rows += [
            (f"FullSync muon lr={lr:g}", "FullSync", fs_muon(lr)) for lr in FULLSYNC_MUON_SWEEP
        ]
    label = "muon-gap" if a.length == 1 else f"muon-gap-{a.length}x"
    _, specs, budget = study_variants(out, "muon-gap", rows, seeds=a.seeds)
    budget = {label: budget["muon-gap"] * a.length}
    specs = [replace(s, study=label) for s in specs]
    # a row's own microbatches an update (2BW's M): equal tokens, a quarter of the updates
    specs = [
        replace(s, microbatches_per_update=int(dict(s.overrides)["pipeline.microbatches"]))
        if dict(s.overrides).get("pipeline.schedule") == "2bw"
        else s
        for s in specs
    ]
    runs = run_specs(load_config([]), specs, budget, Path(f"runs/{label}"), a.workers, label)
    loss: dict[str, dict[int, float]] = {}
    for r in runs:
        loss.setdefault(r["method"], {})[r["seed"]] = r["val_loss"]
    fs = sorted(n for n in loss if n.startswith("FullSync muon"))
    best = min(fs, key=lambda n: sum(loss[n].values()))
    order = [*fs, *ROWS]  # FullSync's sweep, then the rows as ROWS lists them
    table = []
    for name, vals in sorted(loss.items(), key=lambda kv: order.index(kv[0])):
        per_seed = " / ".join(f"{vals[s]:.4f}" for s in a.seeds)
        gap = paired_interval(vals, loss[best], relative=True)
        table.append([name, per_seed, fmt_interval(gap, pct=True) if name != best else ""])
    lines = [
        "# Where the 4-stage default's gap to FullSync with Muon comes from",
        "",
        f"The convergence study's 4x2 grid, {budget[label]} microbatches per replica, "
        f"tuning seeds {a.seeds}; AsyncMesh-fp8 at its tuned settings with the depth rule on "
        f"(Muon), one ingredient changed per row, against the best of FullSync with Muon "
        f"({best}; `FullSync muon` is lr {FULLSYNC_MUON_LR:g}, Muon's matrices at 10x the lr) "
        "(scripts/muon_gap.py).",
        "",
        format_table(["run", "val loss per seed", f"vs {best}"], table),
        "",
    ]
    stem = "muon_gap" if a.length == 1 else f"muon_gap_{a.length}x"
    (out / f"{stem}.md").write_text("\n".join(lines))
    (out / f"{stem}.json").write_text(
        json.dumps({"loss": loss, "best_fullsync": best, "runs": runs}, indent=1)
    )
    print("\n".join(lines))


def headline(out: Path, workers: int) -> None:
    """HEADLINE_ROWS on the study's evaluation seeds, against muon_headline.json's FullSync with
    Muon and its depth-rule arm (same seeds): muon_gap_headline.md."""
    from mesh.bench.convergence import study_variants
    from mesh.bench.report import fmt_interval, paired_interval
    from mesh.bench.simruns import run_specs
    from mesh.config import load_config
    from mesh.report import format_table

    rows = [(n, "AsyncMesh-fp8", ROWS[n]) for n in HEADLINE_ROWS]
    study, specs, budget = study_variants(out, "muon-gap", rows)
    runs = run_specs(load_config([]), specs, budget, Path("runs/muon-gap"), workers, "headline")
    known = json.loads((out / "muon_headline.json").read_text())["loss"]
    ref_name, rule_name = "FullSync muon lr=0.004", "AsyncMesh-fp8 depth rule"
    loss = {n: {int(s): v for s, v in known[n].items()} for n in ("FullSync", ref_name, rule_name)}
    for r in runs:
        loss.setdefault(r["method"], {})[r["seed"]] = r["val_loss"]
    seeds = sorted(loss[ref_name])
    table = [
        [
            name,
            f"{sum(vals[s] for s in seeds) / len(seeds):.4f}",
            fmt_interval(paired_interval(vals, loss["FullSync"], relative=True), pct=True),
            fmt_interval(paired_interval(vals, loss[ref_name], relative=True), pct=True),
        ]
        for name, vals in loss.items()
        if name not in ("FullSync", ref_name)
    ]
    lines = [
        "# The Muon screen's pick on the convergence study's unseen seeds",
        "",
        f"The study's 4x2 grid, {budget['muon-gap']} microbatches per replica, seeds "
        f"{seeds[0]}-{seeds[-1]} (no tuning used them); the rows of muon_gap.md's screen (tuning "
        "seeds 0 and 1) picked here, against the headline's FullSync (AdamW) and FullSync with "
        "Muon at its best lr (muon_headline.md, the same seeds). Paired by seed: mean +- SE "
        "[95% t] (scripts/muon_gap.py --headline).",
        "",
        format_table(["arm", "mean", "vs FullSync (AdamW)", f"vs {ref_name}"], table),
        "",
    ]
    (out / "muon_gap_headline.md").write_text("\n".join(lines))
    (out / "muon_gap_headline.json").write_text(json.dumps({"loss": loss}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
