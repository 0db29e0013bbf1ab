"""Emulated compute, link profiles and the throughput accounting of a run.

Role: what `emulation.compute = "emulated"`, `emulation.slowdowns`, `transport.link` and
`pipeline.window = "auto"` mean in numbers, and how a run's metrics rows become tokens/s, the
ideal (each replica at its slowest stage's pace, a stage's time per microbatch the larger of
its compute and its link time; with stage pools the slowest stage's summed speed) and
`fraction_of_ideal`. Used by the stage worker
(`ComputeClock`), the trainer (the link profile), the launcher (the window), `summarize_run`
and the throughput benchmark, so they all count the same way.

Emulated compute. A cell owns an emulated device: an op of duration t (forward_ms or backward_ms
x the cell's slowdown) occupies it from start = max(ready, free_at) to deadline = start + t,
where `ready` is when the op's input arrived (the end of the last receive or collective that
actually blocked) and `free_at` the previous op's deadline. The host does the op's real work
(building and encoding the payload) first, sleeps until the deadline, then hands the payload to
the transport, so a stage's busy time per microbatch is exactly its emulated time whenever the
host work fits inside it (host work overlaps device time, as kernel launches overlap a GPU).
Sleeps overshoot by a small, steady amount; the clock learns it (EMA) and wakes that much early.

imports: torch, comms, mesh (no cli).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from comms.throttle import PROFILES, LinkProfile
from mesh.algo import routing
from mesh.algo.schedule import extra_warmups, microbatches_per_update
from mesh.algo.topology import Grid, cell_name
from mesh.config import Config, parse_slowdowns, with_overrides

# ---- emulated compute -----------------------------------------------------------------------


class ComputeClock:
    """The emulated device of one cell (see the module docstring). Not thread-safe.

    Args:
        clock, sleep: injectable for tests (time.perf_counter / time.sleep by default).
        bias_limit_s: the most the clock wakes early to cancel oversleep.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
        bias_limit_s: float = 0.002,
    ) -> None:
        self._clock, self._sleep, self._limit = clock, sleep, bias_limit_s
        self.free_at = -math.inf  # the device finishes its last op at this time
        self.ready = -math.inf  # the host's inputs for the next op were there at this time
        self.bias_s = 0.0  # learned oversleep: sleeps end this much early
        self.busy_s = 0.0  # emulated compute time so far
        self.late_s = 0.0  # deadlines passed before the host was done (host-bound time)
        self.ops = 0

    def now(self) -> float:
        return self._clock()

    def waited(self, since: float, threshold_s: float = 0.001) -> None:
        """Call after a receive or collective that began at `since`: if it blocked (took longer
        than threshold_s), the next op cannot start before now."""
        now = self._clock()
        if now - since > threshold_s:
            self.ready = max(self.ready, now)

    def begin(self, duration_s: float) -> float:
        """Reserve the device for one op; returns its deadline."""
        if duration_s < 0:
            raise ValueError(f"an op cannot take {duration_s} s")
        start = max(self.ready, self.free_at)
        if not math.isfinite(start):  # the first op: starts now
            start = self._clock()
        self.free_at = start + duration_s
        self.busy_s += duration_s
        self.ops += 1
        return self.free_at

    def finish(self, deadline: float) -> None:
        """Sleep until `deadline` (minus the learned oversleep) after the host's own work."""
        now = self._clock()
        if now >= deadline:
            self.late_s += now - deadline
            return
        self._sleep(max(0.0, deadline - now - self.bias_s))
        over = self._clock() - deadline
        # EMA of the oversleep, kept within [0, limit]: early wakes pull it back down
        self.bias_s = min(self._limit, max(0.0, self.bias_s + 0.2 * over))


def slowdown(cfg: Config, stage: int, replica: int) -> float:
    """The compute factor of cell (stage, replica) from emulation.slowdowns (1.0 if unlisted)."""
    table = parse_slowdowns(cfg.emulation.slowdowns, cfg.grid.stages, cfg.grid.replicas)
    return table.get((stage, replica), 1.0)


def real_op_s(spent_s: float, factor: float, floor_s: float) -> float:
    """How long a real forward or backward takes the cell: its CPU time `spent_s` x its
    slowdown `factor`, and at least `floor_s` (emulation.min_compute_ms)."""
    return max(spent_s * factor, floor_s)


def emulated_op_s(cfg: Config, stage: int, replica: int) -> tuple[float, float]:
    """(forward, backward) seconds per microbatch of one cell in emulated mode."""
    f = slowdown(cfg, stage, replica)
    return cfg.emulation.forward_ms * f / 1e3, cfg.emulation.backward_ms * f / 1e3


# ---- links ----------------------------------------------------------------------------------


def link_profile(cfg: Config) -> LinkProfile | None:
    """The profile every link gets: transport.link, with link_bandwidth_mbps / link_latency_ms
    replacing its fields when set; None when nothing is shaped."""
    rt = cfg.transport
    base = PROFILES[rt.link] if rt.link != "none" else LinkProfile()
    bw = rt.link_bandwidth_mbps if rt.link_bandwidth_mbps is not None else base.bandwidth_mbps
    lat = rt.link_latency_ms if rt.link_latency_ms is not None else base.latency_ms
    p = LinkProfile(bandwidth_mbps=bw, latency_ms=lat, jitter_ms=base.jitter_ms, seed=cfg.run.seed)
    return p if p.is_shaped else None


def cell_shaping(cfg: Config, stage: int, replica: int) -> LinkProfile | dict[str, LinkProfile]:
    """What cell (stage, replica) shapes its outgoing links with (comms.throttle.Shaping): the
    one profile for every link, or with transport.link_shared per destination, the shared ones
    naming this cell's uplink."""
    p = link_profile(cfg)
    shared = cfg.transport.link_shared
    if p is None or shared == "none":
        return p  # type: ignore[return-value]
    P, m = cfg.grid.stages, cfg.grid.replicas
    me = cell_name(stage, replica)
    pipeline = {cell_name(j, replica) for j in (stage - 1, stage + 1) if 0 <= j < P}
    uplink = dataclasses.replace(p, uplink=me)
    return {
        name: uplink if shared == "all" or name in pipeline else p
        for name in Grid(P, m).names()
        if name != me
    }


def uplink_frames(cfg: Config, stage: int) -> int:
    """Pipeline frames a microbatch puts on one wire of stage `stage`: with a shared uplink a
    middle stage's activation and gradient (2), else one per link."""
    if cfg.transport.link_shared == "none":
        return 1
    return (stage < cfg.grid.stages - 1) + (stage > 0)


def link_bytes_per_s(cfg: Config) -> float | None:
    p = link_profile(cfg)
    return None if p is None or p.bandwidth_mbps is None else p.bandwidth_mbps * 1e6 / 8


def link_latency_s(cfg: Config) -> float:
    p = link_profile(cfg)
    return 0.0 if p is None else p.latency_ms / 1e3


def activation_frame_bytes(cfg: Config) -> int:
    """Bytes one activation (or its gradient) puts on a pipeline link: the wire frame of a
    (B, T, width) tensor (pipeline.boundary) in the pipeline codec plus the torch transport's
    8-byte length."""
    import torch

    from comms import codecs, wire

    shape = cfg.boundary_shape
    codec = cfg.pipeline.codec
    # the header depends on the name and the number of dimensions only: pack one value
    one = wire.pack("act/0", wire.Kind.ACTIVATION, codecs.encode(torch.ones(1, 1, 1), codec), 0)
    numel = shape[0] * shape[1] * shape[2]
    return 8 + len(one) - codecs.encoded_nbytes(1, codec) + codecs.encoded_nbytes(numel, codec)


# ---- stage times, ideal, window ---------------------------------------------------------------


def compute_table(
    cfg: Config, measured: Mapping[tuple[int, int], float] | None = None
) -> list[list[float]]:
    """Compute seconds per microbatch, [replica][stage]: emulated (f + b) x slowdown, or the
    `measured` busy time per microbatch of each cell (real compute)."""
    P, m = cfg.grid.stages, cfg.grid.replicas
    if cfg.emulation.compute == "emulated":
        return [[sum(emulated_op_s(cfg, j, i)) for j in range(P)] for i in range(m)]
    if measured is None:
        raise ValueError("real compute: pass the measured busy time per microbatch of each cell")
    return [[measured[(j, i)] for j in range(P)] for i in range(m)]


def stage_times(
    compute: list[list[float]], link_s: Mapping[tuple[int, int], float] | float
) -> list[list[float]]:
    """[replica][stage] max(compute, link time per microbatch)."""
    out = []
    for i, row in enumerate(compute):
        out.append(
            [
                max(c, link_s if isinstance(link_s, float | int) else link_s.get((j, i), 0.0))
                for j, c in enumerate(row)
            ]
        )
    return out


def measure_compute_s(cfg: Config, repeats: int = 3) -> list[float]:
    """Real compute: thread CPU seconds of one forward + backward (with the backward's
    recomputed forward, as the worker does) per stage, median of `repeats` (window sizing)."""

    from mesh.model.build import build_cell_stages

    with torch_threads(cfg.run.threads):  # as the cells will run
        stages = build_cell_stages(cfg)
        return [_time_stage(cfg, j, st, len(stages), repeats) for j, st in enumerate(stages)]


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to n for the block (on a busy 2-core box, 2 threads make
    small ops orders of magnitude slower than 1)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _time_stage(cfg: Config, j: int, st: Any, num_stages: int, repeats: int) -> float:
    import torch

    from mesh.model.build import lm_loss, needs_tokens

    B, T, w = cfg.boundary_shape  # a stage past the first takes what crosses the boundary
    times = []
    for _ in range(repeats):
        tokens = torch.randint(0, cfg.model.vocab_size, (B, T))
        x = tokens if j == 0 else torch.randn(B, T, w, requires_grad=True)
        kwargs = {"tokens": tokens} if needs_tokens(st) else {}
        t0 = time.thread_time()
        with torch.no_grad():
            st(x, **kwargs)
        y = st(x, **kwargs)
        if j == num_stages - 1:
            lm_loss(y, torch.randint(0, cfg.model.vocab_size, (B, T))).backward()
        else:
            y.backward(torch.ones_like(y))
        times.append(time.thread_time() - t0)
    return statistics.median(times)


def resolve_window(cfg: Config, headroom: float = 0.25) -> Config:
    """cfg with pipeline.window = 'auto' replaced by the extra warm-ups per stage.

    Sized from the configured round trip (schedule.extra_warmups): stage compute per replica
    (emulated times, or measured here for real compute), the link's latency and the transfer
    time of one activation frame; the period is the slowest stage's time including its link.
    `headroom` stretches the round trip's link part (latency + transfer per hop) for what the
    formula leaves out (codecs, thread wake-ups, a loaded host): a window sized exactly to the
    RTT starves at the first hiccup. The last stage has no link in its loop: no window.
    The max over replicas is taken (one window per stage). Sync schedules: 'none'.
    """
    if cfg.pipeline.window != "auto":
        return cfg
    if cfg.pipeline.schedule != "async":
        return with_overrides(cfg, {"pipeline.window": "none"})
    bw = link_bytes_per_s(cfg)
    transfer = activation_frame_bytes(cfg) / bw if bw else 0.0
    if cfg.emulation.compute == "emulated":
        rows = compute_table(cfg)
    else:
        measured = measure_compute_s(cfg)  # forward and backward: two floors a microbatch
        floor_s = cfg.emulation.min_compute_ms / 1e3
        rows = [
            [real_op_s(t, slowdown(cfg, j, i), 2 * floor_s) for j, t in enumerate(measured)]
            for i in range(cfg.grid.replicas)
        ]
    lat = link_latency_s(cfg)
    # a shared uplink: a frame may wait behind the other direction's, and a middle stage's
    # period holds both
    transfer *= max(uplink_frames(cfg, j) for j in range(cfg.grid.stages))
    extra = [0] * cfg.grid.stages
    for row in rows:
        period = max(max(row), transfer)
        stretched = extra_warmups(row, lat * (1 + headroom), transfer * (1 + headroom), period)
        extra = [max(a, b) for a, b in zip(extra, stretched)]
    return with_overrides(cfg, {"pipeline.window": extra})


def window_of(cfg: Config) -> list[int] | None:
    """The resolved window as `actions` takes it (None for 'none'); 'auto' must be resolved."""
    if cfg.pipeline.window == "auto":
        raise ValueError("pipeline.window = 'auto' must be resolved first (resolve_window)")
    return cfg.pipeline.extra_warmups()


# ---- throughput accounting ------------------------------------------------------------------


def steady_rate(
    times_s: Sequence[float], steps: Sequence[int], skip_frac: float = 0.2
) -> float | None:
    """Updates per second of one cell from its (time, step) rows, the first skip_frac of the
    rows (warm-up: pipeline fill, first connections) left out; None with < 2 rows."""
    n = len(times_s)
    if n < 2:
        return None
    k = min(max(1, math.ceil(skip_frac * n)), n - 2) if n > 2 else 0
    dt = times_s[-1] - times_s[k]
    return (steps[-1] - steps[k]) / dt if dt > 0 else None


@dataclass(frozen=True)
class Throughput:
    """What a run (or a bench window) achieved against its ideal."""

    tokens_per_s: float | None  # steady state, summed over replicas (last stage's updates)
    ideal_tokens_per_s: float
    fraction_of_ideal: float | None
    compute_s: list[list[float]]  # [replica][stage] per microbatch
    link_s: list[list[float]]  # [replica][stage] per microbatch (0 when unshaped)
    stage_s: list[list[float]]  # max of the two
    pp_bytes_per_replica_step: float
    dp_bytes_per_replica_step: float
    staleness: list[int]  # per stage: the largest (live - read) version gap of a forward
    peak_stash_bytes: dict[str, int]  # per cell: weight versions + in-flight activations
    peak_rss_mb: dict[str, float]  # per cell

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def throughput(
    cfg: Config, rows: Mapping[tuple[int, int], list[dict[str, Any]]], skip_frac: float = 0.2
) -> Throughput:
    """From the metrics rows of every cell (trainer.run_cell's per-update rows: time_s, step,
    bytes_sent, microbatches, busy_s, staleness_max, stash_bytes_peak, rss_peak_mb):
    the steady tokens/s, the ideal tokens per microbatch x sum_r 1 / max_s t_{s,r} with
    t = max(compute, link) per microbatch, and their ratio.

    Compute: emulated (forward_ms + backward_ms) x slowdown exactly; real: the
    cell's busy thread CPU time per microbatch. Link: the larger of the activation and
    the gradient bytes the cell sent per microbatch over the link bandwidth; with
    transport.link_shared their sum (one uplink carries both; "all": the averaging bytes too).
    """
    P, m = cfg.grid.stages, cfg.grid.replicas
    mpu = microbatches_per_update(cfg.pipeline.schedule, cfg.pipeline.microbatches)
    tok = cfg.tokens_per_microbatch
    steps_rows = {
        k: [r for r in v if "time_s" in r and not r.get("final")] for k, v in rows.items()
    }
    last = {k: v[-1] for k, v in steps_rows.items() if v}
    # bytes: a cell's final row (written after its sends drained) when there is one
    final_bytes = {
        k: r["bytes_sent"]
        for k, v in rows.items()
        for r in v
        if r.get("final") and "bytes_sent" in r
    }
    bw = link_bytes_per_s(cfg)
    busy, link = {}, {}
    for k, r in last.items():
        mbs = max(1, int(r.get("microbatches", r["step"] * mpu)))
        busy[k] = float(r.get("busy_s", 0.0)) / mbs
        sent = final_bytes.get(k, r.get("bytes_sent", {}))
        act, grad = sent.get("activation", 0), sent.get("gradient", 0)
        shared = cfg.transport.link_shared
        per_mb = (
            max(act, grad)
            if shared == "none"
            else act + grad + (sent.get("average", 0) if shared == "all" else 0)
        ) / mbs
        link[k] = per_mb / bw if bw else 0.0
    if cfg.emulation.compute == "emulated":
        compute = compute_table(cfg)
    else:
        compute = [[busy.get((j, i), 0.0) for j in range(P)] for i in range(m)]
    link_rows = [[link.get((j, i), 0.0) for j in range(P)] for i in range(m)]
    # a cell emulation.deaths takes out from the start never ran (on a fixed grid its whole
    # replica): no capacity in the ideal, no rate to measure
    spans = routing.parse_deaths(cfg.emulation.deaths, P, m)
    gone = routing.absent(spans, P, m, cfg.pipeline.pooled)
    st = [
        [0.0 if (j, i) in gone else max(c, x) for j, (c, x) in enumerate(zip(cr, lr))]
        for i, (cr, lr) in enumerate(zip(compute, link_rows))
    ]
    if cfg.pipeline.pooled:  # a stage's cells share its work: its summed speed
        speeds = [[1.0 / st[i][j] if st[i][j] > 0 else 0.0 for i in range(m)] for j in range(P)]
        ideal = tok * routing.pool_bound(speeds)
    else:
        ideal = tok * sum(1.0 / max(row) for row in st if max(row) > 0)
    rate = 0.0
    for i in range(m):
        if (P - 1, i) in gone:
            continue
        r = steps_rows.get((P - 1, i), [])
        ups = steady_rate([x["time_s"] for x in r], [x["step"] for x in r], skip_frac)
        if ups is None:
            rate = math.nan
            break
        rate += ups * mpu * tok
    measured = None if math.isnan(rate) else rate
    steps = min((r["step"] for r in last.values()), default=0)
    per = max(steps, 1) * m
    sent_total: dict[str, int] = {}
    for k, r in last.items():
        for kind, n in final_bytes.get(k, r.get("bytes_sent", {})).items():
            sent_total[kind] = sent_total.get(kind, 0) + n
    names = {k: cell_name(*k) for k in last}
    stale = [0] * P
    for (j, _), r in last.items():
        stale[j] = max(stale[j], int(r.get("staleness_max", 0)))
    return Throughput(
        tokens_per_s=measured,
        ideal_tokens_per_s=ideal,
        fraction_of_ideal=measured / ideal if measured is not None and ideal > 0 else None,
        compute_s=compute,
        link_s=link_rows,
        stage_s=st,
        pp_bytes_per_replica_step=(sent_total.get("activation", 0) + sent_total.get("gradient", 0))
        / per,
        dp_bytes_per_replica_step=sent_total.get("average", 0) / per,
        staleness=stale,
        peak_stash_bytes={names[k]: int(r.get("stash_bytes_peak", 0)) for k, r in last.items()},
        peak_rss_mb={names[k]: float(r.get("rss_peak_mb", 0.0)) for k, r in last.items()},
    )
