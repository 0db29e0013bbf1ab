"""`meshtrain bench comms`: codecs, transports on loopback, background means, link shaping.

Role: `run_comms_bench(out_dir, quick)` measures and writes `out_dir/summary.json` and
`out_dir/table.md`; the CLI only calls it. Transports run in real processes (spawn), one per
peer, on 127.0.0.1. Backends are the list BACKENDS: a new backend is appended there.

Definitions (what the numbers mean; every peer process runs with one torch thread):
- codecs: N random normal values; bytes_per_value = wire bytes / N; rel_err = |decode - x| / |x|
  over x != 0 (median, max); encode/decode MB/s = float32 bytes (4 N) / best-of-k time.
- transports: a fp32 tensor of payload_bytes sent with Transport.send, received and validated
  with Transport.recv. mb_s: a stream of messages back to back, payload bytes / time from the
  first send to the receiver's ack of the last (MB = 1e6 B). p50/p99_ms: one way = half the
  round trip of a ping-pong of that size. The torch rows also give raw gloo send/recv of the
  same tensor (no framing, no validation) as `gloo_raw_mb_s`.
- averaging: `start_mean` of a 5% payload of a 10M-parameter stage (500,000 values) among 4
  replicas, round_ms = median over rounds and replicas of start_mean -> result.
- shaping: two peers whose links are shaped in the application (comms/throttle.py): measured
  bandwidth = wire bytes of one message / median gap between arrivals, in a stream of 16 that
  keeps the link busy; measured latency = half the round trip of a 64-value ping-pong. As
  root, the same bandwidth is also set with kernel tbf on a veth pair between two network
  namespaces (comms/netns.py): kernel_mbps is what TCP got through tbf (it counts
  IP/TCP headers, so ~95%), app_tcp_mbps what our LinkShaper paced over the same veth.

imports: torch, comms only (no mesh, no cli).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from comms import codecs
from comms.build import local_rendezvous, make_transport
from comms.throttle import PROFILES, LinkProfile
from comms.torchdist.gloo import FOREVER
from comms.wire import Expect, Kind

BACKENDS: list[str] = ["torch", "hivemind"]
SIZES = (4 << 10, 1 << 20, 16 << 20)
STAGE_PARAMS, FRACTION, REPLICAS = 10_000_000, 0.05, 4
MEAN_CODECS = ("fp8_e4m3", "bf16", "fp32")
SHAPING = ("wan100", "wan10")
TIMEOUT_S = 60.0


def run_comms_bench(out_dir: Path, quick: bool = False) -> dict:
    """Run every part, write out_dir/summary.json and out_dir/table.md, return the summary."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    summary: dict[str, Any] = {
        "quick": quick,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "load_avg_start": os.getloadavg()[0],  # other work on the box skews every time below
        "codecs": bench_codecs(quick),
        "transports": [],
        "averaging": [],
        "shaping": [],
    }
    for backend in BACKENDS:
        summary["transports"] += bench_transport(backend, quick)
        summary["averaging"] += bench_averaging(backend, quick)
    summary["shaping"] = bench_shaping(quick)
    summary["wall_s"] = round(time.monotonic() - t0, 1)
    summary["load_avg_end"] = os.getloadavg()[0]
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out_dir / "table.md").write_text(to_markdown(summary))
    return summary


# ---------------------------------------------------------------- codecs (in this process)


def bench_codecs(quick: bool, device: str = "cpu", n: int | None = None) -> list[dict]:
    """Every codec on n values (default 4M, quick 1M) on device (scripts/gpu_check.sh: CUDA)."""
    n = n or (1 << 20 if quick else 1 << 22)
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device)
    nz = x != 0
    rows = []
    for codec in codecs.CODECS:
        enc = codecs.encode(x, codec)
        y = codecs.decode(enc)
        rel = ((y - x).abs()[nz] / x.abs()[nz]).double()
        rows.append(
            {
                "name": codec,
                "bytes_per_value": enc.nbytes / n,
                "rel_err_median": rel.median().item(),
                "rel_err_max": rel.max().item(),
                "encode_mb_s": 4 * n / 1e6 / _best(lambda c=codec: codecs.encode(x, c), quick, x),
                "decode_mb_s": 4 * n / 1e6 / _best(lambda e=enc: codecs.decode(e), quick, x),
            }
        )
    return rows


def _best(fn: Callable[[], object], quick: bool, on: torch.Tensor | None = None) -> float:
    """fn's fastest of 3 (quick) or 7 runs in s; on: a tensor whose CUDA device is waited for."""

    def sync() -> None:
        if on is not None and on.is_cuda:
            torch.cuda.synchronize(on.device)

    fn()  # warm up (lazy imports, allocator)
    times = []
    for _ in range(3 if quick else 7):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return min(times)


# ---------------------------------------------------------------- transports (2 processes)


def bench_transport(backend: str, quick: bool) -> list[dict]:
    res = run_procs(backend, ["a", "b"], {}, "_transport_peer", quick=quick)
    return res["a"]["rows"]


def _transport_peer(t, me: str, names: list[str], quick: bool) -> dict:
    other = names[1] if me == names[0] else names[0]
    rows = []
    for size in SIZES:
        x = torch.randn(size // 4)
        enc = codecs.encode(x, "fp32")
        want = Expect(shape=(size // 4,))
        pings = {4 << 10: 200, 1 << 20: 40, 16 << 20: 10}[size] // (4 if quick else 1)
        stream = {4 << 10: 400, 1 << 20: 60, 16 << 20: 12}[size] // (4 if quick else 1)
        one_way = []
        for i in range(pings + 1):  # round trips; the first is a warm-up
            if me == names[0]:
                start = time.perf_counter()
                t.send(other, f"p{size}/{i}", Kind.ACTIVATION, enc, i)
                t.recv(other, f"q{size}/{i}", want, TIMEOUT_S)
                one_way.append((time.perf_counter() - start) / 2)
            else:
                msg = t.recv(other, f"p{size}/{i}", want, TIMEOUT_S)
                t.send(other, f"q{size}/{i}", Kind.ACTIVATION, msg.encoded, i)
        if me == names[0]:
            start = time.perf_counter()
            for i in range(stream):
                t.send(other, f"s{size}/{i}", Kind.ACTIVATION, enc, i)
            t.recv(other, f"ack{size}", Expect(), TIMEOUT_S)
            elapsed = time.perf_counter() - start
            one_way = sorted(one_way[1:])
            row = {
                "backend": t.backend,
                "payload_bytes": size,
                "mb_s": stream * size / elapsed / 1e6,
                "p50_ms": 1e3 * statistics.median(one_way),
                "p99_ms": 1e3 * one_way[min(len(one_way) - 1, int(0.99 * len(one_way)))],
            }
            if t.backend == "torch":
                row["gloo_raw_mb_s"] = _raw_gloo(t, other, x, stream, sender=True)
            rows.append(row)
        else:
            for i in range(stream):
                t.recv(other, f"s{size}/{i}", want, TIMEOUT_S)
            t.send(other, f"ack{size}", Kind.CONTROL, codecs.encode(torch.zeros(1), "fp32"), 0)
            if t.backend == "torch":
                _raw_gloo(t, other, x, stream, sender=False)
    return {"rows": rows}


def _raw_gloo(t, other: str, x: torch.Tensor, n: int, sender: bool) -> float:
    """The same tensor over bare gloo send/recv on the transport's own pair group (tag 10)."""
    pair, rank = t._links[other].pair, t._links[other].peer_rank
    buf = torch.empty_like(x)
    start = time.perf_counter()
    for _ in range(n):
        if sender:
            pair.send([x], rank, 10).wait(FOREVER)
        else:
            pair.recv([buf], rank, 10).wait(FOREVER)
    ack = torch.zeros(1)
    (pair.recv if sender else pair.send)([ack], rank, 11).wait(FOREVER)
    return n * x.numel() * 4 / (time.perf_counter() - start) / 1e6


# ---------------------------------------------------------------- averaging (4 processes)


def bench_averaging(backend: str, quick: bool) -> list[dict]:
    names = [f"r{i}" for i in range(REPLICAS)]
    rounds = 3 if quick else 10
    res = run_procs(backend, names, {"stage": names}, "_mean_peer", rounds=rounds)
    rows = []
    for codec in MEAN_CODECS:
        per_replica = [statistics.median(res[n]["round_ms"][codec]) for n in names]
        rows.append(
            {
                "backend": backend,
                "replicas": REPLICAS,
                "payload_values": int(STAGE_PARAMS * FRACTION),
                "codec": codec,
                "round_ms": statistics.median(per_replica),
                "round_ms_max": max(max(res[n]["round_ms"][codec]) for n in names),
                "statuses": sorted({s for n in names for s in res[n]["statuses"][codec]}),
            }
        )
    return rows


def _mean_peer(t, me: str, names: list[str], rounds: int) -> dict:
    values = torch.randn(int(STAGE_PARAMS * FRACTION))
    round_ms: dict[str, list[float]] = {}
    statuses: dict[str, list[str]] = {}
    r = 0
    for codec in MEAN_CODECS:
        for i in range(rounds + 1):  # the first round is a warm-up
            start = time.perf_counter()
            res = t.start_mean("stage", names, r, values, codec, TIMEOUT_S).result(TIMEOUT_S)
            if i:
                round_ms.setdefault(codec, []).append(1e3 * (time.perf_counter() - start))
                statuses.setdefault(codec, []).append(res.status.value)
            r += 1
    return {"round_ms": round_ms, "statuses": statuses}


# ---------------------------------------------------------------- shaping


def bench_shaping(quick: bool) -> list[dict]:
    rows = []
    for name in SHAPING:
        p = PROFILES[name]
        nbytes = int(p.bandwidth_mbps * 1e6 / 8 * (0.4 if quick else 1.0))  # 0.4 s / 1 s of data
        res = run_procs("torch", ["a", "b"], {}, "_shaping_peer", shaping=p, nbytes=nbytes)
        row = {
            "profile": name,
            "target_mbps": p.bandwidth_mbps,
            "measured_mbps": res["b"]["mbps"],
            "target_latency_ms": p.latency_ms,
            "measured_latency_ms": res["a"]["latency_ms"],
        }
        row.update(_kernel_check(p.bandwidth_mbps, nbytes))
        rows.append(row)
    return rows


def _shaping_peer(t, me: str, names: list[str], nbytes: int) -> dict:
    a, b = names
    other = b if me == a else a
    small = codecs.encode(torch.randn(64), "fp32")
    count = 16  # messages of nbytes / 16: the link stays busy, the estimate has 15 intervals
    chunk = codecs.encode(torch.randn(max(64, nbytes // count // 4)), "fp32")
    lat = []
    for i in range(6):  # ping-pong of small messages; the first is a warm-up
        if me == a:
            start = time.perf_counter()
            t.send(b, f"p{i}", Kind.CONTROL, small, i)
            t.recv(b, f"q{i}", Expect(), TIMEOUT_S)
            lat.append(1e3 * (time.perf_counter() - start) / 2)
        else:
            t.recv(a, f"p{i}", Expect(), TIMEOUT_S)
            t.send(a, f"q{i}", Kind.CONTROL, small, i)
    if me == a:
        for i in range(count):
            t.send(b, f"s{i}", Kind.ACTIVATION, chunk, i)
        t.recv(b, "done", Expect(), TIMEOUT_S)
        return {"latency_ms": statistics.median(lat[1:])}
    arrivals = []
    for i in range(count):
        t.recv(a, f"s{i}", Expect(), TIMEOUT_S)
        arrivals.append(time.perf_counter())
    t.send(a, "done", Kind.CONTROL, small, 0).wait(TIMEOUT_S)
    frame = t.stats.bytes_received[(other, "activation")] / count  # bytes on the wire each
    gap = statistics.median(b - a for a, b in zip(arrivals, arrivals[1:], strict=False))
    return {"mbps": 8 * frame / gap / 1e6}  # median gap: one late wake-up does not skew it


def _kernel_check(mbps: float, nbytes: int) -> dict:
    """Kernel tbf vs our LinkShaper over the same veth (root only; else the reason)."""
    from comms import netns

    why = netns.unavailable()
    if why:
        return {"kernel_check": f"skipped: {why}"}
    try:
        with netns.netns_pair(rate_mbit=mbps) as pair:
            kernel = netns.measure_mbps(pair, nbytes)
            netns.set_rate(pair, None)
            app = netns.measure_mbps(pair, nbytes, app_mbps=mbps)
    except Exception as e:  # noqa: BLE001 - a failed cross-check is reported, not fatal
        return {"kernel_check": f"failed: {type(e).__name__}: {e}"[:300]}
    return {"kernel_mbps": kernel, "app_tcp_mbps": app, "kernel_check": "ok"}


# ---------------------------------------------------------------- processes


def run_procs(
    backend: str,
    names: list[str],
    groups: dict[str, list[str]],
    fn: str,
    shaping: LinkProfile | None = None,
    timeout_s: float = 300.0,
    **kwargs: Any,
) -> dict[str, dict]:
    """Run this module's `fn(transport, me, names, **kwargs)` in one process per name."""
    ctx = mp.get_context("spawn")
    with local_rendezvous(backend) as rz:
        pipes = [ctx.Pipe(duplex=False) for _ in names]
        procs = [
            ctx.Process(target=_child, args=(backend, n, names, groups, rz, shaping, fn, kwargs, w))
            for n, (_, w) in zip(names, pipes, strict=True)
        ]
        for p in procs:
            p.start()
        for _, w in pipes:
            w.close()
        out, deadline = {}, time.monotonic() + timeout_s
        try:
            for n, (r, _) in zip(names, pipes, strict=True):
                if not r.poll(max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"bench peer {n} gave no result in {timeout_s}s")
                out[n] = r.recv()
        finally:
            for p in procs:
                p.join(max(0.0, min(30.0, deadline - time.monotonic())))
                if p.is_alive():
                    p.kill()
                    p.join()
    errors = {n: r["error"] for n, r in out.items() if "error" in r}
    if errors:
        raise RuntimeError(f"bench {fn} failed: {errors}")
    return out


def _child(backend, me, names, groups, rz, shaping, fn, kwargs, conn) -> None:
    # one intra-op thread per peer: several peers share the cores, and idle OpenMP workers
    # spinning in one process steal them from the transport threads of the others
    torch.set_num_threads(1)
    try:
        t = make_transport(backend, me, names, groups, rz, timeout_s=TIMEOUT_S, shaping=shaping)
        try:
            conn.send(globals()[fn](t, me, names, **kwargs))
        finally:
            t.close()
    except Exception:  # noqa: BLE001 - reported to the parent, which raises
        conn.send({"error": traceback.format_exc()})


# ---------------------------------------------------------------- report


def to_markdown(s: dict) -> str:
    def table(rows: list[dict], cols: list[str]) -> list[str]:
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in rows:
            lines.append("| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |")
        return lines + [""]

    out = [f"# comms bench ({'quick' if s['quick'] else 'full'}, torch {s['torch']})", ""]
    load = f"{s['load_avg_start']:.1f} at the start, {s['load_avg_end']:.1f} at the end"
    out += [f"{s['cpus']} CPUs; load average {load} (other work skews the times).", ""]
    out += ["## Codecs (block 128)", ""]
    out += table(
        s["codecs"],
        ["name", "bytes_per_value", "rel_err_median", "rel_err_max", "encode_mb_s", "decode_mb_s"],
    )
    out += ["## Transports (loopback, 2 processes, fp32 tensors; MB = 1e6 B)", ""]
    out += table(
        s["transports"], ["backend", "payload_bytes", "mb_s", "p50_ms", "p99_ms", "gloo_raw_mb_s"]
    )
    out += [f"## Background mean ({REPLICAS} replicas, 5% of a 10M-parameter stage)", ""]
    out += table(
        s["averaging"],
        ["backend", "replicas", "payload_values", "codec", "round_ms", "round_ms_max", "statuses"],
    )
    out += ["## Link shaping (in-app; kernel tbf cross-check as root)", ""]
    out += table(
        s["shaping"],
        [
            "profile",
            "target_mbps",
            "measured_mbps",
            "target_latency_ms",
            "measured_latency_ms",
            "kernel_mbps",
            "app_tcp_mbps",
            "kernel_check",
        ],
    )
    return "\n".join(out)


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"
    if isinstance(v, list):
        return ",".join(map(str, v))
    return str(v)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="meshtrain comms benchmark")
    ap.add_argument("--out", type=Path, default=Path("results/comms"))
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    print(to_markdown(run_comms_bench(args.out, args.quick)))
