"""Muon in the convergence study's 4x2 grid (P = 4, two replicas): AsyncMesh-fp8 at its tuned
settings with `optim.name = muon` (its matrices at 10x the lr), and FullSync with Muon, the
same-optimizer baseline, against the study's FullSync (AdamW) and AsyncMesh-fp8 (NAdamW), on
the study's tuning seeds 0 and 1 (in sample: a screen, not the headline), its budget and data.

    python3 scripts/convergence_muon.py [--workers 1] [--out results/convergence]

Reads results/convergence/summary.json; writes muon.md and muon.json there. Runs in about 20
minutes here with 2 workers (runs/convergence-muon keeps the runs: a second call reruns none).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ASYNC_LRS = (1e-3, 2e-3, 4e-3)
FULLSYNC_LRS = (4e-3,)  # the depth study's FullSync-with-Muon best (inside 2e-3..8e-3 there)
SEEDS = [0, 1]


def _muon(lr: float) -> dict[str, object]:
    from mesh.bench.depth_arms import MUON_LR_FACTOR  # the depth study's ratio, one place

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
    a = ap.parse_args()
    out = Path(a.out)
    rows = [(f"AsyncMesh-fp8 muon lr={lr:g}", "AsyncMesh-fp8", _muon(lr)) for lr in ASYNC_LRS]
    rows += [(f"FullSync muon lr={lr:g}", "FullSync", _muon(lr)) for lr in FULLSYNC_LRS]
    study, specs, budget = study_variants(out, "conv-muon", rows, seeds=SEEDS)
    specs = sorted(specs, key=lambda s: (s.method, s.seed))
    runs = run_specs(
        load_config([]), specs, budget, Path("runs/convergence-muon"), a.workers, "muon 4x2"
    )
    loss = {m: cached_losses(load_config([]), out, m, SEEDS) for m in ("FullSync", "AsyncMesh-fp8")}
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
        table.append(
            [
                name,
                " / ".join(f"{vals[s]:.4f}" for s in SEEDS),
                fmt_interval(gap, pct=True) if name != "FullSync" else "",
                fmt_interval(same, pct=True) if name != best["FullSync muon"] else "",
            ]
        )
    headers = ["arm", "seeds 0 / 1", "vs FullSync (AdamW)", f"vs {best['FullSync muon']}"]
    scale = study_scale(load_config([]))
    model, mbs = scale["model"], budget["conv-muon"]
    bigram = study["data_ngram_ce"]["bigram_nats_per_token"]
    ratios = " and ".join(f"{loss['FullSync'][s] / bigram:.2f}" for s in SEEDS)
    lines = [
        "# Muon in the convergence study's 4x2 grid",
        "",
        f"The study's 4x2 grid (P = 4, two replicas) of a {model['arch']} d {model['d_model']} x "
        f"{model['n_layers']} ({scale['params'] / 1e6:.2f}M parameters) on {scale['data']}, "
        f"{mbs} microbatches ({mbs * scale['microbatch_tokens'] / 1e6:.2f}M tokens) per "
        f"replica; FullSync (AdamW) at {ratios} of the data's bigram ({bigram:.3f} nats) on "
        f"its tuning seeds {SEEDS} (in sample: a screen, not the headline, which is read on "
        "seeds 10-17); every other setting the study's tuned one "
        "(scripts/convergence_muon.py). Muon's matrices take 10x the lr.",
        "",
        format_table(headers, table),
        "",
    ]
    (out / "muon.md").write_text("\n".join(lines))
    (out / "muon.json").write_text(json.dumps({"loss": loss, "best": best}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
