"""`meshtrain plan`: memory and link needs of every cell, before anyone trains."""

from __future__ import annotations

import json
from typing import Any

import click

from cli.options import config_options, resolve_config, user_errors
from cli.plan_uplink import answer_uplink
from cli.plan_uplink import tie_note as tie_note  # re-exported: its tests read it here
from mesh.config import ConfigError
from mesh.engine.machine import host_memory_bytes, local_gpus


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def _gb_short(n: float) -> str:
    """24 for 24e9, 25.3 for 25.28e9, 144 for 143.8e9: a memory size as a user names it."""
    gb = n / 1e9
    return f"{gb:.0f}" if gb >= 100 else f"{gb:.3g}"


@click.command()
@config_options
@click.option(
    "--tokens-per-s",
    type=float,
    default=10_000.0,
    show_default=True,
    help="Throughput of one replica's pipeline the links must carry.",
)
@click.option(
    "--memory-gb",
    type=float,
    default=None,
    help="Memory to check each cell against (default: this machine's GPU, or its memory when "
    "torch sees no GPU).",
)
@click.option(
    "--uplink-mbit",
    type=float,
    default=None,
    help="Each cell's uplink: say which pipeline boundary and averaging interval fit it, and "
    "what the studies measured each to cost in loss (exit 2 when none fits).",
)
@click.option(
    "--results",
    "results_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Where --uplink-mbit reads the studies' costs (DIR/boundary/, DIR/convergence/"
    "interval/); default: the costs shipped with meshtrain (mesh/engine/measured_costs.json).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@user_errors
def plan(
    config_files: tuple[str, ...],
    overrides: tuple[str, ...],
    tokens_per_s: float,
    memory_gb: float | None,
    uplink_mbit: float | None,
    results_dir: str | None,
    as_json: bool,
) -> None:
    """Without training: per cell, the fp32 master weights, the stashed versions its schedule
    keeps, gradients, optimizer states, drift and error-feedback buffers, averaging rounds in
    flight, inputs of the microbatches in flight and what one microbatch's forward keeps for its
    backward (runtime.precision) - GB; and the uplink each cell needs at --tokens-per-s, for the
    run's codecs and for the others. Every replica's cell of a stage is the same."""
    if tokens_per_s <= 0:
        raise ConfigError("--tokens-per-s must be > 0")
    if memory_gb is not None and memory_gb <= 0:
        raise ConfigError("--memory-gb must be > 0")
    cfg = resolve_config(config_files, overrides)
    if uplink_mbit is not None:
        memory = _memory_with_uplink(cfg, memory_gb) if memory_gb is not None else None
        answer_uplink(cfg, tokens_per_s, uplink_mbit, results_dir, as_json, memory)
        return
    from mesh.engine.plan import plan

    # a run on runtime.device = cpu trains in this machine's memory, whatever GPU it has
    gpus = local_gpus() if cfg.runtime.device != "cpu" else []
    memory, source = memory_to_check(memory_gb, gpus, host_memory_bytes(), cfg.runtime.device)
    # a pool's `auto` stream window holds what fits the memory checked (as a GPU cell's does)
    cells = plan(cfg, memory)
    if as_json:
        _echo_plan_json(cfg, cells, tokens_per_s, memory, source)
        return
    on_host = memory_gb is None and not gpus
    _echo_plan_tables(cfg, cells, tokens_per_s, memory, source, on_host)


def _echo_plan_json(
    cfg: Any, cells: list[Any], tokens_per_s: float, memory: float, source: str
) -> None:
    """`plan --json`: the memory checked, the stages that fit it and every cell's needs."""
    from mesh.engine.plan import link_mbps, stage_to_take, stages_that_fit

    take = stage_to_take(cells, memory)
    rows = []
    for c in cells:
        pp, dp = link_mbps(c, cfg, tokens_per_s)
        fits = c.total_bytes <= memory
        rows.append({**c.as_dict(), "fits": fits, "pp_up_mbps": pp, "dp_up_mbps": dp})
    click.echo(
        json.dumps(
            {
                "tokens_per_s": tokens_per_s,
                "precision": cfg.runtime.precision,
                "masters": "fp32",
                "memory_bytes": memory,
                "memory_source": source,
                "stages_that_fit": stages_that_fit(cells, memory),
                "take_stage": take,
                "cells": rows,
            },
            indent=2,
        )
    )


def _echo_plan_tables(
    cfg: Any, cells: list[Any], tokens_per_s: float, memory: float, source: str, on_host: bool
) -> None:
    """`plan`'s tables: the model in one line, each stage's cell, the memory answer and the
    uplink each codec needs."""
    from cli.report import print_table
    from mesh.engine.plan import uplink_by_codec

    m, g = cfg.model, cfg.grid
    click.echo(
        f"{m.arch} d {m.d_model} x {m.n_layers} layers, {sum(c.params for c in cells):,} "
        f"parameters on {g.stages} stages x {g.replicas} replicas; {cfg.pipeline.schedule}, "
        f"microbatch {cfg.pipeline.microbatch_size} x {m.seq_len} tokens, "
        f"{cfg.runtime.precision} compute, optimizer {cfg.effective().optim.name}"
        + (" (8-bit states)" if cfg.optim.state_8bit else "")
    )
    click.echo(cfg.depth_rule_line())
    headers = [
        "stage",
        "layers",
        "params",
        "weights GB",
        "stash GB (versions)",
        "grads GB",
        "optimizer GB",
        "drift+EF GB",
        "averaging GB",
        "in flight GB (mb)",
        "mailboxes GB",
        "activations GB",
        "total GB",
        f"fits {_gb_short(memory)} GB",
        f"pp up Mbit/s ({cfg.pipeline.codec})",
        f"dp up Mbit/s ({cfg.dp.codec})",
    ]
    rows = [_plan_row(c, cfg, tokens_per_s, memory) for c in cells]
    print_table(headers, rows)
    click.echo("")
    for line in memory_answer(cfg, cells, memory, source, on_host=on_host):
        click.echo(line)
    click.echo(f"\nuplink per cell at {tokens_per_s:,.0f} tokens/s by codec (Mbit/s):")
    print_table(
        ["codec", "pipeline (busiest cell)", "averaging (largest stage)"],
        [
            [codec, "-" if pp is None else f"{pp:,.0f}", "-" if dp is None else f"{dp:,.0f}"]
            for codec, pp, dp in uplink_by_codec(cfg, tokens_per_s)
        ],
    )


def _plan_row(c: Any, cfg: Any, tokens_per_s: float, memory: float) -> list[Any]:
    """One stage's cell in `plan`'s table: its memory by part, whether it fits, its uplinks."""
    from mesh.engine.plan import link_mbps

    pp, dp = link_mbps(c, cfg, tokens_per_s)
    return [
        c.stage,
        c.layers,
        f"{c.params:,}",
        _gb(c.weights_bytes),
        f"{_gb(c.stash_bytes)} ({c.versions})",
        _gb(c.grad_bytes),
        _gb(c.optimizer_bytes),
        _gb(c.drift_bytes + c.error_feedback_bytes),
        _gb(c.averaging_bytes),
        f"{_gb(c.inflight_bytes)} ({c.inflight})",
        _gb(c.transport_bytes),
        _gb(c.activation_bytes),
        _gb(c.total_bytes),
        "yes" if c.total_bytes <= memory else "no",
        f"{pp:,.0f}",
        f"{dp:,.0f}",
    ]


def memory_to_check(
    memory_gb: float | None, gpus: list[tuple[str, int]], host_bytes: int, device: str = "auto"
) -> tuple[float, str]:
    """(bytes, where that figure comes from) a cell is checked against: --memory-gb, else this
    machine's GPU (the smallest, as a simulated grid spreads its cells over all of them), else
    this machine's memory, which is where runtime.device = auto trains when torch sees no GPU
    (and runtime.device = cpu always: the caller then passes no GPUs)."""
    if memory_gb is not None:
        return memory_gb * 1e9, f"--memory-gb {memory_gb:g}"
    if gpus:
        name, total = min(gpus, key=lambda g: g[1])
        of = f", the smallest of {len(gpus)}" if len(gpus) > 1 else ""
        return float(total), f"this machine's GPU: {name}, {_gb_short(total)} GB{of}"
    host = _gb_short(host_bytes)
    if device == "cpu":
        return float(host_bytes), f"runtime.device = cpu: this machine's memory, {host} GB"
    return float(host_bytes), (
        f"no GPU here (torch sees none): assumed this machine's memory, {host} GB, where "
        "runtime.device = auto trains; give --memory-gb G for a GPU's"
    )


def memory_answer(
    cfg: Any, cells: list[Any], memory: float, source: str, on_host: bool = False
) -> list[str]:
    """The lines under the table: the precision, what memory was checked, the stage to take
    (on_host: the memory is this machine's, which a simulate of the whole grid shares)."""
    from mesh.config import with_overrides
    from mesh.engine.plan import at_precision, plan, stage_to_take, stages_that_fit

    precision = cfg.runtime.precision
    lines = [
        f"precision: {precision} compute (runtime.precision); master weights, optimizer states, "
        "drift and averaging in fp32",
        f"memory: {source}",
    ]
    if on_host:
        grid = sum(c.total_bytes for c in cells) * cfg.grid.replicas
        lines.append(
            f"  the whole grid, as `meshtrain simulate` runs it here: {_gb(grid)} GB, "
            + ("fits" if grid <= memory else "does not fit")
        )
    fit = stages_that_fit(cells, memory)
    take = stage_to_take(cells, memory)
    with_gb = f"with {_gb_short(memory)} GB"
    if take is not None:
        which = "every stage fits" if len(fit) == len(cells) else _fit_phrase(fit)
        lines.append(
            f"{with_gb}: {which}; take stage {take} (the largest that fits, leaving the smaller "
            f"ones to peers with less memory): meshtrain join --stage {take} ..."
        )
        bf16 = at_precision(cfg, cells, "bf16")[take].total_bytes
        if precision == "fp32" and bf16 < 0.95 * cells[take].total_bytes:
            lines.append(
                f"  --set runtime.precision=bf16 would take stage {take} from "
                f"{_gb(cells[take].total_bytes)} to {_gb(bf16)} GB"
            )
        return lines
    smallest = min(cells, key=lambda c: c.total_bytes)
    lines.append(
        f"{with_gb}: no stage fits; the smallest, stage {smallest.stage}, needs "
        f"{_gb(smallest.total_bytes)} GB"
    )
    lean = {"runtime.precision": "bf16", "optim.state_8bit": True}
    lean = {k: v for k, v in lean.items() if _get(cfg, k) != v}
    if lean:
        leaner = plan(with_overrides(cfg, lean))
        sets = " ".join(f"--set {k}={str(v).lower()}" for k, v in lean.items())
        take = stage_to_take(leaner, memory)
        if take is not None:
            lines.append(
                f"  with {sets}: {_fit_phrase(stages_that_fit(leaner, memory))}; take "
                f"stage {take} ({_gb(leaner[take].total_bytes)} GB)"
            )
            return lines
        least = min(c.total_bytes for c in leaner)
        lines.append(f"  with {sets} the smallest needs {_gb(least)} GB")
    lines.append("  more stages (grid.stages) make each smaller")
    return lines


def _get(cfg: Any, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def _fit_phrase(stages: list[int]) -> str:
    if len(stages) == 1:
        return f"stage {stages[0]} fits"
    return f"stages {', '.join(str(j) for j in stages)} fit"


def _memory_with_uplink(cfg: Any, memory_gb: float) -> dict[str, Any]:
    """The memory answer of --memory-gb, kept when --uplink-mbit asks the link question too."""
    from mesh.engine.plan import plan, stage_to_take, stages_that_fit

    memory, source = memory_to_check(memory_gb, [], 0, cfg.runtime.device)
    cells = plan(cfg, memory)
    return {
        "memory_bytes": memory,
        "memory_source": source,
        "stages_that_fit": stages_that_fit(cells, memory),
        "take_stage": stage_to_take(cells, memory),
        "lines": memory_answer(cfg, cells, memory, source),
    }
