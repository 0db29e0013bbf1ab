"""Wires one cell: config -> corpus -> stage module -> transport -> worker loop -> metrics.

`run_cell` is what each peer process runs (spawned by mesh/runtime/launch.py for `simulate`, or by
`join`). It writes one JSON line per update to `metrics/<stage>-<replica>.jsonl` and a final
line with the cell's totals, so the launcher can draw progress and build the summary without
talking to the workers.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from comms.build import Meeting
from comms.errors import PeerLost, PeerTimeout, StartTimeout
from comms.p2p.auth import Auth
from comms.transport import DirectoryTransport, Transport
from mesh.algo import routing
from mesh.algo.schedule import microbatches_per_update
from mesh.algo.topology import Grid, cell_name
from mesh.config import Config, config_from_dict
from mesh.data.corpus import load_corpus
from mesh.data.manifest import run_record_data
from mesh.engine.cell import Cell
from mesh.model.build import build_cell_stage
from mesh.runtime import memory, stacks
from mesh.runtime.cell_rows import final_row, health_rows, update_row
from mesh.runtime.cell_worker import CellWorker
from mesh.runtime.checkpoint import checkpoint_path, load_cell, newest_intact, save_cell
from mesh.runtime.emulate import resolve_window
from mesh.runtime.failure import (
    LOST_NEIGHBOUR,
    reserve_failure_report,
    write_failure,
)
from mesh.runtime.metrics import MetricsSink, beat_stats
from mesh.runtime.pool import PoolWorker
from mesh.runtime.pool_grid import pool_members, pool_move
from mesh.runtime.registry import CellRecord, Registry, RunRecord, read_again
from mesh.runtime.rows import append_row, cut_torn_tail
from mesh.runtime.session import DhtCoordinator, SessionBroken, StageMove, StaticCoordinator
from mesh.runtime.session_step import take_session_step
from mesh.runtime.stage import StageWorker
from mesh.runtime.state_sync import StateServer, download_state
from mesh.runtime.stop import STOP, StopAt, StopAtStep, watch_parent
from mesh.runtime.wiring import cell_device, cell_transport
from mesh.runtime.worker_settings import WorkerSettings


def make_coordinator(
    cfg: Config,
    cell: Cell,
    transport: Transport,
    run_key: str | None,
    since: float | None = None,
    data: dict[str, Any] | None = None,
) -> StaticCoordinator | DhtCoordinator:
    """Fixed grid on torch.distributed; DHT sessions and heartbeats on hivemind (data: the
    dataset's identity for the run's record, mesh.data.manifest.run_record_data)."""
    mpu = microbatches_per_update(cfg.pipeline.schedule, cfg.pipeline.microbatches)
    if cfg.transport.backend != "hivemind":
        return StaticCoordinator(cfg.run.steps, mpu)
    # assert: build_transport makes a hivemind transport for the hivemind backend
    assert isinstance(transport, DirectoryTransport), type(transport)
    auth = Auth.of(run_key, cfg.fingerprint())
    registry = Registry(transport, auth, cfg.elastic.heartbeat_s)
    peer = transport.peer_id
    return DhtCoordinator(
        registry,
        cell=cell_name(cell.stage, cell.replica),
        peer=peer,
        replica_cells=Grid(cfg.grid.stages, cfg.grid.replicas).path(cell.replica),
        leader=cell.stage == 0,
        replica=cell.replica,
        steps=cfg.run.steps,
        mpu=mpu,
        wait_s=cfg.elastic.rejoin_timeout_s,
        run_record=RunRecord(cfg.fingerprint(), cfg.to_toml(), auth.key_check, data),
        since=since,
        step=cell.step,
        watch=list(range(cfg.grid.replicas)) if cfg.pipeline.pooled else None,
    )


CATCH_UP_READS = 5  # reads of the other replicas' claims (a second apart) before training on


def catch_up(
    cfg: Config,
    worker: CellWorker,
    coord: DhtCoordinator,
    transport: Transport,
    staging_dir: str | None = None,
    event: Callable[..., None] | None = None,
) -> CellRecord | None:
    """Reload state from the most advanced live peer of this stage when this cell is more than
    elastic.max_lag_steps behind it (a fresh joiner, or a cell whose replica was stalled); the
    peers further ahead are the next donors if one fails mid-transfer. Returns the claim of the
    peer whose state was loaded (the cell is at its step now), or None when nothing was loaded
    (a failed download is an event row, `state_download_failed`, with its reason)."""
    cell = worker.cell
    others = [r for r in range(cfg.grid.replicas) if r != cell.replica]
    # a silent DHT is read again, not taken for "nobody ahead": a fresh replacement that led
    # its replica from step 0 beside a follower at step 58k wrecked both (the soak)
    owned = read_again(lambda: coord.reg.owners(others), CATCH_UP_READS) if others else {}
    if owned is None:
        return None  # the DHT did not answer: train on, catch up at the next session
    column = Grid(cfg.grid.stages, cfg.grid.replicas).column(cell.stage, without=cell.replica)
    live = sorted((owned[c] for c in column if c in owned), key=lambda r: -r.step)
    ahead = [r for r in live if r.step - cell.step > cfg.elastic.max_lag_steps]
    if not ahead:
        return None
    old_step = cell.step
    with worker.lock:
        got = download_state(
            transport,
            cell,
            [r.cell for r in ahead],
            cfg.elastic.state_timeout_s,
            staging_dir=staging_dir,
        )
    if not got:
        if event is not None:
            event("state_download_failed", reason=got.reason)
        return None
    worker.rounds.drop(old_step)
    return next(r for r in ahead if r.cell == got.donor)


def run_cell(
    cfg_tree: dict[str, Any],
    stage: int,
    replica: int,
    out_dir: str,
    meeting: Meeting,
    resume_step: int | None = None,
    run_key: str | None = None,
    since: float | None = None,
    local_rank: int | None = None,
    coordinator: Callable[..., Any] | None = None,
) -> None:
    """One cell's process: train until the run's last step (or until stopped: SIGTERM / Ctrl-C
    save a checkpoint, release the cell and return normally).

    resume_step: load this step's checkpoint first; -1: the latest one of this cell, if any.
    since: claim time to publish (a join that won its claim keeps the same one).
    local_rank: a cluster launcher's LOCAL_RANK (the GPU: cell_device).
    coordinator: (cfg, worker, transport, event) -> the cell's coordinator, instead of the
        backend's (`train`: mesh.runtime.cluster_start.ClusterStart).
    """
    # SIGTERM (the launcher stopping us, or a user): first of all, so a stop while we load is
    # a clean exit 0 too; from the transport on, it unwinds through `finally` so the transport
    # is closed (p2pd children reaped), the cell released and the checkpoint written
    signal.signal(signal.SIGTERM, STOP.handler)
    signal.signal(signal.SIGINT, STOP.handler)  # Ctrl-C: the same clean stop
    life = CellRun.build(cfg_tree, stage, replica, out_dir, resume_step, local_rank)
    # outside the save's `finally`: a cell whose transport did not start trained nothing, and
    # its step-0 checkpoint was taken for a cell that had run (a stop here exits with no save)
    life.start_transport(meeting, run_key)
    try:
        with life.metrics.open("a") as f:
            life.open_rows(f)
            life.start_coordinator(run_key, since, coordinator)
            life.train()
            life.write_final(f)
    finally:
        life.save()


class CellRun:
    """One cell's life in phases (run_cell): built, its transport started, its rows opened, its
    coordinator and worker made, trained, saved. What a phase starts is kept here (None: not
    started), so the save, which runs whatever ended the others, closes exactly that; on_step
    is what the worker calls after each update."""

    def __init__(
        self,
        cfg: Config,
        stage: int,
        replica: int,
        out_dir: str,
        cell: Cell,
        corpus: Any,
        resume_step: int | None,
        metrics: Path,
    ) -> None:
        self.cfg, self.stage, self.replica, self.out_dir = cfg, stage, replica, out_dir
        self.cell, self.corpus, self.resume_step, self.metrics = cell, corpus, resume_step, metrics
        self.transport: Transport | None = None
        self.coord: StaticCoordinator | DhtCoordinator | None = None
        self.server: StateServer | None = None
        self.worker: CellWorker | None = None
        self.sink: MetricsSink | None = None
        self.start = time.perf_counter()
        self.tokens_per_update = (
            microbatches_per_update(cfg.pipeline.schedule, cfg.pipeline.microbatches)
            * cfg.pipeline.microbatch_size
            * cfg.model.seq_len
        )
        # the training loop's clocks (the last heartbeat rate, stage pools' last rebalancing
        # look, the last trim) and checks: train sets them
        self.last_beat = self.last_look = self.last_trim = self.start
        self.rebalance: routing.Rebalancer | None = None
        self.stop_at: StopAt | None = None

    @classmethod
    def build(
        cls,
        cfg_tree: dict[str, Any],
        stage: int,
        replica: int,
        out_dir: str,
        resume_step: int | None,
        local_rank: int | None,
    ) -> CellRun:
        """The build phase: the config, the process's arenas and threads, the corpus, the
        stage's module on its device, the checkpoint resumed from, the metrics file."""
        cfg = config_from_dict(cfg_tree)
        memory.limit_arenas(cfg.runtime.malloc_arenas)  # before the transport's threads start
        torch.set_num_threads(cfg.run.threads)
        emulated = cfg.emulation.compute == "emulated"
        if emulated:
            cfg = resolve_window(cfg)  # deterministic here; real compute: the launcher resolves it
        corpus = (
            None
            if emulated
            else load_corpus(
                cfg.data.path, cfg.data.val_fraction, cfg.model.seq_len, cfg.data.digest
            )
        )
        module = build_cell_stage(cfg, stage)
        cell = Cell.build(
            cfg, stage, replica, module.to(cell_device(cfg, stage, replica, local_rank))
        )
        if resume_step == -1:  # the newest intact one: a file torn by a crash is passed over
            resume_step = newest_intact(out_dir, stage, replica, cfg.state_fingerprint())
        if resume_step is not None:
            path = checkpoint_path(out_dir, stage, replica, resume_step)
            load_cell(cell, cfg.state_fingerprint(), path)
        metrics = Path(out_dir) / "metrics" / f"{stage}-{replica}.jsonl"
        metrics.parent.mkdir(parents=True, exist_ok=True)
        cut_torn_tail(metrics)  # a row torn by a kill: this run's rows start on a line of their own
        return cls(cfg, stage, replica, out_dir, cell, corpus, resume_step, metrics)

    def event(self, name: str, **fields: Any) -> None:
        """An event row (`join` prints each as a line). Its own append, so the heartbeat thread
        can write one too, and one can follow the cell's release after the rows' file closed."""
        row = {"event": name, "step": self.cell.step, **fields}
        append_row(self.metrics, {**row, "time_s": round(time.perf_counter() - self.start, 4)})

    def start_transport(self, meeting: Meeting, run_key: str | None) -> None:
        """The transport phase. A stop while the transport starts ends it at once (its helper
        processes with it): a start may take up to transport.start_timeout_s (p2pd's bootstrap
        retries on a busy host, a TCPStore connect blocked in C++ where no handler runs),
        longer than a launcher waits."""
        with STOP.immediate():
            self.transport = cell_transport(self.cfg, self.stage, self.replica, meeting, run_key)

    def open_rows(self, f: Any) -> None:
        """The cell's first rows (`started`, `resumed`) and the sink its update rows go to."""
        # whose rows these are: a dashboard on this machine tells a dead cell by its pid
        self.event("started", pid=os.getpid(), host=socket.gethostname())
        self.sink = MetricsSink(
            f, self.cfg, self.stage, self.replica, Path(self.out_dir), self.tokens_per_update
        )
        if self.resume_step is not None:
            saved_at = checkpoint_path(self.out_dir, self.stage, self.replica, self.resume_step)
            self.event("resumed", **{"from": "checkpoint"}, checkpoint=str(saved_at))

    def start_coordinator(
        self, run_key: str | None, since: float | None, coordinator: Callable[..., Any] | None
    ) -> None:
        """The coordinator phase: the backend's coordinator (or a launcher's own), the worker
        and, on an elastic grid, the server of this cell's state to its stage's joiners."""
        cfg, cell, transport = self.cfg, self.cell, self.transport
        data = run_record_data(self.corpus.manifest) if self.corpus is not None else None
        self.coord = make_coordinator(cfg, cell, transport, run_key, since, data)
        if isinstance(self.coord, DhtCoordinator):
            self.coord.on_event = self.event  # waiting for whom, sessions
            self.coord.on_beat = health_rows(self.event, transport)
        settings = WorkerSettings.of(cfg, self.stage, self.replica)
        # a pool's cell runs its routing's loop (run_pools), a fixed grid's the schedule
        kind = PoolWorker if settings.routing.pooled else StageWorker
        self.worker = kind(settings, cell, transport, self.corpus)
        self.worker.critical = STOP.deferred
        if coordinator is not None:  # a launcher's own start (mesh/runtime/cluster_start.py)
            self.coord = coordinator(cfg, self.worker, transport, self.event)
        if self.coord.elastic:
            column = Grid(cfg.grid.stages, cfg.grid.replicas).column(
                self.stage, without=self.replica
            )
            self.server = StateServer(
                transport, cell, self.worker.lock, column, spool_dir=self.out_dir
            )

    def train(self) -> None:
        """The loop phase: the pools' run, or session after session, until the run's end; a
        launcher's stop step ends it as the run's end does, a clean stop (SystemExit) writes
        the totals so far and goes on up."""
        cfg, worker, coord, transport = self.cfg, self.worker, self.coord, self.transport
        self.last_beat = self.last_look = self.last_trim = time.perf_counter()
        pools = cfg.pipeline.pooled
        if pools and cfg.elastic.rebalance:  # stage pools: a look at the pools every beat
            self.rebalance = routing.Rebalancer(
                cfg.elastic.rebalance_ratio, cfg.elastic.rebalance_after_s
            )
        # a launcher's stop names the step this fixed replica ends at (mesh/runtime/stop.py)
        fixed = not coord.elastic and not isinstance(worker, PoolWorker)
        own = coord.stop_at  # `train`'s, agreed in its store (mesh/runtime/cluster_stop.py)
        self.stop_at = (own or StopAt(self.out_dir, self.replica)) if fixed else None
        try:
            if isinstance(worker, PoolWorker):  # no sessions: the pools route around a loss
                if isinstance(coord, DhtCoordinator):
                    self.align()  # a joiner (or a cell far behind) takes its stage's state first
                    worker.live = pool_members(coord, cfg.elastic.heartbeat_s)
                worker.run_pools(self.on_step)
            while not isinstance(worker, PoolWorker):
                session = coord.next_session(self.align)
                if session is None:
                    break
                if isinstance(coord, DhtCoordinator):
                    take_session_step(worker, coord, session, self.event)
                try:
                    worker.run_session(session, coord, self.on_step)
                except SessionBroken:
                    worker.reset()
                    if cfg.runtime.trim_every_s:
                        memory.trim()  # the old session's buffers and threads are gone
                    self.event("session_broken")
        except StopAtStep:  # ends here as at the run's end (saved below)
            pass
        except SystemExit:  # a clean stop: the totals so far (a cell that never stepped
            # has no other row that says what it refused)
            sent, rejects = transport.stats.sent_by_kind(), dict(transport.stats.rejects)
            self.event("stopped", bytes_sent=sent, rejects=rejects)
            raise
        worker.finish()

    def align(self) -> int:
        """The cell's step for the next session, after catching up with its stage's most
        advanced peer where it lags (a DHT grid)."""
        if isinstance(self.coord, DhtCoordinator):
            source = catch_up(
                self.cfg, self.worker, self.coord, self.transport, self.out_dir, self.event
            )
            if source is not None:
                self.coord.beat.step = self.cell.step
                self.event("state_loaded", from_cell=source.cell, from_peer=source.peer)
        return self.cell.step

    def on_step(self, w: CellWorker) -> None:
        """After each update, in order: the checkpoint that is due, memory handed back, the
        heartbeat's step and rate (a pool's: its capacity, and a rebalancing move), the
        metrics row, a launcher's stop step."""
        self.checkpoint_if_due()
        now = time.perf_counter()
        self.trim_if_due(now)
        coord = self.coord
        if isinstance(coord, DhtCoordinator):
            self.beat_rate(coord, now)
            if isinstance(w, PoolWorker):  # a pool's capacity: what it could compute
                coord.beat.tps = w.capacity_tps()
                self.move_if_thinner(coord, now)
        row = update_row(w, self.transport, now - self.start)
        if isinstance(coord, DhtCoordinator):
            self.beat_row(coord, row)
        with STOP.deferred():  # a row is in every sink or in none (a Ctrl-C between)
            self.sink.write(row)
        if self.stop_at is not None and self.stop_at.due(self.cell.step):
            raise StopAtStep(self.cell.step)

    def checkpoint_if_due(self) -> None:
        """A checkpoint every checkpoint.every updates, whole even if a stop comes meanwhile."""
        every = self.cfg.checkpoint.every
        if every and self.cell.step % every == 0 and not self.lost():
            with STOP.deferred():
                save_cell(self.cell, self.cfg.state_fingerprint(), self.out_dir)

    def trim_if_due(self, now: float) -> None:
        """Freed memory handed back to the system every runtime.trim_every_s."""
        trim_s = self.cfg.runtime.trim_every_s
        if trim_s and now - self.last_trim >= trim_s:
            self.last_trim = now
            memory.trim()

    def beat_rate(self, coord: DhtCoordinator, now: float) -> None:
        """The heartbeat's step and tokens a second (a moving average over the updates)."""
        dt, self.last_beat = now - self.last_beat, now
        tps = self.tokens_per_update / dt if dt > 0 else 0.0
        coord.beat.step = self.cell.step
        coord.beat.tps = 0.8 * coord.beat.tps + 0.2 * tps if coord.beat.tps else tps

    def move_if_thinner(self, coord: DhtCoordinator, now: float) -> None:
        """Stage pools with elastic.rebalance: once a heartbeat, a look at the pools; a move to
        a thinner stage ends this cell (StageMove: `join` takes the stage it names)."""
        if self.rebalance is None or now - self.last_look < self.cfg.elastic.heartbeat_s:
            return
        self.last_look = now
        to = pool_move(coord, self.cfg, self.stage, self.replica, self.rebalance)
        if to is not None:
            self.event("moved", from_stage=self.stage, to_stage=to)
            raise StageMove(cell_name(self.stage, self.replica), to)

    def beat_row(self, coord: DhtCoordinator, row: dict[str, Any]) -> None:
        """What the heartbeat carries of the update's row (and the flags, a relayed link)."""
        stats = beat_stats(row)
        if row["flagged"]:  # sentinel.enabled's flagged neighbours
            stats["flagged"] = row["flagged"]
        if isinstance(self.transport, DirectoryTransport) and self.transport.relayed:  # NAT
            stats["relayed"] = True
        # whole, then in: the heartbeat thread reads beat.stats at any moment
        coord.beat.stats = stats

    def write_final(self, f: Any) -> None:
        """The cell's final row: its totals, once the worker finished (sends drained)."""
        append_row(f, final_row(self.worker, self.transport, self.start))

    def lost(self) -> bool:
        """Whether another join's live claim owns this cell (CellLost): its state is the
        owner's, and a second writer under one --out would mix the two, so nothing is saved."""
        return isinstance(self.coord, DhtCoordinator) and self.coord.lost

    def save(self) -> None:
        """The save phase, however the others ended: the sinks and the state server closed, the
        checkpoint written, the claim released, the transport closed, and a `saved` row."""
        STOP.exiting = True  # a second SIGTERM must not cut the last save short
        if self.sink is not None:
            self.sink.close()
        if self.server is not None:
            self.server.close()
        saved = None
        if not self.lost():
            with self.worker.lock if self.worker is not None else contextlib.nullcontext():
                # first: nothing can lose it
                saved = save_cell(self.cell, self.cfg.state_fingerprint(), self.out_dir)
        released = None
        if self.coord is not None:
            released = self.coord.close()  # releases our claim: a joiner can take the cell at once
        if self.transport is not None:
            self.transport.close()
        if saved is not None:
            with contextlib.suppress(OSError):  # `join` says so only now that it is true
                self.event("saved", checkpoint=str(saved), released=released)


def cell_life(out_dir: str | Path, stage: int, replica: int, run: Callable[[], None]) -> int:
    """Run a cell (`run`) as its process's life and return the process's exit code: 0 when it
    returns, 2 for a user error (its own transport not starting in time among them),
    LOST_NEIGHBOUR when a peer it needs died or froze (a fixed
    pipeline cannot go on without it; the launcher restarts its replica), 1 for anything else,
    the reason in DIR/logs/sJrI.err, not on the terminal, where eight cells would print eight
    tracebacks. The launcher gone (SIGKILL) is a clean stop, not an orphan that trains on."""
    code = 0
    reserve = reserve_failure_report(out_dir, stage, replica)
    watch_parent()
    try:
        with stacks.written_on_request(out_dir, stage, replica):  # a launcher about to kill it
            run()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0
    except StartTimeout as e:  # its own transport never started: a user error (exit 2), not a
        # lost neighbour, which a hivemind launcher leaves its replica to wait out (120 s)
        code = write_failure(out_dir, stage, replica, e, reserve)
    except (PeerLost, PeerTimeout) as e:  # a neighbour died or froze: the launcher's fault
        write_failure(out_dir, stage, replica, e, reserve)
        code = LOST_NEIGHBOUR
    except BaseException as e:  # noqa: BLE001 - reported, then the exit code says it failed
        code = write_failure(out_dir, stage, replica, e, reserve)
    if reserve is not None:
        reserve.unlink(missing_ok=True)  # renamed to the report, or not needed
    return code


def cell_process_main(
    cfg_tree: dict[str, Any],
    stage: int,
    replica: int,
    out_dir: str,
    meeting: Meeting,
    resume_step: int | None = None,
) -> None:
    """run_cell as a process's whole life (cell_life), then exit at once with its code,
    skipping interpreter finalization. Its files are closed and fsynced by then; what is left
    are daemon threads (rounds past their deadline, libp2p readers) that must not be torn down
    under a C++ thread at exit ("terminate called without an active exception")."""
    run = functools.partial(run_cell, cfg_tree, stage, replica, out_dir, meeting, resume_step)
    code = cell_life(out_dir, stage, replica, run)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
