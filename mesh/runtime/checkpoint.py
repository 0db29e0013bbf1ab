"""Atomic save and load of one cell's state.

A checkpoint is written to a temporary file in the same folder, fsynced, renamed over the old
one and the folder fsynced, so a peer killed mid-save (even by SIGKILL) leaves either the old
checkpoint or the new one, never a torn file. Loading uses `torch.load(weights_only=True)`
(tensors, numbers and strings only) and checks that the checkpoint belongs to this run
(config fingerprint) and this cell before anything is used.

Every checkpoint proves its bytes: a digest of the file (SHA-256 over every byte torch.save
wrote, hashed as it is written: no second pass; 1.75 GB per CPU second on the dev box, twice
blake2b's) trails it, in the same temporary file, so the rename makes the file and its digest
visible together. A reader checks it before anything else (one streaming read of the file): a
checkpoint whose bytes changed since the save (a flipped sector, a bad copy) is passed over like
a torn one, never half-used.

Neither way holds a second copy of the stage (llama-1b's stage 0 holds 10.5 GB of state:
weights, drift, moments, four stashed versions). A save writes the cell's own tensors, no
clones. A load maps the file (torch.load mmap=True) and reads it a chunk at a time, into the
cell's own tensors, handing each chunk's pages back once read: a mapped page that was read
counts in the process's memory until the file is unmapped, so reading a whole stage through
the map would add the file's size to the peak (the kernel could reclaim it, but a peer's memory
limit counts it).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from comms.procs import pid_alive
from mesh.engine.cell import Cell
from mesh.errors import CheckpointError, disk_full  # CheckpointError: re-exported
from mesh.runtime.checkpoint_digest import DAMAGED, digest_problem, write_digested

# 3: a digest trails the file; 2: the stashed versions as a list of tensors; 1 stacked them
# into one (a copy)
FORMAT = 3
READ_FORMATS = (1, 2, 3)  # files of formats 1 and 2 (earlier runs, no digest) still resume
DIGESTED = 3  # the first format whose files carry a digest: one without it is damaged
CHUNK = 1 << 22  # values read at once from a mapped file (16 MB of fp32) before release


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


# ---- reading a mapped checkpoint ---------------------------------------------------------------


class MappedCheckpoint:
    """A checkpoint file mapped into memory: `state` is its content, its tensors read from the
    file when touched. `all_finite`, `copy_into` and `release` read a tensor a chunk at a time
    and drop each chunk's pages from this process once read (madvise MADV_DONTNEED: the bytes
    stay in the file and the page cache, and a later read maps them again).

    Pages are dropped only inside this file's own mapping (Linux; elsewhere nothing is) and only
    when torch did not byte-swap the file in place (one written on a machine of the other byte
    order): swapped pages are private copies, and dropping them would bring the file's bytes
    back."""

    def __init__(self, path: Path) -> None:
        self.state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        self._ranges = _mapped_ranges(path) if _native_byte_order(path) else []

    def release(self, t: torch.Tensor) -> None:
        """Drop the pages wholly inside `t`'s bytes (no-op outside this file's mapping)."""
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        lo, hi = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
        if hi > lo and any(a <= lo and hi <= b for a, b in self._ranges):
            _madvise()(lo, hi - lo, mmap.MADV_DONTNEED)  # a failure only leaves them mapped

    def chunks(self, t: torch.Tensor) -> list[torch.Tensor]:
        """`t`'s values in chunks of CHUNK (views: `t` is contiguous as torch.save wrote it)."""
        return list((t if t.is_contiguous() else t.contiguous()).view(-1).split(CHUNK))

    def all_finite(self, t: torch.Tensor) -> bool:
        for part in self.chunks(t):
            finite = bool(torch.isfinite(part).all())  # a bool per value: one chunk's worth
            self.release(part)
            if not finite:
                return False
        return True

    def copy_into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst.copy_(src) (any device and dtype, the same number of values) chunk by chunk."""
        if not dst.is_contiguous():  # not a tensor of a cell (all are): a plain copy
            dst.copy_(src.reshape(dst.shape))
            return
        for d, s in zip(dst.view(-1).split(CHUNK), self.chunks(src), strict=True):
            d.copy_(s)
            self.release(s)


def _native_byte_order(path: Path) -> bool:
    """Whether the file's tensors are in this machine's byte order (torch.load swaps them in
    place otherwise). torch.save records the writer's in a `byteorder` record of the zip."""
    try:
        with zipfile.ZipFile(path) as z:
            names = [n for n in z.namelist() if n.endswith("/byteorder")]
            return not names or z.read(names[0]).decode() == sys.byteorder
    except (OSError, zipfile.BadZipFile, UnicodeDecodeError):
        return False


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """The address ranges where this process maps `path` (from /proc/self/maps; none where
    there is no such file, so nothing is released there)."""
    name = str(path.resolve())
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    ranges = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == name:
            lo, hi = fields[0].split("-")
            ranges.append((int(lo, 16), int(hi, 16)))
    return ranges if hasattr(mmap, "MADV_DONTNEED") else []


@functools.cache
def _madvise() -> Any:
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def read_checkpoint(path: Path) -> MappedCheckpoint:
    """The checkpoint at `path`, mapped; CheckpointError when it is missing or unreadable."""
    try:
        return MappedCheckpoint(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no checkpoint there") from None
    except Exception as e:  # torn, truncated or foreign file: refuse it, never half-load it
        raise CheckpointError(f"{path}: not a readable checkpoint ({type(e).__name__})") from None


def check_checkpoint(path: Path, fingerprint: str, stage: int, replica: int) -> str | None:
    """Why the checkpoint at `path` cannot be resumed from, or None when it can: readable
    (not torn or truncated), its bytes the ones its save wrote (the digest that trails it), of
    this run's math (state fingerprint), this cell and the step its name says, with finite
    weights. Maps the file, reads it once for the digest and the weights again; builds no
    model."""
    try:
        bad = digest_problem(path)  # first: damaged bytes are never unpickled
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"unreadable ({type(e).__name__})"
    if bad is not None and bad != "no digest":
        return f"unreadable ({DAMAGED})"
    try:
        mapped = MappedCheckpoint(path)
    except Exception as e:  # noqa: BLE001 - torn, truncated or foreign: the reason is the type
        return f"unreadable ({type(e).__name__}: truncated or not a checkpoint)"
    state = mapped.state
    if not isinstance(state, dict) or state.get("format") not in READ_FORMATS:
        return "unknown checkpoint format"
    if bad is not None and state["format"] >= DIGESTED:  # its digest was cut off
        return "unreadable (no digest: truncated or not a checkpoint)"
    if state.get("fingerprint") != fingerprint:
        return f"{FOREIGN} (state fingerprint {state.get('fingerprint')!r})"
    if (state.get("stage"), state.get("replica")) != (stage, replica) or not all(
        _is_int(state.get(k)) for k in ("stage", "replica")
    ):
        return f"holds cell s{state.get('stage')!r}r{state.get('replica')!r}"
    why = malformed(state)
    if why is not None:
        return why
    if f"step-{state['step']:08d}" != path.stem:
        return f"holds step {state['step']}"
    if not mapped.all_finite(state["flat"]):
        return "non-finite weights"
    return None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def malformed(state: dict[str, Any]) -> str | None:
    """What is wrong with the fields of a checkpoint's content (a file another program wrote,
    or damaged in a way that still unpickles), or None: each field of the type and shape a
    save writes. A malformed file is passed over like a torn one, never half-used."""
    step = state.get("step")
    if not _is_int(step) or step < 0:
        return f"step is {type(step).__name__} {step!r}, not a step number"
    flat, drift, stashes = state.get("flat"), state.get("drift"), _stashes(state)
    if not isinstance(flat, torch.Tensor) or flat.ndim != 1 or not flat.is_floating_point():
        return "parameter count does not match: flat is not a vector of weights"
    if not isinstance(drift, torch.Tensor) or drift.shape != flat.shape:
        return "parameter count does not match: drift is missing or of another size"
    if stashes is None or not all(
        isinstance(t, torch.Tensor) and t.shape == flat.shape for t in stashes
    ):
        return "parameter count does not match: the stashed versions are not vectors of weights"
    versions = state.get("versions")
    if (
        not isinstance(versions, torch.Tensor)
        or versions.dtype != torch.int64
        or versions.shape != (len(stashes),)
    ):
        return "the stashed versions do not match their steps"
    optimizer = state.get("optimizer")
    if not isinstance(optimizer, dict) or not all(
        isinstance(k, str) and "/" in k and (isinstance(v, torch.Tensor) or _is_number(v))
        for k, v in optimizer.items()
    ):
        return "optimizer state does not fit (not a table of tensors and numbers)"
    return None


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def newest_intact(run_dir: str | Path, stage: int, replica: int, fingerprint: str) -> int | None:
    """The newest step of this cell's checkpoints that can be resumed from (check_checkpoint;
    newer damaged ones passed over, older ones not read), None when there is none."""
    for step in reversed(saved_steps(run_dir, stage, replica)):
        path = checkpoint_path(run_dir, stage, replica, step)
        if check_checkpoint(path, fingerprint, stage, replica) is None:
            return step
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


# ---- save ---------------------------------------------------------------------------------------


def cell_state(cell: Cell, fingerprint: str) -> dict[str, Any]:
    """A checkpoint's content: the cell's own tensors, not copies. Nothing changes them while
    torch.save writes them: every change to a cell's state (an update, a round's arrival, a new
    version, a state download) happens on its worker's thread, which is the one saving, and the
    state server only reads (under the step lock)."""
    versions = sorted(cell.history)
    return {
        "format": FORMAT,
        "fingerprint": fingerprint,
        "stage": cell.stage,
        "replica": cell.replica,
        "step": cell.step,
        "flat": cell.flat,
        "drift": cell.drift,
        # the stashed versions the schedule still needs (P - j for async, 2 for 2bw), as a
        # list: a stack would be a copy of all of them
        "versions": torch.tensor(versions, dtype=torch.int64),
        "stashes": [cell.history[v] for v in versions],
        "optimizer": cell.optimizer.state_views(),  # no copies
    }


def save_cell(
    cell: Cell, fingerprint: str, run_dir: str | Path, extra: dict[str, Any] | None = None
) -> Path:
    """Write the cell's checkpoint for its current step atomically; prune old ones, and the
    temporary files of earlier writers of this cell that were killed mid-save. `extra`: more
    entries of the file (a logical run's simulator state, mesh/engine/sim_state.py), which
    every reader of a cell's state passes over."""
    path = checkpoint_path(run_dir, cell.stage, cell.replica, cell.step)
    path.parent.mkdir(parents=True, exist_ok=True)
    _sweep_torn(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    state = cell_state(cell, fingerprint)
    assert not set(extra or {}) & set(state), "an extra entry must not replace the cell's"
    try:
        with tmp.open("wb") as f:
            # CPU tensors straight from memory; the digest in the same file: the rename
            # publishes both at once
            write_digested({**state, **(extra or {})}, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as e:  # a failed write (a full disk) leaves nothing and the older ones
        tmp.unlink(missing_ok=True)
        full = disk_full(e, path)
        if full is not None:
            raise full from None
        raise
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    prune(run_dir, cell.stage, cell.replica)
    return path


def prune(run_dir: str | Path, stage: int, replica: int) -> list[int]:
    """Remove this cell's checkpoints but the newest KEEP and the ones a resume needs: the
    newest step every cell of its replica has (where a restarted replica resumes) and the
    newest step every cell of the run directory has (where `--resume` resumes the grid). A
    replica that trains on while another is down must not prune the step they share. Returns
    the steps removed."""
    steps = saved_steps(run_dir, stage, replica)
    cells = [
        (int(a), int(b))
        for a, _, b in (d.name.partition("-") for d in (Path(run_dir) / "checkpoints").iterdir())
        if a.isdigit() and b.isdigit()
    ]
    keep = set(steps[-KEEP:])
    for group in ([c for c in cells if c[1] == replica], cells):
        shared = common_step(run_dir, group) if group else None
        if shared is not None:
            keep.add(shared)
    removed = [s for s in steps if s not in keep]
    for old in removed:
        checkpoint_path(run_dir, stage, replica, old).unlink(missing_ok=True)
    return removed


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


# ---- load ---------------------------------------------------------------------------------------


def _stashes(state: dict[str, Any]) -> list[Any] | None:
    """The stashed versions of either format (format 1 stacked them: its rows), or None."""
    stashes = state.get("stashes")
    if state["format"] == 1 and isinstance(stashes, torch.Tensor) and stashes.ndim == 2:
        return list(stashes)
    return stashes if isinstance(stashes, list) else None


def _optimizer_entries(cell: Cell, saved: Any, path: Path) -> list[tuple[dict[str, Any], str, Any]]:
    """(the optimizer's state of one parameter, key, saved value) for every saved entry, once
    the saved state fits this optimizer as load_state_dict demands (the same keys; tensors of
    the same shapes); CheckpointError otherwise."""
    own = cell.optimizer.state
    mine = {f"{name}/{key}" for name, st in own.items() for key in st}
    keys = set(saved) if isinstance(saved, dict) else set()
    if keys != mine:
        missing, extra = sorted(mine - keys), sorted(keys - mine)
        raise CheckpointError(
            f"{path}: optimizer state does not fit (missing {missing[:5]}, extra {extra[:5]})"
        )
    entries = []
    for full, val in saved.items():
        name, key = full.split("/", 1)
        old = own[name][key]
        is_tensor = isinstance(old, torch.Tensor)
        if is_tensor != isinstance(val, torch.Tensor) or (is_tensor and val.shape != old.shape):
            want = f"a tensor {tuple(old.shape)}" if is_tensor else "a number"
            raise CheckpointError(f"{path}: optimizer state does not fit ({full}: not {want})")
        entries.append((own[name], key, val))
    return entries


def load_cell(cell: Cell, fingerprint: str, path: Path) -> None:
    """Restore `cell` in place from `path`, or raise CheckpointError (nothing changed then).
    Everything is checked before anything is copied; then the file's tensors are copied into
    the cell's own (the optimizer's too) a chunk at a time, so no second copy of the stage is
    held (only its stashed versions are new tensors, the old ones freed first)."""
    mapped = read_checkpoint(path)
    state = mapped.state
    if not isinstance(state, dict) or state.get("format") not in READ_FORMATS:
        raise CheckpointError(f"{path}: unknown checkpoint format")
    if state.get("fingerprint") != fingerprint:
        raise CheckpointError(
            f"{path}: written by a run with another config (fingerprint "
            f"{state.get('fingerprint')} != {fingerprint}); resume with the same config"
        )
    if (state.get("stage"), state.get("replica")) != (cell.stage, cell.replica):
        raise CheckpointError(f"{path}: holds cell {state.get('stage')}-{state.get('replica')}")
    why = malformed(state)
    if why is not None:
        raise CheckpointError(f"{path}: {why}")
    flat, drift, stashes = state.get("flat"), state.get("drift"), _stashes(state)
    versions = state.get("versions")
    n = cell.flat.numel()
    vectors = [flat, drift, *(stashes or [])]
    if stashes is None or not all(isinstance(t, torch.Tensor) and t.shape == (n,) for t in vectors):
        raise CheckpointError(f"{path}: parameter count does not match this model")
    if not isinstance(versions, torch.Tensor) or versions.shape != (len(stashes),):
        raise CheckpointError(f"{path}: the stashed versions do not match their steps")
    optimizer = _optimizer_entries(cell, state.get("optimizer"), path)
    if not (mapped.all_finite(flat) and all(mapped.all_finite(w) for w in stashes)):
        raise CheckpointError(f"{path}: non-finite weights")
    for st, key, val in optimizer:
        if isinstance(val, torch.Tensor):
            mapped.copy_into(st[key], val)
        else:
            st[key] = type(st[key])(val)
    mapped.copy_into(cell.flat, flat)
    mapped.copy_into(cell.drift, drift)
    cell.step = int(state["step"])
    cell.history.clear()  # before the new versions: their old tensors are freed first
    for v, w in zip(versions.tolist(), stashes, strict=True):
        version = torch.empty_like(cell.flat)
        mapped.copy_into(version, w)
        cell.history[int(v)] = version
