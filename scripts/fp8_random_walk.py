"""The soak's grid in the one-process simulator for a soak's length: fp8 payloads, fp32
payloads, and fp8 with dp.payload_error_feedback (session 11; why the soak's loss rose).

    python3 scripts/fp8_random_walk.py [--steps 84000] [--out results/fp8-feedback]

Each arm is one process (about 12 minutes each on this machine, the three in parallel).
Writes summary.json, table.md and loss.png.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import tempfile
from pathlib import Path

ARMS = {  # (payload_error_feedback is on by default since session 12)
    "fp8": ["dp.payload_error_feedback=false"],
    "fp32": ["dp.codec=fp32"],
    "fp8 + payload_error_feedback": ["dp.payload_error_feedback=true"],
}


def run_arm(args: tuple[str, int]) -> dict:
    from mesh.bench.soak import SOAK_D_MODEL, SOAK_SEQ_LEN
    from mesh.config import load_config
    from mesh.engine.sim import GridSim
    from mesh.testing.local_peers import tiny_grid_config

    name, steps = args
    with tempfile.TemporaryDirectory() as tmp:
        toml = tiny_grid_config(
            Path(tmp),
            None,
            steps=steps,
            d_model=SOAK_D_MODEL,
            seq_len=SOAK_SEQ_LEN,
            schedule_steps=steps,
        )
        cfg = load_config([str(toml)], ["transport.backend=torch", *ARMS[name]])
        r = GridSim(cfg).run()
    return {"arm": name, "val_loss": r.val_loss, "curve": r.curve, "train": r.train_curve}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=84_000)
    ap.add_argument("--out", default="results/fp8-feedback")
    a = ap.parse_args()
    with mp.get_context("spawn").Pool(len(ARMS)) as pool:
        runs = pool.map(run_arm, [(n, a.steps) for n in ARMS])
    write(runs, Path(a.out), a.steps)


def write(runs: list[dict], out: Path, steps: int) -> None:
    from mesh.report import format_table, plot_curves

    out.mkdir(parents=True, exist_ok=True)
    tenth = steps // 10
    rows = []
    for r in runs:
        w: dict[int, list[float]] = {}
        for x in r["train"]:
            w.setdefault(min(9, int(x["step"] // tenth)), []).append(x["loss"])
        r["train_by_tenth"] = [round(statistics.mean(v), 4) for _, v in sorted(w.items())]
        rows.append(
            [r["arm"], f"{r['val_loss']:.4f}", " ".join(f"{v:.3f}" for v in r["train_by_tenth"])]
        )
    slim = [{k: v for k, v in r.items() if k != "train"} for r in runs]
    (out / "summary.json").write_text(json.dumps({"steps": steps, "runs": slim}, indent=1))
    lines = [
        "# fp8 rounding in a soak-length run (simulator)",
        "",
        f"The soak's 2x2 grid (2 layers, d 48, seq 32, Shakespeare bytes), {steps} updates, lr and "
        "lambda schedules over the run; one process (no runtime). `scripts/fp8_random_walk.py`.",
        "",
        format_table(["payloads", "final val loss", "train loss by tenth of the run"], rows),
    ]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    curves = {r["arm"]: [(c["step"], c["val_loss"]) for c in r["curve"]] for r in runs}
    plot_curves(
        curves,
        out / "loss.png",
        "update",
        "validation loss (nats/byte)",
        "fp8 rounding random-walks into the weights; feedback removes it",
    )


if __name__ == "__main__":
    main()
