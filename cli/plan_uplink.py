"""`meshtrain plan --uplink-mbit`: which pipeline boundary and averaging interval fit a cell's
uplink, and what the studies measured each to cost in loss."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from mesh.config import ConfigError


def measured_costs(cfg: Any, results: str | None) -> tuple[dict[str, float], dict[int, float], str]:
    """The studies' loss gaps (shares) by boundary arm (the study's P nearest the run's stages)
    and by averaging interval, and one line saying which file they came from: the costs shipped
    with the package, or --results DIR's studies."""
    from mesh.engine import measured

    if results is None:
        found = measured.read_shipped()
        what = measured.describe(found, cfg.grid.stages, cfg.effective().optim.name)
        line = (
            f"measured costs: {measured.SHIPPED} (shipped with meshtrain; {what})"
            if what
            else f"measured costs: none ({measured.SHIPPED} is missing or empty): every row "
            "'not measured'"
        )
    else:
        found, files = measured.read_results(Path(results))
        what = measured.describe(found, cfg.grid.stages, cfg.effective().optim.name)
        line = (
            f"measured costs: {', '.join(map(str, files))} ({what})"
            if files
            else f"measured costs: none in --results {results} (no boundary/summary.json or "
            "convergence/interval/summary.json): every row 'not measured'"
        )
    boundary, interval = measured.costs_for(found, cfg.grid.stages)
    return boundary, interval, line


def tie_note(best: Any, candidates: list[Any], uplink: float) -> str | None:
    """Why the chosen setting won, where another that fits has the same measured cost: the
    least compressed boundary wins a tie (it carries more of the activations for the same
    measured loss, and a measured gap below zero counts as none), then the shortest averaging
    interval (fresher averages for the same cost)."""
    if best.cost is None:
        return None
    tied = [s for s in candidates if s.busiest_mbps <= uplink and s.cost == best.cost and s != best]
    others = list(dict.fromkeys(s.option.label for s in tied if s.option != best.option))
    if not others:
        if any(s.option == best.option for s in tied):
            return (
                f"tie: longer intervals cost the same measured {_pct(best.cost)}; the shortest "
                "that fits wins (fresher averages)"
            )
        return None
    shown = ", ".join(others[:4]) + (" ..." if len(others) > 4 else "")
    return (
        f"tie: {shown} also fit at the same measured cost ({_pct(best.cost)}; a gap below zero "
        f"counts as none); {best.option.label} wins as the least compressed of them (more of the "
        "activations carried for the same measured loss), then the shortest interval"
    )


def _pct(cost: float | None) -> str:
    return "not measured" if cost is None else f"{100 * cost:+.2f}%"


def answer_uplink(
    cfg: Any,
    tokens_per_s: float,
    uplink: float,
    results: str | None,
    as_json: bool,
    memory: dict[str, Any] | None = None,
) -> None:
    """Which pipeline boundary and averaging interval fit an uplink of `uplink` Mbit/s a cell
    (with memory: --memory-gb's answer too, above the link's)."""
    from mesh.engine import uplink as up

    if uplink <= 0:
        raise ConfigError("--uplink-mbit must be > 0")
    b_costs, i_costs, source = measured_costs(cfg, results)
    cands = up.settings(cfg, tokens_per_s, b_costs, i_costs)
    best = up.choose(cands, uplink)
    shown = up.per_option(cands, uplink)
    tie = None if best is None else tie_note(best, cands, uplink)
    if as_json:
        _echo_uplink_json(tokens_per_s, uplink, source, shown, best, tie, memory)
    else:
        _echo_uplink_table(cfg, tokens_per_s, uplink, source, shown, best, memory)
    if best is None:
        raise _nothing_fits(up.leanest(cands), tokens_per_s, uplink)
    if not as_json:
        sets = " ".join(f"--set {k}={v}" for k, v in best.overrides().items())
        click.echo(
            f"\nchosen: {best.option.label} boundary, a round every {best.interval_steps} "
            f"update(s); busiest cell {best.busiest_mbps:,.1f} of {uplink:g} Mbit/s; measured "
            f"cost {_pct(best.cost)}\n  {sets}"
        )
        if tie is not None:
            click.echo(f"  {tie}")


def _echo_uplink_json(
    tokens_per_s: float,
    uplink: float,
    source: str,
    shown: list[Any],
    best: Any,
    tie: str | None,
    memory: dict[str, Any] | None,
) -> None:
    """`plan --uplink-mbit --json`: every option's needs and cost, the chosen setting's
    overrides and --memory-gb's answer (its lines left out)."""
    rows = [
        {
            "boundary": s.option.label,
            "rank": s.option.rank,
            "codec": s.option.codec,
            "compression": s.option.compression,
            "interval_steps": s.interval_steps,
            "needs_mbps": list(s.needs_mbps),
            "fits": s.busiest_mbps <= uplink,
            "cost": s.cost,
        }
        for s in shown
    ]
    chosen = (
        None
        if best is None
        else {**best.option.overrides(), "dp.interval_steps": best.interval_steps}
    )
    mem = None if memory is None else {k: v for k, v in memory.items() if k != "lines"}
    click.echo(
        json.dumps(
            {
                "uplink_mbit": uplink,
                "tokens_per_s": tokens_per_s,
                "measured_costs": source,
                "options": rows,
                "chosen": chosen,
                "tie": tie,
                "memory": mem,
            },
            indent=2,
        )
    )


def _echo_uplink_table(
    cfg: Any,
    tokens_per_s: float,
    uplink: float,
    source: str,
    shown: list[Any],
    best: Any,
    memory: dict[str, Any] | None,
) -> None:
    """`plan --uplink-mbit`'s table: --memory-gb's lines, where the costs come from, then each
    option's uplink by stage, whether it fits and its measured cost (the chosen one marked)."""
    from cli.report import print_table

    for line in (memory or {}).get("lines", []):
        click.echo(line)
    if memory is not None:
        click.echo("")
    click.echo(source)
    P = cfg.grid.stages
    click.echo(
        f"uplink {uplink:g} Mbit/s a cell at {tokens_per_s:,.0f} tokens/s a replica "
        f"({P} stages x {cfg.grid.replicas} replicas; pipeline + averaging, Mbit/s):"
    )
    headers = [
        "pipeline boundary",
        "width",
        "vs bf16",
        "dp.interval_steps",
        *[f"stage {j}" for j in range(P)],
        "fits",
        "measured loss cost",
    ]
    rows = []
    for s in shown:
        mark = " <- chosen" if best is not None and s.option == best.option else ""
        rows.append(
            [
                s.option.label + mark,
                s.option.rank,
                f"{s.option.compression:.1f}x",
                s.interval_steps,
                *[f"{n:,.1f}" for n in s.needs_mbps],
                "yes" if s.busiest_mbps <= uplink else "no",
                _pct(s.cost),
            ]
        )
    print_table(headers, rows)


def _nothing_fits(lean: Any, tokens_per_s: float, uplink: float) -> ConfigError:
    """The error when no setting fits the uplink: the leanest one's need, and the throughput
    the uplink would carry."""
    most = tokens_per_s * uplink / lean.busiest_mbps
    return ConfigError(
        f"no pipeline boundary and averaging interval fit --uplink-mbit {uplink:g} at "
        f"{tokens_per_s:,.0f} tokens/s: the leanest ({lean.option.label}, "
        f"dp.interval_steps={lean.interval_steps}) needs {lean.busiest_mbps:,.1f} Mbit/s "
        f"at its busiest cell; lower --tokens-per-s to {most:,.0f} or below"
    )
