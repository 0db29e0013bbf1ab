"""What the formulas predict for a grid, what its windows measured, and the issue's targets."""

from __future__ import annotations

import statistics
from typing import Any

from mesh.algo.schedule import (
    microbatches_per_update,
    predicted_async_tokens_per_s,
    predicted_sync_step_s,
)
from mesh.bench.throughput.protocol import METHODS
from mesh.config import Config, with_overrides
from mesh.runtime.emulate import (
    activation_frame_bytes,
    compute_table,
    emulated_op_s,
    link_bytes_per_s,
    link_latency_s,
    torch_threads,
    window_of,
)


def stage_params(cfg: Config) -> list[int]:
    from mesh.model.build import build_stage

    P = cfg.grid.stages
    with torch_threads(cfg.run.threads):
        return [
            sum(p.numel() for p in build_stage(cfg.model, P, j, cfg.run.seed).parameters())
            for j in range(P)
        ]


def predictions(cfgs: dict[str, Config], n_params: list[int]) -> dict[str, Any]:
    """What the schedule formulas say (mesh/algo/schedule.py), from the same config and link."""
    from comms import codecs
    from mesh.algo.sparse import dp_bytes_per_replica_step, ring_allreduce_bytes

    fs, am = cfgs["FullSync"], cfgs["AsyncMesh"]
    P, m, M = fs.grid.stages, fs.grid.replicas, fs.pipeline.microbatches
    tok = fs.tokens_per_microbatch
    bw = link_bytes_per_s(fs)
    lat = link_latency_s(fs)
    frame = activation_frame_bytes(fs)
    transfer = frame / bw if bw else 0.0
    # blocking all-reduce of each stage's fp32 gradient (torch transport: an all-gather whose
    # m-1 frames cross the link to the ring neighbour, then the link latency)
    allreduce = [
        (m - 1) * (codecs.encoded_nbytes(n, "fp32") / bw if bw else 0.0) + (m - 1) * lat
        for n in n_params
    ]
    steps = []
    for i in range(m):
        tf, tb = zip(*(emulated_op_s(fs, j, i) for j in range(P)), strict=True)
        steps.append(predicted_sync_step_s(P, M, list(tf), list(tb), max(allreduce), lat, transfer))
    sync_step = max(steps)  # replicas meet in every all-reduce
    fs_rate = m * M * tok / sync_step
    compute = compute_table(am)
    times = [[max(c, transfer) for c in row] for row in compute]
    window = window_of(am)
    in_flight = [P - j + (window[j] if window else 0) for j in range(P)]
    # 1 / slowest stage, unless the window cannot cover a round trip (Little's law); the round
    # trip is compute plus link hops (a link-bound stage's period is not part of it)
    am_rate = sum(
        min(
            predicted_async_tokens_per_s(tok, [t_row]),
            predicted_async_tokens_per_s(tok, [c_row], lat, transfer, in_flight),
        )
        for t_row, c_row in zip(times, compute, strict=True)
    )
    ideal = tok * sum(1.0 / max(row) for row in times)
    am_dp = sum(
        dp_bytes_per_replica_step(
            n, m, codecs.bytes_per_value(am.dp.codec, am.dp.block_size), am.dp.fraction
        )
        for n in n_params
    )
    fs_dp = sum(ring_allreduce_bytes(codecs.encoded_nbytes(n, "fp32"), m) for n in n_params)
    pp = {
        label: 2 * (P - 1) * microbatches_per_update(c.pipeline.schedule, M) * frame
        for label, c in cfgs.items()
    }
    return {
        "ideal_tokens_per_s": ideal,
        "FullSync": {
            "step_s": sync_step,
            "tokens_per_s": fs_rate,
            "fraction_of_ideal": fs_rate / ideal,
            "dp_bytes_per_replica_step": fs_dp,
            "pp_bytes_per_replica_step": pp["FullSync"],
        },
        "AsyncMesh": {
            "tokens_per_s": am_rate,
            "fraction_of_ideal": am_rate / ideal,
            "dp_bytes_per_replica_step": am_dp,
            "pp_bytes_per_replica_step": pp["AsyncMesh"],
            "in_flight": in_flight,
        },
        "ratio": am_rate / fs_rate,
        "transfer_s": transfer,
        "allreduce_s": allreduce,
        "updates_per_s": {
            "FullSync": 1.0 / sync_step,
            "AsyncMesh": min(1.0 / max(row) for row in times),
        },
    }


def pp_codec_bytes(cfg: Config) -> dict[str, Any]:
    """Frame bytes of one activation per pipeline codec (the real encoder and wire format)."""
    sizes = {
        c: activation_frame_bytes(with_overrides(cfg, {"pipeline.codec": c}))
        for c in ("fp32", "bf16", "fp8_e4m3")
    }
    return {
        "frame_bytes": sizes,
        "vs_fp32": {c: n / sizes["fp32"] for c, n in sizes.items()},
    }


def c_label(window_name: str) -> str:
    return window_name.split("-", 1)[1]


def _method_summary(results: list[Any], pred: dict[str, Any], ideal_pred: float) -> dict[str, Any]:
    tps = [tp for tp, _ in results]
    rates = [tp.tokens_per_s for tp in tps if tp.tokens_per_s]
    fracs = [tp.fraction_of_ideal for tp in tps if tp.fraction_of_ideal]
    med = statistics.median(rates) if rates else None
    dp = statistics.median(tp.dp_bytes_per_replica_step for tp in tps)
    pp = statistics.median(tp.pp_bytes_per_replica_step for tp in tps)
    stash = [max(tp.peak_stash_bytes.values(), default=0) for tp in tps]
    finals = [f for _, fs in results for f in fs]
    return {
        "tokens_per_s": med,
        "tokens_per_s_windows": rates,
        "fraction_of_ideal": statistics.median(fracs) if fracs else None,
        "ideal_tokens_per_s": tps[0].ideal_tokens_per_s,
        "predicted_tokens_per_s": pred["tokens_per_s"],
        "predicted_fraction_of_ideal": pred["fraction_of_ideal"],
        "vs_prediction": med / pred["tokens_per_s"] if med else None,
        "dp_bytes_per_replica_step": dp,
        "dp_bytes_formula": pred["dp_bytes_per_replica_step"],
        "dp_bytes_vs_formula": dp / pred["dp_bytes_per_replica_step"]
        if pred["dp_bytes_per_replica_step"]
        else None,
        "pp_bytes_per_replica_step": pp,
        "pp_bytes_formula": pred["pp_bytes_per_replica_step"],
        "pp_bytes_vs_formula": pp / pred["pp_bytes_per_replica_step"],
        "staleness": tps[-1].staleness,
        "peak_stash_bytes": max(stash),
        "peak_stash_bytes_per_cell": tps[-1].peak_stash_bytes,
        "peak_rss_mb": max(max(tp.peak_rss_mb.values(), default=0.0) for tp in tps),
        "rounds_failed": sum(int(f.get("rounds_failed", 0)) for f in finals),
        "host_late_s": round(sum(float(f.get("late_s", 0.0)) for f in finals), 3),
    }


def targets(configs: list[dict[str, Any]], codec: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets, each as measured values and a pass flag (times are noisy here)."""
    by = {c["id"]: c for c in configs}

    def ratio_at(i: str) -> float | None:
        return by[i]["ratio"] if i in by else None

    am_fracs = {c["id"]: c["AsyncMesh"]["fraction_of_ideal"] for c in configs}
    fs_vs = {c["id"]: c["FullSync"]["vs_prediction"] for c in configs}
    dp_vs = {c["id"]: {m: c[m]["dp_bytes_vs_formula"] for m in METHODS} for c in configs}
    out = {
        "asyncmesh_fraction_of_ideal_ge_0.9": {
            "values": am_fracs,
            "pass": all(v is not None and v >= 0.9 for v in am_fracs.values()),
        },
        "fullsync_within_15pct_of_prediction": {
            "values": fs_vs,
            "pass": all(v is not None and abs(v - 1) <= 0.15 for v in fs_vs.values()),
        },
        "dp_bytes_within_5pct_of_formula": {
            "values": dp_vs,
            "pass": all(v is not None and v <= 1.05 for d in dp_vs.values() for v in d.values()),
        },
        "pp_bytes_bf16_half_fp8_quarter": {
            "values": codec["vs_fp32"],
            "pass": abs(codec["vs_fp32"]["bf16"] - 0.5) <= 0.01
            and abs(codec["vs_fp32"]["fp8_e4m3"] - 0.25) <= 0.01,
        },
    }
    for i, want in (("A2", 2.0), ("A3", 3.0)):
        r = ratio_at(i)
        if i in by:
            out[f"ratio_{i}_ge_{want:g}x"] = {"value": r, "pass": r is not None and r >= want}
    return out
