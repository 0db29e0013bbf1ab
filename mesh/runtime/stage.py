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

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from comms import codecs
from comms.errors import CommsError, PeerLost, PeerTimeout
from comms.transport import MeanStatus, Transport
from comms.wire import Expect, Kind
from mesh.algo.schedule import Op, iter_actions, version_for
from mesh.algo.topology import cell_name, group_name
from mesh.data.corpus import Corpus, train_batch
from mesh.engine.cell import Cell
from mesh.engine.stage_step import GradSum, update_loss
from mesh.model.build import needs_tokens
from mesh.runtime.emulate import ComputeClock, real_op_s
from mesh.runtime.rounds import Rounds
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


class StageWorker:
    def __init__(
        self, settings: WorkerSettings, cell: Cell, transport: Transport, corpus: Corpus | None
    ) -> None:
        self.settings, self.cell, self.transport, self.corpus = settings, cell, transport, corpus
        self.P, self.m = settings.stages, settings.replicas
        self.j, self.i = cell.stage, cell.replica
        self.mpu = settings.microbatches_per_update
        self.window = settings.window
        self.slowdown, self.min_op_s = settings.slowdown, settings.min_op_s
        self.emu: ComputeClock | None = None
        if settings.emulated_op_s is not None:
            self.emu = ComputeClock()
            self.t_f, self.t_b = settings.emulated_op_s
            gen = torch.Generator().manual_seed(settings.seed * 1009 + self.j * 31 + self.i)
            B, T, w = settings.boundary_shape  # what crosses the link (pipeline.boundary)
            self._fake_tokens = torch.randint(0, settings.vocab_size, (B, T), generator=gen)
            self._fake_act = torch.randn(B, T, w, generator=gen)
            self._fake_grad = torch.randn(B, T, w, generator=gen) * 1e-3
        self.prev = cell_name(self.j - 1, self.i) if self.j > 0 else None
        self.next = cell_name(self.j + 1, self.i) if self.j < self.P - 1 else None
        # cells emulation.deaths takes out from the start average with nobody
        self.grid = settings.grid
        self.column = self.grid.column(self.j)
        self.absent = {cell_name(j, i) for j, i in self.grid.absent}
        self.in_flight: dict[int, _InFlight] = {}
        self.grads = GradSum(cell.params)  # this update's (bench model measures its cost)
        self._last_send: dict[str, Any] = {}  # per neighbour: links are FIFO
        self.stats = self._new_stats()
        self.rounds = Rounds(settings.rounds, cell, transport, self.stats, self.column, self.emu)
        self.device = cell.flat.device  # the cell's device: cuda when the runtime chose one
        self.precision = settings.precision  # autocast of forward and backward
        self.lock = threading.Lock()  # held while an update changes the cell's state
        self.critical: Any = contextlib.nullcontext  # the trainer defers SIGTERM inside it
        self.session = Session(0, 0, 0)
        self.coord: Coordinator = StaticCoordinator(0, 1)
        self.first = cell.step
        self._update_loss = 0.0
        self._update_used = 0  # microbatches of this update whose loss was computed
        shape = settings.boundary_shape
        self._expect_act = Expect(kind=Kind.ACTIVATION, shape=shape)
        self._expect_grad = Expect(kind=Kind.GRADIENT, shape=shape)

    # ---- the loop ---------------------------------------------------------------------------

    def _new_stats(self) -> StageStats:
        """The counters this worker keeps (a pool cell's add its routing's)."""
        return StageStats()

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

    def finish(self) -> None:
        """At the end: wait briefly for rounds and sends in flight (final byte counters)."""
        self.rounds.drain()
        self._drain_sends()

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

    def _timeout(self) -> float:
        return self.settings.recv_timeout_s

    def _batch(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.settings
        assert self.corpus is not None, "real compute needs the corpus"
        x, y = train_batch(self.corpus, s.seed, self.i, b, s.pipeline.microbatch_size, s.seq_len)
        return x.to(self.device), y.to(self.device)

    def _tokens(self, b: int) -> torch.Tensor | None:
        """Microbatch b's token ids where this stage's boundary anchors read them (every stage
        reads the data itself: token ids never cross a link)."""
        return self._batch(b)[0] if needs_tokens(self.cell.module) else None

    def _recv_act(self, b: int) -> None:
        assert self.prev is not None
        t0 = time.perf_counter()
        msg = self._recv(self.prev, self.session.tag("act", b), self._expect_act)
        x = msg.tensor().to(self.device)
        void = not self.emu and self._screened(self.prev, "activation", x, b) != "use"
        self.in_flight[b] = _InFlight(x, -1, void=void)
        if self.emu:
            self.emu.waited(t0)

    def _forward(self, b: int, rel: int) -> None:
        update = self.first + rel // self.mpu
        version = version_for(self.settings.pipeline.schedule, self.j, self.P, update, self.window)
        # a cell that joined (or reloaded state) holds only its current version: the fill reads it
        version = max(version, min(self.cell.history))
        if self.j == 0:
            tokens = self._fake_tokens if self.emu else self._batch(b)[0]
            self.in_flight[b] = _InFlight(tokens, version)
        else:
            self.in_flight[b].version = version
        self._track_stash()
        if self.emu:
            tag = self.session.tag("act", b)
            self._emulated(self.t_f, self.next, tag, Kind.ACTIVATION, self._fake_act)
            return
        if self.next is None:
            return  # the last stage's forward is recomputed with its backward, right after
        if self.in_flight[b].void:  # pass the skip on: the next stage does nothing with it
            self._send_void(self.next, self.session.tag("act", b), Kind.ACTIVATION)
            return
        t0 = time.thread_time()
        inputs = self.in_flight[b].inputs
        out = self.cell.forward(version, inputs, self.precision, self._tokens(b))
        self._busy(t0)
        out = self.cell.outgoing(out, "activation", b)  # faults.pipeline_poison: a hostile cell
        enc = codecs.encode(out, self.settings.pipeline.codec)
        self._send(self.next, self.session.tag("act", b), Kind.ACTIVATION, enc)

    def _emulated(
        self, seconds: float, to: str | None, tag: str, kind: Kind, payload: torch.Tensor
    ) -> None:
        """One emulated op: reserve the device, encode the real payload, wait out the op's
        time, then queue the payload (it leaves when the op would have produced it)."""
        assert self.emu is not None
        deadline = self.emu.begin(seconds)
        enc = codecs.encode(payload, self.settings.pipeline.codec) if to is not None else None
        self.emu.finish(deadline)
        self.stats.busy_s += seconds
        if to is not None and enc is not None:
            self._send(to, tag, kind, enc)

    def _busy(self, t0: float, ops: int = 1) -> None:
        """Real compute: count the thread CPU time since t0; a slowdown > 1 then waits
        (factor - 1) x that time, as a slower peer would, and up to the floor of its `ops`
        forwards and backwards (min_op_s each), as a device with that step time would."""
        spent = time.thread_time() - t0
        took = real_op_s(spent, self.slowdown, self.min_op_s * ops)
        self.stats.busy_s += took
        if took > spent:
            time.sleep(took - spent)

    def _track_stash(self) -> None:
        held = sum(v.numel() * v.element_size() for v in self.cell.history.values())
        for fl in self.in_flight.values():
            held += fl.inputs.numel() * fl.inputs.element_size()
            if fl.grad_out is not None:
                held += fl.grad_out.numel() * fl.grad_out.element_size()
        self.stats.stash_bytes_peak = max(self.stats.stash_bytes_peak, held)

    def _recv_grad(self, b: int) -> None:
        assert self.next is not None
        t0 = time.perf_counter()
        msg = self._recv(self.next, self.session.tag("grad", b), self._expect_grad)
        fl = self.in_flight[b]
        fl.grad_out = msg.tensor().to(self.device)
        if not self.emu and not fl.void:
            fl.void = self._screened(self.next, "gradient", fl.grad_out, b) != "use"
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
            tag = self.session.tag("grad", b)
            self._emulated(self.t_b, self.prev, tag, Kind.GRADIENT, self._fake_grad)
            return
        fl = self.in_flight.pop(b)
        if fl.void:  # no gradient from it here, nor upstream
            if self.prev is not None:
                self._send_void(self.prev, self.session.tag("grad", b), Kind.GRADIENT)
            return
        t0 = time.thread_time()
        targets = self._batch(b)[1] if self.next is None else None
        step = self.cell.backward(
            fl.version, fl.inputs, self.precision, self._tokens(b), fl.grad_out, targets, self.mpu
        )
        if step.loss is not None:
            self._update_loss += step.loss / self.mpu
            self._update_used += 1
        self._busy(t0, ops=2 if self.next is None else 1)  # the last stage's forward too
        if step.inputs is not None:
            sent = self.cell.outgoing(step.inputs, "gradient", b)  # faults.pipeline_poison
            enc = codecs.encode(sent, self.settings.pipeline.codec)
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
        grads = self.grads.take()
        if self.emu:
            self.cell.step += 1  # emulated: no optimizer math, the weights stay
        elif grads is None:  # every microbatch of the update was dropped on its way here
            self.cell.skip_update()
        else:
            # the optimizer clips them in place: they are this update's, and the next
            # backward replaces them
            self.stats.grad_norm = self.cell.apply_update(grads)
        if self.next is None and not self.emu:
            self.stats.loss = update_loss(self._update_loss, self._update_used, self.mpu)
        self._update_loss, self._update_used = 0.0, 0
        if self.settings.dp.mode == "param_avg" and self.m > 1:
            self.rounds.after_update()
        self.cell.push_version(shared=self.emu is not None)

    def _screened(self, sender: str, kind: str, x: torch.Tensor, b: int) -> str:
        """cell.screen's verdict on a received tensor of microbatch b (every stage reads its
        tokens: the sentinel keys its statistics by them); a drop is counted as rejects
        'poison'."""
        verdict = self.cell.screen(sender, kind, x, self._batch(b))
        if verdict == "drop":
            self.transport.stats.add_reject("poison")
        return verdict

    def _send_void(self, to: str, tag: str, kind: Kind) -> None:
        """The void marker (mesh/algo/sentinel.py): an all-zero tensor of the boundary's shape."""
        zeros = torch.zeros(self.settings.boundary_shape)
        self._send(to, tag, kind, codecs.encode(zeros, self.settings.pipeline.codec))

    def _send(self, to: str, tag: str, kind: Kind, enc: codecs.Encoded) -> None:
        self._last_send[to] = self.transport.send(to, tag, kind, enc, self.cell.step)

    def _drain_sends(self) -> None:
        """At the end, wait until the last message to each neighbour left (links are FIFO), so
        the byte counters are final and nothing is lost in a shaped link's queue."""
        for handle in self._last_send.values():
            with contextlib.suppress(CommsError):  # a neighbour that left takes nothing more
                handle.wait(self._timeout())
        self._last_send.clear()

    @property
    def cell_name(self) -> str:
        return cell_name(self.j, self.i)
