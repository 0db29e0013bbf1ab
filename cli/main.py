"""`meshtrain`: the command group. User errors print one line and exit 2, never a traceback."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from cli.bench import bench
from cli.dashboard import dashboard
from cli.data import data
from cli.export import export
from cli.generate import generate
from cli.options import (
    config_options,
    grid_run_options,
    resolve_config,
    run_options,
    shorthand_overrides,
    skip_resource_check_option,
    user_errors,
    with_method,
)
from cli.plan import plan
from cli.train import train
from mesh.config import ConfigError


@click.group()
@click.version_option(package_name="meshtrain")
def main() -> None:
    """meshtrain: decentralized LM training on a P x m grid of peers."""


main.add_command(bench)
main.add_command(dashboard)
main.add_command(data)
main.add_command(export)
main.add_command(generate)
main.add_command(plan)
main.add_command(train)

verify_data_option = click.option(
    "--verify-data",
    is_flag=True,
    help="Hash every shard of a prepared dataset against its manifest before training "
    "(sizes are always checked).",
)


@main.command("show-config")
@config_options
@user_errors
def show_config(config_files: tuple[str, ...], overrides: tuple[str, ...]) -> None:
    """Print the resolved config as TOML (defaults < --config files < --set)."""
    cfg = resolve_config(config_files, overrides)
    from mesh.model.build import boundary_spec, stage_param_counts  # torch, once valid

    counts = stage_param_counts(cfg.model, cfg.grid.stages, boundary_spec(cfg))
    click.echo(f"# fingerprint {cfg.fingerprint()}")
    per_stage = ", ".join(f"s{j} {n:,}" for j, n in enumerate(counts))
    click.echo(f"# parameters per stage: {per_stage} (total {sum(counts):,})")
    click.echo(f"# {cfg.depth_rule_line()}")
    # the settings the cells train with: the depth rule's keys resolved
    click.echo(cfg.effective().to_toml(), nl=False)


@main.command()
@config_options
@grid_run_options
@click.option("--out", type=click.Path(file_okay=False), default=None, help="Run directory.")
@click.option(
    "--backend",
    type=click.Choice(["torch", "hivemind", "logical"]),
    default=None,
    help="torch/hivemind: every cell its own process talking over that transport on "
    "127.0.0.1 (default: transport.backend, torch); logical: the whole grid in one process on "
    "a logical clock (exact, fast; for studies).",
)
@click.option(
    "--resume",
    default=None,
    metavar="DIR",
    help="Continue a stopped run from its checkpoints (a logical run's on the logical "
    "backend, exactly as if uninterrupted).",
)
@verify_data_option
@skip_resource_check_option
@user_errors
def simulate(
    config_files: tuple[str, ...],
    overrides: tuple[str, ...],
    grid: str | None,
    steps: int | None,
    method: str | None,
    init_from: str | None,
    out: str | None,
    backend: str | None,
    resume: str | None,
    verify_data: bool,
    skip_resource_check: bool,
) -> None:
    """Train a whole grid on this machine, every cell its own process, and print a summary.

    Before any cell starts, a grid whose processes this machine cannot hold (their memory as
    `meshtrain plan` counts it, and their threads, against its available memory and process
    limits) is refused in one line; --skip-resource-check starts it anyway."""
    extra = shorthand_overrides(grid, steps, init_from)
    if resume:
        if not Path(resume).is_dir():
            raise ConfigError(
                f"--resume {resume}: no such directory; give the directory of a stopped run (its "
                "--out, e.g. runs/20250101-120000), or leave --resume out to start a new run"
            )
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
    if backend is None and resume:
        from cli.logical import is_logical_run

        # a logical run's checkpoints hold the simulator's state: it continues on that backend
        backend = "logical" if is_logical_run(Path(resume)) else None
    backend = backend or cfg.transport.backend
    cfg = with_method(cfg, method)
    if backend != "logical":
        from cli.preflight import check_deaths
        from cli.simulate import simulate_processes

        check_deaths(cfg, "simulate")  # first: before the data is read or a process starts
        simulate_processes(
            cfg,
            backend,
            Path(out) if out else None,
            bool(resume),
            verify_data,
            check_resources=not skip_resource_check,
        )
        return
    from cli.logical import simulate_logical
    from cli.preflight import check_data
    from cli.simulate import stop_signals

    corpus = check_data(cfg, verify_data)
    with stop_signals(ctrl_c=True) as stop:
        simulate_logical(cfg, Path(out) if out else None, corpus, bool(resume), stop)


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


@main.command()
@p2p_options
@click.option(
    "--relay-time-limit-s",
    type=click.FloatRange(min=0, min_open=True),
    default=1800.0,
    show_default=True,
    help="How long this node relays one connection of a peer behind NAT before it resets it "
    "(the two sides redial; transport.relay_time_limit_s on a join).",
)
@click.option(
    "--relay-data-limit-mib",
    type=click.FloatRange(min=0, min_open=True),
    default=4096.0,
    show_default=True,
    help="What this node relays on one connection, each way, before it resets it.",
)
@user_errors
def dht(
    host_maddrs: tuple[str, ...],
    announce_maddrs: tuple[str, ...],
    identity: str | None,
    relay_time_limit_s: float,
    relay_data_limit_mib: float,
) -> None:
    """A bootstrap DHT node: prints the multiaddrs to pass to --initial-peers, runs until
    stopped (Ctrl-C / SIGTERM). Any hivemind DHT node works as a bootstrap too. It relays for
    peers behind NAT (join --client-mode) within the two limits."""
    import signal
    import threading

    from comms.p2p.relay import RelayLimits, p2pd_options

    limits = RelayLimits(relay_time_limit_s, int(relay_data_limit_mib * 2**20))
    relay_kwargs, flags = p2pd_options(False, [], limits)
    kwargs: dict[str, Any] = {"host_maddrs": list(host_maddrs) or ["/ip4/0.0.0.0/tcp/0"]}
    kwargs.update(relay_kwargs, p2pd_flags=flags)
    if announce_maddrs:
        kwargs["announce_maddrs"] = list(announce_maddrs)
    if identity:
        kwargs["identity_path"] = identity
    from cli.reach import p2pd_failure
    from comms.build import BOOTSTRAP_START_S
    from comms.p2p import dialback
    from comms.p2p.dht import start_dht

    # the peers' DHT (comms.p2p.dht.PeerDHT): it checks signed records (cell claims) before it
    # stores them, and its process stops its p2pd and removes its socket files when this one
    # dies, even by SIGKILL (a plain hivemind.DHT's would run on, orphaned)
    try:
        node = start_dht([], BOOTSTRAP_START_S, **kwargs)
    except Exception as e:
        why = p2pd_failure(e)
        if why is None:
            raise
        raise ConfigError(why) from None
    node.run_coroutine(dialback.serve)  # joiners ask us to dial them back before they claim
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
@click.option(
    "--skip-reach-check",
    is_flag=True,
    help="Claim a cell even if no peer of the run can dial this one back (e.g. your peers "
    "reach it over a network the checking peer is not on).",
)
@verify_data_option
@run_options()
@p2p_options
@user_errors
def join(
    config_files: tuple[str, ...],
    overrides: tuple[str, ...],
    initial_peers: tuple[str, ...],
    stage: int | None,
    out: str | None,
    client_mode: bool,
    skip_reach_check: bool,
    verify_data: bool,
    run_id: str,
    run_key: str | None,
    host_maddrs: tuple[str, ...],
    announce_maddrs: tuple[str, ...],
    identity: str | None,
) -> None:
    """Add this machine to a run: claim a free cell through the DHT, take its stage's state from
    a live peer, train until the run ends or Ctrl-C (which saves and releases the cell).

    Before it claims, a peer of the run dials this one back at its announced addresses; if it
    cannot, join says what to do (forward a port and pass --announce-maddrs, or --client-mode)
    and exits 2 without a cell.

    A line above the progress bar says each thing the cell does: whom its replica waits for,
    where its state came from, the checkpoint saved and the cell released at the end. The
    summary's rejects count refused messages by reason (unauthorized: not a run member;
    late / evicted: averaging payloads of a round already done / pushed out of a full mailbox;
    not_finite: NaN or Inf; truncated_stream: a sender stopped mid-message; the full list is
    in docs/faults-and-trust.md, "Rejected messages")."""
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
            verify_data=verify_data,
            skip_reach_check=skip_reach_check,
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
@run_options()
@user_errors
def status(initial_peers: tuple[str, ...], as_json: bool, run_id: str, run_key: str | None) -> None:
    """The grid as the DHT sees it: each cell's peer, step, tokens/s, last heartbeat and session;
    free cells. Without the run key (or with another one) a keyed run's claims cannot be read:
    none is shown, no cell is called free, and status exits 2 saying which key is missing."""
    from cli.join import open_scout
    from cli.report import print_table
    from cli.status import STATUS_HEADERS, data_label, key_error, read_status, status_table

    scout = open_scout(
        list(initial_peers), run_id, client_mode=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"]
    )
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
        click.echo(f"data: {data_label(rows['data'])}")
        print_table(STATUS_HEADERS, status_table(rows))
        free = ", ".join(rows["free"]) or "none"
        if not rows.get("claims_readable", True):  # a keyed run's, without its key
            free = "unknown (the claims are readable only with the run key)"
        click.echo(f"free cells: {free}")
        for pool in rows.get("pools") or []:  # stage pools: each stage's cells and capacity
            share = pool["cross_replica_share"]
            cross = "" if share is None else f", {share:.0%} of its traffic to other replicas"
            click.echo(
                f"stage {pool['stage']} pool: {pool['cells']} cells, capacity "
                f"{pool['capacity_tps']:,.0f} tokens/s{cross}"
            )
    if problem:
        click.echo(f"error: {problem}", err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    # skip interpreter teardown: with torch and hivemind loaded it takes 1-2 s, longer on a
    # busy machine, and status has nothing left to clean up (the scout is shut down)
    os._exit(2 if problem else 0)


if __name__ == "__main__":
    main()
