"""The real-size grid of `meshtrain bench throughput --real-size`: llama-1b's boundary shapes
(d 2304, seq 1024, microbatch 8: the real payloads on the wire) on a 4x2 grid over 100 Mbit/s,
50 ms links, compute emulated at GPU speed, full fp8 boundaries against compressed ones.

Compute: a stage's time per microbatch is plan's FLOPs of that llama-1b stage over 40% of an
H100's dense bf16 peak,

    t_stage = (6 x matmul parameters + 12 x layers x T x d) [FLOP/token] x B x T / (0.4 x 989e12)

split one third forward, two thirds backward (runtime.forward_ms / backward_ms of the middle
stages, runtime.slowdowns for a stage whose FLOPs differ: the last holds the head). No model
math runs, so only what crosses the links matters: each cell holds a stand-in of one block of
d 2304 (1 kv head, SwiGLU width 64, vocab 256) to keep 8 cells within this box's memory; the
averaging rounds therefore move the stand-in's bytes, not a real stage's (`plan
--uplink-mbit` sizes those).

Reported beside the link-inclusive "of ideal" (tokens/s over the rate max(compute, link) per
stage allows): the fraction of compute-ideal, tokens/s over the rate the stages' compute alone
allows (tokens per microbatch x replicas / the slowest stage's time).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from mesh.bench.model import stage_flops_per_token
from mesh.bench.throughput.protocol import BENCH, SKIP_FRAC
from mesh.config import Config, load_config, with_overrides
from mesh.engine.plan import compression_vs_bf16, rank_for_compression
from mesh.methods import apply_method
from mesh.runtime.emulate import activation_frame_bytes, resolve_window, throughput
from mesh.runtime.metrics import read_metrics

H100_BF16_PEAK = 989e12  # dense bf16 FLOP/s, the vendor's sheet
MFU = 0.40
REAL_MODEL = "configs/models/llama-1b.toml"
LINK = {"runtime.link": "none", "runtime.link_bandwidth_mbps": 100.0,
        "runtime.link_latency_ms": 50.0}  # fmt: skip
STAND_IN = {"model.n_layers": 4, "model.n_kv_heads": 1, "model.intermediate_size": 64,
            "model.vocab_size": 256}  # fmt: skip
ARMS = (("full fp8", "full", None), ("learned 16x", "learned", 16), ("learned 64x", "learned", 64))


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
    slow = [f"s{j}r{i}={c / mid:.4f}" for j, c in enumerate(compute) if abs(c / mid - 1) > 1e-3
            for i in range(real.grid.replicas)]  # fmt: skip
    keep = {k: v for k, v in BENCH.items() if not k.startswith("model.")}
    cfg = with_overrides(
        base,
        {**{f"model.{k}": v for k, v in real.model.model_dump().items()}, **STAND_IN, **keep,
         **LINK, "grid.stages": 4, "grid.replicas": 2, "pipeline.microbatch_size": 8,
         "runtime.forward_ms": 1e3 * mid / 3, "runtime.backward_ms": 2e3 * mid / 3,
         "runtime.slowdowns": slow, "runtime.timeout_s": 300.0},
    )  # fmt: skip
    return apply_method(cfg, "AsyncMesh-fp8"), compute


def arm_config(cfg: Config, method: str, ratio: int | None) -> Config:
    ov: dict[str, Any] = {"pipeline.boundary": method, "pipeline.codec": "fp8_e4m3"}
    if ratio is not None:
        tokens, d = cfg.tokens_per_microbatch, cfg.model.d_model
        ov["pipeline.boundary_rank"] = rank_for_compression(tokens, d, ratio, "fp8_e4m3")
    return resolve_window(with_overrides(cfg, ov))


def uplink_s_per_microbatch(cfg: Config, bandwidth_bytes_per_s: float) -> float:
    """Seconds the busiest cell's uplink needs a microbatch: a middle stage sends the
    activation on and the gradient back over the one uplink it has."""
    frames = 2 if cfg.grid.stages > 2 else 1
    return frames * activation_frame_bytes(cfg) / bandwidth_bytes_per_s


def run_real_size(base: Config, out: Path, steps: int = 40) -> dict[str, Any]:
    """Every arm as one window on one set of 4x2 cell processes; the real-size entry."""
    from mesh.bench.throughput.runs import _run_windows

    cfg, compute = real_size_config(base)
    arms = [(label, arm_config(cfg, m, r)) for label, m, r in ARMS]
    bw = cfg.runtime.link_bandwidth_mbps * 1e6 / 8
    slowest = max(compute)
    plan, next_base = [], 0
    for label, c in arms:
        # a fixed count, not a duration: on a small host the codecs of 8 cells, not the link,
        # can set the pace, and a duration would then ask for far more updates than it runs
        plan.append((label.replace(" ", "-"), c, steps, next_base))
        next_base += steps
    expected = sum(steps * uplink_s_per_microbatch(c, bw) for _, c, _, _ in plan)
    t0 = time.perf_counter()
    _run_windows(cfg, plan, out, timeout_s=600 + 10 * expected)
    compute_ideal = cfg.tokens_per_microbatch * cfg.grid.replicas / slowest
    rows = []
    for (label, method, _), (name, c, steps, _) in zip(ARMS, plan, strict=True):
        tp = throughput(c, read_metrics(out / name), SKIP_FRAC)
        frame = activation_frame_bytes(c)
        rows.append({
            "arm": label, "boundary": method, "rank": c.boundary_width,
            "compression": round(compression_vs_bf16(
                c.tokens_per_microbatch, c.model.d_model, method, c.boundary_width, "fp8_e4m3"), 2),
            "frame_bytes": frame, "link_s_per_message": frame / bw, "steps": steps,
            "wall_s_per_update": None if tp.tokens_per_s is None
            else c.tokens_per_microbatch * c.grid.replicas / tp.tokens_per_s,
            "tokens_per_s": tp.tokens_per_s,
            "fraction_of_ideal": tp.fraction_of_ideal,  # link-inclusive, as the grids A1-A4
            "fraction_of_compute_ideal": None if tp.tokens_per_s is None
            else tp.tokens_per_s / compute_ideal,
            "predicted_link_model_share": slowest
            / max(slowest, uplink_s_per_microbatch(c, bw)),
            "host_late_s": tp_late(out / name),
            "staleness": tp.staleness,
            "peak_rss_mb": max(tp.peak_rss_mb.values(), default=None),
        })  # fmt: skip
    return {
        "grid": "4x2",
        "shapes": {
            "d_model": cfg.model.d_model,
            "seq_len": cfg.model.seq_len,
            "microbatch_size": cfg.pipeline.microbatch_size,
        },  # fmt: skip
        "model": "llama-1b boundary shapes; compute from llama-1b's stages",
        "link": {
            "bandwidth_mbps": cfg.runtime.link_bandwidth_mbps,
            "latency_ms": cfg.runtime.link_latency_ms,
        },  # fmt: skip
        "compute_formula": "t_stage = (6 x matmul params + 12 x layers x T x d) x B x T / "
        f"({MFU} x {H100_BF16_PEAK:.3g}); forward 1/3, backward 2/3",
        "stage_compute_ms": [round(1e3 * c, 3) for c in compute],
        "compute_bound_tokens_per_s": compute_ideal,
        "stand_in": STAND_IN,
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
    from mesh.bench.report import format_table

    rows = [
        [r["arm"], r["rank"], f"{r['compression']:.1f}x", f"{r['frame_bytes']:,}",
         f"{1e3 * r['link_s_per_message']:.1f}",
         "n/a" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:,.0f}",
         _f(r["fraction_of_compute_ideal"]), f"{r['predicted_link_model_share']:.2f}",
         _f(r["fraction_of_ideal"]), r["staleness"], r.get("host_late_s", "n/a")]
        for r in entry["arms"]
    ]  # fmt: skip
    ms = ", ".join(f"{m:.1f}" for m in entry["stage_compute_ms"])
    return (
        f"## Real-size grid: llama-1b boundaries (d {entry['shapes']['d_model']}, seq "
        f"{entry['shapes']['seq_len']}, microbatch {entry['shapes']['microbatch_size']}), "
        f"{entry['grid']} over {entry['link']['bandwidth_mbps']:g} Mbit/s, "
        f"{entry['link']['latency_ms']:g} ms\n\n"
        f"Compute emulated at GPU speed: {entry['compute_formula']}; stages {ms} ms a "
        f"microbatch; compute-ideal {entry['compute_bound_tokens_per_s']:,.0f} tokens/s.\n\n"
        + format_table(
            [
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
                "host-late s",
            ],
            rows,
        )  # fmt: skip
        + "\n"
    )


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
