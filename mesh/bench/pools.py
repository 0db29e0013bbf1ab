"""`meshtrain bench pools`: stage pools against fixed wiring, side by side in one run.

Process grids (torch backend, emulated compute: every cell its own process, real payloads
through real links, forward/backward as waits of forward_ms/backward_ms x the cell's slowdown,
stretched so the 2-core host is not the bottleneck), per scenario:
- gpu-mix: 4x8, each cell's speed drawn from {1, 1, 0.5, 0.25} (seeded);
- dead-10: 4x8 with 10% of the cells (3) dead from the start, one per stage from stage 1 on
  (fixed wiring loses their replicas; pools lose their capacity);
- churn: 4x4, a random live cell SIGKILLed every `churn_every_s` and started again from its
  checkpoint by the launcher (a fresh peer in its place);
- equal: 3x3, every cell at one speed, none dead (what pools cost where nothing needs routing
  around).
Arms: fixed and pools. Each arm: tokens/s over the steady window (the streams' progress,
sampled on the bench's clock so that a restart's replayed steps count once, from a quarter of it
on, while every stream is live; to the run's end beside it), the bounds
of the capacity model for the same speeds (mesh/algo/routing: fixed_bound, pool_bound;
microbatches a second: speed / (forward + backward) per cell), the fraction of the pool bound
reached, the staleness (mean updates between a microbatch's read version and its update), and
the microbatches voided.

Targets: pools >= 1.4x fixed in gpu-mix; >= 0.95x fixed with equal peers; pools >= 0.85 of the
pool bound.

Writes summary.json, table.md and throughput.png under --out (results/pools).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from mesh.algo import routing
from mesh.algo.topology import cell_name
from mesh.bench.pools_cells import bottleneck, stage_shares
from mesh.config import Config, load_config
from mesh.report import format_table, pyplot
from mesh.runtime.launch import run_grid
from mesh.runtime.metrics import read_metrics
from mesh.runtime.rows import parse_rows

SPEEDS = (1.0, 1.0, 0.5, 0.25)
TARGET_VS_FIXED = 1.4  # gpu-mix
TARGET_EQUAL_VS_FIXED = 0.95  # equal peers: what routing may cost where no peer needs avoiding
TARGET_OF_BOUND = 0.85
STEADY_FROM = 0.25  # share of the run's wall time left out as warm-up
RUN_TIMEOUT_S = 900  # a hang guard per arm


def scenario_speeds(name: str, stages: int, replicas: int, seed: int = 0) -> list[list[float]]:
    """speeds[stage][replica] of a scenario (0: dead from the start)."""
    rng = random.Random(seed)
    if name == "gpu-mix":
        return [[rng.choice(SPEEDS) for _ in range(replicas)] for _ in range(stages)]
    speeds = [[1.0] * replicas for _ in range(stages)]
    if name == "dead-10":
        dead = max(1, round(0.1 * stages * replicas))
        for k in range(dead):  # spread over the stages after the first (stage 0: the streams)
            j = 1 + k % (stages - 1)
            speeds[j][rng.randrange(replicas)] = 0.0
    return speeds


def arm_config(
    scenario: str, arm: str, speeds: list[list[float]], steps: int, base: list[str]
) -> Config:
    P, m = len(speeds), len(speeds[0])
    cells = [(j, i, speeds[j][i]) for j in range(P) for i in range(m)]
    slow = [f'"{cell_name(j, i)}={1 / s:g}"' for j, i, s in cells if 0 < s < 1]
    dead = [f'"{cell_name(j, i)}@0"' for j, i, s in cells if s == 0]
    sets = [
        f"grid.stages={P}",
        f"grid.replicas={m}",
        f"run.steps={steps}",
        f"pipeline.routing='{arm}'",
        "emulation.compute='emulated'",
        f"emulation.slowdowns=[{', '.join(slow)}]",
        f"emulation.deaths=[{', '.join(dead)}]",
        "checkpoint.every=20",
        "elastic.max_restarts=1000",
        "elastic.pool_timeout_s=10",
        *base,
    ]
    return load_config([], sets)


def measure(
    cfg: Config, out: Path, speeds: list[list[float]], churn_every_s: float | None = None
) -> dict[str, Any]:
    """Run one arm's grid; its steady tokens/s, staleness and voided microbatches, and where
    each stage's time went (not under churn: a restarted cell's clock starts again)."""
    killer = None
    stop = threading.Event()
    if churn_every_s:
        killer = threading.Thread(target=_churn, args=(out, churn_every_s, stop), daemon=True)
        killer.start()
    samples: list[tuple[float, dict[str, int]]] = []
    sampler = threading.Thread(target=_sample, args=(out, samples, stop), daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    try:
        ok = run_grid(cfg, out, timeout_s=RUN_TIMEOUT_S).ok
    except TimeoutError:  # reported as not ok, with what it measured until then
        ok = False
    wall = time.perf_counter() - t0
    stop.set()
    sampler.join()
    samples.append((time.perf_counter(), _stream_steps(out)))
    all_live, to_the_end = steady_rates(samples, cfg.tokens_per_microbatch)
    rows = read_metrics(out)
    stale_n = stale_sum = voided = refused = rerouted = 0
    for v in rows.values():
        final = [r for r in v if r.get("final")]
        if not final:
            continue
        for k, n in final[-1].get("staleness_hist", {}).items():
            stale_n, stale_sum = stale_n + n, stale_sum + int(k) * n
        voided += final[-1].get("voided", 0)
        refused += final[-1].get("refused", 0)
        rerouted += final[-1].get("rerouted", 0)
    return {
        "ok": ok,
        "wall_s": round(wall, 1),
        "tokens_per_s": all_live,
        "tokens_per_s_to_the_end": to_the_end,
        "staleness_mean": round(stale_sum / stale_n, 3) if stale_n else None,
        "voided": voided,
        "refused": refused,  # pools: microbatches a full cell turned away (each sent again)
        "rerouted": rerouted,
        "stages": None if churn_every_s else stage_shares(rows, speeds),
        "lives": sum(
            sum(1 for r in read_metrics(out, events=True).get(k, []) if r.get("event") == "started")
            for k in rows
        ),
    }


SAMPLE_S = 0.5  # how often the bench reads the streams' progress


def _stream_steps(out: Path) -> dict[str, int]:
    """Each stream's (stage-0 cell's) newest step in its metrics file, over all its lives."""
    steps = {}
    for path in (out / "metrics").glob("0-*.jsonl"):
        rows = parse_rows(path.read_bytes())
        done = [r["step"] for r in rows if "loss" in r and isinstance(r.get("step"), int)]
        if done:
            steps[path.stem] = max(done)
    return steps


def _sample(out: Path, samples: list[tuple[float, dict[str, int]]], stop: threading.Event) -> None:
    """The streams' progress on the bench's own clock (a cell's rows carry its life's clock, so a
    restarted cell's rows cannot be laid beside the others')."""
    while not stop.wait(SAMPLE_S):
        if (out / "metrics").is_dir():
            samples.append((time.perf_counter(), _stream_steps(out)))


def steady_rates(
    samples: list[tuple[float, dict[str, int]]], tokens_per_microbatch: int
) -> tuple[float, float]:
    """(tokens/s while every stream is live, tokens/s to the end) from samples of each stream's
    newest step: progress is each stream's best step so far (a restart's replayed steps add
    nothing), from the sample where it reached a quarter of its final sum (the warm-up left out)
    to the first sample where one stream had done all it did (a stream behind a 4x slower
    stage-0 cell issues the same microbatches over 4x the time: after the first stream's end,
    fewer streams feed the grid), or to the end."""
    best: dict[str, int] = {}
    timeline: list[tuple[float, int, dict[str, int]]] = []
    for t, steps in samples:
        for name, step in steps.items():
            best[name] = max(best.get(name, 0), step)
        timeline.append((t, sum(best.values()), dict(best)))
    if not timeline or not best:
        return 0.0, 0.0
    final = timeline[-1][1]
    first = next(k for k, (_, total, _) in enumerate(timeline) if total >= STEADY_FROM * final)
    ended = next(
        (k for k, (_, _, b) in enumerate(timeline) if any(b.get(n) == best[n] for n in best)),
        len(timeline) - 1,
    )
    done = next(k for k, (_, total, _) in enumerate(timeline) if total >= final)

    def rate(a: int, b: int) -> float:
        (ta, pa, _), (tb, pb, _) = timeline[a], timeline[b]
        return round((pb - pa) * tokens_per_microbatch / (tb - ta), 1) if tb > ta else 0.0

    return rate(first, max(first, ended)), rate(first, done)


def _churn(out: Path, every_s: float, stop: threading.Event) -> None:
    """SIGKILL a random live cell every every_s (the launcher starts it again)."""
    rng = random.Random(1)
    while not stop.wait(every_s):
        pids = []
        for path in (out / "metrics").glob("*.jsonl"):
            started = [r for r in parse_rows(path.read_bytes()) if r.get("event") == "started"]
            if started:
                pids.append(started[-1]["pid"])
        if pids:
            try:
                os.kill(rng.choice(sorted(pids)), signal.SIGKILL)
            except ProcessLookupError:
                pass


def bounds(cfg: Config, speeds: list[list[float]]) -> dict[str, float]:
    """The capacity model's tokens/s for these speeds: fixed wiring, pools, and pools whose
    cells rebalance (elastic.rebalance: a cell of a stage with rebalance_ratio x the thinnest
    stage's capacity moves into a free cell of that stage, routing.rebalanced)."""
    per_mb_s = (cfg.emulation.forward_ms + cfg.emulation.backward_ms) / 1000
    scale = cfg.tokens_per_microbatch / per_mb_s
    moved = routing.rebalanced(speeds, cfg.elastic.rebalance_ratio)
    return {
        "fixed_bound_tps": round(routing.fixed_bound(speeds) * scale, 1),
        "pool_bound_tps": round(routing.pool_bound(speeds) * scale, 1),
        "rebalanced_bound_tps": round(routing.pool_bound(moved) * scale, 1),
        "rebalancing_moves": sum(a != b for s, t in zip(speeds, moved) for a, b in zip(s, t)) // 2,
    }


SCENARIOS = {"gpu-mix": (4, 8), "dead-10": (4, 8), "churn": (4, 4), "equal": (3, 3)}


BASE = [
    "model.n_layers=4",
    "model.d_model=64",
    "model.seq_len=64",
    "pipeline.microbatch_size=8",
    # stretched so 32 processes on 2 cores are not host-bound (time dilation)
    "emulation.forward_ms=150",
    "emulation.backward_ms=300",
    "transport.recv_timeout_s=120",
    "transport.round_timeout_s=30",
    # streams sized by their round trip: the study's setting (the default, window, keeps a
    # real-size stage 0's stash small; docs/pools.md)
    "pipeline.pool_stream_window='auto'",
]


def run_study(
    out: Path,
    quick: bool = False,
    steps: int | None = None,
    overrides: tuple[str, ...] = (),
    only: tuple[str, ...] = (),
    keep_runs: bool = False,
) -> dict[str, Any]:
    """Every scenario's two arms, one after the other; `overrides` (config keys) on top of the
    study's settings in both arms. `only`: these scenarios, the others kept from out's
    summary.json (run with the same steps and overrides; a fresh out has only these)."""
    out.mkdir(parents=True, exist_ok=True)
    base = [*BASE, *overrides]
    steps = steps or (30 if quick else 80)
    scenarios = {"gpu-mix": SCENARIOS["gpu-mix"]} if quick else SCENARIOS
    results: dict[str, Any] = {}
    if only:
        results = _kept(out, steps, overrides)
        scenarios = {name: SCENARIOS[name] for name in only}
    # keep_runs: each arm's run directory (metrics, checkpoints) stays in out/runs/, fresh
    if keep_runs:
        shutil.rmtree(out / "runs", ignore_errors=True)
        (out / "runs").mkdir()
    holder: contextlib.AbstractContextManager[str] = (
        contextlib.nullcontext(str(out / "runs"))
        if keep_runs
        else tempfile.TemporaryDirectory(prefix="bench-pools-")
    )
    with holder as tmp:
        for name, (P, m) in scenarios.items():
            speeds = scenario_speeds(name, P, m)
            row: dict[str, Any] = {"grid": f"{P}x{m}", "speeds": speeds}
            for arm in ("fixed", "pools"):  # side by side, one after the other
                cfg = arm_config(name, arm, speeds, steps, base)
                churn = 20.0 if name == "churn" else None
                row[arm] = measure(cfg, Path(tmp) / f"{name}-{arm}", speeds, churn)
            row.update(bounds(cfg, speeds))
            pools, fixed = row["pools"]["tokens_per_s"], row["fixed"]["tokens_per_s"]
            row["pools_vs_fixed"] = round(pools / fixed, 3) if fixed else None
            row["pools_of_bound"] = round(pools / row["pool_bound_tps"], 3)
            results[name] = row
            (out / "summary.partial.json").write_text(json.dumps(results, indent=2))
    results = {name: results[name] for name in SCENARIOS if name in results}  # the table's order
    summary = {"steps": steps, "quick": quick, "overrides": list(overrides), "scenarios": results}
    return write_report(out, summary)


def _kept(out: Path, steps: int, overrides: tuple[str, ...]) -> dict[str, Any]:
    """The scenarios of out's summary.json, if it was run with these steps and overrides (none
    where out holds no study yet: --only then starts one with just those scenarios)."""
    path = out / "summary.json"
    if not path.exists():
        return {}
    old = json.loads(path.read_text())
    if old.get("steps") != steps or old.get("overrides", []) != list(overrides):
        raise ValueError(
            f"{path}: run with steps {old.get('steps')} and overrides {old.get('overrides', [])}, "
            f"not {steps} and {list(overrides)}: --only adds to a study of the same settings"
        )
    return old["scenarios"]


def report_only(out: Path) -> dict[str, Any]:
    """The outputs again from out/summary.json's measurements, the capacity model's bounds
    recomputed (for the same speeds and settings): no grid runs."""
    old = json.loads((out / "summary.json").read_text())
    base = [*BASE, *old.get("overrides", [])]
    for name, row in old["scenarios"].items():
        cfg = arm_config(name, "pools", row["speeds"], old["steps"], base)
        row.update(bounds(cfg, row["speeds"]))
    kept = ("steps", "quick", "overrides", "scenarios")
    return write_report(out, {k: old[k] for k in kept if k in old})


def write_report(out: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """The targets' verdicts; summary.json, table.md and the plot."""
    results = summary["scenarios"]
    mix = results["gpu-mix"]
    targets = {
        "pools_vs_fixed_gpu_mix": {
            "target": TARGET_VS_FIXED,
            "measured": mix["pools_vs_fixed"],
            "met": bool(mix["pools_vs_fixed"] and mix["pools_vs_fixed"] >= TARGET_VS_FIXED),
        },
        **_equal_target(results),
        "pools_of_bound": {
            "target": TARGET_OF_BOUND,
            "measured": min(r["pools_of_bound"] for r in results.values()),
            "met": all(r["pools_of_bound"] >= TARGET_OF_BOUND for r in results.values()),
        },
    }
    summary = {**summary, "targets": targets}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "summary.partial.json").unlink(missing_ok=True)  # the whole run is in summary.json
    (out / "table.md").write_text(table(summary))
    plot(summary, out / "throughput.png")
    return summary


def _equal_target(results: dict[str, Any]) -> dict[str, Any]:
    """The equal peers' verdict (none for a summary run before the scenario existed)."""
    equal = results.get("equal")
    if equal is None:
        return {}
    got = equal["pools_vs_fixed"]
    return {
        "pools_vs_fixed_equal_peers": {
            "target": TARGET_EQUAL_VS_FIXED,
            "measured": got,
            "met": bool(got and got >= TARGET_EQUAL_VS_FIXED),
        }
    }


def table(summary: dict[str, Any]) -> str:
    head = [
        "scenario",
        "grid",
        "fixed tok/s",
        "pools tok/s",
        "pools/fixed",
        "fixed bound",
        "pool bound",
        "pools of bound",
        "rebalanced bound (moves)",
        "to the end: fixed/pools tok/s",
        "staleness fixed/pools",
        "voided (pools)",
        "refused (pools)",
    ]
    rows = []
    for name, r in summary["scenarios"].items():
        f, p = r["fixed"], r["pools"]
        rows.append(
            [
                name,
                r["grid"],
                f"{f['tokens_per_s']:,.0f}",
                f"{p['tokens_per_s']:,.0f}",
                f"{r['pools_vs_fixed']:.2f}x" if r["pools_vs_fixed"] else "-",
                f"{r['fixed_bound_tps']:,.0f}",
                f"{r['pool_bound_tps']:,.0f}",
                f"{r['pools_of_bound']:.2f}",
                _rebalanced(r),
                _to_the_end(f, p),
                f"{f['staleness_mean']} / {p['staleness_mean']}",
                str(p["voided"]),
                str(p.get("refused", "-")),
            ]
        )
    lines = [format_table(head, rows), ""]
    for key, t in summary["targets"].items():
        verdict = "met" if t["met"] else "MISSED"
        lines.append(f"- {key}: {t['measured']} against {t['target']}: {verdict}")
    breakdown = time_table(summary)
    if breakdown:
        lines += ["", breakdown]
    return "\n".join(lines) + "\n"


def time_table(summary: dict[str, Any]) -> str:
    """Where each stage's time went over the steady window (mesh/bench/pools_cells.py): busy
    (fixed, pools), and the pools cells' idle, starved or blocked; '' before the columns."""
    head = [
        "scenario",
        "stage",
        "capacity",
        "busy: fixed / pools",
        "pools starved",
        "pools blocked",
        "",
    ]
    rows = []
    for name, r in summary["scenarios"].items():
        fixed, pools = r["fixed"].get("stages"), r["pools"].get("stages")
        if not pools:
            continue
        low = bottleneck(pools)["stage"]
        for f, p in zip(fixed or [{}] * len(pools), pools):
            rows.append(
                [
                    name,
                    str(p["stage"]),
                    f"{p['capacity']:g}",
                    f"{_share(f.get('busy'))} / {_share(p['busy'])}",
                    _share(p["starved"]),
                    _share(p["blocked"]),
                    "the pool bound's stage" if p["stage"] == low else "",
                ]
            )
    if not rows:
        return ""
    note = (
        "Shares of the steady window, weighted by the cells' speeds (a stage's busy share is "
        "its throughput over its capacity); starved: asleep holding nothing, blocked: asleep "
        "holding only microbatches out downstream (at stage 0: the stream window full)."
    )
    return format_table(head, rows) + "\n\n" + note


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _to_the_end(fixed: dict[str, Any], pools: dict[str, Any]) -> str:
    if "tokens_per_s_to_the_end" not in fixed:  # a summary written before the column
        return "-"
    return f"{fixed['tokens_per_s_to_the_end']:,.0f} / {pools['tokens_per_s_to_the_end']:,.0f}"


def _rebalanced(row: dict[str, Any]) -> str:
    if "rebalanced_bound_tps" not in row:  # a summary written before the column
        return "-"
    return f"{row['rebalanced_bound_tps']:,.0f} ({row['rebalancing_moves']})"


def plot(summary: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    names = list(summary["scenarios"])
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for k, arm in enumerate(("fixed", "pools")):
        vals = [summary["scenarios"][n][arm]["tokens_per_s"] for n in names]
        ax.bar([x + 0.38 * k for x in range(len(names))], vals, width=0.36, label=arm)
    for x, n in enumerate(names):
        r = summary["scenarios"][n]
        ax.plot([x - 0.2, x + 0.6], [r["pool_bound_tps"]] * 2, "k--", lw=1)
        ax.plot([x - 0.2, x + 0.6], [r["fixed_bound_tps"]] * 2, "k:", lw=1)
    ax.set_xticks([x + 0.19 for x in range(len(names))], names)
    ax.set_ylabel("tokens/s (steady)")
    ax.set_title("fixed wiring against stage pools (dashed: pool bound, dotted: fixed bound)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
