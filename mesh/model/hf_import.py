"""A Hugging Face `LlamaForCausalLM` directory as a stage's initial weights (model.init_from):
the tensors of the stage's own layers only, read from the safetensors files (sharded or
not), so a peer never reads the other stages' weights. The directory's config and digest are
mesh.hf_checkpoint's.

imports: torch, mesh.hf_checkpoint, mesh.model.hf (names); no transformers.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn

from mesh.hf_checkpoint import HFImportError, tied, weight_files
from mesh.model.hf import hf_name


def load_stage(module: nn.Module, path: str | Path) -> int:
    """Copy this stage's tensors (global meshtrain names) from the HF directory into `module`;
    parameters with no HF counterpart (a learned boundary's anchors) keep their init. Returns
    the number of values read. Only this stage's tensors are read from disk."""
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
            with file.open("rb") as f:
                header, data_at = _header(f, file)
                for hf, param in params:
                    read += _read_into(f, data_at, header.get(hf), hf, param)
    return read


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _header(f: BinaryIO, file: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's header (tensor name -> dtype, shape, offsets) and where its data
    starts: 8 bytes of little-endian header length, then the JSON."""
    (n,) = struct.unpack("<Q", f.read(8))
    if n > 100 * 2**20:
        raise HFImportError(f"{file}: a safetensors header of {n} bytes: not a safetensors file")
    try:
        return json.loads(f.read(n)), 8 + n
    except ValueError as e:
        raise HFImportError(f"{file}: unreadable safetensors header ({e})") from None


def _read_into(f: BinaryIO, data_at: int, entry: Any, hf: str, param: torch.Tensor) -> int:
    """Read one tensor's bytes straight into the parameter's storage (one tensor's buffer when
    the file's dtype is another): read(), not a map of the file, so the file's pages never
    count in this process's memory (a mapped llama-1b stage doubled its peak)."""
    if not isinstance(entry, dict) or entry.get("dtype") not in _DTYPES:
        got = entry.get("dtype") if isinstance(entry, dict) else None
        raise HFImportError(f"model.init_from: {hf}: dtype {got!r}, not one of {list(_DTYPES)}")
    dtype = _DTYPES[entry["dtype"]]
    if tuple(entry.get("shape", ())) != tuple(param.shape):
        raise HFImportError(
            f"model.init_from: {hf} has shape {tuple(entry.get('shape', ()))}, this run's model "
            f"{tuple(param.shape)}: the model section disagrees with it"
        )
    start, end = entry["data_offsets"]
    target = param if dtype == param.dtype else torch.empty(param.shape, dtype=dtype)
    raw = target.view(-1).view(torch.uint8)
    if end - start != raw.numel():
        raise HFImportError(f"model.init_from: {hf}: {end - start} bytes for {raw.numel()}")
    f.seek(data_at + start)
    view, done = memoryview(raw.numpy()), 0
    while done < raw.numel():
        got = f.readinto(view[done:])
        if not got:
            raise HFImportError(f"model.init_from: {hf}: the file ends inside the tensor")
        done += got
    if target is not param:
        param.copy_(target)
    return param.numel()
