"""The handlers and options of the `meshtrain bench` commands that measure the system's parts
rather than train a study: codecs and transports (comms), grids' tokens/s on shaped links
(throughput), the process runtime against the simulator (runtime), a cell's compute (model) and
a real-size stage's state paths (scale-model). cli/bench.py's table makes them commands."""

from __future__ import annotations

from pathlib import Path

import click

from cli.options import out_option, resolve_config
from mesh.config import ConfigError, load_config

COMMS_OPTIONS = (
    click.option("--quick", is_flag=True, help="Fewer repetitions (about a minute)."),
    click.option("--out", type=click.Path(file_okay=False), default="results/comms"),
)


def comms(quick: bool, out: str) -> str:
    """Codecs, transports (hivemind and torch.distributed), group means and link shaping."""
    # comms knows nothing of models: this benchmark needs no config
    from mesh.bench.comms import run_comms_bench

    run_comms_bench(Path(out), quick=quick)
    return (Path(out) / "table.md").read_text()


THROUGHPUT_OPTIONS = (
    click.option("--quick", is_flag=True, help="One short window per method (about 2 minutes)."),
    click.option(
        "--out",
        type=click.Path(file_okay=False),
        default="results/throughput",
        show_default=True,
        help="Where summary.json, table.md and each window's metrics go.",
    ),
    click.option(
        "--real-size",
        is_flag=True,
        help="Only the real-size grid: llama-1b boundary shapes, 4x2 over a 100 Mbit/s uplink a "
        "cell and 50 ms, compute at 40% of an H100, full fp8 against compressed boundaries, time "
        "dilated to fit this host (10-30 minutes).",
    ),
)


def throughput(
    config_files: tuple[str, ...],
    overrides: tuple[str, ...],
    quick: bool,
    out: str,
    real_size: bool,
) -> str | None:
    """Grids A1-A4, emulated compute on shaped links: FullSync vs AsyncMesh, interleaved.

    The protocol's settings (d=128, L=4, T=128, B=8, M=4, t_f=10 ms, t_b=20 ms) apply after
    --config files and before --set (which wins).
    """
    from mesh.bench.throughput.protocol import BENCH_SETS
    from mesh.bench.throughput.runs import run_throughput

    if real_size:
        from mesh.bench.throughput.real_size import (
            merge_into,
            real_size_table,
            run_real_size,
            with_loss_costs,
        )

        base = load_config(list(config_files), list(overrides))
        entry = run_real_size(base, Path(out) / "real-size", steps=20 if quick else 60)
        entry = with_loss_costs(entry, Path(out).parent)
        merge_into(Path(out), entry)
        return real_size_table(entry)
    cfg = load_config(list(config_files), [*BENCH_SETS, *overrides])
    run_throughput(cfg, Path(out), quick=quick)
    return None


RUNTIME_OPTIONS = (
    click.option("--quick", is_flag=True, help="40 updates instead of 200."),
    click.option("--out", type=click.Path(file_okay=False), default="results/runtime"),
)


def runtime(
    config_files: tuple[str, ...], overrides: tuple[str, ...], quick: bool, out: str
) -> None:
    """Multi-process runs (torch, hivemind) against the simulator: same config and seed,
    validation loss at equal tokens."""
    from mesh.bench.runtime import run_equivalence

    run_equivalence(resolve_config(config_files, overrides), Path(out), quick=quick)


MODEL_OPTIONS = (
    click.option("--quick", is_flag=True, help="llama-20m only, short sequences (about a minute)."),
    out_option("model"),
    click.option(
        "--device",
        type=click.Choice(["auto", "cpu", "cuda"]),
        default="auto",
        show_default=True,
        help="auto: cuda when present.",
    ),
    click.option(
        "--preset",
        "presets",
        multiple=True,
        type=click.Choice(["tiny", "llama-20m", "llama-160m", "llama-1b"]),
        help="Only these models (repeatable; default llama-20m and llama-160m, --quick "
        "llama-20m; llama-1b wants a GPU).",
    ),
)


def model(quick: bool, out: str, device: str, presets: tuple[str, ...]) -> str:
    """Per stage of llama-20m and llama-160m (or --preset), fp32 and bf16: a cell's
    forward+backward against a plain torch loop over the same layers, tokens/s, FLOP/s (MFU on
    CUDA) and peak memory against `meshtrain plan`."""
    import torch

    from cli.report import progress_bar
    from mesh.bench.model import PRESETS, run_model_bench

    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda, but torch sees no GPU; use auto or cpu")
    chosen = presets or (PRESETS[:1] if quick else PRESETS)
    total = sum(2 * load_config([f"configs/models/{p}.toml"]).grid.stages for p in chosen)
    with progress_bar(total, "bench model") as bar:
        run_model_bench(Path(out), quick, device, lambda row: bar.goto(bar.bar.n + 1), chosen)
    return (Path(out) / "table.md").read_text()


SCALE_MODEL_OPTIONS = (
    click.option(
        "--preset",
        "presets",
        multiple=True,
        type=click.Choice(["llama-160m", "llama-1b"]),
        help="Only these models (default both; llama-1b needs about 16 GB of memory).",
    ),
    out_option("scale-model"),
    click.option("--no-download", is_flag=True, help="Skip the state download (two processes)."),
)


def scale_model(presets: tuple[str, ...], out: str, no_download: bool) -> str:
    """The largest stage of llama-160m and llama-1b at real size on this machine: build, one
    update, the averaging round's host cost, checkpoint save and load, and a state download
    over loopback, each with its peak RSS against `meshtrain plan`."""
    from cli.report import progress_bar
    from mesh.bench.scale_model import PRESETS, run_scale_model_bench

    chosen = presets or PRESETS
    steps = len(chosen) * (2 if no_download else 3)
    with progress_bar(steps, "bench scale-model") as bar:
        run_scale_model_bench(
            Path(out), chosen, lambda _: bar.goto(bar.bar.n + 1), download=not no_download
        )
    return (Path(out) / "table.md").read_text()
