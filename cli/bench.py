"""`meshtrain bench ...`: the side-by-side studies. COMMANDS, one table, makes every command: its
name, its handler (here, or the process grids' in cli/bench_grids.py), its own options and the
shared ones it takes (cli.options.BenchCommand). The drivers live in mesh/bench/; each handler
imports its own when it runs, so `meshtrain --help` stays light."""

from __future__ import annotations

import signal
from pathlib import Path

import click

from cli import bench_grids as grids
from cli import bench_system as system
from cli.options import BenchCommand, StudyArgs, parse_seeds
from mesh.config import ConfigError


@click.group()
def bench() -> None:
    """Side-by-side benchmarks that write summary.json, table.md and plots."""
    # SIGTERM unwinds like Ctrl-C: a benchmark's `finally` stops and reaps the grid it started
    # (Python's default SIGTERM exits at once and left a stopped soak's peers running)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


CONVERGENCE_OPTIONS = (
    click.option(
        "--lr-sweep",
        is_flag=True,
        help="Instead: the DP study's learning-rate sweep (lr_sweep.md; about 12 minutes here).",
    ),
    click.option(
        "--tune",
        is_flag=True,
        help="Instead: tune FullSync and AsyncMesh-fp8 with the same budget (tuning.md; about 45 "
        "minutes here with 2 workers from scratch; runs whose config is unchanged are reused).",
    ),
    click.option(
        "--dp-only",
        is_flag=True,
        help="Run the data-parallel study alone; keep the pipeline study's runs of summary.json.",
    ),
    click.option(
        "--seeds",
        default=None,
        help="The data-parallel study's evaluation seeds, e.g. 10-17 (default 10-17; --quick: "
        "10,11); refused where a seed also tuned (tuning.json's seeds, or --tune-seeds with "
        "--tune).",
    ),
    click.option(
        "--methods",
        default=None,
        help="The data-parallel methods to run, comma-separated, FullSync and AsyncMesh-fp8 among "
        "them (default: all); the others keep their runs of summary.json on their own seeds, "
        "marked in the table as not on the evaluation seeds.",
    ),
    click.option(
        "--tune-seeds", default=None, help="With --tune: the seeds its stages run on (default 0)."
    ),
    click.option(
        "--confirm-seeds",
        default=None,
        help="With --tune: the seeds each arm's best settings are confirmed on (default 1).",
    ),
    click.option(
        "--like-for-like",
        "like_for_like",
        is_flag=True,
        help="Instead: both headline arms with rotated_adam, each tuned with the same budget on "
        "the tuning seeds, then on the evaluation seeds, with the async arm at FullSync's batch "
        "beside them (like_for_like.md; 48 runs, resumable).",
    ),
    click.option(
        "--report-only",
        is_flag=True,
        help="With --like-for-like: run nothing, write like_for_like.md from the runs finished "
        "so far (a stopped study's missing runs are marked 'not run').",
    ),
    click.option(
        "--interval",
        "interval_axis",
        is_flag=True,
        help="Run the averaging-interval axis alone (AsyncMesh-fp8 at H = 1, 4, 16 on the "
        "study's seeds): OUT/interval/.",
    ),
)


def convergence(
    study: StudyArgs,
    lr_sweep: bool,
    tune: bool,
    dp_only: bool,
    interval_axis: bool,
    like_for_like: bool,
    report_only: bool,
    seeds: str | None,
    methods: str | None,
    tune_seeds: str | None,
    confirm_seeds: str | None,
) -> str | None:
    """Every baseline at equal tokens on the corpus, 8 evaluation seeds the tuning never used,
    plus the pipeline-only study (2 seeds)."""
    from mesh.bench.convergence import EVAL_SEEDS, check_methods, run_convergence, run_lr_sweep
    from mesh.bench.tuning import CONFIRM_SEEDS, TUNE_SEEDS, check_held_out

    evaluation = parse_seeds(seeds)
    tuning = parse_seeds(tune_seeds, "--tune-seeds")
    confirm = parse_seeds(confirm_seeds, "--confirm-seeds")
    if (tuning or confirm) and not tune:
        raise ConfigError("--tune-seeds and --confirm-seeds go with --tune")
    if evaluation and (lr_sweep or interval_axis):
        raise ConfigError(
            "--seeds goes with the study or --tune (--interval and --lr-sweep run "
            "on the study's own seeds)"
        )
    if report_only and not like_for_like:
        raise ConfigError("--report-only goes with --like-for-like")
    chosen = [m.strip() for m in methods.split(",") if m.strip()] if methods else None
    if chosen is not None:
        if tune or lr_sweep or interval_axis:
            raise ConfigError("--methods goes with the study (not --tune, --lr-sweep, --interval)")
        check_methods(chosen)
    if tune:  # the tuning's seeds against the study's evaluation seeds
        check_held_out(
            evaluation or EVAL_SEEDS, [*(tuning or TUNE_SEEDS), *(confirm or CONFIRM_SEEDS)]
        )
    cfg, out, workers, quick = study.config(), Path(study.out), study.workers, study.quick
    if like_for_like or interval_axis:
        flag = "--like-for-like" if like_for_like else "--interval"
        if not (out / "summary.json").is_file():
            raise ConfigError(f"{flag} runs on a study's settings: {out}/summary.json is missing")
    if like_for_like:
        from mesh.bench.like_for_like import run_like_for_like
        from mesh.bench.like_for_like import table as like_table

        return like_table(run_like_for_like(cfg, out, workers, report_only))
    if interval_axis:
        from mesh.bench.interval import run_interval
        from mesh.bench.interval import table as interval_table

        return interval_table(run_interval(cfg, out, workers, quick))
    if tune:
        from mesh.bench.tuning import run_tuning

        run_tuning(cfg, out, quick, workers, tuning, confirm)
        return (out / "tuning.md").read_text()
    if lr_sweep:
        run_lr_sweep(cfg, out, quick=quick, workers=workers)
        return (out / "lr_sweep.md").read_text()
    run_convergence(
        cfg, out, quick, workers, pipeline=not dp_only, seeds=evaluation, methods=chosen
    )
    return None


SEEDS_OPTION = click.option(
    "--seeds",
    default=None,
    help="Comma-separated seeds (default 0,1; runs of a stopped study with other seeds are kept "
    "in runs.partial.jsonl and reused).",
)


def ablations(
    study: StudyArgs,
    seeds: str | None,
) -> str:
    """The AsyncMesh paper's ablation table on an 8x2 grid, the paper's numbers beside ours."""
    from mesh.bench.ablations import run_ablations

    out = Path(study.out)
    run_ablations(study.config(), out, study.quick, study.workers, parse_seeds(seeds))
    return (out / "table.md").read_text()


BOUNDARY_OPTIONS = (
    click.option(
        "--seeds",
        default=None,
        help="Comma-separated seeds to report (default 0,1; the lrs are tuned on seed 100).",
    ),
    click.option(
        "--stages",
        "stages_csv",
        default=None,
        help="Comma-separated pipeline depths P to run (default 4,8); the rows of other depths "
        "that --out's summary.json holds are kept, and a later run with the same --out reuses "
        "these runs.",
    ),
    click.option(
        "--width",
        type=click.Choice(["64", "192"]),
        default="64",
        show_default=True,
        help="The model's d_model (its heads and MLP with it); 192 writes to "
        "results/boundary-d192 unless --out says otherwise.",
    ),
    click.option(
        "--report-only",
        is_flag=True,
        help="Run nothing: write summary.json, table.md and the plot from the runs finished so "
        "far (a study stopped part way; its missing arms are marked 'not run').",
    ),
    click.option(
        "--optimizer",
        type=click.Choice(["nadamw", "shipped"]),
        default="nadamw",
        show_default=True,
        help="nadamw: every arm at the methods' tuned settings; shipped: the async arms with "
        "what a pipeline of their depth gets without flags (optim.depth_rule = auto: Muon), "
        "FullSync with Muon; writes to results/boundary[-d192]-shipped unless --out says "
        "otherwise.",
    ),
    click.option(
        "--arms",
        "arms_csv",
        default=None,
        help="Comma-separated arms to run besides the reference and FullSync (e.g. 'learned "
        "8x,learned 16x'); the others are rows marked 'not run'.",
    ),
)


def boundary(
    study: StudyArgs,
    seeds: str | None,
    stages_csv: str | None,
    width: str,
    report_only: bool,
    optimizer: str,
    arms_csv: str | None,
) -> str:
    """Compressed stage boundaries: validation loss and bits per byte at equal tokens for each
    method at 8-64x fewer bytes than bf16, against full boundaries and FullSync, P = 4 and 8
    (a d 64 or d 192 Llama on the Shakespeare bytes, 1.6M tokens a run, unless --config/--set
    say otherwise)."""
    from mesh.bench.boundary import STUDY_DEFAULTS, WIDTHS, arms, run_boundary
    from mesh.bench.boundary_report import table

    chosen = parse_seeds(seeds)
    # the study's model unless a config file names one (--set overrides either)
    defaults = () if study.config_files else (*STUDY_DEFAULTS, *WIDTHS[int(width)])
    out = study.out
    if out == "results/boundary":
        out += (f"-d{width}" if width != "64" else "") + (
            "-shipped" if optimizer == "shipped" else ""
        )
    base = study.config(defaults)
    if base.data.path is not None and not Path(base.data.path).exists():
        raise ConfigError(
            f"data.path = {base.data.path!r} does not exist: prepare it with `meshtrain data "
            "prepare ... --out data/shakespeare-bpe4k --tokenizer bpe:4096` (README: Demo), or "
            "--set data.path=... and model.vocab_size to another dataset"
        )
    stages = parse_seeds(stages_csv, "--stages")
    if stages is not None and any(p < 2 for p in stages):
        raise ConfigError(f"--stages {stages_csv}: a pipeline needs P >= 2")
    only = None
    if arms_csv is not None:
        only = tuple(a.strip() for a in arms_csv.split(",") if a.strip())
        known = [a for a, _ in arms(base, 2)]
        if not only or set(only) - set(known):
            raise ConfigError(f"--arms {arms_csv!r}: choose from {', '.join(known)}")
    # the default study at full budget is what `plan --uplink-mbit` ships with
    publish = (
        not study.quick
        and out == "results/boundary"
        and not study.config_files
        and not study.overrides
        and only is None
    )
    summary = run_boundary(
        base,
        Path(out),
        study.quick,
        study.workers,
        chosen,
        tuple(stages) if stages else None,
        report_only,
        publish,
        optimizer,
        only,
    )
    return table(summary)


FIDELITY_OPTIONS = (
    click.argument("study", type=click.Choice(["precision", "horizon", "scaling"])),
)


def fidelity(args: StudyArgs, study: str) -> str:
    """The paper's other claims: payload precision, the gap against the horizon, grid scaling
    (results/fidelity/STUDY; reads results/convergence/tuning.json)."""
    from mesh.bench.fidelity import run_fidelity

    where = Path(args.out) / study
    run_fidelity(args.config(), study, where, args.quick, args.workers)
    return (where / "table.md").read_text()


OPTIMIZERS_OPTIONS = (
    click.option(
        "--target",
        type=float,
        default=None,
        help="Validation loss to reach (default: delay-free adamw's at half the horizon).",
    ),
    click.option(
        "--reanalyze",
        is_flag=True,
        help="Do not train: re-derive OUT/summary.json's async updates-to-target for --target "
        "(default: the loosest loss every run reaches) and rewrite the outputs.",
    ),
)


def optimizers(
    study: StudyArgs,
    target: float | None,
    reanalyze: bool,
) -> None:
    """Depth study: adamw, nadamw, muon, rotated_adam (+stage-aware) at P = 1..16; 2bw +- EF.

    The study's 16-layer model applies before --set (which wins) and after --config files.
    """
    from mesh.bench.optimizers.protocol import STUDY_DEFAULTS
    from mesh.bench.optimizers.runs import run_optimizers

    if reanalyze:
        from mesh.bench.optimizers.runs import reanalyze as rederive

        if not (Path(study.out) / "summary.json").is_file():
            raise ConfigError(f"--reanalyze: no {study.out}/summary.json; run the study first")
        rederive(Path(study.out), target)
        return
    cfg = study.config(STUDY_DEFAULTS)
    run_optimizers(cfg, Path(study.out), quick=study.quick, workers=study.workers, target=target)


DEPTH_OPTIONS = (
    SEEDS_OPTION,
    click.option(
        "--stages",
        "stages_csv",
        default=None,
        help="Comma-separated depths P of the finals, in the order they run (default 8,16,4).",
    ),
    click.option(
        "--phase",
        type=click.Choice(["screen", "picks", "finals", "long", "width"]),
        default="width",
        show_default=True,
        help="Stop after this phase: the screen at P = 8, the picks (the best two levers and "
        "their combination), the finals at every depth, the long run (4x the tokens), or the "
        "width check (d 192 x 8 at P = 8): the last is the whole study.",
    ),
    click.option(
        "--report-only",
        is_flag=True,
        help="Run nothing: write summary.json, table.md and gap.png from the runs finished so far.",
    ),
    click.option(
        "--levers",
        default=None,
        help="Comma-separated arms of the screen to run (the reference and FullSync always run; "
        "default: every arm), e.g. 'lr correction,beta1 0.95': the picks are made among them.",
    ),
)


def depth(
    study: StudyArgs,
    seeds: str | None,
    stages_csv: str | None,
    phase: str,
    report_only: bool,
    levers: str | None,
) -> str:
    """Depth at parity: the async pipeline against FullSync at P = 4, 8 and 16, and the levers
    that close the gap (lr correction, adaptive momentum, the decay phase, rotation, Muon, 2BW
    with error feedback, weight prediction), screened at P = 8 with tuned lrs, then the best
    two and their combination on the report seeds (a 16-block d 64 Llama on the Shakespeare
    bytes, 1.6M tokens a run, unless --config/--set say otherwise; docs/depth.md)."""
    from mesh.bench.depth import run_depth
    from mesh.bench.depth_arms import STUDY_DEFAULTS
    from mesh.bench.depth_report import table

    stages = parse_seeds(stages_csv, "--stages")
    if stages is not None and any(p < 2 for p in stages):
        raise ConfigError(f"--stages {stages_csv}: a pipeline needs P >= 2")
    if stages is not None and "-" not in stages_csv:  # as given: the finals run the first first
        stages = list(dict.fromkeys(int(p) for p in stages_csv.split(",")))
    base = study.config(() if study.config_files else STUDY_DEFAULTS)
    summary = run_depth(
        base,
        Path(study.out),
        study.quick,
        study.workers,
        parse_seeds(seeds),
        tuple(stages) if stages else None,
        phase,
        report_only,
        [x.strip() for x in levers.split(",")] if levers else None,
    )
    return table(summary)


# every `meshtrain bench` command (`meshtrain bench --help` lists them by name)
COMMANDS = (
    BenchCommand(
        "convergence",
        convergence,
        CONVERGENCE_OPTIONS,
        study="A short version (under 5 minutes here).",
    ),
    BenchCommand(
        "ablations",
        ablations,
        (SEEDS_OPTION,),
        study="1 seed, 160 microbatches (a few minutes here).",
    ),
    BenchCommand(
        "boundary",
        boundary,
        BOUNDARY_OPTIONS,
        study="1 seed, P = 2, 24 microbatches (a minute here).",
    ),
    BenchCommand(
        "fidelity",
        fidelity,
        FIDELITY_OPTIONS,
        study="1 seed at a tenth of the budget (a few minutes here).",
    ),
    BenchCommand(
        "depth",
        depth,
        DEPTH_OPTIONS,
        study="1 seed, P = 2 and 4, 24 microbatches (a few minutes here).",
    ),
    BenchCommand("comms", system.comms, system.COMMS_OPTIONS),
    BenchCommand("throughput", system.throughput, system.THROUGHPUT_OPTIONS, config=True),
    BenchCommand("runtime", system.runtime, system.RUNTIME_OPTIONS, config=True),
    BenchCommand(
        "optimizers",
        optimizers,
        OPTIMIZERS_OPTIONS,
        study="A short version (under 5 minutes here).",
    ),
    BenchCommand("model", system.model, system.MODEL_OPTIONS),
    BenchCommand("scale-model", system.scale_model, system.SCALE_MODEL_OPTIONS),
    BenchCommand("join", grids.join, grids.JOIN_OPTIONS),
    BenchCommand("nat", grids.nat, grids.NAT_OPTIONS),
    BenchCommand("pools", grids.pools, grids.POOLS_OPTIONS),
    BenchCommand("soak", grids.soak, grids.SOAK_OPTIONS),
    BenchCommand("scale", grids.scale, grids.SCALE_OPTIONS),
)
for _entry in COMMANDS:
    bench.add_command(_entry.command())
