"""The grid: P stages x m replicas, cells, and the balanced cut of layers into stages. Pure."""

from __future__ import annotations

import re
from dataclasses import dataclass

_NAME = re.compile(r"s(\d{1,4})r(\d{1,4})")


def cell_name(stage: int, replica: int) -> str:
    """A cell's name, "s<stage>r<replica>": how logs, metrics, claims and peers spell it."""
    return f"s{stage}r{replica}"


def group_name(stage: int) -> str:
    """The name of a stage's averaging group (its replicas' cells average together)."""
    return f"stage{stage}"


@dataclass(frozen=True, order=True)
class Place:
    """One peer's place in the grid: pipeline stage j of data-parallel replica i (the cell that
    trains there is mesh.engine.cell.Cell)."""

    stage: int
    replica: int

    def __str__(self) -> str:
        return cell_name(self.stage, self.replica)

    @staticmethod
    def parse(name: str) -> Place | None:
        """The place named "s<stage>r<replica>" (None: not a cell's name)."""
        found = _NAME.fullmatch(name)
        return None if found is None else Place(int(found.group(1)), int(found.group(2)))


def stage_of(name: str) -> int | None:
    """The stage of the cell named `name` (None: not a cell's name)."""
    place = Place.parse(name)
    return None if place is None else place.stage


@dataclass(frozen=True)
class Grid:
    """P stages x m replicas: the one owner of the grid's names (a cell's, a replica's path, a
    stage's column or pool, a stage's averaging group). `absent`: the places that never start
    (emulation.deaths at 0), in no column and no pool."""

    stages: int
    replicas: int
    absent: frozenset[tuple[int, int]] = frozenset()

    def __post_init__(self) -> None:
        assert self.stages >= 1 and self.replicas >= 1, self

    def names(self) -> list[str]:
        """Every cell's name in rank order: replica-major, the P stages of replica 0 first."""
        return [cell_name(j, i) for i in range(self.replicas) for j in range(self.stages)]

    def rank(self, place: Place) -> int:
        """Replica-major rank (used by torch.distributed)."""
        return place.replica * self.stages + place.stage

    def place(self, rank: int) -> Place:
        return Place(rank % self.stages, rank // self.stages)

    def path(self, replica: int) -> list[str]:
        """A replica's cells in stage order: a fixed pipeline's path."""
        return [cell_name(j, replica) for j in range(self.stages)]

    def column(self, stage: int, without: int | None = None) -> list[str]:
        """The cells that average stage `stage` together (one per replica, the absent ones
        left out), without replica `without` (a cell's own: its partners)."""
        return [
            cell_name(stage, i)
            for i in range(self.replicas)
            if i != without and (stage, i) not in self.absent
        ]

    def neighbours(self, stage: int, replica: int, pooled: bool) -> list[str]:
        """The cells a cell exchanges activations and gradients with: the stages before and
        after, its own replica's cells on a fixed grid, their every present cell in pools."""
        stages = [j for j in (stage - 1, stage + 1) if 0 <= j < self.stages]
        if pooled:
            return [c for j in stages for c in self.column(j)]
        return [cell_name(j, replica) for j in stages if (j, replica) not in self.absent]

    def groups(self) -> dict[str, list[str]]:
        """Every stage's averaging group and its members."""
        return {group_name(j): self.column(j) for j in range(self.stages)}


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
