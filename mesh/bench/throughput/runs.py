"""The throughput study's runs: one set of cell processes per grid runs every window of it."""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import statistics
import subprocess
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from comms.build import Meeting
from mesh.algo.schedule import microbatches_per_update
from mesh.algo.topology import cell_name
from mesh.bench.throughput.analysis import (
    _method_summary,
    c_label,
    pp_codec_bytes,
    predictions,
    stage_params,
    targets,
)
from mesh.bench.throughput.protocol import (
    GRIDS,
    METHODS,
    MIN_SYNC_STEPS,
    SKIP_FRAC,
    Grid,
    grid_config,
    method_configs,
)
from mesh.bench.throughput.report import _line, table_md
from mesh.config import Config, config_from_dict
from mesh.runtime.emulate import link_profile, throughput, window_of
from mesh.runtime.metrics import read_metrics


def _bench_cell(
    plan: list[tuple[str, dict[str, Any], int, int]],
    stage: int,
    replica: int,
    out_dir: str,
    meeting: Meeting,
    barrier: Any,
    barrier_timeout_s: float,
) -> None:
    """Run every window of one grid as cell (stage, replica): [(name, cfg tree, steps, base)].

    `base` numbers the window's updates (and so its microbatch tags and round ids) after every
    earlier window's, so no message or round of one window can be taken for another's.
    """
    import torch

    from mesh.engine.cell import Cell
    from mesh.model.build import build_stage
    from mesh.runtime.stage import StageWorker
    from mesh.runtime.wiring import cell_transport
    from mesh.runtime.worker_settings import WorkerSettings

    cfgs = [config_from_dict(tree) for _, tree, _, _ in plan]
    first = cfgs[0]
    torch.set_num_threads(first.run.threads)
    transport = cell_transport(first, stage, replica, meeting)
    module = build_stage(first.model, first.grid.stages, stage, first.run.seed)
    try:
        for (name, _, steps, base), cfg in zip(plan, cfgs, strict=True):
            cell = Cell.build(cfg, stage, replica, module)
            cell.step = base
            cell.history = OrderedDict({base: cell.flat.clone()})
            worker = StageWorker(WorkerSettings.of(cfg, stage, replica), cell, transport, None)
            path = Path(out_dir) / name / "metrics" / f"{stage}-{replica}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            barrier.wait(barrier_timeout_s)
            rows = _one_window(worker, steps, base)
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    finally:
        transport.close()


def _one_window(worker: Any, steps: int, base: int) -> list[dict[str, Any]]:
    """Run one window on a fresh worker; its metrics rows (steps, times and bytes relative to
    the window's start), then a final row written after the worker drained its sends."""
    transport, cell = worker.transport, worker.cell
    sent0 = transport.stats.sent_by_kind()
    t0, cpu0 = time.perf_counter(), time.process_time()
    rows: list[dict[str, Any]] = []

    def sent() -> dict[str, int]:
        now = transport.stats.sent_by_kind()
        return {k: n - sent0.get(k, 0) for k, n in now.items()}

    def on_step(w: Any) -> None:
        st = w.stats
        rows.append(
            {
                "stage": w.j,
                "replica": w.i,
                "step": cell.step - base,
                "time_s": round(time.perf_counter() - t0, 5),
                "cpu_s": round(time.process_time() - cpu0, 5),  # the process's, all threads
                "bytes_sent": sent(),
                "microbatches": st.microbatches,
                "busy_s": round(st.busy_s, 6),
                "staleness_max": st.staleness_max,
                "stash_bytes_peak": st.stash_bytes_peak,
                "rss_peak_mb": round(st.rss_peak_mb(), 1),
                "rounds_started": st.rounds_started,
                "rounds_applied": st.rounds_applied,
                "rounds_failed": st.rounds_failed,
            }
        )

    stats = worker.run(steps, on_step)
    rows.append(
        {
            "final": True,
            "stage": worker.j,
            "replica": worker.i,
            "wall_s": time.perf_counter() - t0,
            "bytes_sent": sent(),
            "rounds_failed": stats.rounds_failed,
            "staleness_hist": {str(k): n for k, n in sorted(stats.staleness.items())},
            "late_s": worker.emu.late_s if worker.emu else 0.0,
        }
    )
    return rows


def _run_windows(
    cfg: Config,
    plan: list[tuple[str, Config, int, int]],
    out: Path,
    timeout_s: float,
    barrier_timeout_s: float = 300.0,
) -> None:
    """Spawn the grid's cells, run the plan, reap them; RuntimeError if a cell failed. Every
    window runs on the transport of the first one's config (its links' shaping)."""
    from comms.build import local_rendezvous

    ctx = mp.get_context("spawn")
    P, m = cfg.grid.stages, cfg.grid.replicas
    barrier = ctx.Barrier(P * m)
    trees = [(name, c.model_dump(mode="json"), steps, base) for name, c, steps, base in plan]
    procs = []
    start = time.perf_counter()
    with local_rendezvous(cfg.transport.backend, cfg.transport.host) as meeting:
        try:
            for i in range(m):
                for j in range(P):
                    p = ctx.Process(
                        target=_bench_cell,
                        args=(trees, j, i, str(out), meeting, barrier, barrier_timeout_s),
                        name=f"bench-{cell_name(j, i)}",
                    )
                    p.start()
                    procs.append(p)
            while any(p.is_alive() for p in procs):
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
                if time.perf_counter() - start > timeout_s:
                    raise TimeoutError(f"{out.name}: windows did not finish in {timeout_s:.0f} s")
                time.sleep(0.2)
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join(5)
    bad = {p.name: p.exitcode for p in procs if p.exitcode != 0}
    if bad:
        raise RuntimeError(f"{out.name}: cells failed: {bad}")


def run_grid_bench(
    base: Config, g: Grid, out: Path, windows: int, window_s: float
) -> dict[str, Any]:
    cfg = grid_config(base, g)
    cfgs = method_configs(cfg)
    n_params = stage_params(cfg)
    pred = predictions(cfgs, n_params)
    plan: list[tuple[str, Config, int, int]] = []
    next_base = 0
    for k in range(windows):
        for label, c in cfgs.items():
            ups = pred["updates_per_s"][label]
            steps = max(MIN_SYNC_STEPS if label == "FullSync" else 10, math.ceil(window_s * ups))
            plan.append((f"w{k}-{label}", c, steps, next_base))
            mpu = microbatches_per_update(c.pipeline.schedule, c.pipeline.microbatches)
            # tags and round ids never repeat: the round clock may take a window's round ids
            # ahead of its updates (a jump to a partner's newest round), so leave room
            next_base = (next_base + steps) * mpu + steps + 64
    expected = sum(steps / pred["updates_per_s"][c_label(name)] for name, _, steps, _ in plan)
    t0 = time.perf_counter()
    _run_windows(cfg, plan, out, timeout_s=120 + 3 * expected)
    wall = time.perf_counter() - t0
    per: dict[str, list[Any]] = {label: [] for label in cfgs}
    for name, c, _, _ in plan:
        rows = read_metrics(out / name)
        tp = throughput(c, rows, SKIP_FRAC)
        finals = [r for v in rows.values() for r in v if r.get("final")]
        per[c_label(name)].append((tp, finals))
    entry: dict[str, Any] = {
        "id": g.id,
        "grid": f"{g.stages}x{g.replicas}",
        "link": {
            "profile": g.link,
            "bandwidth_mbps": link_profile(cfg).bandwidth_mbps,  # type: ignore[union-attr]
            "latency_ms": link_profile(cfg).latency_ms,  # type: ignore[union-attr]
        },
        "slowdowns": list(g.slowdowns),
        "stage_params": n_params,
        "windows": windows,
        "wall_s": round(wall, 1),
    }
    for label, results in per.items():
        entry[label] = _method_summary(results, pred[label], pred["ideal_tokens_per_s"])
    entry["AsyncMesh"]["window"] = window_of(cfgs["AsyncMesh"]) or [0] * g.stages
    entry["AsyncMesh"]["in_flight"] = pred["AsyncMesh"]["in_flight"]
    ratios = [
        a.tokens_per_s / f.tokens_per_s
        for (f, _), (a, _) in zip(per["FullSync"], per["AsyncMesh"], strict=True)
        if a.tokens_per_s and f.tokens_per_s
    ]
    entry["ratio"] = statistics.median(ratios) if ratios else None
    entry["ratio_min"] = min(ratios) if ratios else None
    entry["ratio_max"] = max(ratios) if ratios else None
    entry["predicted_ratio"] = pred["ratio"]
    entry["predicted"] = pred
    return entry


def _env() -> dict[str, Any]:
    import torch

    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=False
        ).stdout.strip()
    except OSError:
        sha = ""
    return {
        "torch": torch.__version__,
        "nproc": os.cpu_count(),
        "loadavg": list(os.getloadavg()),
        "git_sha": sha or None,
    }


def run_throughput(
    base: Config,
    out: Path,
    quick: bool = False,
    grids: tuple[Grid, ...] = GRIDS,
    windows: int | None = None,
    window_s: float | None = None,
) -> dict[str, Any]:
    """Every grid in turn; writes out/summary.json and out/table.md and returns the summary."""
    windows = windows or (1 if quick else 3)
    window_s = window_s or (4.0 if quick else 10.0)
    out.mkdir(parents=True, exist_ok=True)
    env = _env()
    t0 = time.perf_counter()
    configs = []
    for g in grids:
        print(f"bench throughput: {g.id} ({g.stages}x{g.replicas}, {g.link}) ...", flush=True)
        entry = run_grid_bench(base, g, out / g.id, windows, window_s)
        configs.append(entry)
        print(_line(entry), flush=True)
    codec = pp_codec_bytes(grid_config(base, grids[0]))
    summary = {
        "protocol": {
            "forward_ms": base.emulation.forward_ms,
            "backward_ms": base.emulation.backward_ms,
            "compute": base.emulation.compute,
            "tokens_per_microbatch": base.tokens_per_microbatch,
            "microbatches": base.pipeline.microbatches,
            "windows": windows,
            "window_s": window_s,
            "warmup_rows_skipped": SKIP_FRAC,
            "methods": METHODS,
            "quick": quick,
        },
        "configs": configs,
        "pp_codec_bytes": codec,
        "targets": targets(configs, codec),
        "env": {**env, "loadavg_after": list(os.getloadavg())},
        "base_config_fingerprint": base.fingerprint(),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "table.md").write_text(table_md(summary))
    print(table_md(summary))
    return summary
