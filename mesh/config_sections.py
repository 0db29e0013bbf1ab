"""The config's sections: every key of a run with its type, default and the reason for it.

`mesh.config` composes them into one `Config` (cross-checks, fingerprint, TOML and --set); import
them from there. Imports: pydantic only.
"""

from __future__ import annotations

import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from mesh import choices


class ConfigError(ValueError):
    """A user error in the configuration: the message names the dotted key and the fix."""


def _takes_bool(annotation: Any) -> bool:
    """Whether a field of this type means to hold true/false (bool, Any, or a union or
    Literal with a bool in it)."""
    if annotation is bool or annotation is Any:
        return True
    return any(
        a is bool or isinstance(a, bool) or (a is not annotation and _takes_bool(a))
        for a in typing.get_args(annotation)
    )


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        """A bool is not a number: pydantic would take `tau = true` as 1 (and a float key as
        1.0); a number key refuses it (ints still fill float keys)."""
        field = cls.model_fields.get(info.field_name or "")
        items = value if isinstance(value, list | tuple) else [value]
        if field is not None and any(isinstance(v, bool) for v in items):
            if not _takes_bool(field.annotation):
                raise ValueError(f"{str(value).lower()} is a bool, not a number; write a number")
        return value


class ModelConfig(_Section):
    arch: Literal[choices.ARCHS] = Field(
        "gpt",
        description="gpt: byte-level demo GPT (LayerNorm, learned positions, GELU MLP); llama: "
        "RMSNorm, rotary positions, SwiGLU, grouped-query attention, untied head (the Hugging "
        "Face LlamaForCausalLM layout, so `meshtrain export` is a rename)",
    )
    vocab_size: int = Field(256, ge=2, description="byte-level tokenizer: 256")
    d_model: int = Field(64, ge=8, description="residual width")
    n_layers: int = Field(8, ge=1, description="transformer blocks, split evenly over stages")
    n_heads: int = Field(4, ge=1, description="attention heads; must divide d_model")
    mlp_ratio: int = Field(4, ge=1, description="MLP hidden width / d_model")
    seq_len: int = Field(64, ge=2, description="context length in tokens")
    n_kv_heads: int | None = Field(
        None, ge=1, description="llama: key/value heads (grouped-query attention); None: n_heads"
    )
    intermediate_size: int | None = Field(
        None, ge=1, description="llama: SwiGLU hidden width; None: mlp_ratio x d_model"
    )
    rope_theta: float = Field(10000.0, gt=0, description="llama: rotary embedding base")
    norm_eps: float = Field(1e-5, gt=0, description="llama: RMSNorm epsilon")
    init_from: str | None = Field(
        None,
        description="a Hugging Face LlamaForCausalLM directory (config.json, safetensors) whose "
        "weights start the run; the model keys left unset come from its config.json. Every "
        "peer needs its own copy: the run checks them by init_digest",
    )
    init_digest: str | None = Field(
        None, description="init_from's weights' identity (set from the directory; not a path)"
    )

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def mlp_width(self) -> int:
        return self.intermediate_size or self.mlp_ratio * self.d_model


class GridConfig(_Section):
    stages: int = Field(4, ge=1, description="P: pipeline stages (model cut by depth)")
    replicas: int = Field(2, ge=1, description="m: data-parallel replicas (one pipeline each)")


class PipelineConfig(_Section):
    schedule: Literal[choices.SCHEDULES] = Field(
        "async", description="gpipe/1f1b: sync with flush; async: PipeDream stashing; 2bw: delay 1"
    )
    microbatch_size: int = Field(8, ge=1, description="sequences per microbatch")
    microbatches: int = Field(
        4, ge=1, description="M: microbatches per update for gpipe/1f1b/2bw (async updates each)"
    )
    codec: Literal[choices.PIPELINE_CODECS] = Field(
        "bf16",
        description="codec of activations and their gradients between stages; int4_hadamard: "
        "4 bits a value, Hadamard-rotated blocks of 128 (docs/boundaries.md)",
    )
    window: Literal["none", "auto"] | list[int] = Field(
        "none",
        description="async only: extra warm-up forwards per stage so a latent link never starves "
        "the pipeline; each adds one step of staleness (stage j's forward of "
        "microbatch b reads version b-(P-1-j)-window[j]). 'auto': sized at launch from the "
        "round trip (transport.link, stage times; schedule.inflight_window); 'none': 1F1B's P-1-j",
    )

    boundary: Literal[choices.BOUNDARIES] = Field(
        "full",
        description="what crosses a stage boundary (mesh/algo/boundary.py), in pipeline.codec: "
        "full: the d_model-wide residual stream; subspace: boundary_rank coordinates in one "
        "fixed shared basis, every residual write kept inside it (Subspace Networks, lossless "
        "by construction, exports as a plain Llama); learned: boundary_rank coordinates through "
        "a learned per-boundary encoder (orthonormal, Stiefel) and decoder with token anchors "
        "on both sides (MAPL-style). Activations and their gradients alike; llama only",
    )
    boundary_rank: int = Field(
        16, ge=1, description="coordinates per token that cross a compressed boundary (<= d_model)"
    )
    anchor_rank: int = Field(
        16,
        ge=0,
        description="learned: rank of each side's token anchor (vocab x rank x d_model): what "
        "the tokens alone predict is taken out before the projection and added back after; 0: none",
    )

    weight_prediction: float = Field(
        0.0,
        ge=0,
        description="async/2bw: each stage's forward (and its backward's recompute) reads its "
        "weights moved this share of its gradient delay ahead along the EMA of its own updates, "
        "so a stale gradient is taken near where it lands (1: the whole delay; "
        "mesh/algo/staleness.py); 0: off. Costs one parameter-sized buffer per stage",
    )
    prediction_beta: float = Field(
        0.9, ge=0, lt=1, description="EMA factor of the update velocity weight_prediction uses"
    )

    routing: Literal[choices.ROUTINGS] = Field(
        "fixed",
        description="fixed: stage j of replica i sends only to stage j+1 of replica i (a replica "
        "runs at its slowest cell and stops at a dead one); pools: the live cells of a stage "
        "form its pool and each microbatch picks its next cell by load, its gradient returning "
        "along its path (async only; docs/pools.md)",
    )
    pool_window: int = Field(
        4,
        ge=1,
        description="pools: microbatches a cell holds at most (each with its stashed weight "
        "version); a full cell refuses new work and the sender picks another",
    )
    pool_stream_window: Annotated[int, Field(ge=1)] | Literal["window", "auto"] = Field(
        "window",
        description="pools: microbatches a stream (a stage-0 cell) keeps in flight: window = "
        "pool_window; auto = enough to cover the time its microbatches spend downstream, from "
        "its measured round trip and compute (Little's law), between pool_window and "
        f"{choices.STREAM_WINDOW_CAP}x it or as many as fit the device's memory (a stashed "
        "weight version each: `plan` shows it), grown only while a next-stage cell starves; "
        "or a number (>= 1). More in flight keeps a fast stream's device busy and adds "
        "staleness",
    )
    pool_cell_window: Literal["window", "auto"] = Field(
        "window",
        description="pools: microbatches a cell of a later stage holds at most: window = "
        "pool_window; auto = one more than it holds while it has nothing of its own to compute "
        "and a cell of the next stage starves, up to "
        f"{choices.STREAM_WINDOW_CAP}x pool_window or as many as fit the device's memory (a "
        "stashed weight version each: `plan` shows it). Its senders read it from its answers. "
        "Keeps a thin stage's cells from idling full while the next stage waits",
    )
    pool_choice: Literal[choices.POOL_CHOICES] = Field(
        "delay",
        description="pools: delay = two next cells drawn with probability ~ its measured rate "
        "/ (its queue + 1), of which the one that would finish the microbatch first, "
        "(queue + 1) / rate (the power of two choices: a slow cell's queue stays short); "
        "load = one cell so drawn (SWARM's stochastic wiring); seeded = drawn uniformly from "
        "the pool by a pure function of (seed, stream, microbatch, stage), and each cell "
        "takes its microbatches one at a time in (microbatch, stream) order: reproduces the "
        "simulator exactly",
    )
    pool_affinity: float = Field(
        1.5,
        ge=0,
        description="pools (load and delay): replica affinity. A ratio >= 1 keeps a microbatch "
        "on its own replica's next cell unless that cell is clearly slower: its measured time "
        "per microbatch more than this x the best other cell's (or it is full, down or not "
        "measured yet). With equal peers a pool is then fixed wiring (docs/pools.md measured "
        "1.5); 0 = off: every hop drawn by load",
    )

    @property
    def pooled(self) -> bool:
        """Whether a stage's cells form a pool (routing = pools): the one place the routing's
        name is read (mesh/algo/routes.py builds the component from it)."""
        return self.routing == "pools"

    def extra_warmups(self) -> list[int] | None:
        """The resolved window as the schedule functions take it (None for 'none').

        'auto' is sized from a link and stage times (mesh.runtime.emulate.resolve_window) before
        any cell is built; a cell or the simulator meeting it unresolved is a user error.
        """
        if self.window == "auto":
            raise ConfigError(
                "pipeline.window = 'auto' is sized from the link when a grid launches, and here "
                "there is none (simulator, plan): give the extra warm-ups as a list (e.g. "
                "[1, 1, 0, 0]) or 'none'"
            )
        return None if self.window == "none" else list(self.window)


class OptimConfig(_Section):
    name: Literal[choices.OPTIMIZERS] = "nadamw"
    lr: float = Field(
        1e-3, gt=0, description="peak lr (AdamW part for muon); nadamw 1e-3, adamw 2e-3 tuned"
    )
    beta1: float | None = Field(
        None, ge=0, lt=1, description="None: 0.99 for nadamw, 0.9 for adamw/muon's AdamW part"
    )
    beta2: float = Field(0.999, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    momentum_decay: Annotated[float, Field(ge=0)] | Literal["auto"] = Field(
        0.004,
        description="NAdam psi: the mu_t ramp (>= 0). 'auto': the paper's 0.004 over its 30k "
        "updates, scaled to this run's schedule horizon (mu_t follows the same curve)",
    )
    muon_lr: float = Field(0.02, gt=0)
    muon_momentum: float = Field(0.95, ge=0, lt=1)
    ns_steps: int = Field(5, ge=1)
    rotate_every: int = Field(10, ge=1, description="rotated_adam: eigenbasis refresh period")
    stage_aware: bool = Field(False, description="rotated_adam: refresh faster at larger delay")
    grad_clip: float = Field(
        1.0, description="per-stage gradient norm clip (AsyncPP uses 10 at 163M); <= 0 disables"
    )
    warmup_steps: int = Field(100, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine floor as a fraction of lr")
    delay_lr_share: float = Field(
        0.0,
        ge=0,
        le=4,
        description="a stage with gradient delay d > 1 starts at lr / d and reaches the full lr "
        "at this share of the run (AsyncPP's lr_correction; mesh.algo.staleness.delay_lr_factor); "
        "above 1 it ends at lr / d^(1 - 1/share); 0: off",
    )
    adaptive_momentum: bool = Field(
        False,
        description="AsyncPP's adaptive momentum: stage j's beta1 = beta1 + delay_j (0.99 - "
        "beta1) / P (needs beta1 < 0.99 to change anything; "
        "mesh.algo.optim_schedules.adaptive_beta1)",
    )
    mu_cap: float | None = Field(
        None,
        ge=0,
        lt=1,
        description="nadamw: NAdam's mu_t at most this (None: torch's ramp towards beta1)",
    )
    boundary_lr_scale: float = Field(
        1.0,
        gt=0,
        description="a compressed boundary's own parameters (pipeline.boundary = learned: its "
        "encoders, decoders and token anchors) train at lr x this (Muon's matrices: muon_lr x "
        "this); 1 = the model's",
    )
    boundary_weight_decay: float | None = Field(
        None, ge=0, description="their weight decay (None: optim.weight_decay)"
    )
    depth_rule: Literal["auto", "off"] = Field(
        "auto",
        description="auto: an async pipeline's optimizer keys left at their defaults take what "
        "`bench depth` measured for its depth (mesh/depth_rule.py; show-config shows them); off: "
        "the defaults at every depth",
    )
    error_feedback: bool = Field(False, description="x <- x - 2u_t + u_(t-1) for any optimizer")
    state_8bit: bool = Field(False, description="bitsandbytes 8-bit optimizer states (CUDA)")


class DPConfig(_Section):
    mode: Literal[choices.DP_MODES] = Field(
        "param_avg", description="data-parallel axis: nothing, blocking gradient mean, or averaging"
    )
    fraction: float = Field(0.05, gt=0, le=1, description="p: share of each tensor per round")
    tau: int = Field(5, ge=0, description="rounds land tau steps late (0 = blocking)")
    interval_steps: int = Field(1, ge=1, description="a round is launched every N steps")
    correction: Literal[choices.CORRECTIONS] = Field(
        "ema", description="ema: AsyncMesh; delta: lambda = 1; replace: AsyncSPARTA"
    )
    lambda_initial: float = Field(0.5, gt=0, le=1)
    lambda_final: float = Field(0.01, gt=0, le=1)
    lambda_hold_steps: int = Field(1000, ge=0, description="lambda_initial for this many steps")
    lambda_clock: Literal[choices.LAMBDA_CLOCKS] = Field(
        "steps",
        description="what lambda's schedule counts. steps: optimizer updates (hold "
        "dp.lambda_hold_steps, cosine to lambda_final at the horizon); arrivals: the averages a "
        "coordinate has received (one per K = 1/p rounds), hold dp.lambda_hold_arrivals, "
        "cosine over the run's arrivals per coordinate, so the EMA's memory (1/lambda arrivals) "
        "means what it means in the paper however short the run",
    )
    lambda_hold_arrivals: int = Field(
        50, ge=0, description="lambda_clock = arrivals: the paper's 1,000 steps at K = 20"
    )
    selector: Literal[choices.SELECTORS] = "partition"
    index_map: Literal[choices.INDEX_MAPS] = Field(
        "keyed",
        description="partition selector: how a round's share of the positions maps to "
        "coordinates. keyed: a keyed bijection evaluated on the round's k positions alone, "
        "O(k) a round; permutation: one randperm per tensor, O(numel) a round once it "
        "outgrows the cache (the runs from before the key: the two pick different coordinates)",
    )
    subset_block: int = Field(
        1,
        ge=1,
        le=1 << 16,
        description="keyed partition: a round selects runs of this many contiguous values "
        "instead of single coordinates (1). At 5% of single coordinates a round's gathers touch "
        "nearly every cache line of the stage; runs of 64 touch 5% of them (the llama-160m and "
        "llama-1b presets set 64: see bench scale-model)",
    )
    codec: Literal[choices.DP_CODECS] = Field(
        "fp8_e4m3", description="codec of averaging payloads (and of gradients in grad_allreduce)"
    )
    block_size: int = Field(128, ge=1, description="values per scale for fp8/int8 codecs")
    strict_tau: bool = Field(
        False,
        description="runtime: wait for each round exactly tau updates after launch (reproduces "
        "the simulator); off: apply a round when it completes, at least tau updates late",
    )
    max_round_lag_steps: int = Field(
        20,
        ge=0,
        description="runtime (hivemind): a member whose payload is still missing this many "
        "updates after a round was due is dropped from it; the round applies over the rest",
    )
    aggregate: Literal[choices.AGGREGATES] = Field(
        "mean",
        description="how a round combines the dequantized payloads, coordinate-wise: mean; "
        "trimmed_mean (drops the largest and smallest quarter, at least one each) or median "
        "keep one poisoning replica from steering the average (grid.replicas >= 3)",
    )
    payload_error_feedback: bool = Field(
        True,
        description="a round's mean is applied relative to this replica's own decoded payload "
        "(mean + snapshot - decode(own payload)), so the codec's rounding of its own values never "
        "enters its weights: replicas that agree get their own values back exactly. Off (the "
        "papers' rule), an fp8 round writes its rounding error into the weights every K rounds, "
        "a random walk the decaying lr stops pulling back (the soak's loss rose after 30 "
        "minutes). No effect with dp.codec = fp32",
    )
    noise_codec: Literal[choices.NOISE_CODECS] = Field(
        "none",
        description="studies, simulator only: add this codec's error on a shuffled copy of "
        "each round's mean to the mean (its noise's size, none of its bias); the processes "
        "refuse it",
    )
    outlier_k: float = Field(
        0.0,
        ge=0,
        description="reject a payload whose RMS distance to this replica's own exceeds k x the "
        "lower median of recent accepted distances (counted as 'outlier'); 0: off. 10 leaves a "
        "clean run alone and catches scaled or sign-flipped weights",
    )


class DataConfig(_Section):
    path: str | None = Field(None, description="`data prepare` DIR, UTF-8 file, None: Shakespeare")
    digest: str | None = Field(
        None,
        description="a prepared dataset's identity (from its manifest): in the fingerprint, "
        "instead of data.path (where each peer keeps its copy is its own business)",
    )
    val_fraction: float = Field(0.05, gt=0, lt=0.5, description="held-out tail of each document")
    val_batches: int = Field(16, ge=1, description="fixed validation batches")


class RunConfig(_Section):
    seed: int = Field(0, ge=0)
    steps: int = Field(300, ge=1, description="optimizer updates per stage")
    schedule_steps: int | None = Field(
        None,
        ge=1,
        description="horizon of the lr and lambda schedules (None: run.steps). `simulate` "
        "writes the resolved value to the run's config.toml, so a resume that extends "
        "run.steps keeps the horizon the run started with: lr and lambda stay at their floors "
        "for the extra steps instead of jumping back up",
    )
    eval_every: int = Field(100, ge=1, description="validation every N updates")
    threads: int = Field(1, ge=1, description="torch threads per process")


# Keys added after the first release, by section: left at their defaults they stay out of the
# fingerprint, so the runs (and checkpoints) of configs that predate them keep theirs.
LATER_KEYS: dict[str, tuple[str, ...]] = {
    "model": (
        "arch",
        "n_kv_heads",
        "intermediate_size",
        "rope_theta",
        "norm_eps",
        "init_digest",  # (init_from, a path, is never hashed)
    ),
    "pipeline": (
        "weight_prediction",
        "prediction_beta",
        "boundary",
        "boundary_rank",
        "anchor_rank",
        "routing",
        "pool_window",
        "pool_choice",
        "pool_stream_window",
        "pool_affinity",
        "pool_cell_window",
    ),
    "optim": (
        "delay_lr_share",
        "adaptive_momentum",
        "mu_cap",
        "boundary_lr_scale",
        "boundary_weight_decay",
    ),
    "dp": (
        "lambda_clock",
        "lambda_hold_arrivals",
        "aggregate",
        "outlier_k",
        "noise_codec",
        "payload_error_feedback",
        "index_map",
        "subset_block",
    ),
}
# Later keys whose default is not the behaviour from before the key (their default changed, or
# the key came with a new default behaviour): they hash away at the value that reproduces the
# behaviour from before the key, not at the default.
HASHED_AWAY_AT: dict[tuple[str, str], Any] = {
    ("dp", "payload_error_feedback"): False,
    ("dp", "index_map"): "permutation",
    ("pipeline", "pool_affinity"): 0.0,
}
# the sections every peer of a run shares (mesh/config_local.py: those each peer sets itself)
SECTIONS: dict[str, type[_Section]] = {
    "model": ModelConfig,
    "grid": GridConfig,
    "pipeline": PipelineConfig,
    "optim": OptimConfig,
    "dp": DPConfig,
    "data": DataConfig,
    "run": RunConfig,
}
