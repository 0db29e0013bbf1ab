"""What every command shares: config options (--config, --set), their resolution, and the
decorator that turns our user errors into one line and exit code 2, never a traceback.

imports: click, mesh.config, mesh.errors (light: no torch, no hivemind).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import click

from mesh.config import Config, ConfigError, load_config
from mesh.errors import CheckpointError, DataError, DiskFull, MissingExtra, disk_full

# join's: ConfigErrors
USER_ERRORS = (ConfigError, DataError, CheckpointError, MissingExtra, DiskFull)


def user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn our user-facing exceptions into a message and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        except OSError as e:  # a full disk under a command's own writes (summary, plots)
            full = disk_full(e)
            if full is None:
                raise
            click.echo(f"error: {full}", err=True)
            sys.exit(2)

    return wrapper


def config_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    fn = click.option(
        "--set",
        "overrides",
        multiple=True,
        metavar="KEY=VALUE",
        help="Override one config key (repeatable), e.g. --set grid.stages=4.",
    )(fn)
    fn = click.option(
        "--config",
        "config_files",
        multiple=True,
        metavar="FILE",
        help="TOML config file (repeatable; later files win).",
    )(fn)
    return fn


def resolve_config(
    config_files: tuple[str, ...], overrides: tuple[str, ...], extra: list[str] = ()
) -> Config:
    return load_config(list(config_files), list(overrides) + list(extra))


KEY_HELP = (
    "The run's shared secret (or MESHTRAIN_RUN_KEY): only holders can claim cells, send "
    "activations or join averaging."
)


def run_options(key_help: str = KEY_HELP) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """--run-key (also from MESHTRAIN_RUN_KEY) and --run-id: which run on the DHT, and its key."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn = click.option("--run-key", envvar="MESHTRAIN_RUN_KEY", default=None, help=key_help)(fn)
        return click.option(
            "--run-id",
            default="meshtrain",
            show_default=True,
            help="Namespace of the run's DHT keys.",
        )(fn)

    return wrap
