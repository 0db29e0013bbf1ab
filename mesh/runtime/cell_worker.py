"""What every cell's worker is, whatever loop its routing runs (mesh/algo/routes.py): the fixed
grid's schedule (mesh/runtime/stage.py StageWorker) or a stage pool's (pool.py PoolWorker). Its
cell, transport, counters and averaging rounds; the emulated device; a microbatch's data, screen
and timing; the update that ends a backward; the sends. The math of a stage's forward and
backward is the Cell's (mesh/engine/stage_step.py), the same in every engine.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import torch

from comms import codecs
from comms.codecs import Encoded
from comms.errors import CommsError
from comms.transport import Transport
from comms.wire import Expect, Kind
from mesh.algo.topology import cell_name
from mesh.data.corpus import Corpus, train_batch
from mesh.engine.cell import Cell
from mesh.engine.stage_step import StageGrads
from mesh.model.build import needs_tokens
from mesh.runtime.emulate import ComputeClock, real_op_s
from mesh.runtime.rounds import Rounds
from mesh.runtime.stage_stats import StageStats
from mesh.runtime.worker_settings import WorkerSettings


class CellWorker:
    def __init__(
        self, settings: WorkerSettings, cell: Cell, transport: Transport, corpus: Corpus | None
    ) -> None:
        self.settings, self.cell, self.transport, self.corpus = settings, cell, transport, corpus
        self.P, self.m = settings.stages, settings.replicas
        self.j, self.i = cell.stage, cell.replica
        self.route = settings.routing
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
        self.next = cell_name(self.j + 1, self.i) if self.j < self.P - 1 else None
        # cells emulation.deaths takes out from the start average with nobody
        self.grid = settings.grid
        self.column = self.grid.column(self.j)
        self._last_send: dict[str, Any] = {}  # per neighbour: links are FIFO
        self.stats = self._new_stats()
        self.rounds = Rounds(settings.rounds, cell, transport, self.stats, self.column, self.emu)
        self.device = cell.flat.device  # the cell's device: cuda when the runtime chose one
        self.precision = settings.precision  # autocast of forward and backward
        self.lock = threading.Lock()  # held while an update changes the cell's state
        self.critical: Any = contextlib.nullcontext  # the trainer defers SIGTERM inside it
        shape = settings.boundary_shape
        self._expect_act = Expect(kind=Kind.ACTIVATION, shape=shape)
        self._expect_grad = Expect(kind=Kind.GRADIENT, shape=shape)

    def _new_stats(self) -> StageStats:
        """The counters this worker keeps (a pool cell's add its routing's)."""
        return StageStats()

    def finish(self) -> None:
        """At the end: wait briefly for rounds and sends in flight (final byte counters)."""
        self.rounds.drain()
        self._drain_sends()

    def _timeout(self) -> float:
        return self.settings.recv_timeout_s

    # ---- a microbatch's data, screen and time ------------------------------------------------
    def _batch_of(self, stream: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Microbatch (stream, b)'s tokens and targets: every cell reads them from the name, so
        token ids never cross a link."""
        s = self.settings
        assert self.corpus is not None, "real compute needs the corpus"
        x, y = train_batch(self.corpus, s.seed, stream, b, s.pipeline.microbatch_size, s.seq_len)
        return x.to(self.device), y.to(self.device)

    def _tokens_of(self, stream: int, b: int) -> torch.Tensor | None:
        """The token ids where this stage's boundary anchors read them (None: it reads none)."""
        return self._batch_of(stream, b)[0] if needs_tokens(self.cell.module) else None

    def _screened(self, sender: str, kind: str, x: torch.Tensor, stream: int, b: int) -> str:
        """cell.screen's verdict on a received tensor of microbatch (stream, b) (the sentinel
        keys its statistics by its tokens); a drop is counted as rejects 'poison'."""
        verdict = self.cell.screen(sender, kind, x, self._batch_of(stream, b))
        if verdict == "drop":
            self.transport.stats.add_reject("poison")
        return verdict

    def _emulated(self, seconds: float, payload: torch.Tensor | None) -> Encoded | None:
        """One emulated op: reserve the device, encode the real payload (None: nothing goes on),
        wait out the op's time; the payload leaves when the op would have produced it."""
        assert self.emu is not None
        deadline = self.emu.begin(seconds)
        enc = None if payload is None else codecs.encode(payload, self.settings.pipeline.codec)
        self.emu.finish(deadline)
        self.stats.busy_s += seconds
        return enc

    def _busy(self, t0: float, ops: int = 1) -> None:
        """Real compute: count the thread CPU time since t0; a slowdown > 1 then waits
        (factor - 1) x that time, as a slower peer would, and up to the floor of its `ops`
        forwards and backwards (min_op_s each), as a device with that step time would."""
        spent = time.thread_time() - t0
        took = real_op_s(spent, self.slowdown, self.min_op_s * ops)
        self.stats.busy_s += took
        if took > spent:
            time.sleep(took - spent)

    def _forward_out(self, version: int, inputs: torch.Tensor, stream: int, b: int) -> Encoded:
        """Microbatch (stream, b)'s forward on weight version `version` as it leaves for the
        next stage: through faults.pipeline_poison's hostile cell, encoded."""
        t0 = time.thread_time()
        out = self.cell.forward(version, inputs, self.precision, self._tokens_of(stream, b))
        self._busy(t0)
        out = self.cell.outgoing(out, "activation", b)
        return codecs.encode(out, self.settings.pipeline.codec)

    def _backward_of(
        self, version: int, inputs: torch.Tensor, stream: int, b: int, grad_out: Any, share: int
    ) -> tuple[StageGrads, Encoded | None]:
        """Its backward, recomputed on its stashed version (the last stage's from the loss on
        its targets, / share: an update's microbatches), and dL/d(input) as it goes back,
        encoded (None on stage 0)."""
        t0 = time.thread_time()
        targets = self._batch_of(stream, b)[1] if self.next is None else None
        tokens = self._tokens_of(stream, b)
        step = self.cell.backward(version, inputs, self.precision, tokens, grad_out, targets, share)
        self._busy(t0, ops=2 if self.next is None else 1)  # the last stage's forward too
        if step.inputs is None:
            return step, None
        sent = self.cell.outgoing(step.inputs, "gradient", b)  # faults.pipeline_poison
        return step, codecs.encode(sent, self.settings.pipeline.codec)

    def _track_stash(self, tensors: list[torch.Tensor]) -> None:
        """The stash's peak: the weight versions kept and what the microbatches in flight
        hold (`tensors`)."""
        held = sum(v.numel() * v.element_size() for v in self.cell.history.values())
        held += sum(t.numel() * t.element_size() for t in tensors)
        self.stats.stash_bytes_peak = max(self.stats.stash_bytes_peak, held)

    def _update(self, grads: list[torch.Tensor] | None) -> None:
        """An update's optimizer step (emulated: none, the weights stay; no gradients: every
        microbatch of it was dropped on its way here), then its averaging rounds."""
        if self.emu:
            self.cell.step += 1
        elif grads is None:
            self.cell.skip_update()
        else:
            # the optimizer clips them in place: they are this update's
            self.stats.grad_norm = self.cell.apply_update(grads)
        if self.settings.dp.mode == "param_avg" and self.m > 1:
            self.rounds.after_update()

    # ---- sends ------------------------------------------------------------------------------
    def _send_void(self, to: str, tag: str, kind: Kind) -> None:
        """The void marker (mesh/algo/sentinel.py): an all-zero tensor of the boundary's shape."""
        zeros = torch.zeros(self.settings.boundary_shape)
        self._send(to, tag, kind, codecs.encode(zeros, self.settings.pipeline.codec))

    def _send(self, to: str, tag: str, kind: Kind, enc: Encoded) -> None:
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
