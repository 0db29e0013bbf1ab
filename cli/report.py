"""Progress bars and summary tables for long commands."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import click
from tqdm import tqdm

from mesh.metrics import format_table


class _Bar:
    def __init__(self, bar: tqdm) -> None:
        self.bar = bar

    def update_loss(self, loss: float) -> None:
        self.bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
        self.bar.update(1)


@contextmanager
def progress_bar(total: int, desc: str) -> Iterator[_Bar]:
    with tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, leave=True) as bar:
        yield _Bar(bar)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    click.echo(format_table(headers, rows))
