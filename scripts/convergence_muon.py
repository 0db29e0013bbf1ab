"""Muon in the convergence study's 4x2 grid (P = 4, two replicas): AsyncMesh-fp8 at its tuned
settings with `optim.name = muon` (its matrices at 10x the lr), and FullSync with Muon, the
same-optimizer baseline, against the study's FullSync (AdamW) and AsyncMesh-fp8 (NAdamW), on
the study's tuning seeds 0 and 1 (in sample: a screen, not the headline), its budget and data.

    python3 scripts/convergence_muon.py [--workers 1] [--out results/convergence] [--headline]

Reads results/convergence/summary.json; writes muon.md and muon.json there. Runs in about 20
minutes here with 2 workers (runs/convergence-muon keeps the runs: a second call reruns none).
--headline: the arms at the lrs the screen picked, and AsyncMesh-fp8's tuned config with
`optim.depth_rule = auto` (what a user's 4-stage pipeline gets: Muon, its matrices at the rule's
lr, the tuned lr for the rest), on the study's evaluation seeds (10-17, which no tuning used),
against the headline's own FullSync and AsyncMesh-fp8 runs; writes muon_headline.md and
muon_headline.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ASYNC_LRS = (1e-3, 2e-3, 4e-3)
FULLSYNC_LRS = (4e-3,)  # the depth study's FullSync-with-Muon best (inside 2e-3..8e-3 there)
SEEDS = [0, 1]
# the screen's picks on the tuning seeds (muon.md): AsyncMesh-fp8 with Muon at 2e-3, inside its
# grid; FullSync with Muon at the depth study's best
HEADLINE_ASYNC_LRS = (2e-3,)
RULE_ARM = "AsyncMesh-fp8 depth rule"  # its tuned settings with the rule on (Muon at P = 4)


def _muon(lr: float) -> dict[str, object]:
    from mesh.bench.simruns import MUON_LR_FACTOR  # every study's ratio, one place

    return {"optim.name": "muon", "optim.lr": lr, "optim.muon_lr": round(MUON_LR_FACTOR * lr, 10)}


def main() -> None:
    from mesh.bench.convergence import cached_losses, study_variants
    from mesh.bench.report import fmt_interval, paired_interval, study_scale
    from mesh.bench.simruns import run_specs
    from mesh.config import load_config
    from mesh.report import format_table

    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--out", default="results/convergence")
    ap.add_argument("--headline", action="store_true")
    a = ap.parse_args()
    out = Path(a.out)
    study = json.loads((out / "summary.json").read_text())
    seeds = list(study["seeds"]["dp"]) if a.headline else SEEDS
    async_lrs = HEADLINE_ASYNC_LRS if a.headline else ASYNC_LRS
    rows = [(f"AsyncMesh-fp8 muon lr={lr:g}", "AsyncMesh-fp8", _muon(lr)) for lr in async_lrs]
    rows += [(f"FullSync muon lr={lr:g}", "FullSync", _muon(lr)) for lr in FULLSYNC_LRS]
    if a.headline:  # what a user gets at P = 4: the tuned arm with optim.depth_rule's settings
        rows.append((RULE_ARM, "AsyncMesh-fp8", {"optim.depth_rule": "auto"}))
    study, specs, budget = study_variants(out, "conv-muon", rows, seeds=seeds)
    specs = sorted(specs, key=lambda s: (s.method, s.seed))
    runs = run_specs(
        load_config([]), specs, budget, Path("runs/convergence-muon"), a.workers, "muon 4x2"
    )
    loss = {m: cached_losses(load_config([]), out, m, seeds) for m in ("FullSync", "AsyncMesh-fp8")}
    for r in runs:
        loss.setdefault(r["method"], {})[r["seed"]] = r["val_loss"]
    best = {
        kind: min((n for n in loss if n.startswith(kind)), key=lambda n: sum(loss[n].values()))
        for kind in ("AsyncMesh-fp8 muon", "FullSync muon")
    }
    table = []
    for name, vals in loss.items():
        gap = paired_interval(vals, loss["FullSync"], relative=True)
        same = paired_interval(vals, loss[best["FullSync muon"]], relative=True)
        per_seed = " / ".join(f"{vals[s]:.4f}" for s in seeds)
        mean = sum(vals[s] for s in seeds) / len(seeds)
        table.append(
            [
                name,
                per_seed if len(seeds) <= 2 else f"{mean:.4f}",
                fmt_interval(gap, pct=True) if name != "FullSync" else "",
                fmt_interval(same, pct=True) if name != best["FullSync muon"] else "",
            ]
        )
    seed_names = " / ".join(map(str, seeds)) if len(seeds) <= 2 else f"{seeds[0]}-{seeds[-1]}"
    headers = [
        "arm",
        f"seeds {seed_names}" + (" (mean)" if len(seeds) > 2 else ""),
        "vs FullSync (AdamW)",
        f"vs {best['FullSync muon']}",
    ]
    scale = study_scale(load_config([]))
    model, mbs = scale["model"], budget["conv-muon"]
    bigram = study["data_ngram_ce"]["bigram_nats_per_token"]
    fs_mean = sum(loss["FullSync"][s] for s in seeds) / len(seeds)
    where = (
        f"on the study's evaluation seeds {seed_names}, which no tuning used (the lrs are the "
        "screen's picks on the tuning seeds 0 and 1: muon.md)"
        if a.headline
        else f"on its tuning seeds {seed_names} (in sample: a screen, not the headline, which is "
        "read on seeds 10-17)"
    )
    title = "# Muon in the convergence study's 4x2 grid"
    lines = [
        title + (": the headline's seeds" if a.headline else ""),
        "",
        f"The study's 4x2 grid (P = 4, two replicas) of a {model['arch']} d {model['d_model']} x "
        f"{model['n_layers']} ({scale['params'] / 1e6:.2f}M parameters) on {scale['data']}, "
        f"{mbs} microbatches ({mbs * scale['microbatch_tokens'] / 1e6:.2f}M tokens) per "
        f"replica; FullSync (AdamW) at {fs_mean / bigram:.2f} of the data's bigram "
        f"({bigram:.3f} nats) {where}; every other setting the study's tuned one "
        "(scripts/convergence_muon.py). Muon's matrices take 10x the lr. Gaps are paired by "
        "seed: mean +- standard error [95% t interval]."
        + (
            f" `{RULE_ARM}` is the study's tuned AsyncMesh-fp8 with `optim.depth_rule = auto`, "
            "what a 4-stage pipeline gets without flags: Muon, its matrices at the rule's 0.01, "
            "the rest at the tuned lr (3e-3) with the tuned lr correction."
            if a.headline
            else ""
        ),
        "",
        format_table(headers, table),
        "",
    ]
    stem = "muon_headline" if a.headline else "muon"
    (out / f"{stem}.md").write_text("\n".join(lines))
    (out / f"{stem}.json").write_text(json.dumps({"loss": loss, "best": best}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
