"""`join` starting over as a new process of the same command line: after losing its cell to an
earlier claim (rejoin), or moved by elastic.rebalance to the thinnest stage of a pool (move_to;
the stage travels in the environment and overrides --stage once)."""

from __future__ import annotations

import os
import sys

import click

REJOINS_MAX = 5  # a join that lost its cell starts over this many times, then gives up
REJOINS_ENV = "MESHTRAIN_REJOINS"


def rejoin(lost: str) -> tuple[int, str]:
    """Start this `join` over (the same command line, a fresh process: its cell's transport and
    torch state are gone with it) to claim another free cell; after REJOINS_MAX starts, the
    exit code and message instead."""
    done = int(os.environ.get(REJOINS_ENV, "0"))
    if done >= REJOINS_MAX:
        return 2, f"error: {lost}; lost a cell {done + 1} times: join again later"
    from mesh.runtime.session import REJOIN_NOTE

    click.echo(f"{lost}: {REJOIN_NOTE}")
    sys.stdout.flush()
    sys.stderr.flush()
    os.environ[REJOINS_ENV] = str(done + 1)
    os.execv(sys.executable, relaunch_argv())
    raise AssertionError("unreachable")  # execv does not return


def relaunch_argv() -> list[str]:
    """This command line as a new interpreter runs it (`python -m cli.main ARGS`): the same
    whether it was started as `meshtrain`, `python -m cli.main` or forked from a fork server
    (whose own command line sys.orig_argv would be)."""
    return [sys.executable, "-m", "cli.main", *sys.argv[1:]]


MOVE_ENV = "MESHTRAIN_MOVE_TO_STAGE"  # a rebalanced join's next stage (its --stage)


def move_to(stage: int) -> None:
    """Start this `join` over in `stage` (elastic.rebalance): the same command line, a fresh
    process, whose claim takes a free cell of that stage and downloads its state."""
    click.echo(f"moving to stage {stage}, the thinnest: joining again there")
    sys.stdout.flush()
    sys.stderr.flush()
    os.environ[MOVE_ENV] = str(stage)
    os.execv(sys.executable, relaunch_argv())


def moved_stage(stage: int | None) -> int | None:
    """The stage a rebalancing move sent this process to (it overrides --stage: the move was
    decided later than the command line), else --stage."""
    held = os.environ.pop(MOVE_ENV, None)
    return stage if held is None else int(held)
