"""A Hugging Face `LlamaForCausalLM` directory as a stage's initial weights (model.init_from):
the tensors of the stage's own layers only, read lazily from the safetensors files (sharded or
not), so a peer never reads the other stages' weights. The directory's config and digest are
mesh.hf_checkpoint's.

imports: safetensors, torch, mesh.hf_checkpoint, mesh.model.hf (names); no transformers.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from mesh.hf_checkpoint import HFImportError, tied, weight_files
from mesh.model.hf import hf_name


def load_stage(module: nn.Module, path: str | Path) -> int:
    """Copy this stage's tensors (global meshtrain names) from the HF directory into `module`;
    parameters with no HF counterpart (a learned boundary's anchors) keep their init. Returns
    the number of values read. Only this stage's tensors are read from disk."""
    from safetensors import safe_open

    files = weight_files(path)
    tie = tied(path)
    wanted: dict[Path, list[tuple[str, torch.Tensor]]] = {}
    for name, param in module.named_parameters():
        try:
            hf = hf_name(name)
        except KeyError:
            continue  # not a llama weight (boundary anchors): the run's own init
        if hf == "lm_head.weight" and hf not in files and tie:
            hf = "model.embed_tokens.weight"
        if hf not in files:
            raise HFImportError(f"model.init_from = {str(path)!r}: no tensor {hf}")
        wanted.setdefault(files[hf], []).append((hf, param))
    read = 0
    with torch.no_grad():
        for file, params in wanted.items():
            with safe_open(str(file), framework="pt") as f:
                for hf, param in params:
                    t = f.get_tensor(hf)
                    if tuple(t.shape) != tuple(param.shape):
                        raise HFImportError(
                            f"model.init_from: {hf} has shape {tuple(t.shape)}, this run's "
                            f"model {tuple(param.shape)}: the model section disagrees with it"
                        )
                    param.copy_(t.to(param.dtype))
                    read += t.numel()
    return read
