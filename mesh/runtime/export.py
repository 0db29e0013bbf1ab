"""A trained run as one whole model: the newest step every stage has a checkpoint of, assembled
from one replica's cells, written as a Hugging Face LlamaForCausalLM directory (config.json,
the weights in safetensors, the tokenizer's files) that `transformers` loads as it is.

The replica: 0 unless asked (replicas differ only by what averaging has not yet pulled
together; the run's final average is not stored anywhere). The step: resume_point's, so a torn
newest file falls back to the step before, as a resume would.

The weights are streamed: the shard files are planned from the stages' shapes (no weights),
then each stage's checkpoint is mapped in turn and its tensors written, so an export holds about
one shard file's worth (a llama-1b is 4.7 GB in fp32), never the whole model. A model larger
than the shard size is sharded as transformers shards its own (model-00001-of-00003.safetensors
and model.safetensors.index.json, which from_pretrained reads); a smaller one is one
model.safetensors.
"""

from __future__ import annotations

import json
import re
import shutil
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mesh.config import Config, ConfigError, ModelConfig, config_from_dict, load_config
from mesh.errors import CheckpointError
from mesh.hf_checkpoint import INDEX, WEIGHTS  # transformers' names: one file, or shards
from mesh.model.build import named_chunks, stage_module, stage_shapes
from mesh.model.hf import hf_config, hf_name, meshtrain_name, model_config_from_hf
from mesh.runtime.checkpoint import (
    MappedCheckpoint,
    checkpoint_path,
    newest_intact,
    read_checkpoint,
    resume_point,
    saved_steps,
)

PROVENANCE = "meshtrain.json"  # beside an export: the run's config and where the weights came from
SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}  # decimal, as transformers


def parse_size(size: str, option: str = "size") -> int:
    """Bytes of a size spelled as transformers' max_shard_size is ("5GB", "200MB", "1.5GB") or
    a plain number of bytes; ConfigError naming `option` otherwise."""
    text = size.strip().upper()
    unit = SIZE_UNITS.get(text[-2:], 1)
    try:
        value = float(text[:-2] if text[-2:] in SIZE_UNITS else text)
    except ValueError:
        raise ConfigError(
            f"{option} {size!r}: give bytes or a number with KB, MB, GB or TB (5GB, 200MB)"
        ) from None
    if not 0 < value * unit < float("inf"):
        raise ConfigError(f"{option} {size!r}: must be a positive, finite size")
    return max(1, int(value * unit))


# Smaller than transformers' own default (50GB; 5GB in v4), so a llama-1b (4.7 GB in fp32) is
# sharded and an export holds one 2 GB shard at most, not the whole model.
MAX_SHARD_SIZE = "2GB"
MAX_SHARD_BYTES = parse_size(MAX_SHARD_SIZE)


def run_config(run_dir: str | Path) -> Config:
    toml = Path(run_dir) / "config.toml"
    if not toml.is_file():
        raise ConfigError(f"{run_dir}: not a run directory (no config.toml)")
    return load_config([toml])


def export_step_checks(run_dir: str | Path, cfg: Config, replica: int) -> None:
    """The replica exists and every one of its stages has a checkpoint (CheckpointError
    naming the stage without one)."""
    if not 0 <= replica < cfg.grid.replicas:
        raise ConfigError(f"--replica {replica}: the run has replicas 0..{cfg.grid.replicas - 1}")
    for j in range(cfg.grid.stages):
        if not saved_steps(run_dir, j, replica):
            raise CheckpointError(
                f"{run_dir}: stage {j} of replica {replica} has no checkpoint (the run's "
                f"checkpoints/{j}-{replica}/ is empty or missing); export needs every stage"
            )


def export_step(run_dir: str | Path, cfg: Config, replica: int) -> int:
    """The newest step every stage of `replica` has an intact checkpoint of, or CheckpointError
    naming the stage without one, or the steps when the stages share none."""
    export_step_checks(run_dir, cfg, replica)
    cells = [(j, replica) for j in range(cfg.grid.stages)]
    point = resume_point(run_dir, cells, cfg.state_fingerprint())
    if point.step is None:
        held = "; ".join(f"stage {j}: steps {saved_steps(run_dir, j, i)}" for j, i in cells)
        unusable = len(point.damaged + point.foreign)
        why = f" ({unusable} unusable files)" if unusable else ""
        raise CheckpointError(
            f"{run_dir}: the stages of replica {replica} share no intact checkpoint step{why} "
            f"({held}); resume the run so every stage saves the same step, or export another "
            "replica"
        )
    return point.step


def export_steps(run_dir: str | Path, cfg: Config, replica: int) -> list[int]:
    """Each stage's step the export reads: export_step's for every stage of a fixed grid; for
    stage pools, whose cells take different numbers of updates (mesh/runtime/pool.py), each
    stage's newest intact checkpoint of the replica's cell, as a pooled resume takes it."""
    if not cfg.pipeline.pooled:
        return [export_step(run_dir, cfg, replica)] * cfg.grid.stages
    export_step_checks(run_dir, cfg, replica)
    fp = cfg.state_fingerprint()
    steps = [newest_intact(run_dir, j, replica, fp) for j in range(cfg.grid.stages)]
    missing = [j for j, s in enumerate(steps) if s is None]
    if missing:
        raise CheckpointError(
            f"{run_dir}: stage {missing[0]} of replica {replica} has no intact checkpoint; "
            "export needs every stage"
        )
    return [s for s in steps if s is not None]


def stage_weights(path: Path, shapes: dict[str, tuple[int, ...]]) -> MappedCheckpoint:
    """A stage's checkpoint, mapped (its weights not yet read), once its weight vector is known
    to fit the stage's shapes."""
    mapped = read_checkpoint(path)
    flat = mapped.state.get("flat") if isinstance(mapped.state, dict) else None
    n = sum(torch.Size(s).numel() for s in shapes.values())
    if not isinstance(flat, torch.Tensor) or flat.shape != (n,):
        got = tuple(flat.shape) if isinstance(flat, torch.Tensor) else None
        raise CheckpointError(f"{path}: weights of shape {got} do not fit this run's model ({n})")
    return mapped


def per_stage(step: int | Sequence[int], stages: int) -> list[int]:
    """One step for every stage (a fixed grid's), or each stage's own (stage pools)."""
    steps = [step] * stages if isinstance(step, int) else list(step)
    assert len(steps) == stages, (steps, stages)
    return steps


def run_weights(
    run_dir: str | Path, cfg: Config, replica: int, step: int | Sequence[int]
) -> dict[str, torch.Tensor]:
    """The whole model's weights (global names) at `step` (or each stage's), stage by stage."""
    out: dict[str, torch.Tensor] = {}
    steps = per_stage(step, cfg.grid.stages)
    for j in range(cfg.grid.stages):
        shapes = stage_shapes(cfg.model, cfg.grid.stages, j)
        mapped = stage_weights(checkpoint_path(run_dir, j, replica, steps[j]), shapes)
        for name, t in named_chunks(mapped.state["flat"], shapes):
            out[name] = t.clone()
            mapped.release(t)
    return out


@dataclass(frozen=True)
class PlannedTensor:
    stage: int
    name: str  # the global meshtrain name (hf_name gives the file's)
    shape: tuple[int, ...]
    nbytes: int


def shard_plan(
    cfg: ModelConfig, n_stages: int, max_shard_bytes: int, itemsize: int = 4
) -> list[list[PlannedTensor]]:
    """The model's tensors (stage by stage, each stage in module order) cut into shard files as
    transformers cuts a state dict: in order, a new shard when the next tensor would take the
    current one past max_shard_bytes (a tensor larger than that gets a shard of its own). From
    shapes only: nothing is read."""
    shards: list[list[PlannedTensor]] = [[]]  # itemsize 4: the cells' fp32 masters
    size = 0
    for j in range(n_stages):
        for name, shape in stage_shapes(cfg, n_stages, j).items():
            nbytes = torch.Size(shape).numel() * itemsize
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(PlannedTensor(j, name, shape, nbytes))
            size += nbytes
    return shards


def shard_names(n_shards: int) -> list[str]:
    """The files of n shards, named as transformers names them."""
    if n_shards == 1:
        return [WEIGHTS]
    return [f"model-{k:05d}-of-{n_shards:05d}.safetensors" for k in range(1, n_shards + 1)]


def write_weights(
    run_dir: str | Path,
    cfg: Config,
    replica: int,
    step: int | Sequence[int],
    out: Path,
    max_shard_bytes: int,
) -> int:
    """Write the weights of `step` into `out` as shard_plan cuts them, one stage's checkpoint
    mapped at a time: a shard is written as soon as its last tensor is mapped, and only the
    part of a shard that began in an earlier stage is held as a copy (at most one shard).
    Returns the number of parameters."""
    from safetensors.torch import save_file

    P = cfg.grid.stages
    paths = [checkpoint_path(run_dir, j, replica, s) for j, s in enumerate(per_stage(step, P))]
    shapes = [stage_shapes(cfg.model, P, j) for j in range(P)]
    for path, stage in zip(paths, shapes, strict=True):  # all checked before a file is written
        stage_weights(path, stage)
    plan = shard_plan(cfg.model, P, max_shard_bytes)
    files = shard_names(len(plan))
    for old in out.iterdir():  # an earlier export's weights would be read instead of these
        if old.name in (WEIGHTS, INDEX) or SHARD.fullmatch(old.name):
            old.unlink()
    shard = 0  # the next shard to write
    copied: dict[str, torch.Tensor] = {}  # its tensors from earlier stages (HF name -> copy)
    for j in range(P):
        mapped = stage_weights(paths[j], shapes[j])
        views: dict[str, torch.Tensor] = {}  # its tensors from this stage (views of the map)
        for name, view in named_chunks(mapped.state["flat"], shapes[j]):
            views[hf_name(name)] = view
            if len(copied) + len(views) == len(plan[shard]):
                save_file({**copied, **views}, out / files[shard], metadata={"format": "pt"})
                for written in views.values():
                    mapped.release(written)
                shard, copied, views = shard + 1, {}, {}
        for hf, view in views.items():  # the open shard goes on in the next stage
            copied[hf] = view.clone()
            mapped.release(view)
        del mapped, views  # the stage's map goes before the next one's comes
    assert shard == len(plan) and not copied, "every planned shard was written"
    params = sum(torch.Size(t.shape).numel() for s in plan for t in s)
    if len(plan) > 1:
        total = sum(t.nbytes for s in plan for t in s)
        weight_map = {hf_name(t.name): files[k] for k, s in enumerate(plan) for t in s}
        index = {
            "metadata": {"total_parameters": params, "total_size": total},
            "weight_map": weight_map,
        }
        (out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return params


@dataclass(frozen=True)
class Exported:
    out: Path
    step: int
    replica: int
    params: int
    files: list[str]


def export_run(
    run_dir: str | Path,
    out: str | Path,
    replica: int = 0,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Exported:
    """Write the run's newest complete step as a LlamaForCausalLM directory at `out`, with the
    files of the run's tokenizer (none for bytes); weights past max_shard_bytes are sharded."""
    from mesh.data.tokenizer import load_tokenizer

    cfg = run_config(run_dir)
    if cfg.model.arch != "llama":
        raise ConfigError(
            f"{run_dir}: model.arch = {cfg.model.arch!r}; export writes Hugging Face "
            "LlamaForCausalLM, so it needs a llama run (--config configs/models/llama-20m.toml)"
        )
    check_boundary_exports(run_dir, cfg)
    steps = export_steps(run_dir, cfg, replica)
    step = steps[0]  # a fixed grid's one step; stage pools: the stream's (stage 0's)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    params = write_weights(run_dir, cfg, replica, steps, out, max_shard_bytes)
    tokenizer = load_tokenizer(cfg.data.path)
    config = hf_config(cfg.model, tokenizer.eot_id)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in tokenizer.files():
        shutil.copy2(f, out / Path(f).name)
    provenance = {
        "run_dir": str(Path(run_dir).resolve()),
        "step": step,
        **({"stage_steps": steps} if len(set(steps)) > 1 else {}),
        "replica": replica,
        "fingerprint": cfg.fingerprint(),
        "config": cfg.to_toml(),
    }
    (out / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
    files = sorted(p.name for p in out.iterdir())
    return Exported(out, step, replica, params, files)


def check_boundary_exports(run_dir: str | Path, cfg: Config) -> None:
    """A compressed boundary's model as one Llama: the fixed subspace's stages compose to a
    plain Llama (its weights keep the residual stream in E0[x] + span(U), where the rebuild is
    exact: mesh/algo/boundary.py), so it exports as one. A learned boundary's rebuild
    D_j U_j^T (h - a_s(x)) + a_r(x) is a rank-r map of the residual stream between two blocks,
    which LlamaForCausalLM cannot express: such a run is refused, with the way out."""
    if cfg.pipeline.boundary == "learned":
        raise ConfigError(
            f"{run_dir}: pipeline.boundary = 'learned' rebuilds the residual stream through a "
            "rank-r map between stages, which a LlamaForCausalLM cannot hold (its validation, "
            "through the stages as trained, is in the run's val.jsonl); train a run to export "
            "with pipeline.boundary='subspace' (a plain Llama) or 'full'"
        )


def weight_files(export_dir: Path) -> list[Path] | None:
    """The safetensors files of an export (transformers' order of preference: one
    model.safetensors, else the shards its index names), or None when it has neither."""
    if (export_dir / WEIGHTS).is_file():
        return [export_dir / WEIGHTS]
    if not (export_dir / INDEX).is_file():
        return None
    try:
        weight_map = json.loads((export_dir / INDEX).read_text())["weight_map"]
        files = [export_dir / f for f in sorted(set(weight_map.values()))]
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{export_dir}: {INDEX} is not a safetensors index ({e})") from None
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ConfigError(f"{export_dir}: {INDEX} names shard {missing[0]}, which is missing")
    return files


def load_export(export_dir: str | Path) -> tuple[Config, nn.Module]:
    """A whole model from an export directory (ours, or any LlamaForCausalLM in safetensors):
    the config from meshtrain.json when present, else from config.json."""
    from safetensors.torch import load_file

    d = Path(export_dir)
    files = weight_files(d)
    if files is None or not (d / "config.json").is_file():
        raise ConfigError(
            f"{d}: neither a run directory (config.toml) nor an export (config.json + "
            f"{WEIGHTS} or {INDEX})"
        )
    if (d / PROVENANCE).is_file():
        cfg = config_from_dict(tomllib.loads(json.loads((d / PROVENANCE).read_text())["config"]))
    else:
        hf = json.loads((d / "config.json").read_text())
        cfg = config_from_dict({"model": model_config_from_hf(hf), "grid": {"stages": 1}})
    state = {meshtrain_name(k): v for f in files for k, v in load_file(f).items()}
    return cfg, whole_model(cfg, state)


def whole_model(cfg: Config, state: dict[str, torch.Tensor]) -> nn.Module:
    """The one-stage model holding these weights (built on the meta device, weights assigned)."""
    model = stage_module(cfg.model, range(cfg.model.n_layers), True, True)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def load_for_sampling(source: str | Path, replica: int = 0) -> tuple[Config, nn.Module, Any, str]:
    """(config, whole model, tokenizer, where the weights came from) of a run directory (its
    newest complete step, as export takes it) or of an export directory."""
    from mesh.data.tokenizer import load_tokenizer

    d = Path(source)
    if (d / "config.toml").is_file():
        cfg = run_config(d)
        check_boundary_exports(d, cfg)
        steps = export_steps(d, cfg, replica)
        model = whole_model(cfg, run_weights(d, cfg, replica, steps))
        at = f"step {steps[0]}" if len(set(steps)) == 1 else f"stage steps {steps}"
        return cfg, model, load_tokenizer(cfg.data.path), f"{at} of replica {replica}"
    cfg, model = load_export(d)
    return cfg, model, export_tokenizer(d), "export"


def export_tokenizer(export_dir: Path) -> Any:
    """The tokenizer an export carries (its tokenizer.json), else bytes (with the end-of-text
    token 256 when config.json names it, as a prepared byte dataset has)."""
    from mesh.data.tokenizer import ByteTokenizer, HFTokenizer

    if (export_dir / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(export_dir / "tokenizer.json"))
        return HFTokenizer(tok, "tokenizer.json", export_dir)
    hf = json.loads((export_dir / "config.json").read_text())
    return ByteTokenizer(eot=hf.get("eos_token_id") == 256)
