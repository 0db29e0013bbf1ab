"""`meshtrain plan`: what each cell of a run holds and sends, from the config alone.

Per stage (every replica's cell of a stage is the same): the fp32 master weights, the stashed
versions its schedule keeps, gradients, optimizer states (8-bit when optim.state_8bit), the
drift and error-feedback buffers, the averaging rounds in flight, the inputs of the microbatches
in flight and what one microbatch's forward keeps for its backward; and the link bandwidth the
cell needs at a given pipeline throughput (tokens/s of one replica). Shapes come from the stage
built on the meta device, so the parameter figures are exact; tests/unit/test_plan.py checks the
rest against a real cell.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch

from comms import codecs
from mesh import choices
from mesh.algo import boundary as bmath
from mesh.algo import routing, sparse
from mesh.algo.optim import _Blockwise8bit, get_planner
from mesh.algo.schedule import microbatches_per_update, stage_delay, versions_kept
from mesh.algo.staleness import prediction_distance
from mesh.config import Config
from mesh.engine.cell import optim_spec
from mesh.model.build import boundary_spec, stage_layers, stage_module
from mesh.model.memory import output_bytes, saved_bytes

GB = 1e9


@dataclass(frozen=True)
class CellPlan:
    stage: int
    layers: int
    params: int
    weights_bytes: int  # the live fp32 masters
    stash_bytes: int  # weight versions the schedule keeps (one flat copy each)
    versions: int
    grad_bytes: int  # an update's gradients (+ the backward's own while they are added)
    optimizer_bytes: int
    drift_bytes: int  # AsyncMesh's drift buffer (a cell always holds it)
    error_feedback_bytes: int
    averaging_bytes: int  # rounds in flight (indices, snapshot, mean) + a cached permutation
    inflight: int  # microbatches between forward and backward at once
    inflight_bytes: int  # their stashed inputs and one incoming gradient
    transport_bytes: int  # what the mailboxes hold: received frames with their decoded copies
    activation_bytes: int  # one microbatch's forward kept for its backward, and its output
    pp_up_bytes_per_token: float  # activations forward + gradients back, encoded
    dp_bytes_per_update: float  # averaging payload each cell sends per update (ring)

    @property
    def total_bytes(self) -> int:
        return (
            self.weights_bytes
            + self.stash_bytes
            + self.grad_bytes
            + self.optimizer_bytes
            + self.drift_bytes
            + self.error_feedback_bytes
            + self.averaging_bytes
            + self.inflight_bytes
            + self.transport_bytes
            + self.activation_bytes
        )

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "total_bytes": self.total_bytes}


def optimizer_state_bytes(cfg: Config, stage: int) -> tuple[int, int]:
    """(optimizer state bytes, error-feedback bytes) of one stage, from the rules' own state on
    meta tensors; with state_8bit the quantized moments take 1 byte a value plus a fp32 scale per
    block of 256 (tensors under 4096 values stay fp32), as bitsandbytes stores them."""
    module = stage_module(
        cfg.model,
        *stage_layers(cfg.model, cfg.grid.stages, stage),
        stage=stage,
        boundary=boundary_spec(cfg),
    )
    spec = optim_spec(cfg.effective().optim)  # the depth rule resolved
    planner = get_planner(spec.name)
    total = 0
    for name, p in module.named_parameters():
        rule = planner(name, p, spec)
        for key, val in rule.init_state(p.detach()).items():
            if not isinstance(val, torch.Tensor):
                continue
            n = val.numel()
            q8 = _Blockwise8bit
            if spec.state_8bit and key in rule.quantized and p.numel() >= q8.MIN_NUMEL:
                total += n + 4 * math.ceil(n / q8.BLOCK)
            else:
                total += n * val.element_size()
    params = sum(p.numel() for p in module.parameters())
    pipe = cfg.pipeline
    delay = stage_delay(pipe.schedule, stage, cfg.grid.stages, pipe.extra_warmups())
    if prediction_distance(pipe.weight_prediction, delay) > 0:
        total += 4 * params  # the update velocity weight prediction reads (optimizer state)
    return total, 4 * params if spec.error_feedback else 0


def pool_held(cfg: Config, stage: int, memory_bytes: float | None = None) -> int:
    """The most microbatches a pooled cell holds (mesh/runtime/pool.py): a stream (stage 0) its
    stream window at its largest, any other cell its cell window (`auto`: as many as fit
    memory_bytes, else pool_window)."""
    p = cfg.pipeline
    if stage > 0 and p.pool_cell_window == "auto":
        return auto_window(cfg, stage, memory_bytes)
    if stage > 0:
        return p.pool_window
    if p.pool_stream_window == "window":
        return p.pool_window
    if p.pool_stream_window == "auto":
        return auto_window(cfg, 0, memory_bytes)
    return p.pool_stream_window


def auto_window(cfg: Config, stage: int, memory_bytes: float | None) -> int:
    """The most microbatches an `auto` window lets stage `stage`'s cell hold (a stream's
    `pool_stream_window`, a later cell's `pool_cell_window`): STREAM_WINDOW_CAP x pool_window,
    fewer where the cell holding that many would not fit memory_bytes (each one stashes a
    weight version and keeps its input: tokens at stage 0, an activation after), never fewer
    than pool_window (None: no memory to fit, the cap)."""
    p = cfg.pipeline
    floor, cap = p.pool_window, choices.STREAM_WINDOW_CAP * p.pool_window
    if memory_bytes is None:
        return cap
    at_cap = plan_cell(cfg, stage)  # pool_held without a memory: the cap
    per_microbatch = 4 * at_cap.params + held_input_bytes(cfg, stage)
    return routing.windows_that_fit(at_cap.total_bytes, per_microbatch, memory_bytes, floor, cap)


def inflight_microbatches(cfg: Config, stage: int, memory_bytes: float | None = None) -> int:
    """Microbatches whose input stage j holds between forward and backward at most."""
    p = cfg.pipeline
    if p.pooled:
        return pool_held(cfg, stage, memory_bytes)
    if p.schedule == "gpipe":
        return p.microbatches
    kept = versions_kept(p.schedule, stage, cfg.grid.stages, cfg.pipeline.extra_warmups())
    if p.schedule == "async":
        return kept  # P - j (+ the window's extra warm-ups)
    return min(cfg.grid.stages - stage, p.microbatches)


def stash_versions(cfg: Config, stage: int, memory_bytes: float | None = None) -> int:
    """Weight versions a cell holds: its schedule's, or a pooled cell's at most one per
    microbatch it holds plus the live one (PoolWorker._push_version pins no more)."""
    p = cfg.pipeline
    if p.pooled:
        return pool_held(cfg, stage, memory_bytes) + 1
    return versions_kept(p.schedule, stage, cfg.grid.stages, p.extra_warmups())


def held_input_bytes(cfg: Config, stage: int) -> int:
    """What stage `stage` keeps of each microbatch it holds between forward and backward: token
    ids at stage 0, else the decoded fp32 activation (and the tokens a compressed boundary
    reads)."""
    B, T = cfg.pipeline.microbatch_size, cfg.model.seq_len
    compressed = cfg.pipeline.boundary != "full"
    return B * T * (8 if stage == 0 else 4 * cfg.boundary_width + 8 * compressed)


def plan_cell(cfg: Config, stage: int, memory_bytes: float | None = None) -> CellPlan:
    """Stage `stage`'s cell; memory_bytes: the device's, which bounds a pool's `auto` windows
    (None: unbounded, the window's cap)."""
    m, P = cfg.model, cfg.grid.stages
    layers, first, last = stage_layers(m, P, stage)
    module = stage_module(m, layers, first, last, stage=stage, boundary=boundary_spec(cfg))
    n = sum(p.numel() for p in module.parameters())
    flat = 4 * n
    versions = stash_versions(cfg, stage, memory_bytes)
    opt, ef = optimizer_state_bytes(cfg, stage)
    B, T, d = cfg.pipeline.microbatch_size, m.seq_len, m.d_model
    inflight = inflight_microbatches(cfg, stage, memory_bytes)
    w = cfg.boundary_width
    act_in = held_input_bytes(cfg, stage)
    grad_in = 0 if last else B * T * 4 * w
    # the fixed subspace's buffers: U and the initial token table, on every stage
    fixed = 4 * (m.vocab_size * d + d * w) if cfg.pipeline.boundary == "subspace" and P > 1 else 0
    # async: an update's gradients are its one backward's; the flushed schedules add each
    # microbatch's into them (two sets at once)
    mpu = microbatches_per_update(cfg.pipeline.schedule, cfg.pipeline.microbatches)
    dp, reps = cfg.dp, cfg.grid.replicas
    averaging, dp_update = 0, 0.0
    # the pipeline's messages while they wait in a mailbox (comms.wire.Message.held_bytes):
    # an activation from the previous stage and a gradient from the next, each frame plus its
    # decoded float32 copy, and what this cell sends the other way
    boundary = codecs.encoded_nbytes(B * T * w, cfg.pipeline.codec)
    transport = ((not first) + (not last)) * 2 * (boundary + 4 * B * T * w)
    if dp.mode == "param_avg" and reps > 1:
        largest = sparse.max_subset_size(n, dp.fraction, dp.subset_block)  # any round's k
        k = largest if dp.subset_block > 1 else max(sparse.subset_sizes([n], dp.fraction))
        rounds = dp.tau // dp.interval_steps + 1
        averaging = rounds * largest * (8 + 4 + 4)  # int64 indices, fp32 snapshot and mean
        cached = dp.index_map == "permutation" and n <= sparse._CACHE_MAX_ELEMENTS
        if dp.selector == "partition" and dp.fraction < 1 and cached:
            averaging += 4 * n  # the int32 permutation of the current cycle, cached
        payload = codecs.encoded_nbytes(k, dp.codec, dp.block_size)
        dp_update = sparse.ring_allreduce_bytes(payload, reps) / dp.interval_steps
        # each round in flight: the other replicas' payloads waiting (frame + decoded copy)
        # and this cell's own frame on its way out
        held = codecs.encoded_nbytes(largest, dp.codec, dp.block_size) + 4 * largest
        transport += rounds * ((reps - 1) * held + payload)
    elif dp.mode == "grad_allreduce" and reps > 1:
        payload = codecs.encoded_nbytes(n, dp.codec, dp.block_size)
        dp_update = sparse.ring_allreduce_bytes(payload, reps)
    return CellPlan(
        stage=stage,
        layers=len(layers),
        params=n,
        weights_bytes=flat + fixed,
        stash_bytes=versions * flat,
        versions=versions,
        grad_bytes=flat * (1 if mpu == 1 else 2),
        optimizer_bytes=opt,
        drift_bytes=flat,
        error_feedback_bytes=ef,
        averaging_bytes=averaging,
        inflight=inflight,
        inflight_bytes=inflight * act_in + grad_in,
        transport_bytes=transport,
        activation_bytes=activation_bytes(cfg, stage, cfg.runtime.precision),
        pp_up_bytes_per_token=pp_bytes_per_token(cfg, stage, cfg.pipeline.codec),
        dp_bytes_per_update=dp_update,
    )


def activation_bytes(cfg: Config, stage: int, precision: str) -> int:
    """What one microbatch's forward keeps for its backward at `precision`, and its output."""
    layers, first, last = stage_layers(cfg.model, cfg.grid.stages, stage)
    B = cfg.pipeline.microbatch_size
    return saved_bytes(cfg.model, len(layers), first, last, B, precision) + output_bytes(
        cfg.model, last, B
    )


def at_precision(cfg: Config, cells: list[CellPlan], precision: str) -> list[CellPlan]:
    """The same cells with another compute precision (runtime.precision): only what a forward
    keeps for its backward changes; the masters, states and buffers stay fp32 either way."""
    return [replace(c, activation_bytes=activation_bytes(cfg, c.stage, precision)) for c in cells]


def stages_that_fit(cells: list[CellPlan], memory_bytes: float) -> list[int]:
    return [c.stage for c in cells if c.total_bytes <= memory_bytes]


def stage_to_take(cells: list[CellPlan], memory_bytes: float) -> int | None:
    """The stage a peer with `memory_bytes` should take: the largest that fits (ties: the
    lower stage), leaving the smaller stages to peers with less memory; None when none fits."""
    fit = [c for c in cells if c.total_bytes <= memory_bytes]
    return max(fit, key=lambda c: (c.total_bytes, -c.stage)).stage if fit else None


def pp_bytes_per_token(cfg: Config, stage: int, codec: str) -> float:
    """Pipeline bytes a cell sends per token: activations to the next stage, gradients to the
    previous one (each cfg.boundary_width values a token, through the codec)."""
    tokens = cfg.tokens_per_microbatch
    one_way = codecs.encoded_nbytes(tokens * cfg.boundary_width, codec) / tokens
    return one_way * ((stage < cfg.grid.stages - 1) + (stage > 0))


def plan(cfg: Config, memory_bytes: float | None = None) -> list[CellPlan]:
    return [plan_cell(cfg, j, memory_bytes) for j in range(cfg.grid.stages)]


def link_mbps(cell: CellPlan, cfg: Config, tokens_per_s: float) -> tuple[float, float]:
    """(pipeline, averaging) uplink Mbit/s a cell needs when its replica moves tokens_per_s."""
    per_update = cfg.tokens_per_microbatch * microbatches_per_update(
        cfg.pipeline.schedule, cfg.pipeline.microbatches
    )
    pp = cell.pp_up_bytes_per_token * tokens_per_s * 8 / 1e6
    dp = cell.dp_bytes_per_update * tokens_per_s / per_update * 8 / 1e6
    return pp, dp


def uplink_by_codec(
    cfg: Config, tokens_per_s: float
) -> list[tuple[str, float | None, float | None]]:
    """(codec, pipeline Mbit/s of the busiest cell or None where the pipeline has no such codec,
    averaging Mbit/s of the largest stage's cell or None where averaging has none) for every
    codec."""
    from typing import get_args

    from mesh.config import DPConfig, PipelineConfig, with_overrides

    pp_codecs = get_args(PipelineConfig.model_fields["codec"].annotation)
    dp_codecs = get_args(DPConfig.model_fields["codec"].annotation)
    busiest = max(range(cfg.grid.stages), key=lambda j: pp_bytes_per_token(cfg, j, "fp32"))
    out: list[tuple[str, float | None, float | None]] = []
    for codec in dict.fromkeys((*dp_codecs, *pp_codecs)):
        pp = dp = None
        if codec in pp_codecs:
            pp = pp_bytes_per_token(cfg, busiest, codec) * tokens_per_s * 8 / 1e6
        if codec in dp_codecs:
            other = with_overrides(cfg, {"dp.codec": codec})
            dp = max(
                link_mbps(plan_cell(other, j), other, tokens_per_s)[1]
                for j in (0, cfg.grid.stages - 1)
            )
        out.append((codec, pp, dp))
    return out


# ---- a stage boundary in bytes (pipeline.boundary; the math: mesh/algo/boundary.py) --------


def boundary_bytes(tokens: int, d_model: int, method: str, rank: int, codec: str) -> int:
    """Encoded payload bytes of one activation (or gradient) of `tokens` tokens (no header)."""
    return codecs.encoded_nbytes(tokens * bmath.width(d_model, method, rank), codec)


def compression_vs_bf16(tokens: int, d_model: int, method: str, rank: int, codec: str) -> float:
    """How many times fewer payload bytes than a full bf16 boundary."""
    full = codecs.encoded_nbytes(tokens * d_model, "bf16")
    return full / boundary_bytes(tokens, d_model, method, rank, codec)


def rank_for_compression(tokens: int, d_model: int, ratio: float, codec: str) -> int:
    """The largest rank whose payload is at least `ratio` x smaller than full bf16 (>= 1)."""
    full = codecs.encoded_nbytes(tokens * d_model, "bf16")
    # from above: bytes per value with the scales amortized never exceed the real bytes
    r = max(1, min(d_model, int(d_model * 2 / (ratio * codecs.bytes_per_value(codec))) + 1))
    while r > 1 and codecs.encoded_nbytes(tokens * r, codec) * ratio > full:
        r -= 1
    return r
