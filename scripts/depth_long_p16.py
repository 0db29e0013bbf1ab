"""The depth study's long run at P = 16 (4x the tokens, one seed): the shipped rule at 16 stages
(AsyncPP's lr correction with Muon at momentum 0.9, lr 1e-3) against FullSync with Muon (4e-3),
into results/depth's runs (study "depth-long"; `meshtrain bench depth --report-only` then keeps
them in summary.json). `bench depth`'s own long phase runs P = 8 only.

    python3 scripts/depth_long_p16.py [--seed 0] [--dry]

--dry prints each run's fingerprint at the study's length beside the study's run of it (they must
agree: the same configs at 4x the tokens) and runs nothing. About 1,400 s of a core a run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    from mesh.bench import depth
    from mesh.bench import depth_arms as da
    from mesh.bench.simruns import spec_config
    from mesh.config import load_config

    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/depth")
    ap.add_argument("--dry", action="store_true")
    a = ap.parse_args()
    out = Path(a.out)
    base = load_config([], list(da.STUDY_DEFAULTS))
    by = {name: da.lever_arm(16, name, *rest) for name, *rest in da.LEVERS}
    rule = da.combine(16, by["lr correction"], by["muon momentum 0.9"])
    assert rule is not None
    runs = [(rule, 1e-3), (da.fullsync(16, 4, (4e-3,), "muon"), 4e-3)]
    known = {
        (r["method"], r["seed"]): r
        for r in json.loads((out / "summary.json").read_text())["runs"]
        if r["study"] == "depth"
    }
    for arm, lr in runs:
        s = da.spec(arm, 16, a.seed, lr, False)
        r = known.get((s.method, a.seed), {})
        print(
            s.method,
            spec_config(base, s, depth.MICROBATCHES).fingerprint(),
            "study's:",
            r.get("config_fingerprint"),
        )
    if a.dry:
        return
    study = depth.Study(base, out, 2, depth.MICROBATCHES, False)
    longs = [da.spec(arm, 16, a.seed, lr, False, study="depth-long") for arm, lr in runs]
    for r in study.run(longs, "depth P=16: 4x the tokens"):
        print(r["method"], r["seed"], round(r["val_loss"], 4))


if __name__ == "__main__":
    main()
