"""One cell's worker loop: run the schedule's actions for real, through a Transport.

Stage j of replica i receives activations from stage j-1 of its replica, sends its own to stage
j+1, gets the gradients back, and steps its own weights; nothing waits on other replicas except
the averaging rounds, which run in the background. The math is the simulator's
(mesh/engine/cell.py): the forward of microbatch b reads weight version
`version_for(schedule, j, P, b // mpu)`, the backward recomputes the forward on that same stashed
version, activations and their gradients cross the link through the pipeline codec, and rounds
are applied with the same drift correction. With `dp.strict_tau` a round is applied exactly tau
updates after its launch, so a run reproduces the simulator's numbers.

Faults are values: a round that fails is dropped and counted; a partial round (a member
missing) is applied over the members that contributed, since every survivor computed the same
mean. The pipeline runs in sessions (mesh/runtime/session.py): on a fixed grid (torch) a neighbour
that stops answering makes `recv` raise PeerTimeout after `transport.recv_timeout_s`, a clear error
rather than a hang; on an elastic grid (hivemind) the cell drops its in-flight microbatches when
its replica's session breaks and continues in the next one, once the lost cell is back.

With `pipeline.window` (async) stage j runs window[j] extra warm-up forwards, so its forward of
microbatch b reads version b - (P-1-j) - window[j] (schedule.version_for with the window) and it
stashes that many more versions. With `emulation.compute = "emulated"` (mesh/runtime/emulate.py) a
cell does no model math: forward and backward occupy an emulated device for forward_ms /
backward_ms x the cell's slowdown, while real tensors of the real shapes go through the codecs and
the transport; the optimizer step is skipped (weights stay), averaging rounds still run on the real
parameter subsets."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from comms.errors import PeerLost, PeerTimeout
from comms.transport import MeanStatus, Transport
from comms.wire import Expect, Kind
from mesh.algo.schedule import Op, iter_actions, version_for
from mesh.algo.topology import cell_name, group_name
from mesh.data.corpus import Corpus
from mesh.engine.cell import Cell
from mesh.engine.stage_step import GradSum, update_loss
from mesh.runtime.cell_worker import CellWorker
from mesh.runtime.session import (
    CHECK_EVERY_S,
    Coordinator,
    Session,
    SessionBroken,
    StaticCoordinator,
)
from mesh.runtime.stage_stats import StageStats
from mesh.runtime.worker_settings import WorkerSettings


@dataclass
class _InFlight:
    inputs: torch.Tensor  # what the forward consumed (tokens on stage 0)
    version: int
    grad_out: torch.Tensor | None = None
    # dropped on its way (sentinel.enabled) or voided by a neighbour that dropped it: no math,
    # an all-zero tensor (the void marker) goes on in its place
    void: bool = False


class StageWorker(CellWorker):
    """A cell of a fixed grid: its schedule's actions, session after session."""

    def __init__(
        self, settings: WorkerSettings, cell: Cell, transport: Transport, corpus: Corpus | None
    ) -> None:
        super().__init__(settings, cell, transport, corpus)
        self.mpu = settings.microbatches_per_update
        self.window = settings.window
        self.prev = cell_name(self.j - 1, self.i) if self.j > 0 else None
        self.in_flight: dict[int, _InFlight] = {}
        self.grads = GradSum(cell.params)  # this update's (bench model measures its cost)
        self.session = Session(0, 0, 0)
        self.coord: Coordinator = StaticCoordinator(0, 1)
        self.first = cell.step
        self._update_loss = 0.0
        self._update_used = 0  # microbatches of this update whose loss was computed

    # ---- the loop ---------------------------------------------------------------------------
    def run(self, num_updates: int, on_step: Any = None) -> StageStats:
        """Execute the schedule for `num_updates` updates from the cell's current step, as one
        session of a fixed grid (every cell at the same step); then drain."""
        step = self.cell.step
        self.run_session(Session(0, step * self.mpu, num_updates), StaticCoordinator(0, 1), on_step)
        self.finish()
        return self.stats

    def run_session(self, session: Session, coord: Coordinator, on_step: Any = None) -> None:
        """One pipeline session (mesh/runtime/session.py): `session.updates` updates with
        microbatches numbered from session.base_mb. Raises SessionBroken when coord says the session
        ended while this cell waited on a neighbour; the caller resets and takes the next one."""
        self.session, self.coord = session, coord
        self.first = self.cell.step  # weight versions are read relative to this step
        plan = iter_actions(
            self.settings.pipeline.schedule,
            self.j,
            self.P,
            self.settings.pipeline.microbatches,
            session.updates,
            self.window,
        )
        for act in plan:
            rel = act.microbatch
            b = session.base_mb + rel  # the data index (and message tag) of the microbatch
            if act.op is Op.RECV_ACT:
                self._recv_act(b)
            elif act.op is Op.FORWARD:
                self._forward(b, rel)
            elif act.op is Op.RECV_GRAD:
                self._recv_grad(b)
            elif act.op is Op.BACKWARD:
                self._backward(b)
            elif act.op is Op.FLUSH:
                self._flush()
            elif act.op is Op.STEP:
                # a state download snapshots between updates, never inside one; a stop signal
                # waits until the update (optimizer, rounds, new version) is whole
                with self.lock, self.critical():
                    self._step()
                if on_step:
                    on_step(self)
            # SEND_ACT / SEND_GRAD: the forward / backward queued them; sends never block

    def reset(self) -> None:
        """After a broken session: drop the in-flight microbatches and the partial update, and
        the session's messages waiting in (or still coming to) the mailbox: nobody will take
        them, and they would hold a neighbour's mailbox room until they expired."""
        self.transport.drop_tags(self.session.prefix)
        self.in_flight.clear()
        self.grads.take()
        self._update_loss, self._update_used = 0.0, 0
        self._last_send.clear()
        self.stats.sessions_broken += 1

    def _recv(self, frm: str, tag: str, expect: Expect) -> Any:
        """transport.recv in short waits, asking between them whether the session still stands.
        Fixed grid: PeerTimeout after transport.recv_timeout_s. Elastic (hivemind): a lost neighbour
        is waited for up to elastic.rejoin_timeout_s, since the replica re-forms around it."""
        elastic = self.coord.elastic
        limit = self.settings.elastic.rejoin_timeout_s if elastic else self._timeout()
        deadline = time.monotonic() + limit
        while True:
            left = deadline - time.monotonic()
            try:
                return self.transport.recv(frm, tag, expect, max(0.0, min(CHECK_EVERY_S, left)))
            except (PeerTimeout, PeerLost) as e:
                if self.coord.broken(self.session):
                    raise SessionBroken(f"{self.cell_name}: session {self.session.epoch}") from e
                if time.monotonic() >= deadline:
                    if isinstance(e, PeerLost) and not elastic:
                        raise
                    raise PeerTimeout(f"no message {tag!r} from {frm!r} within {limit}s") from e
                if isinstance(e, PeerLost) and not elastic:
                    raise
                if isinstance(e, PeerLost):
                    time.sleep(CHECK_EVERY_S)

    def _recv_act(self, b: int) -> None:
        assert self.prev is not None
        t0 = time.perf_counter()
        msg = self._recv(self.prev, self.session.tag("act", b), self._expect_act)
        x = msg.tensor().to(self.device)
        void = not self.emu and self._screened(self.prev, "activation", x, self.i, b) != "use"
        self.in_flight[b] = _InFlight(x, -1, void=void)
        if self.emu:
            self.emu.waited(t0)

    def _forward(self, b: int, rel: int) -> None:
        update = self.first + rel // self.mpu
        version = version_for(self.settings.pipeline.schedule, self.j, self.P, update, self.window)
        # a cell that joined (or reloaded state) holds only its current version: the fill reads it
        version = max(version, min(self.cell.history))
        if self.j == 0:
            tokens = self._fake_tokens if self.emu else self._batch_of(self.i, b)[0]
            self.in_flight[b] = _InFlight(tokens, version)
        else:
            self.in_flight[b].version = version
        held = [(fl.inputs, fl.grad_out) for fl in self.in_flight.values()]
        self._track_stash([t for pair in held for t in pair if t is not None])
        if self.emu:
            self._emulated_send(self.t_f, self.next, self.session.tag("act", b), Kind.ACTIVATION)
            return
        if self.next is None:
            return  # the last stage's forward is recomputed with its backward, right after
        if self.in_flight[b].void:  # pass the skip on: the next stage does nothing with it
            self._send_void(self.next, self.session.tag("act", b), Kind.ACTIVATION)
            return
        enc = self._forward_out(version, self.in_flight[b].inputs, self.i, b)
        self._send(self.next, self.session.tag("act", b), Kind.ACTIVATION, enc)

    def _emulated_send(self, seconds: float, to: str | None, tag: str, kind: Kind) -> None:
        """One emulated op whose real-shaped output (an activation or a gradient) goes to `to`."""
        fake = self._fake_act if kind is Kind.ACTIVATION else self._fake_grad
        enc = self._emulated(seconds, fake if to is not None else None)
        if to is not None and enc is not None:
            self._send(to, tag, kind, enc)

    def _recv_grad(self, b: int) -> None:
        assert self.next is not None
        t0 = time.perf_counter()
        msg = self._recv(self.next, self.session.tag("grad", b), self._expect_grad)
        fl = self.in_flight[b]
        fl.grad_out = msg.tensor().to(self.device)
        if not self.emu and not fl.void:
            fl.void = self._screened(self.next, "gradient", fl.grad_out, self.i, b) != "use"
        if self.emu:
            self.emu.waited(t0)

    def _backward(self, b: int) -> None:
        """Recompute the forward on the stashed version, backprop, queue dL/d(input)."""
        self.stats.microbatches += 1
        # staleness: updates between the version this microbatch read and the one its
        # gradient is applied to (the live one now)
        self.stats.staleness[self.cell.step - self.in_flight[b].version] += 1
        if self.emu:
            self.in_flight.pop(b)
            self._emulated_send(self.t_b, self.prev, self.session.tag("grad", b), Kind.GRADIENT)
            return
        fl = self.in_flight.pop(b)
        if fl.void:  # no gradient from it here, nor upstream
            if self.prev is not None:
                self._send_void(self.prev, self.session.tag("grad", b), Kind.GRADIENT)
            return
        step, enc = self._backward_of(fl.version, fl.inputs, self.i, b, fl.grad_out, self.mpu)
        if step.loss is not None:
            self._update_loss += step.loss / self.mpu
            self._update_used += 1
        if enc is not None:
            assert self.prev is not None
            self._send(self.prev, self.session.tag("grad", b), Kind.GRADIENT, enc)
        self.grads.add(step.weights)

    def _flush(self) -> None:
        """FullSync: a blocking mean of the gradients over the replicas of this stage."""
        if self.settings.dp.mode != "grad_allreduce" or self.m == 1:
            return
        # the transports take host memory
        flat = torch.cat([g.reshape(-1) for g in self.grads.tensors]).cpu()
        t0 = time.perf_counter()
        handle = self.transport.start_mean(
            group_name(self.j),
            self.column,
            self.cell.step,
            flat,
            self.settings.dp.codec,
            self._timeout(),
        )
        res = handle.result(self._timeout())
        if self.emu:
            self.emu.waited(t0)
        if res.status is MeanStatus.FAILED or res.mean is None:
            raise RuntimeError(f"{self.cell}: gradient all-reduce failed: {res.reason}")
        offset = 0
        for g in self.grads.tensors:
            g.copy_(res.mean[offset : offset + g.numel()].view_as(g))  # copy_ crosses devices
            offset += g.numel()

    def _step(self) -> None:
        self._update(self.grads.take())
        if self.next is None and not self.emu:
            self.stats.loss = update_loss(self._update_loss, self._update_used, self.mpu)
        self._update_loss, self._update_used = 0.0, 0
        self.cell.push_version(shared=self.emu is not None)
