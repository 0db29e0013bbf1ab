"""What every command shares: config options (--config, --set), their resolution, the
decorator that turns our user errors into one line and exit code 2, never a traceback, and the
studies' options (--quick, --out, --workers, --seeds).

imports: click, mesh.config, mesh.errors (light: no torch, no hivemind).
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

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


def grid_overrides(grid: str | None) -> list[str]:
    """--grid PxM (simulate, train) as the config keys it stands for."""
    if grid is None:
        return []
    parts = grid.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ConfigError(f"--grid {grid}: expected STAGESxREPLICAS, e.g. --grid 4x2")
    return [f"grid.stages={parts[0]}", f"grid.replicas={parts[1]}"]


def grid_run_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A grid's shorthands (simulate, train): --grid, --steps, --method and --init-from; they
    become config keys through shorthand_overrides and with_method."""
    options = [
        click.option(
            "--grid", default=None, metavar="PxM", help="Shorthand for grid.stages / replicas."
        ),
        click.option("--steps", type=int, default=None, help="Shorthand for run.steps."),
        click.option("--method", default=None, help="A named baseline, e.g. AsyncMesh, FullSync."),
        click.option(
            "--init-from",
            # no exists=True: a missing directory is the config's one-line error (exit 2)
            # naming model.init_from, not click's usage
            type=click.Path(file_okay=False),
            default=None,
            help="Start from a Hugging Face LlamaForCausalLM directory's weights "
            "(shorthand for model.init_from; its config.json gives the model keys).",
        ),
    ]
    for option in reversed(options):  # listed in --help's order
        fn = option(fn)
    return fn


skip_resource_check_option = click.option(
    "--skip-resource-check",
    is_flag=True,
    help="Start the cells even if this machine (on `train`: this node) cannot hold them as "
    "predicted: their memory and threads against what it has (docs/running.md).",
)


def shorthand_overrides(grid: str | None, steps: int | None, init_from: str | None) -> list[str]:
    """--grid, --steps and --init-from as the config keys they stand for."""
    extra = grid_overrides(grid) + ([f"run.steps={steps}"] if steps is not None else [])
    if init_from:
        extra.append(f"model.init_from={json.dumps(str(Path(init_from).resolve()))}")
    return extra


def with_method(cfg: Config, method: str | None) -> Config:
    """The config with --method's baseline applied (a name it does not know: a user error)."""
    if not method:
        return cfg
    from mesh.methods import METHODS, apply_method  # after the config is known to be valid

    if method not in METHODS:
        raise ConfigError(f"--method {method}: unknown; choose one of {', '.join(METHODS)}")
    return apply_method(cfg, method)


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


F = TypeVar("F", bound=Callable[..., Any])


def study_options(name: str, quick_help: str) -> Callable[[F], F]:
    """The options of a simulator study: the config, --quick, --out results/NAME, --workers."""

    def wrap(f: F) -> F:
        f = click.option(
            "--workers", type=int, default=2, help="Runs in parallel (one core each)."
        )(f)
        f = click.option("--out", type=click.Path(file_okay=False), default=f"results/{name}")(f)
        f = click.option("--quick", is_flag=True, help=quick_help)(f)
        return config_options(f)

    return wrap


def out_option(name: str) -> Callable[[Any], Any]:
    """A benchmark's --out, results/NAME by default."""
    return click.option(
        "--out", type=click.Path(file_okay=False), default=f"results/{name}", show_default=True
    )


@dataclass(frozen=True)
class StudyArgs:
    """The shared options of a simulator study, as its handler gets them."""

    config_files: tuple[str, ...]
    overrides: tuple[str, ...]
    quick: bool
    out: str
    workers: int

    def config(self, defaults: Sequence[str] = ()) -> Config:
        """The study's base config: `defaults` (the study's own settings) after --config files,
        before --set (which wins)."""
        return load_config(list(self.config_files), [*defaults, *self.overrides])


@dataclass(frozen=True)
class BenchCommand:
    """One `meshtrain bench` command: its handler (its docstring is the command's help; it takes
    the options' values and returns the text to print, or None), its own options (click.option
    decorators, top first), and the shared ones it takes: a simulator study's (`study`: the
    help of its --quick; --config, --set, --quick, --out results/NAME, --workers: the handler
    gets them as one StudyArgs, its first argument), or only the config's (`config`)."""

    name: str
    run: Callable[..., str | None]
    options: tuple[Callable[[Any], Any], ...] = ()
    study: str | None = None
    config: bool = False

    def command(self) -> click.Command:
        run, study = self.run, self.study is not None

        @functools.wraps(run)
        def callback(**values: Any) -> None:
            if study:
                shared = {k: values.pop(k) for k in STUDY_FIELDS}
                text = run(StudyArgs(**shared), **values)
            else:
                text = run(**values)
            if text:
                click.echo(text, nl=not text.endswith("\n"))

        f: Any = user_errors(callback)
        for option in reversed(self.options):
            f = option(f)
        if self.study is not None:
            f = study_options(self.name, self.study)(f)
        elif self.config:
            f = config_options(f)
        return click.command(self.name, help=run.__doc__)(f)


STUDY_FIELDS = ("config_files", "overrides", "quick", "out", "workers")


def parse_seeds(seeds: str | None, option: str = "--seeds") -> list[int] | None:
    """--seeds 0,1,2 or 10-17 (ranges inclusive, mixed: 0,10-12; or another option's
    integers, --stages 4,8) as a sorted list without repeats (None: the study's default)."""
    if not seeds:
        return None
    out: set[int] = set()
    try:
        for part in seeds.split(","):
            lo, sep, hi = part.strip().partition("-")
            first, last = int(lo), int(hi) if sep else int(lo)
            if first < 0 or last < first:
                raise ValueError
            out.update(range(first, last + 1))
    except ValueError:
        raise ConfigError(f"{option} {seeds}: expected integers >= 0 like 0,1 or 10-17") from None
    return sorted(out)
