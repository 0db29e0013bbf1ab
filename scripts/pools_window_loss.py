"""What a larger pool window costs in loss: `bench pools --convergence`'s arms (the convergence
study's AsyncMesh-fp8, 4x2, s1r0 2x slower in the pools arm, 3,200 microbatches a replica, seeds
10-13) with every stage but the last reading weights one update older, `pipeline.window =
[1, 1, 1, 0]` on the simulator (mean delay 2.25 updates a microbatch against the async schedule's
1.5).

Why that window: the process grids of `bench pools` measure the staleness the cells' windows
give. At `pipeline.pool_window = 6` a pools microbatch waits 2.44 updates on average with 10% of
the cells dead and 2.33 under churn, against 1.64 and 1.53 at the default 4 (results/pools,
results/pools-window6): one more update at every stage but the last (+0.75) is that increase.
The simulator has no clock for a window to fill on, so it takes the measured staleness as a
window of extra in-flight microbatches (mesh/engine/pools.py reads pipeline.window as GridSim
does).

Arms, each against the fixed arm as `bench pools --convergence` runs it (its runs reused):
- pools, affinity 1.5, at the window's staleness: what window-6 pools would cost;
- fixed wiring at the same staleness: the staleness's own share of that.

    python3 scripts/pools_window_loss.py [--workers 2] [--out results/pools] [--seeds 10 11 12 13]

Writes window_loss.md and window_loss.json there; runs append to convergence.partial.jsonl.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

WINDOW = [1, 1, 1, 0]


def main() -> None:
    from tqdm import tqdm

    from mesh.bench import pools_convergence as pc
    from mesh.bench.simruns import Spec, read_runs, run_one, spec_config, worker_pool
    from mesh.config import load_config
    from mesh.report import format_table

    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default="results/pools")
    ap.add_argument("--seeds", type=int, nargs="+", default=[10, 11, 12, 13])
    a = ap.parse_args()
    out, base = Path(a.out), load_config([])
    partial = out / "convergence.partial.jsonl"
    done = {
        pc._key(r["method"], r["config_fingerprint"]): r
        for r in read_runs(partial)
        if r["method"] == pc.ARMS["fixed"][2] or r.get("pool_engine") == pc.POOL_ENGINE
    }
    pc._reuse_fixed_runs(done, pc.ARMS["fixed"][2], pc.MICROBATCHES)
    seeds = tuple(a.seeds)
    arms = pc.specs(seeds)
    win = {"pipeline.window": WINDOW}
    label = f"window {WINDOW}"
    arms["pools windowed"] = [
        replace(s, method=f"{s.method}, {label}", overrides=(*s.overrides, *win.items()))
        for s in arms["pools"]
    ]
    arms["fixed windowed"] = [
        replace(s, method=f"{s.method}, {label}", overrides=(*s.overrides, *win.items()))
        for s in arms["fixed"]
    ]
    del arms["even"]

    def key(s: Spec) -> str:
        return pc._key(s.method, spec_config(base, s, pc.MICROBATCHES).fingerprint())

    todo = [s for ss in arms.values() for s in ss if key(s) not in done]
    if todo:
        with worker_pool(a.workers) as pool:
            args = [(base.model_dump(mode="json"), s, pc.MICROBATCHES) for s in todo]
            for r in tqdm(pool.imap(run_one, args), total=len(args), desc="window loss"):
                r = {**r, "pool_engine": pc.POOL_ENGINE}
                with partial.open("a") as f:
                    f.write(json.dumps({k: v for k, v in r.items() if k != "curve"}) + "\n")
                done[pc._key(r["method"], r["config_fingerprint"])] = r
    loss = {arm: [done[key(s)]["val_loss"] for s in ss] for arm, ss in arms.items()}
    gaps = {arm: pc.relative_gap(loss[arm], loss["fixed"]) for arm in arms if arm != "fixed"}
    rows = [[str(seed), *(f"{loss[arm][k]:.4f}" for arm in arms)] for k, seed in enumerate(seeds)]
    from mesh.bench.regime import data_reference
    from mesh.data.ngram import to_bigram

    ratio = to_bigram(sum(loss["fixed"]) / len(loss["fixed"]), data_reference(base))
    lines = [
        "# What a larger pool window's staleness costs in loss",
        "",
        f"Model: the convergence study's GPT d 64 x 8 (0.43M parameters) on the Shakespeare "
        f"bytes, {pc.MICROBATCHES * base.tokens_per_microbatch / 1e6:.1f}M tokens a replica; "
        f"the fixed arm ends at {ratio} of the data's bigram cross-entropy.",
        "",
        f"`bench pools --convergence`'s arms (4x2, {pc.MICROBATCHES:,} microbatches a replica, "
        f"s1r0 {pc.SLOW[0].split('=')[1]}x slower in the pools arms, seeds "
        f"{seeds[0]}-{seeds[-1]}), with `pipeline.window = {WINDOW}`: every stage but "
        "the last reads weights one update older (mean delay 2.25 against 1.5), the increase "
        "the process grids measure at pool_window 6 against 4 (scripts/pools_window_loss.py).",
        "",
        format_table(["seed", *arms], rows),
        "",
        *(f"- {arm} against fixed: {pc._gap(g)}" for arm, g in gaps.items()),
        "",
    ]
    (out / "window_loss.md").write_text("\n".join(lines))
    (out / "window_loss.json").write_text(
        json.dumps({"window": WINDOW, "val_loss": loss, "vs_fixed": gaps}, indent=1)
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
