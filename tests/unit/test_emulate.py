"""Emulated compute timing, heterogeneous-peer config, in-flight windows, throughput math."""

from __future__ import annotations

import math
import typing

import pytest

from comms.throttle import PROFILES
from mesh.algo.schedule import (
    actions,
    execute,
    extra_warmups,
    inflight_window,
    stage_delay,
    version_for,
    versions_kept,
)
from mesh.config import ConfigError, TransportConfig, load_config, parse_slowdowns
from mesh.runtime.emulate import (
    ComputeClock,
    activation_frame_bytes,
    cell_shaping,
    compute_table,
    emulated_op_s,
    link_profile,
    real_op_s,
    resolve_window,
    slowdown,
    stage_times,
    steady_rate,
    throughput,
    uplink_frames,
    window_of,
)


class FakeTime:
    """A clock that only moves when the code sleeps or we say so."""

    def __init__(self, oversleep: float = 0.0) -> None:
        self.t, self.oversleep, self.sleeps = 100.0, oversleep, []

    def clock(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.t += s + self.oversleep


def test_ops_run_back_to_back_and_host_work_overlaps() -> None:
    ft = FakeTime()
    clk = ComputeClock(ft.clock, ft.sleep)
    d1 = clk.begin(0.010)
    ft.t += 0.002  # the host encodes for 2 ms inside the op's 10 ms
    clk.finish(d1)
    assert ft.t == pytest.approx(100.010)
    ft.t += 0.001  # bookkeeping between ops: the device is already busy with the next op
    d2 = clk.begin(0.020)
    assert d2 == pytest.approx(100.030)  # starts at the previous deadline, not at "now"
    clk.finish(d2)
    assert ft.t == pytest.approx(100.030)
    assert clk.busy_s == pytest.approx(0.030) and clk.ops == 2 and clk.late_s == 0


def test_a_blocking_wait_moves_the_next_start() -> None:
    ft = FakeTime()
    clk = ComputeClock(ft.clock, ft.sleep)
    clk.finish(clk.begin(0.010))
    since = ft.t
    ft.t += 0.050  # a receive that blocked 50 ms
    clk.waited(since)
    assert clk.begin(0.010) == pytest.approx(100.070)
    since = ft.t
    ft.t += 0.0005  # a receive whose message was there: not a wait
    clk.waited(since)
    assert clk.begin(0.010) == pytest.approx(100.080)


def test_host_bound_ops_count_late_time() -> None:
    ft = FakeTime()
    clk = ComputeClock(ft.clock, ft.sleep)
    d = clk.begin(0.010)
    ft.t += 0.015  # the host needed 15 ms for a 10 ms op
    clk.finish(d)
    assert clk.late_s == pytest.approx(0.005) and ft.sleeps == []


def test_oversleep_is_learned_and_bounded() -> None:
    ft = FakeTime(oversleep=0.001)
    clk = ComputeClock(ft.clock, ft.sleep)
    ends = []
    for _ in range(40):
        d = clk.begin(0.010)
        clk.finish(d)
        ends.append(ft.t - d)
    assert ends[0] == pytest.approx(0.001)
    assert abs(ends[-1]) < 1e-4  # wakes early by the learned amount
    ft2 = FakeTime(oversleep=0.050)
    clk2 = ComputeClock(ft2.clock, ft2.sleep, bias_limit_s=0.002)
    for _ in range(20):
        clk2.finish(clk2.begin(0.010))
    assert clk2.bias_s == pytest.approx(0.002)
    with pytest.raises(ValueError):
        clk2.begin(-1.0)


# ---- config ------------------------------------------------------------------------------------


def test_slowdowns_parse_and_name_the_key() -> None:
    assert parse_slowdowns(["s2r0=2.0", " s0r1 = 1.5 "], 4, 2) == {(2, 0): 2.0, (0, 1): 1.5}
    cfg = load_config([], ["emulation.slowdowns=['s2r0=2.0']", "emulation.compute='emulated'"])
    assert slowdown(cfg, 2, 0) == 2.0 and slowdown(cfg, 2, 1) == 1.0
    assert emulated_op_s(cfg, 2, 0) == pytest.approx((0.020, 0.040))
    assert compute_table(cfg)[0] == pytest.approx([0.03, 0.03, 0.06, 0.03])
    bad = {
        "s4r0=2": "not in the 4x2 grid",
        "s0r2=2": "not in the 4x2 grid",
        "s1r1=0": "must be > 0",
        "s1r1=-3": "must be > 0",
        "s1r1=inf": "must be > 0",
        "slow=2": "expected 'sJrI=FACTOR'",
        "s1r1=fast": "expected 'sJrI=FACTOR'",
    }
    for item, msg in bad.items():
        with pytest.raises(ConfigError, match="emulation.slowdowns") as e:
            load_config([], [f"emulation.slowdowns=['{item}']"])
        assert msg in str(e.value)
    with pytest.raises(ConfigError, match="twice"):
        load_config([], ["emulation.slowdowns=['s1r1=2', 's1r1=3']"])
    # a smaller grid: the cell check follows the grid
    with pytest.raises(ConfigError, match="2x2"):
        load_config([], ["grid.stages=2", "grid.replicas=2", "emulation.slowdowns=['s2r0=2']"])


def test_a_real_ops_time_is_its_slowed_cpu_time_and_at_least_the_floor() -> None:
    assert real_op_s(0.010, 1.0, 0.0) == 0.010  # as fast as it runs
    assert real_op_s(0.010, 3.0, 0.0) == pytest.approx(0.030)
    assert real_op_s(0.010, 1.0, 0.050) == 0.050  # a tiny model on a "device" of 50 ms
    assert real_op_s(0.010, 8.0, 0.050) == pytest.approx(0.080)  # the slowdown past the floor
    assert real_op_s(0.010, 0.5, 0.0) == pytest.approx(0.005)  # a faster cell waits for nothing
    assert load_config([], ["emulation.min_compute_ms=40"]).emulation.min_compute_ms == 40
    with pytest.raises(ConfigError, match="emulation.min_compute_ms"):
        load_config([], ["emulation.min_compute_ms=-1"])


def test_link_profiles_match_comms_and_override() -> None:
    names = typing.get_args(TransportConfig.model_fields["link"].annotation)
    assert set(names) - {"none"} == set(PROFILES)
    assert link_profile(load_config([], [])) is None
    wan = link_profile(load_config([], ["transport.link='wan10'"]))
    assert wan is not None and (wan.bandwidth_mbps, wan.latency_ms) == (10.0, 100.0)
    custom = link_profile(
        load_config([], ["transport.link='wan100'", "transport.link_latency_ms=5"])
    )
    assert custom is not None and (custom.bandwidth_mbps, custom.latency_ms) == (100.0, 5.0)
    only_bw = link_profile(load_config([], ["transport.link_bandwidth_mbps=50"]))
    assert only_bw is not None and (only_bw.bandwidth_mbps, only_bw.latency_ms) == (50.0, 0.0)
    with pytest.raises(ConfigError, match="transport.link"):
        load_config([], ["transport.link='wan5'"])
    with pytest.raises(ConfigError, match="transport.link_bandwidth_mbps"):
        load_config([], ["transport.link_bandwidth_mbps=0"])


def test_window_config_is_validated() -> None:
    cfg = load_config([], ["pipeline.window=[3, 2, 1, 0]"])
    assert window_of(cfg) == [3, 2, 1, 0]
    assert window_of(load_config([], [])) is None
    with pytest.raises(ValueError, match="resolve"):
        window_of(load_config([], ["pipeline.window='auto'"]))
    for bad, msg in {
        "[1, 0]": "need 4",
        "[0, 2, 0, 0]": "deadlock",
        "[-1, 0, 0, 0]": ">= 0",
    }.items():
        with pytest.raises(ConfigError, match="pipeline.window") as e:
            load_config([], [f"pipeline.window={bad}"])
        assert msg in str(e.value)
    with pytest.raises(ConfigError, match="schedule = 'async'"):
        load_config([], ["pipeline.window=[1, 0, 0, 0]", "pipeline.schedule='gpipe'"])


# ---- windows in the schedule -----------------------------------------------------------------


@pytest.mark.parametrize("window", [[0, 0, 0, 0], [3, 2, 1, 0], [5, 4, 2, 0], [2, 3, 1, 0]])
def test_window_actions_execute_and_agree_with_version_for(window: list[int]) -> None:
    P, U = 4, 20
    trace = execute("async", P, 1, U, window=window)
    for j in range(P):
        delay = P - 1 - j + window[j]
        assert stage_delay("async", j, P, window) == delay
        assert versions_kept("async", j, P, window) == delay + 1
        for b in range(U):
            v = version_for("async", j, P, b, window)
            assert v == max(0, b - delay)
            assert trace.forward_version[(j, b)] == trace.backward_version[(j, b)] == v
        # steady state holds the whole window in flight
        assert trace.max_in_flight[j] == min(U, delay + 1)
        assert trace.max_versions_held[j] == min(U, delay + 1)
        warm = actions("async", j, P, 1, U, window)
        forwards_before_first_backward = 0
        for a in warm:
            if a.op.name == "BACKWARD":
                break
            forwards_before_first_backward += a.op.name == "FORWARD"
        assert forwards_before_first_backward == delay + 1


def test_no_window_keeps_the_old_schedule() -> None:
    for j in range(4):
        assert actions("async", j, 4, 1, 9) == actions("async", j, 4, 1, 9, None)
        assert actions("async", j, 4, 1, 9) == actions("async", j, 4, 1, 9, [0, 0, 0, 0])
        assert version_for("async", j, 4, 7) == version_for("async", j, 4, 7, None)


def test_inflight_window_with_a_period_and_extra_warmups() -> None:
    compute = [0.03] * 4
    # A3-like: link-bound period 0.21 s, rtt from compute + 2 (P-1-j) (latency + transfer)
    rtt0 = 0.12 + 6 * (0.1 + 0.21)
    assert inflight_window(compute, 0, 0.1, 0.21, 0.21) == math.ceil(rtt0 / 0.21)
    extra = extra_warmups(compute, 0.1, 0.21, 0.21)
    assert extra[0] == math.ceil(rtt0 / 0.21) - 4 and extra[-1] == 0
    assert all(extra[j + 1] <= extra[j] + 1 for j in range(3))
    assert extra_warmups(compute) == [0, 0, 0, 0]


def test_resolve_window_from_the_link() -> None:
    base = [
        "grid.stages=4",
        "grid.replicas=2",
        "model.n_layers=4",
        "model.d_model=128",
        "model.seq_len=128",
        "emulation.compute='emulated'",
        "pipeline.window='auto'",
    ]
    no_link = resolve_window(load_config([], base))
    assert no_link.pipeline.window == [0, 0, 0, 0]
    wan = resolve_window(load_config([], [*base, "transport.link='wan100'"]), headroom=0.0)
    # 256 KiB bf16 frame at 12.5 MB/s = 21 ms, latency 20 ms: rtt_0 = 0.12 + 6 * 0.041
    transfer = 262224 / 12.5e6
    want = math.ceil((0.12 + 6 * (0.02 + transfer)) / 0.03) - 4
    assert wan.pipeline.window[0] == want
    assert wan.pipeline.window[-1] == 0
    roomy = resolve_window(load_config([], [*base, "transport.link='wan100'"]))
    assert roomy.pipeline.window[0] >= want and roomy.pipeline.window[-1] == 0
    sync = resolve_window(load_config([], [*base, "pipeline.schedule='gpipe'"]))
    assert sync.pipeline.window == "none"
    # real compute: the stage times are measured (thread CPU time of forward + backward)
    real = [
        "grid.stages=2",
        "model.n_layers=2",
        "model.d_model=16",
        "model.n_heads=2",
        "model.seq_len=16",
        "pipeline.microbatch_size=2",
        "pipeline.window='auto'",
        "transport.link_latency_ms=1000",
    ]
    w = resolve_window(load_config([], real)).pipeline.window
    assert isinstance(w, list) and w[0] > 0 and w[1] == 0


# ---- throughput accounting --------------------------------------------------------------------


def test_steady_rate_skips_the_warmup() -> None:
    times = [1.0, 1.5, 1.6, 1.7, 1.8, 1.9]  # a slow first interval (fill)
    assert steady_rate(times, list(range(1, 7)), skip_frac=0.2) == pytest.approx(10.0)
    assert steady_rate([1.0], [1]) is None
    assert steady_rate([1.0, 2.0], [1, 3]) == pytest.approx(2.0)


def _rows(cfg, period: dict[int, float], n: int, act: int, avg: int) -> dict:
    """Synthetic metrics rows: replica i's cells step every period[i] seconds."""
    rows = {}
    P, m = cfg.grid.stages, cfg.grid.replicas
    for i in range(m):
        for j in range(P):
            out = []
            for s in range(1, n + 1):
                sent = {"average": avg * s}
                if j < P - 1:
                    sent["activation"] = act * s
                if j > 0:
                    sent["gradient"] = act * s
                out.append(
                    {
                        "step": s,
                        "time_s": s * period[i],
                        "bytes_sent": sent,
                        "microbatches": s,
                        "busy_s": 0.0,
                        "staleness_max": P - 1 - j,
                        "stash_bytes_peak": 1000 * j,
                        "rss_peak_mb": 300.0,
                    }
                )
            out.append({"final": True, "bytes_sent": out[-1]["bytes_sent"]})
            rows[(j, i)] = out
    return rows


def test_fraction_of_ideal_from_rows() -> None:
    cfg = load_config(
        [],
        [
            "grid.stages=2",
            "grid.replicas=2",
            "model.n_layers=2",
            "emulation.compute='emulated'",
            "emulation.slowdowns=['s1r0=2.0']",
            "model.seq_len=16",
            "pipeline.microbatch_size=2",
        ],
    )
    tok = cfg.tokens_per_microbatch
    # replica 0 is 2x slower at stage 1: ideal = tok (1/0.06 + 1/0.03)
    rows = _rows(cfg, {0: 0.06, 1: 0.03}, n=50, act=1000, avg=100)
    tp = throughput(cfg, rows)
    assert tp.ideal_tokens_per_s == pytest.approx(tok * (1 / 0.06 + 1 / 0.03))
    assert tp.fraction_of_ideal == pytest.approx(1.0)
    assert tp.pp_bytes_per_replica_step == pytest.approx(2000)
    assert tp.dp_bytes_per_replica_step == pytest.approx(200)
    assert tp.staleness == [1, 0]
    assert tp.peak_stash_bytes == {"s0r0": 0, "s1r0": 1000, "s0r1": 0, "s1r1": 1000}
    # half speed -> half of ideal
    slow = throughput(cfg, _rows(cfg, {0: 0.12, 1: 0.06}, n=50, act=1000, avg=100))
    assert slow.fraction_of_ideal == pytest.approx(0.5)


def test_a_pooled_grids_ideal_is_its_thinnest_stage() -> None:
    """Stage pools: a stage's cells share its work, so the ideal is the slowest stage's summed
    speed (routing.pool_bound), not each replica at its slowest cell."""
    cfg = load_config(
        [],
        [
            "grid.stages=2",
            "grid.replicas=2",
            "model.n_layers=2",
            "emulation.compute='emulated'",
            "emulation.slowdowns=['s1r0=2.0']",
            "model.seq_len=16",
            "pipeline.microbatch_size=2",
            "pipeline.routing='pools'",
        ],
    )
    tok, t = cfg.tokens_per_microbatch, 0.03  # a cell's forward + backward at speed 1
    tp = throughput(cfg, _rows(cfg, {0: 0.045, 1: 0.045}, n=50, act=1000, avg=100))
    # stage 0: 1/t + 1/t; stage 1: 1/(2t) + 1/t, the thinner: 1.5 / t microbatches a second
    assert tp.ideal_tokens_per_s == pytest.approx(tok * 1.5 / t)
    assert tp.fraction_of_ideal == pytest.approx((2 / 0.045) / (1.5 / t))


def test_a_slow_link_sets_the_stage_time() -> None:
    cfg = load_config(
        [],
        [
            "grid.stages=2",
            "grid.replicas=1",
            "model.n_layers=2",
            "emulation.compute='emulated'",
            "transport.link_bandwidth_mbps=8",
        ],
    )
    # 100 kB per microbatch at 1 MB/s = 0.1 s > 0.03 s compute
    tp = throughput(cfg, _rows(cfg, {0: 0.1}, n=20, act=100_000, avg=0))
    assert tp.link_s[0] == pytest.approx([0.1, 0.1])
    assert tp.stage_s[0] == pytest.approx([0.1, 0.1])
    assert tp.fraction_of_ideal == pytest.approx(1.0)
    assert stage_times([[0.03, 0.03]], 0.1) == [[0.1, 0.1]]
    assert stage_times([[0.03, 0.03]], {(1, 0): 0.05}) == [[0.03, 0.05]]


def test_bench_predictions_follow_the_reference_table() -> None:
    """The schedule formulas with this repo's link model: the A1-A4 ratios are at least the
    reference's (whose parentheses leave out activation transfer and latency)."""
    from mesh.bench.throughput.analysis import predictions, stage_params
    from mesh.bench.throughput.protocol import BENCH_SETS, GRIDS, grid_config, method_configs

    base = load_config([], BENCH_SETS)
    want = {"A1": 2.2, "A2": 2.3, "A3": 7.0 * 0.6, "A4": 2.5}  # A3: both are link-bound here
    for g in GRIDS:
        cfg = grid_config(base, g)
        cfgs = method_configs(cfg)
        pred = predictions(cfgs, stage_params(cfg))
        assert pred["ratio"] >= want[g.id], (g.id, pred["ratio"])
        assert pred["AsyncMesh"]["fraction_of_ideal"] == pytest.approx(1.0)
        assert cfgs["FullSync"].pipeline.window == "none"
        assert (
            pred["AsyncMesh"]["dp_bytes_per_replica_step"]
            < pred["FullSync"]["dp_bytes_per_replica_step"] / 70
        )  # 5% fp8 vs fp32: ~78x fewer bytes


def test_link_config_files_spell_out_their_profiles() -> None:
    from pathlib import Path

    configs = Path(__file__).resolve().parents[2] / "configs"
    files = sorted((configs / "links").glob("*.toml"))
    assert {f.stem for f in files} == set(PROFILES)
    for f in files:
        profile = link_profile(load_config([configs / "tiny.toml", f], []))
        assert profile is not None
        want = PROFILES[f.stem]
        assert (profile.bandwidth_mbps, profile.latency_ms) == (
            want.bandwidth_mbps,
            want.latency_ms,
        )


def test_a_shared_uplink_carries_a_cells_pipeline_frames_together() -> None:
    base = [
        "grid.stages=3",
        "grid.replicas=2",
        "model.n_layers=3",
        "emulation.compute='emulated'",
        "transport.link_bandwidth_mbps=8",
        "transport.link_latency_ms=10",
    ]
    plain = load_config([], base)
    assert cell_shaping(plain, 1, 0) == link_profile(plain)  # every link its own bandwidth
    pipe = load_config([], [*base, "transport.link_shared='pipeline'"])
    shaping = cell_shaping(pipe, 1, 0)
    assert isinstance(shaping, dict) and set(shaping) == {"s0r0", "s2r0", "s0r1", "s1r1", "s2r1"}
    assert shaping["s0r0"].uplink == shaping["s2r0"].uplink == "s1r0"  # its two neighbours
    assert shaping["s1r1"].uplink == "" and shaping["s1r1"].bandwidth_mbps == 8.0  # averaging
    assert all(p.latency_ms == 10.0 for p in shaping.values())
    every = cell_shaping(load_config([], [*base, "transport.link_shared='all'"]), 1, 0)
    assert {p.uplink for p in every.values()} == {"s1r0"}
    assert [uplink_frames(pipe, j) for j in range(3)] == [1, 2, 1]
    assert [uplink_frames(plain, j) for j in range(3)] == [1, 1, 1]
    # accounting: a middle stage's link time is both frames over the one uplink
    tp = throughput(pipe, _rows(pipe, {0: 0.2, 1: 0.2}, n=20, act=100_000, avg=5_000))
    assert tp.link_s[0] == pytest.approx([0.1, 0.2, 0.1])
    assert throughput(plain, _rows(plain, {0: 0.2, 1: 0.2}, n=20, act=100_000, avg=0)).link_s[
        0
    ] == pytest.approx([0.1, 0.1, 0.1])
    all_cfg = load_config([], [*base, "transport.link_shared='all'"])
    tp = throughput(all_cfg, _rows(all_cfg, {0: 0.2, 1: 0.2}, n=20, act=100_000, avg=5_000))
    assert tp.link_s[0] == pytest.approx([0.105, 0.205, 0.105])
    # the window: a hop may wait behind the other direction's frame, and the period holds both
    w = ["model.d_model=128", "model.seq_len=128", "pipeline.window='auto'"]
    shared = load_config([], [*base, *w, "transport.link_shared='pipeline'"])
    transfer = 2 * activation_frame_bytes(shared) / 1e6
    row = compute_table(shared)[0]
    want = extra_warmups(row, 0.01 * 1.25, transfer * 1.25, max(max(row), transfer))
    assert resolve_window(shared, headroom=0.25).pipeline.window == want
