"""`meshtrain plan`: memory and link needs of every cell, before anyone trains."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
    default="results",
    show_default=True,
    help="Where --uplink-mbit reads the studies' costs (boundary/, convergence/interval/).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@user_errors
def plan(
    config_files: tuple[str, ...],
    overrides: tuple[str, ...],
    tokens_per_s: float,
    memory_gb: float | None,
    uplink_mbit: float | None,
    results_dir: str,
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
    if uplink_mbit is not None:
        _uplink(cfg, tokens_per_s, uplink_mbit, Path(results_dir), as_json)
        return
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
        [[codec, "-" if pp is None else f"{pp:,.0f}", "-" if dp is None else f"{dp:,.0f}"]
         for codec, pp, dp in uplink_by_codec(cfg, tokens_per_s)],
    )  # fmt: skip


def measured_costs(cfg: Any, results: Path) -> tuple[dict[str, float], dict[int, float]]:
    """The studies' loss gaps (shares): by boundary arm from results/boundary (its P nearest the
    run's stages), by averaging interval from results/convergence/interval."""
    boundary: dict[str, float] = {}
    path = results / "boundary" / "summary.json"
    if path.is_file():
        rows = [
            r for r in json.loads(path.read_text()).get("rows", []) if r.get("loss_gap") is not None
        ]
        if rows:
            p = min({r["P"] for r in rows}, key=lambda p: (abs(p - cfg.grid.stages), p))
            boundary = {r["arm"]: r["loss_gap"] for r in rows if r["P"] == p}
    interval: dict[int, float] = {}
    path = results / "convergence" / "interval" / "summary.json"
    if path.is_file():
        for r in json.loads(path.read_text()).get("rows", []):
            if r.get("loss_gap") is not None:
                interval[int(r["interval_steps"])] = r["loss_gap"]
    return boundary, interval


def _pct(cost: float | None) -> str:
    return "not measured" if cost is None else f"{100 * cost:+.2f}%"


def _uplink(cfg: Any, tokens_per_s: float, uplink: float, results: Path, as_json: bool) -> None:
    """Which pipeline boundary and averaging interval fit an uplink of `uplink` Mbit/s a cell."""
    from cli.report import print_table
    from mesh.engine import uplink as up

    if uplink <= 0:
        raise ConfigError("--uplink-mbit must be > 0")
    b_costs, i_costs = measured_costs(cfg, results)
    cands = up.settings(cfg, tokens_per_s, b_costs, i_costs)
    best = up.choose(cands, uplink)
    shown = up.per_option(cands, uplink)
    if as_json:
        rows = [{"boundary": s.option.label, "rank": s.option.rank, "codec": s.option.codec,
                 "compression": s.option.compression, "interval_steps": s.interval_steps,
                 "needs_mbps": list(s.needs_mbps), "fits": s.busiest_mbps <= uplink,
                 "cost": s.cost} for s in shown]  # fmt: skip
        chosen = (
            None
            if best is None
            else {**best.option.overrides(), "dp.interval_steps": best.interval_steps}
        )
        click.echo(json.dumps({"uplink_mbit": uplink, "tokens_per_s": tokens_per_s,
                               "options": rows, "chosen": chosen}, indent=2))  # fmt: skip
    else:
        P = cfg.grid.stages
        click.echo(
            f"uplink {uplink:g} Mbit/s a cell at {tokens_per_s:,.0f} tokens/s a replica "
            f"({P} stages x {cfg.grid.replicas} replicas; pipeline + averaging, Mbit/s):"
        )
        headers = ["pipeline boundary", "width", "vs bf16", "dp.interval_steps",
                   *[f"stage {j}" for j in range(P)], "fits", "measured loss cost"]  # fmt: skip
        rows = []
        for s in shown:
            mark = " <- chosen" if best is not None and s.option == best.option else ""
            rows.append([s.option.label + mark, s.option.rank, f"{s.option.compression:.1f}x",
                         s.interval_steps, *[f"{n:,.1f}" for n in s.needs_mbps],
                         "yes" if s.busiest_mbps <= uplink else "no", _pct(s.cost)])  # fmt: skip
        print_table(headers, rows)
    if best is None:
        lean = up.leanest(cands)
        most = tokens_per_s * uplink / lean.busiest_mbps
        raise ConfigError(
            f"no pipeline boundary and averaging interval fit --uplink-mbit {uplink:g} at "
            f"{tokens_per_s:,.0f} tokens/s: the leanest ({lean.option.label}, "
            f"dp.interval_steps={lean.interval_steps}) needs {lean.busiest_mbps:,.1f} Mbit/s "
            f"at its busiest cell; lower --tokens-per-s to {most:,.0f} or below"
        )
    if not as_json:
        sets = " ".join(f"--set {k}={v}" for k, v in best.overrides().items())
        click.echo(
            f"\nchosen: {best.option.label} boundary, a round every {best.interval_steps} "
            f"update(s); busiest cell {best.busiest_mbps:,.1f} of {uplink:g} Mbit/s; measured "
            f"cost {_pct(best.cost)}\n  {sets}"
        )
