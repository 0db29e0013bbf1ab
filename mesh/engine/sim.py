"""The whole P x m grid in one process on a logical clock: exact, repeatable, fast.

At update u, replica i computes its microbatch(es) through its stages with the version vector of
its schedule (stage j uses weights `version_for(schedule, j, P, u)`), one stage at a time forward
and back with the workers' stage step (mesh/engine/stage_step.py), each stage steps its newest
weights with the gradient, and averaging rounds land exactly `dp.tau` updates after they
were launched. Wall-clock effects are left out on purpose; stashing, staleness, codecs and the
drift correction are all in. Every payload that would cross a link goes through its codec, and
the bytes each cell would send are counted exactly (pipeline and averaging apart).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.func import functional_call

from comms import codecs
from comms.errors import CodecError
from comms.means import alone
from comms.transport import mean_in_member_order
from mesh.algo import sparse
from mesh.algo.schedule import microbatches_per_update, version_for
from mesh.algo.topology import cell_name
from mesh.config import Config
from mesh.data.corpus import Corpus, bits_per_byte, load_corpus, train_batch, val_batches
from mesh.engine.cell import Cell, Params
from mesh.engine.rounds import Action, round_index
from mesh.engine.rounds import after_update as rounds_after
from mesh.engine.stage_step import GradSum, update_loss
from mesh.model.build import build_cell_stages, lm_loss, run_stages


@dataclass
class _Link:
    """One boundary of one microbatch: stage j (upper) sends activations to stage j+1 (lower)
    and takes the gradient back. Each side's emulated attack (faults.pipeline_poison) applies
    to what it sends, and the receiver screens what arrives (sentinel.enabled), as the runtime's
    stages do (mesh/runtime/stage.py). A dropped activation voids the whole microbatch; a
    dropped (or void) gradient gives the stages up to j nothing from it. With fp32, no attack
    and no sentinel, a tensor crosses as it is (the codec's roundtrip would give the same)."""

    codec: str
    upper: Cell
    lower: Cell
    microbatch: int
    batch: tuple[torch.Tensor, torch.Tensor]  # its inputs and targets: what the sentinel keys by
    verdicts: Counter[str]  # the grid's count of drops and voids

    @property
    def plain(self) -> bool:
        cells = (self.upper, self.lower)
        guarded = any(c.pipeline_poison is not None or c.sentinel is not None for c in cells)
        return self.codec == "fp32" and not guarded

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """The activation as the lower stage takes it; None: it voided the microbatch."""
        return self._cross(x, self.upper, self.lower, "activation")

    def backward(self, g: torch.Tensor) -> torch.Tensor | None:
        """The input's gradient as the upper stage takes it; None: it gets nothing."""
        return self._cross(g, self.lower, self.upper, "gradient")

    def _cross(
        self, x: torch.Tensor, sender: Cell, receiver: Cell, kind: str
    ) -> torch.Tensor | None:
        if self.plain:
            return x
        got = codecs.roundtrip(sender.outgoing(x, kind, self.microbatch), self.codec)
        name = cell_name(sender.stage, sender.replica)
        verdict = receiver.screen(name, kind, got, self.batch)
        if verdict == "use":
            return got
        if kind == "activation":
            self.verdicts["void_forward"] += 1
        self.verdicts["poison"] += verdict == "drop"
        return None


@dataclass
class Microbatch:
    """One microbatch's way through a path of cells (one a stage), forward and back."""

    weights: list[list[torch.Tensor] | None]  # per stage its weight gradients (None: it got none)
    loss: float | None  # None: voided on its way (no stage got a gradient)


def through_path(
    cells: list[Cell],
    versions: list[int],
    batch: tuple[torch.Tensor, torch.Tensor],
    index: int,
    codec: str,
    precision: str,
    verdicts: Counter[str],
    share: int = 1,
) -> Microbatch:
    """Microbatch `index` (its inputs and targets `batch`) forward through `cells` on their
    `versions` and back (Cell.forward_pass, StagePass.backward: the workers' step), each
    boundary crossing its _Link; the last stage's loss is divided by `share` (an update's
    microbatches). A tensor a stage drops stops the microbatch there (see _Link)."""
    x, y = batch
    passes, links, h = [], [], x
    for j, (c, version) in enumerate(zip(cells, versions, strict=True)):
        passes.append(c.forward_pass(version, h, precision, x))
        if j + 1 < len(cells):
            links.append(_Link(codec, c, cells[j + 1], index, batch, verdicts))
            h = links[-1].forward(passes[-1].output.detach())
            if h is None:  # the later stages skip it, as the runtime's do: no loss, no gradient
                return Microbatch([None] * len(cells), None)
    grads: list[list[torch.Tensor] | None] = [None] * len(cells)
    top = passes[-1].backward(targets=y, share=share)
    grads[-1], back = top.weights, top.inputs
    for j in reversed(range(len(links))):
        assert back is not None  # a stage past the first has its input's gradient
        g = links[j].backward(back)
        if g is None:  # dropped on its way: the stages up to j get nothing from it
            break
        step = passes[j].backward(g)
        grads[j], back = step.weights, step.inputs
    return Microbatch(grads, top.loss)


@dataclass
class SimResult:
    grid: str
    steps: int
    tokens: int
    val_loss: float | None  # mean over replicas of each replica's own validation loss
    val_loss_replicas: list[float | None]
    val_loss_avg_model: float | None  # loss of the replicas' parameter average
    pp_bytes_per_replica_step: float
    dp_bytes_per_replica_step: float
    wall_s: float
    diverged: bool
    curve: list[dict[str, float]] = field(default_factory=list)  # step, tokens, val_loss
    train_curve: list[dict[str, float]] = field(default_factory=list)
    val_bpb: float | None = None  # val_loss in bits per byte of text (across tokenizers)
    # refused, by reason: averaging payloads (outlier), boundary tensors (poison)
    rejects: dict[str, int] = field(default_factory=dict)
    clip_rate: float = 0.0  # share of the cells' updates whose gradient norm was clipped
    # receiving cell -> the senders its sentinel flagged (sentinel.enabled); {}: none
    flagged: dict[str, list[str]] = field(default_factory=dict)


class GridSim:
    def __init__(self, cfg: Config, corpus: Corpus | None = None) -> None:
        self.cfg = cfg
        torch.set_num_threads(cfg.run.threads)
        self.corpus = corpus or load_corpus(
            cfg.data.path, cfg.data.val_fraction, cfg.model.seq_len, cfg.data.digest
        )
        self.P, self.m = cfg.grid.stages, cfg.grid.replicas
        # the runtime's stage j reads the same versions; 'auto' needs a link: refused here
        self.window = cfg.pipeline.extra_warmups()
        self.M = microbatches_per_update(cfg.pipeline.schedule, cfg.pipeline.microbatches)
        # every replica starts from the same weights: sparse averaging cannot align strangers
        self.cells = [
            [Cell.build(cfg, j, i, module) for j, module in enumerate(build_cell_stages(cfg))]
            for i in range(self.m)
        ]
        self.update = 0
        self.pp_bytes = 0  # summed over replicas
        self.dp_bytes = 0.0
        self.rejects: Counter[str] = Counter()  # payloads refused by the deviation bound
        # boundary tensors: "poison" dropped by a receiver's sentinel, "void_forward" the
        # microbatches that went no further (dropped, or after a drop)
        self.verdicts: Counter[str] = Counter()
        self._last_loss = math.nan
        self._val = val_batches(
            self.corpus, cfg.data.val_batches, cfg.pipeline.microbatch_size, cfg.model.seq_len
        )

    @property
    def tokens(self) -> int:
        return self.update * self.M * self.cfg.tokens_per_microbatch * self.m

    # ---- one update of the whole grid ---------------------------------------------------
    def _replica_grads(self, replica: int) -> tuple[float | None, list[list[torch.Tensor] | None]]:
        """One replica's update: its microbatches through its stages on the schedule's versions,
        each stage's gradients summed (GridSim: what each stage applies; None: none reached
        it) and the update's loss (None: every microbatch was voided)."""
        cfg, cells = self.cfg, self.cells[replica]
        schedule, window = cfg.pipeline.schedule, self.window
        versions = [version_for(schedule, j, self.P, self.update, window) for j in range(self.P)]
        sums = [GradSum(c.params) for c in cells]
        total, used = 0.0, 0
        for k in range(self.M):
            b = self.update * self.M + k
            batch = train_batch(
                self.corpus,
                cfg.run.seed,
                replica,
                b,
                cfg.pipeline.microbatch_size,
                cfg.model.seq_len,
            )
            mb = self._through(cells, versions, batch, b, self.M)
            if mb.loss is None:
                continue
            total, used = total + mb.loss / self.M, used + 1
            for acc, grads in zip(sums, mb.weights, strict=True):
                if grads is not None:
                    acc.add(grads)
        return update_loss(total, used, self.M), [acc.take() for acc in sums]

    def _through(
        self,
        cells: list[Cell],
        versions: list[int],
        batch: tuple[torch.Tensor, torch.Tensor],
        index: int,
        share: int = 1,
    ) -> Microbatch:
        """through_path with this grid's codec, precision and counters; each inner boundary
        carries one activation forward and one gradient back, counted whatever befalls them."""
        cfg = self.cfg
        self.pp_bytes += 2 * (self.P - 1) * self._act_bytes()
        codec, precision = cfg.pipeline.codec, cfg.runtime.precision
        return through_path(cells, versions, batch, index, codec, precision, self.verdicts, share)

    def _act_bytes(self) -> int:
        """What one boundary carries each way a microbatch: the residual stream or its
        coordinates, in the pipeline codec."""
        cfg = self.cfg
        values = cfg.tokens_per_microbatch * cfg.boundary_width
        return codecs.encoded_nbytes(values, cfg.pipeline.codec)

    def _allreduce_grads(self, grads: list[list[list[torch.Tensor]]]) -> None:
        """FullSync: blocking mean of every replica's (encoded) gradients, stage by stage."""
        codec, block = self.cfg.dp.codec, self.cfg.dp.block_size
        for j in range(self.P):
            payload = sum(codecs.encoded_nbytes(g.numel(), codec, block) for g in grads[0][j])
            self.dp_bytes += self.m * sparse.ring_allreduce_bytes(payload, self.m)
            for k in range(len(grads[0][j])):
                parts = [codecs.roundtrip(grads[i][j][k], codec, block) for i in range(self.m)]
                mean = mean_in_member_order(parts).to(grads[0][j][k].dtype)
                for i in range(self.m):
                    grads[i][j][k] = mean.clone()

    def _average(self, dead: Collection[tuple[int, int]] = ()) -> list[Cell]:
        """This update's round actions (mesh/engine/rounds.py) for every stage's column (its
        live cells: those of no (stage, replica) in `dead`). Returns the cells that applied a
        round (their live weights moved)."""
        dp, moved = self.cfg.dp, []
        for j in range(self.P):
            column = [self.cells[i][j] for i in range(self.m) if (j, i) not in dead]
            for action in rounds_after(self.update, dp.interval_steps, dp.tau):
                if action is Action.LAUNCH:
                    self._launch(j, column)
                    continue
                for c in column:
                    for rnd in c.due_rounds():
                        c.apply_round(rnd)
                        moved.append(c)
        return moved

    def _launch(self, j: int, column: list[Cell]) -> None:
        """Open this update's round on every replica of stage j and fill its mean at once."""
        dp = self.cfg.dp
        index = round_index(self.update, dp.interval_steps)
        rounds, decoded = zip(*(c.open_round(index) for c in column), strict=True)
        screened = column[0].screens_rounds
        names = [cell_name(j, c.replica) for c in column]  # a pool's live cells: not every replica
        # a cell whose weights are stale (Cell.sits_out: its last update had no gradient) sits
        # the round out and takes the others' mean, as on the processes (comms/means.py)
        contributors = [k for k, c in enumerate(column) if not c.sits_out()]
        mean = None
        if not screened and contributors:
            mean = mean_in_member_order([decoded[k] for k in contributors])
        if mean is not None and dp.noise_codec != "none":
            seed = sparse.stable_seed(self.cfg.run.seed, j, self.update)
            mean = mean + codecs.shuffled_error(mean, dp.noise_codec, dp.block_size, seed)
        for me, c, rnd in zip(names, column, rounds, strict=True):
            kept = [names[k] for k in contributors]
            rnd.mean = mean
            if screened:  # each replica screens against its own payload
                rnd.mean, rejected = c.combine_round(names, decoded, me)
                self.rejects["outlier"] += len(rejected)
                kept = [n for n in names if n not in rejected]
            if alone(kept, me):  # no other member's payload: no mean, the round fails here
                continue
            c.rounds.launch(rnd, None)
            self.dp_bytes += sparse.ring_allreduce_bytes(rnd.payload_bytes, self.m)

    def step(self) -> float:
        """One update of every cell; returns the mean training loss over replicas."""
        losses, grads = zip(*(self._replica_grads(i) for i in range(self.m)), strict=True)
        grads = [list(g) for g in grads]
        if self.cfg.dp.mode == "grad_allreduce" and self.m > 1:
            for i, j in ((i, j) for i in range(self.m) for j in range(self.P)):
                if grads[i][j] is None:  # a replica's dropped microbatches add zeros to the mean
                    grads[i][j] = [torch.zeros_like(p) for p in self.cells[i][j].params]
            self._allreduce_grads(grads)
        for i in range(self.m):
            for j in range(self.P):
                if grads[i][j] is None:  # every microbatch dropped on its way to this stage
                    self.cells[i][j].skip_update()
                else:
                    self.cells[i][j].apply_update(grads[i][j])
        if self.cfg.dp.mode == "param_avg" and self.m > 1:
            self._average()
        self.update += 1
        for row in self.cells:
            for c in row:
                c.push_version()
        reached = [loss for loss in losses if loss is not None]
        if len(reached) == self.m:
            self._last_loss = sum(reached) / self.m
        elif reached:  # a replica whose every microbatch was dropped has no loss this update
            self._last_loss = sum(reached) / len(reached)
        return self._last_loss

    # ---- evaluation ------------------------------------------------------------------------
    def _val_loss(self, modules: list[torch.nn.Module]) -> float:
        total = 0.0
        with torch.no_grad():  # the fp32 masters, whatever the compute precision (as runtime)
            for x, y in self._val:
                total += lm_loss(run_stages(modules, x), y).item()
        return total / len(self._val)

    def evaluate(self) -> list[float]:
        return [self._val_loss([c.module for c in row]) for row in self.cells]

    def average_model_loss(self) -> float:
        """The loss of the replicas' parameter average (one final blocking average)."""
        modules = []
        for j in range(self.P):
            column = [self.cells[i][j] for i in range(self.m)]
            avg = mean_in_member_order([c.flat for c in column])
            modules.append(functional_module(column[0].module, column[0].as_params(avg)))
        return self._val_loss(modules)

    def run(self, on_step: Callable[[int, float], None] | None = None) -> SimResult:
        cfg, start = self.cfg, time.perf_counter()
        curve, train_curve, diverged = [], [], False
        while self.update < cfg.run.steps:  # a resumed grid (sim_state.restore) goes on
            try:
                loss = self.step()
            except CodecError:  # a non-finite payload: the run has diverged
                loss = math.nan
            if not math.isfinite(loss):
                diverged = True
                break
            train_curve.append({"step": self.update, "tokens": self.tokens, "loss": loss})
            if self.update % cfg.run.eval_every == 0 or self.update == cfg.run.steps:
                val = self.evaluate()
                curve.append(
                    {"step": self.update, "tokens": self.tokens, "val_loss": sum(val) / self.m}
                )
            if on_step:
                on_step(self.update, loss)
        finals: list[float | None] = [None] * self.m
        avg_loss = None
        if not diverged:
            finals = list(self.evaluate())
            avg_loss = self.average_model_loss() if self.m > 1 else finals[0]
        steps = max(self.update, 1)
        val_loss = None if diverged else sum(finals) / self.m  # type: ignore[arg-type]
        bpt = self.corpus.val_bytes_per_token  # text bytes per validation token
        return SimResult(
            grid=f"{self.P}x{self.m}",
            steps=self.update,
            tokens=self.tokens,
            val_loss=val_loss,
            val_loss_replicas=finals,
            val_loss_avg_model=avg_loss,
            pp_bytes_per_replica_step=self.pp_bytes / self.m / steps,
            dp_bytes_per_replica_step=self.dp_bytes / self.m / steps,
            wall_s=time.perf_counter() - start,
            diverged=diverged,
            curve=curve,
            train_curve=train_curve,
            val_bpb=None if val_loss is None else bits_per_byte(val_loss, bpt),
            rejects=dict(self.rejects) | self.pipeline_rejects(),
            clip_rate=self.clip_rate(),
            flagged=self.flagged(),
        )

    def pipeline_rejects(self) -> dict[str, int]:
        """Boundary tensors the receivers' sentinels dropped ({} when none was)."""
        return {"poison": self.verdicts["poison"]} if self.verdicts["poison"] else {}

    def flagged(self) -> dict[str, list[str]]:
        """Per receiving cell, the senders its sentinel flagged (cells with none left out)."""
        out = {}
        for c in (c for row in self.cells for c in row):
            if c.sentinel is not None and c.sentinel.flagged():
                out[cell_name(c.stage, c.replica)] = c.sentinel.flagged()
        return out

    def clip_rate(self) -> float:
        cells = [c for column in self.cells for c in column]
        return sum(c.clipped for c in cells) / max(1, sum(c.step for c in cells))


class functional_module(torch.nn.Module):  # noqa: N801 - used like a function
    """A stage module evaluated with other weights (no copy into the original)."""

    def __init__(self, module: torch.nn.Module, params: Params) -> None:
        super().__init__()
        self.inner, self.params = module, params

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return functional_call(self.inner, self.params, (x,), kwargs)
