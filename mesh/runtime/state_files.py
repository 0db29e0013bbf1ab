"""A cell's state to and from a file of wire values, in bounded pieces (state download's I/O).

The donor writes its state into a snapshot file (mesh/runtime/state_sync.py holds the worker's
step lock meanwhile) and serves chunks from it; the joiner writes verified chunks into a staging
file and, once the whole stream checks out, copies it into its own tensors. Both files hold the
stream of mesh/runtime/state_chunks.py (the entries' float32 wire values back to back). Reads and
writes go through os.pread/pwrite into one reusable buffer, not mmap: pages of a mapped file
count in a process's RSS once touched, the page cache behind a plain read does not.

imports: mesh (engine, runtime), torch and stdlib.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from mesh.engine.cell import Cell
from mesh.runtime.state_chunks import (
    VALUE_BYTES,
    ChunkHasher,
    Entry,
    Manifest,
    chunk_count,
    entry_for,
    entry_offsets,
    entry_pieces,
    from_wire,
    number_tensor,
    to_wire,
    wire_error,
)

PIECE_VALUES = 1 << 22  # 16 MiB of wire values converted or copied at a time


@dataclass(frozen=True)
class Slot:
    """One state entry of a live cell: `holder[key]` (tensors are written in place, numbers
    are replaced in their holder)."""

    name: str
    holder: dict[str, Any]
    key: str

    @property
    def value(self) -> torch.Tensor | int | float:
        return self.holder[self.key]


def live_state(cell: Cell) -> list[Slot]:
    """The cell's state in stream order: flat, drift, then each optimizer state value by name
    (the optimizer's own tensors, not state_dict()'s clones)."""
    slots = [
        Slot("flat", {"flat": cell.flat}, "flat"),
        Slot("drift", {"drift": cell.drift}, "drift"),
    ]
    opt = [
        Slot(f"opt/{param}/{key}", st, key)
        for param, st in cell.optimizer.state.items()
        for key in st
    ]
    return slots + sorted(opt, key=lambda s: s.name)


def entries_of(slots: list[Slot]) -> tuple[Entry, ...]:
    return tuple(entry_for(s.name, s.value) for s in slots)


def buffer_for(values: int) -> torch.Tensor:
    """A reusable float32 buffer of `values` wire values."""
    return torch.empty(values, dtype=torch.float32)


def as_bytes(values: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor (float32 wire values: little-endian)."""
    return memoryview(values.reshape(-1).view(torch.uint8).numpy())


def write_at(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def read_at(fd: int, values: torch.Tensor, offset: int) -> torch.Tensor:
    """Fill `values` (a buffer slice) from the file at byte `offset`; returns it."""
    view, at = as_bytes(values), offset
    while len(view):
        n = os.preadv(fd, [view], at)
        if n == 0:
            raise OSError(f"state file ends at byte {at}")
        view, at = view[n:], at + n
    return values


def write_snapshot(slots: list[Slot], entries: tuple[Entry, ...], fd: int) -> None:
    """Write the live state into `fd` (the caller holds the cell's step lock: one consistent
    update). Float32 tensors on the CPU are written from the live tensor itself; other dtypes
    and devices are converted PIECE_VALUES at a time."""
    for slot, entry, at in zip(slots, entries, entry_offsets(entries), strict=True):
        value = slot.value
        flat = value.detach().reshape(-1) if isinstance(value, torch.Tensor) else None
        for lo, hi in entry_pieces(entry, PIECE_VALUES):
            if flat is None:
                wire = to_wire(number_tensor(entry, value))
            else:
                wire = to_wire(flat[lo // entry.words : hi // entry.words])
            write_at(fd, as_bytes(wire.contiguous()), (at + lo) * VALUE_BYTES)


def hash_stream(
    fd: int, total_values: int, chunk_values: int, buffer: torch.Tensor
) -> tuple[tuple[str, ...], bool]:
    """(each chunk's digest, whether every value is finite) of a snapshot file; `buffer`
    holds at least chunk_values values."""
    hasher, finite = ChunkHasher(chunk_values), True
    for i in range(chunk_count(total_values, chunk_values)):
        start = i * chunk_values
        stop = min(total_values, start + chunk_values)
        part = read_at(fd, buffer[: stop - start], start * VALUE_BYTES)
        hasher.update(as_bytes(part))
        if finite:  # min/max carry a NaN along: one pass, no mask
            lo, hi = torch.aminmax(part)
            finite = math.isfinite(lo.item()) and math.isfinite(hi.item())
    return hasher.finish(), finite


def check_staged(fd: int, manifest: Manifest, buffer: torch.Tensor) -> str | None:
    """Why the staged stream cannot be adopted (a chunk's digest differs from the manifest's:
    the staging file is not what was verified on arrival, or an entry holds values its dtype
    cannot have), or None. Reads the file once, entry by entry, in order."""
    hasher = ChunkHasher(manifest.chunk_values)
    for entry, at in zip(manifest.entries, entry_offsets(manifest.entries), strict=True):
        for lo, hi in entry_pieces(entry, PIECE_VALUES):
            part = read_at(fd, buffer[: hi - lo], (at + lo) * VALUE_BYTES)
            hasher.update(as_bytes(part))
            why = wire_error(entry.dtype, part)
            if why is not None:
                return f"entry {entry.name} holds {why}"
    got = hasher.finish()
    bad = [i for i, (a, b) in enumerate(zip(got, manifest.chunks, strict=True)) if a != b]
    return f"staged chunks {bad[:5]} differ from their digests" if bad else None


def adopt_staged(cell: Cell, fd: int, manifest: Manifest, buffer: torch.Tensor) -> None:
    """Copy the staged stream (checked with check_staged) into the cell's own tensors, piece by
    piece, and put the cell at the manifest's step; the stashed versions restart from the
    adopted weights."""
    slots = live_state(cell)
    for slot, entry, at in zip(
        slots, manifest.entries, entry_offsets(manifest.entries), strict=True
    ):
        target = slot.value
        if not isinstance(target, torch.Tensor):
            part = read_at(fd, buffer[: entry.values], at * VALUE_BYTES)
            slot.holder[slot.key] = type(target)(from_wire(part, entry.dtype).item())
            continue
        # a non-contiguous tensor (none today) is filled through one temporary of its size
        flat = (
            target.view(-1)
            if target.is_contiguous()
            else torch.empty(target.numel(), dtype=target.dtype, device=target.device)
        )
        for lo, hi in entry_pieces(entry, PIECE_VALUES):
            part = read_at(fd, buffer[: hi - lo], (at + lo) * VALUE_BYTES)
            flat[lo // entry.words : hi // entry.words].copy_(from_wire(part, entry.dtype))
        if not target.is_contiguous():
            target.copy_(flat.view(target.shape))
    cell.step = manifest.step
    cell.history.clear()
    cell.history[cell.step] = cell.version_weights()
