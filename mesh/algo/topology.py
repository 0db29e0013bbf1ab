"""The grid: P stages x m replicas, cells, and the balanced cut of layers into stages. Pure."""

from __future__ import annotations

import re
from dataclasses import dataclass

_NAME = re.compile(r"s(\d{1,4})r(\d{1,4})")


def cell_name(stage: int, replica: int) -> str:
    """A cell's name, "s<stage>r<replica>": how logs, metrics, claims and peers spell it."""
    return f"s{stage}r{replica}"


@dataclass(frozen=True, order=True)
class Cell:
    """One peer's place in the grid: pipeline stage j of data-parallel replica i."""

    stage: int
    replica: int

    def __str__(self) -> str:
        return cell_name(self.stage, self.replica)

    @staticmethod
    def parse(name: str) -> Cell | None:
        """The cell named "s<stage>r<replica>" (None: not a cell's name)."""
        found = _NAME.fullmatch(name)
        return None if found is None else Cell(int(found.group(1)), int(found.group(2)))


@dataclass(frozen=True)
class Grid:
    stages: int
    replicas: int

    def __post_init__(self) -> None:
        assert self.stages >= 1 and self.replicas >= 1, self

    def cells(self) -> list[Cell]:
        return [Cell(s, r) for r in range(self.replicas) for s in range(self.stages)]

    def rank(self, cell: Cell) -> int:
        """Replica-major rank: the P stages of replica 0 come first (used by torch.distributed)."""
        return cell.replica * self.stages + cell.stage

    def cell(self, rank: int) -> Cell:
        return Cell(rank % self.stages, rank // self.stages)

    def stage_peers(self, stage: int) -> list[Cell]:
        """The cells that average stage `stage` together: one per replica."""
        return [Cell(stage, r) for r in range(self.replicas)]


def partition_layers(n_layers: int, n_stages: int) -> list[range]:
    """Balanced contiguous cut: sizes differ by at most one, larger parts first.

    Stage 0 also holds the embedding and the last stage the head, so giving the earlier stages
    the extra layers keeps the last stage (head + loss + softmax) from being the slowest.
    """
    if not 1 <= n_stages <= n_layers:
        raise ValueError(f"cannot cut {n_layers} layers into {n_stages} stages")
    base, extra = divmod(n_layers, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        size = base + (1 if s < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out
