"""The one typed run config: schema with defaults, TOML files, --set overrides, fingerprint.

Precedence: schema defaults < --config files (left to right) < --set key=value (left to right).
Every user mistake becomes a ConfigError naming the dotted key and the fix; the CLI prints it and
exits 2. Imports: pydantic, tomllib (no comms, no cli).
"""

from __future__ import annotations

import hashlib
import json
import math
import tomllib
from pathlib import Path
from typing import Any

import tomli_w
from pydantic import BaseModel, ValidationError, model_validator

from mesh.config_keys import REMOVED_KEYS, is_removed, move_old_keys, moved_to, suggest_key
from mesh.config_local import (  # noqa: F401 - the sections are part of this module's API
    LOCAL_PREFIXES,
    LOCAL_SECTIONS,
    MOVED_KEYS,
    CheckpointConfig,
    ElasticConfig,
    EmulationConfig,
    FaultsConfig,
    MetricsConfig,
    RuntimeConfig,
    SentinelConfig,
    TransportConfig,
)
from mesh.config_sections import (  # noqa: F401 - the sections are part of this module's API
    HASHED_AWAY_AT,
    LATER_KEYS,
    SECTIONS,
    ConfigError,
    DataConfig,
    DPConfig,
    GridConfig,
    ModelConfig,
    OptimConfig,
    PipelineConfig,
    RunConfig,
    _Section,
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
    """emulation.slowdowns ["s2r0=2.0", ...] -> {(stage, replica): factor}; ValueError naming
    the key and the entry when a cell is not in the grid, repeated, or a factor is not > 0."""
    return parse_cell_factors(items, stages, replicas, "emulation.slowdowns", positive=True)


def parse_cell_factors(
    items: list[str], stages: int, replicas: int, key: str, positive: bool = False
) -> dict[tuple[int, int], float]:
    """Per-cell factors ["sJrI=FACTOR", ...] of config `key` -> {(stage, replica): factor};
    ValueError naming the key and the entry when a cell is not in the grid, repeated, or a
    factor is not finite (not > 0 with `positive`)."""
    from mesh.algo.topology import Place

    out: dict[tuple[int, int], float] = {}
    for item in items:
        name, eq, value = str(item).partition("=")
        place, factor = Place.parse(name.strip()), None
        if place is not None and eq:
            try:
                factor = float(value.strip())
            except ValueError:
                factor = None
        if place is None or factor is None:
            raise ValueError(f"{key} entry {item!r}: expected 'sJrI=FACTOR', e.g. 's2r0=2.0'")
        j, i = place.stage, place.replica
        if not (0 <= j < stages and 0 <= i < replicas):
            raise ValueError(
                f"{key} entry {item!r}: cell {place} is not in the "
                f"{stages}x{replicas} grid (stages s0..s{stages - 1}, replicas r0..r{replicas - 1})"
            )
        if not math.isfinite(factor) or (positive and factor <= 0):
            must = "> 0" if positive else "finite"
            raise ValueError(f"{key} entry {item!r}: the factor must be {must}")
        if (j, i) in out:
            raise ValueError(f"{key} lists cell {place} twice")
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
    # each peer's own (mesh/config_local.py): outside the fingerprint
    transport: TransportConfig = TransportConfig()
    elastic: ElasticConfig = ElasticConfig()
    emulation: EmulationConfig = EmulationConfig()
    faults: FaultsConfig = FaultsConfig()
    sentinel: SentinelConfig = SentinelConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    metrics: MetricsConfig = MetricsConfig()
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

    @model_validator(mode="before")
    @classmethod
    def _from_the_init(cls, tree: Any) -> Any:
        """model.init_from: the Hugging Face model's config.json gives the model keys a config
        leaves unset (one it sets must agree), and its weights' digest the run's identity of
        them (computed once: a run's config.toml carries it)."""
        from mesh.hf_checkpoint import hf_model_keys, weights_digest

        model = tree.get("model") if isinstance(tree, dict) else None
        if not isinstance(model, dict) or not model.get("init_from"):
            return tree
        path = model["init_from"]
        theirs = hf_model_keys(path)
        for key, value in theirs.items():
            if key in model and model[key] != value:
                raise ValueError(
                    f"model.{key} = {model[key]!r}, but model.init_from's config.json has "
                    f"{value!r}; drop model.{key} (it is taken from there)"
                )
        digest = model.get("init_digest") or weights_digest(path)
        return {**tree, "model": {**theirs, **model, "init_digest": digest}}

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
        if self.dp.subset_block > 1 and (self.dp.selector, self.dp.index_map) != (
            "partition",
            "keyed",
        ):
            raise ValueError(
                f"dp.subset_block = {self.dp.subset_block} needs dp.selector = 'partition' and "
                "dp.index_map = 'keyed'; set those or dp.subset_block=1"
            )
        parse_slowdowns(self.emulation.slowdowns, g.stages, g.replicas)
        from mesh.algo.routing import parse_deaths

        parse_deaths(self.emulation.deaths, g.stages, g.replicas)
        if p.pooled and p.schedule != "async":
            raise ValueError(
                f"pipeline.routing = 'pools' needs pipeline.schedule = 'async' (got "
                f"{p.schedule!r}): a pooled microbatch's path is drawn when it leaves a stage, "
                "so no flushed batch spans a fixed chain; set pipeline.schedule='async' or "
                "pipeline.routing='fixed'"
            )
        if 0 < p.pool_affinity < 1:
            raise ValueError(
                f"pipeline.pool_affinity = {p.pool_affinity}: 0 (off) or a ratio >= 1 (stay on "
                "the own replica's cell unless its time per microbatch is more than this x the "
                "best other's), e.g. 1.5"
            )
        parse_cell_factors(self.faults.poison, g.stages, g.replicas, "faults.poison")
        from mesh.algo.pipeline_poison import parse_pipeline_poison

        parse_pipeline_poison(self.faults.pipeline_poison, g.stages, g.replicas)
        from mesh.algo.robust import ROBUST_MIN_MEMBERS

        if self.dp.aggregate != "mean" and g.replicas < ROBUST_MIN_MEMBERS:
            raise ValueError(
                f"dp.aggregate = {self.dp.aggregate!r} needs grid.replicas >= "
                f"{ROBUST_MIN_MEMBERS} (got {g.replicas}): with fewer there is no majority to "
                "keep; set dp.aggregate='mean' (dp.outlier_k works for any replicas)"
            )
        if isinstance(p.window, list):
            from mesh.algo.schedule import validate_window

            validate_window(p.schedule, g.stages, p.window)
        _check_arch(m)
        if p.boundary != "full":
            if m.arch != "llama":
                raise ValueError(
                    f"pipeline.boundary = {p.boundary!r} needs model.arch = 'llama' (the byte "
                    "GPT's learned positions write outside any subspace); set model.arch='llama' "
                    "or pipeline.boundary='full'"
                )
            if p.boundary_rank > m.d_model:
                raise ValueError(
                    f"pipeline.boundary_rank ({p.boundary_rank}) > model.d_model ({m.d_model}): "
                    "a boundary sends at most d_model coordinates per token; lower it"
                )
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

    def effective(self) -> Config:
        """This config with optim.depth_rule resolved (mesh/depth_rule.py): the optimizer keys
        the rule for this depth sets where the config leaves them at their defaults. What the
        cells train with, `plan` counts and `show-config` shows; the config itself keeps what
        was asked, so a later change of depth resolves again."""
        changes = self.depth_rule_settings()
        if not changes:
            return self
        return self.model_copy(update={"optim": self.optim.model_copy(update=changes)})

    def depth_rule_settings(self) -> dict[str, Any]:
        """The optim keys (without the section) optim.depth_rule sets on this config."""
        from mesh.depth_rule import resolved_settings

        if self.optim.depth_rule == "off":
            return {}
        defaults = {k: f.default for k, f in OptimConfig.model_fields.items()}
        return resolved_settings(
            self.optim.model_dump(),
            defaults,
            self.grid.stages,
            self.pipeline.schedule,
            d_model=self.model.d_model,
        )

    def depth_rule_line(self) -> str:
        """One line on what optim.depth_rule does to this config."""
        from mesh.depth_rule import describe

        return describe(
            self.optim.depth_rule,
            self.depth_rule_settings(),
            self.grid.stages,
            self.pipeline.schedule,
            self.optim.name,
        )

    def _hash(self, with_steps: bool) -> str:
        import torch

        # the numbers a run trains: the depth rule's resolved keys, not the switch that chose
        # them (a config that spells them out hashes the same)
        d = self.effective().model_dump(mode="json")
        del d["optim"]["depth_rule"]
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
        for section in LOCAL_SECTIONS:  # how this peer connects, saves, ... is its own business
            del d[section]
        del d["model"]["init_from"]  # a path: init_digest says what the weights are
        if self.dp.codec == "fp32":  # lossless: the feedback changes no number, so no run
            d["dp"]["payload_error_feedback"] = HASHED_AWAY_AT[("dp", "payload_error_feedback")]
        # the index map only picks the coordinates of partition rounds short of everything:
        # without such rounds it changes no number, so those runs keep their hash
        averaging = self.dp.mode == "param_avg" and self.grid.replicas > 1
        if not averaging or self.dp.selector != "partition" or self.dp.fraction >= 1:
            d["dp"]["index_map"] = HASHED_AWAY_AT[("dp", "index_map")]
            d["dp"]["subset_block"] = 1
        # replica affinity steers only a pool's draws by load: fixed wiring and seeded pools
        # (each path known whole) never read it, so their runs keep their hash at any default
        from mesh.algo import routes

        route = routes.of(self.pipeline)
        if not route.pooled or route.seeded:
            d["pipeline"]["pool_affinity"] = HASHED_AWAY_AT[("pipeline", "pool_affinity")]
        # a full boundary reads neither rank; the fixed subspace has no anchors
        if self.pipeline.boundary == "full":
            d["pipeline"]["boundary_rank"] = PipelineConfig.model_fields["boundary_rank"].default
        if self.pipeline.boundary != "learned":
            d["pipeline"]["anchor_rank"] = PipelineConfig.model_fields["anchor_rank"].default
        for section, keys in LATER_KEYS.items():
            for key in keys:
                default = SECTIONS[section].model_fields[key].default
                if d[section][key] == HASHED_AWAY_AT.get((section, key), default):
                    del d[section][key]
        d["torch"] = ".".join(torch.__version__.split(".")[:2])
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def to_toml(self) -> str:
        return tomli_w.dumps(_drop_none(self.model_dump(mode="json")))

    @property
    def boundary_width(self) -> int:
        """Values per token that cross a stage boundary (mesh/algo/boundary.py)."""
        p = self.pipeline
        return self.model.d_model if p.boundary == "full" else p.boundary_rank

    @property
    def boundary_shape(self) -> tuple[int, int, int]:
        """The (B, T, width) tensor of one activation message (and of its gradient)."""
        return (self.pipeline.microbatch_size, self.model.seq_len, self.boundary_width)

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


def _set_dotted(tree: dict[str, Any], key: str, value: Any, origin: str) -> None:
    if is_removed(key, value, origin):
        return
    if key in MOVED_KEYS:
        for new in moved_to(key, origin):
            _set_dotted(tree, new, value, origin)
        return
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
            data = tomllib.loads(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"--config {f}: not UTF-8 text (byte {e.start}); save it as UTF-8 TOML"
            ) from None
        except OSError as e:
            raise ConfigError(f"--config {f}: cannot be read ({e.strerror})") from None
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
    for key in REMOVED_KEYS:  # a tree from an older peer or file
        section, leaf = key.split(".")
        node = tree.get(section)
        if isinstance(node, dict) and leaf in node and is_removed(key, node[leaf], "config"):
            tree = {**tree, section: {k: v for k, v in node.items() if k != leaf}}
    tree = move_old_keys(tree)
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
        if len(lines) == 1:  # one line, the key first, as every other user error
            raise ConfigError(lines[0]) from None
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines)) from None


def with_overrides(cfg: Config, overrides: dict[str, Any]) -> Config:
    """A copy of cfg with dotted keys replaced (used by benchmarks to derive each method)."""
    tree = cfg.model_dump(mode="json")
    for key, value in overrides.items():
        _set_dotted(tree, key, value, "override")
    return config_from_dict(tree)
