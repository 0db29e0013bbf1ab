"""Does a compressed boundary under the shipped optimizer train too slowly? `bench boundary
--optimizer shipped`'s learned arms at P = 8 with the boundary's own lr scaled
(`optim.boundary_lr_scale`: its parameters train with AdamW, not Muon, at the model's lr x
this), one seed, against the study's runs at scale 1 (results/boundary[-d192]-shipped).

    python3 scripts/boundary_lr_probe.py --width 192 --scale 4 [--arms "learned 16x,learned 8x"]
        [--seed 0] [--out runs/boundary-lr]

Prints each run's final validation loss and clip rate and writes result-<width>-x<scale>.json
to --out. Each d 192 run takes about 800 s of a core; d 64 about 160 s.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    from mesh.bench.boundary import STUDY_DEFAULTS, WIDTHS, _spec, arms
    from mesh.bench.simruns import Spec, run_specs
    from mesh.config import load_config

    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, choices=sorted(WIDTHS), default=192)
    ap.add_argument("--scale", type=float, default=4.0)
    ap.add_argument("--arms", default="learned 16x,learned 8x")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-3, help="the rule's lr at P = 8")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default="runs/boundary-lr")
    a = ap.parse_args()
    out = Path(a.out)
    base = load_config([], [*STUDY_DEFAULTS, *WIDTHS[a.width]])
    shipped = dict(arms(base, 8, "shipped"))
    specs = []
    for name in (x.strip() for x in a.arms.split(",")):
        s = _spec(name, {**shipped[name], "optim.boundary_lr_scale": a.scale}, a.seed, a.lr)
        specs.append(Spec(s.study, f"{s.method} boundary lr x{a.scale:g}", a.seed, 1, s.overrides))
    runs = run_specs(base, specs, {"boundary": 1600}, out, a.workers, "boundary lr")
    for r in runs:
        print(r["method"], round(r["val_loss"], 4), "clip rate", r.get("clip_rate"))
    (out / f"result-{a.width}-x{a.scale:g}.json").write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
