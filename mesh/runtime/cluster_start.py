"""How the cells of a `meshtrain train` grid start: from their checkpoints, brought up to their
stage's most advanced peer by a state download, in one pipeline session per process.

A launcher (torchrun, srun) starts every cell of the grid together: at the job's start, and
whenever torchrun starts its workers again (a failed worker with --max-restarts, a node that
rejoins: torchelastic restarts every worker of the job). So each start is the whole grid's, and
the cells agree on where each replica starts by messages over their links (CONTROL messages of
float32 numbers, tags `start/...`, each checked before use), never by files they may not share:

1. Up the replica's pipeline (stage 0 -> P-1), the steps every cell has an intact checkpoint of
   (intersected on the way); down again, the newest of them (0 when none: the seeded init).
   Every cell loads that step: a replica resumes from a consistent cut, as `simulate` does.
2. Each cell tells its stage's other replicas (its column) that step and hears theirs (a peer
   not heard from within transport.start_timeout_s is left out). A cell more than
   elastic.max_lag_steps behind the most advanced one downloads its state from it
   (mesh/runtime/state_sync.py: verified chunks over the torch links; the next one ahead if it
   fails) and is at that peer's step then.
3. Each cell tells its column it is settled and waits for theirs before it trains, so a donor's
   state does not move while its column downloads: the replicas that downloaded from one
   replica all start at its step.
4. Up the pipeline, stage 0's step: the session's first microbatch (step x microbatches per
   update) and its length (run.steps - that step), the same for every cell of the replica.

From the session on, a signal stops the cell at the step its replica agrees on in the store
(stop_at: mesh/runtime/cluster_stop.py); stage 0 clears a past start's before step 3.

Each cell serves its state to its column for the process's whole life (a later start's
downloads). A neighbour lost during the start ends it (PeerLost): the cell exits with
LOST_NEIGHBOUR and the launcher starts the grid again.

imports: mesh, comms.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from comms import codecs
from comms.errors import PeerLost, PeerTimeout
from comms.transport import Transport
from comms.wire import Expect, Kind
from mesh.algo.schedule import microbatches_per_update
from mesh.algo.topology import Grid, cell_name
from mesh.config import Config
from mesh.runtime.checkpoint import check_checkpoint, checkpoint_path, load_cell, saved_steps
from mesh.runtime.cluster_stop import StoreStop
from mesh.runtime.session import Session
from mesh.runtime.stage import StageWorker
from mesh.runtime.state_sync import StateServer, download_state

MAX_NUMBERS = 256  # the longest start message (a count and the steps a cell has saved)
RETRY_S = 0.2  # a column peer's link not formed yet: send again this often
_EXPECT = Expect(kind=Kind.CONTROL, codecs=frozenset({"fp32"}), max_body_bytes=4 * MAX_NUMBERS)


def donors_ahead(steps: dict[str, int], mine: int, max_lag: int) -> list[str]:
    """The column peers more than max_lag steps ahead of `mine`, the most advanced first (then
    by name, so every stage of a replica asks the same replica first)."""
    ahead = [(-s, name) for name, s in steps.items() if s - mine > max_lag]
    return [name for _, name in sorted(ahead)]


def intact_steps(
    dirs: Sequence[Path], stage: int, replica: int, fingerprint: str
) -> dict[int, Path]:
    """step -> the intact checkpoint of this cell at that step, over the run directories given
    (the first that holds an intact one). A file torn by a crash or of another run is left out."""
    found: dict[int, Path] = {}
    for d in dirs:
        for step in saved_steps(d, stage, replica):
            path = checkpoint_path(d, stage, replica, step)
            if step not in found and check_checkpoint(path, fingerprint, stage, replica) is None:
                found[step] = path
    return found


class ClusterStart:
    """The coordinator of a `train` cell (mesh.runtime.session.Coordinator): the start in the
    module docstring, then one session to run.steps. Fixed wiring: a neighbour lost while the
    session runs ends the process (elastic = False), the launcher starts the grid again."""

    elastic = False

    def __init__(
        self,
        cfg: Config,
        worker: StageWorker,
        transport: Transport,
        event: Callable[..., None],
        dirs: Sequence[Path],
        spool_dir: str,
        stop_at: StoreStop | None = None,
    ) -> None:
        self.cfg, self.worker, self.t, self.event = cfg, worker, transport, event
        self.stop_at = stop_at  # the run_cell loop asks it after each update
        self.cell = worker.cell
        self.dirs = list(dirs)
        j, i, P = self.cell.stage, self.cell.replica, cfg.grid.stages
        self.prev = cell_name(j - 1, i) if j > 0 else None
        self.next = cell_name(j + 1, i) if j < P - 1 else None
        self.column = Grid(P, cfg.grid.replicas).column(j, without=i)
        self.mpu = microbatches_per_update(cfg.pipeline.schedule, cfg.pipeline.microbatches)
        # a neighbour that loads, waits for its column and downloads before it answers
        self.chain_wait_s = cfg.transport.start_timeout_s + cfg.elastic.rejoin_timeout_s
        self._given = False
        self.server = StateServer(
            transport, self.cell, worker.lock, self.column, spool_dir=spool_dir
        )

    # ---- Coordinator -------------------------------------------------------------------------
    def next_session(self, align: Callable[[], int]) -> Session | None:
        if self._given:
            return None
        self._given = True
        step = self.start()
        if step >= self.cfg.run.steps:
            return None
        if self.stop_at is not None:
            self.stop_at.arm()
        return Session(0, step * self.mpu, self.cfg.run.steps - step)

    def broken(self, session: Session) -> bool:
        return False

    def close(self) -> None:
        self.server.close()

    # ---- the start ---------------------------------------------------------------------------
    def start(self) -> int:
        """Steps 1-4 of the module docstring; stage 0's step, where the session starts."""
        cfg, cell = self.cfg, self.cell
        saved = intact_steps(self.dirs, cell.stage, cell.replica, cfg.state_fingerprint())
        common = self._up("start/saved", sorted(saved)[-MAX_NUMBERS + 1 :], _intersect)
        step = self._down("start/from", [max(common, default=0)])[0]
        if step:
            load_cell(cell, cfg.state_fingerprint(), saved[step])
            self.event("resumed", **{"from": "checkpoint"}, checkpoint=str(saved[step]))
        heard = self._column("start/step", [cell.step], self.cfg.transport.start_timeout_s)
        steps = {peer: int(v[0]) for peer, v in heard.items()}
        donors = donors_ahead(steps, cell.step, cfg.elastic.max_lag_steps)
        if donors:
            self._download(donors)
        if self.stop_at is not None and cell.stage == 0:
            self.stop_at.clear()  # before any cell of its replica (or grid) trains
        self._column("start/settled", [cell.step], self.chain_wait_s, wait_for=list(heard))
        return int(self._up("start/base", [cell.step], lambda below, mine: below)[0])

    def _download(self, donors: list[str]) -> None:
        old = self.cell.step
        with self.worker.lock:
            got = download_state(
                self.t,
                self.cell,
                donors,
                self.cfg.elastic.state_timeout_s,
                staging_dir=self.server.spool_dir,
            )
        if not got:
            self.event("state_download_failed", reason=got.reason)
            return
        self.worker.rounds.drop(old)
        self.event("state_loaded", from_cell=got.donor, from_peer=got.donor, from_step=old)

    # ---- messages ----------------------------------------------------------------------------
    def _send(self, to: str, tag: str, numbers: Sequence[float]) -> Any:
        enc = codecs.encode(torch.tensor([len(numbers), *numbers], dtype=torch.float32), "fp32")
        return self.t.send(to, tag, Kind.CONTROL, enc, self.cell.step)

    def _recv(self, frm: str, tag: str, timeout_s: float) -> list[int]:
        """The numbers of `frm`'s message `tag`: whole, non-negative and as many as it says
        (else counted as a reject and waited for again)."""
        deadline = time.monotonic() + timeout_s
        while True:
            msg = self.t.recv(frm, tag, _EXPECT, max(0.0, deadline - time.monotonic()))
            v = msg.tensor()
            if v.ndim == 1 and len(v) >= 1 and torch.equal(v, v.trunc()) and bool((v >= 0).all()):
                numbers = [int(x) for x in v.tolist()]
                if numbers[0] == len(numbers) - 1:
                    return numbers[1:]
            self.t.stats.add_reject("bad_start_message")

    def _up(self, tag: str, mine: list[int], combine: Callable[[list[int], list[int]], list[int]]):
        """Stage 0 -> P-1: each stage combines what came from below with its own and passes it
        on; the value at this stage (at the last stage: the replica's)."""
        value = mine
        if self.prev is not None:
            value = combine(self._recv(self.prev, tag, self.chain_wait_s), mine)
        if self.next is not None:
            self._send(self.next, tag, value).wait(self.chain_wait_s)
        return value

    def _down(self, tag: str, mine: list[int]) -> list[int]:
        """The last stage's value, passed down to stage 0."""
        value = mine if self.next is None else self._recv(self.next, tag, self.chain_wait_s)
        if self.prev is not None:
            self._send(self.prev, tag, value).wait(self.chain_wait_s)
        return value

    def _column(
        self, tag: str, mine: list[int], timeout_s: float, wait_for: list[str] | None = None
    ) -> dict[str, list[int]]:
        """Send `mine` to the column peers and hear theirs: the peers heard from within
        timeout_s (a lost one is left out). wait_for: only these are waited for (sent to again
        while their link is not formed yet, heard from); the others get one try."""
        peers = self.column if wait_for is None else wait_for
        for peer in set(self.column) - set(peers):
            self._send(peer, tag, mine)
        deadline = time.monotonic() + timeout_s
        pending = list(peers)
        while pending and time.monotonic() < deadline:
            for peer in list(pending):
                try:
                    self._send(peer, tag, mine).wait(max(0.0, deadline - time.monotonic()))
                    pending.remove(peer)
                except PeerLost:  # not formed yet (still starting), or gone: again shortly
                    pass
                except PeerTimeout:
                    break
            if pending:
                time.sleep(RETRY_S)
        heard: dict[str, list[int]] = {}
        for peer in peers:
            try:
                heard[peer] = self._recv(peer, tag, max(0.0, deadline - time.monotonic()))
            except (PeerLost, PeerTimeout):
                continue
        missing = sorted(set(peers) - set(heard))
        if missing:
            self.event("start_column_missing", tag=tag, missing=missing)
        return heard


def _intersect(below: list[int], mine: list[int]) -> list[int]:
    return sorted(set(below) & set(mine))[-MAX_NUMBERS + 1 :]
