"""What a launcher checks before any cell process starts or any file is written: a mistake
costs the user one line and exit 2 within seconds, not eight tracebacks after twenty.

- the data: the corpus loads (path exists, UTF-8, long enough; a prepared dataset's manifest
  and shard sizes, and with --verify-data its shards' hashes), it is the run's (data.digest),
  and its tokens fit the vocabulary;
- the machine: transport.host can be bound, runtime.device = cuda has a GPU;
- the settings a process grid cannot act out: emulation.deaths but for a cell out from the
  start (`simulate` never starts it), dp.noise_codec;
- a resume: the directory is a run, the new config changes nothing that the updates so far
  depend on, and every cell has an intact checkpoint at a common step (newer damaged files are
  passed over, and the user is told).
"""

from __future__ import annotations

import importlib.util
import socket
from dataclasses import dataclass
from pathlib import Path

from mesh.algo.topology import cell_name
from mesh.config import (
    LOCAL_PREFIXES,
    LOCAL_SECTIONS,
    Config,
    ConfigError,
    load_config,
    with_overrides,
)
from mesh.errors import CheckpointError, need_extra

# settings a resume may change: they decide where the run stops, how it is watched and how
# its peers connect, never the math of an update (checked again through the state fingerprint)
RESUMABLE = ("run.steps", "run.eval_every", "run.threads", "data.val_batches", *LOCAL_PREFIXES)


def check_data(cfg: Config, verify: bool = False, run_data: dict | None = None):
    """The corpus every cell will load, loaded once here; DataError / ConfigError if unusable.
    (Returns a mesh.data.Corpus; torch is imported only here.)

    verify: hash every shard of a prepared dataset against its manifest (--verify-data).
    run_data: the identity of the run's dataset (its DHT record), to say what differs when
    this peer's data is not the run's."""
    from mesh.data.corpus import load_corpus
    from mesh.data.manifest import describe_difference, identity, verify_shards
    from mesh.errors import DataError

    corpus = load_corpus(cfg.data.path, cfg.data.val_fraction, cfg.model.seq_len)
    want = cfg.data.digest
    if want is not None and corpus.digest != want:
        what = (
            describe_difference(identity(corpus.manifest), run_data)
            if run_data is not None and corpus.manifest is not None
            else f"digest {corpus.digest[:16]} here"
        )
        raise DataError(
            f"data.path = {cfg.data.path!r} is not the run's dataset (data.digest "
            f"{want[:16]}): {what}; use a copy of the run's data (--set data.path=YOUR_COPY)"
        )
    if corpus.manifest is not None:
        if verify:
            verify_shards(Path(cfg.data.path), corpus.manifest)
        if corpus.vocab_size > cfg.model.vocab_size:
            raise ConfigError(
                f"model.vocab_size = {cfg.model.vocab_size}, but the dataset's tokenizer has "
                f"{corpus.vocab_size} tokens ({cfg.data.path}/manifest.json); set "
                f"model.vocab_size to at least {corpus.vocab_size}, or leave it unset"
            )
        return corpus
    top = int(max(corpus.train.max(), corpus.val.max()))
    if top >= cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size = {cfg.model.vocab_size}, but the data has token ids up to {top} "
            f"(byte-level text: 0..255); set model.vocab_size to at least {top + 1}"
        )
    return corpus


def check_extras(cfg: Config) -> None:
    """The optional packages the config's features need are installed (else one line, exit 2,
    before any cell starts): metrics exporters and 8-bit optimizer states."""
    wanted = [  # (module, the setting that needs it, whether it is on)
        ("tensorboard", "metrics.tensorboard", cfg.metrics.tensorboard),
        ("prometheus_client", "metrics.prometheus_port", bool(cfg.metrics.prometheus_port)),
        ("bitsandbytes", "optim.state_8bit", cfg.optim.state_8bit),
    ]
    for module, key, on in wanted:
        if on and importlib.util.find_spec(module) is None:
            raise need_extra(module, key)


def check_deaths(cfg: Config, command: str) -> None:
    """emulation.deaths as this command's processes can act it out (else one line, exit 2,
    before any cell starts): `simulate` on torch or hivemind leaves out a cell dead from update
    0 for good ("sJrI@0": never started) and kills none mid-run; `train` and `join` start one
    cell each, whose peers someone else starts, and take no deaths at all."""
    from mesh.algo.routing import mid_run_deaths, parse_deaths

    items = cfg.emulation.deaths
    if not items:
        return
    if command != "simulate":
        raise ConfigError(
            f"emulation.deaths = {list(items)} is acted out by `meshtrain simulate` only; "
            f"`{command}` runs real peers: take a cell out by stopping its process, and "
            "drop the setting (--set emulation.deaths=[])"
        )
    g = cfg.grid
    mid = mid_run_deaths(parse_deaths(items, g.stages, g.replicas))
    if mid:
        cell = mid[0].split("@")[0]
        raise ConfigError(
            f"emulation.deaths {', '.join(repr(x) for x in mid)}: a cell that dies during the "
            "run or comes back is acted out by --backend logical only; on torch and hivemind "
            f'a cell can only be out from the start ("{cell}@0": never started); use '
            "--backend logical, or write the span as sJrI@0"
        )


def check_machine(cfg: Config) -> None:
    if cfg.dp.noise_codec != "none":
        raise ConfigError(
            f"dp.noise_codec = {cfg.dp.noise_codec!r} is a study instrument of the simulator; "
            "set it to 'none', or run on one process (`simulate --backend logical`)"
        )
    host = cfg.transport.host
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
    except OSError as e:
        raise ConfigError(
            f"transport.host = {host!r}: cannot listen there ({e.strerror or e}); use an address "
            "of this machine, e.g. 127.0.0.1"
        ) from None
    check_extras(cfg)
    if cfg.runtime.device == "cuda" and cfg.emulation.compute == "real":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("runtime.device = cuda, but torch sees no GPU; use auto or cpu")


def resume_config(
    run_dir: Path, config_files: list[str], overrides: list[str]
) -> tuple[Config, Config]:
    """(the run's stored config, the config to resume with): the stored one with the user's
    files and --set on top. ConfigError when run_dir is not a run, or when the new settings
    would change the math of the updates already made."""
    toml, ckpts = run_dir / "config.toml", run_dir / "checkpoints"
    if not toml.is_file():
        raise ConfigError(f"--resume {run_dir}: not a run directory (no config.toml)")
    if not any(ckpts.glob("*/step-*.pt")) and not (run_dir / "metrics").is_dir():
        raise ConfigError(
            f"--resume {run_dir}: not a run directory (no checkpoints under {ckpts}); a run "
            "saves every checkpoint.every updates and on a clean stop"
        )
    stored = load_config([toml])
    new = load_config([toml, *config_files], overrides)
    if new.run.schedule_steps is None:  # a longer run keeps the horizon it started with
        new = with_overrides(new, {"run.schedule_steps": stored.schedule_horizon})
    if new.state_fingerprint() != stored.state_fingerprint():
        changed = [k for k in changed_keys(stored, new) if not k.startswith(RESUMABLE)]
        raise ConfigError(
            f"--resume {run_dir}: {', '.join(changed) or 'the config'} would change the math of "
            f"the {stored.run.steps}-step run so far; a resume may change only "
            "run.steps, run.eval_every, run.threads, data.val_batches and the local sections ("
            f"{', '.join(LOCAL_SECTIONS)})"
        )
    return stored, new


def changed_keys(a: Config, b: Config) -> list[str]:
    flat_a, flat_b = _flat(a.model_dump(mode="json")), _flat(b.model_dump(mode="json"))
    return sorted(k for k in flat_a.keys() | flat_b.keys() if flat_a.get(k) != flat_b.get(k))


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


@dataclass(frozen=True)
class Resume:
    step: int  # the oldest replica's step (where the progress bar and the rates start)
    notes: list[str]  # what the user should hear (damaged files passed over)
    replica_steps: dict[int, int | None]  # where each replica resumes (None: from the start)
    # hivemind, pools: where each cell resumes (its own newest save; None: from the start)
    cell_steps: dict[tuple[int, int], int | None] | None = None


def check_resume(cfg: Config, run_dir: Path) -> Resume:
    """The step each replica resumes from: the newest one all its cells have intact (replicas
    need not agree: each trains on from its own newest cut, none loses what it saved), or the
    start for a replica with none (a run stopped, or out of disk space, before its cells all
    saved one step). Damaged newer files are renamed *.pt.bad (kept for a post-mortem, out of
    every later resume's way)."""
    from mesh.runtime.checkpoint import resume_point

    if cfg.transport.backend == "hivemind" or cfg.pipeline.pooled:
        return _resume_cells(cfg, run_dir)
    fp, damaged, steps, notes = cfg.state_fingerprint(), [], {}, []
    for i in range(cfg.grid.replicas):
        point = resume_point(run_dir, [(j, i) for j in range(cfg.grid.stages)], fp)
        if point.foreign:
            raise CheckpointError(
                f"--resume {run_dir}: checkpoints written by another config "
                f"({describe(point.foreign[0])}); resume with the config.toml the run wrote"
            )
        if point.step is None:
            notes.append(
                f"replica {i} starts again from step 0: no step that every one of its cells "
                "saved intact"
            )
        damaged += point.damaged
        steps[i] = point.step
    _set_aside(run_dir, damaged, notes)
    if len({s or 0 for s in steps.values()}) > 1:
        notes.append(
            "resuming "
            + ", ".join(f"replica {i} from step {s or 0}" for i, s in steps.items())
            + " (the newest step all of each replica's cells saved)"
        )
    return Resume(min(s or 0 for s in steps.values()), notes, steps)


def _resume_cells(cfg: Config, run_dir: Path) -> Resume:
    """check_resume on hivemind or with stage pools: each cell from its own newest intact
    checkpoint (a stop saves each where it finds it, a step or so apart along a pipeline; the
    sessions take a replica's cells at different steps, as after a `join`; a pool's cells take
    different numbers of updates)."""
    from mesh.runtime.checkpoint import FOREIGN, check_checkpoint, checkpoint_path, saved_steps

    fp, damaged, cells, notes = cfg.state_fingerprint(), [], {}, []
    for i in range(cfg.grid.replicas):
        for j in range(cfg.grid.stages):
            cells[(j, i)] = None
            for step in reversed(saved_steps(run_dir, j, i)):
                why = check_checkpoint(checkpoint_path(run_dir, j, i, step), fp, j, i)
                if why is None:
                    cells[(j, i)] = step
                    break
                if why.startswith(FOREIGN):
                    raise CheckpointError(
                        f"--resume {run_dir}: checkpoints written by another config "
                        f"({describe((j, i, step, why))}); resume with the config.toml the run "
                        "wrote"
                    )
                damaged.append((j, i, step, why))
    _set_aside(run_dir, damaged, notes)
    fresh = [cell_name(*c) for c, s in cells.items() if s is None]
    if fresh:
        notes.append(f"{', '.join(fresh)} start again from step 0: no intact checkpoint")
    replicas = {
        i: min(s or 0 for (_, r), s in cells.items() if r == i) for i in range(cfg.grid.replicas)
    }
    return Resume(min(replicas.values()), notes, replicas, cells)


def _set_aside(run_dir: Path, damaged: list, notes: list[str]) -> None:
    """Rename the damaged files *.pt.bad (out of every later resume's way) and say so first."""
    from mesh.runtime.checkpoint import checkpoint_path

    for stage, replica, step, _ in damaged:
        path = checkpoint_path(run_dir, stage, replica, step)
        if path.exists():
            path.rename(path.with_name(path.name + ".bad"))
    if damaged:
        notes.insert(
            0,
            "passed over damaged checkpoints (renamed *.pt.bad): "
            + "; ".join(map(describe, damaged)),
        )


def describe(damage: tuple[int, int, int, str]) -> str:
    stage, replica, step, why = damage
    return f"{cell_name(stage, replica)} step {step}: {why}"
