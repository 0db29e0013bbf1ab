"""The optimizer study's runs (a worker pool of simulator runs, then the optimizers timed side by
side) and its re-analysis for another target."""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path
from typing import Any

from mesh.bench.optimizers.analysis import default_target, reachable_target, steps_to_target
from mesh.bench.optimizers.protocol import (
    ASYNC_OPTIMIZERS,
    FULL,
    LR,
    MUON_LR,
    QUICK,
    TIMING_WARMUP,
    Spec,
    build_specs,
    spec_config,
)
from mesh.bench.optimizers.report import write_outputs
from mesh.bench.regime import data_reference, stamp
from mesh.config import Config


def _cost(spec: Spec) -> float:
    """Rough relative run time, to start the longest runs first."""
    return {"rotated_adam": 1.3 + (0.5 if spec.stage_aware else 0.0), "muon": 1.2}.get(
        spec.optimizer, 1.0
    )


def _run_one(args: tuple[dict[str, Any], Spec, int, int]) -> dict[str, Any]:
    from mesh.config import config_from_dict
    from mesh.engine.sim import GridSim

    base_tree, spec, microbatches, evals = args
    cfg = spec_config(config_from_dict(base_tree), spec, microbatches, evals)
    sim = GridSim(cfg)
    opt_s = [0.0]
    _time_optimizer_steps(sim, opt_s)  # the optimizer steps alone as well
    step_s: list[float] = []
    last = [time.perf_counter()]

    def on_step(update: int, loss: float) -> None:
        now = time.perf_counter()
        if update % cfg.run.eval_every and update != cfg.run.steps:  # no evaluation inside
            step_s.append(now - last[0])
        last[0] = now

    r = sim.run(on_step)
    periods = []
    for c in sim.cells[0]:
        ps = {getattr(rule, "period", None) for rule in c.optimizer.rules.values()} - {None}
        periods.append(min(ps) if ps else None)
    return {
        "study": spec.study,
        "label": spec.label,
        "optimizer": spec.optimizer,
        "schedule": spec.schedule,
        "stages": spec.stages,
        "seed": spec.seed,
        "error_feedback": spec.error_feedback,
        "stage_aware": spec.stage_aware,
        "lr": LR[spec.optimizer],
        "steps": r.steps,
        "horizon_steps": cfg.run.steps,
        "tokens": r.tokens,
        "steps_to_target": None,  # filled in once the study's target is known
        "target_val_loss": None,
        "val_loss": r.val_loss,
        "diverged": r.diverged,
        "ms_per_step": round(1000 * statistics.mean(step_s), 3) if step_s else None,
        "opt_ms_per_step": round(1000 * opt_s[0] / max(1, r.steps), 3),
        "state_bytes_per_stage": [c.optimizer.state_bytes() for c in sim.cells[0]],
        "refresh_period_per_stage": periods,
        "wall_s": round(r.wall_s, 2),
        "curve": r.curve,
    }


def _time_paired(args: tuple[dict[str, Any], list[int], int]) -> list[dict[str, Any]]:
    """Time per update of every async optimizer at every P, the optimizers interleaved update by
    update so that they share whatever else the machine is doing (the runs' own times are taken
    at different moments under a varying load). `steps` timed updates after TIMING_WARMUP; with
    rotate_every 10 and 10 or 30 timed updates, refreshes come in their true proportion."""
    from mesh.config import config_from_dict
    from mesh.data.corpus import load_corpus
    from mesh.engine.sim import GridSim

    base_tree, stages, steps = args
    base = config_from_dict(base_tree)
    corpus = load_corpus(
        base.data.path, base.data.val_fraction, base.model.seq_len, base.data.digest
    )
    out = []
    for p in stages:
        sims, step_s, opt_s = {}, {}, {}
        for opt, sa in ASYNC_OPTIMIZERS:
            spec = Spec("async", opt, "async", p, 0, stage_aware=sa)
            cfg = spec_config(base, spec, steps + TIMING_WARMUP, evals=1)
            sims[spec.label] = GridSim(cfg, corpus)
            step_s[spec.label], opt_s[spec.label] = 0.0, [0.0]
            _time_optimizer_steps(sims[spec.label], opt_s[spec.label])
        for k in range(TIMING_WARMUP + steps):
            if k == TIMING_WARMUP:
                for acc in opt_s.values():
                    acc[0] = 0.0
            for label, sim in sims.items():
                t = time.perf_counter()
                sim.step()
                if k >= TIMING_WARMUP:
                    step_s[label] += time.perf_counter() - t
        for label in sims:
            out.append(
                {
                    "label": label,
                    "stages": p,
                    "ms_per_step": round(1000 * step_s[label] / steps, 3),
                    "opt_ms_per_step": round(1000 * opt_s[label][0] / steps, 3),
                }
            )
    return out


def _time_optimizer_steps(sim: Any, acc: list[float]) -> None:
    """Add the seconds spent in every stage optimizer's step() of `sim` to acc[0]."""
    for c in sim.cells[0]:
        inner = c.optimizer.step

        def timed(lr_scale: float, _inner: Any = inner) -> float:
            t = time.perf_counter()
            out = _inner(lr_scale)
            acc[0] += time.perf_counter() - t
            return out

        c.optimizer.step = timed


def run_optimizers(
    base: Config, out: Path, quick: bool, workers: int, target: float | None = None
) -> dict[str, Any]:
    from tqdm import tqdm

    plan = QUICK if quick else FULL
    specs = build_specs(plan["stages"], plan["seeds"])
    for s in specs:  # a config error shows here, not in a worker
        spec_config(base, s, plan["microbatches"], plan["evals"])
    specs.sort(key=lambda s: -_cost(s))
    tree = base.model_dump(mode="json")
    start = time.perf_counter()
    runs: list[dict[str, Any]] = []
    ctx = mp.get_context("spawn")
    with ctx.Pool(workers) as pool:
        jobs = [(tree, s, plan["microbatches"], plan["evals"]) for s in specs]
        for res in tqdm(pool.imap_unordered(_run_one, jobs), total=len(jobs), desc="optimizers"):
            runs.append(res)
        print("timing the optimizers side by side ...", flush=True)
        timing = pool.apply(_time_paired, ((tree, plan["stages"], plan["timed_steps"]),))
    targets = {
        st: target if target is not None else default_target(runs, st) for st in ("async", "2bw")
    }
    for r in runs:
        t = targets[r["study"]]
        r["target_val_loss"] = t
        r["steps_to_target"] = None if t is None else steps_to_target(r["curve"], t)
    runs.sort(key=lambda r: (r["study"], r["label"], r["stages"], r["seed"]))
    summary = {
        "quick": quick,
        "microbatches_per_replica": plan["microbatches"],
        "evals_per_run": plan["evals"],
        "tokens_per_microbatch": base.tokens_per_microbatch,
        "seeds": plan["seeds"],
        "stages": plan["stages"],
        "targets": targets,
        "target_rule": "given" if target is not None else "delay-free adamw at half the horizon",
        "lr": {**LR, "muon_lr": MUON_LR},
        "rotate_every": base.optim.rotate_every,
        "model": base.model.model_dump(),
        "wall_s": round(time.perf_counter() - start, 1),
        "base_config_fingerprint": base.fingerprint(),
        "timing": timing,
        "runs": runs,
    }
    write_outputs(summary, out)
    summary.update(stamp(out, "optimizers", data_reference(base)))  # the rule (bench/regime.py)
    return summary


def reanalyze(out: Path, async_target: float | None = None) -> dict[str, Any]:
    """Re-derive updates-to-target of a finished study (out/summary.json) for another async
    target (default: reachable_target) without re-running it; rewrites the outputs."""
    summary = json.loads((out / "summary.json").read_text())
    runs = summary["runs"]
    t = async_target if async_target is not None else reachable_target(runs, "async")
    summary["targets"]["async"] = t
    rule = "given" if async_target is not None else "the worst run's best loss (all reach it)"
    summary["target_rule"] = f"async: {rule}; 2bw: {summary['target_rule']}"
    for r in runs:
        if r["study"] == "async":
            r["target_val_loss"] = t
            r["steps_to_target"] = None if t is None else steps_to_target(r["curve"], t)
    write_outputs(summary, out)
    return summary
