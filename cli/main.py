"""`meshtrain`: the command group. User errors print one line and exit 2, never a traceback."""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from mesh.config import Config, ConfigError, load_config
from mesh.errors import CheckpointError, DataError

USER_ERRORS = (ConfigError, DataError, CheckpointError)  # join errors are ConfigErrors


def user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn our user-facing exceptions into a message and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)

    return wrapper


def config_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    fn = click.option(
        "--set",
        "overrides",
        multiple=True,
        metavar="KEY=VALUE",
        help="Override one config key (repeatable), e.g. --set grid.stages=4.",
    )(fn)
    fn = click.option(
        "--config",
        "config_files",
        multiple=True,
        metavar="FILE",
        help="TOML config file (repeatable; later files win).",
    )(fn)
    return fn


def resolve_config(
    config_files: tuple[str, ...], overrides: tuple[str, ...], extra: list[str] = ()
) -> Config:
    return load_config(list(config_files), list(overrides) + list(extra))


@click.group()
@click.version_option(package_name="meshtrain")
def main() -> None:
    """meshtrain: decentralized LM training on a P x m grid of peers."""


@main.command("show-config")
@config_options
@user_errors
def show_config(config_files: tuple[str, ...], overrides: tuple[str, ...]) -> None:
    """Print the resolved config as TOML (defaults < --config files < --set)."""
    cfg = resolve_config(config_files, overrides)
    click.echo(f"# fingerprint {cfg.fingerprint()}")
    click.echo(cfg.to_toml(), nl=False)


@main.command()
@config_options
@click.option("--grid", default=None, metavar="PxM", help="Shorthand for grid.stages / replicas.")
@click.option("--steps", type=int, default=None, help="Shorthand for run.steps.")
@click.option("--method", default=None, help="A named baseline, e.g. AsyncMesh, FullSync.")
@click.option("--out", type=click.Path(file_okay=False), default=None, help="Run directory.")
@click.option(
    "--backend",
    type=click.Choice(["torch", "hivemind", "logical"]),
    default=None,
    help="torch/hivemind: every cell its own process talking over that transport on "
    "127.0.0.1 (default: runtime.backend, torch); logical: the whole grid in one process on "
    "a logical clock (exact, fast; for studies).",
)
@click.option(
    "--resume",
    type=click.Path(file_okay=False, exists=True),
    default=None,
    help="Continue a stopped run (torch/hivemind backends) from its checkpoints.",
)
@user_errors
def simulate(
    config_files: tuple[str, ...],
    overrides: tuple[str, ...],
    grid: str | None,
    steps: int | None,
    method: str | None,
    out: str | None,
    backend: str | None,
    resume: str | None,
) -> None:
    """Train a whole grid on this machine, every cell its own process, and print a summary."""
    extra = grid_overrides(grid) + ([f"run.steps={steps}"] if steps else [])
    if resume:
        if backend == "logical":
            raise ConfigError("--resume needs --backend torch or hivemind")
        if method:
            raise ConfigError("--resume keeps the run's method (its config.toml); drop --method")
        if out and Path(out) != Path(resume):
            raise ConfigError(f"--resume {resume} continues in that directory; drop --out")
        from cli.preflight import resume_config

        # the run's stored config, with later flags on top if they leave the math so far alone
        # (--steps extends it); nothing is written before every check passed
        _, cfg = resume_config(Path(resume), list(config_files), [*overrides, *extra])
        out = resume
    else:
        cfg = resolve_config(config_files, overrides, extra)
    backend = backend or cfg.runtime.backend
    # heavy imports after the config is known to be valid: a typo answers at once
    from cli.report import print_table, progress_bar
    from mesh.engine.sim import GridSim
    from mesh.methods import METHODS, apply_method

    if method:
        if method not in METHODS:
            raise ConfigError(f"--method {method}: unknown; choose one of {', '.join(METHODS)}")
        cfg = apply_method(cfg, method)
    if backend != "logical":
        from cli.simulate import simulate_processes

        simulate_processes(cfg, backend, Path(out) if out else None, resume=bool(resume))
        return
    sim = GridSim(cfg)
    with progress_bar(cfg.run.steps, "simulate") as bar:
        result = sim.run(lambda step, loss: bar.update_loss(loss))
    summary = {"config_fingerprint": cfg.fingerprint(), **result.__dict__}
    if out:
        path = Path(out)
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.toml").write_text(cfg.to_toml())
        (path / "summary.json").write_text(json.dumps(summary, indent=2))
    print_table(
        ["grid", "steps", "tokens", "val loss", "pp B/replica/step", "dp B/replica/step", "wall s"],
        [
            [
                result.grid,
                result.steps,
                result.tokens,
                "diverged" if result.val_loss is None else f"{result.val_loss:.4f}",
                f"{result.pp_bytes_per_replica_step:,.0f}",
                f"{result.dp_bytes_per_replica_step:,.0f}",
                f"{result.wall_s:.1f}",
            ]
        ],
    )


def grid_overrides(grid: str | None) -> list[str]:
    if grid is None:
        return []
    parts = grid.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ConfigError(f"--grid {grid}: expected STAGESxREPLICAS, e.g. --grid 4x2")
    return [f"grid.stages={parts[0]}", f"grid.replicas={parts[1]}"]


@main.group()
def bench() -> None:
    """Side-by-side benchmarks that write summary.json, table.md and plots."""


@bench.command("convergence")
@config_options
@click.option("--quick", is_flag=True, help="A short version (under 5 minutes here).")
@click.option("--out", type=click.Path(file_okay=False), default="results/convergence")
@click.option("--workers", type=int, default=2, help="Runs in parallel (one core each).")
@click.option(
    "--lr-sweep",
    is_flag=True,
    help="Instead: the DP study's learning-rate sweep (lr_sweep.md; about 12 minutes here).",
)
@user_errors
def bench_convergence(
    config_files: tuple[str, ...],
    overrides: tuple[str, ...],
    quick: bool,
    out: str,
    workers: int,
    lr_sweep: bool,
) -> None:
    """Every baseline at equal tokens on the corpus, 2 seeds, plus the pipeline-only study."""
    from mesh.bench.convergence import run_convergence, run_lr_sweep

    cfg = resolve_config(config_files, overrides)
    if lr_sweep:
        run_lr_sweep(cfg, Path(out), quick=quick, workers=workers)
        click.echo((Path(out) / "lr_sweep.md").read_text())
        return
    run_convergence(cfg, Path(out), quick=quick, workers=workers)


@bench.command("comms")
@click.option("--quick", is_flag=True, help="Fewer repetitions (about a minute).")
@click.option("--out", type=click.Path(file_okay=False), default="results/comms")
@user_errors
def bench_comms(quick: bool, out: str) -> None:
    """Codecs, transports (hivemind and torch.distributed), group means and link shaping."""
    # comms knows nothing of models: this benchmark needs no config
    from mesh.bench.comms import run_comms_bench

    run_comms_bench(Path(out), quick=quick)
    click.echo((Path(out) / "table.md").read_text())


@bench.command("throughput")
@config_options
@click.option("--quick", is_flag=True, help="One short window per method (about 2 minutes).")
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    default="results/throughput",
    show_default=True,
    help="Where summary.json, table.md and each window's metrics go.",
)
@user_errors
def bench_throughput(
    config_files: tuple[str, ...], overrides: tuple[str, ...], quick: bool, out: str
) -> None:
    """Grids A1-A4, emulated compute on shaped links: FullSync vs AsyncMesh, interleaved.

    The protocol's settings (d=128, L=4, T=128, B=8, M=4, t_f=10 ms, t_b=20 ms) apply after
    --config files and before --set (which wins).
    """
    from mesh.bench.throughput.protocol import BENCH_SETS
    from mesh.bench.throughput.runs import run_throughput

    cfg = load_config(list(config_files), [*BENCH_SETS, *overrides])
    run_throughput(cfg, Path(out), quick=quick)


@bench.command("runtime")
@config_options
@click.option("--quick", is_flag=True, help="40 updates instead of 200.")
@click.option("--out", type=click.Path(file_okay=False), default="results/runtime")
@user_errors
def bench_runtime(
    config_files: tuple[str, ...], overrides: tuple[str, ...], quick: bool, out: str
) -> None:
    """Multi-process runs (torch, hivemind) against the simulator: same config and seed,
    validation loss at equal tokens."""
    from mesh.bench.runtime import run_equivalence

    run_equivalence(resolve_config(config_files, overrides), Path(out), quick=quick)


@bench.command("join")
@click.option("--out", type=click.Path(file_okay=False), default="results/join", show_default=True)
@click.option(
    "--repeats",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Grids to form, one after another (about a minute each on 2 cores).",
)
def bench_join(out: str, repeats: int) -> None:
    """Joins on 127.0.0.1 (a 2x2 tiny grid): join to training, a killed peer's replacement to
    its replica resumed, a join naming a dead bootstrap to its error."""
    from mesh.bench.join import run_join_bench

    run_join_bench(Path(out), repeats=repeats)


@bench.command("optimizers")
@config_options
@click.option("--quick", is_flag=True, help="A short version (under 5 minutes here).")
@click.option("--out", type=click.Path(file_okay=False), default="results/optimizers")
@click.option("--workers", type=int, default=2, help="Runs in parallel (one core each).")
@click.option(
    "--target",
    type=float,
    default=None,
    help="Validation loss to reach (default: delay-free adamw's at half the horizon).",
)
@click.option(
    "--reanalyze",
    is_flag=True,
    help="Do not train: re-derive OUT/summary.json's async updates-to-target for --target "
    "(default: the loosest loss every run reaches) and rewrite the outputs.",
)
@user_errors
def bench_optimizers(
    config_files: tuple[str, ...],
    overrides: tuple[str, ...],
    quick: bool,
    out: str,
    workers: int,
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

        if not (Path(out) / "summary.json").is_file():
            raise ConfigError(f"--reanalyze: no {out}/summary.json; run the study first")
        rederive(Path(out), target)
        return

    cfg = load_config(list(config_files), [*STUDY_DEFAULTS, *overrides])
    run_optimizers(cfg, Path(out), quick=quick, workers=workers, target=target)


def p2p_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Where this peer listens and what it tells others (hivemind multiaddrs)."""
    fn = click.option(
        "--identity",
        type=click.Path(dir_okay=False),
        default=None,
        help="Private key file: a stable PeerID across restarts (created if missing).",
    )(fn)
    fn = click.option(
        "--announce-maddrs",
        multiple=True,
        metavar="MADDR",
        help="Addresses others should dial (NAT / port mapping), e.g. /ip4/203.0.113.5/tcp/31337.",
    )(fn)
    fn = click.option(
        "--host-maddrs",
        multiple=True,
        metavar="MADDR",
        help="Addresses to listen on (default /ip4/0.0.0.0/tcp/0: every interface, any port).",
    )(fn)
    return fn


def run_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    fn = click.option(
        "--run-key",
        envvar="MESHTRAIN_RUN_KEY",
        default=None,
        help="The run's shared secret (or MESHTRAIN_RUN_KEY): only holders can claim cells, "
        "send activations or join averaging.",
    )(fn)
    fn = click.option(
        "--run-id", default="meshtrain", show_default=True, help="Namespace of the run's DHT keys."
    )(fn)
    return fn


@main.command()
@p2p_options
@user_errors
def dht(
    host_maddrs: tuple[str, ...], announce_maddrs: tuple[str, ...], identity: str | None
) -> None:
    """A bootstrap DHT node: prints the multiaddrs to pass to --initial-peers, runs until
    stopped (Ctrl-C / SIGTERM). Any hivemind DHT node works as a bootstrap too."""
    import signal
    import threading

    import hivemind

    kwargs: dict[str, Any] = {"host_maddrs": list(host_maddrs) or ["/ip4/0.0.0.0/tcp/0"]}
    if announce_maddrs:
        kwargs["announce_maddrs"] = list(announce_maddrs)
    if identity:
        kwargs["identity_path"] = identity
    from hivemind.dht.crypto import RSASignatureValidator

    # checks signed records (cell claims) before it stores them, as every peer does
    node = hivemind.DHT(start=True, record_validators=[RSASignatureValidator()], **kwargs)
    for maddr in node.get_visible_maddrs():
        click.echo(str(maddr))
    sys.stdout.flush()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        node.shutdown()


@main.command()
@config_options
@click.option(
    "--initial-peers",
    multiple=True,
    metavar="MADDR",
    help="Any DHT node of the run, as `meshtrain dht` prints it: /ip4/HOST/tcp/PORT/p2p/PEER_ID.",
)
@click.option("--stage", type=int, default=None, help="Claim a cell of this stage.")
@click.option("--out", type=click.Path(file_okay=False), default=None, help="Run directory.")
@click.option(
    "--client-mode",
    is_flag=True,
    help="A peer behind NAT: do not serve the DHT, and ask a public peer to relay for us.",
)
@run_options
@p2p_options
@user_errors
def join(
    config_files: tuple[str, ...],
    overrides: tuple[str, ...],
    initial_peers: tuple[str, ...],
    stage: int | None,
    out: str | None,
    client_mode: bool,
    run_id: str,
    run_key: str | None,
    host_maddrs: tuple[str, ...],
    announce_maddrs: tuple[str, ...],
    identity: str | None,
) -> None:
    """Add this machine to a run: claim a free cell through the DHT, take its stage's state from
    a live peer, train until the run ends or Ctrl-C (which saves and releases the cell).

    A line above the progress bar says each thing the cell does: whom its replica waits for,
    where its state came from, the checkpoint saved and the cell released at the end. The
    summary's rejects count refused messages by reason (unauthorized: not a run member;
    late / evicted: averaging payloads of a round already done / pushed out of a full mailbox;
    not_finite: NaN or Inf; truncated_stream: a sender stopped mid-message; the full list is
    in the README, "Rejected messages")."""
    from cli.join import run_join  # light: torch loads only once a cell is claimed

    local = resolve_config(config_files, overrides) if config_files else None
    try:
        run_join(
            local,
            list(overrides),
            list(initial_peers),
            stage=stage,
            out=Path(out) if out else None,
            run_key=run_key,
            run_id=run_id,
            identity=identity,
            host_maddrs=list(host_maddrs),
            announce_maddrs=list(announce_maddrs),
            client_mode=client_mode,
        )
    except KeyboardInterrupt:  # once a cell runs, its own handler saves and releases it
        click.echo(
            "interrupted before this peer ran a cell: nothing to save (a claim being made "
            "expires by itself within 4 heartbeats)",
            err=True,
        )
        sys.exit(130)


@main.command()
@click.option(
    "--initial-peers",
    multiple=True,
    metavar="MADDR",
    help="Any DHT node of the run, as `meshtrain dht` prints it: /ip4/HOST/tcp/PORT/p2p/PEER_ID.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@run_options
@user_errors
def status(initial_peers: tuple[str, ...], as_json: bool, run_id: str, run_key: str | None) -> None:
    """The grid as the DHT sees it: each cell's peer, step, tokens/s, last heartbeat and session;
    free cells. Without the run key (or with another one) claims cannot be verified: they are
    shown marked unverified, and status exits 2 after showing them."""
    from cli.join import open_scout
    from cli.report import print_table
    from cli.status import STATUS_HEADERS, key_error, read_status, status_table

    scout = open_scout(list(initial_peers), run_id, client_mode=True,
                       host_maddrs=["/ip4/127.0.0.1/tcp/0"])  # fmt: skip
    try:
        rows = read_status(scout, run_key)
    finally:
        scout.close()
    problem = key_error(rows["run_key"])
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    else:
        grid = rows["grid"] or "unknown (no config record)"
        click.echo(f"run {run_id!r}: grid {grid}, run key {rows['run_key']}")
        print_table(STATUS_HEADERS, status_table(rows))
        click.echo(f"free cells: {', '.join(rows['free']) or 'none'}")
    if problem:
        click.echo(f"error: {problem}", err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    # skip interpreter teardown: with torch and hivemind loaded it takes 1-2 s, longer on a
    # busy machine, and status has nothing left to clean up (the scout is shut down)
    os._exit(2 if problem else 0)


if __name__ == "__main__":
    main()
