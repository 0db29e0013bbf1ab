"""The one typed run config: schema with defaults, TOML files, --set overrides, fingerprint.

Precedence: schema defaults < --config files (left to right) < --set key=value (left to right).
Every user mistake becomes a ConfigError naming the dotted key and the fix; the CLI prints it and
exits 2. Imports: pydantic, tomllib (no comms, no cli).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A user error in the configuration: the message names the dotted key and the fix."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class ModelConfig(_Section):
    arch: Literal["gpt", "llama"] = Field(
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

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def mlp_width(self) -> int:
        return self.intermediate_size or self.mlp_ratio * self.d_model


# keys added after the first release: left at their defaults they stay out of the fingerprint,
# so the runs (and checkpoints) of configs that predate them keep theirs
_LATER_MODEL_KEYS = ("arch", "n_kv_heads", "intermediate_size", "rope_theta", "norm_eps")


class GridConfig(_Section):
    stages: int = Field(4, ge=1, description="P: pipeline stages (model cut by depth)")
    replicas: int = Field(2, ge=1, description="m: data-parallel replicas (one pipeline each)")


class PipelineConfig(_Section):
    schedule: Literal["gpipe", "1f1b", "async", "2bw"] = Field(
        "async", description="gpipe/1f1b: sync with flush; async: PipeDream stashing; 2bw: delay 1"
    )
    microbatch_size: int = Field(8, ge=1, description="sequences per microbatch")
    microbatches: int = Field(
        4, ge=1, description="M: microbatches per update for gpipe/1f1b/2bw (async updates each)"
    )
    codec: Literal["fp32", "bf16", "fp8_e4m3", "fp8_e5m2"] = Field(
        "bf16", description="codec of activations and their gradients between stages"
    )
    window: Literal["none", "auto"] | list[int] = Field(
        "none",
        description="async only: extra warm-up forwards per stage so a latent link never starves "
        "the pipeline (design 4); each adds one step of staleness (stage j's forward of "
        "microbatch b reads version b-(P-1-j)-window[j]). 'auto': sized at launch from the "
        "round trip (runtime.link, stage times; schedule.inflight_window); 'none': 1F1B's P-1-j",
    )

    def extra_warmups(self) -> list[int] | None:
        """The resolved window as the schedule functions take it (None for 'none').

        'auto' is sized from a link and stage times (mesh.runtime.emulate.resolve_window) before
        any cell is built; a cell or the simulator meeting it unresolved is a user error.
        """
        if self.window == "auto":
            raise ConfigError(
                "pipeline.window = 'auto' is sized from a link at launch; the simulator has "
                "none: give the extra warm-ups as a list (e.g. [1, 1, 0, 0]) or 'none'"
            )
        return None if self.window == "none" else list(self.window)


class OptimConfig(_Section):
    name: Literal["nadamw", "adamw", "muon", "rotated_adam"] = "nadamw"
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
    error_feedback: bool = Field(False, description="x <- x - 2u_t + u_(t-1) for any optimizer")
    state_8bit: bool = Field(False, description="bitsandbytes 8-bit optimizer states (CUDA)")


class DPConfig(_Section):
    mode: Literal["none", "grad_allreduce", "param_avg"] = Field(
        "param_avg", description="data-parallel axis: nothing, blocking gradient mean, or averaging"
    )
    fraction: float = Field(0.05, gt=0, le=1, description="p: share of each tensor per round")
    tau: int = Field(5, ge=0, description="rounds land tau steps late (0 = blocking)")
    interval_steps: int = Field(1, ge=1, description="a round is launched every N steps")
    correction: Literal["ema", "delta", "replace"] = Field(
        "ema", description="ema: AsyncMesh; delta: lambda = 1; replace: AsyncSPARTA"
    )
    lambda_initial: float = Field(0.5, gt=0, le=1)
    lambda_final: float = Field(0.01, gt=0, le=1)
    lambda_hold_steps: int = Field(1000, ge=0, description="lambda_initial for this many steps")
    lambda_clock: Literal["steps", "arrivals"] = Field(
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
    selector: Literal["partition", "bernoulli"] = "partition"
    codec: Literal["fp32", "bf16", "fp8_e4m3", "fp8_e5m2", "int8_blockwise"] = Field(
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


class RuntimeConfig(_Section):
    backend: Literal["torch", "hivemind"] = Field(
        "torch", description="torch.distributed (gloo/NCCL) in a cluster, hivemind over a WAN"
    )
    timeout_s: float = Field(60.0, gt=0, description="deadline of a pipeline receive")
    round_timeout_s: float = Field(10.0, gt=0, description="deadline of an averaging round")
    host: str = Field("127.0.0.1", description="address peers bind (simulate: loopback)")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where a cell computes: auto = cuda when present, else cpu"
    )
    rejoin_timeout_s: float = Field(
        120.0,
        gt=0,
        description="hivemind: how long a cell waits for a lost neighbour of its replica to be "
        "replaced (restart or join) before it gives up",
    )
    heartbeat_s: float = Field(
        1.0, gt=0, description="hivemind: claim heartbeat period; a claim lives 4 periods"
    )
    max_lag_steps: int = Field(
        20,
        ge=0,
        description="hivemind: a cell this many updates behind the most advanced live peer of "
        "its stage reloads that peer's state before it trains (a joiner always does)",
    )
    mean_path: Literal["direct", "averager"] = Field(
        "direct",
        description="hivemind: averaging rounds as an all-gather on our streams (direct), or "
        "through hivemind's DecentralizedAverager (one round per group at a time)",
    )
    checkpoint_every: int = Field(
        50, ge=0, description="save each cell every N updates (and on a clean stop); 0: only then"
    )
    compute: Literal["real", "emulated"] = Field(
        "real",
        description="emulated: no model math; forward/backward sleep forward_ms/backward_ms x "
        "slowdown while real payloads of the real shapes cross the links (systems benchmarks)",
    )
    forward_ms: float = Field(
        10.0, gt=0, description="emulated: forward time per microbatch per stage at slowdown 1"
    )
    backward_ms: float = Field(
        20.0, gt=0, description="emulated: backward time per microbatch per stage at slowdown 1"
    )
    slowdowns: list[str] = Field(
        [],
        description='per-cell compute factors, e.g. ["s2r0=2.0"] (stage 2 of replica 0 twice '
        "as slow); unlisted cells 1.0. Real compute: each forward/backward then waits "
        "(factor-1) x its own time",
    )
    link: Literal["none", "datacenter", "wan100", "wan10"] = Field(
        "none",
        description="profile of every link, pipeline and averaging (comms.throttle.PROFILES: "
        "datacenter 10 Gbit/0.1 ms, wan100 100 Mbit/20 ms, wan10 10 Mbit/100 ms one-way)",
    )
    link_bandwidth_mbps: float | None = Field(
        None, gt=0, description="overrides the link profile's bandwidth (Mbit/s per direction)"
    )
    link_latency_ms: float | None = Field(
        None, ge=0, description="overrides the link profile's one-way latency (ms)"
    )
    precision: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="compute of a stage's forward and backward: bf16 autocasts them (CPU and "
        "CUDA); weights, optimizer states, drift and averaging stay fp32 masters, and what "
        "crosses a link follows the codecs",
    )


def _check_arch(m: ModelConfig) -> None:
    """The model keys that only one family reads, and llama's head shapes."""
    if m.arch == "gpt":
        for key in ("n_kv_heads", "intermediate_size"):
            if getattr(m, key) is not None:
                raise ValueError(
                    f"model.{key} only applies to model.arch = 'llama'; drop it or set "
                    "model.arch='llama'"
                )
        return
    if m.n_heads % m.kv_heads:
        raise ValueError(
            f"model.n_heads ({m.n_heads}) is not divisible by model.n_kv_heads ({m.kv_heads}); "
            "pick n_kv_heads that divides n_heads"
        )
    if (m.d_model // m.n_heads) % 2:
        raise ValueError(
            f"model.d_model / model.n_heads ({m.d_model // m.n_heads}) is odd: rotary embeddings "
            "rotate pairs; pick an even head width"
        )


def parse_slowdowns(items: list[str], stages: int, replicas: int) -> dict[tuple[int, int], float]:
    """runtime.slowdowns ["s2r0=2.0", ...] -> {(stage, replica): factor}; ValueError naming
    the key and the entry when a cell is not in the grid, repeated, or a factor is not > 0."""
    import re

    out: dict[tuple[int, int], float] = {}
    for item in items:
        m = re.fullmatch(r"\s*s(\d+)r(\d+)\s*=\s*([^\s]+)\s*", str(item))
        factor = None
        if m:
            try:
                factor = float(m.group(3))
            except ValueError:
                factor = None
        if m is None or factor is None:
            raise ValueError(
                f"runtime.slowdowns entry {item!r}: expected 'sJrI=FACTOR', e.g. 's2r0=2.0'"
            )
        j, i = int(m.group(1)), int(m.group(2))
        if not (0 <= j < stages and 0 <= i < replicas):
            raise ValueError(
                f"runtime.slowdowns entry {item!r}: cell s{j}r{i} is not in the "
                f"{stages}x{replicas} grid (stages s0..s{stages - 1}, replicas r0..r{replicas - 1})"
            )
        if not (factor > 0 and factor < float("inf")):
            raise ValueError(f"runtime.slowdowns entry {item!r}: the factor must be > 0")
        if (j, i) in out:
            raise ValueError(f"runtime.slowdowns lists cell s{j}r{i} twice")
        out[(j, i)] = factor
    return out


class Config(_Section):
    model: ModelConfig = ModelConfig()
    grid: GridConfig = GridConfig()
    pipeline: PipelineConfig = PipelineConfig()
    optim: OptimConfig = OptimConfig()
    dp: DPConfig = DPConfig()
    data: DataConfig = DataConfig()
    run: RunConfig = RunConfig()
    runtime: RuntimeConfig = RuntimeConfig()

    @model_validator(mode="before")
    @classmethod
    def _from_the_data(cls, tree: Any) -> Any:
        """A prepared dataset sets model.vocab_size and data.digest unless given: every config
        naming one has them before any model is built (data.path/manifest.json, which
        mesh.data.prepare writes; an unreadable one is the data loader's error to report)."""
        data = tree.get("data") if isinstance(tree, dict) else None
        model = tree.get("model", {}) if isinstance(tree, dict) else None
        if not (isinstance(model, dict) and isinstance(data, dict)):
            return tree
        if data.get("digest") and "vocab_size" in model:
            return tree  # both given (a run's own config.toml): nothing to read
        try:
            manifest = json.loads((Path(data["path"]) / "manifest.json").read_text())
            vocab, digest = manifest["vocab_size"], manifest["digest"]
        except (OSError, ValueError, KeyError, TypeError):
            return tree
        data = {**data, "digest": data.get("digest") or digest}
        return {**tree, "model": {"vocab_size": vocab, **model}, "data": data}

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        m, g, p = self.model, self.grid, self.pipeline
        if g.stages > m.n_layers:
            raise ValueError(
                f"grid.stages ({g.stages}) > model.n_layers ({m.n_layers}): every stage needs a "
                "layer; lower grid.stages or raise model.n_layers"
            )
        if m.d_model % m.n_heads:
            raise ValueError(
                f"model.d_model ({m.d_model}) is not divisible by model.n_heads ({m.n_heads}); "
                "pick n_heads that divides d_model"
            )
        if p.schedule == "2bw" and p.microbatches < g.stages:
            raise ValueError(
                f"pipeline.microbatches ({p.microbatches}) < grid.stages ({g.stages}): 2bw needs "
                "M >= P; raise pipeline.microbatches"
            )
        if self.dp.mode == "grad_allreduce" and p.schedule in ("async", "2bw"):
            raise ValueError(
                "dp.mode = 'grad_allreduce' needs a synchronous pipeline (gpipe or 1f1b); "
                "set pipeline.schedule='gpipe' or dp.mode='param_avg'"
            )
        parse_slowdowns(self.runtime.slowdowns, g.stages, g.replicas)
        if isinstance(p.window, list):
            from mesh.algo.schedule import validate_window

            validate_window(p.schedule, g.stages, p.window)
        _check_arch(m)
        if self.optim.name != "rotated_adam" and self.optim.stage_aware:
            raise ValueError(
                "optim.stage_aware only applies to optim.name = 'rotated_adam'; "
                "set optim.stage_aware=false"
            )
        return self

    def fingerprint(self) -> str:
        """Hash of what every peer of one run must agree on (not local settings like threads).

        The torch minor version is part of it: averaging indices come from torch.randperm, whose
        stream may change between releases, and peers must draw the same indices.
        """
        return self._hash(with_steps=True)

    def state_fingerprint(self) -> str:
        """Hash of what decides the math of every update so far: the fingerprint without
        run.steps, which only says where the run stops (the schedules' horizon is
        run.schedule_steps). Checkpoints carry it, so a resume may extend run.steps."""
        return self._hash(with_steps=False)

    @property
    def schedule_horizon(self) -> int:
        """Updates over which the lr and lambda schedules run (run.schedule_steps or run.steps)."""
        return self.run.schedule_steps or self.run.steps

    def _hash(self, with_steps: bool) -> str:
        import torch

        d = self.model_dump(mode="json")
        # resolved horizon: a config with schedule_steps unset hashes as one that spells it out
        # (and a run's fingerprint is what it was before the key existed when they agree)
        run: dict[str, int] = {"seed": self.run.seed}
        if with_steps:
            run["steps"] = self.run.steps
        if not with_steps or self.schedule_horizon != self.run.steps:
            run["schedule_steps"] = self.schedule_horizon
        d["run"] = run
        # the digest says what a peer's data holds, not its path (None: hash as before the key)
        del d["data"]["digest" if self.data.digest is None else "path"]
        del d["runtime"]  # how this peer connects is its own business
        for key in _LATER_MODEL_KEYS:
            if d["model"][key] == ModelConfig.model_fields[key].default:
                del d["model"][key]
        d["torch"] = ".".join(torch.__version__.split(".")[:2])
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def to_toml(self) -> str:
        return tomli_w.dumps(_drop_none(self.model_dump(mode="json")))

    @property
    def tokens_per_microbatch(self) -> int:
        return self.pipeline.microbatch_size * self.model.seq_len


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    """TOML has no null: an unset optional key is simply absent (and so takes its default)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out[k] = _drop_none(v)
        elif v is not None:
            out[k] = v
    return out


def _known_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys += _known_keys(ann, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


def _parse_value(text: str) -> Any:
    """A --set value is a TOML literal (3e-4, true, "x", [1, 2]); anything else is a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


# the names other trainers use for our keys' leaves: matched before edit distance, which would
# turn optim.learning_rate into optim.warmup_steps' neighbours rather than optim.lr
SYNONYMS = {
    "learning_rate": "lr",
    "lr_rate": "lr",
    "momentum": "beta1",
    "wd": "weight_decay",
    "clip": "grad_clip",
    "max_grad_norm": "grad_clip",
    "warmup": "warmup_steps",
    "layers": "n_layers",
    "num_layers": "n_layers",
    "num_hidden_layers": "n_layers",
    "hidden_size": "d_model",
    "num_heads": "n_heads",
    "num_attention_heads": "n_heads",
    "context_length": "seq_len",
    "block_size": "seq_len",
    "max_seq_len": "seq_len",
    "batch_size": "microbatch_size",
    "max_steps": "steps",
    "num_steps": "steps",
    "iterations": "steps",
    "pipeline_stages": "stages",
    "pp": "stages",
    "dp": "replicas",
    "data_parallel": "replicas",
}


def suggest_key(key: str, known: list[str]) -> str | None:
    """The known key a mistyped one most likely means: a synonym of its leaf in the same
    section, then the same leaf (or synonym) in another section, then the closest spelling."""
    *parents, leaf = key.split(".")
    section = ".".join(parents)
    for name in (SYNONYMS.get(leaf.lower(), leaf.lower()), leaf.lower()):
        if f"{section}.{name}" in known:
            return f"{section}.{name}"
        elsewhere = [k for k in known if k.rsplit(".", 1)[-1] == name]
        if len(elsewhere) == 1:
            return elsewhere[0]
    hint = difflib.get_close_matches(key, known, n=1)
    return hint[0] if hint else None


def _set_dotted(tree: dict[str, Any], key: str, value: Any, origin: str) -> None:
    known = _known_keys(Config)
    if key not in known:
        hint = suggest_key(key, known)
        fix = f"did you mean {hint}?" if hint else "see `meshtrain show-config` for the keys"
        raise ConfigError(f"{key}: unknown key (from {origin}); {fix}")
    *parents, leaf = key.split(".")
    node = tree
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value


def _flatten(tree: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for k, v in tree.items():
        if isinstance(v, dict):
            out += _flatten(v, f"{prefix}{k}.")
        else:
            out.append((f"{prefix}{k}", v))
    return out


def load_config(
    files: list[str | Path] | tuple[str | Path, ...] = (),
    overrides: list[str] | tuple[str, ...] = (),
) -> Config:
    """Resolve defaults < files < overrides into a frozen Config, or raise ConfigError."""
    tree: dict[str, Any] = {}
    for f in files:
        path = Path(f)
        if not path.is_file():
            raise ConfigError(
                f"--config {f}: no such file; pass a TOML file such as configs/tiny.toml"
            )
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"--config {f}: not valid TOML ({e})") from None
        for key, value in _flatten(data):
            _set_dotted(tree, key, value, str(f))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. --set grid.stages=4")
        key, text = item.split("=", 1)
        _set_dotted(tree, key.strip(), _parse_value(text.strip()), f"--set {item}")
    return config_from_dict(tree)


def config_from_dict(tree: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"]) or "config"
            got = (
                f" (got {err['input']!r})"
                if "input" in err and err["type"] != "value_error"
                else ""
            )
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"{loc}: {msg}{got}")
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines)) from None


def with_overrides(cfg: Config, overrides: dict[str, Any]) -> Config:
    """A copy of cfg with dotted keys replaced (used by benchmarks to derive each method)."""
    tree = cfg.model_dump(mode="json")
    for key, value in overrides.items():
        _set_dotted(tree, key, value, "override")
    return config_from_dict(tree)
