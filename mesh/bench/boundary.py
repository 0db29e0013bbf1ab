"""`meshtrain bench boundary`: what compressing a stage boundary costs in loss, at equal tokens.

Every arm is one replica's pipeline (grid P x 1: the boundary is the pipeline's; the averaging
axis has its own study) of a small Llama on the Shakespeare bytes, trained on the same tokens:
the async pipeline with full bf16 boundaries (the reference, 1x), with full fp8 boundaries, the
synchronous pipeline (FullSync: GPipe with a flush), and each compressed method
(pipeline.boundary = learned | subspace, fp8 coordinates) at the rank that makes its boundary
FP8_RATIOS times smaller than full bf16, and the learned boundary with 4-bit coordinates
(pipeline.codec = int4_hadamard) at the INT4_STUDY_RATIOS. The gap of an arm is its validation
loss against the reference's, paired by seed, as a share of the reference (bits per byte is the
loss times a constant of the dataset, so its relative gap is the same).

The study is sized to pass the rule every study is read by (mesh/bench/regime.py): its reference
must end at least 15% below the data's bigram cross-entropy, which a d 64 Llama reaches on bytes
in about 1.6M tokens (a d 64 model on the 4k BPE at 154k tokens sat between the unigram and the
bigram: results/boundary-bpe4k, an early-training observation). --width 64 or 192 picks the
model (WIDTHS); each width is its own study in its own --out.

A study re-run in the same --out reuses the runs its summary.json already holds (same config
fingerprint and budget), so adding arms runs only the new ones, a stopped study resumes from its
runs.partial.jsonl, and a run of some depths (--stages 4) keeps the rows of the others. The cache
trusts that a fingerprint means the same numbers: after a change to the simulator's numbers, or
on another machine (the same code, data and config can give other floats there, so other
trajectories: docs/boundaries.md), start from a fresh --out. The pipeline sentinel is off in
every arm (sentinel.enabled).

The lrs are tuned on a seed that is not reported (TUNE_SEED): the async reference's and
FullSync's best of LR_GRID at each P; every async arm of that P then runs at the reference's lr
(a compressed boundary gets no tuning of its own, so a gap is the method's, not a sweep's).
"""

from __future__ import annotations

import functools
import math
import time
from pathlib import Path
from typing import Any

from mesh.bench.ablations import best_lr
from mesh.bench.boundary_report import MAPL_BAND, PUBLISHED, REFERENCE, write_outputs
from mesh.bench.regime import data_reference, rule_fields
from mesh.bench.report import paired_gap, study_scale
from mesh.bench.simruns import MUON_LR_FACTOR, Spec, run_specs
from mesh.config import Config
from mesh.config_sections import ConfigError
from mesh.engine import measured
from mesh.engine.plan import boundary_bytes, rank_for_compression
from mesh.engine.uplink import INT4_CODEC, arm_label
from mesh.methods import METHODS

FP8_RATIOS = {"learned": (8, 16, 32), "subspace": (8, 16)}
INT4_STUDY_RATIOS = (32, 64)
COMPRESSED = tuple(FP8_RATIOS)
STAGES = (4, 8)
REPORT_SEEDS = [0, 1]
TUNE_SEED = 100
# each baseline's lrs (FullSync's updates take 4 microbatches each: it wants a larger one)
LR_GRID = {"full bf16": (4e-3, 8e-3), "FullSync": (8e-3, 1.6e-2)}
# at P = 8 both bests sat on the grid's low edge (the reference 2.01 at 4e-3 against 2.38 at
# 8e-3: eight stages of staleness want a smaller step), so P = 8 also tries lower: the
# reference down to a quarter (2e-3 gave 1.97, still the edge), FullSync to half. P = 4's bests
# sat on the same edges (the reference 1.810 at 4e-3 against 1.839 at 8e-3): it tries as low,
# so that both depths, and d 64 against d 192, are tuned alike. There the reference's best
# stayed 4e-3 (2e-3: 1.817, 1e-3: 1.869), and FullSync's moved to 4e-3 (1.827 against 1.835 at
# 8e-3), its new edge: FullSync also tries 2e-3
LR_GRID_EXTRA = {
    4: {"full bf16": (1e-3, 2e-3), "FullSync": (2e-3, 4e-3)},
    8: {"full bf16": (1e-3, 2e-3), "FullSync": (4e-3,)},
}
QUICK_LRS = {"full bf16": (4e-3,), "FullSync": (8e-3,)}
# a wider model wants a smaller step (Adam's update is per element, a d 192 matrix sums 3x the
# terms): d 192 tries half of d 64's grid and d 64's low edge; its reference's best sat on the
# low edge twice (4e-3: 2.040, 2e-3: 1.757, 1e-3: 1.675 nats per byte on seed 100), so it goes
# down to 5e-4; FullSync's too (2e-3: 1.701, 4e-3: 1.773, 8e-3: 1.948), so it goes as low
# (1e-3: 1.698, 5e-4: 1.755: its best is inside). The reference's best then sat on the new
# low edge, if by a hair (5e-4: 1.6736, 1e-3: 1.6751): it also tries 2.5e-4
LR_GRID_WIDTH = {
    192: {
        "full bf16": (2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3),
        "FullSync": (5e-4, 1e-3, 2e-3, 4e-3, 8e-3),
    }
}
# ... and at P = 8 FullSync leaves out 8e-3: at P = 4 it ended 15% behind the best (1.948
# against 1e-3's 1.698), and d 64's best only doubled from P = 4 to 8 (4e-3 to 8e-3), so 4e-3
# still brackets a best that doubles; a d 192 run at P = 8 takes 10-20 minutes of a core
LR_GRID_WIDTH_AT = {192: {8: {"FullSync": (5e-4, 1e-3, 2e-3, 4e-3)}}}
# --optimizer shipped: every async arm takes what a user's pipeline of that depth gets
# (optim.depth_rule = auto: Muon, its matrices at the rule's 0.01, the lr sweep moving the rest),
# FullSync Muon with its matrices at MUON_LR_FACTOR x the lr (bench depth's same-optimizer
# FullSync). d 192 at P = 8 takes the lr bench depth tuned for the rule's arm there on seed 100
# (Muon at momentum 0.9: 1e-3 best of 2.5e-4 .. 2e-3, 1.534), so it sweeps nothing new
OPTIMIZERS = ("nadamw", "shipped")
SHIPPED_LR_GRID = {"full bf16": (5e-4, 1e-3, 2e-3), "FullSync": (2e-3, 4e-3, 8e-3)}
SHIPPED_LR_GRID_AT = {192: {8: {"full bf16": (1e-3,)}}}
MICROBATCHES = 1600  # per run: 1.64M tokens of 1,024 a microbatch
QUICK_MICROBATCHES = 24
# the model at each width (a Llama, 8 blocks so that P = 8 holds one a stage, on bytes)
WIDTHS = {
    64: [
        "model.d_model=64",
        "model.n_heads=4",
        "model.n_kv_heads=2",
        "model.intermediate_size=172",
    ],
    192: [
        "model.d_model=192",
        "model.n_heads=6",
        "model.n_kv_heads=2",
        "model.intermediate_size=512",
    ],
}
# the study's model, unless the command line says otherwise
STUDY_DEFAULTS = [
    "model.arch=llama",
    "model.vocab_size=256",
    "model.n_layers=8",
    "model.seq_len=128",
    "pipeline.microbatch_size=8",
    "data.val_batches=16",
    *WIDTHS[64],
]
ANCHOR_RANK = 16


def arms(base: Config, stages: int, optimizer: str = "nadamw") -> list[tuple[str, dict[str, Any]]]:
    """(arm, its overrides) for one P: the baselines, then each method at each ratio.
    optimizer: "nadamw" (the methods' tuned settings) or "shipped" (OPTIMIZERS)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r}: one of {OPTIMIZERS}")
    shipped = optimizer == "shipped"
    tokens, d = base.tokens_per_microbatch, base.model.d_model
    # the pipeline sentinel (a defence against hostile stages) is off: its drops are not a
    # boundary's cost, and on a learned boundary's early, fast-turning coordinates it can drop
    # every later message of an honest stage (docs/boundaries.md)
    grid = {"grid.stages": stages, "grid.replicas": 1, "sentinel.enabled": False}
    async_ = {**METHODS["AsyncMesh-fp8"], **grid, "pipeline.boundary": "full"}
    fullsync = {**METHODS["FullSync"], **grid, "pipeline.microbatches": 4, "pipeline.codec": "bf16"}
    if shipped:
        async_["optim.depth_rule"] = "auto"
        fullsync["optim.name"] = "muon"  # its matrices' lr follows the lr (_spec)
    out = [
        (REFERENCE, {**async_, "pipeline.codec": "bf16"}),
        ("full fp8", {**async_, "pipeline.codec": "fp8_e4m3"}),
        ("FullSync", fullsync),
    ]
    compressed = [(m, ratio, "fp8_e4m3") for m, ratios in FP8_RATIOS.items() for ratio in ratios]
    compressed += [("learned", ratio, INT4_CODEC) for ratio in INT4_STUDY_RATIOS]
    for method, ratio, codec in compressed:
        rank = rank_for_compression(tokens, d, ratio, codec)
        ov = {
            **async_,
            "pipeline.codec": codec,
            "pipeline.boundary": method,
            "pipeline.boundary_rank": rank,
            "pipeline.anchor_rank": ANCHOR_RANK,
        }
        out.append((arm_label(method, ratio, codec), ov))
    return out


def lr_grid(
    stages: int, quick: bool = False, width: int = 64, optimizer: str = "nadamw"
) -> dict[str, tuple[float, ...]]:
    """Each baseline's lrs to try at depth `stages` and d_model `width`, smallest first."""
    if quick:
        return QUICK_LRS
    if optimizer == "shipped":
        return {**SHIPPED_LR_GRID, **SHIPPED_LR_GRID_AT.get(width, {}).get(stages, {})}
    grid = {**LR_GRID_WIDTH.get(width, LR_GRID), **LR_GRID_WIDTH_AT.get(width, {}).get(stages, {})}
    extra = LR_GRID_EXTRA.get(stages, {}) if width == 64 else {}
    return {arm: tuple(sorted({*lrs, *extra.get(arm, ())})) for arm, lrs in grid.items()}


def _spec(arm: str, ov: dict[str, Any], seed: int, lr: float) -> Spec:
    mpu = 4 if arm == "FullSync" else 1
    label = f"P{ov['grid.stages']} {arm}"
    ov = {**ov, "optim.lr": lr}
    if ov.get("optim.name") == "muon" and "optim.muon_lr" not in ov:
        ov["optim.muon_lr"] = round(MUON_LR_FACTOR * lr, 10)
    return Spec("boundary", label, seed, mpu, tuple(ov.items()))


def lr_specs(
    base: Config,
    stages: int,
    seed: int,
    lrs: dict[str, tuple[float, ...]],
    optimizer: str = "nadamw",
) -> list[Spec]:
    """The reference and FullSync at each of their lrs (labels end in lr=...)."""
    specs = []
    for arm, ov in arms(base, stages, optimizer):
        if arm in lrs:
            for lr in lrs[arm]:
                s = _spec(arm, ov, seed, lr)
                specs.append(
                    Spec(
                        s.study,
                        f"{s.method} lr={lr:g}",
                        seed,
                        s.microbatches_per_update,
                        s.overrides,
                    )
                )
    return specs


# the order the arms run in on each seed: the reference, then the arms the frontier question
# turns on (a study stopped part way has those first: 16x, the target's ratio, and 8x, where the
# frontier sits when 16x misses), the baselines last
BASELINES = (REFERENCE, "FullSync")
RUN_FIRST = (
    "full bf16",
    "learned 16x",
    "learned 8x",
    "learned 32x int4",
    "learned 32x",
    "learned 64x int4",
    "subspace 16x",
    "subspace 8x",
)


def build_specs(
    base: Config,
    stages: int,
    seeds: list[int],
    lrs: dict[str, float],
    part: str = "all",
    optimizer: str = "nadamw",
    only: tuple[str, ...] | None = None,
) -> list[Spec]:
    """The arms of one P on every seed, arm by arm in RUN_FIRST's order, each on all seeds (a
    study stopped part way has whole rows, paired by seed): FullSync at its lr, every async arm
    at the reference's. part: "all", "async" (all but FullSync) or "FullSync"; only: these
    arms and the baselines (None: every arm)."""
    ordered = sorted(arms(base, stages, optimizer), key=lambda a: _run_rank(a[0]))
    return [
        _spec(arm, ov, seed, lrs["FullSync" if arm == "FullSync" else REFERENCE])
        for arm, ov in ordered
        if part == "all" or (arm == "FullSync") == (part == "FullSync")
        if only is None or arm in only or arm in BASELINES
        for seed in seeds
    ]


def _run_rank(arm: str) -> int:
    return RUN_FIRST.index(arm) if arm in RUN_FIRST else len(RUN_FIRST)


def summarize_rows(
    base: Config, runs: list[dict[str, Any]], stages: int, optimizer: str = "nadamw"
) -> list[dict[str, Any]]:
    """One row per arm of one P: its bytes, its losses over the seeds, its gap to the
    reference (a share of the reference's loss, paired by seed)."""
    tokens, d = base.tokens_per_microbatch, base.model.d_model
    full_bf16 = boundary_bytes(tokens, d, "full", 0, "bf16")
    by_arm: dict[str, dict[int, dict[str, Any]]] = {}
    for r in runs:
        by_arm.setdefault(r["method"], {})[r["seed"]] = r
    ref = {s: r["val_loss"] for s, r in by_arm.get(f"P{stages} {REFERENCE}", {}).items()}
    rows = []
    for arm, ov in arms(base, stages, optimizer):
        got = by_arm.get(f"P{stages} {arm}", {})
        method = ov.get("pipeline.boundary", "full")
        rank = ov.get("pipeline.boundary_rank", d) if method != "full" else d
        codec = ov["pipeline.codec"]
        nbytes = boundary_bytes(tokens, d, method, rank, codec)
        losses = {s: r["val_loss"] for s, r in got.items() if not r.get("diverged")}
        rel = {s: v / ref[s] for s, v in losses.items() if s in ref}
        gap = paired_gap(rel, dict.fromkeys(rel, 1.0))
        bpb = [r["val_bpb"] for r in got.values() if r.get("val_bpb") is not None]
        rows.append(
            {
                "arm": arm,
                "method": method,
                "P": stages,
                "rank": rank,
                "codec": codec,
                "schedule": "gpipe" if arm == "FullSync" else "async",
                "compression": round(full_bf16 / nbytes, 3),
                "bytes_per_token": round(nbytes / tokens, 4),
                "val_loss": _mean(list(losses.values())),
                "val_bpb": _mean(bpb),
                "loss_gap": None if gap is None else round(gap[0], 5),
                "loss_gap_se": None
                if gap is None or not math.isfinite(gap[1])
                else round(gap[1], 5),
                "seeds": sorted(got),
                "diverged": sum(bool(r.get("diverged")) for r in got.values()),
            }
        )
    return rows


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else None


def frontier(rows: list[dict[str, Any]], max_gap: float = 0.01) -> dict[int, dict[str, Any]]:
    """Per P, the most compressed arm whose mean gap is at most max_gap (None: none is)."""
    out: dict[int, dict[str, Any]] = {}
    for r in rows:
        if r["loss_gap"] is None or r["loss_gap"] > max_gap or r["method"] == "full":
            continue
        best = out.get(r["P"])
        if best is None or r["compression"] > best["compression"]:
            out[r["P"]] = r
    return out


def earlier_runs(out: Path) -> list[dict[str, Any]]:
    """The runs (and lr sweep) of a study already written to out/summary.json."""
    old = _earlier_summary(out)
    return [*old.get("lr_sweep", []), *old.get("runs", [])]


def _earlier_summary(out: Path, optimizer: str | None = None) -> dict[str, Any]:
    """out/summary.json ({} if none); refused (ConfigError) where it is a study of another
    optimizer than `optimizer` (None: any)."""
    import json

    path = out / "summary.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    if old and optimizer is not None and old.get("optimizer", "nadamw") != optimizer:
        raise ConfigError(
            f"--optimizer {optimizer}: {out} holds a study with --optimizer "
            f"{old.get('optimizer', 'nadamw')}; give this one its own --out"
        )
    return old


def _depth(run: dict[str, Any]) -> int:
    """A run's P, from its label ("P8 learned 16x", "P4 full bf16 lr=0.004")."""
    return int(run["method"].split()[0][1:])


def held_depths(
    old: dict[str, Any], stages: tuple[int, ...], microbatches: int
) -> tuple[dict[int, dict[str, float]], list[dict[str, Any]], list[dict[str, Any]]]:
    """What an earlier summary holds for the depths this call does not run, at the same budget:
    their tuned lrs, lr sweep and runs (kept, so --stages 4 adds to a study of P = 4 and 8)."""
    lrs = {int(p): v for p, v in old.get("lrs", {}).items() if int(p) not in stages}

    def kept(key: str) -> list[dict[str, Any]]:
        return [
            r
            for r in old.get(key, [])
            if _depth(r) in lrs and r.get("microbatches") == microbatches
        ]

    runs = kept("runs")
    lrs = {p: v for p, v in lrs.items() if p in {_depth(r) for r in runs}}
    return lrs, [r for r in kept("lr_sweep") if _depth(r) in lrs], runs


def _grids_of(
    stages: tuple[int, ...], grids: dict[int, dict[str, tuple[float, ...]]], old: dict[str, Any]
) -> dict[str, dict[str, list[float]]]:
    """Each depth's lr grid for the summary: this call's, or for a depth it kept from an earlier
    summary (held_depths), the grid that summary says its sweep ran."""
    ran = {str(p): {arm: list(v) for arm, v in g.items()} for p, g in grids.items()}
    return {str(p): ran.get(str(p)) or old.get("lr_grid", {}).get(str(p), {}) for p in stages}


def run_boundary(
    base: Config,
    out: Path,
    quick: bool,
    workers: int,
    seeds: list[int] | None = None,
    stages: tuple[int, ...] | None = None,
    report_only: bool = False,
    publish: bool = False,
    optimizer: str = "nadamw",
    only: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """The study (its lr sweeps, then every arm on every seed), resumed from what out/ holds.
    report_only: run nothing, write the outputs from the runs finished so far (a study
    stopped part way: the arms without runs are rows marked "not run"). publish: the costs
    `plan --uplink-mbit` ships with become this study's (mesh/engine/measured.py). optimizer:
    OPTIMIZERS; only: run these arms and the baselines (the others are rows "not run")."""
    seeds = seeds or ([0] if quick else REPORT_SEEDS)
    old = _earlier_summary(out, optimizer)
    known = [*old.get("lr_sweep", []), *old.get("runs", [])]
    budget = {"boundary": QUICK_MICROBATCHES if quick else MICROBATCHES}
    stages = stages or ((2,) if quick else STAGES)
    start = time.perf_counter()
    run = functools.partial(run_specs, report_only=report_only)
    width = base.model.d_model
    grids = {p: lr_grid(p, quick, width, optimizer) for p in stages}

    def sweep_of(arm: str) -> dict[int, list[dict[str, Any]]]:
        return {
            p: run(
                base,
                lr_specs(base, p, TUNE_SEED, {arm: grids[p][arm]}, optimizer),
                budget,
                out,
                workers,
                f"boundary P={p}: {arm} lr",
                known,
            )
            for p in stages
        }

    def arms_of(part: str, lrs: dict[int, dict[str, float]]) -> list[dict[str, Any]]:
        specs = [
            s
            for p in stages
            if p in lrs
            for s in build_specs(base, p, seeds, lrs[p], part, optimizer, only)
        ]
        return run(base, specs, budget, out, workers, f"boundary: {part} arms", known)

    # the reference's sweep and the async arms first, FullSync's sweep and runs last: at d 192
    # a run takes 20 minutes, and the frontier is read against the reference
    ref_sweep = sweep_of(REFERENCE)
    ref_lr = {p: {REFERENCE: best_lr(rs)} for p, rs in ref_sweep.items() if rs}
    runs = arms_of("async", ref_lr)
    fs_sweep = sweep_of("FullSync")
    tuned = {p: {**ref_lr[p], "FullSync": best_lr(fs_sweep[p])} for p in ref_lr if fs_sweep[p]}
    runs += arms_of("FullSync", tuned)
    sweeps = [r for p in stages for r in [*ref_sweep[p], *fs_sweep[p]]]
    tuned = {**ref_lr, **tuned}
    held_lrs, held_sweep, held_runs = held_depths(old, stages, budget["boundary"])
    tuned.update(held_lrs)
    sweeps, runs = sweeps + held_sweep, runs + held_runs
    stages = tuple(sorted(tuned))
    rows = [row for p in stages for row in summarize_rows(base, runs, p, optimizer)]
    best = frontier(rows)
    summary = {
        **study_scale(base),
        "microbatches_per_replica": budget["boundary"],
        "tokens_per_run": budget["boundary"] * base.tokens_per_microbatch,
        "seeds": seeds,
        "tune_seed": TUNE_SEED,
        "lr_grid": _grids_of(stages, grids, old),
        "lrs": {str(p): v for p, v in tuned.items()},
        "anchor_rank": ANCHOR_RANK,
        "optimizer": optimizer,
        "quick": quick,
        "complete": all(r["seeds"] == sorted(seeds) for r in rows) and bool(rows),
        "rows": rows,
        "best_within_1pct": {
            str(p): r and {k: r[k] for k in ("arm", "compression", "loss_gap")}
            for p, r in ((p, best.get(p)) for p in stages)
        },
        "published": [
            {"name": n, "compression": c, "reported_loss_cost": g} for n, c, g in PUBLISHED
        ],
        "mapl_equal_token_band": [
            {"compression": c, "loss_cost_pct": [lo, hi]} for c, lo, hi in MAPL_BAND
        ],
        "wall_s": round(time.perf_counter() - start, 1),
        "cpu_s_of_runs": round(sum(r["wall_s"] for r in [*sweeps, *runs]), 1),
    }
    summary.update(rule_fields("boundary", summary, data_reference(base)))
    summary.update(lr_sweep=sweeps, runs=runs)
    write_outputs(summary, out)
    if publish:
        measured.record("boundary", measured.boundary_entry(summary, str(out / "summary.json")))
    if summary["complete"]:
        (out / "runs.partial.jsonl").unlink(missing_ok=True)
    return summary
