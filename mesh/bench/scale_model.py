"""`meshtrain bench scale-model`: the paths a real stage takes, at real size, against `plan`.

For the largest stage of llama-160m and of llama-1b (a llama-1b stage holds 329M parameters),
each measurement in a process of its own (so its peak RSS is its own, read from VmHWM):
- **cell**: build (the stage's init), its stash filled, one update (a one-sequence microbatch:
  only the activations shrink, the state is the real one), then averaging rounds through the
  cell's own path (open_round: select + gather + encode + decode; combine_round; apply_round);
  peak RSS over the process's own baseline against plan's total for the cell.
- **checkpoint**: save_cell of that cell, then in a fresh process load_cell: time and the peak
  each adds over the cell it works on (two full copies would add the state's size again).
- **state download**: a donor and a joiner on 127.0.0.1 (torch backend), the joiner's state
  replaced by the donor's through mesh.runtime.state_sync in verified chunks: time, both ends'
  peak RSS, the joiner's against 1.3x the stage's state bytes (weights, drift, optimizer).
Targets (issue 27): round host cost <= 50 ms per update at a llama-1b stage, peak RSS within
15% of plan, the download verified with the joiner's peak <= 1.3x the state bytes.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mesh.bench.stage_probe import (
    SHAPE,
    bench_config,
    build_cell,
    largest_stage,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
)
from mesh.report import format_table

PRESETS = ("llama-160m", "llama-1b")
ROUNDS = 5  # averaging rounds timed (the fastest is reported: the least disturbed)
TARGET_ROUND_MS = 50.0
TARGET_RSS_VS_PLAN = 0.15
TARGET_JOINER_VS_STATE = 1.3
MB = 1e6


def state_bytes(cell: Any) -> int:
    """What a state download carries: weights, drift and the optimizer's tensors."""
    import torch

    opt = sum(
        v.numel() * v.element_size()
        for v in cell.optimizer.state_dict().values()
        if isinstance(v, torch.Tensor)
    )
    return cell.flat.numel() * 4 * 2 + opt


def measure_cell(preset: str, stage: int, run_dir: str) -> dict[str, Any]:
    """Child: build, fill the stash, one update, rounds, save; times and peaks."""
    import torch

    from mesh.algo import sparse
    from mesh.bench.model import _cell_step, _inputs
    from mesh.engine.plan import plan_cell
    from mesh.model.build import stage_layers
    from mesh.runtime.checkpoint import save_cell

    base = rss_bytes()
    t0 = time.perf_counter()
    cfg, cell = build_cell(preset, stage)
    build_s = time.perf_counter() - t0
    build_peak = peak_rss_bytes() - base
    for _ in range(cell.versions_to_keep() - 1):
        cell.step += 1
        cell.push_version()
    _, _, last = stage_layers(cfg.model, cfg.grid.stages, stage)
    x, y = _inputs(cfg, stage, torch.device("cpu"))
    t0 = time.perf_counter()
    cell.apply_update(_cell_step(cell, x, y, last, cfg.runtime.precision))
    update_s = time.perf_counter() - t0
    cell.push_version()
    dp = cfg.dp
    select, whole = [], []
    for i in range(ROUNDS):
        t0 = time.perf_counter()
        sparse.subset_indices(
            cfg.run.seed,
            stage,
            0,
            i,
            cell.flat.numel(),
            dp.fraction,
            dp.selector,
            dp.index_map,
            dp.subset_block,
        )
        select.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        rnd, decoded = cell.open_round(i)  # select + gather + encode + decode
        rnd.mean, _ = cell.combine_round(["r0", "r1"], [decoded, decoded], "r0")
        cell.apply_round(rnd)
        whole.append((time.perf_counter() - t0) * 1e3)
    k = rnd.indices.numel()
    # the floor, side by side: gathering k values once, value by value and in runs (the round
    # gathers in runs where dp.subset_block > 1)
    gather, gather_runs, numel = [], [], cell.flat.numel()
    for _ in range(3):
        t0 = time.perf_counter()
        cell.flat.index_select(0, rnd.indices)
        gather.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        sparse.gather_runs(cell.flat, sparse.runs_of(numel, rnd.indices, dp.subset_block))
        gather_runs.append((time.perf_counter() - t0) * 1e3)
    gather_ms, gather_runs_ms = min(gather), min(gather_runs)
    del rnd, decoded
    peak = peak_rss_bytes() - base
    plan = plan_cell(cfg, stage)
    # what this process holds of plan's cell: no transport and no microbatch in flight, and one
    # averaging round at a time where a running cell keeps tau / H + 1
    rounds = dp.tau // dp.interval_steps + 1
    cell_plan = (
        plan.total_bytes
        - plan.transport_bytes
        - plan.inflight_bytes
        - plan.averaging_bytes * (rounds - 1) // rounds
    )
    reset_peak_rss()
    before = rss_bytes()
    t0 = time.perf_counter()
    path = save_cell(cell, cfg.state_fingerprint(), run_dir)
    save_s = time.perf_counter() - t0
    save_extra = peak_rss_bytes() - before
    return {
        "preset": preset,
        "stage": stage,
        "params": cell.flat.numel(),
        "state_bytes": state_bytes(cell),
        "build_s": build_s,
        "build_peak_bytes": build_peak,
        "update_s": update_s,
        "averaging_k": k,
        "select_ms": min(select),
        "averaging_ms": min(whole),
        "averaging_ms_per_update": min(whole) / dp.interval_steps,
        "gather_k_ms": gather_ms,
        "gather_k_runs_ms": gather_runs_ms,
        "subset_block": dp.subset_block,
        "peak_rss_bytes": peak,
        "plan_bytes": cell_plan,
        "peak_vs_plan": peak / cell_plan - 1,
        "save_s": save_s,
        "save_extra_rss_bytes": save_extra,
        "checkpoint_bytes": path.stat().st_size,
        "checkpoint": str(path),
    }


def measure_load(preset: str, stage: int, path: str) -> dict[str, Any]:
    """Child: a fresh cell, then load_cell of the saved checkpoint: time and what it adds."""
    from mesh.runtime.checkpoint import load_cell

    cfg, cell = build_cell(preset, stage)
    reset_peak_rss()
    before = rss_bytes()
    t0 = time.perf_counter()
    load_cell(cell, cfg.state_fingerprint(), Path(path))
    return {"load_s": time.perf_counter() - t0, "load_extra_rss_bytes": peak_rss_bytes() - before}


def _child(fn_name: str, args: tuple, conn: Any) -> None:
    try:
        conn.send(("ok", globals()[fn_name](*args)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises
        conn.send(("error", f"{type(e).__name__}: {e}"))


def in_child(fn_name: str, *args: Any) -> dict[str, Any]:
    """Run one measurement in a spawned process (its own VmHWM); its dict or RuntimeError."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(fn_name, args, child))
    proc.start()
    child.close()
    try:
        status, value = parent.recv()
    except EOFError:
        status, value = "error", f"the measuring process died (exit {proc.exitcode})"
    proc.join(60)
    if status != "ok":
        raise RuntimeError(f"{fn_name}{args[:2]}: {value}")
    return value


def run_scale_model_bench(
    out: Path,
    presets: tuple[str, ...] = PRESETS,
    on_step: Callable[[str], None] | None = None,
    download: bool = True,
) -> dict[str, Any]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="mt-scale-model-") as tmp:
        for preset in presets:
            stage = largest_stage(bench_config(preset))
            row = in_child("measure_cell", preset, stage, tmp)
            _step(on_step, f"{preset} cell")
            row.update(in_child("measure_load", preset, stage, row.pop("checkpoint")))
            _step(on_step, f"{preset} checkpoint")
            if download:
                from mesh.bench.scale_model_download import measure_download

                row.update(measure_download(preset, stage))
                _step(on_step, f"{preset} download")
            rows.append(row)
    summary: dict[str, Any] = {"rows": rows, "targets": targets(rows), "shape": list(SHAPE)}
    big = next((r for r in rows if r["preset"] == "llama-1b"), None)
    if big is not None:  # the figure, under the one key that names it
        summary["llama-1b round_ms_per_update"] = big["averaging_ms_per_update"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "table.md").write_text(scale_model_table(summary) + "\n")
    return summary


def _step(on_step: Callable[[str], None] | None, what: str) -> None:
    if on_step is not None:
        on_step(what)


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, judged on the llama-1b row (None where it was not measured)."""
    big = next((r for r in rows if r["preset"] == "llama-1b"), None)
    if big is None:
        return {}
    out: dict[str, Any] = {
        "averaging_ms_per_update_le_50": big["averaging_ms_per_update"] <= TARGET_ROUND_MS,
        "peak_rss_within_15pct_of_plan": abs(big["peak_vs_plan"]) <= TARGET_RSS_VS_PLAN,
    }
    if "joiner_vs_state" in big:
        out["download_verified"] = bool(big.get("download_ok"))
        out["joiner_peak_le_1_3x_state"] = big["joiner_vs_state"] <= TARGET_JOINER_VS_STATE
    return out


def scale_model_table(summary: dict[str, Any]) -> str:
    headers = ["path", *[f"{r['preset']} stage {r['stage']}" for r in summary["rows"]]]
    rows_by = summary["rows"]

    def line(name: str, fmt: Callable[[dict[str, Any]], str]) -> list[str]:
        return [name, *[fmt(r) if _has(r, name) else "-" for r in rows_by]]

    def mb(key: str) -> Callable[[dict[str, Any]], str]:
        return lambda r: f"{r[key] / MB:,.0f} MB"

    lines = [
        ["parameters", *[f"{r['params'] / 1e6:,.1f}M" for r in rows_by]],
        ["state (weights, drift, optimizer)", *[mb("state_bytes")(r) for r in rows_by]],
        line("build", lambda r: f"{r['build_s']:.1f} s, peak {r['build_peak_bytes'] / MB:,.0f} MB"),
        line("one update (1 x 256 tokens)", lambda r: f"{r['update_s']:.2f} s"),
        line(
            "averaging round (select + encode + apply)",
            lambda r: (
                f"{r['averaging_ms']:,.0f} ms for k = {r['averaging_k'] / 1e6:.1f}M "
                f"(select {r['select_ms']:,.0f} ms, "
                f"gathering k alone {r['gather_k_ms']:.0f} ms value by value, "
                f"{r.get('gather_k_runs_ms', float('nan')):.0f} ms in runs of "
                f"{r.get('subset_block', 1)})"
            ),
        ),
        line(
            "peak RSS vs plan",
            lambda r: (
                f"{r['peak_rss_bytes'] / MB:,.0f} vs {r['plan_bytes'] / MB:,.0f} MB "
                f"({r['peak_vs_plan']:+.1%})"
            ),
        ),
        line(
            "checkpoint save",
            lambda r: (
                f"{r['save_s']:.1f} s, +{r['save_extra_rss_bytes'] / MB:,.0f} MB, "
                f"file {r['checkpoint_bytes'] / MB:,.0f} MB"
            ),
        ),
        line(
            "checkpoint load",
            lambda r: f"{r['load_s']:.1f} s, +{r['load_extra_rss_bytes'] / MB:,.0f} MB",
        ),
        line(
            "state download (loopback, torch)",
            lambda r: (
                f"{r['download_s']:.1f} s, {'verified' if r['download_ok'] else 'FAILED'}, "
                f"{r['download_chunks']} chunks"
            ),
        ),
        line(
            "download peak RSS: joiner / donor",
            lambda r: (
                f"{r['joiner_peak_bytes'] / MB:,.0f} / {r['donor_peak_bytes'] / MB:,.0f} MB"
                f" (joiner {r['joiner_vs_state']:.2f}x state)"
            ),
        ),
    ]
    head = "Measured on this machine's CPU; microbatch " + ", ".join(summary["shape"]) + ".\n\n"
    verdicts = "\n".join(
        f"- {k}: {'met' if v else 'MISSED'}" for k, v in summary.get("targets", {}).items()
    )
    return head + format_table(headers, lines) + ("\n\nTargets (llama-1b):\n" + verdicts)


_NEEDS = {
    "build": "build_s",
    "one update (1 x 256 tokens)": "update_s",
    "averaging round (select + encode + apply)": "averaging_ms",
    "peak RSS vs plan": "peak_rss_bytes",
    "checkpoint save": "save_s",
    "checkpoint load": "load_s",
    "state download (loopback, torch)": "download_s",
    "download peak RSS: joiner / donor": "joiner_peak_bytes",
}


def _has(row: dict[str, Any], name: str) -> bool:
    return _NEEDS.get(name, "") in row
