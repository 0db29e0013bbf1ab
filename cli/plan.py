"""`meshtrain plan`: memory and link needs of every cell, before anyone trains."""

from __future__ import annotations

import json

import click

from cli.options import config_options, resolve_config, user_errors
from mesh.config import ConfigError


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


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
    "--memory-gb", type=float, default=None, help="Device memory to check each cell against."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@user_errors
def plan(
    config_files: tuple[str, ...],
    overrides: tuple[str, ...],
    tokens_per_s: float,
    memory_gb: float | None,
    as_json: bool,
) -> None:
    """Without training: per cell, the fp32 master weights, the stashed versions its schedule
    keeps, gradients, optimizer states, drift and error-feedback buffers, averaging rounds in
    flight, inputs of the microbatches in flight and what one microbatch's forward keeps for its
    backward (runtime.precision) - GB; and the uplink each cell needs at --tokens-per-s, for the
    run's codecs and for the others. Every replica's cell of a stage is the same."""
    if tokens_per_s <= 0:
        raise ConfigError("--tokens-per-s must be > 0")
    cfg = resolve_config(config_files, overrides)
    from cli.report import print_table
    from mesh.engine.plan import link_mbps, plan, uplink_by_codec

    cells = plan(cfg)
    if as_json:
        rows = []
        for c in cells:
            pp, dp = link_mbps(c, cfg, tokens_per_s)
            rows.append({**c.as_dict(), "pp_up_mbps": pp, "dp_up_mbps": dp})
        click.echo(json.dumps({"tokens_per_s": tokens_per_s, "cells": rows}, indent=2))
        return
    m, g = cfg.model, cfg.grid
    click.echo(
        f"{m.arch} d {m.d_model} x {m.n_layers} layers, {sum(c.params for c in cells):,} "
        f"parameters on {g.stages} stages x {g.replicas} replicas; {cfg.pipeline.schedule}, "
        f"microbatch {cfg.pipeline.microbatch_size} x {m.seq_len} tokens, "
        f"{cfg.runtime.precision} compute, optimizer {cfg.optim.name}"
        + (" (8-bit states)" if cfg.optim.state_8bit else "")
    )
    headers = ["stage", "layers", "params", "weights GB", "stash GB (versions)", "grads GB",
               "optimizer GB", "drift+EF GB", "averaging GB", "in flight GB (mb)",
               "mailboxes GB", "activations GB", "total GB"]  # fmt: skip
    if memory_gb:
        headers.append(f"fits {memory_gb:g} GB")
    headers += [f"pp up Mbit/s ({cfg.pipeline.codec})", f"dp up Mbit/s ({cfg.dp.codec})"]
    rows = []
    for c in cells:
        pp, dp = link_mbps(c, cfg, tokens_per_s)
        row = [c.stage, c.layers, f"{c.params:,}", _gb(c.weights_bytes),
               f"{_gb(c.stash_bytes)} ({c.versions})", _gb(c.grad_bytes), _gb(c.optimizer_bytes),
               _gb(c.drift_bytes + c.error_feedback_bytes), _gb(c.averaging_bytes),
               f"{_gb(c.inflight_bytes)} ({c.inflight})", _gb(c.transport_bytes),
               _gb(c.activation_bytes),
               _gb(c.total_bytes)]  # fmt: skip
        if memory_gb:
            row.append("yes" if c.total_bytes <= memory_gb * 1e9 else "no")
        rows.append([*row, f"{pp:,.0f}", f"{dp:,.0f}"])
    print_table(headers, rows)
    click.echo(f"\nuplink per cell at {tokens_per_s:,.0f} tokens/s by codec (Mbit/s):")
    print_table(
        ["codec", "pipeline (busiest cell)", "averaging (largest stage)"],
        [[codec, "-" if pp is None else f"{pp:,.0f}", f"{dp:,.0f}"]
         for codec, pp, dp in uplink_by_codec(cfg, tokens_per_s)],
    )  # fmt: skip
