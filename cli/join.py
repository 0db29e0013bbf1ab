"""`meshtrain dht`, `join` and `status`: a grid formed over the internet through a hivemind DHT.

join: --initial-peers are checked by syntax (cli/reach.py), then a scout DHT node reads the
run's config record (refusing another fingerprint or another run key), asks a peer of the run
to dial it back (check_reach: an unreachable peer is told the fix and claims nothing), picks a
free cell (or one of --stage), claims it and checks the claim held, then the cell runs in this
process (mesh.runtime.trainer.run_cell: its own transport, heartbeats, state download from a
live peer of its stage, sessions with its replica) while a thread draws its progress and prints
a line for each of its events (cli/events.py). Ctrl-C or SIGTERM: the cell saves, releases its
claim and says so; join exits 0. `status` is in cli/status.py.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import click

from cli.claim_keeper import ClaimKeeper
from cli.reach import (
    EXAMPLE_MADDR,
    any_reachable,
    maddr_problems,
    p2pd_failure,
    peer_id_of,
    public_relays,
    reach_verdict,
)
from cli.rejoin import move_to, moved_stage, rejoin
from cli.run_record import (
    OPEN_RUN_WARNING,
    JoinError,
    config_of_record,
    other_key_run,
    read_run_record,
)
from mesh.algo import routing
from mesh.algo.topology import Grid, cell_name
from mesh.config import Config, with_overrides
from mesh.runtime.registry import (
    CLAIMING,
    CellRecord,
    Registry,
    RunRecord,
    free_cells,
    read_again,
)

# p2pd's start and first DHT contact; a dead bootstrap fails at once anyway (any_reachable's
# TCP probe comes first), so this only needs room for a loaded machine (5 s was too short with
# 32 peers starting on 2 cores)
SCOUT_TIMEOUT_S = 30.0
# reads of the run's record before concluding there is none: a busy DHT can answer empty once
RUN_READS = 5
CLAIM_READS = 5  # reads of the claims (each up to the registry's timeout) before a join gives up
REACH_S = 30.0  # asking helpers for a dial-back: no new helper is asked after this
CLAIM_CONFIRM_READS = 2  # a claim must own its cell on this many reads, CLAIM_SETTLE_S apart
# how long the scout keeps a claim for a cell whose own claim has not shown (its transport's
# start on a loaded box takes tens of seconds; a cell that never comes up frees it after this)
KEEP_CLAIM_S = 180.0
# a placeholder claim lives at least this long: its confirmation (a settle, then a read that may
# take seconds) must not outlast it when elastic.heartbeat_s is short
PLACEHOLDER_TTL_S = 10.0
CLAIM_SETTLE_S = 1.0  # after claiming, how long other claims of the same cell may still appear
# (a racing claim was stored, with acks, before its claimer slept: 1 s covers WAN round trips)


def open_scout(initial_peers: list[str], run_id: str, **kwargs: Any) -> Any:
    if not initial_peers:
        raise JoinError(
            "--initial-peers: give at least one multiaddr of a DHT node of the run, "
            f"e.g. {EXAMPLE_MADDR}"
        )
    bad = maddr_problems(initial_peers)
    if bad:  # by syntax, before any daemon starts (p2pd would fail on it seconds later)
        raise JoinError(
            f"--initial-peers {'; '.join(bad)}. Expected /ip4/HOST/tcp/PORT/p2p/PEER_ID as "
            f"`meshtrain dht` prints it, e.g. {EXAMPLE_MADDR}"
        )
    if not any_reachable(initial_peers):  # fails in a moment, before p2pd tries for seconds
        raise JoinError(
            f"no DHT node answers at --initial-peers {' '.join(initial_peers)} (TCP connection "
            "refused or timed out); check the address and that the bootstrap node "
            "(meshtrain dht) is running"
        )
    # heavy (hivemind imports torch and scipy: seconds, many on a busy box): only now
    from comms.p2p.dht import DhtClient

    try:
        return DhtClient(list(initial_peers), run_id, SCOUT_TIMEOUT_S, **kwargs)
    except Exception as e:  # noqa: BLE001 - p2pd's own error text says which address failed
        started = p2pd_failure(e)  # ours (a port in use, ...), not the bootstrap's
        if started is not None:
            raise JoinError(started) from None
        raise JoinError(
            f"could not reach the DHT through --initial-peers {' '.join(initial_peers)} "
            f"within {SCOUT_TIMEOUT_S:.0f} s ({str(e).strip()[:200]}); check the address and "
            "that the bootstrap node (meshtrain dht) is running (a bootstrap node restarted "
            "without --identity has a new peer ID: use the address it prints now)"
        ) from None


def check_reach(
    scout: Any,
    initial_peers: list[str],
    announce_maddrs: list[str],
    client_mode: bool,
    skip: bool,
) -> None:
    """Before a claim: can the other peers dial this one? A peer of the run (the bootstrap
    first) dials the scout back at its announced addresses (comms/p2p/dialback.py); the scout
    listens where the cell will (--host-maddrs; with /tcp/0 on another port, which tells the
    same for a machine that is not behind NAT). Unreachable: JoinError with the fix, no claim.
    A client-mode peer is reached through a relay instead: not checked."""
    if client_mode:
        click.echo(
            "reachability: not checked (--client-mode: other peers reach this one "
            "through a relay, which a reachable peer of the run provides)"
        )
        return
    if skip:
        click.echo("reachability: not checked (--skip-reach-check)")
        return
    from functools import partial

    from comms.p2p import dialback

    helpers = [p for m in initial_peers if (p := peer_id_of(m)) is not None]
    ask = partial(dialback.ask, helpers, 2, REACH_S, None)
    try:
        result = scout.dht.run_coroutine(ask, return_future=True).result(REACH_S + dialback.ASK_S)
    except Exception:  # noqa: BLE001 - nobody answered in time: unknown, said below
        result = {"maddrs": [], "answers": []}
    verdict, text = reach_verdict(result, announce_maddrs)
    if verdict == "unreachable":
        raise JoinError(text)
    click.echo(f"reachability: {text}")


def read_owners(
    registry: Registry, replicas: list[int], reads: int
) -> dict[str, CellRecord] | None:
    """The live claims of those replicas' cells, read again (a second apart) while the DHT does
    not answer, up to `reads` times: a joiner that gives up on one slow read starts over from
    scratch (its imports, its p2pd), which on a loaded DHT only adds to the load (bench
    scale)."""
    return read_again(lambda: registry.owners(replicas), reads)


def claim_cell(
    registry: Registry,
    cfg: Config,
    me: str,
    stage: int | None,
    prefer: list[tuple[int, int]] = (),
) -> tuple[int, int, CellRecord]:
    """Claim the first free cell (of `stage` if given): the `prefer` ones first (cells this
    peer has checkpoints of), then replica by replica; returns (stage, replica, the claim: a
    placeholder, see cli/claim_keeper.py). A claim
    that loses a race (an earlier claim of the same cell shows up within CLAIM_SETTLE_S) is
    withdrawn and the next free cell is tried."""
    P, m = cfg.grid.stages, cfg.grid.replicas
    grid = [(j, i) for i in range(m) for j in range(P) if stage is None or j == stage]
    if cfg.pipeline.pooled and stage is None:  # fill the thinnest stage first
        grid = routing.thinnest_first(pool_capacity(registry, P, m), grid)
    order = [c for c in prefer if c in grid] + [c for c in grid if c not in prefer]
    tried: set[str] = set()
    while True:
        owned = read_owners(registry, sorted({i for _, i in order}), CLAIM_READS)
        if owned is None:
            raise JoinError("the DHT does not answer (no claim can be checked); try again")
        free = [c for c in free_cells([cell_name(j, i) for j, i in order], owned) if c not in tried]
        if not free:
            which = f"stage {stage}" if stage is not None else "the grid"
            raise JoinError(f"no free cell in {which} ({P}x{m}); see `meshtrain status`")
        name = free[0]
        tried.add(name)
        j, i = next((j, i) for j, i in order if cell_name(j, i) == name)
        since = time.time()
        rec = CellRecord(name, me, CLAIMING, since, 0, -1, 0.0, since, registry.token(me))
        if all(_holds(registry, rec, i) for _ in range(CLAIM_CONFIRM_READS)):
            return j, i, rec
        registry.release(name, me, PLACEHOLDER_TTL_S)
        click.echo(f"{name}: claimed earlier by another join; trying the next free cell", err=True)


def pool_capacity(registry: Registry, stages: int, replicas: int) -> list[float]:
    """Each stage's measured capacity from the live claims (a pooled cell's heartbeat `tps` is
    what it could compute); all zeros when the DHT does not answer (then the first free cell)."""
    owned = read_owners(registry, list(range(replicas)), CLAIM_READS) or {}
    return routing.stage_capacity({c: rec.tps for c, rec in owned.items()}, stages)


def _holds(registry: Registry, claim: CellRecord, replica: int) -> bool:
    """The claim (re-)stored, then after CLAIM_SETTLE_S whether it owns its cell: read twice a
    settle apart, so a rival's earlier claim whose store reached a loaded DHT late is seen (two
    joins holding one cell stall its replica until one notices; bench scale saw 7 of 32). Each
    read follows a fresh store: a claim lives HEARTBEAT_LIVES heartbeats, which with a short
    elastic.heartbeat_s is less than the settles."""
    registry.beat(claim, PLACEHOLDER_TTL_S)
    time.sleep(CLAIM_SETTLE_S)
    winner = (read_owners(registry, [replica], CLAIM_READS) or {}).get(claim.cell)
    return winner is not None and winner.peer == claim.peer


def default_out(run_id: str, j: int, i: int) -> Path:
    return Path("runs") / f"{run_id}-{cell_name(j, i)}"


def saved_cells(cfg: Config, out: Path | None, run_id: str) -> list[tuple[int, int]]:
    """Cells this peer has checkpoints of (in --out, or in each cell's default --out), the
    most advanced first: after a whole run stopped, each peer takes its own cell back."""
    from mesh.runtime.checkpoint import saved_steps

    found = []
    for i in range(cfg.grid.replicas):
        for j in range(cfg.grid.stages):
            steps = saved_steps(out or default_out(run_id, j, i), j, i)
            if steps:
                found.append((steps[-1], (j, i)))
    return [cell for _, cell in sorted(found, key=lambda f: -f[0])]


def run_join(
    cfg_local: Config | None,
    sets: list[str],
    initial_peers: list[str],
    *,
    stage: int | None,
    out: Path | None,
    run_key: str | None,
    run_id: str,
    identity: str | None,
    host_maddrs: list[str],
    announce_maddrs: list[str],
    client_mode: bool,
    verify_data: bool = False,
    skip_reach_check: bool = False,
) -> None:
    from cli.preflight import check_data, check_deaths, check_extras
    from comms.build import HivemindMeeting
    from comms.p2p.auth import Auth
    from comms.p2p.relay import RelayLimits
    from mesh.data.manifest import run_record_data

    maddr_kwargs: dict[str, Any] = {"host_maddrs": host_maddrs or ["/ip4/0.0.0.0/tcp/0"]}
    if announce_maddrs:
        maddr_kwargs["announce_maddrs"] = announce_maddrs
    scout = open_scout(initial_peers, run_id, client_mode=True, **maddr_kwargs)
    keeper = None
    try:
        # a joiner without --config can only follow a run: it waits longer for the record
        reads = RUN_READS if cfg_local is None else 2
        rec = read_run_record(Registry(scout, None, 1.0), reads, run_key)
        if rec is None and run_key:  # nothing sealed with our key: is there a run of another?
            other_key_run(Registry(scout, None, 1.0), run_key, cfg_local is not None)
        cfg = config_of_record(rec, cfg_local, sets, run_key)
        cfg = with_overrides(cfg, {"transport.backend": "hivemind"})
        check_extras(cfg)  # before a claim: a missing package is one line here
        check_deaths(cfg, "join")
        data = None
        if cfg.emulation.compute == "real":  # before a claim: a bad data path is one line here
            run_data = rec.data if rec is not None else None
            data = run_record_data(check_data(cfg, verify_data, run_data).manifest)
        check_reach(scout, initial_peers, announce_maddrs, client_mode, skip_reach_check)
        if not run_key:  # said once, before the claim: the user can still stop and add one
            click.echo(OPEN_RUN_WARNING, err=True)
        auth = Auth.of(run_key, cfg.fingerprint())
        registry = Registry(scout, auth, cfg.elastic.heartbeat_s)
        if registry.run(run_key) is None:
            registry.put_run(RunRecord(cfg.fingerprint(), cfg.to_toml(), auth.key_check, data))
        if stage is not None and not 0 <= stage < cfg.grid.stages:
            raise JoinError(f"--stage {stage}: the run has stages 0..{cfg.grid.stages - 1}")
        stage = moved_stage(stage)
        j, i, claim = claim_cell(registry, cfg, scout.peer_id, stage, saved_cells(cfg, out, run_id))
        grid = Grid(cfg.grid.stages, cfg.grid.replicas).names()
        relays = public_relays(scout, auth, grid) if client_mode else []
        # the scout keeps the claim until the cell's own shows, then closes (it was closed
        # here, and the cell was free while its process came up: two joins took one cell)
        keeper = ClaimKeeper(registry, claim, scout, KEEP_CLAIM_S, PLACEHOLDER_TTL_S)
    finally:
        if keeper is None:
            scout.close()
    out = out or default_out(run_id, j, i)
    created = not out.exists()  # a join that never trained takes back what it made here
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.toml").write_text(cfg.to_toml())
    limits = None
    if not client_mode:  # it relays for peers behind NAT within these (comms/p2p/relay_service.py)
        t = cfg.transport
        limits = RelayLimits(t.relay_time_limit_s, int(t.relay_data_limit_mib * 2**20))
    meeting = HivemindMeeting(
        initial_peers=tuple(initial_peers),
        run_id=run_id,
        host_maddrs=tuple(maddr_kwargs["host_maddrs"]),
        announce_maddrs=tuple(announce_maddrs or ()),
        identity_path=identity or None,
        client_mode=client_mode,
        relays=tuple(relays),  # with the bootstrap nodes (P2PTransport)
        relay_limits=limits,
    )
    click.echo(
        f"joined run {run_id!r} as {cell_name(j, i)} (grid {cfg.grid.stages}x"
        f"{cfg.grid.replicas}); metrics and checkpoints in {out}"
    )
    # the cell's own claim is a hair earlier than the scout's, so it owns the cell the moment it
    # appears; the keeper then withdraws the scout's
    _run_here(cfg, j, i, out, meeting, run_key, claim.since - 1e-3, keeper, created)


def _data_reference(cfg: Config) -> dict[str, Any] | None:
    """The data's unigram and bigram cross-entropy for the summary (None where the data cannot
    be read now: the summary is still shown)."""
    from mesh.data.corpus import load_corpus, ngram_ce
    from mesh.errors import DataError

    try:
        corpus = load_corpus(cfg.data.path, cfg.data.val_fraction, cfg.model.seq_len)
    except (DataError, OSError):
        return None
    return ngram_ce(corpus)


def _run_here(
    cfg: Config,
    j: int,
    i: int,
    out: Path,
    meeting: Any,  # comms.build.HivemindMeeting
    run_key: str | None,
    since: float,
    keeper: ClaimKeeper,
    created: bool,
) -> None:
    """Run the cell in this process (no second interpreter to start: the replica resumes
    sooner), a progress bar drawn from its metrics by a thread, with a line above it for each
    thing the cell does (cli/events.py); then the summary, and exit: 0 after the run's end or a
    clean stop (Ctrl-C / SIGTERM), 2 after a user error, 1 after any other failure. A cell that
    never started (its transport did not: no row of its own) prints no table, and `out`, when
    this join `created` it, is removed again; one that lost its cell takes its rows back."""
    import os
    import threading

    from cli.events import EventLines
    from mesh.runtime.metrics import RowTail, read_metrics
    from mesh.runtime.rows import WrittenSince

    done = threading.Event()
    events = EventLines(read_metrics(out, events=True).get((j, i), []), name := cell_name(j, i))
    mark = WrittenSince(path := out / "metrics" / f"{j}-{i}.jsonl", out / "tensorboard" / name)
    tail = RowTail(path, mark.size)
    drawer = threading.Thread(
        target=_draw_progress, args=(cfg, j, i, tail, events, done), name="progress", daemon=True
    )
    drawer.start()
    try:
        code, failure, lost, moved = _run_cell_caught(cfg, j, i, out, meeting, run_key, since)
    finally:
        done.set()
        drawer.join(2)
        keeper.stop()
    events.say_new(read_metrics(out, events=True).get((j, i), []), click.echo)
    if failure:  # below the closed bar, not drawn into it
        click.echo(failure.rstrip(), err=True)
    # a cell's first row (`started`) follows its transport's start: none, and it trained nothing
    ran = path.exists() and path.stat().st_size > mark.size
    if not ran and created:
        _take_back(out)
    if ran and not lost:  # one that lost its cell trained nothing of its own either: no table
        _print_cell_summary(cfg, j, i, out)
    if moved is not None:
        move_to(moved)
    if lost:
        mark.take_back()  # the cell's rows are its owner's to write: none of ours stay
        code, failure = rejoin(lost)  # returns only when this peer rejoined too often
        click.echo(failure, err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    # skip interpreter teardown under libp2p / averaging daemon threads (see
    # mesh.runtime.trainer.cell_process_main); files are closed and fsynced by now
    os._exit(code)


def _take_back(out: Path) -> None:
    """What a join that never trained made in the `out` it created (config.toml, an empty
    metrics folder); anything else there is left alone."""
    (out / "config.toml").unlink(missing_ok=True)
    for folder in (out / "metrics", out):
        with contextlib.suppress(OSError):  # not empty: something else is there
            folder.rmdir()


def _draw_progress(cfg: Config, j: int, i: int, tail: Any, events: Any, done: Any) -> None:
    """The progress thread: every half second, the rows the cell appended (tail, a
    mesh.runtime.metrics.RowTail) move the bar and print their events (events, a
    cli.events.EventLines) above it, until `done` is set. The bar opens with the cell's first
    row (`started`, once its transport is up): a cell that never starts prints no bar."""
    from cli.report import progress_bar

    while not (rows := tail.read()):  # only what was appended: the file grows for days
        if done.wait(0.5):
            return
    with progress_bar(cfg.run.steps, f"join {cell_name(j, i)}") as bar:
        while True:
            events.say_appended(rows, bar.bar.write)
            last = [r for r in rows if "step" in r and "event" not in r and not r.get("final")]
            if last:
                bar.bar.n = last[-1]["step"]
                if last[-1].get("loss") is not None:
                    bar.bar.set_postfix(loss=f"{last[-1]['loss']:.3f}", refresh=False)
                bar.bar.refresh()
            if done.wait(0.5):
                return
            rows = tail.read()


def _run_cell_caught(
    cfg: Config,
    j: int,
    i: int,
    out: Path,
    meeting: Any,
    run_key: str | None,
    since: float,
) -> tuple[int, str, str, int | None]:
    """run_cell, and how it ended: (exit code, the failure to print, why the cell was lost to
    another join, the stage elastic.rebalance moves this peer to)."""
    import traceback

    from comms.errors import CommsError
    from mesh.errors import disk_full
    from mesh.runtime.failure import USER_ERRORS
    from mesh.runtime.session import CellLost, StageMove
    from mesh.runtime.trainer import run_cell

    code, failure, lost, moved = 0, "", "", None
    try:
        run_cell(cfg.model_dump(mode="json"), j, i, str(out), meeting, -1, run_key, since)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0
    # the message says the fix, as a simulated cell's (its own transport that did not start in
    # time among them, a CommsError: raise transport.start_timeout_s)
    except USER_ERRORS as e:
        code, failure = 2, f"error: {e}"
    except StageMove as e:  # elastic.rebalance: this peer goes where the pools are thinnest
        moved = e.to_stage
    except CellLost as e:  # two joins took the cell at once: this one takes another
        lost = str(e)
    except CommsError as e:  # e.g. the replica never formed: the message says which cell
        code, failure = 1, f"error: {e}"
    except Exception as e:  # noqa: BLE001 - reported; the exit code says it failed
        # a port taken since the scout listened there, or a full disk: one line, exit 2
        started = p2pd_failure(e) or disk_full(e)
        code = 1 if started is None else 2
        failure = traceback.format_exc() if started is None else f"error: {started}"
    return code, failure, lost, moved


def _print_cell_summary(cfg: Config, j: int, i: int, out: Path) -> None:
    """The cell's one-row table after the run: steps, last loss beside the data's n-gram
    references, rounds, rejects and lives."""
    from cli.report import print_table
    from cli.simulate import reference_cells
    from mesh.data.ngram import beside_loss
    from mesh.runtime.lives import cell_totals
    from mesh.runtime.metrics import read_metrics

    rows = [r for r in read_metrics(out).get((j, i), []) if "step" in r and not r.get("final")]
    losses = [r["loss"] for r in rows if r.get("loss") is not None]
    ref = _data_reference(cfg)
    # rounds and rejects of every life of the cell in this directory (restarts included)
    every = cell_totals(read_metrics(out, events=True, replayed=True).get((j, i), []))
    print_table(
        [
            "cell",
            "steps",
            "last loss",
            "data unigram/bigram",
            "loss/bigram",
            "rounds applied/failed",
            "rejects",
            "lives",
        ],
        [
            [
                cell_name(j, i),
                rows[-1]["step"] if rows else 0,
                f"{losses[-1]:.4f}" if losses else "n/a",
                *reference_cells(beside_loss(losses[-1] if losses else None, ref)),
                f"{every['rounds_applied']}/{every['rounds_failed']}",
                json.dumps(every["rejects"]),
                every["lives"],
            ]
        ],
    )
