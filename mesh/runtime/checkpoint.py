"""Atomic save and load of one cell's state.

A checkpoint is written to a temporary file in the same folder, fsynced, renamed over the old
one and the folder fsynced, so a peer killed mid-save (even by SIGKILL) leaves either the old
checkpoint or the new one, never a torn file. Loading uses `torch.load(weights_only=True)`
(tensors, numbers and strings only) and checks that the checkpoint belongs to this run
(config fingerprint) and this cell before anything is used.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mesh.engine.cell import Cell
from mesh.errors import CheckpointError  # noqa: F401 - re-exported
from mesh.procs import pid_alive

FORMAT = 1


FOREIGN = "written by another config"
KEEP = 3  # checkpoints kept per cell: a consistent cut across cells needs older ones too


def cell_dir(run_dir: str | Path, stage: int, replica: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"{stage}-{replica}"


def checkpoint_path(run_dir: str | Path, stage: int, replica: int, step: int) -> Path:
    return cell_dir(run_dir, stage, replica) / f"step-{step:08d}.pt"


def saved_steps(run_dir: str | Path, stage: int, replica: int) -> list[int]:
    d = cell_dir(run_dir, stage, replica)
    return sorted(int(p.stem.split("-")[1]) for p in d.glob("step-*.pt")) if d.is_dir() else []


def common_step(run_dir: str | Path, cells: list[tuple[int, int]]) -> int | None:
    """The latest step every cell has a checkpoint of: where a whole grid resumes.

    Stages of one pipeline are at different steps at any instant (the last stage steps first),
    so each cell keeps its last few checkpoints and a resume picks a step all of them have;
    resuming there replays exactly the same microbatches with the same weight versions.
    """
    common = None
    for stage, replica in cells:
        steps = set(saved_steps(run_dir, stage, replica))
        common = steps if common is None else common & steps
    return max(common) if common else None


def check_checkpoint(path: Path, fingerprint: str, stage: int, replica: int) -> str | None:
    """Why the checkpoint at `path` cannot be resumed from, or None when it can: readable
    (not torn or truncated), of this run's math (state fingerprint), this cell and the step its
    name says, with finite weights. Reads the file; builds no model."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        return "missing"
    except Exception as e:  # noqa: BLE001 - torn, truncated or foreign: the reason is the type
        return f"unreadable ({type(e).__name__}: truncated or not a checkpoint)"
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        return "unknown checkpoint format"
    if state.get("fingerprint") != fingerprint:
        return f"{FOREIGN} (state fingerprint {state.get('fingerprint')})"
    if (state.get("stage"), state.get("replica")) != (stage, replica):
        return f"holds cell s{state.get('stage')}r{state.get('replica')}"
    if f"step-{state.get('step', -1):08d}" != path.stem:
        return f"holds step {state.get('step')}"
    flat = state.get("flat")
    if not isinstance(flat, torch.Tensor) or not bool(torch.isfinite(flat).all()):
        return "non-finite weights"
    return None


Damage = tuple[int, int, int, str]  # (stage, replica, step, why the file cannot be used)


@dataclass(frozen=True)
class ResumePoint:
    step: int | None  # None: no step that every cell has intact
    damaged: list[Damage]  # newer files passed over: torn, truncated, not ours
    foreign: list[Damage]  # files of another config (a wrong config, not damage)


def resume_point(
    run_dir: str | Path, cells: list[tuple[int, int]], fingerprint: str
) -> ResumePoint:
    """The newest step that every cell has an intact checkpoint of, after checking each file
    newer than it (so a truncated newest file falls back to the step before)."""
    steps = {cell: set(saved_steps(run_dir, *cell)) for cell in cells}
    bad: list[Damage] = []
    found = None
    for step in sorted(set().union(*steps.values()), reverse=True):
        intact = True
        for cell in cells:
            if step not in steps[cell]:
                intact = False
                continue
            why = check_checkpoint(checkpoint_path(run_dir, *cell, step), fingerprint, *cell)
            if why is not None:
                bad.append((*cell, step, why))
                intact = False
        if intact:
            found = step
            break
    foreign = [b for b in bad if b[3].startswith(FOREIGN)]
    return ResumePoint(found, [b for b in bad if b not in foreign], foreign)


def cell_state(cell: Cell, fingerprint: str) -> dict[str, Any]:
    versions = sorted(cell.history)
    return {
        "format": FORMAT,
        "fingerprint": fingerprint,
        "stage": cell.stage,
        "replica": cell.replica,
        "step": cell.step,
        "flat": cell.flat.clone(),
        "drift": cell.drift.clone(),
        # the stashed versions the schedule still needs (P - j for async, 2 for 2bw)
        "versions": torch.tensor(versions, dtype=torch.int64),
        "stashes": torch.stack([cell.history[v] for v in versions]),
        "optimizer": cell.optimizer.state_dict(),
    }


def save_cell(cell: Cell, fingerprint: str, run_dir: str | Path) -> Path:
    """Write the cell's checkpoint for its current step atomically; prune old ones, and the
    temporary files of earlier writers of this cell that were killed mid-save."""
    path = checkpoint_path(run_dir, cell.stage, cell.replica, cell.step)
    path.parent.mkdir(parents=True, exist_ok=True)
    _sweep_torn(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("wb") as f:
        torch.save(cell_state(cell, fingerprint), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    for old in saved_steps(run_dir, cell.stage, cell.replica)[:-KEEP]:
        checkpoint_path(run_dir, cell.stage, cell.replica, old).unlink(missing_ok=True)
    return path


def _sweep_torn(folder: Path) -> None:
    """Remove the temporary files of writers that died mid-save (a SIGKILL leaves one per
    kill, each as large as a checkpoint); a live writer's file is left alone."""
    for tmp in folder.glob(".step-*.pt.*.tmp"):
        try:
            pid = int(tmp.name.rsplit(".", 2)[-2])
        except ValueError:
            continue
        if pid != os.getpid() and not pid_alive(pid):
            tmp.unlink(missing_ok=True)


def load_cell(cell: Cell, fingerprint: str, path: Path) -> None:
    """Restore `cell` in place from `path`, or raise CheckpointError (nothing changed then)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no checkpoint there") from None
    except Exception as e:  # torn, truncated or foreign file: refuse it, never half-load it
        raise CheckpointError(f"{path}: not a readable checkpoint ({type(e).__name__})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path}: unknown checkpoint format")
    if state.get("fingerprint") != fingerprint:
        raise CheckpointError(
            f"{path}: written by a run with another config (fingerprint "
            f"{state.get('fingerprint')} != {fingerprint}); resume with the same config"
        )
    if (state.get("stage"), state.get("replica")) != (cell.stage, cell.replica):
        raise CheckpointError(f"{path}: holds cell {state.get('stage')}-{state.get('replica')}")
    flat, drift, stashes = state["flat"], state["drift"], state["stashes"]
    n = cell.flat.numel()
    if flat.shape != (n,) or drift.shape != (n,) or stashes.shape[1:] != (n,):
        raise CheckpointError(f"{path}: parameter count does not match this model")
    if not (torch.isfinite(flat).all() and torch.isfinite(stashes).all()):
        raise CheckpointError(f"{path}: non-finite weights")
    try:
        cell.optimizer.load_state_dict(state["optimizer"])
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{path}: optimizer state does not fit ({e})") from None
    cell.flat.copy_(flat)
    cell.drift.copy_(drift)
    cell.step = int(state["step"])
    cell.history.clear()
    for v, w in zip(state["versions"].tolist(), stashes, strict=True):
        cell.history[int(v)] = w.to(cell.flat.device, copy=True)


# ---- state transfer to a joining peer (mesh/runtime/state_sync.py) ----------------------------
# A joiner gets its stage's live state as ONE float32 vector: [flat, drift, optimizer state in
# the sorted key order of state_dict()]. Both ends build the same layout from the same config, so
# nothing but numbers crosses (no pickle); the receiver checks the length before anything else.


def state_layout(cell: Cell) -> list[tuple[str, tuple[int, ...] | None]]:
    """(optimizer state key, tensor shape or None for a number) in transfer order."""
    sd = cell.optimizer.state_dict()
    return [
        (k, tuple(v.shape) if isinstance(v, torch.Tensor) else None) for k, v in sorted(sd.items())
    ]


def state_numel(cell: Cell) -> int:
    n = 2 * cell.flat.numel()
    for _, shape in state_layout(cell):
        n += 1 if shape is None else int(torch.Size(shape).numel())
    return n


def state_vector(cell: Cell) -> torch.Tensor:
    """The cell's live state as one float32 vector (8-bit optimizer codes and step counts are
    exact in float32)."""
    sd = cell.optimizer.state_dict()
    parts = [cell.flat.cpu(), cell.drift.cpu()]
    for key, shape in state_layout(cell):
        v = sd[key]
        parts.append(
            v.detach().reshape(-1).to("cpu", torch.float32)
            if shape is not None
            else torch.tensor([float(v)], dtype=torch.float32)
        )
    return torch.cat(parts)


def load_state_vector(cell: Cell, vec: torch.Tensor, step: int) -> None:
    """Adopt a live peer's state (from state_vector) as this cell's, at `step`; the stashed
    versions restart from the live weights. CheckpointError if the vector does not fit."""
    if vec.dtype != torch.float32 or vec.shape != (state_numel(cell),):
        raise CheckpointError(f"state of {tuple(vec.shape)} values does not fit this stage")
    if not bool(torch.isfinite(vec).all()):
        raise CheckpointError("state with non-finite values refused")
    if step < 0:
        raise CheckpointError(f"state for step {step} refused")
    n = cell.flat.numel()
    old = cell.optimizer.state_dict()
    sd: dict[str, Any] = {}
    offset = 2 * n
    for key, shape in state_layout(cell):
        if shape is None:
            sd[key] = type(old[key])(vec[offset].item())
            offset += 1
        else:
            k = int(torch.Size(shape).numel())
            sd[key] = vec[offset : offset + k].view(shape).to(old[key].dtype)
            offset += k
    cell.optimizer.load_state_dict(sd)
    cell.flat.copy_(vec[:n])
    cell.drift.copy_(vec[n : 2 * n])
    cell.step = step
    cell.history.clear()
    cell.history[step] = cell.version_weights()
