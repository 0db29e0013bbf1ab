"""The real-size grid of `meshtrain bench throughput --real-size`: llama-1b's boundary shapes
(d 2304, seq 1024, microbatch 8: the real payloads on the wire) on a 4x2 grid over 100 Mbit/s,
50 ms links, compute emulated at GPU speed, full fp8 boundaries against compressed ones.

Compute: a stage's time per microbatch is plan's FLOPs of that llama-1b stage over 40% of an
H100's dense bf16 peak,

    t_stage = (6 x matmul parameters + 12 x layers x T x d) [FLOP/token] x B x T / (0.4 x 989e12)

split one third forward, two thirds backward (emulation.forward_ms / backward_ms of the middle
stages, emulation.slowdowns for a stage whose FLOPs differ: the last holds the head). No model
math runs, so only what crosses the links matters: each cell holds a stand-in of one block of
d 2304 (1 kv head, SwiGLU width 64, vocab 256) to keep 8 cells within this box's memory; the
averaging rounds therefore move the stand-in's bytes, not a real stage's (`plan
--uplink-mbit` sizes those), over links of their own.

The link is a cell's uplink (transport.link_shared = pipeline): a middle stage's activation on and
gradient back leave through one 100 Mbit/s wire, so its link time per microbatch is two frames
(the link model: fraction of compute-ideal = t_slowest / max(t_slowest, frames x frame / bw)).

Time dilation (Gupta et al., NSDI 2006). On a small host the 8 cells' own work (codecs, the
averaging rounds, the transport) takes longer than 34-43 ms of GPU compute a microbatch, and the
grid would measure the host, not the link. So each arm first runs a calibration window with no
compute sleeps and no shaping (the host's own pace, the wall time per update, under whatever
load the host has), then runs with every duration of the emulation scaled by k = max(1,
MARGIN x that time / the arm's predicted period): compute x k, link bandwidth / k, latency x k,
timeouts x k. Every fraction (of compute-ideal, of ideal, the link's share) is invariant under
k; tokens/s are reported undilated (measured x k).

Reported beside the link-inclusive "of ideal" (tokens/s over the rate max(compute, link) per
stage allows): the fraction of compute-ideal, tokens/s over the rate the stages' compute alone
allows (tokens per microbatch x replicas / the slowest stage's time).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

from mesh.algo.topology import cell_name
from mesh.bench.model import stage_flops_per_token
from mesh.bench.throughput.protocol import BENCH, SKIP_FRAC
from mesh.config import Config, load_config, with_overrides
from mesh.engine.plan import compression_vs_bf16, rank_for_compression
from mesh.engine.uplink import INT4_CODEC, arm_label
from mesh.methods import apply_method
from mesh.runtime.emulate import (
    activation_frame_bytes,
    resolve_window,
    steady_rate,
    throughput,
    uplink_frames,
)
from mesh.runtime.metrics import read_metrics

H100_BF16_PEAK = 989e12  # dense bf16 FLOP/s, the vendor's sheet
MFU = 0.40
REAL_MODEL = "configs/models/llama-1b.toml"
LINK = {
    "transport.link": "none",
    "transport.link_bandwidth_mbps": 100.0,
    "transport.link_latency_ms": 50.0,
    "transport.link_shared": "pipeline",
}
STAND_IN = {
    "model.n_layers": 4,
    "model.n_kv_heads": 1,
    "model.intermediate_size": 64,
    "model.vocab_size": 256,
}
FP8 = "fp8_e4m3"
# (method, ratio over bf16 or None for full, codec): full fp8, the study's best fp8 setting,
# its 4-bit twin at twice the ratio, and 4-bit ratios up to what the link model needs for 0.8
ARMS = (
    ("full", None, FP8),
    ("learned", 16, FP8),
    ("learned", 32, INT4_CODEC),
    ("learned", 64, FP8),
    ("learned", 128, INT4_CODEC),
)
MARGIN = 3.0  # the dilated period over the host's own time per update (a loaded box wakes late)
CALIBRATION_STEPS = 16
ARM_BUDGET_S = 300.0  # an arm runs `steps` updates or what fits this much dilated time ...
MIN_STEPS = 20  # ... but at least this many
TIMEOUT_S = 300.0  # a receive's and a barrier's deadline before dilation
ROUND_TIMEOUT_S = 60.0


def arm_name(method: str, ratio: int | None, codec: str) -> str:
    return f"full {codec.split('_')[0]}" if ratio is None else arm_label(method, ratio, codec)


def stage_compute_s(real: Config) -> list[float]:
    """Seconds of forward + backward per microbatch of each real stage at MFU of the peak."""
    tokens = real.tokens_per_microbatch
    return [
        stage_flops_per_token(real, j) * tokens / (MFU * H100_BF16_PEAK)
        for j in range(real.grid.stages)
    ]


def real_size_config(base: Config) -> tuple[Config, list[float]]:
    """The stand-in grid's config (AsyncMesh-fp8, emulated compute at the real stages' times,
    the real boundary shapes and link; its window still "auto": each arm sizes its own from
    its round trip) and the real stages' compute seconds."""
    real = load_config([REAL_MODEL], ["grid.stages=4", "grid.replicas=2"])
    compute = stage_compute_s(real)
    mid = compute[1]
    slow = [
        f"{cell_name(j, i)}={c / mid:.4f}"
        for j, c in enumerate(compute)
        if abs(c / mid - 1) > 1e-3
        for i in range(real.grid.replicas)
    ]
    keep = {k: v for k, v in BENCH.items() if not k.startswith("model.")}
    cfg = with_overrides(
        base,
        {
            **{f"model.{k}": v for k, v in real.model.model_dump().items()},
            **STAND_IN,
            **keep,
            **LINK,
            "grid.stages": 4,
            "grid.replicas": 2,
            "pipeline.microbatch_size": 8,
            "emulation.forward_ms": 1e3 * mid / 3,
            "emulation.backward_ms": 2e3 * mid / 3,
            "emulation.slowdowns": slow,
            "transport.recv_timeout_s": TIMEOUT_S,
            "transport.round_timeout_s": ROUND_TIMEOUT_S,
            # the preset's averaging layout (runs of 64 values a round), as a real run has it
            "dp.subset_block": real.dp.subset_block,
        },
    )
    return apply_method(cfg, "AsyncMesh-fp8"), compute


def arm_config(cfg: Config, method: str, ratio: int | None, codec: str = FP8) -> Config:
    ov: dict[str, Any] = {"pipeline.boundary": method, "pipeline.codec": codec}
    if ratio is not None:
        tokens, d = cfg.tokens_per_microbatch, cfg.model.d_model
        ov["pipeline.boundary_rank"] = rank_for_compression(tokens, d, ratio, codec)
    return resolve_window(with_overrides(cfg, ov))


def uplink_s_per_microbatch(cfg: Config, bandwidth_bytes_per_s: float) -> float:
    """Seconds the busiest cell's uplink needs a microbatch: a middle stage sends the
    activation on and the gradient back over the one uplink it has."""
    frames = max(uplink_frames(cfg, j) for j in range(cfg.grid.stages))
    return frames * activation_frame_bytes(cfg) / bandwidth_bytes_per_s


def predicted_period_s(cfg: Config, compute: list[float]) -> float:
    """The link model's time per update: the slowest stage's compute or the busiest uplink."""
    bw = cfg.transport.link_bandwidth_mbps * 1e6 / 8
    return max(max(compute), uplink_s_per_microbatch(cfg, bw))


def unconstrained(cfg: Config) -> Config:
    """The arm with no compute sleeps (1 us an op) and no shaping: the host's own pace."""
    return with_overrides(
        cfg,
        {
            "emulation.forward_ms": 1e-3,
            "emulation.backward_ms": 1e-3,
            "emulation.slowdowns": [],
            "transport.link_bandwidth_mbps": None,
            "transport.link_latency_ms": None,
        },
    )


def dilated(cfg: Config, k: float) -> Config:
    """Every duration of the emulation x k: compute, latency and timeouts longer, bandwidth
    lower; the window (in microbatches) and every fraction stay as they are."""
    emu, link = cfg.emulation, cfg.transport
    return with_overrides(
        cfg,
        {
            "emulation.forward_ms": emu.forward_ms * k,
            "emulation.backward_ms": emu.backward_ms * k,
            "transport.link_bandwidth_mbps": link.link_bandwidth_mbps / k,
            "transport.link_latency_ms": link.link_latency_ms * k,
            "transport.recv_timeout_s": link.recv_timeout_s * k,
            "transport.round_timeout_s": link.round_timeout_s * k,
        },
    )


def host_pace(rows: dict[tuple[int, int], list[dict[str, Any]]]) -> tuple[float, float]:
    """(wall seconds an update, the busiest cell's CPU seconds an update) in the steady part of
    a window: the slowest replica's last stage's pace, each cell's process CPU time."""
    walls, cpus = [], []
    for (j, _), r in rows.items():
        steps = [x for x in r if "time_s" in x and not x.get("final")]
        if len(steps) < 3:
            continue
        k = max(1, round(SKIP_FRAC * len(steps)))
        first, last = steps[k], steps[-1]
        if last["step"] > first["step"] and "cpu_s" in last:
            cpus.append((last["cpu_s"] - first["cpu_s"]) / (last["step"] - first["step"]))
        ups = steady_rate([x["time_s"] for x in steps], [x["step"] for x in steps], SKIP_FRAC)
        if j == max(jj for jj, _ in rows) and ups:
            walls.append(1.0 / ups)
    if not walls:
        raise RuntimeError("calibration: no steady updates to time")
    return max(walls), max(cpus, default=float("nan"))


def dilation(host_s: float, period_s: float, margin: float = MARGIN) -> float:
    """k: the smallest factor (>= 1) that gives the host `margin` x its own time an update."""
    return max(1.0, margin * host_s / period_s)


def arm_steps(steps: int, dilated_period_s: float) -> int:
    """`steps`, or fewer for an arm whose dilated updates are long (a link-bound arm is steady
    from its first updates on), never below MIN_STEPS."""
    return min(steps, max(MIN_STEPS, math.ceil(ARM_BUDGET_S / dilated_period_s)))


def run_real_size(base: Config, out: Path, steps: int = 60) -> dict[str, Any]:
    """Calibrate every arm's host pace on one set of 4x2 cell processes, then run each arm at
    its dilation on its own set (a set's links are shaped once); the real-size entry."""
    cfg, compute = real_size_config(base)
    arms = [(arm_name(m, r, c), arm_config(cfg, m, r, c), m) for m, r, c in ARMS]
    bw = cfg.transport.link_bandwidth_mbps * 1e6 / 8
    t0 = time.perf_counter()
    paces = calibrate(arms, out)
    compute_ideal = cfg.tokens_per_microbatch * cfg.grid.replicas / max(compute)
    rows = [
        run_arm(label, c, method, paces[label], compute, compute_ideal, bw, out, steps)
        for label, c, method in arms
    ]
    return real_size_entry(cfg, compute, compute_ideal, rows, t0)


def calibrate(arms: list[tuple[str, Config, str]], out: Path) -> dict[str, tuple[float, float]]:
    """Each arm's host pace (host_pace: seconds an update, the busiest cell's CPU seconds an
    update), from undilated, unshaped runs of all the arms on one set of cell processes."""
    from mesh.bench.throughput.runs import _run_windows

    cal = [
        (
            f"calibrate-{label.replace(' ', '-')}",
            unconstrained(c),
            CALIBRATION_STEPS,
            i * (CALIBRATION_STEPS + 64),
        )
        for i, (label, c, _) in enumerate(arms)
    ]
    print(f"real size: calibrating the host's pace ({len(cal)} arms) ...", flush=True)
    _run_windows(cal[0][1], cal, out, timeout_s=1800)
    return {
        label: host_pace(read_metrics(out / name))
        for (label, _, _), (name, *_rest) in zip(arms, cal, strict=True)
    }


def run_arm(
    label: str,
    c: Config,
    method: str,
    pace: tuple[float, float],
    compute: list[float],
    compute_ideal: float,
    bw: float,
    out: Path,
    steps: int,
) -> dict[str, Any]:
    """One arm run at its dilation (pace: its host's seconds and busiest cell's CPU seconds an
    update; bw: the link's bytes a second), and its row of the entry."""
    from mesh.bench.throughput.runs import _run_windows

    period = predicted_period_s(c, compute)
    host_s, cpu_s = pace
    k = dilation(host_s, period)
    d = dilated(c, k)
    name = label.replace(" ", "-")
    n = arm_steps(steps, period * k)
    print(
        f"real size: {label}: host {1e3 * host_s:.0f} ms an update (busiest cell "
        f"{1e3 * cpu_s:.0f} ms CPU), period {1e3 * period:.1f} ms -> k = {k:.2f}, "
        f"{n} updates",
        flush=True,
    )
    expected = n * period * k
    _run_windows(
        d, [(name, d, n, 0)], out, timeout_s=600 + 4 * expected, barrier_timeout_s=TIMEOUT_S * k
    )
    tp = throughput(d, read_metrics(out / name), SKIP_FRAC)
    frame = activation_frame_bytes(c)
    tokens_per_s = None if tp.tokens_per_s is None else tp.tokens_per_s * k
    return {
        "arm": label,
        "boundary": method,
        "codec": c.pipeline.codec,
        "rank": c.boundary_width,
        "compression": round(
            compression_vs_bf16(
                c.tokens_per_microbatch,
                c.model.d_model,
                method,
                c.boundary_width,
                c.pipeline.codec,
            ),
            2,
        ),
        "frame_bytes": frame,
        "link_s_per_message": frame / bw,
        "steps": n,
        "dilation": round(k, 3),
        "host_s_per_update": round(host_s, 4),
        "host_cpu_s_per_update_busiest_cell": round(cpu_s, 4),
        "wall_s_per_update": None
        if tokens_per_s is None
        else c.tokens_per_microbatch * c.grid.replicas / tokens_per_s,
        "tokens_per_s": tokens_per_s,
        "fraction_of_ideal": tp.fraction_of_ideal,  # link-inclusive, as the grids A1-A4
        "fraction_of_compute_ideal": None if tokens_per_s is None else tokens_per_s / compute_ideal,
        "predicted_link_model_share": max(compute) / period,
        "host_late_s": tp_late(out / name),
        "staleness": tp.staleness,
        "peak_rss_mb": max(tp.peak_rss_mb.values(), default=None),
        "peak_rss_mb_all_cells": round(sum(tp.peak_rss_mb.values()), 1),
    }


def real_size_entry(
    cfg: Config, compute: list[float], compute_ideal: float, rows: list[dict[str, Any]], t0: float
) -> dict[str, Any]:
    """The real-size entry of the throughput summary: the shapes, link and compute model, the
    host, and each arm's row (t0: when the calibration began, for wall_s)."""
    return {
        "grid": "4x2",
        "shapes": {
            "d_model": cfg.model.d_model,
            "seq_len": cfg.model.seq_len,
            "microbatch_size": cfg.pipeline.microbatch_size,
        },
        "model": "llama-1b boundary shapes; compute from llama-1b's stages",
        "link": {
            "bandwidth_mbps": cfg.transport.link_bandwidth_mbps,
            "latency_ms": cfg.transport.link_latency_ms,
            "shared": cfg.transport.link_shared,
        },
        "compute_formula": "t_stage = (6 x matmul params + 12 x layers x T x d) x B x T / "
        f"({MFU} x {H100_BF16_PEAK:.3g}); forward 1/3, backward 2/3",
        "stage_compute_ms": [round(1e3 * c, 3) for c in compute],
        "compute_bound_tokens_per_s": compute_ideal,
        "stand_in": STAND_IN,
        "dilation_margin": MARGIN,
        "host": {"nproc": os.cpu_count(), "loadavg": list(os.getloadavg())},
        "arms": rows,
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def tp_late(window_dir: Path) -> float:
    """The largest time a cell's emulated device waited on its host (codecs, transport) in
    the window: host-bound time, which a cell on its own machine would not have."""
    from mesh.runtime.rows import parse_rows

    late = 0.0
    for f in (window_dir / "metrics").glob("*.jsonl"):
        for row in parse_rows(f.read_bytes()):  # a torn line is skipped
            if row.get("final"):
                late = max(late, float(row.get("late_s", 0.0)))
    return round(late, 1)


def real_size_table(entry: dict[str, Any]) -> str:
    """The section of table.md (with each arm's loss cost as the boundary study measured it,
    where the entry has them: `with_loss_costs`)."""
    from mesh.report import format_table

    costed = any("loss_cost" in r for r in entry["arms"])
    rows = [
        [
            r["arm"],
            r["rank"],
            f"{r['compression']:.1f}x",
            f"{r['frame_bytes']:,}",
            f"{1e3 * r['link_s_per_message']:.1f}",
            "n/a" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:,.0f}",
            _f(r["fraction_of_compute_ideal"]),
            f"{r['predicted_link_model_share']:.2f}",
            _f(r["fraction_of_ideal"]),
            r["staleness"],
            f"{r.get('dilation', 1.0):.1f}",
            f"{1e3 * r.get('host_s_per_update', math.nan):.0f}",
            *([_cost(r.get("loss_cost"))] if costed else []),
        ]
        for r in entry["arms"]
    ]
    ms = ", ".join(f"{m:.1f}" for m in entry["stage_compute_ms"])
    link = entry["link"]
    shared = (
        " (one uplink a cell: a middle stage's two frames share it)"
        if link.get("shared", "none") != "none"
        else ""
    )
    headers = [
        "boundary",
        "width",
        "vs bf16",
        "frame B",
        "link ms/message",
        "tokens/s",
        "of compute-ideal",
        "predicted",
        "of ideal (link-incl.)",
        "staleness",
        "dilation k",
        "host ms/update",
    ]
    if costed:
        headers.append(f"loss cost (results/boundary, P = {entry.get('loss_cost_P', '?')})")
    return (
        f"## Real-size grid: llama-1b boundaries (d {entry['shapes']['d_model']}, seq "
        f"{entry['shapes']['seq_len']}, microbatch {entry['shapes']['microbatch_size']}), "
        f"{entry['grid']} over {link['bandwidth_mbps']:g} Mbit/s, {link['latency_ms']:g} ms"
        f"{shared}\n\n"
        f"Compute emulated at GPU speed: {entry['compute_formula']}; stages {ms} ms a "
        f"microbatch; compute-ideal {entry['compute_bound_tokens_per_s']:,.0f} tokens/s. "
        "Predicted: the link model, t_slowest / max(t_slowest, frames on the busiest uplink x "
        "frame / bandwidth). Time dilation: each arm ran with every duration x k, k = "
        f"max(1, {entry.get('dilation_margin', MARGIN):g} x the host's own time an update (a "
        "calibration window without sleeps or shaping) / the predicted period); tokens/s are "
        "undilated, fractions do not depend on k.\n\n" + format_table(headers, rows) + "\n"
    )


def with_loss_costs(entry: dict[str, Any], results: Path) -> dict[str, Any]:
    """The entry with each arm's loss gap from results/boundary (its rows at the grid's P; an
    arm the study has not run: None) as `loss_cost`."""
    import json

    path = results / "boundary" / "summary.json"
    if not path.is_file():
        return entry
    rows = json.loads(path.read_text()).get("rows", [])
    gaps = {r["arm"]: r.get("loss_gap") for r in rows if r.get("P") == 4}
    arms = [{**r, "loss_cost": gaps.get(r["arm"])} for r in entry["arms"]]
    return {**entry, "arms": arms, "loss_cost_P": 4}


def _cost(gap: float | None) -> str:
    return "not measured" if gap is None else f"{100 * gap:+.2f}%"


def _f(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def merge_into(out: Path, entry: dict[str, Any]) -> None:
    """Put the entry into out/summary.json (key real_size) and its table at the end of
    out/table.md, replacing an earlier one; the grids A1-A4 stay as they were."""
    import json

    out.mkdir(parents=True, exist_ok=True)
    path = out / "summary.json"
    summary = json.loads(path.read_text()) if path.is_file() else {}
    summary["real_size"] = entry
    path.write_text(json.dumps(summary, indent=2))
    table = out / "table.md"
    text = table.read_text() if table.is_file() else ""
    text = text.split("## Real-size grid")[0].rstrip("\n")
    table.write_text((text + "\n\n" if text else "") + real_size_table(entry))
