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
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from comms.build import Meeting
from comms.errors import PeerLost, PeerTimeout
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
from mesh.runtime.checkpoint import checkpoint_path, load_cell, newest_intact, save_cell
from mesh.runtime.emulate import resolve_window
from mesh.runtime.failure import (
    LOST_NEIGHBOUR,
    reserve_failure_report,
    write_failure,
)
from mesh.runtime.metrics import MetricsSink, beat_stats
from mesh.runtime.pool import PoolWorker
from mesh.runtime.pool_grid import pool_members, pool_move, pool_row
from mesh.runtime.pool_seeded import SeededPoolWorker
from mesh.runtime.registry import CellRecord, Registry, RunRecord, read_again
from mesh.runtime.rows import append_row, cut_torn_tail
from mesh.runtime.session import DhtCoordinator, SessionBroken, StageMove, StaticCoordinator
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
        watch=list(range(cfg.grid.replicas)) if cfg.pipeline.routing == "pools" else None,
    )


CATCH_UP_READS = 5  # reads of the other replicas' claims (a second apart) before training on


def catch_up(
    cfg: Config,
    worker: StageWorker,
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
    cfg = config_from_dict(cfg_tree)
    memory.limit_arenas(cfg.runtime.malloc_arenas)  # before the transport's threads start
    torch.set_num_threads(cfg.run.threads)
    emulated = cfg.emulation.compute == "emulated"
    if emulated:
        cfg = resolve_window(cfg)  # deterministic here; real compute: the launcher resolves it
    corpus = (
        None
        if emulated
        else load_corpus(cfg.data.path, cfg.data.val_fraction, cfg.model.seq_len, cfg.data.digest)
    )
    module = build_cell_stage(cfg, stage)
    cell = Cell.build(cfg, stage, replica, module.to(cell_device(cfg, stage, replica, local_rank)))
    if resume_step == -1:  # the newest intact one: a file torn by a crash is passed over
        resume_step = newest_intact(out_dir, stage, replica, cfg.state_fingerprint())
    if resume_step is not None:
        path = checkpoint_path(out_dir, stage, replica, resume_step)
        load_cell(cell, cfg.state_fingerprint(), path)
    metrics = Path(out_dir) / "metrics" / f"{stage}-{replica}.jsonl"
    metrics.parent.mkdir(parents=True, exist_ok=True)
    cut_torn_tail(metrics)  # a row torn by a kill: this run's rows start on a line of their own
    transport: Transport | None = None
    coord: StaticCoordinator | DhtCoordinator | None = None
    server: StateServer | None = None
    worker: StageWorker | None = None
    sink: MetricsSink | None = None
    start = time.perf_counter()
    tokens_per_update = (
        microbatches_per_update(cfg.pipeline.schedule, cfg.pipeline.microbatches)
        * cfg.pipeline.microbatch_size
        * cfg.model.seq_len
    )

    def event(name: str, **fields: Any) -> None:
        """An event row (`join` prints each as a line). Its own append, so the heartbeat thread
        can write one too, and one can follow the cell's release after the rows' file closed."""
        row = {"event": name, "step": cell.step, **fields}
        append_row(metrics, {**row, "time_s": round(time.perf_counter() - start, 4)})

    try:
        # a stop while the transport starts ends it at once (its helper processes with it):
        # a start may take up to transport.start_timeout_s (p2pd's bootstrap retries on a busy
        # host, a TCPStore connect blocked in C++ where no handler runs), longer than a launcher
        # waits
        with STOP.immediate():
            transport = cell_transport(cfg, stage, replica, meeting, run_key)
        with metrics.open("a") as f:
            # whose rows these are: a dashboard on this machine tells a dead cell by its pid
            event("started", pid=os.getpid(), host=socket.gethostname())
            sink = MetricsSink(f, cfg, stage, replica, Path(out_dir), tokens_per_update)
            if resume_step is not None:
                saved_at = checkpoint_path(out_dir, stage, replica, resume_step)
                event("resumed", **{"from": "checkpoint"}, checkpoint=str(saved_at))
            data = run_record_data(corpus.manifest) if corpus is not None else None
            coord = make_coordinator(cfg, cell, transport, run_key, since, data)
            if isinstance(coord, DhtCoordinator):
                coord.on_event = event  # waiting for whom, sessions
                coord.on_beat = _health_rows(event, transport)
            pools = cfg.pipeline.routing == "pools"
            kind = StageWorker
            if pools:  # the seeded mode serializes each cell, so the simulator can follow it
                kind = SeededPoolWorker if cfg.pipeline.pool_choice == "seeded" else PoolWorker
            worker = kind(WorkerSettings.of(cfg, stage, replica), cell, transport, corpus)
            worker.critical = STOP.deferred
            if coordinator is not None:  # a launcher's own start (mesh/runtime/cluster_start.py)
                coord = coordinator(cfg, worker, transport, event)
            if coord.elastic:
                column = Grid(cfg.grid.stages, cfg.grid.replicas).column(stage, without=replica)
                server = StateServer(transport, cell, worker.lock, column, spool_dir=out_dir)
            last = [time.perf_counter()]
            last_check = [time.perf_counter()]  # stage pools: the last rebalancing look
            rebalance = (
                routing.Rebalancer(cfg.elastic.rebalance_ratio, cfg.elastic.rebalance_after_s)
                if pools and cfg.elastic.rebalance
                else None
            )
            trimmed = [time.perf_counter()]
            # a launcher's stop names the step this fixed replica ends at (mesh/runtime/stop.py)
            fixed = not coord.elastic and not isinstance(worker, PoolWorker)
            stop_at = StopAt(out_dir, replica) if fixed else None

            def on_step(w: StageWorker) -> None:
                every = cfg.checkpoint.every
                if every and cell.step % every == 0:
                    with STOP.deferred():
                        save_cell(cell, cfg.state_fingerprint(), out_dir)
                now = time.perf_counter()
                trim_s = cfg.runtime.trim_every_s
                if trim_s and now - trimmed[0] >= trim_s:
                    trimmed[0] = now
                    memory.trim()
                if isinstance(coord, DhtCoordinator):
                    dt, last[0] = now - last[0], now
                    tps = tokens_per_update / dt if dt > 0 else 0.0
                    coord.beat.step = cell.step
                    coord.beat.tps = 0.8 * coord.beat.tps + 0.2 * tps if coord.beat.tps else tps
                    if isinstance(w, PoolWorker):  # a pool's capacity: what it could compute
                        coord.beat.tps = w.capacity_tps()
                        if rebalance is not None and now - last_check[0] >= cfg.elastic.heartbeat_s:
                            last_check[0] = now
                            to = pool_move(coord, cfg, stage, replica, rebalance)
                            if to is not None:
                                event("moved", from_stage=stage, to_stage=to)
                                raise StageMove(cell_name(stage, replica), to)
                row = _row(w, transport, now - start)
                if isinstance(coord, DhtCoordinator):
                    stats = beat_stats(row)
                    if row["flagged"]:  # sentinel.enabled's flagged neighbours
                        stats["flagged"] = row["flagged"]
                    if isinstance(transport, DirectoryTransport) and transport.relayed:  # NAT
                        stats["relayed"] = True
                    # whole, then in: the heartbeat thread reads beat.stats at any moment
                    coord.beat.stats = stats
                with STOP.deferred():  # a row is in every sink or in none (a Ctrl-C between)
                    sink.write(row)
                if stop_at is not None and stop_at.due(cell.step):
                    raise StopAtStep(cell.step)

            def align() -> int:
                if isinstance(coord, DhtCoordinator):
                    source = catch_up(cfg, worker, coord, transport, out_dir, event)
                    if source is not None:
                        coord.beat.step = cell.step
                        event("state_loaded", from_cell=source.cell, from_peer=source.peer)
                return cell.step

            try:
                if isinstance(worker, PoolWorker):  # no sessions: the pools route around a loss
                    if isinstance(coord, DhtCoordinator):
                        align()  # a joiner (or a cell far behind) takes its stage's state first
                        worker.live = pool_members(coord, cfg.elastic.heartbeat_s)
                    worker.run_pools(on_step)
                while not isinstance(worker, PoolWorker):
                    session = coord.next_session(align)
                    if session is None:
                        break
                    try:
                        worker.run_session(session, coord, on_step)
                    except SessionBroken:
                        worker.reset()
                        if cfg.runtime.trim_every_s:
                            memory.trim()  # the old session's buffers and threads are gone
                        event("session_broken")
            except StopAtStep:  # ends here as at the run's end (saved below)
                pass
            except SystemExit:  # a clean stop: the totals so far (a cell that never stepped
                # has no other row that says what it refused)
                sent, rejects = transport.stats.sent_by_kind(), dict(transport.stats.rejects)
                event("stopped", bytes_sent=sent, rejects=rejects)
                raise
            worker.finish()
            final = {
                "final": True,
                "stage": stage,
                "replica": replica,
                "step": cell.step,
                "flat_sha": _digest(cell.flat),
                "wall_s": time.perf_counter() - start,
                "bytes_sent": transport.stats.sent_by_kind(),  # sends drained: final counts
                "staleness_hist": {str(k): n for k, n in sorted(worker.stats.staleness.items())},
                "rejects": dict(transport.stats.rejects),
                "sessions_broken": worker.stats.sessions_broken,
                **pool_row(worker.stats),
            }
            append_row(f, final)
    finally:
        STOP.exiting = True  # a second SIGTERM must not cut the last save short
        if sink is not None:
            sink.close()
        if server is not None:
            server.close()
        with worker.lock if worker is not None else contextlib.nullcontext():
            saved = save_cell(cell, cfg.state_fingerprint(), out_dir)  # first: nothing can lose it
        released = None
        if coord is not None:
            released = coord.close()  # releases our claim: a joiner can take the cell at once
        if transport is not None:
            transport.close()
        with contextlib.suppress(OSError):  # `join` says so only now that it is true
            event("saved", checkpoint=str(saved), released=released)


HEALTH_EVERY_S = 5.0  # a `health` row at most this often (on the heartbeat thread)


def _health_rows(event: Any, transport: Transport) -> Any:
    """A heartbeat hook writing a `health` event row every HEALTH_EVERY_S: what only the
    process itself can see of a leak (threads, live asyncio tasks, mailbox depth, its own DHT
    calls); `meshtrain bench soak` reads /proc for the rest (RSS, descriptors). unix_s ties the
    row's time_s to the wall clock."""
    last = [-HEALTH_EVERY_S]

    def beat() -> None:
        now = time.monotonic()
        if now - last[0] < HEALTH_EVERY_S:
            return
        last[0] = now
        event(
            "health",
            threads=threading.active_count(),
            torch_threads=torch.get_num_threads(),
            unix_s=round(time.time(), 3),
            **transport.health(),
        )

    return beat


def _row(worker: StageWorker, transport: Transport, time_s: float) -> dict[str, Any]:
    st, cell = worker.stats, worker.cell
    return {
        "stage": cell.stage,
        "replica": cell.replica,
        "step": cell.step,
        "time_s": round(time_s, 4),
        "loss": st.loss,
        "lr_scale": cell.lr_scale(),
        "grad_norm": st.grad_norm,
        "bytes_sent": transport.stats.sent_by_kind(),
        "rounds_started": st.rounds_started,
        "rounds_applied": st.rounds_applied,
        "rounds_partial": st.rounds_partial,
        "rounds_failed": st.rounds_failed,
        "rounds_jumped": st.rounds_jumped,
        "rounds_skipped": st.rounds_skipped,
        "rejects": dict(transport.stats.rejects),
        # neighbours sentinel.enabled flagged for sending far outside their statistics
        "flagged": cell.sentinel.flagged() if cell.sentinel is not None else [],
        "microbatches": st.microbatches,
        "busy_s": round(st.busy_s, 6),
        "staleness_max": st.staleness_max,
        "stash_bytes_peak": st.stash_bytes_peak,
        "rss_peak_mb": round(st.rss_peak_mb(), 1),
        **pool_row(st),
    }


def _digest(t: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest()[:16]


def cell_life(out_dir: str | Path, stage: int, replica: int, run: Callable[[], None]) -> int:
    """Run a cell (`run`) as its process's life and return the process's exit code: 0 when it
    returns, 2 for a user error, LOST_NEIGHBOUR when a peer it needs died or froze (a fixed
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
