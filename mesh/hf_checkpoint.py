"""A Hugging Face `LlamaForCausalLM` directory's files, read for model.init_from.

`hf_model_keys` reads its config.json into model.* keys (what a config leaves unset is taken
from it; what it sets must agree: mesh.config), `weights_digest` is the weights' identity for the
run's fingerprint (a path says nothing about what a peer's copy holds), and `weight_files` says
which safetensors file holds each tensor (sharded or not). The tensors themselves are read by
mesh.model.hf_import, a stage's own only.

imports: stdlib and safetensors (its header only); no torch, no transformers.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

WEIGHTS = "model.safetensors"  # transformers' names: one file, or shards and their index
INDEX = "model.safetensors.index.json"  # (meshtrain export writes the same)


class HFImportError(ValueError):
    """A directory that is not a LlamaForCausalLM meshtrain can start from (a user error)."""


def _config_json(path: Path) -> dict[str, Any]:
    try:
        cfg = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise HFImportError(
            f"model.init_from = {str(path)!r}: no config.json (a Hugging Face model directory "
            "holds config.json and model.safetensors)"
        ) from None
    except (OSError, ValueError) as e:
        raise HFImportError(
            f"model.init_from = {str(path)!r}: config.json unreadable ({e})"
        ) from None
    if not isinstance(cfg, dict):
        raise HFImportError(f"model.init_from = {str(path)!r}: config.json is not an object")
    return cfg


def hf_model_keys(path: str | Path) -> dict[str, Any]:
    """model.* keys of a LlamaForCausalLM directory's config.json (model_keys_of)."""
    p = Path(path)
    return model_keys_of(_config_json(p), f"model.init_from = {str(p)!r}")


def model_keys_of(c: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """model.* keys of a LlamaForCausalLM's config.json (all but seq_len: a run's context is its
    own); HFImportError, naming `where`, for what meshtrain's llama does not compute the same
    way (biases, rope scaling, another activation) or a config.json that lacks a key."""
    if "LlamaForCausalLM" not in (c.get("architectures") or []) and c.get("model_type") != "llama":
        raise HFImportError(
            f"{where}: not a LlamaForCausalLM (architectures {c.get('architectures')}, "
            f"model_type {c.get('model_type')!r})"
        )
    unsupported = {
        "hidden_act": (c.get("hidden_act", "silu"), "silu"),
        "attention_bias": (bool(c.get("attention_bias", False)), False),
        "mlp_bias": (bool(c.get("mlp_bias", False)), False),
        "rope_scaling": (c.get("rope_scaling"), None),
    }
    for key, (got, want) in unsupported.items():
        if got != want:
            raise HFImportError(f"{where}: {key} = {got!r}; meshtrain's llama has {want!r}")
    try:
        d, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
        # the rotary base: v4's rope_theta, or v5's rope_parameters
        rope = (c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta", 10000.0))
        keys = {
            "arch": "llama",
            "vocab_size": int(c["vocab_size"]),
            "d_model": d,
            "n_layers": int(c["num_hidden_layers"]),
            "n_heads": heads,
            "n_kv_heads": int(c.get("num_key_value_heads") or heads),
            "intermediate_size": int(c["intermediate_size"]),
            "norm_eps": float(c.get("rms_norm_eps", 1e-5)),
            "rope_theta": float(rope),
        }
    except (KeyError, TypeError, ValueError) as e:
        raise HFImportError(f"{where}: config.json lacks or garbles {e}") from None
    if int(c.get("head_dim") or d // heads) * heads != d:
        raise HFImportError(f"{where}: head_dim x heads != hidden_size; meshtrain needs equality")
    return keys


def tied(path: str | Path) -> bool:
    return bool(_config_json(Path(path)).get("tie_word_embeddings", False))


def weight_files(path: str | Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it."""
    p = Path(path)
    if (p / INDEX).is_file():
        try:
            weight_map = json.loads((p / INDEX).read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise HFImportError(f"model.init_from = {str(p)!r}: {INDEX} unreadable ({e})") from None
        return {name: p / file for name, file in weight_map.items()}
    if (p / WEIGHTS).is_file():
        from safetensors import safe_open

        with safe_open(str(p / WEIGHTS), framework="pt") as f:
            return {name: p / WEIGHTS for name in f.keys()}  # noqa: SIM118 - not a dict
    raise HFImportError(
        f"model.init_from = {str(p)!r}: no {WEIGHTS} or {INDEX} (only safetensors weights are "
        "read; convert a .bin checkpoint with transformers' save_pretrained)"
    )


def weights_digest(path: str | Path) -> str:
    """sha256 of config.json and every weight file's bytes, in name order: the same weights
    anywhere give the same digest (read once, when a run's config is made)."""
    p = Path(path)
    h = hashlib.sha256(json.dumps(_config_json(p), sort_keys=True).encode())
    for file in sorted(set(weight_files(p).values())):
        h.update(file.name.encode())
        with file.open("rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()[:16]
