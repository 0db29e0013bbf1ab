"""A trained run as one whole model: the newest step every stage has a checkpoint of, assembled
from one replica's cells, written as a Hugging Face LlamaForCausalLM directory (config.json,
model.safetensors, the tokenizer's files) that `transformers` loads as it is.

The replica: 0 unless asked (replicas differ only by what averaging has not yet pulled
together; the run's final average is not stored anywhere). The step: resume_point's, so a torn
newest file falls back to the step before, as a resume would.
"""

from __future__ import annotations

import json
import shutil
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mesh.config import Config, ConfigError, config_from_dict, load_config
from mesh.errors import CheckpointError
from mesh.model.build import named_chunks, stage_module, stage_shapes
from mesh.model.hf import hf_config, hf_name, meshtrain_name, model_config_from_hf
from mesh.runtime.checkpoint import checkpoint_path, resume_point, saved_steps

PROVENANCE = "meshtrain.json"  # beside an export: the run's config and where the weights came from


def run_config(run_dir: str | Path) -> Config:
    toml = Path(run_dir) / "config.toml"
    if not toml.is_file():
        raise ConfigError(f"{run_dir}: not a run directory (no config.toml)")
    return load_config([toml])


def export_step(run_dir: str | Path, cfg: Config, replica: int) -> int:
    """The newest step every stage of `replica` has an intact checkpoint of, or CheckpointError
    naming the stage without one, or the steps when the stages share none."""
    if not 0 <= replica < cfg.grid.replicas:
        raise ConfigError(f"--replica {replica}: the run has replicas 0..{cfg.grid.replicas - 1}")
    cells = [(j, replica) for j in range(cfg.grid.stages)]
    for j, i in cells:
        if not saved_steps(run_dir, j, i):
            raise CheckpointError(
                f"{run_dir}: stage {j} of replica {i} has no checkpoint (the run's "
                f"checkpoints/{j}-{i}/ is empty or missing); export needs every stage"
            )
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


def run_weights(
    run_dir: str | Path, cfg: Config, replica: int, step: int
) -> dict[str, torch.Tensor]:
    """The whole model's weights (global names) at `step`, read stage by stage."""
    out: dict[str, torch.Tensor] = {}
    for j in range(cfg.grid.stages):
        path = checkpoint_path(run_dir, j, replica, step)
        state = torch.load(path, map_location="cpu", weights_only=True)
        shapes = stage_shapes(cfg.model, cfg.grid.stages, j)
        try:
            out.update((n, t.clone()) for n, t in named_chunks(state["flat"], shapes))
        except ValueError as e:
            raise CheckpointError(f"{path}: does not fit this run's model ({e})") from None
    return out


@dataclass(frozen=True)
class Exported:
    out: Path
    step: int
    replica: int
    params: int
    files: list[str]


def export_run(run_dir: str | Path, out: str | Path, replica: int = 0) -> Exported:
    """Write the run's newest complete step as a LlamaForCausalLM directory at `out`, with the
    files of the run's tokenizer (none for bytes)."""
    from safetensors.torch import save_file

    from mesh.data.tokenizer import load_tokenizer

    cfg = run_config(run_dir)
    if cfg.model.arch != "llama":
        raise ConfigError(
            f"{run_dir}: model.arch = {cfg.model.arch!r}; export writes Hugging Face "
            "LlamaForCausalLM, so it needs a llama run (--config configs/models/llama-20m.toml)"
        )
    step = export_step(run_dir, cfg, replica)
    weights = run_weights(run_dir, cfg, replica, step)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({hf_name(n): t.contiguous() for n, t in weights.items()},
              out / "model.safetensors", metadata={"format": "pt"})  # fmt: skip
    tokenizer = load_tokenizer(cfg.data.path)
    config = hf_config(cfg.model, tokenizer.eot_id)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in tokenizer.files():
        shutil.copy2(f, out / Path(f).name)
    provenance = {
        "run_dir": str(Path(run_dir).resolve()),
        "step": step,
        "replica": replica,
        "fingerprint": cfg.fingerprint(),
        "config": cfg.to_toml(),
    }
    (out / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
    files = sorted(p.name for p in out.iterdir())
    return Exported(out, step, replica, sum(t.numel() for t in weights.values()), files)


def load_export(export_dir: str | Path) -> tuple[Config, nn.Module]:
    """A whole model from an export directory (ours, or any LlamaForCausalLM in safetensors):
    the config from meshtrain.json when present, else from config.json."""
    from safetensors.torch import load_file

    d = Path(export_dir)
    if not (d / "model.safetensors").is_file() or not (d / "config.json").is_file():
        raise ConfigError(
            f"{d}: neither a run directory (config.toml) nor an export (config.json + "
            "model.safetensors)"
        )
    if (d / PROVENANCE).is_file():
        cfg = config_from_dict(tomllib.loads(json.loads((d / PROVENANCE).read_text())["config"]))
    else:
        hf = json.loads((d / "config.json").read_text())
        cfg = config_from_dict({"model": model_config_from_hf(hf), "grid": {"stages": 1}})
    state = {meshtrain_name(k): v for k, v in load_file(d / "model.safetensors").items()}
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
        step = export_step(d, cfg, replica)
        model = whole_model(cfg, run_weights(d, cfg, replica, step))
        return cfg, model, load_tokenizer(cfg.data.path), f"step {step} of replica {replica}"
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
