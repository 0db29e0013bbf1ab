"""`meshtrain bench convergence --like-for-like`: the headline's two arms, both with rotated_adam
and each tuned with the same budget, reported on the evaluation seeds.

The earlier like for like (scripts/like_for_like.py) tuned FullSync's lr with rotated_adam and
ran AsyncMesh-fp8 with rotated_adam at NAdamW's tuned lr, untuned, and read the +37% gap from
that. Here each arm gets TUNE_RUNS settings on each tuning seed (tuning.json's), picked by the
headline tuning's rule (lowest mean final loss over the seeds, a diverged run infinite):
- FullSync: its lr over FULLSYNC_LRS (extended past 9e-3, the top of the range the earlier one
  tried and its pick);
- AsyncMesh-fp8: its lr over ASYNC_LRS, then at the best lr its tau and clip (ASYNC_STAGE2), as
  the headline's tuning searched them.
Both best settings then run on the evaluation seeds (10-17), gaps paired by seed.

Why an async gap stays large, measured: AsyncMesh updates after every microbatch of 8 sequences
while FullSync updates once per 4 microbatches (32 sequences), so the async arm takes 4x the
updates at a quarter of the batch. The decomposition arm runs the async arm's best settings with
microbatches 4x larger (32 sequences, 400 updates: FullSync's batch and update count at the
same tokens) and the same pipeline delay in updates: what closes is the batch size's share, what
stays is the asynchrony's (stale weights, the partial averaging). It runs twice: at the async
arm's lr (tuned at the small batch), and at its own lr, tuned over BATCH_LRS on the tuning seeds
(the same tau and clip), since a 4x batch may take a larger step.

Every stage resumes from runs.partial.jsonl in OUT/like_for_like/ (runs with the same config and
budget are reused); writes OUT/like_for_like.json and like_for_like.md.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from mesh.bench.convergence import study_variants
from mesh.bench.regime import data_reference, rule_fields, rule_line
from mesh.bench.report import fmt_interval, paired_interval
from mesh.bench.simruns import run_specs
from mesh.bench.tuning import check_held_out, known_runs, tuning_seeds
from mesh.config import Config
from mesh.model.build import stage_param_counts
from mesh.report import format_table

ROTATED = {"optim.name": "rotated_adam"}
FULLSYNC_LRS = (3e-3, 6e-3, 9e-3, 1.2e-2, 1.8e-2, 2.4e-2)
ASYNC_LRS = (1.5e-3, 3e-3, 6e-3)
ASYNC_STAGE2 = ({"dp.tau": 5}, {"dp.tau": 10}, {"optim.grad_clip": 10.0})
TUNE_RUNS = len(FULLSYNC_LRS)  # settings per tuning seed, each arm
assert len(ASYNC_LRS) + len(ASYNC_STAGE2) == TUNE_RUNS, "the two arms' budgets must be equal"
BATCH_FACTOR = 4  # the decomposition arm's microbatch, x the study's (FullSync's batch)
# the decomposition arm's own lr, tuned at its batch (FullSync picked 2.4e-2 at that batch):
# the async arm's lr was tuned at a quarter of it, so its row alone could mix a step too small
# with the staleness. Over 3e-3..2.4e-2 the loss rose with the lr (3e-3 best, the low edge), so
# the grid goes down to a quarter of that
BATCH_LRS = (7.5e-4, 1.5e-3, 3e-3, 6e-3, 1.2e-2, 2.4e-2)
LABEL = "like_for_like"
BATCH_ARM = f"AsyncMesh-fp8, microbatch x{BATCH_FACTOR}"  # its pick's name in the report


def _score(runs: list[dict[str, Any]]) -> float:
    vals = [r.get("val_loss") for r in runs]
    if not vals or any(
        v is None or not math.isfinite(v) or r.get("diverged")
        for v, r in zip(vals, runs, strict=True)
    ):
        return math.inf
    return statistics.mean(vals)


def best_of(runs: list[dict[str, Any]], names: list[str]) -> str:
    """The setting (a run name) with the lowest mean loss over its seeds; a diverged run makes
    its setting's score infinite, a setting without runs never wins."""
    return min(names, key=lambda n: _score([r for r in runs if r["method"] == n]))


def fullsync_variants() -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (f"FullSync rotated_adam lr {lr:g}", "FullSync", {**ROTATED, "optim.lr": lr})
        for lr in FULLSYNC_LRS
    ]


def async_lr_variants() -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (f"AsyncMesh-fp8 rotated_adam lr {lr:g}", "AsyncMesh-fp8", {**ROTATED, "optim.lr": lr})
        for lr in ASYNC_LRS
    ]


def async_stage2_variants(lr_change: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    out = []
    for change in ASYNC_STAGE2:
        label = ", ".join(f"{k.split('.')[-1]} {v:g}" for k, v in change.items())
        name = f"AsyncMesh-fp8 rotated_adam lr {lr_change['optim.lr']:g}, {label}"
        out.append((name, "AsyncMesh-fp8", {**lr_change, **change}))
    return out


def batch_variant(change: dict[str, Any], microbatch_size: int) -> tuple[str, str, dict]:
    """The async arm's best settings at FullSync's batch: microbatches BATCH_FACTOR x larger,
    so the same tokens take 1/BATCH_FACTOR of the updates (run_specs counts microbatches of the
    study's size: the variant's spec reads them BATCH_FACTOR at a time)."""
    ov = {**change, "pipeline.microbatch_size": microbatch_size * BATCH_FACTOR}
    return (f"AsyncMesh-fp8 rotated_adam, microbatch x{BATCH_FACTOR}", "AsyncMesh-fp8", ov)


def batch_lr_variants(change: dict[str, Any], microbatch_size: int) -> list[tuple[str, str, dict]]:
    """The decomposition arm at each of BATCH_LRS (the async arm's tau and clip kept)."""
    name, method, ov = batch_variant(change, microbatch_size)
    return [(f"{name}, lr {lr:g}", method, {**ov, "optim.lr": lr}) for lr in BATCH_LRS]


def run_like_for_like(
    base: Config, study_dir: Path, workers: int, report_only: bool = False
) -> dict[str, Any]:
    """The like for like, resumed from what OUT/like_for_like/ holds; report_only: run nothing,
    report the runs finished so far (a setting without runs never wins a pick; an evaluation
    seed without runs is left out of the paired gaps)."""
    out = study_dir / LABEL
    tune_on = tuning_seeds(study_dir / "tuning.json")
    study = json.loads((study_dir / "summary.json").read_text())
    evaluation = study["seeds"]["dp"]
    check_held_out(evaluation, tune_on)
    # the study's runs, and this like for like's own as its last report wrote them (a clean
    # checkout has no runs.partial.jsonl: the report is what resumes it there)
    known = known_runs(study_dir / "summary.json") + _reported_runs(study_dir)

    def run(variants: list[tuple[str, str, dict]], seeds: list[int], desc: str) -> list[dict]:
        _, specs, budget = study_variants(study_dir, LABEL, variants, seeds)
        specs = [_batched(s) for s in specs]
        return run_specs(base, specs, budget, out, workers, desc, known, report_only)

    fs = run(fullsync_variants(), tune_on, "like for like: FullSync lr")
    lr1 = run(async_lr_variants(), tune_on, "like for like: async lr")
    best_lr = best_of(lr1, [n for n, _, _ in async_lr_variants()])
    lr_change = _change(async_lr_variants(), best_lr)
    st2 = run(async_stage2_variants(lr_change), tune_on, "like for like: async tau, clip")
    async_all = async_lr_variants() + async_stage2_variants(lr_change)
    best_async = best_of(lr1 + st2, [n for n, _, _ in async_all])
    best_fs = best_of(fs, [n for n, _, _ in fullsync_variants()])
    chosen = {
        "FullSync": _change(fullsync_variants(), best_fs),
        "AsyncMesh-fp8": _change(async_all, best_async),
    }
    mb = base.pipeline.microbatch_size
    final = [
        ("FullSync rotated_adam", "FullSync", chosen["FullSync"]),
        ("AsyncMesh-fp8 rotated_adam", "AsyncMesh-fp8", chosen["AsyncMesh-fp8"]),
        batch_variant(chosen["AsyncMesh-fp8"], mb),
    ]
    ev = run(final, evaluation, "like for like: evaluation")
    # the decomposition arm at its own lr: tuned on the tuning seeds, then evaluated
    bt_variants = batch_lr_variants(chosen["AsyncMesh-fp8"], mb)
    bt = run(bt_variants, tune_on, "like for like: x4 batch lr")
    own_lr = f"{batch_variant(chosen['AsyncMesh-fp8'], mb)[0]}, own lr"
    if bt:  # none yet (a report of a stopped study): its row says "not run", nothing is picked
        change = _change(bt_variants, best_of(bt, [n for n, _, _ in bt_variants]))
        chosen[BATCH_ARM] = change
        final.append((own_lr, "AsyncMesh-fp8", change))
        ev += run(final[-1:], evaluation, "like for like: x4 batch at its lr")
    else:
        final.append((own_lr, "AsyncMesh-fp8", {}))
    summary = {
        "tuning_seeds": tune_on,
        "evaluation_seeds": evaluation,
        "microbatches_per_replica": study["microbatches_per_replica"]["dp"],
        "tune_runs_per_seed": TUNE_RUNS,
        "tuning": {
            r["method"]: r["val_loss"] for r in [*fs, *lr1, *st2, *bt] if r["seed"] == tune_on[0]
        },
        "tuning_runs": [*fs, *lr1, *st2, *bt],
        "chosen": chosen,
        "evaluation": {
            name: {r["seed"]: r["val_loss"] for r in ev if r["method"] == name}
            for name, _, _ in final
        },
        "runs": ev,
        "params": sum(stage_param_counts(base.model, 1)),
        "tokens_per_replica": study["microbatches_per_replica"]["dp"] * base.tokens_per_microbatch,
    }
    summary.update(rule_fields("like_for_like", summary, data_reference(base)))
    write_outputs(summary, study_dir)
    return summary


def _reported_runs(study_dir: Path) -> list[dict[str, Any]]:
    path = study_dir / f"{LABEL}.json"
    if not path.is_file():
        return []
    report = json.loads(path.read_text())
    return [*report.get("tuning_runs", []), *report.get("runs", [])]


def _change(variants: list[tuple[str, str, dict]], name: str) -> dict[str, Any]:
    return next(c for n, _, c in variants if n == name)


def _batched(spec: Any) -> Any:
    """A spec whose microbatches are BATCH_FACTOR x the study's reads that many at a time."""
    from dataclasses import replace

    if "microbatch x" in spec.method:
        return replace(spec, microbatches_per_update=BATCH_FACTOR)
    return spec


def table(summary: dict[str, Any]) -> str:
    ev = {k: {int(s): v for s, v in d.items()} for k, d in summary["evaluation"].items()}
    ref = ev.get("FullSync rotated_adam", {})
    rows = []
    for name, vals in ev.items():
        if not vals:
            rows.append([name, "not run", "", ""])
            continue
        nats = fmt_interval(paired_interval(vals, ref))
        pct = fmt_interval(paired_interval(vals, ref, relative=True), pct=True)
        rows.append([name, f"{statistics.mean(vals.values()):.4f}", nats, pct])
    by_name: dict[str, list[float]] = {}
    for r in summary["tuning_runs"]:
        by_name.setdefault(r["method"], []).append(r["val_loss"])
    tuned = [[n, " / ".join(f"{v:.4f}" for v in vs)] for n, vs in by_name.items()]
    return "\n".join(
        [
            "# The headline like for like: both arms with rotated_adam, equal tuning budgets",
            "",
            f"The convergence study's 4x2 grid, {summary['microbatches_per_replica']} microbatches "
            f"per replica. Each arm tuned with {summary['tune_runs_per_seed']} settings on each "
            f"tuning seed {summary['tuning_seeds']} (FullSync: its lr; AsyncMesh-fp8: its lr, then "
            f"its tau and clip at the best lr); the best of each on the evaluation seeds "
            f"{summary['evaluation_seeds']}; gaps paired by seed, mean +- SE [95% t interval], to "
            f"FullSync with rotated_adam. The microbatch x{BATCH_FACTOR} rows are the async arm at "
            "FullSync's batch and update count: at the async arm's lr (tuned at a quarter of "
            "that batch), and at its own lr (tuned over "
            f"{', '.join(f'{lr:g}' for lr in BATCH_LRS)}); what is left of the own-lr row's gap "
            "is the asynchrony's (stale weights, the partial averaging).",
            "",
            _scale_line(summary),
            "",
            format_table(["run", "val loss (mean)", "gap, nats", "gap, %"], rows),
            "",
            _picks(summary),
            "",
            "Tuning (final loss per tuning seed):",
            "",
            format_table(["setting", "val loss per tuning seed"], tuned),
            "",
        ]
    )


def _picks(summary: dict[str, Any]) -> str:
    """The settings each arm's tuning picked, and where a pick sits on its grid's edge."""
    parts = []
    for arm, change in summary.get("chosen", {}).items():
        shown = ", ".join(
            f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in change.items()
        )
        parts.append(f"{arm}: {shown}")
    edge = ""
    for arm, grid in (("FullSync", FULLSYNC_LRS), (BATCH_ARM, BATCH_LRS)):
        lr, lo, hi = summary.get("chosen", {}).get(arm, {}).get("optim.lr"), min(grid), max(grid)
        if lr in (lo, hi):
            edge += f" {arm}'s pick sits on its grid's edge ({lo:g}-{hi:g})."
    return f"Picked on the tuning seeds: {'; '.join(parts)}.{edge}" if parts else ""


def _scale_line(summary: dict[str, Any]) -> str:
    """The model's size and tokens, and the rule's line (where the reference sits against the
    data's bigram)."""
    size = ""
    if summary.get("params"):
        size = (
            f"Model: {summary['params'] / 1e6:.2f}M parameters, "
            f"{summary['tokens_per_replica'] / 1e6:.2f}M tokens a replica. "
        )
    return size + rule_line(summary)


def write_outputs(summary: dict[str, Any], study_dir: Path) -> None:
    (study_dir / "like_for_like.json").write_text(json.dumps(summary, indent=1) + "\n")
    (study_dir / "like_for_like.md").write_text(table(summary))
