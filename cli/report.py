"""Progress bars and summary tables for long commands."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import click
from tqdm import tqdm

from mesh.report import format_table

# tqdm's ETA from the first step or two is mostly start-up (imports, rendezvous, warm-up), and
# a user reads "2:31:07" as a promise: show it only once a few steps have been timed
ETA_AFTER_STEPS = 5
NO_ETA = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"
WITH_ETA = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"


class _Bar:
    def __init__(self, bar: tqdm) -> None:
        self.bar = bar
        self.first = bar.n  # a resumed run starts its bar where it stopped

    def update_loss(self, loss: float) -> None:
        self.goto(self.bar.n + 1, loss)

    def note(self, line: str) -> None:
        """A line above the bar (a restart, a warning), the bar redrawn below it."""
        self.bar.write(line, file=sys.stderr)

    def goto(self, step: int, loss: float | None = None) -> None:
        if self.bar.bar_format == NO_ETA and step - self.first >= ETA_AFTER_STEPS:
            self.bar.bar_format = WITH_ETA
        if loss is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
        if self.bar.total is not None and step >= self.bar.total:
            # the last step is drawn once, when the bar closes (with the whole run's rate):
            # drawn here as well, a log (every redraw its own line) showed 100% twice
            self.bar.n = step
            return
        self.bar.update(step - self.bar.n)


@contextmanager
def progress_bar(total: int, desc: str, initial: int = 0, file: Any = None) -> Iterator[_Bar]:
    with tqdm(
        total=total,
        initial=initial,
        desc=desc,
        unit="step",
        dynamic_ncols=True,
        leave=True,
        bar_format=NO_ETA,
        file=file,
    ) as bar:
        yield _Bar(bar)


def byte_bar(total: int, desc: str) -> tqdm:
    """A bar over bytes of input (data prepare, verify): MB done, MB/s, time left."""
    return tqdm(
        total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1000, dynamic_ncols=True
    )


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    click.echo(format_table(headers, rows))
