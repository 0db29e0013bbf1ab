"""The state of one grid cell (stage j of replica i) and the stage math both engines share.

A cell owns its stage module (the live weights), its optimizer, the stashed weight versions its
schedule needs, the AsyncMesh drift buffer d, and the averaging rounds in flight. The one-process
simulator (sim.py) and the per-process runtime drive cells through the same methods, so the two
engines compute the same numbers.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from comms import codecs
from mesh.algo import pipeline_poison, robust, sentinel, sparse
from mesh.algo.optim import OptimSpec, StageOptimizer
from mesh.algo.optim_schedules import lambda_at, lr_at, momentum_decay_for
from mesh.algo.schedule import microbatches_per_update, stage_delay, versions_kept
from mesh.algo.staleness import delay_lr_factor, predicted, prediction_distance
from mesh.config import (
    Config,
    DPConfig,
    OptimConfig,
    PipelineConfig,
    SentinelConfig,
    parse_cell_factors,
)
from mesh.engine.rounds import Round, RoundBook
from mesh.engine.stage_step import StageGrads, StagePass, stage_pass
from mesh.model.boundary import constrain_, riemannian_grads_
from mesh.model.build import stage_forward

Params = dict[str, torch.Tensor]


def optim_spec(
    cfg: OptimConfig,
    delay: int = 0,
    horizon_steps: int | None = None,
    velocity_beta: float | None = None,
    stages: int = 1,
) -> OptimSpec:
    """The optimizer's plain dataclass from the config section (same field names), plus the
    stage's gradient delay and the pipeline's depth (stage-aware rotation and adaptive
    momentum read them), momentum_decay = 'auto' resolved for the run's schedule horizon, and
    the velocity EMA weight prediction reads (None: off)."""
    fields = OptimSpec.__dataclass_fields__
    values = {k: v for k, v in cfg.model_dump().items() if k in fields}
    if values["momentum_decay"] == "auto":
        assert horizon_steps is not None, "momentum_decay = 'auto' needs the schedule horizon"
        values["momentum_decay"] = momentum_decay_for(horizon_steps)
    return OptimSpec(**values, delay=delay, velocity_beta=velocity_beta, stages=stages)


APPLY_SLICE = 1 << 18  # values of a round applied at once (see Cell.apply_round)


@dataclass(frozen=True)
class CellSettings:
    """What a cell reads of the run's config, its slice: the pipeline's depth, the optimizer and
    its schedules' horizon, the averaging, the pipeline, the sentinel, the run's seed (its
    sparse subsets draw from it) and, for an emulated hostile cell (faults.poison,
    faults.pipeline_poison), what it does: parsed once, here, for this cell alone."""

    stages: int
    optim: OptimConfig
    dp: DPConfig
    pipeline: PipelineConfig
    sentinel: SentinelConfig
    seed: int
    schedule_horizon: int
    poison: float | None = None  # None: an honest cell
    pipeline_poison: pipeline_poison.PipelinePoison | None = None  # None: honest

    @classmethod
    def of(cls, cfg: Config, stage: int, replica: int) -> CellSettings:
        g, faults = cfg.grid, cfg.faults
        poison = parse_cell_factors(faults.poison, g.stages, g.replicas, "poison")
        hostile = pipeline_poison.parse_pipeline_poison(
            faults.pipeline_poison, g.stages, g.replicas
        )
        return cls(
            g.stages,
            cfg.effective().optim,  # with optim.depth_rule resolved for this depth
            cfg.dp,
            cfg.pipeline,
            cfg.sentinel,
            cfg.run.seed,
            cfg.schedule_horizon,
            poison.get((stage, replica)),
            hostile.get((stage, replica)),
        )


@dataclass
class Cell:
    settings: CellSettings
    stage: int
    replica: int
    module: nn.Module  # a family's stage module (mesh.model.build)
    optimizer: StageOptimizer = field(init=False)
    flat: torch.Tensor = field(init=False)  # all stage parameters; the module holds views
    history: OrderedDict[int, torch.Tensor] = field(init=False)  # version -> flat weights used
    drift: torch.Tensor = field(init=False)
    rounds: RoundBook = field(init=False)  # the averaging rounds in flight
    step: int = 0  # optimizer updates applied to the live weights
    clipped: int = 0  # updates whose gradient norm was above optim.grad_clip (the clip rate)
    stalled: bool = False  # its last update had no gradient (skip_update)
    progress: int | None = None  # stage pools: the schedules' clock (see schedule_step)
    # RMS distances of the payloads accepted lately: the deviation bound's scale (dp.outlier_k)
    distances: deque[float] = field(default_factory=lambda: deque(maxlen=robust.OUTLIER_WINDOW))

    @classmethod
    def build(cls, cfg: Config, stage: int, replica: int, module: nn.Module) -> Cell:
        """The cell of (stage, replica) around `module`, with its slice of `cfg`."""
        return cls(CellSettings.of(cfg, stage, replica), stage, replica, module)

    def __post_init__(self) -> None:
        self.rounds = RoundBook(self.settings.dp.tau)
        # One flat buffer per stage (as FSDP does): a version is one clone, a round one gather.
        named = list(self.module.named_parameters())
        # Filled one parameter at a time, each one's own storage freed as its view replaces
        # it: the build peaks at one stage plus one tensor, not two stages (torch.cat's copy
        # of a llama-1b stage is 1.3 GB more than plan counts).
        first = named[0][1]
        total = sum(p.numel() for _, p in named)
        self.flat = torch.empty(total, dtype=first.dtype, device=first.device)
        self._shapes, offset = [], 0
        for name, p in named:
            n = p.numel()
            self.flat[offset : offset + n].copy_(p.detach().reshape(-1))
            p.data = self.flat[offset : offset + n].view_as(p)
            self._shapes.append((name, offset, n, p.shape))
            offset += n
        # the in-flight window's extra warm-ups add to the delay (stage-aware rotation reads it)
        pipe, window = self.settings.pipeline, self.settings.pipeline.extra_warmups()
        delay = stage_delay(pipe.schedule, self.stage, self.settings.stages, window)
        # read by push_version every update: worked out once
        self._versions_kept = versions_kept(pipe.schedule, self.stage, self.settings.stages, window)
        # weight prediction: how far ahead this stage's versions are extrapolated (0: off)
        self._prediction = prediction_distance(pipe.weight_prediction, delay)
        beta = pipe.prediction_beta if self._prediction > 0 else None
        spec = optim_spec(
            self.settings.optim, delay, self.settings.schedule_horizon, beta, self.settings.stages
        )
        self.optimizer = StageOptimizer(named, spec)
        self.drift = torch.zeros_like(self.flat)
        # a compressed boundary's constraints hold from the first version on (the subspace's
        # residual writes, the encoders' orthonormal bases)
        constrain_(self.module)
        self.history = OrderedDict()
        self.history[0] = self.version_weights()
        self.poison = self.settings.poison
        self.pipeline_poison = self.settings.pipeline_poison
        guard = self.settings.sentinel
        mpu = self.mpu = microbatches_per_update(
            self.settings.pipeline.schedule, self.settings.pipeline.microbatches
        )
        warmup = sentinel.warmup_messages(guard.warmup, self.settings.optim.warmup_steps, mpu)
        # an emulated attack starts once its receivers know the sender (twice their warm-up)
        self.poison_start = 0
        if self.pipeline_poison is not None:
            start = self.pipeline_poison.start
            self.poison_start = -(-2 * warmup // mpu) if start is None else start
        spec = sentinel.SentinelSpec(
            warmup,
            guard.z,
            guard.flag_drops,
            max(32, guard.flag_drops),
        )
        self.sentinel = sentinel.Sentinel(spec) if guard.enabled else None

    # ---- weights and versions -------------------------------------------------------------
    @property
    def params(self) -> list[torch.nn.Parameter]:
        return list(self.module.parameters())

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.params)

    def as_params(self, flat: torch.Tensor) -> Params:
        """Named views of a flat weight vector, shaped like the module's parameters."""
        return {n: flat[o : o + k].view(shape) for n, o, k, shape in self._shapes}

    def versions_to_keep(self) -> int:
        """The stashed versions the schedule reads: delay + 1 (+ the in-flight window's)."""
        return self._versions_kept

    def push_version(self, shared: bool = False) -> None:
        """Record the live weights as version `self.step`: what the next forward will use.

        Taken after the optimizer step and after averaging arrivals, so a stashed version is
        exactly the weights its forward saw; averaging later changes only the live weights.
        The version that leaves the stash gives its buffer to the new one: a fresh stage-sized
        tensor every update is a new mapping whose pages all fault in (a 46 MB stage: 157 ms a
        clone against 30 ms a copy into a held buffer on this 2-core box). Its holders are all
        on the worker's thread or under its step lock (forward, backward, checkpoint, state
        server), and none holds a version past the update that evicts it.

        shared: the version is the live tensor itself, no copy (emulated compute: no math reads
        a version, the device would copy it, and the stash's size is counted all the same).
        """
        keep = self.versions_to_keep()
        spare = None
        if not shared and self.step not in self.history and len(self.history) >= keep:
            _, oldest = self.history.popitem(last=False)  # insertion order: the oldest first
            spare = None if oldest is self.flat else oldest
        self.history[self.step] = self.flat if shared else self.version_weights(spare)
        while len(self.history) > keep:
            self.history.popitem(last=False)

    def push_pinned_version(self, pinned: Collection[int], shared: bool = False) -> None:
        """Stage pools' push_version: the versions in `pinned` (those the microbatches the
        cell holds read) and the new live one are kept, whatever their age, and nothing else:
        at most what it holds + 1 (plan.stash_versions). A version let go gives its
        buffer to the new one, as push_version's oldest does."""
        keep = set(pinned) | {self.step}
        spare = None
        for v in [v for v in self.history if v not in keep]:
            old = self.history.pop(v)
            spare = spare if old is self.flat else old
        if self.step not in self.history:
            self.history[self.step] = self.flat if shared else self.version_weights(spare)

    def version_weights(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The weights a new version holds: the live ones, or with pipeline.weight_prediction
        the live ones extrapolated along this stage's update velocity (mesh/algo/staleness.py).
        A copy (into `out` when given): averaging and the optimizer change only the live
        weights."""
        if self._prediction == 0:
            return self.flat.clone() if out is None else out.copy_(self.flat)
        velocity = torch.cat(
            [self.optimizer.velocity(name).reshape(-1) for name, _, _, _ in self._shapes]
        )
        return predicted(self.flat, velocity, self._prediction)

    def weights(self, version: int) -> Params:
        assert version in self.history, (version, list(self.history))
        return self.as_params(self.history[version])

    # ---- the stage's step on a microbatch (mesh/engine/stage_step.py) ----------------------
    def forward(
        self, version: int, inputs: torch.Tensor, precision: str, tokens: torch.Tensor | None
    ) -> torch.Tensor:
        """This stage's output for `inputs` on weight version `version`, no autograd: the
        activation a worker sends on (its backward recomputes it)."""
        with torch.no_grad():
            return stage_forward(self.module, self.weights(version), inputs, precision, tokens)

    def forward_pass(
        self, version: int, inputs: torch.Tensor, precision: str, tokens: torch.Tensor | None
    ) -> StagePass:
        """The forward on version `version` with autograd on, kept for its backward."""
        weights = self.weights(version)
        return stage_pass(self.module, weights, inputs, precision, tokens, self.stage == 0)

    def backward(
        self,
        version: int,
        inputs: torch.Tensor,
        precision: str,
        tokens: torch.Tensor | None,
        grad_out: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        share: int = 1,
    ) -> StageGrads:
        """The forward recomputed on the stashed version, then its backward (StagePass.backward:
        from grad_out, or on the last stage from the loss on `targets` / share)."""
        step = self.forward_pass(version, inputs, precision, tokens)
        return step.backward(grad_out, targets, share)

    # ---- optimizer ------------------------------------------------------------------------
    @property
    def schedule_step(self) -> int:
        """Where the lr and lambda schedules read this cell: its own update count, or (a stage
        pool's cell, whose count depends on how much work was routed to it) the index of the
        microbatch it is applying, which every cell of the grid passes at the same pace."""
        return self.step if self.progress is None else self.progress

    def lr_scale(self) -> float:
        o, horizon, at = self.settings.optim, self.settings.schedule_horizon, self.schedule_step
        scale = lr_at(at, horizon, 1.0, o.warmup_steps, o.min_lr_ratio)
        delay = self.optimizer.spec.delay
        return scale * delay_lr_factor(delay, at, horizon, o.delay_lr_share)

    def skip_update(self) -> None:
        """An update without a gradient (every microbatch of it was dropped on its way here):
        the step counts, so versions and schedules stay aligned, but the optimizer does not
        run (its momentum alone would keep moving the weights)."""
        self.step += 1
        self.stalled = True

    def sits_out(self) -> bool:
        """Whether this cell sits its next round out (abstains, comms/means.py): its last update
        had no gradient (its replica's microbatches were all dropped on the way: a poisoned
        pipeline), so its weights are stale and would drag the column back; it takes the
        others' mean. Only for the plain mean: a screened round (dp.aggregate, dp.outlier_k)
        measures the others against this cell's own payload."""
        return self.stalled and not self.screens_rounds

    @property
    def screens_rounds(self) -> bool:
        """Whether this cell combines its rounds itself (robust.screened: dp.aggregate,
        dp.outlier_k) rather than taking the members' plain mean."""
        dp = self.settings.dp
        return robust.screened(dp.aggregate, dp.outlier_k)

    def apply_update(self, grads: list[torch.Tensor]) -> float:
        """One optimizer step on the live weights with the given gradients; returns grad norm."""
        if getattr(self.module, "boundary", None) is not None:  # Stiefel: along the manifold
            named = dict(zip((n for n, *_ in self._shapes), grads, strict=True))
            riemannian_grads_(self.module, named)
            grads = list(named.values())
        for p, g in zip(self.params, grads, strict=True):
            p.grad = g
        norm = self.optimizer.step(self.lr_scale())
        self.optimizer.zero_grad()
        constrain_(self.module)
        self.step += 1
        self.stalled = False
        clip = self.settings.optim.grad_clip
        self.clipped += int(clip > 0 and norm > clip)
        return norm

    # ---- pipeline boundaries: what this cell sends and what it takes ----------------------
    def outgoing(self, x: torch.Tensor, kind: str, microbatch: int) -> torch.Tensor:
        """What this cell sends across a pipeline boundary for x (an activation or the gradient
        of its input): x itself, or with faults.pipeline_poison the emulated attack's tensor."""
        hostile = self.pipeline_poison
        # from the microbatches of update poison_start on: by the data's position, not this
        # cell's step, which an asynchronous schedule's in-flight microbatches run ahead of
        if hostile is None or microbatch < self.poison_start * self.mpu:
            return x
        which = int(kind == "gradient")
        seed = sparse.stable_seed(self.settings.seed, self.stage, self.replica, which, microbatch)
        return pipeline_poison.poisoned(x, hostile, seed)

    def screen(
        self, sender: str, kind: str, x: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]
    ) -> str:
        """The verdict on a decoded tensor received from `sender` (kind: activation or
        gradient) for the microbatch whose (inputs, targets) are `batch`: "use", "void" (the
        sender skipped this microbatch: pass the skip on), or "drop" (sentinel.enabled found
        it far outside the sender's statistics: skip it)."""
        if sentinel.is_void(x):
            return "void"
        if self.sentinel is None:
            return "use"
        tokens = sentinel.token_keys(kind, *batch)
        return "use" if self.sentinel.check(sender, kind, x, tokens) else "drop"

    # ---- data-parallel averaging ------------------------------------------------------------
    def open_round(self, index: int) -> tuple[Round, torch.Tensor]:
        """Snapshot this round's subset; returns the round and the dequantized payload to average.

        The subset is drawn over the stage's flat parameter vector (tensor index 0), so a round
        is one gather, one payload and one scatter. Every replica averages the dequantized
        payloads of all replicas, its own included, so the mean is bit-identical everywhere.
        """
        dp = self.settings.dp
        idx = sparse.subset_indices(
            self.settings.seed,
            self.stage,
            0,
            index,
            self.flat.numel(),
            dp.fraction,
            dp.selector,
            dp.index_map,
            dp.subset_block,
        )
        idx = idx.to(self.flat.device)
        snap = sparse.gather_runs(
            self.flat, sparse.runs_of(self.flat.numel(), idx, dp.subset_block)
        )
        sent = None if self.poison is None else snap * self.poison
        enc = codecs.encode(snap if sent is None else sent, dp.codec, dp.block_size)
        decoded = codecs.decode(enc)
        own = decoded if dp.payload_error_feedback else None
        return Round(index, self.step, idx, snap, enc.nbytes, sent=sent, own=own), decoded

    def combine_round(
        self, names: Sequence[str], parts: Sequence[torch.Tensor], me: str
    ) -> tuple[torch.Tensor, list[str]]:
        """The round's result from the members' dequantized payloads (in member order, this
        cell's `me` among them): the deviation bound (dp.outlier_k) rejects payloads too far
        from ours, then dp.aggregate combines the rest (mesh/algo/robust.py). Returns the
        result and the names rejected."""
        dp = self.settings.dp
        rejected: set[str] = set()
        if dp.outlier_k > 0:
            mine = parts[list(names).index(me)]
            dist = {n: robust.rms_distance(p, mine) for n, p in zip(names, parts) if n != me}
            rejected = robust.outliers(dist, self.distances, dp.outlier_k)
            self.distances.extend(d for n, d in dist.items() if n not in rejected)
        kept = [p for n, p in zip(names, parts, strict=True) if n not in rejected]
        return robust.aggregate(kept, dp.aggregate), sorted(rejected)

    def apply_round(self, rnd: Round) -> None:
        """Roll the stale mean forward with the drift correction (only live weights change).
        An emulated hostile cell (faults.poison) takes no averages: it trains on its own, so a
        grid with one stays finite wherever the honest cells keep the poison out."""
        assert rnd.mean is not None
        if self.poison is not None:
            return
        dp = self.settings.dp
        lam = self.lambda_for(rnd.index)
        # in slices: the math is elementwise, so the result is the same bits, and a slice's
        # temporaries stay in the cache and the heap (a whole llama-1b round's are 66 MB each,
        # a fresh mapping and its page faults apiece: 1.7x slower on a CPU)
        # (whole runs of dp.subset_block values a slice, so each is read and written in runs)
        block = dp.subset_block
        step = max(block, APPLY_SLICE // block * block)
        for lo in range(0, rnd.indices.numel(), step):
            part = slice(lo, lo + step)
            idx, snapshot, mean = rnd.indices[part], rnd.snapshot[part], rnd.mean[part]
            runs = sparse.runs_of(self.flat.numel(), idx, block)  # once for all four
            live = sparse.gather_runs(self.flat, runs)
            d = sparse.gather_runs(self.drift, runs)
            if rnd.own is not None:  # dp.payload_error_feedback
                mean = sparse.relative_mean(mean, snapshot, rnd.own[part].to(mean.device))
            new_live, new_d = sparse.apply_arrival(live, snapshot, mean, d, dp.correction, lam)
            sparse.scatter_runs_(self.flat, runs, new_live)
            sparse.scatter_runs_(self.drift, runs, new_d)
        constrain_(self.module)  # an average of constrained weights, drift-corrected

    def lambda_for(self, round_index: int) -> float:
        """lambda of the EMA at the arrival of round `round_index`, on the config's clock: this
        cell's update count now (steps) or the averages its coordinates have had (arrivals)."""
        dp = self.settings.dp
        if dp.lambda_clock == "steps":
            hold, now, total = (
                dp.lambda_hold_steps,
                self.schedule_step,
                self.settings.schedule_horizon,
            )
        else:
            hold = dp.lambda_hold_arrivals
            now = sparse.arrivals_before(round_index, dp.fraction, dp.selector)
            total = sparse.arrivals_per_coordinate(
                self.settings.schedule_horizon, dp.fraction, dp.interval_steps
            )
        return lambda_at(now, total, dp.lambda_initial, dp.lambda_final, hold)

    def due_rounds(self) -> list[Round]:
        """The rounds whose delay tau has passed, oldest first, taken out of the book (the
        simulator's, where every round has its mean from its launch)."""
        due = []
        while self.rounds.due(self.step) is not None:
            rnd, _ = self.rounds.pop()
            assert rnd.mean is not None, "a simulator round has its mean at launch"
            due.append(rnd)
        return due
