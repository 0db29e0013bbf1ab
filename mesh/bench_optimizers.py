"""`meshtrain bench optimizers`: which optimizer keeps a deep asynchronous pipeline converging.

Two studies on the simulator, 1 replica, a 16-layer narrow model (so P = 16 has a block per
stage), 2+ seeds, equal tokens:
- async: PipeDream stashing (delay delta_j = P-1-j) at P in {1, 2, 4, 8, 16} for adamw, nadamw,
  muon, rotated_adam and rotated_adam with stage-aware rotation (+SA). P = 1 is delay-free.
- 2bw: PipeDream-2BW at P = 4, M = 4 (delay 1) for adamw, muon and rotated_adam, each with and
  without error feedback, against gpipe at the same M (same updates, same batch, no delay).

Per run: the updates needed to reach a fixed validation loss (evaluated 30 times per run, 16 in
--quick, linearly interpolated between evaluations; null when never reached) and the final
validation loss. The target of each study is one number for all its runs: by default the
delay-free adamw runs' mean validation loss at half the horizon (async P = 1, resp. gpipe
M = 4), so the reference reaches it at ~50% and a slower run has room to show it; `target`
overrides it.
Also measured: ms per update (mean over updates without an evaluation; the CPU is shared, so
read the ratios) and the optimizer state bytes of every stage (rotated_adam's factors and bases).
Writes summary.json, table.md and depth.png (updates to target against P, log2 axis).
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mesh.config import Config, with_overrides
from mesh.methods import NADAMW_LR
from mesh.metrics import format_table, paired_gap, plot_curves

# The study's model and batch, applied before the user's --set (which wins). 16 layers so that
# P = 16 is possible; d_model 32 keeps the whole study near 40 minutes on 2 cores.
STUDY_DEFAULTS: list[str] = [
    "model.n_layers=16",
    "model.d_model=32",
    "model.n_heads=4",
    "model.seq_len=64",
    "pipeline.microbatch_size=8",
    "data.val_batches=8",
    "optim.grad_clip=1.0",
]

# rotated_adam's lr from a small sweep (async, 400 updates, seed 0, final val loss): P = 1:
# 1e-3 2.630, 2e-3 2.464, 4e-3 2.413, 6e-3 2.410 (adamw 2e-3: 2.593); P = 16: 2e-3 2.907,
# 4e-3 2.838 (adamw 2e-3: 3.337). 4e-3 is best at both depths and inside the flat region. The
# others are the project's settings (mesh.methods, design 1.2), not swept here.
ROTATED_LR = 4e-3
LR = {"adamw": 2e-3, "nadamw": NADAMW_LR, "muon": 2e-3, "rotated_adam": ROTATED_LR}
MUON_LR = 0.02
ASYNC_OPTIMIZERS = [("adamw", False), ("nadamw", False), ("muon", False)]
ASYNC_OPTIMIZERS += [("rotated_adam", False), ("rotated_adam", True)]
TWO_BW_OPTIMIZERS = ["adamw", "muon", "rotated_adam"]
TWO_BW_P, TWO_BW_M = 4, 4
# Full: 68 runs x 1000 microbatches; ~45-60 ms per microbatch on one free core (more for
# rotated_adam+SA at P = 16) -> about 35-40 minutes with 2 workers.
FULL = {"stages": [1, 2, 4, 8, 16], "seeds": [0, 1], "microbatches": 1000, "evals": 30}
FULL["timed_steps"] = 30
QUICK = {"stages": [1, 4, 16], "seeds": [0, 1], "microbatches": 96, "evals": 12}
QUICK["timed_steps"] = 10
TIMING_WARMUP = 2  # updates before timing starts (the first eigh, allocator warm-up)


@dataclass(frozen=True)
class Spec:
    study: str  # "async" or "2bw"
    optimizer: str
    schedule: str
    stages: int
    seed: int
    error_feedback: bool = False
    stage_aware: bool = False

    @property
    def microbatches_per_update(self) -> int:
        return 1 if self.schedule == "async" else TWO_BW_M

    @property
    def label(self) -> str:
        """The optimizer as the tables name it: adamw, rotated_adam+SA, 2bw muon +EF, ..."""
        name = self.optimizer + ("+SA" if self.stage_aware else "")
        if self.study == "2bw":
            name = f"{self.schedule} {name}" + (" +EF" if self.error_feedback else "")
        return name

    def overrides(self) -> dict[str, Any]:
        return {
            "grid.stages": self.stages,
            "grid.replicas": 1,
            "dp.mode": "none",
            "pipeline.schedule": self.schedule,
            "pipeline.microbatches": self.microbatches_per_update,
            "optim.name": self.optimizer,
            "optim.lr": LR[self.optimizer],
            "optim.muon_lr": MUON_LR,
            "optim.error_feedback": self.error_feedback,
            "optim.stage_aware": self.stage_aware,
            "run.seed": self.seed,
        }


def build_specs(stages: list[int], seeds: list[int]) -> list[Spec]:
    specs = []
    for seed in seeds:
        for p in stages:
            for opt, sa in ASYNC_OPTIMIZERS:
                specs.append(Spec("async", opt, "async", p, seed, stage_aware=sa))
        for opt in TWO_BW_OPTIMIZERS:
            specs.append(Spec("2bw", opt, "gpipe", TWO_BW_P, seed))
            for ef in (False, True):
                specs.append(Spec("2bw", opt, "2bw", TWO_BW_P, seed, error_feedback=ef))
    return specs


def spec_config(base: Config, spec: Spec, microbatches: int, evals: int = 30) -> Config:
    """The run's config: equal tokens (microbatches per replica), `evals` evaluations, warmup
    5% of the updates."""
    steps = max(1, microbatches // spec.microbatches_per_update)
    ov = spec.overrides()
    ov.update(
        {
            "run.steps": steps,
            "run.eval_every": max(1, steps // evals),
            "run.threads": 1,
            "optim.warmup_steps": max(1, steps // 20),
        }
    )
    return with_overrides(base, ov)


def _cost(spec: Spec) -> float:
    """Rough relative run time, to start the longest runs first."""
    return {"rotated_adam": 1.3 + (0.5 if spec.stage_aware else 0.0), "muon": 1.2}.get(
        spec.optimizer, 1.0
    )


def _run_one(args: tuple[dict[str, Any], Spec, int, int]) -> dict[str, Any]:
    from mesh.config import config_from_dict
    from mesh.sim import GridSim

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
    from mesh.data import load_corpus
    from mesh.sim import GridSim

    base_tree, stages, steps = args
    base = config_from_dict(base_tree)
    corpus = load_corpus(base.data.path, base.data.val_fraction, base.model.seq_len)
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


def steps_to_target(curve: list[dict[str, float]], target: float) -> int | None:
    """First update at which the validation loss is <= target, linearly interpolated between
    the evaluation before and the one that crossed; None when never reached."""
    prev: dict[str, float] | None = None
    for pt in curve:
        if pt["val_loss"] <= target:
            if prev is None or prev["val_loss"] == pt["val_loss"]:
                return int(pt["step"])
            frac = (prev["val_loss"] - target) / (prev["val_loss"] - pt["val_loss"])
            return int(round(prev["step"] + frac * (pt["step"] - prev["step"])))
        prev = pt
    return None


def _is_reference(r: dict[str, Any], study: str) -> bool:
    """The delay-free adamw runs that define a study's target."""
    if r["optimizer"] != "adamw" or r["error_feedback"] or r["study"] != study:
        return False
    return r["stages"] == 1 if study == "async" else r["schedule"] == "gpipe"


def default_target(runs: list[dict[str, Any]], study: str) -> float | None:
    """Mean over seeds of the delay-free adamw validation loss at half the horizon."""
    vals = []
    for r in runs:
        if _is_reference(r, study) and r["curve"]:
            half = r["horizon_steps"] / 2
            vals.append(min(r["curve"], key=lambda pt: abs(pt["step"] - half))["val_loss"])
    return statistics.mean(vals) if vals else None


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
    return summary


def reachable_target(runs: list[dict[str, Any]], study: str) -> float | None:
    """The tightest loss every run of a study reaches within its horizon: the worst run's best
    evaluation, rounded up to 0.01. With it every run has an updates-to-target (the worst one
    at its horizon), so the depth trend is measured instead of censored."""
    best = [min(p["val_loss"] for p in r["curve"]) for r in runs if r["study"] == study]
    return math.ceil(max(best) * 100) / 100 if best else None


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


# ----------------------------------------------------------------------------------- reporting


def _group(runs: list[dict[str, Any]], study: str) -> dict[tuple[str, int], list[dict[str, Any]]]:
    out: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in runs:
        if r["study"] == study:
            out.setdefault((r["label"], r["stages"]), []).append(r)
    return out


def _s2t(rs: list[dict[str, Any]]) -> tuple[float, bool]:
    """Mean updates to target over seeds; a seed that never reached it counts as its horizon,
    and the flag says the mean is then only a lower bound."""
    vals = [r["steps_to_target"] if r["steps_to_target"] is not None else r["steps"] for r in rs]
    return statistics.mean(vals), any(r["steps_to_target"] is None for r in rs)


def _fmt_s2t(rs: list[dict[str, Any]] | None) -> str:
    if not rs:
        return "-"
    mean, censored = _s2t(rs)
    if not censored:
        return f"{mean:.0f}"
    reached = sum(r["steps_to_target"] is not None for r in rs)
    return f">={mean:.0f} ({reached}/{len(rs)})"


def _loss(rs: list[dict[str, Any]] | None) -> float:
    if not rs or any(r["val_loss"] is None for r in rs):
        return math.nan
    return statistics.mean(r["val_loss"] for r in rs)


def _by_seed(rs: list[dict[str, Any]] | None, key: str = "val_loss") -> dict[int, float]:
    return {r["seed"]: (math.nan if r[key] is None else r[key]) for r in rs or []}


def _fmt_gap(g: tuple[float, float] | None) -> str:
    if g is None:
        return "n/a"
    return f"{g[0]:+.4f} +- {g[1]:.4f}" if math.isfinite(g[1]) else f"{g[0]:+.4f}"


def _mean_field(rs: list[dict[str, Any]] | None, key: str) -> float:
    vals = [r[key] for r in rs or [] if r[key] is not None]
    return statistics.mean(vals) if vals else math.nan


def _async_labels(g: dict[tuple[str, int], list[dict[str, Any]]]) -> list[str]:
    order = [o + ("+SA" if sa else "") for o, sa in ASYNC_OPTIMIZERS]
    return [lab for lab in order if any(k[0] == lab for k in g)]


def targets(summary: dict[str, Any]) -> list[tuple[str, str, bool | None, str]]:
    """The issue's targets: (name, measured, met or None when inconclusive, note)."""
    runs = summary["runs"]
    a, b = _group(runs, "async"), _group(runs, "2bw")
    stages = sorted({p for _, p in a})
    lo, hi = (stages[0], stages[-1]) if stages else (1, 1)
    out: list[tuple[str, str, bool | None, str]] = []

    def growth(label: str) -> tuple[float, float, bool]:
        """(extra updates from P=lo to P=hi, their ratio, extra is only a lower bound)."""
        r_hi, r_lo = a.get((label, hi)), a.get((label, lo))
        if not r_hi or not r_lo or _s2t(r_lo)[1]:
            return math.nan, math.nan, False
        (s_hi, c_hi), (s_lo, _) = _s2t(r_hi), _s2t(r_lo)
        return s_hi - s_lo, s_hi / s_lo, c_hi

    def faster(x: tuple[float, float, bool], y: tuple[float, float, bool]) -> bool | None:
        """Does x grow more than y? None when the censoring leaves it open."""
        (ex, _, cx), (ey, _, cy) = x, y
        if not (math.isfinite(ex) and math.isfinite(ey)) or (cx and cy):
            return None
        if ex > ey:
            return None if cy else True
        return None if cx else False

    ga, gr, gm = growth("adamw"), growth("rotated_adam"), growth("muon")
    verdicts = [faster(ga, gr), faster(ga, gm)]
    ok = False if False in verdicts else (True if all(verdicts) else None)
    measured = f"P={lo}->{hi}: " + ", ".join(
        f"{n} {g[0]:+.0f}{'+' if g[2] else ''} ({g[1]:.2f}x)"
        for n, g in (("adamw", ga), ("rotated_adam", gr), ("muon", gm))
    )
    out.append(
        (
            "adamw's updates-to-target grow with P faster than rotated_adam's and muon's",
            measured,
            ok,
            "growth = extra updates to target at the deepest P over P=1 (ratio in brackets); '+' "
            "= a seed never reached it, counted at the horizon, so the growth is a lower bound",
        )
    )
    ra, rr = a.get(("adamw", hi)), a.get(("rotated_adam", hi))
    if ra and rr:
        (sa, csa), (sr, csr) = _s2t(ra), _s2t(rr)
        red = 1 - sr / sa
        if csr:
            ok = None if csa else False
        else:
            ok = red >= 0.3 if not csa or red >= 0.3 else None
        out.append(
            (
                f"P={hi}: rotated_adam needs >= 30% fewer updates than adamw",
                f"{sr:.0f}{'+' if csr else ''} vs {sa:.0f}{'+' if csa else ''}: "
                f"{100 * red:.1f}% fewer{' (at least)' if csa and not csr else ''}",
                ok,
                "",
            )
        )
    for opt in ("adamw", "muon"):
        ref = _by_seed(b.get((f"gpipe {opt}", TWO_BW_P)))
        g0 = paired_gap(_by_seed(b.get((f"2bw {opt}", TWO_BW_P))), ref)
        g1 = paired_gap(_by_seed(b.get((f"2bw {opt} +EF", TWO_BW_P))), ref)
        out.append(
            (
                f"2bw: error feedback reduces {opt}'s gap to gpipe (val loss)",
                f"{_fmt_gap(g0)} -> {_fmt_gap(g1)}",
                None if g0 is None or g1 is None else g1[0] < g0[0],
                "",
            )
        )
    times = _timing(summary)
    ratios = {}
    for label in ("rotated_adam", "rotated_adam+SA"):
        rs = [times[(label, p)][0] / times[("adamw", p)][0] for p in stages if (label, p) in times]
        ratios[label] = [x for x in rs if math.isfinite(x)]
    rt = ratios["rotated_adam"]
    out.append(
        (
            "rotated_adam time per update <= 1.5x adamw's",
            f"{statistics.mean(rt):.2f}x mean over P (max {max(rt):.2f}x)" if rt else "n/a",
            (max(rt) <= 1.5) if rt else None,
            "whole simulated update (all stages), same P, timed side by side",
        )
    )
    rt = ratios["rotated_adam+SA"]
    out.append(
        (
            "(info) rotated_adam+SA time per update vs adamw",
            f"{statistics.mean(rt):.2f}x mean over P (max {max(rt):.2f}x)" if rt else "n/a",
            None,
            "stage-aware refreshes the deepest stages' bases every update",
        )
    )
    mem = _memory_rows(a, stages)
    biggest = max(mem, key=lambda m: m[2], default=None)
    out.append(
        (
            "rotated_adam's extra memory reported per stage",
            f"max +{biggest[2] / 1024:.1f} KiB on a stage at P={biggest[0]}" if biggest else "n/a",
            True if biggest else None,
            "see the cost table",
        )
    )
    rs_, rp = a.get(("rotated_adam+SA", hi)), a.get(("rotated_adam", hi))
    if rs_ and rp:
        (s1, c1), (s0, c0) = _s2t(rs_), _s2t(rp)
        out.append(
            (
                f"(info) P={hi}: stage-aware vs plain rotation (paper: +29.2% speed)",
                f"{s1:.0f}{'+' if c1 else ''} vs {s0:.0f}{'+' if c0 else ''} updates "
                f"({100 * (1 - s1 / s0):+.1f}% fewer)",
                None,
                "",
            )
        )
    return out


def _timing(summary: dict[str, Any]) -> dict[tuple[str, int], tuple[float, float]]:
    """(label, P) -> (ms per update, optimizer ms per update): the side-by-side timing when
    the summary has it, else the mean over each configuration's runs."""
    if summary.get("timing"):
        return {
            (t["label"], t["stages"]): (t["ms_per_step"], t["opt_ms_per_step"])
            for t in summary["timing"]
        }
    a = _group(summary["runs"], "async")
    return {
        k: (_mean_field(rs, "ms_per_step"), _mean_field(rs, "opt_ms_per_step"))
        for k, rs in a.items()
    }


def _memory_rows(
    a: dict[tuple[str, int], list[dict[str, Any]]], stages: list[int]
) -> list[tuple[int, int, int]]:
    """(P, adamw bytes of the largest stage, rotated_adam's largest extra bytes on a stage)."""
    rows = []
    for p in stages:
        ad, ro = a.get(("adamw", p)), a.get(("rotated_adam", p))
        if ad and ro:
            b_ad, b_ro = ad[0]["state_bytes_per_stage"], ro[0]["state_bytes_per_stage"]
            extra = [y - x for x, y in zip(b_ad, b_ro, strict=True)]
            rows.append((p, max(b_ad), max(extra)))
    return rows


def _runs_of(values: list[Any]) -> str:
    """Run-length text of a per-stage list: [1, 1, 1, 2, 10] -> "1 x3, 2, 10"."""
    parts: list[str] = []
    k = 0
    while k < len(values):
        n = 1
        while k + n < len(values) and values[k + n] == values[k]:
            n += 1
        text = "-" if values[k] is None else str(values[k])
        parts.append(f"{text} x{n}" if n > 1 else text)
        k += n
    return ", ".join(parts)


def write_outputs(summary: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    runs = summary["runs"]
    a, b = _group(runs, "async"), _group(runs, "2bw")
    stages = sorted({p for _, p in a})
    labels = _async_labels(a)
    tg = summary["targets"]
    fmt_t = {k: ("n/a" if v is None else f"{v:.4f}") for k, v in tg.items()}
    horizon = {
        st: max((r["horizon_steps"] for r in runs if r["study"] == st), default=0) for st in tg
    }
    lr = summary["lr"]
    lines = [
        "# Optimizers for deep asynchronous pipelines",
        "",
        f"Model: {summary['model']['n_layers']} layers, d_model {summary['model']['d_model']}, "
        f"{summary['model']['n_heads']} heads, seq_len {summary['model']['seq_len']}; "
        f"{summary['microbatches_per_replica']} microbatches of "
        f"{summary['tokens_per_microbatch']} tokens per run (equal tokens), 1 replica; seeds "
        f"{summary['seeds']}; quick={summary['quick']}; {summary['wall_s']:.0f} s in all.",
        f"lr: adamw {lr['adamw']:g}, nadamw {lr['nadamw']:g}, muon {lr['muon_lr']:g} (AdamW part "
        f"{lr['muon']:g}), rotated_adam {lr['rotated_adam']:g} (rotate_every "
        f"{summary['rotate_every']}); grad clip 1.0, warmup 5%, cosine to 10%.",
        f"Targets ({summary['target_rule']}): async {fmt_t['async']} "
        f"(horizon {horizon['async']} updates), 2bw/gpipe {fmt_t['2bw']} "
        f"(horizon {horizon['2bw']} updates). Updates to target are interpolated between "
        f"evaluations (every horizon/{summary['evals_per_run']}); '>=N (k/n)': only k of n "
        "seeds reached it, the "
        "others count at the horizon.",
        "",
        "## Async (PipeDream stashing): updates to reach the target",
        "",
    ]
    rows = []
    for lab in labels:
        row = [lab] + [_fmt_s2t(a.get((lab, p))) for p in stages]
        if len(stages) > 1 and a.get((lab, stages[0])) and a.get((lab, stages[-1])):
            s_hi, c_hi = _s2t(a[(lab, stages[-1])])
            s_lo, _ = _s2t(a[(lab, stages[0])])
            row.append(f"{s_hi / s_lo:.2f}x{'+' if c_hi else ''}")
        else:
            row.append("-")
        rows.append(row)
    head = ["optimizer"] + [f"P={p}" for p in stages] + [f"P={stages[-1]} / P={stages[0]}"]
    lines += [format_table(head, rows), "", "## Async: final validation loss at equal tokens", ""]
    rows = [[lab] + [f"{_loss(a.get((lab, p))):.4f}" for p in stages] for lab in labels]
    for lab in [x for x in labels if x != "adamw"]:
        rows.append(
            [f"{lab} - adamw (paired)"]
            + [
                _fmt_gap(paired_gap(_by_seed(a.get((lab, p))), _by_seed(a.get(("adamw", p)))))
                for p in stages
            ]
        )
    lines += [format_table(["optimizer"] + [f"P={p}" for p in stages], rows), ""]
    lines += [
        f"## 2bw (P={TWO_BW_P}, M={TWO_BW_M}, delay 1) vs gpipe at the same M",
        "",
    ]
    rows = []
    for opt in TWO_BW_OPTIMIZERS:
        ref = b.get((f"gpipe {opt}", TWO_BW_P))
        v0, v1 = b.get((f"2bw {opt}", TWO_BW_P)), b.get((f"2bw {opt} +EF", TWO_BW_P))
        if not ref:
            continue
        rows.append(
            [
                opt,
                _fmt_s2t(ref),
                _fmt_s2t(v0),
                _fmt_s2t(v1),
                f"{_loss(ref):.4f}",
                _fmt_gap(paired_gap(_by_seed(v0), _by_seed(ref))),
                _fmt_gap(paired_gap(_by_seed(v1), _by_seed(ref))),
            ]
        )
    lines += [
        format_table(
            [
                "optimizer",
                "gpipe updates",
                "2bw updates",
                "2bw+EF updates",
                "gpipe val loss",
                "2bw gap (paired)",
                "2bw+EF gap (paired)",
            ],
            rows,
        ),
        "",
        "## Cost: optimizer state and time per update (async)",
        "",
    ]
    rows = []
    mem = {p: (ad, ex) for p, ad, ex in _memory_rows(a, stages)}
    times = _timing(summary)
    for p in stages:
        nan2 = (math.nan, math.nan)
        t_ad, o_ad = times.get(("adamw", p), nan2)
        t_ro, o_ro = times.get(("rotated_adam", p), nan2)
        t_sa, o_sa = times.get(("rotated_adam+SA", p), nan2)
        t_mu, _ = times.get(("muon", p), nan2)
        sa_runs = a.get(("rotated_adam+SA", p))
        periods = sa_runs[0]["refresh_period_per_stage"] if sa_runs else []
        ad, ex = mem.get(p, (0, 0))
        rows.append(
            [
                p,
                f"{ad / 1024:.1f}",
                f"+{ex / 1024:.1f} ({ex / ad:.2f}x)" if ad else "-",
                f"{t_ad:.1f}",
                f"{t_ro:.1f} ({t_ro / t_ad:.2f}x)",
                f"{t_sa:.1f} ({t_sa / t_ad:.2f}x)",
                f"{t_mu:.1f} ({t_mu / t_ad:.2f}x)",
                f"{o_ad:.1f} / {o_ro:.1f} / {o_sa:.1f}",
                _runs_of(periods),
            ]
        )
    lines += [
        format_table(
            [
                "P",
                "adamw state KiB (largest stage)",
                "rotated_adam extra KiB (largest)",
                "adamw ms/update",
                "rotated_adam ms",
                "rotated_adam+SA ms",
                "muon ms",
                "optimizer ms: adamw / rot / rot+SA",
                "SA refresh period per stage",
            ],
            rows,
        ),
        "",
        "ms per simulated update (all stages, no evaluation), the optimizers timed side by side "
        "(interleaved update by update, one process) so that they share the machine's load; "
        "summary.json also has each run's own mean, taken under whatever load it met.",
        "",
        "## Targets",
        "",
        format_table(
            ["target", "measured", "verdict", "note"],
            [
                [
                    n,
                    s,
                    "inconclusive"
                    if ok is None and not n.startswith("(info)")
                    else ("-" if ok is None else ("met" if ok else "MISSED")),
                    note,
                ]
                for n, s, ok, note in targets(summary)
            ],
        ),
    ]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    _plot(summary, out / "depth.png")


def _plot(summary: dict[str, Any], path: Path) -> None:
    a = _group(summary["runs"], "async")
    stages = sorted({p for _, p in a})
    curves = {
        lab: [(float(p), _s2t(a[(lab, p)])[0]) for p in stages if (lab, p) in a]
        for lab in _async_labels(a)
    }
    t = summary["targets"]["async"]
    plot_curves(
        curves,
        path,
        "pipeline stages P (async, delay P-1-j)",
        "updates to reach the target",
        f"Updates to val loss {'n/a' if t is None else f'{t:.3f}'} (mean of seeds; "
        "never reached = horizon)",
        logx=True,
    )
