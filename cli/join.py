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

import json
import sys
import time
from pathlib import Path
from typing import Any

import click

from cli.reach import (
    EXAMPLE_MADDR,
    any_reachable,
    maddr_problems,
    p2pd_failure,
    peer_id_of,
    public_relays,
    reach_verdict,
)
from mesh.algo import routing
from mesh.algo.topology import cell_name
from mesh.config import (
    LOCAL_PREFIXES,
    LOCAL_SECTIONS,
    Config,
    ConfigError,
    load_config,
    with_overrides,
)
from mesh.runtime.registry import (
    CLAIMING,
    CellRecord,
    Registry,
    RunRecord,
    free_cells,
    pick_run,
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
CLAIM_SETTLE_S = 1.0  # after claiming, how long other claims of the same cell may still appear
# (a racing claim was stored, with acks, before its claimer slept: 1 s covers WAN round trips)


class JoinError(ConfigError):
    """A join that cannot go on (unreachable DHT, no run, mismatched run, full grid): exit 2."""


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
    scout: Any, initial_peers: list[str], announce_maddrs: list[str], client_mode: bool,
    skip: bool,
) -> None:  # fmt: skip
    """Before a claim: can the other peers dial this one? A peer of the run (the bootstrap
    first) dials the scout back at its announced addresses (comms/p2p/dialback.py); the scout
    listens where the cell will (--host-maddrs; with /tcp/0 on another port, which tells the
    same for a machine that is not behind NAT). Unreachable: JoinError with the fix, no claim.
    A client-mode peer is reached through a relay instead: not checked."""
    if client_mode:
        click.echo("reachability: not checked (--client-mode: other peers reach this one "
                   "through a relay, which a reachable peer of the run provides)")  # fmt: skip
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


def config_of(rec: RunRecord, sets: list[str] = ()) -> Config:
    """The run's config from its DHT record (TOML), with --set overrides on top."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.toml"
        path.write_text(rec.toml)
        return load_config([path], list(sets))


def read_run_record(registry: Registry, reads: int, run_key: str | None = None) -> RunRecord | None:
    """The run's record (Registry.run: with a key, only one sealed with it), read again (a
    second apart) while the DHT answers empty, up to `reads` times: one empty answer from a
    busy DHT would otherwise tell a joiner that there is no run, or let a joiner with --config
    start a second one."""
    return read_again(lambda: registry.run(run_key), reads)


def other_key_run(registry: Registry, run_key: str, starting: bool) -> None:
    """A joiner with a key found no run sealed with it: if the run id's public record says
    its run has another key, a joiner without --config is told the key does not match (exit
    2); one with --config starts its run beside it (its records are apart, in its key's
    space: a record an outsider stored first never stops an owner), and is told so."""
    public = pick_run(registry.runs(), run_key)
    if public is None or key_verdict(public, run_key) != "wrong":
        return  # none, or unsigned (a peer without any key wrote it): not a run to mention
    if not starting:
        raise JoinError(KEY_PROBLEMS["wrong"])
    click.echo(
        f"note: this run id also names a run with another key; this run starts beside it "
        f"(check {KEY_HINT} if you meant to join that one)",
        err=True,
    )


def read_owners(
    registry: Registry, replicas: list[int], reads: int
) -> dict[str, CellRecord] | None:
    """The live claims of those replicas' cells, read again (a second apart) while the DHT does
    not answer, up to `reads` times: a joiner that gives up on one slow read starts over from
    scratch (its imports, its p2pd), which on a loaded DHT only adds to the load (bench
    scale)."""
    return read_again(lambda: registry.owners(replicas), reads)


def run_config(
    registry: Registry, local: Config | None, sets: list[str], run_key: str | None
) -> Config:
    """The run's config: the DHT's record, checked against a local --config if one is given.
    With no run yet, the local config starts one."""
    return config_of_record(registry.run(run_key), local, sets, run_key)


KEY_HINT = "--run-key or MESHTRAIN_RUN_KEY"
OPEN_RUN_WARNING = (
    "warning: this run has no run key: anyone who reaches its DHT can join it, download its "
    f"state and average into it (start a run with {KEY_HINT} to keep outsiders out)"
)


def key_verdict(rec: RunRecord, run_key: str | None) -> str:
    """How the run's record stands with run_key: "ok" (sealed with it), "unsigned" (not sealed
    with it, yet claiming it: written by a peer without the key), "missing" (the run has a key,
    none was given) or "wrong" (another key). The seal (registry.RunRecord.signed_by) decides;
    the published key check only tells the three failures apart."""
    from comms.p2p.auth import Auth

    if rec.signed_by(run_key):
        return "ok"
    sealed = isinstance((rec.raw or {}).get("sig"), str)
    if not sealed or Auth.of(run_key, rec.fingerprint).key_check == rec.key_check:
        return "unsigned"
    return "wrong" if run_key else "missing"


KEY_PROBLEMS = {
    "unsigned": "the run's config record is not signed by the run key: refused (a peer without "
    "the key wrote it); check that --initial-peers reach the run you mean",
    "missing": f"this run needs a key ({KEY_HINT}): ask the run's owner for it",
    "wrong": f"the run key does not match this run's ({KEY_HINT}): ask the run's owner for it",
}


def run_key_problem(rec: RunRecord, run_key: str | None) -> str | None:
    """Why this peer cannot follow the run's record with run_key (None: it can)."""
    return KEY_PROBLEMS.get(key_verdict(rec, run_key))


def config_of_record(
    rec: RunRecord | None, local: Config | None, sets: list[str], run_key: str | None
) -> Config:
    """run_config on a record already read (None: no run yet). A record not sealed with our
    run key is refused first (run_key_problem). A local dataset that is not the run's is
    refused naming what differs (the record carries the run's data identity)."""
    from cli.preflight import check_data

    if rec is None:
        if local is None:
            raise JoinError("no run found in the DHT: the first peer passes --config to start one")
        return local
    problem = run_key_problem(rec, run_key)
    if problem is not None:
        raise JoinError(problem)
    try:
        theirs = config_of(rec, sets)
    except ConfigError as e:
        raise JoinError(f"the run's config with your --set: {e}") from None
    if theirs.fingerprint() != rec.fingerprint:
        raise JoinError(
            f"the run's config record does not match its fingerprint {rec.fingerprint}; "
            "a --set of a training key changes it: set only keys of the local sections ("
            f"{', '.join(LOCAL_SECTIONS)}) when joining"
        )
    if local is not None and local.fingerprint() != rec.fingerprint:
        from cli.preflight import changed_keys

        changed = [k for k in changed_keys(local, theirs) if not k.startswith(LOCAL_PREFIXES)]
        if "data.digest" in changed:  # the data's own check says what differs
            check_data(with_overrides(theirs, {"data.path": local.data.path}), run_data=rec.data)
        raise JoinError(
            f"config fingerprint {local.fingerprint()} differs from the run's {rec.fingerprint} "
            f"({', '.join(changed) or 'settings'}): drop --config (the run's own config is "
            "used) or use the run's exact settings"
        )
    return theirs


def claim_cell(
    registry: Registry,
    cfg: Config,
    me: str,
    stage: int | None,
    prefer: list[tuple[int, int]] = (),
) -> tuple[int, int, float]:
    """Claim the first free cell (of `stage` if given): the `prefer` ones first (cells this
    peer has checkpoints of), then replica by replica; returns (stage, replica, since). A claim
    that loses a race (an earlier claim of the same cell shows up within CLAIM_SETTLE_S) is
    withdrawn and the next free cell is tried."""
    P, m = cfg.grid.stages, cfg.grid.replicas
    grid = [(j, i) for i in range(m) for j in range(P) if stage is None or j == stage]
    if cfg.pipeline.routing == "pools" and stage is None:  # fill the thinnest stage first
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
        registry.beat(rec)
        if all(_holds(registry, name, i, me) for _ in range(CLAIM_CONFIRM_READS)):
            return j, i, since
        registry.release(name, me)


def pool_capacity(registry: Registry, stages: int, replicas: int) -> list[float]:
    """Each stage's measured capacity from the live claims (a pooled cell's heartbeat `tps` is
    what it could compute); all zeros when the DHT does not answer (then the first free cell)."""
    owned = read_owners(registry, list(range(replicas)), CLAIM_READS) or {}
    return routing.stage_capacity({c: rec.tps for c, rec in owned.items()}, stages)


def _holds(registry: Registry, name: str, replica: int, me: str) -> bool:
    """After CLAIM_SETTLE_S, whether our claim owns the cell: read twice a settle apart, so a
    rival's earlier claim whose store reached a loaded DHT late is seen (two joins holding
    one cell stall its replica until one notices; bench scale saw 7 of 32)."""
    time.sleep(CLAIM_SETTLE_S)
    winner = (read_owners(registry, [replica], CLAIM_READS) or {}).get(name)
    return winner is not None and winner.peer == me


REJOINS_MAX = 5  # a join that lost its cell starts over this many times, then gives up
REJOINS_ENV = "MESHTRAIN_REJOINS"


def rejoin(lost: str) -> tuple[int, str]:
    """Start this `join` over (the same command line, a fresh process: its cell's transport and
    torch state are gone with it) to claim another free cell; after REJOINS_MAX starts, the
    exit code and message instead."""
    import os

    done = int(os.environ.get(REJOINS_ENV, "0"))
    if done >= REJOINS_MAX:
        return 2, f"error: {lost}; lost a cell {done + 1} times: join again later"
    from mesh.runtime.session import REJOIN_NOTE

    click.echo(f"{lost}: {REJOIN_NOTE}")
    sys.stdout.flush()
    sys.stderr.flush()
    os.environ[REJOINS_ENV] = str(done + 1)
    os.execv(sys.executable, relaunch_argv())
    raise AssertionError("unreachable")  # execv does not return


def relaunch_argv() -> list[str]:
    """This command line as a new interpreter runs it (`python -m cli.main ARGS`): the same
    whether it was started as `meshtrain`, `python -m cli.main` or forked from a fork server
    (whose own command line sys.orig_argv would be)."""
    return [sys.executable, "-m", "cli.main", *sys.argv[1:]]


MOVE_ENV = "MESHTRAIN_MOVE_TO_STAGE"  # a rebalanced join's next stage (its --stage)


def move_to(stage: int) -> None:
    """Start this `join` over in `stage` (elastic.rebalance): the same command line, a fresh
    process, whose claim takes a free cell of that stage and downloads its state."""
    import os

    click.echo(f"moving to stage {stage}, the thinnest: joining again there")
    sys.stdout.flush()
    sys.stderr.flush()
    os.environ[MOVE_ENV] = str(stage)
    os.execv(sys.executable, relaunch_argv())


def moved_stage(stage: int | None) -> int | None:
    """The stage a rebalancing move sent this process to (it overrides --stage: the move was
    decided later than the command line), else --stage."""
    import os

    held = os.environ.pop(MOVE_ENV, None)
    return stage if held is None else int(held)


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
    from cli.preflight import check_data, check_extras
    from comms.p2p.auth import Auth
    from comms.p2p.relay import RelayLimits
    from mesh.data.manifest import run_record_data

    maddr_kwargs: dict[str, Any] = {"host_maddrs": host_maddrs or ["/ip4/0.0.0.0/tcp/0"]}
    if announce_maddrs:
        maddr_kwargs["announce_maddrs"] = announce_maddrs
    scout = open_scout(initial_peers, run_id, client_mode=True, **maddr_kwargs)
    try:
        # a joiner without --config can only follow a run: it waits longer for the record
        reads = RUN_READS if cfg_local is None else 2
        rec = read_run_record(Registry(scout, None, 1.0), reads, run_key)
        if rec is None and run_key:  # nothing sealed with our key: is there a run of another?
            other_key_run(Registry(scout, None, 1.0), run_key, cfg_local is not None)
        cfg = config_of_record(rec, cfg_local, sets, run_key)
        cfg = with_overrides(cfg, {"transport.backend": "hivemind"})
        check_extras(cfg)  # before a claim: a missing package is one line here
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
        j, i, since = claim_cell(registry, cfg, scout.peer_id, stage, saved_cells(cfg, out, run_id))
        grid = [cell_name(s, r) for r in range(cfg.grid.replicas) for s in range(cfg.grid.stages)]
        relays = public_relays(scout, auth, grid) if client_mode else []
    finally:
        scout.close()
    out = out or default_out(run_id, j, i)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.toml").write_text(cfg.to_toml())
    options: dict[str, Any] = {
        "initial_peers": list(initial_peers),
        "run_id": run_id,
        "client_mode": client_mode,
        "relays": relays,  # with the bootstrap nodes (P2PTransport)
        **maddr_kwargs,
    }
    if not client_mode:  # it relays for peers behind NAT within these (comms/p2p/relay_service.py)
        t = cfg.transport
        mib = int(t.relay_data_limit_mib * 2**20)
        options["relay_limits"] = RelayLimits(t.relay_time_limit_s, mib)
    if identity:
        options["identity_path"] = identity
    click.echo(f"joined run {run_id!r} as {cell_name(j, i)} (grid {cfg.grid.stages}x"
               f"{cfg.grid.replicas}); metrics and checkpoints in {out}")  # fmt: skip
    # the cell's own claim is a hair earlier than the scout's, so it owns the cell the moment it
    # appears; the scout's claim (this process's DHT node is gone) expires by itself
    _run_here(cfg, j, i, out, options, run_key, since - 1e-3)


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
    cfg: Config, j: int, i: int, out: Path, options: dict[str, Any], run_key: str | None,
    since: float,
) -> None:  # fmt: skip
    """Run the cell in this process (no second interpreter to start: the replica resumes
    sooner), a progress bar drawn from its metrics by a thread, with a line above it for each
    thing the cell does (cli/events.py); then the summary, and exit: 0 after the run's end or a
    clean stop (Ctrl-C / SIGTERM), 2 after a user error, 1 after any other failure."""
    import os
    import threading
    import traceback

    from cli.events import EventLines
    from cli.report import print_table, progress_bar
    from cli.simulate import reference_cells
    from comms.errors import CommsError
    from mesh.data.ngram import beside_loss
    from mesh.errors import CheckpointError, DataError, DiskFull, disk_full
    from mesh.runtime.lives import cell_totals
    from mesh.runtime.metrics import RowTail, read_metrics
    from mesh.runtime.session import CellLost, StageMove
    from mesh.runtime.trainer import run_cell

    done = threading.Event()
    events = EventLines(read_metrics(out, events=True).get((j, i), []), cell_name(j, i))
    path = out / "metrics" / f"{j}-{i}.jsonl"
    tail = RowTail(path, path.stat().st_size if path.exists() else 0)

    def draw() -> None:
        with progress_bar(cfg.run.steps, f"join {cell_name(j, i)}") as bar:
            while not done.wait(0.5):
                rows = tail.read()  # only what was appended: the file grows for days
                events.say_appended(rows, bar.bar.write)
                last = [r for r in rows if "step" in r and "event" not in r and not r.get("final")]
                if last:
                    bar.bar.n = last[-1]["step"]
                    if last[-1].get("loss") is not None:
                        bar.bar.set_postfix(loss=f"{last[-1]['loss']:.3f}", refresh=False)
                    bar.bar.refresh()

    drawer = threading.Thread(target=draw, name="progress", daemon=True)
    drawer.start()
    code, failure, lost, moved = 0, "", "", None
    try:
        run_cell(cfg.model_dump(mode="json"), j, i, str(out), options, -1, run_key, since)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0
    except (ConfigError, DataError, CheckpointError, DiskFull) as e:  # the message says the fix
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
    finally:
        done.set()
        drawer.join(2)
    events.say_new(read_metrics(out, events=True).get((j, i), []), click.echo)
    if failure:  # below the closed bar, not drawn into it
        click.echo(failure.rstrip(), err=True)
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
        ],  # fmt: skip
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
    if moved is not None:
        move_to(moved)
    if lost:
        code, failure = rejoin(lost)  # returns only when this peer rejoined too often
        click.echo(failure, err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    # skip interpreter teardown under libp2p / averaging daemon threads (see
    # mesh.runtime.trainer.cell_process_main); files are closed and fsynced by now
    os._exit(code)
